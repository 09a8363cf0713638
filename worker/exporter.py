"""The supervisor's metrics exporter: a side process serving `/metrics` and `/health`.

The supervisor binds the listening socket itself (a taken port stops it at start; port 0 is
known at once) and forks this process to serve it, as gunicorn's arbiter holds the
listeners its workers serve. It reaps the exporter like a child and forks a new one after
`RESPAWN_DELAY_SECONDS` if it dies; the socket outlives each exporter, so scrapes that
arrive meanwhile wait in its backlog. Decision 0004.

Here threads are fine (nothing forks from this process): prometheus_client's WSGI app under
the standard library's threading WSGI server, a thread per request, so a slow scraper holds
up no other. `/metrics` is the sum of every process's multiprocess files (the children's
task metrics and the supervisor's `worker.metrics.SupervisorMetrics`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import socketserver
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from common import logging as fairq_logging

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

log = logging.getLogger("fairq.worker.exporter")

# A dead exporter is replaced after this long (a crash loop costs a fork a second at most).
RESPAWN_DELAY_SECONDS = 1.0
# How long `stop` waits for the exporter to exit after SIGTERM before SIGKILL.
STOP_TIMEOUT_SECONDS = 2.0
# A scraper that sends nothing for this long is dropped (bounds each read of its request).
CLIENT_TIMEOUT_SECONDS = 5.0
# prctl(2)'s option that names the calling thread (its main thread names the process).
PR_SET_NAME = 15
# The exporter's process name (Linux: /proc/<pid>/comm, what `ps` and `top` show), which
# tells it apart from the worker children of the same supervisor. At most 15 bytes.
PROCESS_NAME = "fairq-exporter"
# How often the exporter checks that its supervisor is still its parent.
PARENT_CHECK_SECONDS = 0.5
# The supervisor's signals, ignored here: the supervisor alone decides when this one stops
# (a terminal's Ctrl-C reaches the whole process group).
_IGNORED = (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU)


class Exporter:
    """The exporter process of one supervisor: start, reap, respawn and stop it.

    `directory`: the Prometheus multiprocess directory. `inherited_fds`: called in the forked
    process, the supervisor's descriptors it must close (pipes of children, the wake-up
    pipe). Raises `OSError` from the constructor when `host:port` cannot be bound.
    """

    def __init__(
        self, host: str, port: int, directory: Path, inherited_fds: Callable[[], Iterable[int]]
    ) -> None:
        self._listener = socket.create_server((host, port), backlog=64)
        self._directory = directory
        self._inherited_fds = inherited_fds
        self.pid: int | None = None
        self._respawn_at = 0.0

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        port: int = self._listener.getsockname()[1]
        return port

    def fileno(self) -> int:
        """The listening socket's descriptor (for the supervisor's children to close)."""
        return self._listener.fileno()

    def keep_running(self) -> None:
        """Fork the exporter if none runs and its respawn delay is over."""
        if self.pid is None and time.monotonic() >= self._respawn_at:
            self._fork()

    def owns(self, pid: int) -> bool:
        """Tell whether `pid` is the exporter (for the supervisor's reaping loop)."""
        return pid == self.pid

    def exited(self, status: int) -> None:
        """The exporter was reaped with wait status `status`; it is replaced later."""
        log.warning(
            "metrics exporter %s exited (status %s); replacing it in %.1fs",
            self.pid, os.waitstatus_to_exitcode(status), RESPAWN_DELAY_SECONDS,
        )  # fmt: skip
        self.pid = None
        self._respawn_at = time.monotonic() + RESPAWN_DELAY_SECONDS

    def stop(self) -> None:
        """TERM the exporter, wait up to `STOP_TIMEOUT_SECONDS`, KILL it if still there."""
        pid, self.pid = self.pid, None
        if pid is None:
            return
        _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if _reaped(pid):
                return
            time.sleep(0.02)
        _signal(pid, signal.SIGKILL)
        while not _reaped(pid):
            time.sleep(0.02)

    def close(self) -> None:
        """Close the listening socket (after `stop`)."""
        self._listener.close()

    def _fork(self) -> None:
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, (*_IGNORED, signal.SIGTERM))
        # Named before the fork, so the exporter has its name from its first instant: a tool
        # that lists the supervisor's children never takes it for a worker child.
        own_name = _process_name()
        _name_process(PROCESS_NAME)
        # Read here, not in the exporter: a supervisor killed while the exporter starts up
        # has it re-parented before it could ask, and it would serve on, orphaned.
        supervisor = os.getpid()
        try:
            pid = os.fork()
        except OSError as exc:
            _name_process(own_name)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            log.error("cannot fork the metrics exporter: %s; retrying", exc)
            self._respawn_at = time.monotonic() + RESPAWN_DELAY_SECONDS
            return
        if pid == 0:  # pragma: no cover  (runs in the exporter; covered by the process tests)
            self._become_exporter(mask, supervisor)
        _name_process(own_name)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        self.pid = pid
        log.info("metrics exporter %d serving port %d", pid, self.port)

    def _become_exporter(  # pragma: no cover
        self, mask: set[int | signal.Signals], supervisor: int
    ) -> NoReturn:
        code = 1
        try:
            from worker import child  # noqa: PLC0415  (what a child imports, only here)

            child.reset_inherited_signals()
            for sig in _IGNORED:
                signal.signal(sig, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask - set(_IGNORED) - {signal.SIGTERM})
            for fd in self._inherited_fds():
                if fd != self._listener.fileno():
                    os.close(fd)
            serve(self._listener, self._directory, supervisor)
            code = 0
        except BaseException:
            log.exception("metrics exporter %d crashed", os.getpid())
        finally:
            fairq_logging.flush()
            os._exit(code)


