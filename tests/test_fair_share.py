"""Deficit round robin over a batch (`db.fair_share.allocate`): pure, no database.

Examples pin the rule down (turns in ring order, a turn of up to `weight` tasks, headroom caps,
the credit of an interrupted turn); hypothesis checks what must hold for any ring: shares add
up to `min(slots, headroom)`, nobody above its headroom, and over many batches every
backlogged company's total is within one quantum (its weight) of its weighted share.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from db import fair_share
from db.fair_share import Contender, Cursor

# Reproducible in CI: the same examples every run, no example database between runs.
settings.register_profile(
    "fairq-fair-share",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=300,
    suppress_health_check=[HealthCheck.too_slow],
)
PROPERTIES = settings.get_profile("fairq-fair-share")

UNLIMITED = None


def ring(*weights: int, headroom: int | None = UNLIMITED) -> list[Contender]:
    """Contenders at ring positions 10, 20, 30, ... with these weights."""
    return [
        Contender(uuid.UUID(int=i + 1), 10 * (i + 1), weight, headroom)
        for i, weight in enumerate(weights)
    ]


def shares(allocation: fair_share.Allocation, contenders: Sequence[Contender]) -> list[int]:
    """Tasks per contender, in the contenders' order (0 for those left out)."""
    return [allocation.shares.get(c.company_id, (0, 0))[0] for c in contenders]


def turns(allocation: fair_share.Allocation, contenders: Sequence[Contender]) -> list[int | None]:
    """Each contender's first turn in the batch (None for those left out)."""
    return [
        allocation.shares[c.company_id][1] if c.company_id in allocation.shares else None
        for c in contenders
    ]


# -- examples ------------------------------------------------------------------------------


def test_equal_weights_take_turns_one_task_each_in_ring_order() -> None:
    contenders = ring(1, 1, 1)

    allocation = fair_share.allocate(contenders, 5, 0)

    assert shares(allocation, contenders) == [2, 2, 1]
    assert turns(allocation, contenders) == [0, 1, 2]
    # The batch ended after the second company's (complete) turn: the next starts after it.
    assert allocation.cursor == Cursor(20, 0)


def test_a_batch_shorter_than_the_ring_serves_the_first_companies_only() -> None:
    contenders = ring(1, 1, 1, 1)

    allocation = fair_share.allocate(contenders, 2, 0)

    assert shares(allocation, contenders) == [1, 1, 0, 0]
    assert set(allocation.shares) == {contenders[0].company_id, contenders[1].company_id}
    assert allocation.cursor == Cursor(20, 0)


@pytest.mark.parametrize("rounds", [1, 2, 5])
def test_a_full_round_gives_each_company_its_weight(rounds: int) -> None:
    contenders = ring(1, 2, 4)

    allocation = fair_share.allocate(contenders, 7 * rounds, 0)

    assert shares(allocation, contenders) == [rounds, 2 * rounds, 4 * rounds]
    assert allocation.cursor == Cursor(30, 0)


def test_headroom_caps_a_company_and_the_others_take_its_slots() -> None:
    capped, *others = contenders = [
        Contender(uuid.UUID(int=1), 10, 4, 1),
        Contender(uuid.UUID(int=2), 20, 1, UNLIMITED),
        Contender(uuid.UUID(int=3), 30, 1, UNLIMITED),
    ]

    allocation = fair_share.allocate(contenders, 10, 0)

    assert shares(allocation, contenders) == [1, 5, 4]
    assert allocation.shares[capped.company_id] == (1, 0)
    assert sum(shares(allocation, others)) == 9


def test_a_company_without_headroom_gets_nothing() -> None:
    contenders = [Contender(uuid.UUID(int=1), 10, 1, 0), Contender(uuid.UUID(int=2), 20, 1, 9)]

    allocation = fair_share.allocate(contenders, 3, 0)

    assert shares(allocation, contenders) == [0, 3]
    assert turns(allocation, contenders) == [None, 0]


