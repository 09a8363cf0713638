"""Alembic owns the schema; the models mirror it exactly (design §2, STACK "Alembic").

`alembic check` compares tables, columns, indexes and unique/foreign keys, but not
partial-index predicates, INCLUDE columns or CHECK constraints: those are compared here by
letting PostgreSQL itself render what the models declare next to what the migrations built.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from alembic import command
from alembic.script import ScriptDirectory
from marshmallow import ValidationError
from sqlalchemy import CheckConstraint, Connection, Engine, Index, pool, text
from sqlalchemy.schema import AddConstraint, CreateIndex

from db import api_keys, models
from db.engine import make_engine
from db.models import DEFAULT_TIMEOUT_SECONDS
from tests import pg
from worker import tasktypes

# The "model" twin of a schema object is created next to the real one under this suffix.
TWIN = "__model"

SCHEMA_SNAPSHOT = text(
    """
    SELECT 'column', table_name || '.' || column_name,
           concat_ws(' ', data_type, is_nullable, column_default)
      FROM information_schema.columns WHERE table_schema = 'public'
    UNION ALL
    SELECT 'index', indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'
    UNION ALL
    SELECT 'constraint', conrelid::regclass || '.' || conname, pg_get_constraintdef(oid)
      FROM pg_constraint WHERE connamespace = 'public'::regnamespace
    UNION ALL
    SELECT 'trigger', tgrelid::regclass || '.' || tgname, pg_get_triggerdef(oid)
      FROM pg_trigger WHERE NOT tgisinternal
    UNION ALL
    SELECT 'function', proname, md5(prosrc)
      FROM pg_proc WHERE pronamespace = 'public'::regnamespace
    UNION ALL
    SELECT 'sequence', sequencename, concat_ws(' ', data_type, start_value, increment_by)
      FROM pg_sequences WHERE schemaname = 'public'
    ORDER BY 1, 2
    """
)


@contextmanager
def connect(url: str) -> Iterator[Connection]:
    """A connection to `url` from an unpooled engine disposed afterwards."""
    engine = make_engine(url, application_name="fairq-tests", poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        engine.dispose()


def snapshot(url: str) -> list[tuple[str, str, str]]:
    """Every column, index and constraint of the public schema, as PostgreSQL renders them."""
    with connect(url) as conn:
        return [
            (kind, name, definition) for kind, name, definition in conn.execute(SCHEMA_SNAPSHOT)
        ]


def url_of(engine: Engine) -> str:
    """The URL `engine` connects to, password included."""
    return engine.url.render_as_string(hide_password=False)


def head_revision(url: str) -> str:
    """The head revision of the migration scripts."""
    head = ScriptDirectory.from_config(pg.alembic_config(url)).get_current_head()
    assert head is not None
    return head


def model_indexes() -> list[Index]:
    """Every index the models declare, by name.

    In name order: a table's indexes are a set, and every test process (pytest-xdist's
    workers) must collect the same tests in the same order.
    """
    indexes = [index for table in models.Base.metadata.sorted_tables for index in table.indexes]
    return sorted(indexes, key=lambda index: str(index.name))


def model_checks() -> list[CheckConstraint]:
    """Every CHECK constraint the models declare, by name (as `model_indexes`)."""
    checks = [
        constraint
        for table in models.Base.metadata.sorted_tables
        for constraint in table.constraints
        if isinstance(constraint, CheckConstraint)
    ]
    return sorted(checks, key=lambda check: str(check.name))


@pytest.fixture(scope="module")
def migrated_engine(server: pg.TestServer) -> Iterator[Engine]:
    """Engine on one migrated database shared by this module's read-only comparisons."""
    name = server.create_from_template("fairq_test_migrations")
    engine = make_engine(server.url(name), application_name="fairq-tests", poolclass=pool.NullPool)
    yield engine
    engine.dispose()
    server.drop(name)


@pytest.fixture
def empty_db_url(server: pg.TestServer) -> Iterator[str]:
    """URL of a new database with no schema at all, dropped after the test."""
    name = server.create_empty()
    yield server.url(name)
    server.drop(name)


def test_a_migrated_database_is_at_the_head_revision(
    migrated_engine: Engine,
) -> None:
    with migrated_engine.connect() as conn:
        versions = conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all()

    assert versions == [head_revision(url_of(migrated_engine))]


