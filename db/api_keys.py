"""A company's API keys (table `api_keys`, migration 0014): issue, list, rotate, revoke, and
authentication's lookup.

Each function takes a psycopg connection and never commits: the caller owns the
transaction. Those that lock the company's row (`issue_key`, `rotate_key`, `revoke_key`)
need one (`with conn.transaction():`): the lock makes the count of its active keys exact
against a concurrent issue or revocation. Only hashes are stored (`api.auth.hash_api_key`).

A key is *active* while it is not revoked and not expired (`expires_at` NULL or later than
the database's `now()`).
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import class_row

from db import errors
from db.engine import driver_errors

# Active keys a company may hold at once: room for rotations with overlap and a key per
# service, not for a runaway script filling the table.
MAX_ACTIVE_KEYS = 100
# Inactive (revoked or expired) keys the listing shows besides every active one, newest first.
LISTED_INACTIVE_KEYS = 100
# Authentication writes `last_used_at` at most this often per key (seconds): an up-to-date
# "last used" to the minute without a write per request.
TOUCH_EVERY_SECONDS = 60


@dataclass(frozen=True)
class ApiKeyRecord:
    """A key as listed: never its secret nor its hash. Times are the database's."""

    id: uuid.UUID
    company_id: uuid.UUID
    created_at: dt.datetime
    last_used_at: dt.datetime | None
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None
    active: bool


@dataclass(frozen=True)
class ActiveKey:
    """What authentication learns of an active key: whose it is and for how long it holds.

    `expires_in_seconds`: seconds from the lookup until `expires_at` (database clock), None
    for a key without expiry.
    """

    id: uuid.UUID
    company_id: uuid.UUID
    expires_in_seconds: float | None


# Every statement below spells "active" as `revoked_at IS NULL AND (expires_at IS NULL OR
# expires_at > now())`, and lists a key's columns in `ApiKeyRecord`'s order.

# One statement: the lookup and, at most once a minute per key, the `last_used_at` write (a
# data-modifying CTE runs whether or not the outer query reads it).
_FIND_ACTIVE = """
WITH found AS (
    SELECT id, company_id, last_used_at,
           EXTRACT(EPOCH FROM expires_at - now())::float8 AS expires_in_seconds
    FROM api_keys
    WHERE key_hash = %(hash)s
      AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now())
), touched AS (
    UPDATE api_keys k SET last_used_at = now()
    FROM found
    WHERE k.id = found.id
      AND (found.last_used_at IS NULL
           OR found.last_used_at < now() - make_interval(secs => %(touch_every)s))
)
SELECT id, company_id, expires_in_seconds FROM found
"""


def find_active_key(
    conn: psycopg.Connection[Any], key_hash: str, *, touch_every: float = TOUCH_EVERY_SECONDS
) -> ActiveKey | None:
    """The active key whose hash is `key_hash`, or None (unknown, revoked or expired).

    Authentication's lookup: one statement on the unique index of `key_hash`. Sets the key's
    `last_used_at` to now when it is older than `touch_every` seconds (or unset). Works in
    autocommit (it then commits by itself).
    """
    with driver_errors("find_active_key"):
        cursor = conn.cursor(row_factory=class_row(ActiveKey))
        return cursor.execute(
            _FIND_ACTIVE, {"hash": key_hash, "touch_every": touch_every}
        ).fetchone()


_LOCK_COMPANY = "SELECT 1 FROM companies WHERE id = %(company_id)s FOR NO KEY UPDATE"
_COUNT_ACTIVE = """
SELECT count(*) FROM api_keys
WHERE company_id = %(company_id)s
  AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now())
  AND id IS DISTINCT FROM %(except_id)s
"""
_INSERT = """
INSERT INTO api_keys (company_id, key_hash, expires_at)
VALUES (%(company_id)s, %(hash)s,
        COALESCE(%(expires_at)s, now() + make_interval(secs => %(expires_in)s)))
RETURNING id, company_id, created_at, last_used_at, expires_at, revoked_at,
       (revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now())) AS active
"""


