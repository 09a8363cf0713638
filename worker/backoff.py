"""Retry delays: capped exponential backoff with full jitter (design §4, Fail).

Source: Marc Brooker, "Exponential Backoff and Jitter", AWS Architecture Blog (2015). Full
jitter, `sleep = random_between(0, min(cap, base * 2 ** attempt))`, spreads the retries of
tasks that failed together (a webhook target that was down) instead of synchronizing them
into waves, and does the least total work of the variants compared there.
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
