"""Worker metrics (design §7) in Prometheus multiprocess mode, and the port that serves them.

Importing this module imports `prometheus_client`, which picks its value storage then: the
supervisor imports it only after `common.metrics_dir.prepare` (metrics created otherwise stay
in one process's memory, invisible to the supervisor's scrape).

Children record task metrics through `TaskMetrics` (one set per child, written to that
child's files); the supervisor serves the sum over every child's files, plus the metrics only
it knows (`worker_children`, `worker_child_restarts_total`, `worker_child_timeouts_total`),
from `MetricsServer`, which its own select loop drives: no threads in a process that forks.
"""

from __future__ import annotations

import bisect
import collections
import json
import logging
import math
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest as _generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

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


class SupervisorCollector(Collector):
    """`worker_children`, `worker_child_restarts_total` and `worker_child_timeouts_total`.

    Read from the supervisor at scrape. The supervisor is the only process that knows them,
    and it serves the scrape itself, so they need no multiprocess files (and no gauge mode
    that a dead child could leave behind).
    """

    def __init__(
        self, children: Callable[[], int], restarts: Callable[[], int], timeouts: Callable[[], int]
    ) -> None:
        self._children = children
        self._restarts = restarts
        self._timeouts = timeouts

    def describe(self) -> list[Metric]:
        """Nothing to describe ahead of a scrape."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Yield the current child count and the restart and timeout totals."""
        yield GaugeMetricFamily(
            "worker_children",
            "Worker children alive (booting and retiring ones included, hung ones not).",
            value=self._children(),
        )
        yield CounterMetricFamily(
            "worker_child_restarts",
            "Children that died unexpectedly, or gave up on a handler they could not stop at "
            "its timeout, and were replaced.",
            value=self._restarts(),
        )  # fmt: skip
        yield CounterMetricFamily(
            "worker_child_timeouts",
            "Hung children (silent for WORKER_CHILD_TIMEOUT_SECONDS) killed and replaced.",
            value=self._timeouts(),
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


def render(directory: Path, extra: Collector) -> bytes:
    """The Prometheus text of every metrics file in `directory` plus `extra`'s metrics."""
    registry = CollectorRegistry()
    registry.register(FilesCollector(directory))
    registry.register(extra)
    return _generate_latest(registry)


def forget_process(directory: Path, pid: int) -> None:
    """Drop the live-gauge files of dead process `pid`; its counters stay in the totals."""
    mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]  # untyped library


# A scrape request is a few hundred bytes; anything this large is not one.
_MAX_REQUEST_BYTES = 8192
# A client that has not sent its request by then is dropped (it holds a file descriptor).
_CLIENT_TIMEOUT_SECONDS = 5.0
# Bounds how long one slow reader can hold up the supervisor loop while we send.
_SEND_TIMEOUT_SECONDS = 2.0


_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
}


@dataclass
class _Client:
    sock: socket.socket
    deadline: float
    buffer: bytearray = field(default_factory=bytearray)


class MetricsServer:
    """A minimal HTTP server for `GET /metrics` and `GET /health`, driven by a select loop.

    Not prometheus_client's: `start_http_server` serves from a thread (unsafe before fork),
    and its thread-free path (wsgiref) reads requests blocking, so one slow client would
    stall the supervisor's loop (decision 0004).

    The owner polls `sockets()` for readability and passes the ready ones to `handle()`. One
    request per connection (`Connection: close`); requests are read without blocking, and
    the response is written with a short blocking send, so a stalled reader delays the owner
    by at most `_SEND_TIMEOUT_SECONDS`. `port` is the bound port (useful with port 0).
    """

    def __init__(self, host: str, port: int, metrics: Callable[[], bytes]) -> None:
        self._metrics = metrics
        self._listener = socket.create_server((host, port), backlog=64)
        self._listener.setblocking(False)
        self._clients: dict[int, _Client] = {}

    @property
    def port(self) -> int:
        """The port the server listens on."""
        port: int = self._listener.getsockname()[1]
        return port

    def sockets(self) -> list[socket.socket]:
        """The listening socket and every open client connection."""
        return [self._listener, *(client.sock for client in self._clients.values())]

    def handle(self, ready: Iterable[int]) -> None:
        """Accept or serve the ready file descriptors that are ours; drop idle clients."""
        for fd in ready:
            if fd == self._listener.fileno():
                self._accept()
            elif fd in self._clients:
                self._read(self._clients[fd])
        now = time.monotonic()
        for client in [c for c in self._clients.values() if c.deadline < now]:
            self._drop(client)

    def owns(self, fd: int) -> bool:
        """Tell whether `fd` is the listener or one of our client connections."""
        return fd == self._listener.fileno() or fd in self._clients

    def close(self) -> None:
        """Close the listener and every client connection."""
        for client in list(self._clients.values()):
            self._drop(client)
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: keep serving the clients we have
                log.warning("metrics server cannot accept: %s", exc)
                return
            sock.setblocking(False)
            deadline = time.monotonic() + _CLIENT_TIMEOUT_SECONDS
            self._clients[sock.fileno()] = _Client(sock, deadline)

    def _read(self, client: _Client) -> None:
        try:
            chunk = client.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(client)
            return
        if not chunk:
            self._drop(client)
            return
        client.buffer += chunk
        if b"\r\n\r\n" in client.buffer or b"\n\n" in client.buffer:
            self._respond(client)
        elif len(client.buffer) > _MAX_REQUEST_BYTES:
            self._send(client, 431, "text/plain", b"request header fields too large\n")

    def _respond(self, client: _Client) -> None:
        request_line = bytes(client.buffer).split(b"\n", 1)[0].decode("latin-1").strip()
        parts = request_line.split()
        if len(parts) < 2:
            self._send(client, 400, "text/plain", b"bad request\n")
            return
        method, target = parts[0], parts[1]
        path = target.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            self._send(client, 405, "text/plain", b"method not allowed\n", head=False)
        elif path == "/metrics":
            try:
                body = self._metrics()
            except Exception:  # a broken metrics file must not take the supervisor down
                log.exception("rendering metrics failed")
                self._send(client, 500, "text/plain", b"metrics unavailable\n")
                return
            self._send(client, 200, CONTENT_TYPE_LATEST, body, head=method == "HEAD")
        elif path == "/health":
            body = json.dumps({"status": "ok"}).encode() + b"\n"
            self._send(client, 200, "application/json", body, head=method == "HEAD")
        else:
            self._send(client, 404, "text/plain", b"not found\n", head=method == "HEAD")

    def _send(
        self, client: _Client, status: int, content_type: str, body: bytes, *, head: bool = False
    ) -> None:
        reason = _REASONS[status]
        header = (
            f"HTTP/1.1 {status} {reason}\r\n"
            f"Content-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode("latin-1")
        try:
            client.sock.settimeout(_SEND_TIMEOUT_SECONDS)
            client.sock.sendall(header if head else header + body)
        except OSError as exc:
            log.debug("metrics client went away: %s", exc)
        self._drop(client)

    def _drop(self, client: _Client) -> None:
        self._clients.pop(client.sock.fileno(), None)
        client.sock.close()
