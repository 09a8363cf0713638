"""A local webhook target for the chaos run and the tests: records every delivery.

`Receiver` serves on a free port of 127.0.0.1 (ThreadingHTTPServer, one thread per request)
and records each request's Idempotency-Key and the status it answered: 200, or 503 for a
configured share of requests.
"""

from __future__ import annotations

import collections
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _ReceiverServer(ThreadingHTTPServer):
    daemon_threads = True
    # Workers and API passes connect all at once; the default backlog (5) would drop SYNs,
    # and a dropped SYN costs the client a one-second retransmit.
    request_queue_size = 256

    def __init__(self, fail_percent: float, seed: int, delay: float) -> None:
        super().__init__(("127.0.0.1", 0), _HookHandler)
        self.fail_percent = fail_percent
        self.delay = delay
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.deliveries: dict[str, list[int]] = collections.defaultdict(list)


class _HookHandler(BaseHTTPRequestHandler):
    server: _ReceiverServer

    def do_POST(self) -> None:
        """Record the delivery; answer 200, or 503 for the configured share."""
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        key = self.headers.get("Idempotency-Key", "")
        server = self.server
        if server.delay > 0:
            time.sleep(server.delay)
        with server.lock:
            status = 503 if server.rng.uniform(0, 100) < server.fail_percent else 200
            server.deliveries[key].append(status)
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        """Silence: one line per delivery would drown the report."""


class Receiver:
    """A local webhook target that records each request's Idempotency-Key and answer.

    A context manager: serves on a free port of 127.0.0.1 from a thread until the block ends.
    Answers 503 to `fail_percent` % of requests; waits `delay` seconds before each answer.
    """

    def __init__(self, fail_percent: float = 0.0, seed: int = 0, delay: float = 0.0) -> None:
        self._server = _ReceiverServer(fail_percent, seed, delay)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="webhook-receiver", daemon=True
        )

    @property
    def url(self) -> str:
        """Where webhooks go."""
        return f"http://127.0.0.1:{self._server.server_address[1]}/hook"

    def deliveries(self) -> dict[str, list[int]]:
        """A copy of what was received: Idempotency-Key -> the status of each answer."""
        with self._server.lock:
            return {key: list(statuses) for key, statuses in self._server.deliveries.items()}

    def __enter__(self) -> Receiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)
