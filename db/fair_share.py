"""How many tasks each company gets in a claim: deficit round robin over a batch.

Pure: no database. The reference model of the claim's allocation: the claim itself shares
its batch inside PostgreSQL (`fairq_allocate` in db/sql/claim.sql, step for step this
module's `_rounds`), and a property test drives random rings, weights, limits and credits
through both and compares (tests/test_claim_function.py). Change one, change the other.

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
from collections.abc import Sequence
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
    """Each contender's share of a batch, and the cursor after it.

    Lists run parallel to the contenders: `tasks[i]` for contender `i`, `turns[i]` the place
    of its first turn in this batch (0, 1, ...; -1 if it gets nothing), `first_turns[i]` the
    tasks of that first turn (what was left of an interrupted turn, else its weight). Tasks
    ordered by (their round, turn) come out in the order round robin serves them.
    """

    contenders: Sequence[Contender]
    tasks: list[int]
    turns: list[int]
    first_turns: list[int]
    cursor: Cursor

    def served(self) -> list[int]:
        """Positions in `contenders` of those that get at least one task, in ring order."""
        return [i for i, n in enumerate(self.tasks) if n > 0]

    @property
    def shares(self) -> dict[uuid.UUID, tuple[int, int]]:
        """Company id to `(tasks, turn)`, for those that get at least one task."""
        return {
            self.contenders[i].company_id: (self.tasks[i], self.turns[i]) for i in self.served()
        }


def allocate(contenders: Sequence[Contender], slots: int, credit: int) -> Allocation:
    """Share `slots` tasks among `contenders`, listed in ring order from the cursor.

    `credit` is what the first contender has left of an interrupted turn (0: a full turn,
    its weight). Companies get at most their headroom. Returns only companies that get at
    least one task; the shares add up to `min(slots, sum of headrooms)`.
    """
    fast = _first_lap(contenders, slots, credit)
    return fast if fast is not None else _rounds(contenders, slots, credit)


def _first_lap(contenders: Sequence[Contender], slots: int, credit: int) -> Allocation | None:
    """The common case in one pass: no limits, and one lap fills the batch; else None.

    What `_rounds` computes for it (a property test compares them), without its queue.
    """
    if slots <= 0:
        return None
    n = len(contenders)
    tasks = [0] * n
    turns = [-1] * n
    first_turns = [0] * n
    left = slots
    for i, contender in enumerate(contenders):
        if contender.headroom is not None:
            return None
        quantum = credit if i == 0 and credit > 0 else contender.weight
        give = quantum if quantum < left else left
        tasks[i], turns[i], first_turns[i] = give, i, quantum
        left -= give
        if left == 0:
            return Allocation(
                contenders,
                tasks,
                turns,
                first_turns,
                Cursor(contender.ring_position, quantum - give),
            )
    return None


def _rounds(contenders: Sequence[Contender], slots: int, credit: int) -> Allocation:
    """Round robin turn by turn: any headroom, any number of laps."""
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
    return Allocation(contenders, taken, turn_of, first_turn, cursor)