def _lock_company(conn: psycopg.Connection[Any], company_id: uuid.UUID) -> None:
    # FOR NO KEY UPDATE: serializes the key changes of one company, and leaves alone the
    # task inserts, whose foreign key takes FOR KEY SHARE.
    if conn.execute(_LOCK_COMPANY, {"company_id": company_id}).fetchone() is None:
        raise errors.NotFound("company not found")


def _active_count(
    conn: psycopg.Connection[Any], company_id: uuid.UUID, except_id: uuid.UUID | None = None
) -> int:
    row = conn.execute(_COUNT_ACTIVE, {"company_id": company_id, "except_id": except_id}).fetchone()
    assert row is not None
    count: int = row[0]
    return count


def _insert(
    conn: psycopg.Connection[Any],
    company_id: uuid.UUID,
    key_hash: str,
    expires_at: dt.datetime | None,
    expires_in_seconds: float | None,
) -> ApiKeyRecord:
    cursor = conn.cursor(row_factory=class_row(ApiKeyRecord))
    params = {
        "company_id": company_id,
        "hash": key_hash,
        "expires_at": expires_at,
        "expires_in": expires_in_seconds,
    }
    record = cursor.execute(_INSERT, params).fetchone()
    assert record is not None
    return record


def issue_key(
    conn: psycopg.Connection[Any],
    company_id: uuid.UUID,
    key_hash: str,
    *,
    expires_at: dt.datetime | None = None,
    expires_in_seconds: float | None = None,
) -> ApiKeyRecord:
    """Add a key (`key_hash`, the SHA-256 hex of the new key) to a company; return it.

    It expires at `expires_at`, else `expires_in_seconds` from now, else never. Needs a
    transaction. Raises `errors.NotFound` (no such company), `errors.Conflict` when the
    company has `MAX_ACTIVE_KEYS` active keys already.
    """
    with driver_errors("issue_key"):
        _lock_company(conn, company_id)
        if _active_count(conn, company_id) >= MAX_ACTIVE_KEYS:
            raise errors.Conflict(
                f"the company has {MAX_ACTIVE_KEYS} active API keys, the most it may hold: "
                "revoke one first"
            )
        return _insert(conn, company_id, key_hash, expires_at, expires_in_seconds)


_LIST = """
WITH listed AS (
    SELECT id, company_id, created_at, last_used_at, expires_at, revoked_at,
           (revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now())) AS active
    FROM api_keys WHERE company_id = %(company_id)s
)
(SELECT * FROM listed WHERE active)
UNION ALL
(SELECT * FROM listed WHERE NOT active ORDER BY created_at DESC, id DESC LIMIT %(inactive)s)
ORDER BY active DESC, created_at DESC, id DESC
"""
_COMPANY_EXISTS = "SELECT 1 FROM companies WHERE id = %(company_id)s"


def list_keys(conn: psycopg.Connection[Any], company_id: uuid.UUID) -> list[ApiKeyRecord]:
    """A company's keys: every active one (at most `MAX_ACTIVE_KEYS`), then the newest
    `LISTED_INACTIVE_KEYS` revoked or expired ones; newest first within each.

    Raises `errors.NotFound` when the company does not exist.
    """
    with driver_errors("list_keys"):
        cursor = conn.cursor(row_factory=class_row(ApiKeyRecord))
        params = {"company_id": company_id, "inactive": LISTED_INACTIVE_KEYS}
        keys = cursor.execute(_LIST, params).fetchall()
        if not keys and conn.execute(_COMPANY_EXISTS, params).fetchone() is None:
            raise errors.NotFound("company not found")
    return keys


