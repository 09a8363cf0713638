"""A TCP proxy that holds every chunk D ms before passing it on: a network round trip of 2D.

Stands between worker processes and PostgreSQL in the scale-out benchmark
(`scripts/bench_scaling.py`), on a machine without `netem`: each chunk read from either side
is written to the other side D ms after it was read, in order per direction, so a request
and its answer arrive 2D later than without it. A connection's end travels the same way: an
EOF is passed on (`shutdown(SHUT_WR)`) D ms after it was read, after the data before it, and
the pair is closed once both directions have ended; a reset or a refused connection to the
target closes both sides at once.

Accuracy is the point, so it runs one thread on `epoll` with a `timerfd` armed at the
absolute CLOCK_MONOTONIC time the oldest held chunk is due (epoll's own timeout counts whole
milliseconds), under SCHED_FIFO when allowed (root; otherwise it says so and runs
unprioritized), with the garbage collector off (every cycle it makes is broken by hand).
With one D for every chunk, chunks fall due in the order they were read, so one FIFO holds
them all. It measures itself: how late each chunk went out against its due time (mean, p99
from 1 us buckets, max) and the CPU time it used, since start or the last reset. From the
command line it prints them to stderr every `--report-seconds` and at exit (SIGINT, SIGTERM);
with `--control` (how `running()` drives it) it answers `stats` and `reset` lines on stdin
with a line on stdout instead, and exits at EOF.

Usage:
    python -m devtools.delay_proxy --listen 127.0.0.1:6432 --target 127.0.0.1:5432 \\
        --delay-ms 1 [--report-seconds 10] [--no-realtime]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import errno
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parent.parent

# Bytes read from a socket at a time.
CHUNK_BYTES = 65536
# Once this many bytes wait to be written to one side, the other side is not read until
# they drain below it (a slow reader must not make the proxy hold unbounded data).
MAX_PENDING_BYTES = 4 * 1024 * 1024
# Lateness histogram: 1 us buckets up to this many, later ones in the last (max kept apart).
HISTOGRAM_BUCKETS = 20_000
REALTIME_PRIORITY = 10

_CLOCK_MONOTONIC = 1  # <time.h>
_TFD_TIMER_ABSTIME = 1  # <sys/timerfd.h>
_NS = 1_000_000_000


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


class _Itimerspec(ctypes.Structure):
    _fields_ = (("it_interval", _Timespec), ("it_value", _Timespec))


class TimerFd:
    """A non-blocking CLOCK_MONOTONIC timerfd, through libc (`os.timerfd_*` is Python 3.13+)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self._settime = libc.timerfd_settime
        self._settime.argtypes = (
            ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p,
        )  # fmt: skip
        # TFD_NONBLOCK and TFD_CLOEXEC are O_NONBLOCK and O_CLOEXEC on Linux.
        fd = int(libc.timerfd_create(_CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC))
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"timerfd_create: {os.strerror(code)}")
        self.fd = fd
        self._spec = _Itimerspec()

    def arm_at(self, deadline_ns: int, interval_ns: int = 0) -> None:
        """Fire at `deadline_ns` (`time.monotonic_ns()` clock), then every `interval_ns` if set.

        A deadline already past fires at once.
        """
        spec = self._spec
        spec.it_value.tv_sec, spec.it_value.tv_nsec = divmod(max(deadline_ns, 1), _NS)
        spec.it_interval.tv_sec, spec.it_interval.tv_nsec = divmod(interval_ns, _NS)
        if self._settime(self.fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"timerfd_settime: {os.strerror(code)}")

    def clear(self) -> None:
        """Consume the expirations, so epoll stops reporting the fd readable."""
        with contextlib.suppress(BlockingIOError):
            os.read(self.fd, 8)

    def close(self) -> None:
        """Close the fd."""
        os.close(self.fd)


