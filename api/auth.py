"""Bearer-token authentication: the admin token and per-company API keys (design §3).

RFC 6750: a missing or invalid token is a 401 with `WWW-Authenticate: Bearer`. A company key
used on another company's path is a 404, never a 403, so ids of other tenants do not leak.
Repeated failures from one client address are answered 429 for a while (`api.throttle`).

A company may hold several keys (`db.api_keys`), each valid until revoked or expired. A key
found active in the database is remembered for `KEY_CACHE_SECONDS` (per process, by its
hash), so a tenant's requests cost no lookup of their own, and never past its `expires_at`:
an expired key is refused at once by every process, and a revoked one at once by the process
that revoked it and within `KEY_CACHE_SECONDS` by the others. A key that matches nothing is
never remembered. The secrets compared here (the admin token) are compared in constant time;
a key is found by the SHA-256 of its 256 random bits, which reveals nothing of it.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

from flask import Flask, current_app, g, request
from flask_smorest import abort

from api import database, errors, settings, throttle
from db import api_keys

API_KEY_PREFIX = "fq_"
# How long a key found in the database is trusted without asking again: the most a key
# revoked by another API process keeps working in this one.
KEY_CACHE_SECONDS = 5.0
# Keys remembered per process; past that the cache starts over (an attacker's random keys
# are never added: only keys that exist are).
KEY_CACHE_SIZE = 10_000

_KEYS_EXT = "fairq.auth.keys"

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


class KeyCache:
    """Key hash -> company id, each entry trusted for `ttl` seconds of `clock` at most.

    Thread-safe without a lock: single dict operations are atomic, and a lost race only
    costs one more lookup.
    """

    def __init__(
        self,
        ttl: float = KEY_CACHE_SECONDS,
        size: int = KEY_CACHE_SIZE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl = ttl
        self.size = size
        self.clock = clock
        self._entries: dict[str, tuple[uuid.UUID, float]] = {}

    def get(self, key_hash: str) -> uuid.UUID | None:
        """The company of `key_hash` if it was found less than `ttl` seconds ago."""
        entry = self._entries.get(key_hash)
        if entry is None:
            return None
        if self.clock() >= entry[1]:
            self._entries.pop(key_hash, None)
            return None
        return entry[0]

    def put(self, key_hash: str, company_id: uuid.UUID, expires_in: float | None = None) -> None:
        """Remember that `key_hash` belongs to `company_id`, for `ttl` seconds from now, or
        `expires_in` seconds if sooner (the key's expiry)."""
        if len(self._entries) >= self.size:
            self._entries.clear()
        trusted = self.ttl if expires_in is None else min(self.ttl, expires_in)
        self._entries[key_hash] = (company_id, self.clock() + trusted)

    def clear(self) -> None:
        """Forget every key."""
        self._entries.clear()


def init_app(app: Flask) -> None:
    """Give `app` its key cache."""
    app.extensions[_KEYS_EXT] = KeyCache()


def key_cache(app: Flask) -> KeyCache:
    """The key cache of `app`."""
    cache: KeyCache = app.extensions[_KEYS_EXT]
    return cache


def new_api_key() -> str:
    """A fresh company API key: prefix plus 256 bits from `secrets`."""
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(key: str) -> str:
    """SHA-256 hex digest of a key; only the digest is stored."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def _unauthorized(message: str) -> None:
    # RFC 6750: the Authorization header is the input at fault.
    abort(
        401,
        message=message,
        errors=errors.header_fault("Authorization", message),
        headers={"WWW-Authenticate": 'Bearer realm="fairq"'},
    )


def _bearer_token() -> str:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        _unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
    return token.strip()


def _admin_token() -> str | None:
    return settings.current().admin_token


def _company_of_key(token: str) -> uuid.UUID | None:
    """The company of the active key `token`, from the cache or the database, or None."""
    key_hash = hash_api_key(token)
    cache = key_cache(current_app)
    company_id = cache.get(key_hash)
    if company_id is None:
        found = api_keys.find_active_key(database.connection(), key_hash)
        if found is None:
            return None
        company_id = found.company_id
        cache.put(key_hash, company_id, found.expires_in_seconds)
    return company_id


def authenticate() -> Principal:
    """Identify the caller. Aborts with 401 when the token is missing or matches nothing,
    429 with `Retry-After` while the client's address is throttled (`api.throttle`; an
    active company key still passes).

    The principal is also kept in `g.fairq_principal` for the request's log line.
    """
    token = _bearer_token()
    admin = _admin_token()
    wait = throttle.retry_after()
    if wait is None and admin is not None and hmac.compare_digest(token.encode(), admin.encode()):
        principal = Principal(company_id=None)
    else:
        company_id = _company_of_key(token)
        if company_id is None:
            if wait is not None:
                throttle.refuse("api", wait)
            throttle.record_failure("api")
            _unauthorized("invalid bearer token")
            raise AssertionError("unreachable")  # abort raises; this satisfies mypy
        principal = Principal(company_id=company_id)
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
        message = "the admin token cannot act for a company; use its API key"
        abort(403, message=message, errors=errors.header_fault("Authorization", message))
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
