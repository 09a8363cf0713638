"""Backoff: the one capped exponential rule of the worker, and its three uses.

`ceiling(n)` is `min(cap, base * 2 ** (n - 1))` after the n-th failure in a row. It serves:

- task retries (design §4, Fail): `delay`, full jitter below the ceiling, base 2 s, cap 1 h;
- a child's database retries and LISTEN reconnects (`worker.child`): `Backoff`, the ceiling
  itself, counting failures until a success resets it;
- the supervisor's respawn of children that die quickly (`worker.supervisor`): the ceiling of
  the number of quick deaths in its window.

Source of the jitter: Marc Brooker, "Exponential Backoff and Jitter", AWS Architecture Blog
(2015). Full jitter, `sleep = random_between(0, min(cap, base * 2 ** attempt))`, spreads the
retries of tasks that failed together (a webhook target that was down) instead of
synchronizing them into waves, and does the least total work of the variants compared there.
"""

from __future__ import annotations

import math
import random

BASE_SECONDS = 2.0
CAP_SECONDS = 3600.0


def ceiling(attempt: int, *, base: float = BASE_SECONDS, cap: float = CAP_SECONDS) -> float:
    """The largest delay in seconds after failed attempt number `attempt` (counted from 1).

    `min(cap, base * 2 ** (attempt - 1))`: 2 s, 4 s, 8 s, ... up to 1 h. The exponent is
    capped before the power is taken, so any attempt number is safe (`2.0 ** 1024` would
    raise `OverflowError`). Raises `ValueError` for `attempt < 1` or a non-positive base/cap.
    """
    if attempt < 1:
        raise ValueError(f"attempt counts from 1, got {attempt}")
    if base <= 0 or cap <= 0:
        raise ValueError("base and cap must be positive")
    # Past this exponent base * 2**exponent already exceeds cap; stop growing there.
    max_exponent = max(0, math.ceil(math.log2(cap / base))) if cap > base else 0
    return min(cap, base * 2.0 ** min(attempt - 1, max_exponent))


def delay(
    attempt: int,
    *,
    base: float = BASE_SECONDS,
    cap: float = CAP_SECONDS,
    rng: random.Random | None = None,
) -> float:
    """Seconds to wait before retrying after failed attempt `attempt`: uniform in [0, ceiling].

    `rng` makes it reproducible in tests; the module's shared generator is used otherwise.
    Raises `ValueError` like `ceiling`.
    """
    top = ceiling(attempt, base=base, cap=cap)
    return (rng or random).uniform(0.0, top)


class Backoff:
    """Failures in a row, and the delay each one earns: `base`, twice that, ... up to `cap`.

    No jitter: one process retrying its own connection. Raises `ValueError` for a
    non-positive base or cap.
    """

    def __init__(self, base: float, cap: float) -> None:
        ceiling(1, base=base, cap=cap)  # validates base and cap now, not at the first failure
        self._base = base
        self._cap = cap
        self._failures = 0

    def next(self) -> float:
        """Count one more failure; return the seconds to wait before the next attempt."""
        self._failures += 1
        return ceiling(self._failures, base=self._base, cap=self._cap)

    def reset(self) -> None:
        """Back to `base` after a success."""
        self._failures = 0
