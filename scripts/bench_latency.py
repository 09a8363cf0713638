"""Enqueue-to-start latency on an idle system (design §9): real API, real supervisor.

Starts the API under gunicorn (`deploy/gunicorn.conf.py`) and `python -m worker` (defaults:
2 children, 1 s poll, so a fast start comes from NOTIFY), creates a company, warms up, then
per run creates one `noop` task every `--interval` seconds for `--seconds` through
`POST /companies/{id}/tasks`. Latency is `started_at - created_at` of each task, both from
the database clock (`created_at` is the API transaction's start, so the API's own insert and
commit are included). Prints p50/p95/p99 per run and the median of each over `--runs`.

PostgreSQL: `--database-url`, else an embedded PostgreSQL 16 with its data in
`.pgdata/bench-latency`, stopped at the end.

Usage (from the repository root):
    .venv/bin/python -m scripts.bench_latency [--runs 3] [--seconds 10]
        [--interval 0.02] [--database-url postgresql+psycopg://...]
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests
from sqlalchemy import Engine, text

from devtools import stack
from scripts import bench_throughput as common

PERCENTILES = (0.5, 0.95, 0.99)


def create_company(base: str, token: str) -> tuple[str, str]:
    """POST /companies as admin; return (company id, API key)."""
    response = requests.post(
        f"{base}/companies",
        json={"name": "latency-bench"},
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    response.raise_for_status()
    body = response.json()
    return str(body["id"]), str(body["api_key"])


def enqueue(
    session: requests.Session,
    base: str,
    company_id: str,
    count: int,
    interval: float,
    *,
    post_ms: list[float] | None = None,
) -> list[str]:
    """Create `count` noop tasks, one every `interval` seconds (absolute schedule).

    Appends each POST's round trip (ms, client side) to `post_ms` when given.
    """
    ids = []
    start = time.perf_counter()
    for index in range(count):
        delay = start + index * interval - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        sent = time.perf_counter()
        response = session.post(
            f"{base}/companies/{company_id}/tasks", json={"type": "noop", "payload": {}}, timeout=10
        )
        response.raise_for_status()
        if post_ms is not None:
            post_ms.append(1000 * (time.perf_counter() - sent))
        ids.append(str(response.json()["id"]))
    return ids


def wait_started(engine: Engine, ids: list[str], timeout: float = 60.0) -> None:
    """Wait until every task in `ids` has started."""
    deadline = time.monotonic() + timeout
    while True:
        with engine.connect() as conn:
            waiting = conn.execute(
                text(
                    "SELECT count(*) FROM tasks "
                    "WHERE id = ANY(CAST(:ids AS uuid[])) AND started_at IS NULL"
                ),
                {"ids": ids},
            ).scalar_one()
        if waiting == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{waiting} tasks not started after {timeout}s")
        time.sleep(0.2)


def latencies_ms(engine: Engine, ids: list[str]) -> list[float]:
    """p50, p95, p99 of `started_at - created_at` over `ids`, in milliseconds."""
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT percentile_cont(CAST(:p AS float8[])) WITHIN GROUP "
                "       (ORDER BY extract(epoch FROM started_at - created_at)) "
                "FROM tasks WHERE id = ANY(CAST(:ids AS uuid[]))"
            ),
            {"p": list(PERCENTILES), "ids": ids},
        ).scalar_one()
    return [1000 * float(v) for v in row]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench_latency", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=0.02)
    parser.add_argument("--log-level", default="WARNING", help="LOG_LEVEL of the worker")
    common.add_database_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the results."""
    args = parse_args(argv)
    token = secrets.token_urlsafe(32)
    count = int(args.seconds / args.interval)
    with (
        common.bench_database(args.database_url, "latency", fast_commit=args.fast_commit) as url,
        tempfile.TemporaryDirectory(prefix="fairq-bench-") as tmp,
        stack.api_server(url, Path(tmp) / "api", admin_token=token) as api,
    ):
        base = api.base_url
        engine = common.engine_for(url)
        common.reset(engine)
        sup = stack.start_supervisor(url, Path(tmp) / "worker", {"LOG_LEVEL": args.log_level})
        try:
            sup.port()
            company_id, api_key = create_company(base, token)
            with requests.Session() as session:
                session.headers["Authorization"] = f"Bearer {api_key}"
                warmup = enqueue(session, base, company_id, 20, 0.05)
                wait_started(engine, warmup)
                runs = []
                for run in range(1, args.runs + 1):
                    post_ms: list[float] = []
                    ids = enqueue(session, base, company_id, count, args.interval, post_ms=post_ms)
                    wait_started(engine, ids)
                    p50, p95, p99 = latencies_ms(engine, ids)
                    runs.append((p50, p95, p99))
                    # For reading the result: how much of it the API request itself takes.
                    post_p50 = statistics.median(post_ms)
                    print(
                        f"run {run}: {len(ids)} tasks, enqueue-to-start "
                        f"p50 {p50:.1f} ms, p95 {p95:.1f} ms, p99 {p99:.1f} ms "
                        f"(POST round trip p50 {post_p50:.1f} ms)",
                        flush=True,
                    )
        finally:
            status = sup.stop(60.0)
            engine.dispose()
        if status != 0:
            raise RuntimeError(f"supervisor exited with {status}:\n{sup.log()[-3000:]}")
        medians = [statistics.median(r[i] for r in runs) for i in range(3)]
        print(
            f"median of {args.runs}: p50 {medians[0]:.1f} ms, p95 {medians[1]:.1f} ms, "
            f"p99 {medians[2]:.1f} ms (one task every {args.interval * 1000:.0f} ms for "
            f"{args.seconds:g} s, 2 children, poll 1 s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
