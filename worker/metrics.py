"""Worker metrics (design §7) in Prometheus multiprocess mode, and the port that serves them.

Importing this module imports `prometheus_client`, which picks its value storage then: the
supervisor imports it only after `common.metrics_dir.prepare` (metrics created otherwise stay
in one process's memory, invisible to the supervisor's scrape).

Children record task metrics through `TaskMetrics` (one set per child, written to that
child's files), the supervisor what only it knows through `SupervisorMetrics` (its own files);
the supervisor's exporter process (`worker.exporter`) serves the sum over every file.
"""

from __future__ import annotations

import bisect
import collections
import logging
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

log = logging.getLogger("fairq.worker.metrics")

# Handlers range from a no-op (microseconds) to `sleep` and webhooks (up to minutes).
TASK_DURATION_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
# A claim takes a few milliseconds when healthy (decision 0002, "Measurements").
CLAIM_DURATION_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip


class TaskMetrics:
    """The task metrics of one child; the processing pass reports to it as its observer.

    Create it in the child, after the fork. The metrics are not registered anywhere: in
    multiprocess mode their values live in this process's files, which the supervisor's
    `MultiProcessCollector` reads. `type` labels are registered task type names only, so
    their number is bounded (design §7).

    The API creates one too, for the passes of `POST /workers/process`, registered in the
    app's `registry` (read from there outside multiprocess mode). One set per process: two
    sets would write the same series of one multiprocess file.
    """

    def __init__(
        self, task_types: Iterable[str] = (), *, registry: CollectorRegistry | None = None
    ) -> None:
        # Per type: the completed counter's and the duration histogram's labelled children,
        # looked up once instead of on every report.
        self._completions: dict[str, tuple[Counter, Histogram]] = {}
        self.tasks_claimed = Counter(
            "tasks_claimed_total", "Tasks moved to processing by a claim.", registry=registry
        )
        self.tasks_completed = Counter(
            "tasks_completed_total", "Tasks completed.", ["type"], registry=registry
        )
        self.tasks_retried = Counter(
            "tasks_retried_total", "Task attempts that failed and were scheduled again.",
            ["type"], registry=registry,
        )  # fmt: skip
        self.tasks_failed = Counter(
            "tasks_failed_total", "Tasks failed for good.", ["type"], registry=registry
        )
        self.tasks_released = Counter(
            "tasks_released_total", "Claimed tasks handed back unstarted (shutdown).",
            registry=registry,
        )  # fmt: skip
        self.tasks_lease_lost = Counter(
            "tasks_lease_lost_total",
            "Finalizations refused because the lease had been taken over.",
            registry=registry,
        )
        self.task_duration = Histogram(
            "task_duration_seconds", "Handler run time per task.", ["type"],
            buckets=TASK_DURATION_BUCKETS, registry=registry,
        )  # fmt: skip
        self.claim_duration = Histogram(
            "claim_duration_seconds", "Duration of one claim transaction.",
            buckets=CLAIM_DURATION_BUCKETS, registry=registry,
        )  # fmt: skip
        # Every type's series exists from the start at 0: rate() and increase() then see
        # a type's first event, and a type that only ever fails still has a completed series.
        for task_type in task_types:
            for per_type in (self.tasks_completed, self.tasks_retried, self.tasks_failed):
                per_type.labels(task_type)
            self.task_duration.labels(task_type)

    def claimed(self, n: int) -> None:
        """`n` tasks were claimed."""
        if n:
            self.tasks_claimed.inc(n)

    def claim_seconds(self, seconds: float) -> None:
        """One claim transaction took `seconds`."""
        self.claim_duration.observe(seconds)

    def completed(self, task_type: str, seconds: Sequence[float]) -> None:
        """`len(seconds)` tasks of `task_type` completed, each after running that long."""
        if not seconds:
            return
        children = self._completions.get(task_type)
        if children is None:
            children = self.tasks_completed.labels(task_type), self.task_duration.labels(task_type)
            self._completions[task_type] = children
        counter, durations = children
        counter.inc(len(seconds))
        observe_all(durations, seconds)

    def retried(self, task_type: str, seconds: float | None = None) -> None:
        """A `task_type` attempt failed and was scheduled again (after running `seconds`)."""
        self.tasks_retried.labels(task_type).inc()
        if seconds is not None:
            self.task_duration.labels(task_type).observe(seconds)

    def failed(self, task_type: str, seconds: float | None = None) -> None:
        """A `task_type` task failed for good (after running `seconds`)."""
        self.tasks_failed.labels(task_type).inc()
        if seconds is not None:
            self.task_duration.labels(task_type).observe(seconds)

    def released(self, n: int) -> None:
        """`n` claimed tasks were handed back unstarted."""
        if n:
            self.tasks_released.inc(n)

    def lease_lost(self, n: int = 1) -> None:
        """`n` finalizations matched no row: the lease had been taken over."""
        if n:
            self.tasks_lease_lost.inc(n)