_GET = """
SELECT id, company_id, created_at, last_used_at, expires_at, revoked_at,
       (revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now())) AS active
FROM api_keys WHERE id = %(key_id)s AND company_id = %(company_id)s
"""
_REVOKE = """
UPDATE api_keys SET revoked_at = COALESCE(revoked_at, now())
WHERE id = %(key_id)s AND company_id = %(company_id)s
RETURNING id, company_id, created_at, last_used_at, expires_at, revoked_at, false AS active
"""


def _get(conn: psycopg.Connection[Any], company_id: uuid.UUID, key_id: uuid.UUID) -> ApiKeyRecord:
    cursor = conn.cursor(row_factory=class_row(ApiKeyRecord))
    record = cursor.execute(_GET, {"company_id": company_id, "key_id": key_id}).fetchone()
    if record is None:
        raise errors.NotFound("API key not found")
    return record


def revoke_key(
    conn: psycopg.Connection[Any],
    company_id: uuid.UUID,
    key_id: uuid.UUID,
    *,
    keep_one_active: bool,
) -> ApiKeyRecord:
    """Revoke a company's key now and return it; revoking a revoked key changes nothing.

    `keep_one_active`: refuse to revoke the company's last active key (a company revoking
    its own keys: it would lock itself out). Needs a transaction. Raises `errors.NotFound`
    (no such company, or the key is not one of its keys) and `errors.Conflict`.
    """
    with driver_errors("revoke_key"):
        _lock_company(conn, company_id)
        key = _get(conn, company_id, key_id)
        if keep_one_active and key.active and _active_count(conn, company_id, key_id) == 0:
            raise errors.Conflict(
                "this is the company's last active API key: issue a new one before revoking it"
            )
        cursor = conn.cursor(row_factory=class_row(ApiKeyRecord))
        revoked = cursor.execute(_REVOKE, {"company_id": company_id, "key_id": key_id}).fetchone()
    assert revoked is not None  # the company's row lock keeps the key from going meanwhile
    return revoked


_EXPIRE_WITHIN = """
UPDATE api_keys
SET expires_at = LEAST(COALESCE(expires_at, 'infinity'),
                       now() + make_interval(secs => %(overlap)s))
WHERE id = %(key_id)s AND company_id = %(company_id)s
RETURNING id, company_id, created_at, last_used_at, expires_at, revoked_at,
       (revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now())) AS active
"""


def rotate_key(
    conn: psycopg.Connection[Any],
    company_id: uuid.UUID,
    key_id: uuid.UUID,
    new_key_hash: str,
    *,
    overlap_seconds: float,
    expires_at: dt.datetime | None = None,
    expires_in_seconds: float | None = None,
) -> tuple[ApiKeyRecord, ApiKeyRecord]:
    """Replace an active key with a new one, both working for `overlap_seconds`.

    The old key then expires (sooner if it was due to); the new key's expiry is as in
    `issue_key`. Returns (old key, new key). Needs a transaction. Raises `errors.NotFound`
    (no such company or key), `errors.Conflict` (the old key is revoked or expired already,
    or the company is at `MAX_ACTIVE_KEYS` without it).
    """
    with driver_errors("rotate_key"):
        _lock_company(conn, company_id)
        old = _get(conn, company_id, key_id)
        if not old.active:
            raise errors.Conflict("this API key is revoked or expired already: issue a new one")
        if _active_count(conn, company_id, key_id) >= MAX_ACTIVE_KEYS:
            raise errors.Conflict(
                f"the company has {MAX_ACTIVE_KEYS} other active API keys, the most it may "
                "hold: revoke one first"
            )
        new = _insert(conn, company_id, new_key_hash, expires_at, expires_in_seconds)
        cursor = conn.cursor(row_factory=class_row(ApiKeyRecord))
        params = {"company_id": company_id, "key_id": key_id, "overlap": overlap_seconds}
        expiring = cursor.execute(_EXPIRE_WITHIN, params).fetchone()
    assert expiring is not None
    return expiring, new
