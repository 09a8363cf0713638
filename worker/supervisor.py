"""The worker supervisor (design §5): forks children and keeps the right number alive.

Modelled on gunicorn's arbiter: one single-threaded loop. Signal handlers only record
(`signal.set_wakeup_fd` writes each signal's number into a pipe that wakes the loop's
`poll()`); the loop dispatches them to `handle_term` ... `handle_chld`, reaps
(`waitpid(-1, WNOHANG)`), kills overdue and hung children, and runs `reconcile()`, the one
idempotent step that spawns missing children and retires the oldest surplus ones. The same
`poll()` reads each child's status pipe (`worker.child_process`). The metrics port is served
by a side process, the exporter (`worker.exporter`, decision 0004), kept running like a child.

A child whose handler overran its deadline writes what it owed, names the task on its status
pipe and exits `child.HANDLER_STUCK`: logged, counted as a restart, replaced (decision 0013).
A hung child (silent on its alive pipe for `child_timeout`, measured on the monotonic clock)
is killed with SIGKILL, counted in `timeouts` and replaced; its tasks go back through the
sweep once its `workers` row is stale (decision 0010).

Signals: TERM and INT stop gracefully (TERM every child, reap every 100 ms for up to
`shutdown_timeout`, KILL the rest); QUIT is the same with `QUICK_SHUTDOWN_SECONDS` of grace;
TTIN/TTOU add or retire one child (the oldest); HUP replaces every child, one at a time. A
child that cannot boot is retried with backoff, one at a time; `run()` returns
`BOOT_FAILED_EXIT` after `BOOT_FAILURE_LIMIT` failures in a row while none works. Design §5.

The supervisor never opens a database connection, and starts no thread: the children it
forks inherit nothing they could share by mistake.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from common import logging as fairq_logging
from common import metrics_dir
from worker import backoff, child, exporter
from worker.child_process import ChildProcess
from worker.settings import WorkerSettings

if TYPE_CHECKING:
    from worker import metrics

log = logging.getLogger("fairq.worker.supervisor")

# The signals the loop handles; blocked around fork() so no supervisor handler runs in a
# child before the child has installed its own.
SIGNALS = (
    signal.SIGHUP, signal.SIGQUIT, signal.SIGINT, signal.SIGTERM,
    signal.SIGTTIN, signal.SIGTTOU, signal.SIGCHLD,
)  # fmt: skip
SIGNAL_NAMES: dict[int, str] = {int(sig): sig.name[3:].lower() for sig in SIGNALS}

# Exit status of the supervisor when children keep failing to boot (gunicorn uses 3 too).
BOOT_FAILED_EXIT = 3
# Boot failures in a row, without a successful boot in between and within the window, that
# stop the supervisor instead of crash-looping against a database that is not there; only
# while no child is working, else it keeps retrying (one booting child at a time).
BOOT_FAILURE_LIMIT = 5
BOOT_FAILURE_WINDOW_SECONDS = 60.0

# Respawn delay after an unexpected death: `backoff.ceiling` of the deaths in the window.
RESTART_BACKOFF_BASE_SECONDS = 0.25
RESTART_BACKOFF_MAX_SECONDS = 10.0
RESTART_BACKOFF_WINDOW_SECONDS = 60.0
# A child that ran this long before dying was healthy: its death does not grow the backoff
# for its successor (supervisord's `startsecs`). Only quick deaths in a row back off.
RESTART_STABLE_AFTER_SECONDS = 5.0

# Grace of SIGQUIT: long enough for children to hand back their unstarted tasks.
QUICK_SHUTDOWN_SECONDS = 1.0
# How often the graceful stop reaps (SIGCHLD wakes it sooner).
STOP_REAP_INTERVAL_SECONDS = 0.1
# After SIGKILL, how long to wait for the kernel to hand back the corpses.
KILL_REAP_SECONDS = 5.0
# Upper bound of one loop iteration: retire deadlines, hung children and idle clients are
# checked this often (or twice per `child_timeout`, if that is shorter).
TICK_SECONDS = 1.0

ChildMain = Callable[[WorkerSettings, child.Inherited], int]


class SupervisorError(RuntimeError):
    """The supervisor cannot start (metrics port taken, ...); the message says why."""


@dataclass(frozen=True)
class _StopRequest:
    reason: str
    timeout: float
    exit_code: int = 0


class Supervisor:
    """Keeps `settings.concurrency` children running until told to stop; see the module doc.

    `metrics_port_file`: where to write the metrics port once listening (for port 0).
    `child_main`: what a forked child runs (tests may substitute it).
    """

    def __init__(
        self,
        settings: WorkerSettings,
        *,
        metrics_port_file: Path | None = None,
        child_main: ChildMain = child.main,
    ) -> None:
        self.settings = settings
        self.desired = settings.concurrency
        self.children: dict[int, ChildProcess] = {}
        self.restarts = 0
        self.timeouts = 0
        self._child_main = child_main
        self._metrics_port_file = metrics_port_file
        self._generation = 0
        self._stop: _StopRequest | None = None
        self._spawn_after = 0.0
        self._deaths: collections.deque[float] = collections.deque()
        self._boot_failures: collections.deque[float] = collections.deque()
        # Boot failures since the last successful boot: their backoff, and while any, one
        # booting child at a time.
        self._boot_streak = 0
        self._wake_r = -1
        self._wake_w = -1
        self._exporter: exporter.Exporter | None = None
        self._metrics: metrics.SupervisorMetrics | None = None
        self._metrics_dir: Path | None = None
        self._stopping = False

    # -- lifecycle ------------------------------------------------------------------------

    def run(self) -> int:
        """Run until stopped; return the exit status (0, or `BOOT_FAILED_EXIT`).

        Raises `SupervisorError` when it cannot start.
        """
        try:
            self._setup()
            log.info(
                "supervisor %s starting %d children (batch %d, poll %.2fs)",
                os.getpid(), self.desired, self.settings.batch_size,
                self.settings.poll_interval,
            )  # fmt: skip
            while True:
                self.reap()  # may request a stop: children that cannot boot
                if self._stop_requested():
                    break
                self.kill_overdue()
                self.kill_hung()
                self.reconcile()
                self._keep_exporting()
                for signum in self._wait(self._tick_timeout()):
                    self._dispatch(signum)
                if self._stop_requested():
                    break
            stop = self._stop
            assert stop is not None
            log.info("stopping (%s): %d children", stop.reason, len(self.children))
            self.shutdown(stop.timeout)
            if stop.exit_code:
                log.error("supervisor stopped: %s", stop.reason)
            else:
                log.info("supervisor stopped")
            return stop.exit_code
        finally:
            if self.children:  # only after an unexpected error: do not leave orphans behind
                self.shutdown(QUICK_SHUTDOWN_SECONDS)
            self._teardown()

    def _keep_exporting(self) -> None:
        """Publish the child count and keep the metrics exporter running."""
        if self._metrics is not None:
            self._metrics.children.set(self.live_children())
        if self._exporter is not None:
            self._exporter.keep_running()

    def _stop_requested(self) -> bool:
        return self._stop is not None

    def _setup(self) -> None:
        try:
            self._metrics_dir = metrics_dir.prepare(
                self.settings.prometheus_multiproc_dir, prefix="fairq-worker-metrics-"
            )
        except metrics_dir.MetricsDirError as exc:
            raise SupervisorError(str(exc)) from exc
        directory = self._metrics_dir
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in SIGNALS:
            signal.signal(sig, _record_only)
        # Imported only after metrics_dir.prepare: it imports prometheus_client, which picks
        # its value storage from the variable then, for this process and every child.
        from worker import metrics  # noqa: PLC0415

        self._metrics = metrics.SupervisorMetrics()
        host, port = self.settings.metrics_host, self.settings.metrics_port
        try:
            self._exporter = exporter.Exporter(host, port, directory, self._supervisor_fds)
        except OSError as exc:
            raise SupervisorError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
        port = self._exporter.port
        self._exporter.keep_running()  # before any child, so the port answers at once
        log.info("metrics and /health on http://%s:%d", self.settings.metrics_host, port)
        if self._metrics_port_file is not None:
            tmp = self._metrics_port_file.with_name(self._metrics_port_file.name + ".tmp")
            tmp.write_text(f"{port}\n")
            tmp.replace(self._metrics_port_file)  # readers never see a half-written file

    def _teardown(self) -> None:
        if self._exporter is not None:
            self._exporter.stop()
            self._exporter.close()
            self._exporter = None
        signal.set_wakeup_fd(-1)
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        for proc in self.children.values():
            proc.close_pipes()
        metrics_dir.remove_temporary()

    # -- the loop's wait ------------------------------------------------------------------

    def _tick_timeout(self) -> float:
        timeout = min(TICK_SECONDS, self.settings.child_timeout / 2)
        if self._missing_children() and self._spawn_after > 0:
            timeout = min(timeout, max(0.0, self._spawn_after - time.monotonic()))
        for proc in self.children.values():
            if proc.kill_at is not None and not proc.killed:
                timeout = min(timeout, max(0.0, proc.kill_at - time.monotonic()))
        return timeout

    def _missing_children(self) -> bool:
        return sum(1 for p in self.children.values() if not p.retiring) < self.desired

    def _wait(self, timeout: float) -> list[int]:
        """Sleep until a signal, a child's status or `timeout`; return the signals."""
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        status_fds = {p.status_fd: p for p in self.children.values() if p.status_fd >= 0}
        for fd in status_fds:
            poller.register(fd, select.POLLIN)
        try:
            events = poller.poll(max(0, int(timeout * 1000)))
        except InterruptedError:  # pragma: no cover  (PEP 475 retries; kept for safety)
            events = []
        ready = [fd for fd, _ in events]
        signals: list[int] = []
        if self._wake_r in ready:
            signals = self._drain_wakeups()
        for fd in ready:
            if fd in status_fds:
                self._read_status(status_fds[fd])
        return signals

    def _drain_wakeups(self) -> list[int]:
        signals: list[int] = []
        while True:
            try:
                data = os.read(self._wake_r, 512)
            except (BlockingIOError, InterruptedError):
                break
            if not data:
                break
            signals.extend(data)  # set_wakeup_fd writes each signal's number as one byte
        return signals

    # -- signals --------------------------------------------------------------------------

    def _dispatch(self, signum: int) -> None:
        name = SIGNAL_NAMES.get(signum)
        if name is None:
            return
        if name != "chld":
            log.info("received SIG%s", name.upper())
        handler: Callable[[], None] = getattr(self, f"handle_{name}")
        handler()

    def handle_term(self) -> None:
        """Graceful stop: children finish their tasks in hand and release the rest."""
        self._stop = _StopRequest("SIGTERM", self.settings.shutdown_timeout)

    def handle_int(self) -> None:
        """Same as TERM (Ctrl-C in a terminal)."""
        self._stop = _StopRequest("SIGINT", self.settings.shutdown_timeout)

    def handle_quit(self) -> None:
        """Immediate stop: TERM, `QUICK_SHUTDOWN_SECONDS` of grace, then KILL."""
        self._stop = _StopRequest(
            "SIGQUIT", min(QUICK_SHUTDOWN_SECONDS, self.settings.shutdown_timeout)
        )

    def handle_ttin(self) -> None:
        """One child more, never above `max_concurrency`."""
        if self.desired >= self.settings.max_concurrency:
            log.warning(
                "SIGTTIN ignored: already %d children, WORKER_MAX_CONCURRENCY", self.desired
            )
            return
        self.desired += 1
        log.info("desired children: %d", self.desired)

    def handle_ttou(self) -> None:
        """One child fewer, never below one."""
        self.desired = max(self.desired - 1, 1)
        log.info("desired children: %d", self.desired)

    def handle_hup(self) -> None:
        """Rolling restart: every current child is replaced, one at a time."""
        self._generation += 1
        log.info("rolling restart of %d children", len(self.children))

    def handle_chld(self) -> None:
        """Nothing: a child exited, and the loop reaps right after dispatching."""

    # -- children -------------------------------------------------------------------------

    def reap(self) -> None:
        """Collect every exited child and decide what its exit means."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self._exporter is not None and self._exporter.owns(pid):
                self._exporter.exited(status)
                continue
            proc = self.children.pop(pid, None)
            if proc is None:
                continue
            self._read_status(proc)
            proc.close_pipes()
            self._mark_dead(pid)
            self._on_exit(proc, status)

    def _on_exit(self, proc: ChildProcess, status: int) -> None:
        now = time.monotonic()
        code, how = proc.describe_exit(status)
        if proc.retiring or self._stopping:
            level = logging.INFO if code in (0, None) else logging.WARNING
            if code == child.HANDLER_STUCK:
                how = f"{how}: {proc.stuck_handler}"
            log.log(level, "child %d exited (%s)", proc.pid, how)
            return
        delay = self._restart_delay(proc, now)
        self._spawn_after = now + delay
        if proc.hung:  # counted in `timeouts` when it was killed
            log.error(
                "hung child %d is dead (%s); the tasks it held go back to the queue; "
                "replacing it in %.2fs", proc.pid, how, delay,
            )  # fmt: skip
            return
        self.restarts += 1
        if self._metrics is not None:
            self._metrics.restarts.inc()
        if code == child.BOOT_ERROR:
            self._on_boot_failure(proc, now)
            return
        if code == child.HANDLER_STUCK:
            # Its pass wrote the task's timeout and what else it owed; whatever it could not
            # write, its leases, the sweep takes back once its row is stale.
            log.error(
                "child %d exited: %s (a handler that ignores its deadline); the rest of its "
                "batch went back to the queue; replacing it in %.2fs",
                proc.pid, proc.stuck_handler, delay,
            )  # fmt: skip
            return
        log.error("child %d died unexpectedly (%s); replacing it in %.2fs", proc.pid, how, delay)

    def _restart_delay(self, proc: ChildProcess, now: float) -> float:
        """Seconds before a dead child's successor: the ceiling of the quick deaths in a row."""
        if now - proc.started_at >= RESTART_STABLE_AFTER_SECONDS:
            self._deaths.clear()
        self._deaths.append(now)
        while self._deaths and now - self._deaths[0] > RESTART_BACKOFF_WINDOW_SECONDS:
            self._deaths.popleft()
        return backoff.ceiling(
            len(self._deaths), base=RESTART_BACKOFF_BASE_SECONDS, cap=RESTART_BACKOFF_MAX_SECONDS
        )

    def _on_boot_failure(self, proc: ChildProcess, now: float) -> None:
        """Retry with backoff; stop the supervisor only if no child works and none can boot."""
        reason = proc.boot_error
        self._boot_streak += 1
        # A boot that waited out the database (WORKER_BOOT_TIMEOUT_SECONDS) is no quick
        # death, yet failures in a row must still back off.
        streak_delay = backoff.ceiling(
            self._boot_streak, base=RESTART_BACKOFF_BASE_SECONDS, cap=RESTART_BACKOFF_MAX_SECONDS
        )
        self._spawn_after = max(self._spawn_after, now + streak_delay)
        delay = self._spawn_after - now
        self._boot_failures.append(now)
        while self._boot_failures and now - self._boot_failures[0] > BOOT_FAILURE_WINDOW_SECONDS:
            self._boot_failures.popleft()
        working = self.working_children()
        if working:
            # Never stop children that work because another cannot join them (the database
            # refuses more connections, ...): keep trying, one booting child at a time.
            log.error(
                "child %d could not boot: %s; retrying in %.2fs (%d failures in a row; "
                "%d working children carry on)", proc.pid, reason, delay, self._boot_streak,
                working,
            )  # fmt: skip
            return
        if len(self._boot_failures) < BOOT_FAILURE_LIMIT:
            log.error("child %d could not boot: %s; retrying in %.2fs", proc.pid, reason, delay)
            return
        log.error("child %d could not boot: %s", proc.pid, reason)
        if self._stop is not None:
            return  # already stopping: the first reason stands
        self._stop = _StopRequest(
            f"children failed to boot {len(self._boot_failures)} times in a row and none "
            f"is working; last reason: {reason}",
            self.settings.shutdown_timeout,
            BOOT_FAILED_EXIT,
        )

    def _mark_dead(self, pid: int) -> None:
        from worker import metrics  # noqa: PLC0415  (see _setup)

        if self._metrics_dir is not None:
            metrics.forget_process(self._metrics_dir, pid)

    def live_children(self) -> int:
        """Children not hung nor killed (`worker_children`): booting and retiring ones count."""
        return sum(1 for p in self.children.values() if not p.killed)

    def working_children(self) -> int:
        """Children that booted and are neither retiring nor hung nor killed."""
        return sum(1 for p in self.children.values() if p.booted and not (p.retiring or p.killed))

    def kill_hung(self) -> None:
        """SIGKILL children that have not said they are alive for `child_timeout`.

        Stopped (SIGSTOP, a frozen cgroup) or stuck: a child that works says so every second
        (`liveness.AliveSignal`). Its tasks go back to the queue once it is reaped.
        """
        now = time.monotonic()
        for proc in self.children.values():
            if proc.killed:
                continue
            if proc.drain_alive():
                proc.alive_at = now
                continue
            silent = now - proc.alive_at
            if silent < self.settings.child_timeout:
                continue
            proc.hung = True
            self.timeouts += 1
            if self._metrics is not None:
                self._metrics.timeouts.inc()
            log.error(
                "child %d gave no sign of life for %.1fs (WORKER_CHILD_TIMEOUT_SECONDS=%g): "
                "stopped or stuck; killing it", proc.pid, silent, self.settings.child_timeout,
            )  # fmt: skip
            self._kill(proc)

    def kill_overdue(self) -> None:
        """SIGKILL retired children still running `shutdown_timeout` after their TERM."""
        now = time.monotonic()
        for proc in self.children.values():
            if proc.kill_at is not None and proc.kill_at <= now and not proc.killed:
                log.warning("retired child %d did not stop in time; killing it", proc.pid)
                self._kill(proc)

    def reconcile(self) -> None:
        """Make the children match the desired count; safe to call any number of times.

        Retires the oldest children beyond the desired count (one more is allowed while a
        rolling restart has a replacement up), advances the rolling restart by at most one
        child, and spawns missing children once the restart backoff has passed (one at a
        time while children fail to boot).
        """
        if self._stop is not None:
            return
        active = self._active()
        outdated = [p for p in active if p.generation < self._generation]
        allowance = 1 if outdated else 0
        for proc in active[: max(0, len(active) - (self.desired + allowance))]:
            self._retire(proc, "surplus")
        active = self._active()
        outdated = [p for p in active if p.generation < self._generation]
        retiring = any(p.retiring for p in self.children.values())
        if outdated and not retiring and len(active) > self.desired:
            fresh = [p for p in active if p.generation == self._generation]
            if all(p.booted for p in fresh):
                self._retire(outdated[0], "rolling restart")
                return
        allowance = 1 if outdated and not retiring else 0
        while len(self._active()) < self.desired + allowance:
            if time.monotonic() < self._spawn_after:
                return
            if self._boot_streak and any(not p.booted for p in self._active()):
                return  # children fail to boot: try one at a time until one does
            if not self.spawn():
                return

    def _active(self) -> list[ChildProcess]:
        """Children not being retired, oldest first."""
        return sorted(
            (p for p in self.children.values() if not p.retiring), key=lambda p: p.started_at
        )

    def _retire(self, proc: ChildProcess, why: str) -> None:
        log.info("retiring child %d (%s)", proc.pid, why)
        proc.retiring = True
        proc.kill_at = time.monotonic() + self.settings.shutdown_timeout
        self._signal(proc.pid, signal.SIGTERM)

    def spawn(self) -> bool:
        """Fork one child; return False when fork failed (retried after a delay)."""
        status_r, status_w = os.pipe()
        alive_r, alive_w = os.pipe()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        inherited = child.Inherited(
            # Read before forking: if the supervisor died between fork and the child's
            # getppid(), the child would record pid 1 as its parent and never notice it was
            # orphaned.
            parent_pid=os.getpid(),
            status_fd=status_w,
            signal_mask=frozenset(signal.Signals(sig) for sig in mask),
            alive_fd=alive_w,
        )
        try:
            pid = os.fork()
        except OSError as exc:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            for fd in (status_r, status_w, alive_r, alive_w):
                os.close(fd)
            log.error("fork failed: %s; retrying in 1s", exc)
            self._spawn_after = time.monotonic() + 1.0
            return False
        if pid == 0:  # pragma: no cover  (runs in the child; covered by the process tests)
            self._become_child(inherited, (status_r, alive_r))
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for fd in (status_w, alive_w):
            os.close(fd)
        for fd in (status_r, alive_r):
            os.set_blocking(fd, False)
        now = time.monotonic()
        self.children[pid] = ChildProcess(
            pid, now, self._generation, status_r,
            alive_fd=alive_r, alive_at=now,
        )  # fmt: skip
        log.info("spawned child %d", pid)
        return True

    def _become_child(self, inherited: child.Inherited, parents_ends: tuple[int, ...]) -> None:
        """Turn this freshly forked process into a child; never returns.

        `parents_ends`: the supervisor's ends of this child's pipes, closed here.
        """
        code = 1
        try:
            # First: nothing of the supervisor may run here (handlers, wakeup pipe, sockets).
            child.reset_inherited_signals()
            for fd in (*parents_ends, *self._supervisor_fds()):
                os.close(fd)
            code = self._child_main(self.settings, inherited)
        except BaseException:
            log.exception("child %d crashed", os.getpid())
            code = 1
        finally:
            fairq_logging.flush()
            os._exit(code)

    def _supervisor_fds(self) -> list[int]:
        """What a forked process must close: the wake-up pipe, the metrics listener, and the
        supervisor's ends of every child's pipes."""
        fds = [self._wake_r, self._wake_w]
        if self._exporter is not None:
            fds.append(self._exporter.fileno())
        for proc in self.children.values():
            fds.extend(fd for fd in (proc.status_fd, proc.alive_fd) if fd >= 0)
        return fds

    def _read_status(self, proc: ChildProcess) -> None:
        if proc.read_status():
            self._boot_failures.clear()  # a boot in between: failures are no longer in a row
            self._boot_streak = 0

    def _kill(self, proc: ChildProcess) -> None:
        proc.killed = True  # so its SIGKILL death is not blamed on the OOM killer
        self._signal(proc.pid, signal.SIGKILL)

    def _signal(self, pid: int, sig: signal.Signals) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass  # already dead; the next reap collects it
        except OSError as exc:
            if exc.errno != errno.ESRCH:
                raise

    # -- stopping -------------------------------------------------------------------------

    def shutdown(self, timeout: float) -> None:
        """TERM every child, reap until they are gone or `timeout` passed, then KILL the rest.

        A SIGQUIT meanwhile cuts the remaining grace to `QUICK_SHUTDOWN_SECONDS`.
        """
        self._stopping = True
        for proc in self.children.values():
            if not proc.killed:
                self._signal(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while True:
            self.reap()
            now = time.monotonic()
            if not self.children or now >= deadline:
                break
            for signum in self._wait(min(STOP_REAP_INTERVAL_SECONDS, deadline - now)):
                if signum == signal.SIGQUIT:
                    log.info("received SIGQUIT while stopping: cutting the grace short")
                    deadline = min(deadline, time.monotonic() + QUICK_SHUTDOWN_SECONDS)
        if not self.children:
            return
        log.warning(
            "%d children still running after %.1fs; killing them (their tasks are recovered "
            "when their leases expire)", len(self.children), timeout,
        )  # fmt: skip
        for proc in self.children.values():
            self._kill(proc)
        deadline = time.monotonic() + KILL_REAP_SECONDS
        while self.children and time.monotonic() < deadline:
            self.reap()
            if self.children:
                self._wait(STOP_REAP_INTERVAL_SECONDS)
        for pid in self.children:
            log.error("child %d did not die after SIGKILL; giving up on it", pid)


def _record_only(signum: int, frame: object) -> None:
    """Python-level handler: nothing to do, set_wakeup_fd already recorded `signum`."""