def observe_all(histogram: Histogram, amounts: Sequence[float]) -> None:
    """`histogram.observe(amount)` for each amount, with one write per bucket touched.

    In multiprocess mode every `observe` writes the sum and one bucket to this process's
    mmapped file, each write under a lock and with a `getpid()` system call: per task, that
    was a tenth of a busy child's CPU. A batch of completions touches a bucket or two. Takes
    a labelled child (or an unlabelled histogram) and uses `Histogram`'s `_upper_bounds`,
    `_buckets` and `_sum`, as `observe` does (prometheus-client is pinned; a test compares
    the two).
    """
    # A NaN is in no bucket (`amount <= bound` is false for all): `observe` knows.
    for amount in amounts:
        if math.isnan(amount):
            histogram.observe(amount)
    amounts = [amount for amount in amounts if not math.isnan(amount)]
    # bisect_left: the first bound >= amount, the bucket `observe` picks (`amount <= bound`).
    buckets = collections.Counter(
        bisect.bisect_left(histogram._upper_bounds, amount) for amount in amounts
    )
    histogram._sum.inc(sum(amounts))
    for index, count in buckets.items():
        histogram._buckets[index].inc(count)


class SupervisorMetrics:
    """`worker_children`, `worker_child_restarts_total` and `worker_child_timeouts_total`.

    Create it in the supervisor, after `common.metrics_dir.prepare`: its values live in the
    supervisor's own multiprocess files, which the exporter sums with the children's. The
    gauge is `livesum`: it disappears with the supervisor's process.
    """

    def __init__(self) -> None:
        self.children = Gauge(
            "worker_children",
            "Worker children alive (booting and retiring ones included, hung ones not).",
            multiprocess_mode="livesum", registry=None,
        )  # fmt: skip
        self.restarts = Counter(
            "worker_child_restarts",
            "Children that died unexpectedly, or exited because a handler overran its "
            "task's deadline, and were replaced.",
            registry=None,
        )  # fmt: skip
        self.timeouts = Counter(
            "worker_child_timeouts",
            "Hung children (silent for WORKER_CHILD_TIMEOUT_SECONDS) killed and replaced.",
            registry=None,
        )


class FilesCollector:
    """prometheus_client's multiprocess merge of the metrics files in a directory.

    Unlike `MultiProcessCollector`, it passes over empty files: a child that is creating its
    file has not sized it yet, and reading it then fails the whole scrape with struct.error
    (prometheus/client_python#604). An empty file holds no values anyway.
    """

    def __init__(self, directory: Path) -> None:
        self._directory = directory

    def collect(self) -> Iterable[Metric]:
        """The merged metrics of every non-empty `*.db` file."""
        files = [str(path) for path in self._directory.glob("*.db") if _has_content(path)]
        merged: Iterable[Metric] = MultiProcessCollector.merge(files, accumulate=True)  # type: ignore[no-untyped-call]
        return merged


def _has_content(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except FileNotFoundError:  # its process died and the file was removed meanwhile
        return False


def forget_process(directory: Path, pid: int) -> None:
    """Drop the live-gauge files of dead process `pid`; its counters stay in the totals."""
    mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]  # untyped library
