"""How many tasks each company gets in a claim: deficit round robin over a batch.

Pure: no database. `db.queue.claim` reads the ready companies in ring order from the claim
cursor, asks `allocate` for each one's share of the batch, claims that many of each
company's longest-waiting runnable tasks, and stores where the turn stopped.

The rule (deficit round robin, Shreedhar and Varghese, SIGCOMM 1995, with unit-cost tasks):
companies take turns in ring order; a turn gives a company up to its `weight` tasks (its
quantum); a company with less runnable work, or at its in-flight limit, ends its turn early
and keeps no credit. So while several companies have runnable work, each one's share of
claimed tasks is its weight over the sum of weights, whatever its backlog or its tasks' ages;
with equal weights every company's next task comes before any company's following one. A
batch that fills up in the middle of a turn leaves the rest of that turn to the next batch
(`Allocation.cursor`), so shares hold across batches, not only within one.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import NamedTuple


class Contender(NamedTuple):
    """A ready company, as the claim sees it (a tuple: a claim builds up to a batch of them).

    `headroom` is how many more leases it may hold: `max_in_flight` minus its `processing`
    tasks, at least 1 (the claim passes over the others), or None when it has no limit.
    """

    company_id: uuid.UUID
    ring_position: int
    weight: int
    headroom: int | None


@dataclass(frozen=True)
class Cursor:
    """Where a turn stopped: the company's ring position and what is left of its quantum.

    `credit` 0 means the next claim starts with the company after `ring_position`.
    """

    ring_position: int
    credit: int


@dataclass(frozen=True)
class Allocation:
    """Each company's share of a batch, and the cursor after it.

    `shares` maps company id to `(tasks, turn)`: `turn` is the position of the company's
    first turn in this batch (0, 1, ...). `first_turns` maps it to the tasks of that first
    turn (what was left of an interrupted turn, else its weight), so tasks ordered by (their
    round, `turn`) come out in the order round robin serves them.
    """

    shares: dict[uuid.UUID, tuple[int, int]]
    first_turns: dict[uuid.UUID, int]
    cursor: Cursor


def allocate(contenders: list[Contender], slots: int, credit: int) -> Allocation:
    """Share `slots` tasks among `contenders`, listed in ring order from the cursor.

    `credit` is what the first contender has left of an interrupted turn (0: a full turn,
    its weight). Companies get at most their headroom. Returns only companies that get at
    least one task; the shares add up to `min(slots, sum of headrooms)`.
    """
    taken = [0] * len(contenders)
    turn_of = [-1] * len(contenders)
    first_turn = [0] * len(contenders)
    turns = 0
    left = slots
    cursor = Cursor(contenders[0].ring_position - 1, 0) if contenders else Cursor(0, 0)
    queue = [i for i, c in enumerate(contenders) if c.headroom is None or c.headroom > 0]
    at = 0
    quantum = credit if credit > 0 else 0
    while left > 0 and queue:
        i = queue[at]
        contender = contenders[i]
        quantum = quantum or contender.weight
        if turn_of[i] < 0:
            turn_of[i], first_turn[i] = turns, quantum
            turns += 1
        room = left if contender.headroom is None else contender.headroom - taken[i]
        give = min(quantum, room, left)
        taken[i] += give
        left -= give
        quantum -= give
        if contender.headroom is not None and taken[i] >= contender.headroom:
            # At its limit: its turn ends without credit, and it sits out the rest.
            queue.pop(at)
            cursor = Cursor(contender.ring_position, 0)
            quantum = 0
        elif quantum > 0:
            # The batch is full in the middle of its turn: the next batch goes on with it.
            cursor = Cursor(contender.ring_position, quantum)
            break
        else:
            cursor = Cursor(contender.ring_position, 0)
            at += 1
        if queue:
            at %= len(queue)
    served = [i for i, n in enumerate(taken) if n > 0]
    return Allocation(
        {contenders[i].company_id: (taken[i], turn_of[i]) for i in served},
        {contenders[i].company_id: first_turn[i] for i in served},
        cursor,
    )
