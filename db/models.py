"""Tables of fairq (design §2), mirrored from the Alembic migrations.

`alembic check` proves these models and the migrations agree, except for partial-index
predicates, which `tests/test_migrations.py` compares against `pg_indexes` itself.
"""

from __future__ import annotations

import datetime as dt
import enum
import uuid
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    ForeignKey,
    Index,
    MetaData,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, TIMESTAMP, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class TaskStatus(enum.StrEnum):
    """The states of a task (design §4).

    pending -> processing -> completed | failed | pending (retry, release);
    pending -> cancelled; failed | cancelled -> pending (retry through the API).
    """

    PENDING = "pending"
    PROCESSING = "processing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL_STATUSES = (TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.CANCELLED)

# Constraint and index names, used as constants when translating driver errors.
UQ_TASK_IDEMPOTENCY_KEY = "uq_tasks_idempotency_key"
FK_TASK_COMPANY = "fk_tasks_company_id_companies"
CK_TASK_STATUS = "ck_tasks_status"
CK_TASK_MAX_ATTEMPTS = "ck_tasks_max_attempts_range"
CK_TASK_PAYLOAD_OBJECT = "ck_tasks_payload_is_object"
CK_COMPANY_WEIGHT = "ck_companies_weight_range"
CK_COMPANY_MAX_IN_FLIGHT = "ck_companies_max_in_flight_range"
CK_COMPANY_MAX_PENDING = "ck_companies_max_pending_range"
CK_TASK_TIMEOUT_SECONDS = "ck_tasks_timeout_seconds_range"
# SQLSTATE of a statement that would take a company beyond its backlog quota (migration 0006).
BACKLOG_QUOTA_SQLSTATE = "FQ429"

MAX_ATTEMPTS_LIMIT = 50
# A company's share of claimed tasks is proportional to its weight (docs/design.md, Claim).
MIN_WEIGHT, MAX_WEIGHT = 1, 1000
# Bounds of max_in_flight, the most `processing` leases a company may hold at once.
MIN_IN_FLIGHT, MAX_IN_FLIGHT = 1, 100_000
# Bounds of max_pending, the most unfinished (pending or processing) tasks of a company.
MIN_PENDING, MAX_PENDING = 1, 10_000_000
# Bounds of a task's timeout_seconds: how long one attempt may run.
MIN_TIMEOUT_SECONDS, MAX_TIMEOUT_SECONDS = 1, 86_400
# The timeout of a task of a type that sets no default of its own, and of a row inserted
# without one (the column's default).
DEFAULT_TIMEOUT_SECONDS = 60

Timestamp = TIMESTAMP(timezone=True)


