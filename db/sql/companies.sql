-- The table `companies`: what PostgreSQL itself does when a company is written. Each
-- company has a row in `company_queues` (the claim's view of it, db/models.py
-- `CompanyQueue`) and one in `company_backlogs` (its count of unfinished tasks, `CompanyBacklog`),
-- made by the triggers below, whoever inserts the company.
--
--   INSERT                                  companies_add_queue, companies_add_backlog
--   UPDATE OF weight, max_in_flight, paused companies_copy_limits
--
-- Changing this file needs a migration that re-runs it (db/sql/README.md).

-- The company's row in the claim's view, with copies of its limits (the claim reads them
-- with the ring, without a join). Migration 0003.
CREATE OR REPLACE FUNCTION fairq_add_company_queue() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO company_queues (company_id, weight, max_in_flight)
    VALUES (NEW.id, NEW.weight, NEW.max_in_flight);
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER companies_add_queue AFTER INSERT ON companies
FOR EACH ROW EXECUTE FUNCTION fairq_add_company_queue();

-- The company's backlog counter, at 0. Migration 0006.
CREATE OR REPLACE FUNCTION fairq_add_company_backlog() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO company_backlogs (company_id) VALUES (NEW.id);
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER companies_add_backlog AFTER INSERT ON companies
FOR EACH ROW EXECUTE FUNCTION fairq_add_company_backlog();

-- Copies the limits and the pause into the claim's view. Pausing also takes the company out
-- of the ring at once (the API's pause also takes the claimers' lock before it commits:
-- db/companies.py `pause_company`). Migration 0006.
CREATE OR REPLACE FUNCTION fairq_copy_company_limits() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE company_queues
    SET weight = NEW.weight, max_in_flight = NEW.max_in_flight, paused = NEW.paused,
        ready = ready AND NOT NEW.paused
    WHERE company_id = NEW.id;
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER companies_copy_limits AFTER UPDATE OF weight, max_in_flight, paused
ON companies FOR EACH ROW EXECUTE FUNCTION fairq_copy_company_limits();