@dataclass(frozen=True)
class ProxyStats:
    """What the proxy did since it started or was last reset.

    Lateness: how long after its due time (read time + D) each chunk was handed to `send`,
    in microseconds; times in seconds; `realtime` says whether it ran under SCHED_FIFO.
    """

    delay_ms: float
    realtime: bool
    seconds: float
    cpu_seconds: float
    connections: int
    chunks: int
    bytes: int
    late_mean_us: float
    late_p99_us: float
    late_max_us: float

    @property
    def cpu_share(self) -> float:
        """CPU seconds per second (cores) it used."""
        return self.cpu_seconds / self.seconds if self.seconds > 0 else 0.0

    def describe(self) -> str:
        """One line for people."""
        return (
            f"delay {self.delay_ms:g} ms{'' if self.realtime else ' (not real-time)'}: "
            f"{self.chunks:,} chunks ({self.bytes:,} bytes, {self.connections} connections) "
            f"in {self.seconds:.1f} s; late mean {self.late_mean_us:.0f} us, "
            f"p99 {self.late_p99_us:.0f} us, max {self.late_max_us:.0f} us; "
            f"CPU {self.cpu_seconds:.2f} s ({100 * self.cpu_share:.1f}% of a core)"
        )


class _End:
    """One socket of a proxied connection and what waits to be written to it."""

    __slots__ = (
        "closed", "connecting", "eof_due", "fd", "mask", "out", "paused", "peer", "queued",
        "read_eof", "sock", "write_shut",
    )  # fmt: skip

    def __init__(self, sock: socket.socket, *, connecting: bool = False) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.peer: _End | None = None
        self.connecting = connecting
        self.queued = 0  # bytes held for this end, not yet due
        self.out = bytearray()  # bytes due but not yet taken by the kernel
        self.eof_due = False  # the peer's EOF is due: shut our write side once `out` is sent
        self.write_shut = False
        self.read_eof = False
        self.paused = False  # not read while the peer has too much waiting
        self.closed = False
        self.mask = 0  # events registered with epoll (0: not registered)


def _now() -> int:
    return time.monotonic_ns()