def test_downgrade_base_then_upgrade_head_round_trips(
    empty_db_url: str, migrated_engine: Engine
) -> None:
    migrated_url = url_of(migrated_engine)
    config = pg.alembic_config(empty_db_url)
    command.upgrade(config, "head")
    assert snapshot(empty_db_url) == snapshot(migrated_url)

    command.downgrade(config, "base")
    with connect(empty_db_url) as conn:
        tables = conn.execute(
            text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        ).scalars()
        assert set(tables) == {"alembic_version"}
        assert conn.execute(text("SELECT count(*) FROM alembic_version")).scalar_one() == 0

    command.upgrade(config, "head")
    assert snapshot(empty_db_url) == snapshot(migrated_url)


# Migration 0003 keeps `company_queues` true whatever writes `tasks` (db/models.py
# `CompanyQueue`), and 0006 `company_backlogs` (`CompanyBacklog`): these triggers, and the
# functions they run, are part of the schema.
FAIR_CLAIM_TRIGGERS = {
    ("companies", "companies_add_queue", "fairq_add_company_queue"),
    ("companies", "companies_copy_limits", "fairq_copy_company_limits"),
    ("tasks", "tasks_pending_inserted", "fairq_note_pending_inserted"),
    ("tasks", "tasks_pending_updated", "fairq_note_pending_updated"),
}
BACKLOG_TRIGGERS = {
    ("companies", "companies_add_backlog", "fairq_add_company_backlog"),
    ("tasks", "tasks_count_inserted", "fairq_count_inserted"),
    ("tasks", "tasks_count_updated", "fairq_count_updated"),
    ("tasks", "tasks_count_deleted", "fairq_count_deleted"),
    ("tasks", "tasks_count_truncated", "fairq_zero_backlogs"),
}

TRIGGERS = text(
    """
    SELECT t.tgrelid::regclass::text, t.tgname, p.proname
    FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid
    WHERE NOT t.tgisinternal AND t.tgenabled = 'O'
    """
)


def test_the_fair_claim_triggers_exist_and_are_enabled_after_upgrade(
    migrated_engine: Engine,
) -> None:
    with migrated_engine.connect() as conn:
        triggers = {tuple(row) for row in conn.execute(TRIGGERS)}

    assert triggers == FAIR_CLAIM_TRIGGERS | BACKLOG_TRIGGERS


def test_downgrading_the_fair_claim_removes_its_triggers_functions_and_tables(
    empty_db_url: str,
) -> None:
    config = pg.alembic_config(empty_db_url)
    command.upgrade(config, "0003")
    command.downgrade(config, "0002")

    with connect(empty_db_url) as conn:
        assert list(conn.execute(TRIGGERS)) == []
        functions = conn.execute(
            text("SELECT proname FROM pg_proc WHERE pronamespace = 'public'::regnamespace")
        ).scalars()
        assert list(functions) == []
        leftovers = conn.execute(
            text(
                "SELECT relname FROM pg_class WHERE relnamespace = 'public'::regnamespace "
                "AND relname IN ('company_queues', 'claim_cursor', 'company_ring_positions')"
            )
        ).scalars()
        assert list(leftovers) == []
        columns = conn.execute(
            text(
                "SELECT column_name FROM information_schema.columns "
                "WHERE table_name = 'companies' AND column_name IN ('weight', 'max_in_flight')"
            )
        ).scalars()
        assert list(columns) == []


RELOPTIONS = text(
    """
    SELECT relname, reloptions FROM pg_class
    WHERE relnamespace = 'public'::regnamespace AND reloptions IS NOT NULL
    """
)


def test_the_queue_tables_carry_their_autovacuum_settings_and_downgrade_resets_them(
    empty_db_url: str,
) -> None:
    config = pg.alembic_config(empty_db_url)
    command.upgrade(config, "0005")
    with connect(empty_db_url) as conn:
        options = {name: set(values) for name, values in conn.execute(RELOPTIONS)}
    assert "autovacuum_vacuum_scale_factor=0.01" in options["tasks"]
    assert "autovacuum_analyze_threshold=5000" in options["tasks"]
    assert "autovacuum_vacuum_threshold=1000" in options["company_queues"]
    assert "autovacuum_vacuum_threshold=1000" in options["claim_cursor"]

    command.downgrade(config, "0004")
    with connect(empty_db_url) as conn:
        assert list(conn.execute(RELOPTIONS)) == []


def test_alembic_check_finds_no_difference_between_models_and_migrations(
    migrated_engine: Engine,
) -> None:
    command.check(pg.alembic_config(url_of(migrated_engine)))  # raises AutogenerateDiffsDetected


