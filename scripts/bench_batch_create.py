"""Task creation through batches against single creates, on the real API under gunicorn.

Starts PostgreSQL (embedded in `.pgdata/bench-batch`, or `--database-url`, whose tasks and
companies are deleted first) and the real API (`deploy/gunicorn.conf.py`, `wsgi:app`;
GUNICORN_WORKERS and GUNICORN_THREADS from the environment, default 2 x 4; companies with
the default backlog quota, which no variant's run comes near). Keep-alive client threads
(each its own `requests.Session`) then load one variant at a time for
`--seconds` seconds, after a `--warmup` of its own:

- `single`: POST /companies/{id}/tasks, one `noop` task per request, `--clients` threads (the
  reference: what a producer without batches gets);
- `batch`: POST /companies/{id}/task-batches, `--batch-size` `noop` tasks per request,
  `--batch-clients` threads; the body is encoded once per company, so the client's CPU goes
  to sending, not to JSON;
- `batch-keys`: the same with an Idempotency-Key on every item (fresh ones each request: all
  created, none replayed): what keys cost (fingerprints, the unique index, the replay probe).

Every variant starts from an empty `tasks` table (TRUNCATE before it), so none inserts into a
larger table than another. Rounds alternate the variants (`--rounds`), so background load on a
shared box falls on all alike. It prints tasks/s, requests/s and client-side p50/p95/p99 per
request (ms) per variant and round, the ratio of each variant's tasks/s to the same round's
`single`, and the medians over the rounds; also the CPU time per task of the gunicorn workers
and of their PostgreSQL backends (read from /proc: a server on this host), which other load on
a shared box disturbs less than the rates. Answers other than 201 are counted and printed; the
run fails if there is any. Responses are read but not parsed (one batch answer is checked
before the run: its items, in order). `LOG_LEVEL` is INFO (the API's one line per request,
written to a file here) unless set.

Usage (from the repository root):
    .venv/bin/python -m scripts.bench_batch_create [--batch-size 1000] [--batch-clients 4]
        [--clients 16] [--seconds 10] [--warmup 2] [--rounds 3] [--companies 4]
        [--variants single,batch,batch-keys] [--database-url postgresql+psycopg://...]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import secrets
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import requests
from sqlalchemy import text

from devtools import stack
from scripts.bench_throughput import backend_pids, process_cpu

VARIANTS = ("single", "batch", "batch-keys")
PERCENTILES = (0.50, 0.95, 0.99)
REQUEST_TIMEOUT_SECONDS = 60.0


@dataclass
class Sample:
    """What one variant's clients saw in one round."""

    latencies: list[float] = field(default_factory=list)
    tasks: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    # CPU seconds of the gunicorn workers and of their PostgreSQL backends meanwhile (None:
    # not readable from /proc, e.g. a server on another host).
    api_cpu: float | None = 0.0
    db_cpu: float | None = 0.0

    @property
    def task_rate(self) -> float:
        """Tasks created per second."""
        return self.tasks / self.seconds if self.seconds else 0.0

    @property
    def request_rate(self) -> float:
        """Successful requests per second."""
        return len(self.latencies) / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        """The q-quantile request latency in ms (nearest rank)."""
        ordered = sorted(self.latencies)
        if not ordered:
            return float("nan")
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    def cpu_per_task(self) -> str:
        """CPU microseconds per task of the API and of PostgreSQL, as text."""
        if not self.tasks:
            return ""
        api = "-" if self.api_cpu is None else f"{1e6 * self.api_cpu / self.tasks:.0f}"
        db = "-" if self.db_cpu is None else f"{1e6 * self.db_cpu / self.tasks:.0f}"
        return f"  CPU/task: API {api} us, PostgreSQL {db} us"

    def add(self, other: Sample) -> None:
        """Pool `other` into this sample."""
        self.latencies.extend(other.latencies)
        self.tasks += other.tasks
        self.seconds += other.seconds
        self.api_cpu = _sum(self.api_cpu, other.api_cpu)
        self.db_cpu = _sum(self.db_cpu, other.db_cpu)
        for status, count in other.failures.items():
            self.failures[status] = self.failures.get(status, 0) + count