class DelayProxy:
    """The event loop: accept on `listen`, connect each client to `target`, delay both ways."""

    def __init__(
        self,
        listen: tuple[str, int],
        target: tuple[str, int],
        delay_ms: float,
        *,
        realtime: bool,
    ) -> None:
        self.target = target
        self.delay_ms = delay_ms
        self.delay_ns = round(delay_ms * 1_000_000)
        self.realtime = realtime
        family = socket.AF_INET6 if ":" in listen[0] else socket.AF_INET
        self.listener = socket.create_server(listen, family=family, backlog=1024)
        self.listener.setblocking(False)
        self.address: tuple[str, int] = self.listener.getsockname()[:2]
        self.epoll = select.epoll()
        self.epoll.register(self.listener.fileno(), select.EPOLLIN)
        self.timer = TimerFd()
        self.epoll.register(self.timer.fd, select.EPOLLIN)
        self._armed = 0  # the deadline the timer is armed at (0: none)
        # (due, destination, data or None for EOF), in due order: one D for every chunk.
        self._held: deque[tuple[int, _End, bytes | None]] = deque()
        self._ends: dict[int, _End] = {}
        self._extra: dict[int, str] = {}  # fd -> "control" or "report"
        self._control_buffer = b""
        self.report_timer: TimerFd | None = None
        self.running = True
        self.reset()

    # -- statistics ----------------------------------------------------------------------

    def reset(self) -> None:
        """Start the statistics afresh."""
        self._since = _now()
        times = os.times()
        self._cpu_since = times.user + times.system
        self._connections = 0
        self._chunks = 0
        self._bytes = 0
        self._late_sum = 0
        self._late_max = 0
        self._histogram = [0] * (HISTOGRAM_BUCKETS + 1)

    def stats(self) -> ProxyStats:
        """The statistics since start or the last reset."""
        times = os.times()
        p99 = 0.0
        if self._chunks:
            rank, seen = 0.99 * self._chunks, 0
            for micros, count in enumerate(self._histogram):
                seen += count
                if seen >= rank:
                    p99 = float(micros)
                    break
        return ProxyStats(
            delay_ms=self.delay_ms,
            realtime=self.realtime,
            seconds=(_now() - self._since) / _NS,
            cpu_seconds=times.user + times.system - self._cpu_since,
            connections=self._connections,
            chunks=self._chunks,
            bytes=self._bytes,
            late_mean_us=self._late_sum / self._chunks / 1000 if self._chunks else 0.0,
            late_p99_us=p99,
            late_max_us=self._late_max / 1000,
        )

    # -- connections ---------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except BlockingIOError:
                return
            except OSError:  # e.g. the client reset before we took it, or out of fds
                return
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            upstream = socket.socket(socket.AF_INET6 if ":" in self.target[0] else socket.AF_INET)
            upstream.setblocking(False)
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            code = upstream.connect_ex(self.target)
            if code not in (0, errno.EINPROGRESS):
                upstream.close()
                client.close()
                continue
            near, far = _End(client), _End(upstream, connecting=code != 0)
            near.peer, far.peer = far, near
            self._ends[near.fd] = near
            self._ends[far.fd] = far
            self._connections += 1
            self._update(near)
            self._update(far)

    def _update(self, end: _End) -> None:
        """Register with epoll exactly the events `end` waits for now."""
        if end.closed:
            return
        mask = 0
        if not (end.read_eof or end.paused or end.connecting):
            mask |= select.EPOLLIN
        if end.connecting or end.out:
            mask |= select.EPOLLOUT
        if mask == end.mask:
            return
        # Unregistered when it waits for nothing: epoll reports HUP and ERR whatever the mask,
        # and a half-closed socket would report HUP on every wait until the pair closes.
        if mask == 0:
            self.epoll.unregister(end.fd)
        elif end.mask == 0:
            self.epoll.register(end.fd, mask)
        else:
            self.epoll.modify(end.fd, mask)
        end.mask = mask

    def _close(self, end: _End) -> None:
        """Close both sockets of `end`'s connection at once; its held chunks are dropped."""
        for side in (end, end.peer):
            if side is None or side.closed:
                continue
            side.closed = True
            if side.mask:
                # Already out of the set when its peer's close took the connection down
                # first (seen at exit under SIGTERM): nothing left to unregister.
                with contextlib.suppress(FileNotFoundError):
                    self.epoll.unregister(side.fd)
            self._ends.pop(side.fd, None)
            side.sock.close()
            side.out.clear()
        if end.peer is not None:
            end.peer.peer = None  # no cycle left for a garbage collector that does not run
        end.peer = None

    def _pending(self, end: _End) -> int:
        return end.queued + len(end.out)

    def _resume_peer(self, end: _End) -> None:
        """Read the peer again once what waits for `end` drained below the limit."""
        peer = end.peer
        if peer is not None and peer.paused and self._pending(end) < MAX_PENDING_BYTES:
            peer.paused = False
            self._update(peer)

    def _on_readable(self, end: _End) -> None:
        try:
            data = end.sock.recv(CHUNK_BYTES)
        except BlockingIOError:
            return
        except OSError:  # reset, refused: the connection is over both ways
            self._close(end)
            return
        peer = end.peer
        if peer is None:
            return
        if not data:
            end.read_eof = True
            self._update(end)
        self._hold(end, peer, data or None)

    def _hold(self, source: _End, destination: _End, data: bytes | None) -> None:
        """Schedule `data` (None: EOF) for `destination`, D after now."""
        now = _now()
        if self.delay_ns == 0:
            self._deliver(destination, data, now, _now())
        else:
            held = self._held
            held.append((now + self.delay_ns, destination, data))
            if data is not None:
                destination.queued += len(data)
            if len(held) == 1:
                self._arm(now + self.delay_ns)
        if data is not None and self._pending(destination) >= MAX_PENDING_BYTES:
            source.paused = True
            self._update(source)

    def _arm(self, deadline: int) -> None:
        if deadline != self._armed:
            self.timer.arm_at(deadline)
            self._armed = deadline

    def _release_due(self) -> None:
        """Deliver every held chunk that is due; arm the timer for the next one."""
        held = self._held
        while held:
            due, destination, data = held[0]
            now = _now()
            if due > now:
                self._arm(due)
                return
            held.popleft()
            if destination.closed:
                continue
            if data is not None:
                destination.queued -= len(data)
            self._deliver(destination, data, due, now)
            peer = destination.peer
            if peer is not None and peer.paused:
                self._resume_peer(destination)
        self._armed = 0  # a timer that fires with nothing held is harmless

    def _deliver(self, end: _End, data: bytes | None, due: int, now: int) -> None:
        """Write `data` (None: EOF) to `end` now, or after what is already waiting for it."""
        if end.closed:
            return
        if data is None:
            end.eof_due = True
            if not end.out and not end.connecting:
                self._shut_write(end)
            return
        late = now - due
        self._chunks += 1
        self._bytes += len(data)
        self._late_sum += late
        self._late_max = max(self._late_max, late)
        self._histogram[min(late // 1000, HISTOGRAM_BUCKETS)] += 1
        if end.out or end.connecting:
            end.out += data
            return
        try:
            sent = end.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._close(end)
            return
        if sent < len(data):
            end.out += memoryview(data)[sent:]
            self._update(end)

    def _on_writable(self, end: _End) -> None:
        if end.connecting:
            if end.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                self._close(end)  # the target refused: the client sees its connection close
                return
            end.connecting = False
        if end.out:
            try:
                sent = end.sock.send(end.out)
            except BlockingIOError:
                sent = 0
            except OSError:
                self._close(end)
                return
            del end.out[:sent]
        if not end.out and end.eof_due and not end.write_shut:
            self._shut_write(end)
            if end.closed:
                return
        self._update(end)
        self._resume_peer(end)

    def _shut_write(self, end: _End) -> None:
        """Pass the peer's EOF on; close the pair once both directions have ended."""
        try:
            end.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(end)
            return
        end.write_shut = True
        peer = end.peer
        if peer is not None and peer.write_shut:
            self._close(end)

    # -- the loop ------------------------------------------------------------------------

    def add_control(self, fd: int) -> None:
        """Answer `stats` and `reset` lines read from `fd`; stop at its EOF or `quit`."""
        os.set_blocking(fd, False)
        self.epoll.register(fd, select.EPOLLIN)
        self._extra[fd] = "control"

    def add_report(self, seconds: float) -> None:
        """Print the statistics to stderr every `seconds`."""
        self.report_timer = TimerFd()
        interval = round(seconds * _NS)
        self.report_timer.arm_at(_now() + interval, interval)
        self.epoll.register(self.report_timer.fd, select.EPOLLIN)
        self._extra[self.report_timer.fd] = "report"

    def _on_control(self, fd: int) -> None:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return
        if not data:
            self.running = False
            return
        self._control_buffer += data
        *lines, self._control_buffer = self._control_buffer.split(b"\n")
        for line in lines:
            command = line.strip().decode()
            if command == "stats":
                answer = json.dumps(asdict(self.stats()))
            elif command == "reset":
                self.reset()
                answer = "ok"
            elif command == "quit":
                self.running = False
                answer = "bye"
            else:
                answer = json.dumps({"error": f"unknown command {command!r}"})
            os.write(sys.stdout.fileno(), (answer + "\n").encode())

    def serve(self) -> None:
        """Run until `running` is cleared (control EOF) or a signal handler raises."""
        listener, timer = self.listener.fileno(), self.timer.fd
        ends, held = self._ends, self._held
        while self.running:
            events = self.epoll.poll()
            for fd, event in events:
                end = ends.get(fd)
                if end is not None:
                    if event & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                        self._on_readable(end)
                    if event & select.EPOLLOUT and not end.closed:
                        self._on_writable(end)
                elif fd == timer:
                    self.timer.clear()
                    self._armed = 0
                elif fd == listener:
                    self._accept()
                elif self._extra.get(fd) == "control":
                    self._on_control(fd)
                elif self.report_timer is not None and fd == self.report_timer.fd:
                    self.report_timer.clear()
                    print(self.stats().describe(), file=sys.stderr, flush=True)
            if held:
                self._release_due()

    def close(self) -> None:
        """Close every socket and fd."""
        for end in list(self._ends.values()):
            self._close(end)
        self.listener.close()
        self.timer.close()
        if self.report_timer is not None:
            self.report_timer.close()
        self.epoll.close()


def become_realtime(priority: int = REALTIME_PRIORITY) -> bool:
    """Run this process under SCHED_FIFO at `priority`; False (with a warning) if refused."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    except OSError as exc:
        print(
            f"delay_proxy: warning: no real-time scheduling ({exc.strerror}): chunks will go "
            "out later under load; run as root for SCHED_FIFO",
            file=sys.stderr,
            flush=True,
        )
        return False
    return True


def parse_address(text: str) -> tuple[str, int]:
    """`127.0.0.1:5432` or `[::1]:5432` -> (host, port)."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> int:
    """Run the proxy until SIGINT/SIGTERM (or control EOF); print its statistics at the end."""
    parser = argparse.ArgumentParser(
        prog="python -m devtools.delay_proxy", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--listen", type=parse_address, required=True, help="HOST:PORT (0: any)")
    parser.add_argument("--target", type=parse_address, required=True, help="HOST:PORT")
    parser.add_argument("--delay-ms", type=float, required=True, help="D, per direction")
    parser.add_argument("--report-seconds", type=float, default=0.0, help="0: only at exit")
    parser.add_argument("--no-realtime", action="store_true", help="do not ask for SCHED_FIFO")
    parser.add_argument("--control", action="store_true", help="stats/reset lines on stdin")
    args = parser.parse_args(argv)
    if args.delay_ms < 0:
        parser.error("--delay-ms must be at least 0")
    realtime = False if args.no_realtime else become_realtime()
    proxy = DelayProxy(args.listen, args.target, args.delay_ms, realtime=realtime)

    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    if args.control:
        proxy.add_control(sys.stdin.fileno())
    if args.report_seconds > 0:
        proxy.add_report(args.report_seconds)
    host, port = proxy.address
    print(f"listening {host}:{port}", flush=True)
    # Every cycle the loop makes is broken by hand (`_close`): no collector pauses.
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        proxy.serve()
    except KeyboardInterrupt:
        pass
    finally:
        if not args.control:  # a controller asks for what it wants
            print(proxy.stats().describe(), file=sys.stderr, flush=True)
        proxy.close()
    return 0


# -- driving it from Python ------------------------------------------------------------------


class RunningProxy:
    """A proxy process started by `running()`: its port and pid, its statistics on demand."""

    def __init__(self, proc: subprocess.Popen[str], host: str, port: int) -> None:
        self.proc = proc
        self.host = host
        self.port = port

    @property
    def pid(self) -> int:
        """The proxy's process id (its CPU can also be read in /proc)."""
        return self.proc.pid

    def _ask(self, command: str) -> str:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the delay proxy exited ({self.proc.poll()})")
        return answer

    def stats(self) -> ProxyStats:
        """Its statistics since it started or was last reset."""
        return ProxyStats(**json.loads(self._ask("stats")))

    def reset(self) -> None:
        """Start its statistics afresh."""
        self._ask("reset")


@contextmanager
def running(
    target: tuple[str, int],
    delay_ms: float,
    *,
    listen_host: str = "127.0.0.1",
    realtime: bool = True,
) -> Iterator[RunningProxy]:
    """Run a proxy process to `target` on a free port of `listen_host` until the block ends.

    Its warnings (no real-time scheduling) and final statistics go to this process's stderr.
    """
    argv = [
        sys.executable, "-m", "devtools.delay_proxy", "--control",
        "--listen", f"{listen_host}:0", "--target", f"{target[0]}:{target[1]}",
        "--delay-ms", repr(delay_ms), *([] if realtime else ["--no-realtime"]),
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        if len(line) != 2 or line[0] != "listening":
            raise RuntimeError(f"the delay proxy did not start (exit {proc.wait(10)})")
        host, port = parse_address(line[1])
        yield RunningProxy(proc, host, port)
    finally:
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()  # EOF on its control: it exits
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


if __name__ == "__main__":
    sys.exit(main())
