"""The functions and triggers of `upgrade head` are those db/sql/*.sql defines, text for text.

The comparison is PostgreSQL's own: in a transaction rolled back afterwards, every function
and trigger of the migrated database is dropped and the files are run; what the catalog then
renders (`pg_get_functiondef`, `pg_get_triggerdef`) must be what it rendered before. A
function or trigger that a migration made and no file defines, or that differs from its file
by a character, fails the test with its name.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from alembic import command
from alembic.script import ScriptDirectory

from tests import pg

SQL_DIR = pg.ROOT / "db" / "sql"

# Ours: functions of the public schema that no extension owns; triggers not made for a
# constraint.
FUNCTIONS = """
SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid)
FROM pg_proc p
WHERE p.pronamespace = 'public'::regnamespace
  AND NOT EXISTS (SELECT FROM pg_depend d
                  WHERE d.classid = 'pg_proc'::regclass AND d.objid = p.oid AND d.deptype = 'e')
"""
TRIGGERS = """
SELECT t.tgrelid::regclass || '.' || t.tgname, pg_get_triggerdef(t.oid)
FROM pg_trigger t
WHERE NOT t.tgisinternal
"""

Definitions = dict[str, str]


def sql_files() -> list[str]:
    """The text of every file of db/sql, in name order."""
    return [path.read_text() for path in sorted(SQL_DIR.glob("*.sql"))]


def definitions(conn: psycopg.Connection[tuple[str, str]]) -> tuple[Definitions, Definitions]:
    """Every function and trigger of ours, by signature or `table.name`, as PostgreSQL renders."""
    functions = dict(conn.execute(FUNCTIONS).fetchall())
    triggers = dict(conn.execute(TRIGGERS).fetchall())
    return functions, triggers


@pytest.fixture(scope="module")
def head_url(server: pg.TestServer) -> Iterator[str]:
    """A libpq URL of a database migrated to head, for tests that roll back what they do."""
    name = server.create_from_template("fairq_test_schema_sql")
    yield pg.libpq(server.url(name))
    server.drop(name)


@pytest.fixture
def head(head_url: str) -> Iterator[psycopg.Connection[tuple[str, str]]]:
    """A connection to the migrated database whose transaction is rolled back afterwards."""
    with psycopg.connect(head_url) as conn:
        yield conn
        conn.rollback()


@pytest.fixture
def empty_db_url(server: pg.TestServer) -> Iterator[str]:
    """URL of a new database with no schema at all, dropped after the test."""
    name = server.create_empty()
    yield server.url(name)
    server.drop(name)


def test_every_function_and_trigger_after_upgrade_head_is_the_one_db_sql_defines(
    head: psycopg.Connection[tuple[str, str]],
) -> None:
    functions, triggers = definitions(head)
    assert functions
    assert triggers
    for name in triggers:
        table, trigger = name.rsplit(".", 1)
        head.execute(f'DROP TRIGGER "{trigger}" ON {table}')
    for signature in functions:
        # CASCADE: a column default calls fairq_uuidv7(); the files do not set defaults.
        head.execute(f"DROP FUNCTION {signature} CASCADE")
    for sql in sql_files():
        head.execute(sql)

    loaded_functions, loaded_triggers = definitions(head)

    assert sorted(functions.keys() - loaded_functions.keys()) == [], "no file defines these"
    assert sorted(triggers.keys() - loaded_triggers.keys()) == [], "no file defines these"
    assert {n: d for n, d in loaded_functions.items() if functions.get(n) != d} == {}
    assert {n: d for n, d in loaded_triggers.items() if triggers.get(n) != d} == {}


def test_the_files_run_again_over_the_head_schema_and_change_nothing(
    head: psycopg.Connection[tuple[str, str]],
) -> None:
    """Each file is re-runnable: the next migration that changes one re-runs it on a live schema."""
    before = definitions(head)
    for sql in sql_files():
        head.execute(sql)

    assert definitions(head) == before


def test_the_runnable_predicate_is_planned_as_if_written_out(
    head: psycopg.Connection[tuple[str, str]],
) -> None:
    """`fairq_runnable` is inlined: a range of the pending index, and no call left in the plan.

    Were it not (declared STRICT, or in PL/pgSQL), every statement that reads runnable tasks
    would filter them one by one after reading the company's whole pending range.
    """
    plan = "\n".join(
        str(row[0])
        for row in head.execute(
            "EXPLAIN (COSTS OFF) SELECT t.run_after FROM tasks t "
            "WHERE t.company_id = gen_random_uuid() AND fairq_runnable(t, now()) "
            "ORDER BY t.run_after LIMIT 1"
        )
    )

    assert "ix_tasks_pending_company_run_after" in plan
    assert "run_after <= now()" in plan
    assert "fairq_runnable" not in plan


def test_migration_0012_changes_only_the_claim_and_downgrades_to_0011(
    empty_db_url: str,
) -> None:
    """0012 runs the files: the runnable predicate is new, the claim calls it, all else stays.

    So the files' other functions and triggers are, text for text, those migrations 0003 to
    0011 made; a file changed without a migration that re-runs it fails here.
    """
    config = pg.alembic_config(empty_db_url)
    # 0011 until branches of the same day are merged in between.
    before_0012 = ScriptDirectory.from_config(config).get_revision("0012").down_revision
    assert isinstance(before_0012, str)
    command.upgrade(config, before_0012)
    with psycopg.connect(pg.libpq(empty_db_url)) as conn:
        at_0011 = definitions(conn)

    command.upgrade(config, "0012")
    with psycopg.connect(pg.libpq(empty_db_url)) as conn:
        at_0012 = definitions(conn)
    command.downgrade(config, before_0012)
    with psycopg.connect(pg.libpq(empty_db_url)) as conn:
        downgraded = definitions(conn)

    changed = {
        name
        for name in at_0011[0].keys() | at_0012[0].keys()
        if at_0011[0].get(name) != at_0012[0].get(name)
    }
    runnable = "fairq_runnable(tasks,timestamp with time zone)"
    assert changed == {"fairq_claim(text,integer)", runnable}
    assert at_0012[1] == at_0011[1]
    assert downgraded == at_0011