def test_more_slots_than_headroom_gives_every_company_all_of_its_headroom() -> None:
    contenders = [
        Contender(uuid.UUID(int=1), 10, 3, 2),
        Contender(uuid.UUID(int=2), 20, 1, 5),
        Contender(uuid.UUID(int=3), 30, 2, 1),
    ]

    allocation = fair_share.allocate(contenders, 100, 0)

    assert shares(allocation, contenders) == [2, 5, 1]


def test_no_contenders_get_nothing() -> None:
    allocation = fair_share.allocate([], 10, 0)

    assert allocation.shares == {}
    assert allocation.cursor == Cursor(0, 0)


def test_zero_slots_give_nothing() -> None:
    allocation = fair_share.allocate(ring(1, 2), 0, 0)

    assert allocation.shares == {}


def test_a_batch_that_fills_mid_turn_leaves_the_rest_of_the_turn_in_the_cursor() -> None:
    contenders = ring(4, 1)

    first = fair_share.allocate(contenders, 2, 0)

    assert shares(first, contenders) == [2, 0]
    assert first.cursor == Cursor(10, 2)


def test_the_credit_of_an_interrupted_turn_is_used_before_the_ring_moves_on() -> None:
    # As the claim lists them after the batch above: the interrupted company first.
    contenders = ring(4, 1)

    allocation = fair_share.allocate(contenders, 5, 2)

    # 2 (the rest of its turn), then the other's 1, then 2 of a new turn of 4.
    assert shares(allocation, contenders) == [4, 1]
    assert turns(allocation, contenders) == [0, 1]
    assert allocation.cursor == Cursor(10, 2)


def test_the_credit_counts_only_for_the_first_turn() -> None:
    contenders = ring(3, 3)

    allocation = fair_share.allocate(contenders, 6, 1)

    # 1 (credit), 3, then 2 of a full turn of 3.
    assert shares(allocation, contenders) == [3, 3]
    assert allocation.cursor == Cursor(10, 1)


def test_a_company_at_its_headroom_keeps_no_credit() -> None:
    contenders = [Contender(uuid.UUID(int=1), 10, 4, 2), Contender(uuid.UUID(int=2), 20, 1, 9)]

    allocation = fair_share.allocate(contenders, 2, 0)

    assert shares(allocation, contenders) == [2, 0]
    assert allocation.cursor == Cursor(10, 0)


# -- properties ----------------------------------------------------------------------------

contender_lists = st.lists(
    st.tuples(st.integers(1, 1000), st.none() | st.integers(0, 300)), min_size=0, max_size=12
).map(
    lambda specs: [
        Contender(uuid.UUID(int=i + 1), 10 * (i + 1), weight, headroom)
        for i, (weight, headroom) in enumerate(specs)
    ]
)


@PROPERTIES
@given(contenders=contender_lists, slots=st.integers(0, 500), credit=st.integers(0, 999))
def test_shares_fill_the_batch_within_every_headroom(
    contenders: list[Contender], slots: int, credit: int
) -> None:
    # A credit is what is left of the first contender's turn: less than its weight.
    credit = min(credit, contenders[0].weight - 1) if contenders else 0

    allocation = fair_share.allocate(contenders, slots, credit)

    given_out = shares(allocation, contenders)
    # No limit (None) means room for the whole batch.
    rooms = [slots if c.headroom is None else c.headroom for c in contenders]
    assert sum(given_out) == min(slots, sum(rooms))
    assert all(0 <= n <= room for n, room in zip(given_out, rooms, strict=True))
    # Only companies that get something are listed, each with a distinct turn 0, 1, ...
    assert all(n > 0 for n, _ in allocation.shares.values())
    assert sorted(turn for _, turn in allocation.shares.values()) == list(
        range(len(allocation.shares))
    )
    # The cursor names a contender (or, with nothing given out, the place before the first).
    positions = {c.ring_position for c in contenders}
    if allocation.shares:
        assert allocation.cursor.ring_position in positions
        assert 0 <= allocation.cursor.credit < max(c.weight for c in contenders)


