"""The API's hot path against a bare Flask app under the same gunicorn shape.

Starts PostgreSQL (embedded in `.pgdata/bench-api`, or `--database-url`, whose tasks and
companies are deleted first), the real API (`deploy/gunicorn.conf.py`, `wsgi:app`) and a bare
Flask app (this module's `bare_app`: POST answers 201 with a small JSON body, nothing else)
under the same gunicorn configuration, GUNICORN_WORKERS and GUNICORN_THREADS from the
environment (default 2 x 4). Both servers run the whole time; one keep-alive client with
`--clients` threads (each its own `requests.Session`) then loads one variant at a time for
`--seconds` seconds, after a `--warmup`:

- `bare`: POST to the bare app;
- `create`: POST /companies/{id}/tasks, a `noop` task (no Idempotency-Key);
- `get`: GET /companies/{id}/tasks/{task_id} of a task created before;
- `list`: GET /companies/{id}/tasks?limit=20 (the newest page).

Rounds alternate every variant (`--rounds`), so background load on a shared box falls on both
sides alike. It prints requests/s and client-side p50/p95/p99 (ms) per variant and round, the
ratio of each to the same round's `bare`, the CPU time the server's processes (gunicorn's
arbiter and workers, read from /proc; PostgreSQL's not included) spent per request, which
background load hardly moves, and the medians over the rounds. Requests that do
not answer 2xx are counted and printed; the run fails if there is any. `LOG_LEVEL` is INFO
(the default: the API's one line per request, written to a file here) unless set.

Usage (from the repository root):
    .venv/bin/python -m scripts.bench_api [--clients 16] [--seconds 10] [--warmup 2]
        [--rounds 3] [--companies 4] [--database-url postgresql+psycopg://...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import requests
from flask import Flask

from devtools import stack
from devtools.embedded_postgres import free_port

VARIANTS = ("bare", "create", "get", "list")
PERCENTILES = (0.50, 0.95, 0.99)
REQUEST_TIMEOUT_SECONDS = 30.0

bare_app = Flask("bare")


@bare_app.post("/bare")
def bare_create() -> tuple[dict[str, str], int]:
    """The reference: a 201 with a small JSON body, no database, no schema."""
    return {"id": "00000000-0000-0000-0000-000000000000", "status": "pending"}, 201


@bare_app.get("/ready")
def bare_ready() -> dict[str, str]:
    """What `stack.ApiServer.wait_ready` polls."""
    return {"status": "ok"}


@contextmanager
def bare_server(workdir: Path, env: Mapping[str, str]) -> Iterator[stack.ApiServer]:
    """Run `bare_app` under `deploy/gunicorn.conf.py` on a free 127.0.0.1 port."""
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    environment = {
        **os.environ,
        **env,
        "GUNICORN_BIND": f"127.0.0.1:{port}",
        "PROMETHEUS_MULTIPROC_DIR": str(workdir / "prometheus"),
    }
    app = "scripts.bench_api:bare_app"
    argv = [sys.executable, "-m", "gunicorn", "-c", "deploy/gunicorn.conf.py", app]
    with (workdir / "stdout.log").open("wb") as out, (workdir / "stderr.log").open("wb") as err:
        proc = subprocess.Popen(
            argv,
            cwd=stack.ROOT,
            env=environment,
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # stop() kills the group
        )
    server = stack.ApiServer("bare", proc, workdir, base_url=f"http://127.0.0.1:{port}")
    try:
        server.wait_ready(60)
        yield server
    finally:
        server.stop()


def process_tree_cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds of `pid` and its children (Linux /proc), None elsewhere."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        for process in (pid, *map(int, children)):
            # Fields after the command's closing parenthesis; utime and stime are 14 and 15.
            fields = Path(f"/proc/{process}/stat").read_text().rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
    except (OSError, ValueError):
        return None
    return total


@dataclass
class Sample:
    """What one variant's clients saw in one round."""

    latencies: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    # Server CPU seconds over the whole load (warm-up included) and the requests it answered.
    server_cpu: float | None = None
    requests: int = 0

    @property
    def cpu_ms_per_request(self) -> float | None:
        """Server CPU ms per answered request, warm-up included."""
        if self.server_cpu is None or not self.requests:
            return None
        return self.server_cpu / self.requests * 1000

    @property
    def rate(self) -> float:
        """Successful requests per second."""
        return len(self.latencies) / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        """The q-quantile latency in ms (nearest rank)."""
        ordered = sorted(self.latencies)
        if not ordered:
            return float("nan")
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


