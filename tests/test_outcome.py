"""What becomes of a task after its attempt (`worker.processing.outcome`): no database needed."""

from __future__ import annotations

import functools
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker import backoff
from worker.errors import PermanentTaskError
from worker.processing import outcome
from worker.processing.outcome import Complete, Fail, LeaseLost, Retry


class BackoffSpy:
    """A backoff rule of `10 * attempt` seconds that records the attempts it was asked for."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def __call__(self, attempt: int) -> float:
        self.asked.append(attempt)
        return 10.0 * attempt


class MailboxFull(PermanentTaskError):
    """A permanent error of a handler's own."""


def decide(raised: Exception | None, attempt: int, max_attempts: int = 5) -> outcome.Decision:
    return outcome.decide(raised, attempt=attempt, max_attempts=max_attempts, backoff=BackoffSpy())


@pytest.mark.parametrize("attempt", [1, 4, 5, 9])
def test_a_handler_that_returned_completes_its_task_on_any_attempt(attempt: int) -> None:
    assert decide(None, attempt) == Complete()


def test_an_error_with_attempts_left_retries_after_the_backoff_of_this_attempt() -> None:
    rule = BackoffSpy()

    decided = outcome.decide(ConnectionError("smtp down"), attempt=2, max_attempts=5, backoff=rule)

    assert decided == Retry(
        delay=20.0, error="ConnectionError: smtp down", error_type="ConnectionError"
    )
    assert rule.asked == [2]


def test_an_error_without_a_message_is_described_by_its_type_alone() -> None:
    assert decide(TimeoutError(), attempt=1) == Retry(10.0, "TimeoutError", "TimeoutError")


def test_an_error_on_the_last_attempt_fails_for_good_saying_it_gave_up() -> None:
    assert decide(ConnectionError("smtp down"), attempt=5, max_attempts=5) == Fail(
        "gave up after 5 attempts: ConnectionError: smtp down", "ConnectionError"
    )


def test_an_attempt_past_max_attempts_fails_too() -> None:
    # A task's attempts can exceed its max_attempts: a lease expiry counts an attempt too.
    assert isinstance(decide(ValueError("bad"), attempt=7, max_attempts=5), Fail)


@pytest.mark.parametrize("error", [PermanentTaskError("no such mailbox"), MailboxFull("full")])
def test_a_permanent_error_fails_at_once_without_asking_the_backoff(
    error: PermanentTaskError,
) -> None:
    rule = BackoffSpy()

    decided = outcome.decide(error, attempt=1, max_attempts=5, backoff=rule)

    assert decided == Fail(f"{type(error).__name__}: {error}", type(error).__name__)
    assert rule.asked == []


def test_the_backoff_is_asked_only_for_a_retry() -> None:
    rule = BackoffSpy()

    for raised, attempt in [(None, 1), (PermanentTaskError("x"), 1), (OSError("x"), 5)]:
        outcome.decide(raised, attempt=attempt, max_attempts=5, backoff=rule)

    assert rule.asked == []


def test_the_worker_backoff_rule_gives_a_delay_up_to_its_ceiling() -> None:
    rule = functools.partial(backoff.delay, rng=random.Random(7))

    decided = outcome.decide(OSError("reset"), attempt=3, max_attempts=5, backoff=rule)

    assert isinstance(decided, Retry)
    assert 0 <= decided.delay <= backoff.ceiling(3) == 8.0


@given(
    attempt=st.integers(1, 100),
    max_attempts=st.integers(1, 100),
    permanent=st.booleans(),
    message=st.text(max_size=20),
)
def test_a_task_is_retried_exactly_when_its_error_is_not_permanent_and_attempts_remain(
    attempt: int, max_attempts: int, permanent: bool, message: str
) -> None:
    error = PermanentTaskError(message) if permanent else RuntimeError(message)

    decided = decide(error, attempt=attempt, max_attempts=max_attempts)

    assert isinstance(decided, Retry) == (not permanent and attempt < max_attempts)
    assert isinstance(decided, Retry | Fail)
    assert decided.error.endswith(outcome.describe_error(error))


def test_an_unknown_task_type_fails_naming_the_registered_types() -> None:
    assert outcome.unknown_type("retired", ["noop", "sleep"]) == Fail(
        "unknown task type 'retired' (registered: noop, sleep)", "UnknownTaskType"
    )


@pytest.mark.parametrize(
    ("decision", "action"),
    [(Complete(), "complete"), (Retry(2.0, "E: x", "E"), "retry"), (Fail("E: x", "E"), "fail")],
)
def test_a_write_that_matched_no_lease_turns_the_decision_into_lease_lost(
    decision: outcome.Decision, action: str
) -> None:
    assert outcome.written(decision, matched=False) == LeaseLost(action)
    assert outcome.written(decision, matched=True) is decision
