"""What one PostgreSQL carries: drain rate and claims by hosts and children (docs/scaling.md).

Each shape runs `hosts` supervisors (`python -m worker`, standing in for worker hosts) of
`children` children each against one database, seeds `--tasks` noop tasks over `--companies`
companies, and drains them. Printed per shape, as medians over `--runs`: tasks/s (database
clock, first start to last finish), claims/s, the mean claim time (its transaction, the wait
for the claimers' lock included) from the supervisors' metrics, and the connections each child
holds, counted in `pg_stat_activity` while idle before the drain and at the end of it. The
ratio column compares each shape's rate with the first shape's, measured in the same run.

PostgreSQL: `--database-url`, else an embedded PostgreSQL 16 in `.pgdata/bench-scaling`.

Usage:
    .venv/bin/python -m scripts.bench_scaling [--shapes 1x1,1x2,1x4,2x2,4x2] [--runs 3]
        [--tasks 20000] [--companies 50] [--batch-size 100]
        [--database-url postgresql+psycopg://postgres@127.0.0.1:5432/fairq_bench]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Engine, text

from devtools import stack
from scripts.bench_throughput import (
    add_database_arguments,
    backend_pids,
    bench_database,
    completed,
    engine_for,
    reset,
    seed_companies,
    seed_tasks,
)


@dataclass(frozen=True)
class Shape:
    """`hosts` supervisors of `children` children each."""

    hosts: int
    children: int

    def __str__(self) -> str:
        hosts = f"{self.hosts} host{'s' if self.hosts > 1 else ''}"
        return f"{hosts} x {self.children} child{'ren' if self.children > 1 else ''}"


@dataclass(frozen=True)
class Run:
    """One drain of one shape."""

    rate: float
    claims_per_second: float
    mean_claim_ms: float
    connections_idle: float
    connections_busy: float


def parse_shapes(text_: str) -> list[Shape]:
    """`1x2,2x2` -> [Shape(1, 2), Shape(2, 2)]."""
    shapes = []
    for part in text_.split(","):
        hosts, children = part.lower().split("x")
        shapes.append(Shape(int(hosts), int(children)))
    return shapes


def _connections(engine: Engine) -> int:
    return len(backend_pids(engine, "fairq-worker%"))


def run_shape(engine: Engine, url: str, shape: Shape, args: argparse.Namespace) -> Run:
    """Start the shape's supervisors, wait for every child's boot, seed, drain, measure."""
    reset(engine)
    companies = seed_companies(engine, args.companies)
    env = {
        "WORKER_BATCH_SIZE": str(args.batch_size),
        "LOG_LEVEL": "WARNING",
        "SHUTDOWN_TIMEOUT_SECONDS": "30",
    }
    children = shape.hosts * shape.children
    with (
        tempfile.TemporaryDirectory(prefix="fairq-bench-scaling-") as tmp,
        contextlib.ExitStack() as hosts,
    ):
        supervisors = []
        for host in range(shape.hosts):
            workdir = Path(tmp) / f"host{host}"
            workdir.mkdir()
            supervisors.append(
                hosts.enter_context(
                    stack.supervisor(url, workdir, concurrency=shape.children, env=env)
                )
            )
        deadline = time.monotonic() + 60
        # A child has booted once its LISTEN connection is open (the last step of its boot).
        while len(backend_pids(engine, "fairq-worker-listen")) < children:
            if time.monotonic() > deadline:
                raise RuntimeError("children did not boot")
            time.sleep(0.05)
        idle = _connections(engine)
        before = [sup.metrics() for sup in supervisors]
        seed_tasks(engine, companies, args.tasks)
        with engine.begin() as conn:  # as the API does: wake the idle children
            conn.execute(text("SELECT pg_notify('fairq_tasks', '')"))
        busy = idle
        deadline = time.monotonic() + args.timeout
        while completed(engine) < args.tasks:
            busy = max(busy, _connections(engine))
            if time.monotonic() > deadline:
                raise RuntimeError(f"not drained after {args.timeout}s")
            time.sleep(0.05)
        after = [sup.metrics() for sup in supervisors]
    with engine.connect() as conn:
        seconds = float(
            conn.execute(
                text("SELECT extract(epoch FROM max(finished_at) - min(started_at)) FROM tasks")
            ).scalar_one()
        )

    def grew(name: str) -> float:
        return sum(
            end.get(name, 0.0) - start.get(name, 0.0)
            for start, end in zip(before, after, strict=True)
        )

    claims = grew("claim_duration_seconds_count")
    return Run(
        rate=args.tasks / seconds,
        claims_per_second=claims / seconds,
        mean_claim_ms=1000 * grew("claim_duration_seconds_sum") / claims if claims else 0.0,
        connections_idle=idle / children,
        connections_busy=busy / children,
    )


def main(argv: list[str] | None = None) -> int:
    """Run every shape `--runs` times, interleaved, and print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes("1x1,1x2,1x4,2x2,4x2"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--companies", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=300.0)
    add_database_arguments(parser)
    args = parser.parse_args(argv)
    results: dict[Shape, list[Run]] = {shape: [] for shape in args.shapes}
    with bench_database(args.database_url, "bench-scaling", fast_commit=args.fast_commit) as url:
        engine = engine_for(url)
        for run in range(1, args.runs + 1):
            for shape in args.shapes:
                result = run_shape(engine, url, shape, args)
                results[shape].append(result)
                print(
                    f"run {run} {shape}: {result.rate:,.0f} tasks/s, "
                    f"{result.claims_per_second:,.0f} claims/s, "
                    f"claim {result.mean_claim_ms:.1f} ms",
                    flush=True,
                )
        engine.dispose()
    first = statistics.median(r.rate for r in results[args.shapes[0]])
    print(
        f"medians ({args.tasks} noop tasks, {args.companies} companies, batch {args.batch_size}, "
        f"{args.runs} runs each):"
    )
    print("| shape | tasks/s | vs first | claims/s | mean claim | connections per child |")
    print("|---|---|---|---|---|---|")
    for shape, runs in results.items():
        rate = statistics.median(r.rate for r in runs)
        print(
            f"| {shape} | {rate:,.0f} | x{rate / first:.2f} "
            f"| {statistics.median(r.claims_per_second for r in runs):,.0f} "
            f"| {statistics.median(r.mean_claim_ms for r in runs):.1f} ms "
            f"| {statistics.median(r.connections_idle for r in runs):.1f} idle, "
            f"{statistics.median(r.connections_busy for r in runs):.1f} busy |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