def next_batch(contenders: Sequence[Contender], cursor: Cursor) -> tuple[list[Contender], int]:
    """The ring from `cursor` as the claim lists it, and the credit it passes on.

    As `fairq_claim` reads it (db/sql/claim.sql): from the cursor's company when it has
    credit left, else from the one after it, wrapping around; the credit only if that
    company comes first.
    """
    start = cursor.ring_position + (0 if cursor.credit > 0 else 1)
    ordered = sorted(contenders, key=lambda c: (c.ring_position < start, c.ring_position))
    credit = cursor.credit if ordered and ordered[0].ring_position == cursor.ring_position else 0
    return ordered, credit


@PROPERTIES
@given(
    weights=st.lists(st.integers(1, 20), min_size=1, max_size=8),
    batch=st.integers(1, 60),
    batches=st.integers(1, 80),
)
def test_over_many_batches_each_company_gets_its_weighted_share_within_one_quantum(
    weights: list[int], batch: int, batches: int
) -> None:
    """Everybody backlogged and unlimited: after any number of batches, DRR's bound holds.

    Company i's total differs from `total * w_i / sum(w)` by at most its quantum `w_i`,
    because the cursor carries an interrupted turn into the next batch.
    """
    contenders = ring(*weights)
    cursor = Cursor(0, 0)
    totals: Counter[uuid.UUID] = Counter()
    for _ in range(batches):
        ordered, credit = next_batch(contenders, cursor)
        allocation = fair_share.allocate(ordered, batch, credit)
        totals.update({i: n for i, (n, _) in allocation.shares.items()})
        cursor = allocation.cursor
    total = batch * batches
    assert sum(totals.values()) == total
    weight_sum = sum(weights)
    for contender in contenders:
        ideal = total * contender.weight / weight_sum
        assert abs(totals[contender.company_id] - ideal) <= contender.weight, (
            weights,
            batch,
            batches,
            dict(totals),
        )


@PROPERTIES
@given(companies=st.integers(2, 8), batch=st.integers(1, 30), batches=st.integers(2, 40))
def test_with_equal_weights_no_company_is_ever_two_tasks_ahead_of_another(
    companies: int, batch: int, batches: int
) -> None:
    contenders = ring(*[1] * companies)
    cursor = Cursor(0, 0)
    totals: Counter[uuid.UUID] = Counter()
    for _ in range(batches):
        ordered, credit = next_batch(contenders, cursor)
        allocation = fair_share.allocate(ordered, batch, credit)
        totals.update({i: n for i, (n, _) in allocation.shares.items()})
        cursor = allocation.cursor
        counts = [totals[c.company_id] for c in contenders]
        assert max(counts) - min(counts) <= 1, counts


unlimited_rings = st.lists(st.integers(1, 1000), min_size=0, max_size=12).map(
    lambda weights: [
        Contender(uuid.UUID(int=i + 1), 10 * (i + 1), weight, None)
        for i, weight in enumerate(weights)
    ]
)


@PROPERTIES
@given(contenders=unlimited_rings, slots=st.integers(0, 500), credit=st.integers(0, 999))
def test_the_one_lap_shortcut_allocates_as_the_turn_by_turn_rule_does(
    contenders: list[Contender], slots: int, credit: int
) -> None:
    credit = min(credit, contenders[0].weight - 1) if contenders else 0

    shortcut = fair_share._first_lap(contenders, slots, credit)
    if shortcut is None:  # more than one lap, or nothing to give: not its case
        return
    full = fair_share._rounds(contenders, slots, credit)
    assert shortcut.shares == full.shares
    assert shortcut.cursor == full.cursor
    served = full.served()
    assert [shortcut.first_turns[i] for i in served] == [full.first_turns[i] for i in served]
