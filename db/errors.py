"""Errors of the storage layer: the domain errors `db` functions raise on purpose, which
`api/errors.py` maps to HTTP responses, and `brief`, the one-line summary of a driver error.
"""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError


class DomainError(Exception):
    """Base of every error the storage layer raises on purpose."""


class NotFound(DomainError):
    """The row does not exist or belongs to another company (never distinguish the two)."""


class Conflict(DomainError):
    """The row exists but is in a state that forbids the operation (HTTP 409)."""


class IdempotencyKeyReused(DomainError):
    """An Idempotency-Key was reused with a different request body.

    IETF draft-ietf-httpapi-idempotency-key-header, section 2.7 ("Error Scenarios").
    `item`: the batch item (index from 0) whose key it is; None on a single create.
    """

    def __init__(self, message: str, *, item: int | None = None) -> None:
        super().__init__(message)
        self.item = item


class IdempotencyKeyInFlux(Conflict):
    """An Idempotency-Key was taken and freed again while a create tried to use it; retry.

    `item`: the batch item (index from 0) whose key it is; None on a single create.
    """

    def __init__(self, message: str, *, item: int | None = None) -> None:
        super().__init__(message)
        self.item = item


def brief(exc: BaseException) -> str:
    """Summarize a database error in one line for a log: the driver's class and first line.

    A SQLAlchemy `DBAPIError` is unwrapped to the driver's error (its own text appends the
    statement). Only the primary message, never the DETAIL or CONTEXT lines nor the
    parameters: they can quote the data that was written (a check violation's DETAIL shows
    the whole row, payload included). Any other exception gets the first line of its text.
    """
    inner = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    primary = getattr(getattr(inner, "diag", None), "message_primary", None)
    if not primary:
        lines = str(inner).strip().splitlines()
        primary = lines[0] if lines else ""
    return f"{type(inner).__name__}: {primary}"