class Base(DeclarativeBase):
    """Declarative base carrying the naming convention for every constraint and index."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Company(Base):
    """A tenant. Its API keys are in `api_keys`."""

    __tablename__ = "companies"

    id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), primary_key=True, server_default=text("gen_random_uuid()")
    )
    name: Mapped[str] = mapped_column(Text, nullable=False)
    created_at: Mapped[dt.datetime] = mapped_column(
        Timestamp, nullable=False, server_default=text("now()")
    )
    # Share of claimed tasks while several companies have runnable work (1..1000).
    weight: Mapped[int] = mapped_column(nullable=False, server_default=text("1"))
    # Most `processing` leases at once across every worker; None = unlimited.
    max_in_flight: Mapped[int | None] = mapped_column()
    # Most unfinished (pending or processing) tasks at once; None = unlimited. Enforced by
    # the triggers that keep `company_backlogs` (migration 0006).
    max_pending: Mapped[int | None] = mapped_column()
    # Its tasks are accepted and kept but never claimed while true.
    paused: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("false"))

    __table_args__ = (
        CheckConstraint(f"weight BETWEEN {MIN_WEIGHT} AND {MAX_WEIGHT}", name="weight_range"),
        CheckConstraint(
            f"max_in_flight BETWEEN {MIN_IN_FLIGHT} AND {MAX_IN_FLIGHT}",
            name="max_in_flight_range",
        ),
        CheckConstraint(
            f"max_pending BETWEEN {MIN_PENDING} AND {MAX_PENDING}", name="max_pending_range"
        ),
    )


class ApiKey(Base):
    """One API key of a company (migration 0014); the key itself is never stored.

    It authenticates while `revoked_at` is NULL and `expires_at` is NULL or later than now
    (`db.api_keys.find_active_key`). `key_hash`: SHA-256 hex of the key (`api.auth.hash_api_key`:
    the key is 256 random bits, so a fast hash is enough). `last_used_at`: set by
    authentication at most once a minute per key (`db.api_keys.TOUCH_EVERY_SECONDS`).
    """

    __tablename__ = "api_keys"

    id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), primary_key=True, server_default=text("gen_random_uuid()")
    )
    company_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("companies.id", ondelete="CASCADE"), nullable=False
    )
    key_hash: Mapped[str] = mapped_column(Text, nullable=False)
    created_at: Mapped[dt.datetime] = mapped_column(
        Timestamp, nullable=False, server_default=text("now()")
    )
    last_used_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    expires_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)

    __table_args__ = (
        UniqueConstraint("key_hash"),
        # A company's keys, for their listing and the count of its active keys.
        Index("ix_api_keys_company_id", "company_id"),
    )


class CompanyBacklog(Base):
    """How many unfinished (pending or processing) tasks a company has: one row per company.

    Derived state, kept by statement-level triggers on `tasks` (migration 0006), which also
    refuse a statement that would take `unfinished` above `companies.max_pending` with
    SQLSTATE `BACKLOG_QUOTA_SQLSTATE`. Created by a trigger on `companies`.
    """

    __tablename__ = "company_backlogs"

    company_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("companies.id", ondelete="CASCADE"), primary_key=True
    )
    unfinished: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))


class CompanyQueue(Base):
    """The claim's view of one company: when it has work due, and its place in the ring.

    Derived state, one row per company (created by a trigger on `companies`). `due_at` is a
    lower bound of the earliest `run_after` among the company's pending tasks (None: none);
    triggers on `tasks` lower it whenever a task becomes pending, and only the claimer
    raises it, under the company's wake-up lock (db/sql/claim.sql). `ready` marks the
    companies the claimer serves, in `ring_position` order (deficit round robin): a company
    gets a position at the end of the ring each time it becomes ready. Migration 0003 holds
    the triggers and the `company_ring_positions` sequence.
    """

    __tablename__ = "company_queues"

    company_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("companies.id", ondelete="CASCADE"), primary_key=True
    )
    due_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    ready: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("false"))
    ring_position: Mapped[int | None] = mapped_column(BigInteger)
    # Copies of companies.weight and max_in_flight, kept by triggers: the claim reads them
    # with the ring, without a join (100 primary-key probes a claim).
    weight: Mapped[int] = mapped_column(nullable=False, server_default=text("1"))
    max_in_flight: Mapped[int | None] = mapped_column()
    # Copy of companies.paused: a paused company is never ready, and the promotion's index
    # leaves it out (migration 0007).
    paused: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("false"))
    # The claim floor (migration 0015, db/sql/tasks.sql and claim.sql): no pending task of the
    # company has a (run_after, id) below it; None: none known, the claim reads from the start.
    # The claim raises it past what it claimed, under the wake-up lock; triggers lower it.
    claim_floor_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    claim_floor_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))

    __table_args__ = (
        # The ring of ready companies, walked from the claim cursor.
        Index(
            "ix_company_queues_ring_position",
            "ring_position",
            postgresql_where=text("ready"),
        ),
        # Companies waiting for their earliest task to come due (scheduled or backed off),
        # paused ones left out.
        Index(
            "ix_company_queues_waiting_unpaused_due_at",
            "due_at",
            postgresql_where=text("NOT ready AND NOT paused AND due_at IS NOT NULL"),
        ),
    )


_status_values = ", ".join(f"'{s.value}'" for s in TaskStatus)


class Task(Base):
    """A unit of background work owned by one company (design §2 `tasks`)."""

    __tablename__ = "tasks"

    # Time-ordered (UUID version 7, migration 0008): a batch's row versions share few pages
    # of the primary key.
    id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), primary_key=True, server_default=text("fairq_uuidv7()")
    )
    company_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("companies.id", ondelete="CASCADE"), nullable=False
    )
    type: Mapped[str] = mapped_column(Text, nullable=False)
    payload: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    status: Mapped[str] = mapped_column(
        Text, nullable=False, server_default=text(f"'{TaskStatus.PENDING.value}'")
    )
    idempotency_key: Mapped[str | None] = mapped_column(Text)
    request_hash: Mapped[str | None] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(nullable=False, server_default=text("0"))
    max_attempts: Mapped[int] = mapped_column(nullable=False, server_default=text("5"))
    run_after: Mapped[dt.datetime] = mapped_column(
        Timestamp, nullable=False, server_default=text("now()")
    )
    lease_token: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    locked_by: Mapped[str | None] = mapped_column(Text)
    locked_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(
        Timestamp, nullable=False, server_default=text("now()")
    )
    updated_at: Mapped[dt.datetime] = mapped_column(
        Timestamp, nullable=False, server_default=text("now()")
    )
    started_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    finished_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    # What the handler returned (any JSON value, at most 64 KiB serialized), once completed.
    result: Mapped[Any] = mapped_column(JSONB, nullable=True)
    # How long one attempt may run, in seconds (the API sets the type's default when a
    # create gives none).
    timeout_seconds: Mapped[int] = mapped_column(
        nullable=False, server_default=text(str(DEFAULT_TIMEOUT_SECONDS))
    )

    __table_args__ = (
        CheckConstraint(f"status IN ({_status_values})", name="status"),
        CheckConstraint(
            f"max_attempts BETWEEN 1 AND {MAX_ATTEMPTS_LIMIT}", name="max_attempts_range"
        ),
        CheckConstraint("attempts >= 0", name="attempts_non_negative"),
        CheckConstraint(
            f"timeout_seconds BETWEEN {MIN_TIMEOUT_SECONDS} AND {MAX_TIMEOUT_SECONDS}",
            name="timeout_seconds_range",
        ),
        CheckConstraint("jsonb_typeof(payload) = 'object'", name="payload_is_object"),
        # The claim's per-company candidates (db/sql/claim.sql), in "eligible since"
        # order (decision 0001): the claim reads the range `run_after <=` its statement's
        # start and stops after the company's share, so rows scheduled or backed off into the
        # future are never visited however many there are. `id` is a key column, not INCLUDE:
        # it breaks ties in run_after in index order (a bulk insert shares one now()). Also
        # the settle's earliest pending run_after, the queue gauges' oldest eligible task
        # (one probe per company) and their capped pending count (db/statistics.py).
        Index(
            "ix_tasks_pending_company_run_after",
            "company_id",
            "run_after",
            "id",
            postgresql_where=text("status = 'pending'"),
        ),
        # A company's leases: the claim counts at most max_in_flight of them for a company
        # with a limit.
        Index(
            "ix_tasks_processing_company_locked_at",
            "company_id",
            "locked_at",
            "id",
            postgresql_where=text("status = 'processing'"),
        ),
        # The lease-expiry sweep (expire_leases) looks for stale processing rows across all
        # companies; also the queue gauges' capped processing count (db/statistics.py).
        Index(
            "ix_tasks_processing_locked_at",
            "locked_at",
            postgresql_where=text("status = 'processing'"),
        ),
        # An Idempotency-Key is unique per company (migration 0004). Partial: a task without
        # a key adds no entry, at creation or at any status change.
        Index(
            UQ_TASK_IDEMPOTENCY_KEY,
            "company_id",
            "idempotency_key",
            unique=True,
            postgresql_where=text("idempotency_key IS NOT NULL"),
        ),
        # GET /companies/{id}/tasks: newest first, with a stable tiebreak. Without the
        # leased tasks (migration 0009): a claim adds no entry here; list_tasks merges a
        # company's leases in from ix_tasks_processing_company_locked_at.
        Index(
            "ix_tasks_company_listing_unleased",
            "company_id",
            text("created_at DESC"),
            text("id DESC"),
            postgresql_where=text("status <> 'processing'"),
        ),
        # Retention deletes terminal rows by age.
        Index(
            "ix_tasks_terminal_finished_at",
            "finished_at",
            postgresql_where=text("status IN ('completed', 'failed', 'cancelled')"),
        ),
    )


class Worker(Base):
    """A worker process that may hold leases, and when it last said it was alive (design §5).

    `id` is what its leases carry in `tasks.locked_by`. A worker child registers at boot,
    its liveness thread refreshes `heartbeat_at`, and it deletes its row when it exits
    cleanly; the sweep (`db.workers.take_back_leases`) takes back the leases of a worker whose
    `heartbeat_at` is older than the stale window, and deletes its row.
    """

    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    host: Mapped[str] = mapped_column(Text, nullable=False)
    pid: Mapped[int] = mapped_column(nullable=False)
    started_at: Mapped[dt.datetime] = mapped_column(
        Timestamp, nullable=False, server_default=text("now()")
    )
    heartbeat_at: Mapped[dt.datetime] = mapped_column(
        Timestamp, nullable=False, server_default=text("now()")
    )
