"""Slowing down guesses of the admin token: failed authentications counted per client address.

Every failed bearer authentication (a token that is neither the admin token nor an active
API key) and every failed dashboard login counts against the client's address. After
`ApiSettings.auth_failure_limit` (10) failures within a window of `WINDOW_SECONDS` that
began at the address's first failure, every attempt from it until the window ends is
answered 429 with `Retry-After`, without comparing its token, so a correct guess cannot be
told from a wrong one meanwhile.
An active company key still passes (256 random bits: not guessable, and tenants behind the
attacker's NAT keep working). The admin is locked out only from the attacker's own address,
for at most `WINDOW_SECONDS`: failures elsewhere never throttle another address.

State is per process (a dict, bounded to `MAX_ADDRESSES`), not in PostgreSQL: a database
write per failure would let a guesser load the database, and the bound stays small: at most
that many guesses per window per address per API process (gunicorn worker). Each
failure and each refusal counts in `auth_failures_total{surface,outcome}`; the start of an
address's throttling is logged.

The client address is the peer's (`request.remote_addr`), or, behind `PROXY_HOPS` reverse
proxies, the one they put in `X-Forwarded-For` (werkzeug's ProxyFix, `api.create_app`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from flask import Flask, current_app, request
from flask_smorest import abort

from api import metrics

log = logging.getLogger("fairq.api.auth")

# Length of an address's window, from its first failure, in seconds.
WINDOW_SECONDS = 60.0
# Addresses remembered per process; past that the oldest windows are forgotten first.
MAX_ADDRESSES = 100_000

_EXT = "fairq.throttle"


class FailureThrottle:
    """Failure counts per address in fixed windows of `window` seconds of `clock`."""

    def __init__(
        self,
        limit: int,
        window: float = WINDOW_SECONDS,
        size: int = MAX_ADDRESSES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.window = window
        self.size = size
        self.clock = clock
        self._lock = threading.Lock()
        # address -> (window end, failures in it), oldest window first.
        self._windows: OrderedDict[str, tuple[float, int]] = OrderedDict()

    def retry_after(self, address: str) -> float | None:
        """Seconds until `address` may try again, or None when it is not throttled."""
        with self._lock:
            entry = self._windows.get(address)
            if entry is None:
                return None
            end, failures = entry
            left = end - self.clock()
            if left <= 0:
                del self._windows[address]
                return None
            return left if failures >= self.limit else None

    def failed(self, address: str) -> bool:
        """Count a failure of `address`; True when it is the one that starts its throttling."""
        now = self.clock()
        with self._lock:
            entry = self._windows.get(address)
            if entry is None or entry[0] <= now:
                self._windows.pop(address, None)
                while len(self._windows) >= self.size:
                    self._windows.popitem(last=False)
                entry = (now + self.window, 0)
            self._windows[address] = (entry[0], entry[1] + 1)
            return entry[1] + 1 == self.limit


def init_app(app: Flask, limit: int) -> None:
    """Give `app` its throttle, refusing an address after `limit` failures in a window."""
    app.extensions[_EXT] = FailureThrottle(limit)


def throttle_of(app: Flask) -> FailureThrottle:
    """The throttle of `app`."""
    found: FailureThrottle = app.extensions[_EXT]
    return found


def client_address() -> str:
    """The address failures are counted against (see the module's docstring)."""
    return request.remote_addr or "unknown"


def retry_after() -> float | None:
    """Seconds until this request's client may try to authenticate again, or None."""
    return throttle_of(current_app).retry_after(client_address())


def refuse(surface: str, seconds: float) -> None:
    """Answer 429 with `Retry-After` (whole seconds, rounded up) and count it."""
    metrics.auth_failures(current_app).labels(surface=surface, outcome="throttled").inc()
    wait = max(1, math.ceil(seconds))
    abort(
        429,
        message=f"too many failed authentications from this address: try again in {wait} s",
        headers={"Retry-After": str(wait)},
    )


def record_failure(surface: str) -> None:
    """Count a failed authentication of this request's client; log when throttling starts."""
    metrics.auth_failures(current_app).labels(surface=surface, outcome="invalid").inc()
    throttle = throttle_of(current_app)
    address = client_address()
    if throttle.failed(address):
        log.warning(
            "throttling authentication from %s for up to %.0f s after %d failures (%s)",
            address,
            throttle.window,
            throttle.limit,
            surface,
        )