def serve(listener: socket.socket, directory: Path, parent: int) -> None:
    """Serve `/metrics` and `/health` on `listener` until `parent` is no longer the parent."""
    # Imported here: prometheus_client picks its value storage when first imported, and the
    # supervisor imports it only after preparing the directory (common/metrics_dir.py).
    from prometheus_client import CollectorRegistry, make_wsgi_app  # noqa: PLC0415

    from worker import metrics  # noqa: PLC0415

    registry = CollectorRegistry()
    registry.register(metrics.FilesCollector(directory))
    server = _Server(listener, _routes(make_wsgi_app(registry)), parent)
    try:
        server.serve_forever(poll_interval=PARENT_CHECK_SECONDS)
    except _Orphaned:
        log.info("metrics exporter %d: supervisor %d is gone; exiting", os.getpid(), parent)


_App = Callable[["WSGIEnvironment", "StartResponse"], Iterable[bytes]]


def _routes(metrics_app: _App) -> _App:
    """GET or HEAD `/metrics` and `/health`; 404 for other paths, 405 for other methods."""

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        if method not in ("GET", "HEAD"):
            return _plain(start_response, "405 Method Not Allowed", b"method not allowed\n")
        if path == "/metrics":
            # prometheus_client answers HEAD with 405: it is asked for GET and the body dropped.
            body = b"".join(metrics_app({**environ, "REQUEST_METHOD": "GET"}, start_response))
            return [] if method == "HEAD" else [body]
        if path == "/health":
            body = json.dumps({"status": "ok"}).encode() + b"\n"
            start_response(
                "200 OK",
                [("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
            )
            return [] if method == "HEAD" else [body]
        return _plain(start_response, "404 Not Found", b"not found\n")

    return app


def _plain(start_response: StartResponse, status: str, body: bytes) -> list[bytes]:
    start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]


class _Orphaned(Exception):
    """The supervisor died: the exporter stops serving."""


class _Handler(WSGIRequestHandler):
    timeout = CLIENT_TIMEOUT_SECONDS

    def log_message(self, format: str, *args: Any) -> None:
        """Requests go to the debug log, not to stderr as wsgiref writes them."""
        log.debug("%s " + format, self.address_string(), *args)


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    """wsgiref's server on a socket bound by the supervisor, a daemon thread per request."""

    daemon_threads = True

    def __init__(self, listener: socket.socket, app: _App, parent: int) -> None:
        super().__init__(listener.getsockname()[:2], _Handler, bind_and_activate=False)
        self.socket.close()
        self.socket = listener
        # What HTTPServer.server_bind would set, without binding.
        self.server_name, self.server_port = listener.getsockname()[:2]
        self.setup_environ()
        self.set_app(app)
        self._parent = parent

    def service_actions(self) -> None:
        """Stop serving once the supervisor is gone (the exporter is then re-parented)."""
        if os.getppid() != self._parent:
            raise _Orphaned


def _process_name() -> str:
    """This thread's name (Linux: the process's, for its main thread), or "" elsewhere."""
    try:
        return Path("/proc/self/comm").read_text().strip()
    except OSError:
        return ""


def _name_process(name: str) -> None:
    """Name this thread where the kernel has a name to set (Linux's PR_SET_NAME)."""
    if name and sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, name.encode(), 0, 0, 0)


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _reaped(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done == pid
