"""How many tasks each company gets in a claim: start-time fair queueing over a batch.

Pure: no database. `db.queue.claim` reads the contenders, asks `allocate` for each one's
share of the batch, claims that many of each company's longest-waiting runnable tasks, and
advances each company's virtual time by what it actually got.

The rule (start-time fair queueing, Goyal, Vin and Cheng, SIGCOMM 1996): a company with
virtual time `v` and weight `w` has its next tasks tagged `v, v + 1/w, v + 2/w, ...`; a
batch takes the `slots` smallest tags over every contender, at most `headroom` from each.
Over many batches each company's share of claimed tasks is proportional to its weight,
whatever its backlog or its tasks' ages; with equal weights and equal virtual times, every
company's next task comes before any company's following one.
"""

from __future__ import annotations

import heapq
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class Contender:
    """A company with runnable work, as the claim sees it.

    `vtime` is its virtual time already lifted to the clock (`max(own, clock)`: time spent
    idle is not banked); `headroom` is how many more leases it may hold (`max_in_flight`
    minus its `processing` tasks, or the batch size when unlimited), at least 1.
    """

    company_id: uuid.UUID
    vtime: float
    weight: int
    headroom: int


def allocate(contenders: list[Contender], slots: int) -> dict[uuid.UUID, int]:
    """Each contender's share of `slots` tasks: the `slots` smallest start tags.

    Ties between equal tags go to the contender listed first (the claim lists them by stored
    virtual time, then company id). Returns only contenders that get at least one slot; the
    shares add up to `min(slots, sum of headrooms)`.
    """
    shares: dict[uuid.UUID, int] = {}
    # (next start tag, position in the list, taken so far)
    heap = [(c.vtime, i, 0) for i, c in enumerate(contenders) if c.headroom > 0]
    heapq.heapify(heap)
    for _ in range(slots):
        if not heap:
            break
        _, i, taken = heap[0]
        contender = contenders[i]
        taken += 1
        shares[contender.company_id] = taken
        if taken < contender.headroom:
            heapq.heapreplace(heap, (contender.vtime + taken / contender.weight, i, taken))
        else:
            heapq.heappop(heap)
    return shares