def _sum(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


# One request: (session, request number) -> (response, tasks it creates when it succeeds).
Request = Callable[[requests.Session, int], tuple[requests.Response, int]]


def _load(request: Request, clients: int, seconds: float, warmup: float = 0.0) -> Sample:
    """`clients` threads send `request` back to back; only the window after `warmup` counts."""
    sample = Sample(seconds=seconds)
    lock = threading.Lock()
    start = time.monotonic() + warmup
    end = start + seconds

    def client(n: int) -> None:
        mine = Sample()
        with requests.Session() as session:
            for i in itertools.count():
                if (now := time.monotonic()) >= end:
                    break
                response, tasks = request(session, n * 1_000_000 + i)
                done = time.monotonic()
                if now < start:
                    continue
                if response.status_code == 201:
                    mine.latencies.append(done - now)
                    mine.tasks += tasks
                else:
                    status = str(response.status_code)
                    mine.failures[status] = mine.failures.get(status, 0) + 1
        with lock:
            sample.add(mine)  # its seconds are 0: the window is the sample's

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sample


def _requests(api_url: str, companies: list[stack.Company], batch_size: int) -> dict[str, Request]:
    run = secrets.token_hex(4)  # keys of this run never meet an earlier run's
    keyed_requests = itertools.count()  # nor one request's another's (thread-safe in CPython)
    headers = [
        {"Authorization": f"Bearer {c.api_key}", "Content-Type": "application/json"}
        for c in companies
    ]
    single_body = json.dumps({"type": "noop", "payload": {}}).encode()
    batch_body = json.dumps({"tasks": [{"type": "noop", "payload": {}}] * batch_size}).encode()

    def company(i: int) -> int:
        return i % len(companies)

    def single(s: requests.Session, i: int) -> tuple[requests.Response, int]:
        c = company(i)
        url = f"{api_url}/companies/{companies[c].id}/tasks"
        response = s.post(
            url, data=single_body, headers=headers[c], timeout=REQUEST_TIMEOUT_SECONDS
        )
        return response, 1

    def batch(s: requests.Session, i: int) -> tuple[requests.Response, int]:
        c = company(i)
        url = f"{api_url}/companies/{companies[c].id}/task-batches"
        response = s.post(url, data=batch_body, headers=headers[c], timeout=REQUEST_TIMEOUT_SECONDS)
        return response, batch_size

    def batch_keys(s: requests.Session, i: int) -> tuple[requests.Response, int]:
        c = company(i)
        url = f"{api_url}/companies/{companies[c].id}/task-batches"
        prefix = f"{run}-{next(keyed_requests)}"
        items = ",".join(
            f'{{"type":"noop","payload":{{}},"idempotency_key":"{prefix}-{n}"}}'
            for n in range(batch_size)
        )
        body = f'{{"tasks":[{items}]}}'.encode()
        response = s.post(url, data=body, headers=headers[c], timeout=REQUEST_TIMEOUT_SECONDS)
        return response, batch_size

    return {"single": single, "batch": batch, "batch-keys": batch_keys}


def _check_batch(api_url: str, company: stack.Company, batch_size: int) -> None:
    """One batch answers 201 with its items in request order; raise `StackError` otherwise."""
    tasks = [{"type": "sleep", "payload": {"seconds": n % 300}} for n in range(batch_size)]
    response = requests.post(
        f"{api_url}/companies/{company.id}/task-batches",
        json={"tasks": tasks},
        headers={"Authorization": f"Bearer {company.api_key}"},
        timeout=REQUEST_TIMEOUT_SECONDS,
    )
    items = response.json().get("items", []) if response.status_code == 201 else []
    if [item["payload"]["seconds"] for item in items] != [n % 300 for n in range(batch_size)]:
        raise stack.StackError(f"a batch answered {response.status_code}: {response.text[:500]}")


def _measured(api: stack.ApiServer, url: str, run: Callable[[], Sample]) -> Sample:
    """`run()`, with the CPU its gunicorn workers and their database backends used meanwhile."""
    engine = stack.script_engine(url)
    try:
        workers = stack.children_of(api.pid)
        backends = backend_pids(engine, "fairq-api")
        api_cpu, db_cpu = process_cpu(workers), process_cpu(backends)
        sample = run()
        # Connections opened meanwhile (pool overflow) count whole; closed ones make it None.
        backends = sorted(set(backends) | set(backend_pids(engine, "fairq-api")))
        sample.api_cpu = _delta(process_cpu(workers), api_cpu)
        sample.db_cpu = _delta(process_cpu(backends), db_cpu)
    finally:
        engine.dispose()
    return sample


def _delta(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else after - before


def _empty_tasks(url: str) -> None:
    engine = stack.script_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text("TRUNCATE tasks"))
    finally:
        engine.dispose()


def _row(name: str, sample: Sample, reference: Sample | None) -> str:
    p50, p95, p99 = (sample.percentile(q) for q in PERCENTILES)
    ratio = (
        f"{sample.task_rate / reference.task_rate:6.1f}x"
        if reference is not None and reference.task_rate
        else "    -  "
    )
    failed = f"  non-201 {sample.failures}" if sample.failures else ""
    return (
        f"  {name:<10} {sample.task_rate:8.0f} tasks/s {ratio}  {sample.request_rate:7.1f} req/s"
        f"  p50 {p50:7.1f}  p95 {p95:7.1f}  p99 {p99:7.1f} ms{sample.cpu_per_task()}{failed}"
    )


def _print_medians(results: dict[str, list[Sample]]) -> bool:
    """Print each variant's medians over the rounds; return whether any request failed."""
    rounds = len(next(iter(results.values()), []))
    print(f"medians of {rounds} rounds (latency: all rounds pooled):")
    singles = [s.task_rate for s in results.get("single", [])]
    failed = False
    for variant, samples in results.items():
        pooled = Sample()
        for s in samples:
            pooled.add(s)
        failed = failed or bool(pooled.failures)
        ratios = [s.task_rate / ref for s, ref in zip(samples, singles, strict=False) if ref]
        ratio = f"{statistics.median(ratios):6.1f}x" if ratios else "    -  "
        p50, p95, p99 = (pooled.percentile(q) for q in PERCENTILES)
        print(
            f"  {variant:<10} {statistics.median(s.task_rate for s in samples):8.0f} tasks/s "
            f"{ratio}  {statistics.median(s.request_rate for s in samples):7.1f} req/s"
            f"  p50 {p50:7.1f}  p95 {p95:7.1f}  p99 {p99:7.1f} ms{pooled.cpu_per_task()}"
        )
    return failed


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; return 1 when any request failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--batch-clients", type=int, default=4)
    parser.add_argument("--clients", type=int, default=16, help="client threads of `single`")
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
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}")
    env = {"LOG_LEVEL": os.environ.get("LOG_LEVEL", "INFO")}
    token = secrets.token_urlsafe(32)
    shape = (os.environ.get("GUNICORN_WORKERS", "2"), os.environ.get("GUNICORN_THREADS", "4"))
    clients = {
        "single": args.clients,
        "batch": args.batch_clients,
        "batch-keys": args.batch_clients,
    }
    with ExitStack() as running, stack.sigterm_as_interrupt():
        workdir = Path(running.enter_context(tempfile.TemporaryDirectory(prefix="bench-batch-")))
        url = running.enter_context(stack.database(args.database_url, "bench-batch"))
        api = running.enter_context(
            stack.api_server(url, workdir / "api", admin_token=token, env=env)
        )
        companies = stack.create_companies(api.base_url, token, args.companies, prefix="bench")
        _check_batch(api.base_url, companies[0], args.batch_size)
        calls = _requests(api.base_url, companies, args.batch_size)
        print(
            f"gunicorn {shape[0]} workers x {shape[1]} threads (gthread), {args.companies} "
            f"companies, batches of {args.batch_size} noop tasks from {args.batch_clients} "
            f"client threads, single creates from {args.clients}; {args.seconds:g} s per "
            f"variant after {args.warmup:g} s warm-up, tasks table emptied before each; "
            f"{os.cpu_count()} CPUs shared by client, server and PostgreSQL; load average "
            f"{os.getloadavg()[0]:.2f} at start"
        )
        results: dict[str, list[Sample]] = {v: [] for v in variants}
        for n in range(1, args.rounds + 1):
            print(f"round {n}:")
            samples: dict[str, Sample] = {}
            for variant in variants:
                _empty_tasks(url)
                call, threads = calls[variant], clients[variant]
                _load(call, threads, args.warmup)  # warm-up, not counted
                samples[variant] = _measured(
                    api, url, functools.partial(_load, call, threads, args.seconds)
                )
                results[variant].append(samples[variant])
            for variant in variants:
                print(_row(variant, samples[variant], samples.get("single")))
        failed = _print_medians(results)
        print(f"load average {os.getloadavg()[0]:.2f} at end")
        with contextlib.suppress(OSError):
            api_errors = api.log()[-2000:]
            if failed and api_errors:
                print(api_errors, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
