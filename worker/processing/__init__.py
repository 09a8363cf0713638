"""Processing passes: claim a batch of tasks, run each task's handler, finalize each task.

Words: a *pass* is one cycle (write what an earlier pass left unwritten, sweep the leases
of dead workers, claim, run, finalize); its *batch* is the tasks that pass claimed. Worker
children run pass after pass (`worker.child`), `python -m worker --once` runs one, and so does
`POST /workers/process`. The claim and every finalization are short transactions of their
own; handlers run holding no transaction and no row lock (STYLE "Database").

The pieces, each in its module:

- `one_pass`: the pass itself (`run_pass`, `ProcessingPass`);
- `outcome`: what becomes of a task after its attempt, a pure function of what its handler
  raised, its attempts and the backoff rule;
- `timeouts`: each attempt's deadline, and what happens to a handler that overruns it;
- `overruns`: the pass's watch on its running handlers, and what it writes when one overran;
- `task_result`: what a handler returned, as the JSON text its task stores;
- `finalize`: writing each outcome fenced by the task's lease, and reporting it once;
- `completer`: where the pass hands each completion (`Completer`), written in batches;
- `held_leases`: the leases a pass holds;
- `holder`: this process as a registered worker (`workers` row) and its heartbeat;
- `pauses`: whether the batch's companies were paused since the claim;
- `lease_keeper`: the thread that flushes completions and watches deadlines and pauses while
  handlers run (and beats a pass's own holder);
- `runners`: the threads that run handlers beside the pass's own (`WORKER_THREADS`);
- `unwritten`: outcomes a database error kept from being written, for the next pass;
- `sweep`: taking back the leases of dead workers, and how often;
- `database`: the pass's connection, its writes one thread at a time;
- `observer`, `result`: what a pass reports (metrics) and returns;
- `task_log`: its log lines, one per task transition.

The names below are the package's interface; the modules' other names are its internals.
"""

from __future__ import annotations

from worker.processing.database import WORKER_STATEMENT_TIMEOUT_MS
from worker.processing.holder import Holder
from worker.processing.lease_keeper import LeaseKeeper
from worker.processing.observer import PassObserver
from worker.processing.one_pass import run_pass, write_unwritten
from worker.processing.result import PassResult
from worker.processing.runners import Runners
from worker.processing.sweep import SweepSchedule
from worker.processing.timeouts import Overrun
from worker.processing.unwritten import UnwrittenOutcomes

__all__ = [
    "WORKER_STATEMENT_TIMEOUT_MS",
    "Holder",
    "LeaseKeeper",
    "Overrun",
    "PassObserver",
    "PassResult",
    "Runners",
    "SweepSchedule",
    "UnwrittenOutcomes",
    "run_pass",
    "write_unwritten",
]
