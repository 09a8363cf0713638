"""Bearer-token authentication: the admin token and per-company API keys (design §3).

RFC 6750: a missing or invalid token is a 401 with `WWW-Authenticate: Bearer`. A company key
used on another company's path is a 404, never a 403, so ids of other tenants do not leak.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

from flask import current_app, g, request
from flask_smorest import abort

from api import database
from db import companies

API_KEY_PREFIX = "fq_"

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class Principal:
    """Who is calling: the admin (`company_id` None) or one company."""

    company_id: uuid.UUID | None

    @property
    def is_admin(self) -> bool:
        """True for the admin token."""
        return self.company_id is None


def new_api_key() -> str:
    """A fresh company API key: prefix plus 256 bits from `secrets`."""
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(key: str) -> str:
    """SHA-256 hex digest of a key; only the digest is stored."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def _unauthorized(message: str) -> None:
    abort(401, message=message, headers={"WWW-Authenticate": 'Bearer realm="fairq"'})


def _bearer_token() -> str:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        _unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
    return token.strip()


def _admin_token() -> str | None:
    token: str | None = current_app.config["FAIRQ_SETTINGS"].admin_token
    return token


def authenticate() -> Principal:
    """Identify the caller. Aborts with 401 when the token is missing or matches nothing.

    The principal is also kept in `g.fairq_principal` for the request's log line.
    """
    token = _bearer_token()
    admin = _admin_token()
    if admin is not None and hmac.compare_digest(token.encode(), admin.encode()):
        principal = Principal(company_id=None)
    else:
        company = companies.find_company_by_key_hash(database.session(), hash_api_key(token))
        if company is None:
            _unauthorized("invalid bearer token")
            raise AssertionError("unreachable")  # abort raises; this satisfies the type checker
        principal = Principal(company_id=company.id)
    g.fairq_principal = principal
    return principal


def require_admin() -> None:
    """Allow only the admin token. 503 when `ADMIN_TOKEN` is not configured, else 401."""
    if _admin_token() is None:
        abort(503, message="admin endpoints are disabled: ADMIN_TOKEN is not configured")
    if not authenticate().is_admin:
        _unauthorized("this endpoint needs the admin token")


def require_company(company_id: uuid.UUID, *, allow_admin: bool = False) -> Principal:
    """Allow the company itself (and the admin if `allow_admin`); others get a 404."""
    principal = authenticate()
    if principal.company_id == company_id or (allow_admin and principal.is_admin):
        return principal
    if principal.is_admin:
        # The admin token does not act for tenants on task endpoints (design §3 "who").
        abort(403, message="the admin token cannot act for a company; use its API key")
    abort(404, message="company not found")
    raise AssertionError("unreachable")


def admin_required(view: Callable[P, R]) -> Callable[P, R]:
    """Decorate a view so `require_admin` runs before its arguments are parsed.

    Applied above flask-smorest's decorators: an unauthenticated caller gets 401, not a
    validation error that would reveal the body's schema.
    """

    @functools.wraps(view)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        require_admin()
        return view(*args, **kwargs)

    return wrapper


def company_required(*, allow_admin: bool = False) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a view taking `company_id` so `require_company` runs before anything else."""

    def decorator(view: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(view)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            company_id = kwargs["company_id"]
            assert isinstance(company_id, uuid.UUID)
            require_company(company_id, allow_admin=allow_admin)
            return view(*args, **kwargs)

        return wrapper

    return decorator
