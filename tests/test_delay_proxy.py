"""The delay proxy of the scale-out benchmark (`devtools.delay_proxy`), over real sockets.

Timing is asserted only from below (a round trip through a proxy of D takes at least 2D):
on a shared machine an upper bound would flake.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from devtools import delay_proxy
from tests import pg

ROOT = Path(__file__).resolve().parent.parent
DELAY_MS = 5.0
TIMEOUT = 30.0


class EchoServer:
    """Echoes every connection's bytes back until its EOF, then ends its own direction."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self.eofs_seen = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)
            with self._lock:
                self.eofs_seen += 1
            conn.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        """Stop accepting."""
        self.sock.close()


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    """An echo server on a free port of 127.0.0.1."""
    server = EchoServer()
    yield server
    server.close()


def _connect(proxy: delay_proxy.RunningProxy) -> socket.socket:
    sock = socket.create_connection((proxy.host, proxy.port), timeout=TIMEOUT)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_exactly(sock: socket.socket, count: int) -> bytes:
    parts, got = [], 0
    while got < count:
        data = sock.recv(min(65536, count - got))
        if not data:
            break
        parts.append(data)
        got += len(data)
    return b"".join(parts)


def _round_trip_seconds(sock: socket.socket, times: int = 20) -> float:
    """The smallest of `times` one-byte round trips."""
    best = float("inf")
    for _ in range(times):
        start = time.perf_counter()
        sock.sendall(b"x")
        assert sock.recv(1) == b"x"
        best = min(best, time.perf_counter() - start)
    return best


def test_a_round_trip_through_the_proxy_takes_at_least_twice_the_delay(
    echo: EchoServer,
) -> None:
    with (
        delay_proxy.running(echo.address, DELAY_MS) as proxy,
        _connect(proxy) as sock,
    ):
        assert _round_trip_seconds(sock) >= 2 * DELAY_MS / 1000
        stats = proxy.stats()
    assert stats.delay_ms == DELAY_MS
    assert stats.connections == 1
    assert stats.chunks >= 40  # each round trip is one chunk each way
    assert stats.bytes >= 40
    assert stats.late_mean_us >= 0
    assert stats.late_p99_us <= stats.late_max_us
    assert stats.cpu_seconds >= 0


def test_select_1_through_the_proxy_takes_at_least_twice_the_delay(main_db_url: str) -> None:
    url = pg.libpq(main_db_url)
    with psycopg.connect(url) as conn:
        address = conn.info.host, conn.info.port
    with delay_proxy.running(address, DELAY_MS) as proxy:
        proxied = make_conninfo(url, host=proxy.host, port=proxy.port)
        with psycopg.connect(proxied, autocommit=True) as conn:
            conn.execute("SELECT 1")
            start = time.perf_counter()
            assert conn.execute("SELECT 1").fetchone() == (1,)
            elapsed = time.perf_counter() - start
    assert elapsed >= 2 * DELAY_MS / 1000


def test_reset_starts_the_statistics_afresh(echo: EchoServer) -> None:
    with delay_proxy.running(echo.address, 1.0) as proxy, _connect(proxy) as sock:
        _round_trip_seconds(sock, times=5)
        assert proxy.stats().chunks >= 10
        proxy.reset()
        stats = proxy.stats()
    assert (stats.chunks, stats.bytes, stats.connections) == (0, 0, 0)


@pytest.mark.parametrize("delay_ms", [0.0, 1.0])
def test_many_connections_get_their_bytes_back_intact_and_in_order(
    echo: EchoServer, delay_ms: float
) -> None:
    def exchange(seed: int) -> bytes:
        rng = random.Random(seed)
        payload = rng.randbytes(rng.randrange(100_000, 400_000))
        with _connect(proxy) as sock:
            # Written in pieces of random sizes from another thread while this one reads,
            # so both directions carry data at once.
            def write() -> None:
                view, offset = memoryview(payload), 0
                while offset < len(payload):
                    size = rng.randrange(1, 20_000)
                    sock.sendall(view[offset : offset + size])
                    offset += size
                sock.shutdown(socket.SHUT_WR)

            writer = threading.Thread(target=write)
            writer.start()
            received = _recv_exactly(sock, len(payload) + 1)  # +1: the EOF must follow
            writer.join()
        assert received == payload
        return received

    with delay_proxy.running(echo.address, delay_ms) as proxy:
        with ThreadPoolExecutor(max_workers=40) as pool:
            results = list(pool.map(exchange, range(40)))
        stats = proxy.stats()
    assert len(results) == 40
    assert stats.connections == 40
    assert stats.bytes == 2 * sum(len(r) for r in results)


def test_a_reader_that_falls_behind_gets_every_byte_once_it_reads(echo: EchoServer) -> None:
    # More than the proxy holds for one side (MAX_PENDING_BYTES): it stops reading the
    # writer until the reader catches up, and nothing is lost or reordered meanwhile.
    payload = random.Random(7).randbytes(3 * delay_proxy.MAX_PENDING_BYTES)
    with delay_proxy.running(echo.address, 1.0) as proxy, _connect(proxy) as sock:
        writer = threading.Thread(target=sock.sendall, args=(payload,))
        writer.start()
        time.sleep(1.0)  # nobody reads the echo yet: every buffer on the way fills up
        received = _recv_exactly(sock, len(payload))
        writer.join()
    assert received == payload


def test_a_client_eof_reaches_the_server_and_the_server_eof_reaches_the_client(
    echo: EchoServer,
) -> None:
    with delay_proxy.running(echo.address, DELAY_MS) as proxy, _connect(proxy) as sock:
        sock.sendall(b"last words")
        sock.shutdown(socket.SHUT_WR)
        # The echo server answers, sees our EOF, then ends its own direction.
        assert _recv_exactly(sock, 100) == b"last words"
        assert sock.recv(1) == b""
    assert echo.eofs_seen == 1


def test_a_server_that_closes_first_closes_the_client_after_its_data() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = server.getsockname()[:2]
        with delay_proxy.running(address, DELAY_MS) as proxy, _connect(proxy) as sock:
            conn, _ = server.accept()
            conn.sendall(b"goodbye")
            conn.close()
            assert _recv_exactly(sock, 100) == b"goodbye"
            assert sock.recv(1) == b""
            # Our direction is still open until we end it; then the pair is gone.
            sock.shutdown(socket.SHUT_WR)


def test_a_refused_target_closes_the_client_connection() -> None:
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        address = placeholder.getsockname()[:2]
    # Nothing listens there any more.
    # A reset is a clean enough close: the client is not left hanging.
    with (
        delay_proxy.running(address, DELAY_MS) as proxy,
        _connect(proxy) as sock,
        contextlib.suppress(ConnectionResetError),
    ):
        assert sock.recv(1) == b""


def test_the_command_line_proxy_serves_until_sigterm_and_prints_its_statistics(
    echo: EchoServer,
) -> None:
    argv = [
        sys.executable, "-m", "devtools.delay_proxy", "--listen", "127.0.0.1:0",
        "--target", f"{echo.address[0]}:{echo.address[1]}", "--delay-ms", "1",
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        host, port = delay_proxy.parse_address(proc.stdout.readline().split()[1])
        with socket.create_connection((host, port), timeout=TIMEOUT) as sock:
            sock.sendall(b"ping")
            assert _recv_exactly(sock, 4) == b"ping"
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "delay 1 ms" in err
    assert "2 chunks (8 bytes, 1 connections)" in err