def test_every_index_in_the_database_is_declared_on_the_models(migrated_engine: Engine) -> None:
    with migrated_engine.connect() as conn:
        plain_indexes = conn.execute(
            text(
                """
                SELECT indexname FROM pg_indexes WHERE schemaname = 'public'
                   AND tablename <> 'alembic_version'
                EXCEPT SELECT conname FROM pg_constraint WHERE contype IN ('p', 'u', 'x')
                """
            )
        ).scalars()

        assert set(plain_indexes) == {str(index.name) for index in model_indexes()}


@pytest.mark.parametrize("index", model_indexes(), ids=lambda index: str(index.name))
def test_index_definition_including_its_predicate_matches_the_model(
    migrated_engine: Engine, index: Index
) -> None:
    name = str(index.name)
    ddl = str(CreateIndex(index).compile(dialect=migrated_engine.dialect))
    assert f"INDEX {name} ON" in ddl, ddl
    with migrated_engine.connect() as conn, conn.begin() as transaction:
        conn.execute(text(ddl.replace(f"INDEX {name} ON", f"INDEX {name}{TWIN} ON", 1)))
        definitions: dict[str, str] = dict(
            conn.execute(
                text("SELECT indexname, indexdef FROM pg_indexes WHERE indexname = ANY(:names)"),
                {"names": [name, name + TWIN]},
            ).all()
        )
        transaction.rollback()

    assert name in definitions, f"{name} is declared on the models but no migration creates it"
    declared = definitions[name + TWIN].replace(name + TWIN, name, 1)
    assert definitions[name] == declared


@pytest.mark.parametrize("check", model_checks(), ids=lambda check: str(check.name))
def test_check_constraint_matches_the_model(
    migrated_engine: Engine, check: CheckConstraint
) -> None:
    name = str(check.name)
    ddl = str(AddConstraint(check).compile(dialect=migrated_engine.dialect))
    assert f"CONSTRAINT {name} CHECK" in ddl, ddl
    with migrated_engine.connect() as conn, conn.begin() as transaction:
        conn.execute(text(ddl.replace(f"CONSTRAINT {name} ", f"CONSTRAINT {name}{TWIN} ", 1)))
        definitions: dict[str, str] = dict(
            conn.execute(
                text(
                    "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint"
                    " WHERE conname = ANY(:names)"
                ),
                {"names": [name, name + TWIN]},
            ).all()
        )
        transaction.rollback()

    assert name in definitions, f"{name} is declared on the models but no migration creates it"
    assert definitions[name] == definitions[name + TWIN]


def test_task_ids_are_uuid_version_7_in_creation_order(migrated_engine: Engine) -> None:
    """`fairq_uuidv7()` (migration 0008): RFC 9562 version 7, Unix milliseconds first.

    Ids made a few milliseconds apart sort in the order they were made; each carries the
    clock's time in its first 48 bits, and the rest stays random.
    """
    with migrated_engine.connect() as conn:
        now_ms, ids = conn.execute(
            text(
                "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000), "
                "       array_agg(id ORDER BY n) "
                "FROM (SELECT n, fairq_uuidv7() AS id, pg_sleep(0.002) "
                "      FROM generate_series(1, 5) n) made"
            )
        ).one()
        default = conn.execute(
            text(
                "SELECT column_default FROM information_schema.columns "
                "WHERE table_name = 'tasks' AND column_name = 'id'"
            )
        ).scalar_one()

    assert default == "fairq_uuidv7()"
    assert [u.version for u in ids] == [7] * 5
    assert {u.variant for u in ids} == {uuid.RFC_4122}
    assert ids == sorted(ids)
    assert len({u.int & ((1 << 74) - 1) for u in ids}) == 5  # the random bits differ
    for made in ids:
        assert abs(int.from_bytes(made.bytes[:6], "big") - int(now_ms)) < 60_000


