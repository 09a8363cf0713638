"""Drain throughput of the real worker supervisor (DESIGN §9): noop tasks per second.

Each run empties the tables, inserts `--tasks` pending `noop` tasks spread evenly over
`--companies` companies, starts `python -m worker` with `--concurrency` children and waits
until every task is completed. Throughput is tasks / (last `finished_at` - first
`started_at`), both from the database clock, so process start-up is not counted. Prints each
run, the median of `--runs`, and the average claim time from the supervisor's metrics.
Also the CPU time the supervisor and its children used per task (start-up included), which
other load on the machine disturbs much less than the rate: compare it between settings, e.g.
`--log-level INFO` against `WARNING`.

PostgreSQL: `--database-url`, else an embedded PostgreSQL 16 with its data in
`.pgdata/bench-throughput` (durable defaults: fsync and synchronous_commit on, unless
`--fast-commit`), stopped at the end.

Usage:
    PYTHONPATH=. .venv/bin/python scripts/bench_throughput.py [--tasks 20000]
        [--companies 50] [--runs 3] [--concurrency 2] [--batch-size 100]
        [--log-level WARNING] [--log-format text] [--fast-commit]
        [--database-url postgresql+psycopg://postgres@127.0.0.1:5432/fairq_bench]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Engine, text

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts import stack  # noqa: E402  (needs the repository on sys.path)


@contextmanager
def bench_database(url: str | None, name: str, *, fast_commit: bool) -> Iterator[str]:
    """Yield a migrated database URL: `url`, else an embedded server in `.pgdata/bench-<name>`."""
    options = {"synchronous_commit": "off"} if fast_commit else None
    with stack.database(url, f"bench-{name}", options=options) as db:
        yield db


def engine_for(url: str) -> Engine:
    """An engine whose connections never outlive their use (the server may be stopped)."""
    return stack.script_engine(url, application_name="fairq-bench")


def add_database_arguments(parser: argparse.ArgumentParser) -> None:
    """`--fast-commit` and `--database-url`, shared by the benchmarks."""
    parser.add_argument(
        "--fast-commit", action="store_true",
        help="embedded server only: synchronous_commit=off (commits skip the WAL flush wait)",
    )  # fmt: skip
    stack.add_database_url_argument(parser)


def reset(engine: Engine) -> None:
    """Empty the tables and refresh statistics, so every run starts alike."""
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE tasks, companies"))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE tasks, companies"))


def seed_companies(engine: Engine, count: int) -> list[str]:
    """Insert `count` companies; return their ids."""
    with engine.begin() as conn:
        return [
            str(company_id)
            for company_id in conn.execute(
                text(
                    "INSERT INTO companies (name, api_key_hash) "
                    "SELECT 'bench-' || g, md5('bench' || g || random()) "
                    "FROM generate_series(1, :n) g RETURNING id"
                ),
                {"n": count},
            ).scalars()
        ]


def seed_tasks(engine: Engine, companies: list[str], count: int) -> None:
    """Insert `count` pending noop tasks, round-robin over `companies`, oldest first."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO tasks (company_id, type, payload, created_at, run_after) "
                "SELECT (CAST(:companies AS uuid[]))[1 + g % :n], 'noop', '{}', "
                "       now() + g * interval '1 microsecond', now() "
                "FROM generate_series(0, :count - 1) g"
            ),
            {"companies": companies, "n": len(companies), "count": count},
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("ANALYZE tasks"))


def completed(engine: Engine) -> int:
    """How many tasks are completed."""
    with engine.connect() as conn:
        return int(
            conn.execute(text("SELECT count(*) FROM tasks WHERE status = 'completed'")).scalar_one()
        )


@dataclass(frozen=True)
class RunResult:
    """One drain: tasks, seconds between first start and last finish, claims seen."""

    tasks: int
    seconds: float
    claims: float
    claim_seconds: float
    cpu_seconds: float = 0.0

    @property
    def cpu_us_per_task(self) -> float:
        """CPU microseconds the supervisor and its children spent per task."""
        return 1e6 * self.cpu_seconds / self.tasks

    @property
    def rate(self) -> float:
        """Tasks per second."""
        return self.tasks / self.seconds


def run_once(engine: Engine, url: str, args: argparse.Namespace, workdir: Path) -> RunResult:
    """Seed, drain with a fresh supervisor, measure."""
    reset(engine)
    seed_tasks(engine, seed_companies(engine, args.companies), args.tasks)
    # The supervisor reaps its children, and this process reaps the supervisor: its rusage
    # then counts the whole tree.
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    sup = stack.start_supervisor(
        url,
        workdir,
        {
            "WORKER_CONCURRENCY": str(args.concurrency),
            "WORKER_BATCH_SIZE": str(args.batch_size),
            "LOG_LEVEL": args.log_level,
            "LOG_FORMAT": args.log_format,
        },
    )
    try:
        deadline = time.monotonic() + args.timeout
        while completed(engine) < args.tasks:
            if sup.proc.poll() is not None:
                raise RuntimeError(f"supervisor exited:\n{sup.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"not drained after {args.timeout}s")
            time.sleep(0.25)
        metrics = sup.metrics()
    finally:
        status = sup.stop(60.0)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    if status != 0:
        raise RuntimeError(f"supervisor exited with {status}:\n{sup.log()[-3000:]}")
    with engine.connect() as conn:
        seconds = conn.execute(
            text("SELECT extract(epoch FROM max(finished_at) - min(started_at)) FROM tasks")
        ).scalar_one()
    return RunResult(
        args.tasks,
        float(seconds),
        metrics.get("claim_duration_seconds_count", 0.0),
        metrics.get("claim_duration_seconds_sum", 0.0),
        cpu,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--companies", type=int, default=50)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument(
        "--log-level", default="WARNING",
        help="LOG_LEVEL of the worker (INFO logs a line per task, which costs throughput)",
    )  # fmt: skip
    parser.add_argument("--log-format", default="text", choices=("text", "json"))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run at most")
    add_database_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the results."""
    args = parse_args(argv)
    with (
        bench_database(args.database_url, "throughput", fast_commit=args.fast_commit) as url,
        tempfile.TemporaryDirectory(prefix="fairq-bench-") as tmp,
    ):
        engine = engine_for(url)
        try:
            results = []
            for run in range(1, args.runs + 1):
                result = run_once(engine, url, args, Path(tmp) / f"run-{run}")
                results.append(result)
                claim_ms = 1000 * result.claim_seconds / result.claims if result.claims else 0
                print(
                    f"run {run}: {result.tasks} tasks in {result.seconds:.3f} s = "
                    f"{result.rate:,.0f} tasks/s ({result.claims:.0f} claims, "
                    f"mean claim {claim_ms:.1f} ms; worker CPU "
                    f"{result.cpu_us_per_task:.1f} us/task)",
                    flush=True,
                )
            median = statistics.median(r.rate for r in results)
            cpu = statistics.median(r.cpu_us_per_task for r in results)
            print(
                f"median of {args.runs}: {median:,.0f} tasks/s, worker CPU {cpu:.1f} us/task "
                f"({args.tasks} noop tasks, {args.companies} companies, "
                f"{args.concurrency} children, batch {args.batch_size}, "
                f"log level {args.log_level}, format {args.log_format})"
            )
        finally:
            engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
