"""The one backoff rule (`worker.backoff`) and the delays each of its three users gets.

No database: the rule is arithmetic. The task retry's jitter is also covered by
tests/test_finalize.py and tests/test_properties.py.
"""

from __future__ import annotations

import random

import pytest

from worker import backoff, child, supervisor


def test_the_ceiling_doubles_from_base_up_to_cap() -> None:
    assert [backoff.ceiling(n, base=0.5, cap=10.0) for n in range(1, 9)] == [
        0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0,
    ]  # fmt: skip


def test_the_ceiling_of_any_attempt_number_is_the_cap() -> None:
    assert backoff.ceiling(10**100, base=0.25, cap=10.0) == 10.0


@pytest.mark.parametrize(("base", "cap"), [(0.0, 1.0), (1.0, 0.0), (-1.0, 1.0)])
def test_a_non_positive_base_or_cap_is_refused_at_once(base: float, cap: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        backoff.ceiling(1, base=base, cap=cap)
    with pytest.raises(ValueError, match="positive"):
        backoff.Backoff(base, cap)


def test_a_task_retry_waits_at_most_the_ceiling() -> None:
    rng = random.Random(7)
    for attempt in range(1, 20):
        assert 0.0 <= backoff.delay(attempt, rng=rng) <= backoff.ceiling(attempt)


def test_a_child_backs_off_from_half_a_second_to_ten_and_starts_over_after_a_success() -> None:
    # What the child's database retries and LISTEN reconnects wait (worker.child).
    retries = backoff.Backoff(child.RETRY_BACKOFF_MIN_SECONDS, child.RETRY_BACKOFF_MAX_SECONDS)

    assert [retries.next() for _ in range(8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    retries.reset()
    assert retries.next() == 0.5


def test_the_supervisor_respawns_after_a_quarter_second_doubling_to_ten() -> None:
    # The supervisor's delay for the n-th quick death in its window (worker.supervisor).
    delays = [
        backoff.ceiling(
            deaths,
            base=supervisor.RESTART_BACKOFF_BASE_SECONDS,
            cap=supervisor.RESTART_BACKOFF_MAX_SECONDS,
        )
        for deaths in range(1, 9)
    ]

    assert delays == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
