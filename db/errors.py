"""Domain errors raised by `db` functions; `api/errors.py` maps them to HTTP responses."""

from __future__ import annotations


class DomainError(Exception):
    """Base of every error the storage layer raises on purpose."""


class NotFound(DomainError):
    """The row does not exist or belongs to another company (never distinguish the two)."""


class Conflict(DomainError):
    """The row exists but is in a state that forbids the operation (HTTP 409)."""


class IdempotencyKeyReused(DomainError):
    """An Idempotency-Key was reused with a different request body.

    IETF draft-ietf-httpapi-idempotency-key-header, section 2.7 ("Error Scenarios").
    """