def test_the_listing_index_migration_lets_writes_go_on_while_it_builds(
    empty_db_url: str,
) -> None:
    """Migration 0009 builds and drops its indexes CONCURRENTLY: writes to `tasks` go on.

    A writer's transaction open at the start makes the build wait for it (as CREATE INDEX
    CONCURRENTLY does); meanwhile, inserts, a claim-like update and a delete on other
    connections, each under a short `lock_timeout`, are not blocked by the migration.
    """
    config = pg.alembic_config(empty_db_url)
    command.upgrade(config, "0008")
    with connect(empty_db_url) as conn:
        # Two companies: concurrent inserts of one company queue on its backlog counter.
        held, company = conn.execute(
            text(
                "INSERT INTO companies (name, api_key_hash) VALUES ('a', 'ha'), ('b', 'hb') "
                "RETURNING id"
            )
        ).scalars()
        conn.commit()
    insert = text(
        "INSERT INTO tasks (company_id, type, payload) VALUES (:c, 'noop', '{}') RETURNING id"
    )
    with connect(empty_db_url) as holder, connect(empty_db_url) as writer:
        holder.execute(insert, {"c": held})  # left open: the build waits for it
        migration = threading.Thread(target=command.upgrade, args=(config, "0009"))
        migration.start()
        try:
            deadline = time.monotonic() + 10
            while not _waiting_for_a_transaction(writer, "CREATE INDEX CONCURRENTLY"):
                assert time.monotonic() < deadline, "the migration never started its build"
                time.sleep(0.02)
            writer.execute(text("SET lock_timeout = '2s'"))
            task = writer.execute(insert, {"c": company}).scalar_one()
            writer.execute(
                text("UPDATE tasks SET status = 'processing' WHERE id = :id"), {"id": task}
            )
            writer.execute(text("DELETE FROM tasks WHERE id = :id"), {"id": task})
            writer.commit()
        finally:
            holder.commit()
            migration.join(30)
    assert not migration.is_alive()
    with connect(empty_db_url) as conn:
        listing = conn.execute(
            text(
                "SELECT indexname FROM pg_indexes WHERE indexname LIKE 'ix_tasks_company_listing%'"
            )
        ).scalars()
        assert list(listing) == ["ix_tasks_company_listing_unleased"]
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == "0009"


def _waiting_for_a_transaction(conn: Connection, statement: str) -> bool:
    """Whether a session running `statement` waits for another transaction to end."""
    waiting = conn.execute(
        text(
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE :statement "
            "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
        ),
        {"statement": f"%{statement}%"},
    ).scalar_one()
    conn.rollback()
    return bool(waiting)


COUNT_INSERTED_SOURCE = text(
    "SELECT md5(prosrc) FROM pg_proc WHERE proname = 'fairq_count_inserted'"
)


def test_the_insert_count_migration_downgrades_to_0006s_function(empty_db_url: str) -> None:
    """Migration 0010 replaces `fairq_count_inserted()`'s body; its downgrade puts 0006's back."""
    config = pg.alembic_config(empty_db_url)
    command.upgrade(config, "0009")
    with connect(empty_db_url) as conn:
        before = conn.execute(COUNT_INSERTED_SOURCE).scalar_one()

    command.upgrade(config, "0010")
    with connect(empty_db_url) as conn:
        upgraded = conn.execute(COUNT_INSERTED_SOURCE).scalar_one()
    command.downgrade(config, "0009")
    with connect(empty_db_url) as conn:
        downgraded = conn.execute(COUNT_INSERTED_SOURCE).scalar_one()

    assert upgraded != before
    assert downgraded == before


CLAIM_CURSOR = text("SELECT ring_position, credit FROM claim_cursor")
CURSOR_SEQUENCES = text(
    "SELECT p.last_value, k.last_value "
    "FROM fairq_claim_cursor_position p, fairq_claim_cursor_credit k"
)


def test_migration_0011_carries_the_claim_cursor_into_its_sequences_and_back(
    empty_db_url: str,
) -> None:
    """The cursor moves from the table `claim_cursor` to two sequences, and back on downgrade.

    Where the claim stopped survives both ways; the downgrade restores the table's autovacuum
    settings of migration 0005 too.
    """
    config = pg.alembic_config(empty_db_url)
    command.upgrade(config, "0010")
    with connect(empty_db_url) as conn:
        conn.execute(text("UPDATE claim_cursor SET ring_position = 42, credit = 3"))
        conn.commit()

    command.upgrade(config, "0011")
    with connect(empty_db_url) as conn:
        assert tuple(conn.execute(CURSOR_SEQUENCES).one()) == (42, 3)
        conn.execute(
            text(
                "SELECT setval('fairq_claim_cursor_position', 57), "
                "setval('fairq_claim_cursor_credit', 1)"
            )
        )
        conn.commit()

    command.downgrade(config, "0010")
    with connect(empty_db_url) as conn:
        assert tuple(conn.execute(CLAIM_CURSOR).one()) == (57, 1)
        options: dict[str, list[str]] = dict(conn.execute(RELOPTIONS).all())
        sequences = conn.execute(
            text("SELECT sequencename FROM pg_sequences WHERE sequencename LIKE 'fairq_claim%'")
        ).all()
    assert "autovacuum_vacuum_threshold=1000" in options["claim_cursor"]
    assert sequences == []