Request = Callable[[requests.Session, int], requests.Response]


def _load(request: Request, clients: int, seconds: float, warmup: float, server_pid: int) -> Sample:
    """`clients` threads send `request` back to back; only the window after `warmup` counts.

    The server's CPU time is taken over every request sent, warm-up included.
    """
    sample = Sample()
    cpu_before = process_tree_cpu_seconds(server_pid)
    lock = threading.Lock()
    start = time.monotonic() + warmup
    end = start + seconds

    def client(n: int) -> None:
        latencies: list[float] = []
        failures: dict[str, int] = {}
        sent = 0
        with requests.Session() as session:
            i = 0
            while (now := time.monotonic()) < end:
                sent += 1
                i += 1
                response = request(session, n * 1_000_000 + i)
                done = time.monotonic()
                if now >= start:
                    if 200 <= response.status_code < 300:
                        latencies.append(done - now)
                    else:
                        status = str(response.status_code)
                        failures[status] = failures.get(status, 0) + 1
        with lock:
            sample.requests += sent
            sample.latencies.extend(latencies)
            for status, count in failures.items():
                sample.failures[status] = sample.failures.get(status, 0) + count

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cpu_after = process_tree_cpu_seconds(server_pid)
    if cpu_before is not None and cpu_after is not None:
        sample.server_cpu = cpu_after - cpu_before
    sample.seconds = seconds
    return sample


def _requests(
    bare_url: str, api_url: str, companies: list[stack.Company], task_ids: dict[str, list[str]]
) -> dict[str, Request]:
    def company(i: int) -> stack.Company:
        return companies[i % len(companies)]

    def headers(c: stack.Company) -> dict[str, str]:
        return {"Authorization": f"Bearer {c.api_key}"}

    def bare(s: requests.Session, i: int) -> requests.Response:
        return s.post(f"{bare_url}/bare", json={"type": "noop"}, timeout=REQUEST_TIMEOUT_SECONDS)

    def create(s: requests.Session, i: int) -> requests.Response:
        c = company(i)
        return s.post(
            f"{api_url}/companies/{c.id}/tasks",
            json={"type": "noop", "payload": {}},
            headers=headers(c),
            timeout=REQUEST_TIMEOUT_SECONDS,
        )

    def get(s: requests.Session, i: int) -> requests.Response:
        c = company(i)
        ids = task_ids[c.id]
        return s.get(
            f"{api_url}/companies/{c.id}/tasks/{ids[i % len(ids)]}",
            headers=headers(c),
            timeout=REQUEST_TIMEOUT_SECONDS,
        )

    def list_(s: requests.Session, i: int) -> requests.Response:
        c = company(i)
        return s.get(
            f"{api_url}/companies/{c.id}/tasks?limit=20",
            headers=headers(c),
            timeout=REQUEST_TIMEOUT_SECONDS,
        )

    return {"bare": bare, "create": create, "get": get, "list": list_}


def _seed(api_url: str, companies: list[stack.Company], per_company: int) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    with requests.Session() as s:
        for c in companies:
            s.headers["Authorization"] = f"Bearer {c.api_key}"
            found[c.id] = []
            for _ in range(per_company):
                response = s.post(
                    f"{api_url}/companies/{c.id}/tasks",
                    json={"type": "noop", "payload": {}},
                    timeout=REQUEST_TIMEOUT_SECONDS,
                )
                response.raise_for_status()
                found[c.id].append(str(response.json()["id"]))
    return found


def _cpu(ms: float | None) -> str:
    return f"server CPU {ms:5.2f} ms/req" if ms is not None else "server CPU    -"


def _row(name: str, sample: Sample, bare: Sample | None) -> str:
    p50, p95, p99 = (sample.percentile(q) for q in PERCENTILES)
    ratio = f"{sample.rate / bare.rate:5.2f}x" if bare is not None and bare.rate else "   -  "
    failed = f"  non-2xx {sample.failures}" if sample.failures else ""
    return (
        f"  {name:<7} {sample.rate:8.0f} req/s  {ratio}  "
        f"p50 {p50:6.1f}  p95 {p95:6.1f}  p99 {p99:6.1f} ms  "
        f"{_cpu(sample.cpu_ms_per_request)}{failed}"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; return 1 when any request failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--companies", type=int, default=4)
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated subset of " + str(VARIANTS)
    )
    stack.add_database_url_argument(parser)
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    env = {"LOG_LEVEL": os.environ.get("LOG_LEVEL", "INFO")}
    token = secrets.token_urlsafe(32)
    shape = (os.environ.get("GUNICORN_WORKERS", "2"), os.environ.get("GUNICORN_THREADS", "4"))
    with ExitStack() as running, stack.sigterm_as_interrupt():
        workdir = Path(running.enter_context(tempfile.TemporaryDirectory(prefix="bench-api-")))
        url = running.enter_context(stack.database(args.database_url, "bench-api"))
        api = running.enter_context(
            stack.api_server(url, workdir / "api", admin_token=token, env=env)
        )
        bare = running.enter_context(bare_server(workdir / "bare", env))
        companies = stack.create_companies(api.base_url, token, args.companies, prefix="bench")
        task_ids = _seed(api.base_url, companies, 50)
        calls = _requests(bare.base_url, api.base_url, companies, task_ids)
        print(
            f"gunicorn {shape[0]} workers x {shape[1]} threads (gthread), {args.clients} client "
            f"threads, {args.seconds:g} s per variant after {args.warmup:g} s warm-up, "
            f"{os.cpu_count()} CPUs shared by client, servers and PostgreSQL; load average "
            f"{os.getloadavg()[0]:.2f} at start"
        )
        results: dict[str, list[Sample]] = {v: [] for v in variants}
        for n in range(1, args.rounds + 1):
            print(f"round {n}:")
            samples: dict[str, Sample] = {}
            for variant in variants:
                server = bare if variant == "bare" else api
                samples[variant] = _load(
                    calls[variant], args.clients, args.seconds, args.warmup, server.pid
                )
                results[variant].append(samples[variant])
            for variant in variants:
                print(_row(variant, samples[variant], samples.get("bare")))
        print(f"medians of {args.rounds} rounds (latency: all rounds pooled):")
        pooled: dict[str, Sample] = {}
        for variant in variants:
            rounds = results[variant]
            merged = Sample(seconds=sum(s.seconds for s in rounds))
            for s in rounds:
                merged.latencies.extend(s.latencies)
                for status, count in s.failures.items():
                    merged.failures[status] = merged.failures.get(status, 0) + count
            pooled[variant] = merged
        bare_rates = [s.rate for s in results.get("bare", [])]
        for variant in variants:
            rate = statistics.median(s.rate for s in results[variant])
            ratios = (
                [s.rate / b for s, b in zip(results[variant], bare_rates, strict=True) if b]
                if bare_rates
                else []
            )
            p50, p95, p99 = (pooled[variant].percentile(q) for q in PERCENTILES)
            ratio = f"{statistics.median(ratios):5.2f}x" if ratios else "   -  "
            cpu = [c for s in results[variant] if (c := s.cpu_ms_per_request) is not None]
            print(
                f"  {variant:<7} {rate:8.0f} req/s  {ratio}  "
                f"p50 {p50:6.1f}  p95 {p95:6.1f}  p99 {p99:6.1f} ms  "
                f"{_cpu(statistics.median(cpu) if cpu else None)}"
            )
        print(f"load average {os.getloadavg()[0]:.2f} at end")
        failed = any(s.failures for s in pooled.values())
        with contextlib.suppress(OSError):
            api_errors = api.log()[-2000:]
            if failed and api_errors:
                print(api_errors, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