def test_the_api_keys_migration_keeps_every_company_key_working_and_downgrades(
    empty_db_url: str,
) -> None:
    """Migration 0014 moves `companies.api_key_hash` into `api_keys`; its downgrade gives each
    company back its newest active key."""
    config = pg.alembic_config(empty_db_url)
    command.upgrade(config, "0014-1")
    with connect(empty_db_url) as conn:
        ids: dict[str, uuid.UUID] = dict(
            conn.execute(
                text(
                    "INSERT INTO companies (name, api_key_hash) VALUES ('a', 'ha'), ('b', 'hb') "
                    "RETURNING api_key_hash, id"
                )
            ).all()
        )
        conn.commit()

    command.upgrade(config, "0014")
    with connect(empty_db_url) as conn:
        keys = conn.execute(
            text(
                "SELECT k.key_hash, k.company_id, k.created_at = c.created_at, k.revoked_at, "
                "k.expires_at FROM api_keys k JOIN companies c ON c.id = k.company_id"
            )
        ).all()
        assert sorted(keys) == sorted(
            (key_hash, company_id, True, None, None) for key_hash, company_id in ids.items()
        )
        driver = conn.connection.driver_connection
        assert isinstance(driver, psycopg.Connection)
        found = api_keys.find_active_key(driver, "ha")
        assert found is not None
        assert found.company_id == ids["ha"]
        # A second key for `a`, newer: the one the downgrade keeps; `b`'s only key is revoked.
        conn.execute(
            text("INSERT INTO api_keys (company_id, key_hash) VALUES (:id, 'ha2')"),
            {"id": ids["ha"]},
        )
        conn.execute(text("UPDATE api_keys SET revoked_at = now() WHERE key_hash = 'hb'"))
        conn.commit()

    command.downgrade(config, "0014-1")
    with connect(empty_db_url) as conn:
        kept: dict[uuid.UUID, str] = dict(
            conn.execute(text("SELECT id, api_key_hash FROM companies")).all()
        )
    assert kept == {ids["ha"]: "ha2", ids["hb"]: "hb"}


def test_the_timeout_migration_gives_each_old_task_its_types_default(empty_db_url: str) -> None:
    """Migration 0016 fills the timeouts tasks older than 0006 lack, as each type's default
    (`TaskType.default_timeout`) computes them, and makes the column NOT NULL, default 60."""
    config = pg.alembic_config(empty_db_url)
    command.upgrade(config, "0015")
    old: dict[str, tuple[str, dict[str, Any]]] = {
        "sleep": ("sleep", {"seconds": 1.5}),
        "unreadable sleep": ("sleep", {}),
        "webhook": ("webhook", {"url": "https://example.com"}),
        "send_email": ("send_email", {"to": "a@example.com", "subject": "s"}),
        "noop": ("noop", {}),
    }
    with connect(empty_db_url) as conn:
        company = conn.execute(
            text("INSERT INTO companies (name) VALUES ('old') RETURNING id")
        ).scalar_one()
        ids = {
            name: conn.execute(
                text(
                    "INSERT INTO tasks (company_id, type, payload) "
                    "VALUES (:company, :type, CAST(:payload AS jsonb)) RETURNING id"
                ),
                {"company": company, "type": task_type, "payload": json.dumps(payload)},
            ).scalar_one()
            for name, (task_type, payload) in old.items()
        }
        conn.commit()

    command.upgrade(config, "0016")
    with connect(empty_db_url) as conn:
        stored: dict[uuid.UUID, int] = dict(
            conn.execute(text("SELECT id, timeout_seconds FROM tasks")).all()
        )
        new = conn.execute(
            text(
                "INSERT INTO tasks (company_id, type, payload) "
                "VALUES (:company, 'noop', '{}') RETURNING timeout_seconds"
            ),
            {"company": company},
        ).scalar_one()
        conn.commit()
    expected: dict[str, int] = {}
    for name, (task_type, payload) in old.items():
        registered = tasktypes.get(task_type)
        assert registered is not None
        try:
            expected[name] = registered.default_timeout(registered.load_payload(payload))
        except ValidationError:
            expected[name] = DEFAULT_TIMEOUT_SECONDS
    assert {name: stored[ids[name]] for name in old} == expected
    assert new == DEFAULT_TIMEOUT_SECONDS

    command.downgrade(config, "0015")
    with connect(empty_db_url) as conn:
        conn.execute(
            text("INSERT INTO tasks (company_id, type, payload) VALUES (:company, 'noop', '{}')"),
            {"company": company},
        )
        nulls = conn.execute(
            text("SELECT count(*) FROM tasks WHERE timeout_seconds IS NULL")
        ).scalar_one()
    assert nulls == 1  # the column takes NULL again; the filled values stay
