"""What the task statistics cost at 1M tasks and 20,000 companies (`db.tenant_stats`).

Seeds with `scripts.perf_seed` (every company with work, 20% of it delayed), then gives the
rows the statuses of a live queue that has run for a week, and adds a whale:

- perf_seed's rows (`--rows` minus the whale's): of those runnable since creation, 70%
  completed (one in seven within the last 2 hours: a busy queue, ~8 tasks/s, so the last
  hour holds 3 times the limit of finished rows counted), 4% failed, 1% cancelled,
  0.25% processing, the rest pending; the delayed ones stay pending;
- one whale, `company-1`, with `--whale-rows` more tasks of its own, 52% runnable and 48%
  delayed, 500 of them processing: past every limit of `db.tenant_stats.Limits`, so its
  figures take the estimate paths, at their bounded cost.

Then it measures, in rounds (each round runs every variant once, so background load on a
shared box falls on all alike; `--rounds`), the median time of:

- each statement of the statistics, as `db.tenant_stats` runs it (labelled by the comment
  it opens with), timed around the driver call, for a typical company, the whale and the
  queue; the reference is the queue gauges' scrape (`db.statistics` and `db.queue_health`,
  `QueueCollector`'s four queries), whose cost is already accepted on every Prometheus scrape;
- each function (`company_stats`, `queue_stats`), in a transaction under the API's
  statement timeout, as the API runs it;
- each endpoint over HTTP against the real API (gunicorn, `deploy/gunicorn.conf.py`),
  `GET /companies/{id}/stats` (own key) and `GET /stats` (admin), one client, keep-alive;
  the reference is `GET /companies/{id}` of the same company (one primary-key read).

With `--plans`, also each statement's plan (EXPLAIN ANALYZE, BUFFERS) for the whale and
the queue.

Usage (from the repository root):
    .venv/bin/python -m scripts.bench_stats [--companies 20000] [--rows 1000000]
        [--whale-rows 250000] [--rounds 15] [--plans] [--reseed]
        [--database-url postgresql+psycopg://postgres@127.0.0.1:5432/fairq_bench_stats]

Without `--database-url` or `DATABASE_URL`, an embedded PostgreSQL with its data in
`.pgdata/bench` is started for the run and stopped afterwards. A seed is reused while it is
less than `REUSE_SECONDS` old (its recent windows age with the clock), unless `--reseed`.
"""

from __future__ import annotations

import argparse
import re
import secrets
import statistics
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests
from sqlalchemy import Connection, Engine, event, text

from db import queue_health, tenant_stats
from db import statistics as gauges
from db.engine import driver_connection
from devtools import stack
from scripts import perf_seed

# The API's default statement timeout of the statistics (api.settings).
TIMEOUT_MS = 2000
# A seed older than this is rebuilt: its "last hour" has drifted out of the window.
REUSE_SECONDS = 1800
WHALE_NAME = "company-1"
REQUEST_TIMEOUT_SECONDS = 30.0

# Statuses of the runnable rows perf_seed made: a deterministic draw per row from its id.
_MIX = """
/* bench_stats.mix */
WITH drawn AS (
    SELECT id, created_at,
           CAST(CAST(CAST('x' || substr(md5(CAST(id AS text)), 1, 8) AS bit(32)) AS bigint)
                AS float8) / 4294967296.0 AS r
    FROM tasks
    WHERE status = 'pending' AND run_after <= now()
)
UPDATE tasks t
SET status = CASE WHEN d.r < 0.70 THEN 'completed' WHEN d.r < 0.74 THEN 'failed'
                  WHEN d.r < 0.75 THEN 'cancelled' WHEN d.r < 0.7525 THEN 'processing'
                  ELSE 'pending' END,
    attempts = CASE WHEN d.r < 0.7525 THEN 1 ELSE 0 END,
    finished_at = CASE
        -- One in seven completed tasks finished within the last 2 hours, evenly.
        WHEN d.r < 0.10 THEN now() - make_interval(secs => d.r / 0.10 * 7200)
        WHEN d.r < 0.70 THEN d.created_at + interval '2 seconds'
        WHEN d.r < 0.75 THEN d.created_at + interval '1 minute'
        END,
    started_at = CASE WHEN d.r < 0.7525 THEN d.created_at END,
    lease_token = CASE WHEN d.r >= 0.75 AND d.r < 0.7525 THEN gen_random_uuid() END,
    locked_by = CASE WHEN d.r >= 0.75 AND d.r < 0.7525 THEN 'bench:1' END,
    locked_at = CASE WHEN d.r >= 0.75 AND d.r < 0.7525 THEN now() END
FROM drawn d
WHERE t.id = d.id AND d.r < 0.7525
"""

# The whale's own tasks: created over the last day, runnable since then or delayed by 1 to 2
# days; one INSERT, so the triggers keep its backlog and due_at as for the API.
_WHALE = """
/* bench_stats.whale */
INSERT INTO tasks (company_id, type, payload, status, run_after, created_at, updated_at)
SELECT md5('fairq-company-1')::uuid, 'noop', '{}', 'pending',
       CASE WHEN g % 25 < 12 THEN now() + interval '1 day' + make_interval(secs => g % 86400)
            ELSE at END,
       at, at
FROM generate_series(1, :rows) AS g,
     LATERAL (SELECT now() - make_interval(secs => (:rows - g) * 86400.0 / :rows) AS at) AS c
"""

_WHALE_LEASES = """
/* bench_stats.whale_leases */
UPDATE tasks SET status = 'processing', attempts = 1, lease_token = gen_random_uuid(),
                 locked_by = 'bench:1', locked_at = now(), started_at = now()
WHERE id IN (SELECT id FROM tasks
             WHERE company_id = md5('fairq-company-1')::uuid AND status = 'pending'
               AND run_after <= now()
             ORDER BY run_after LIMIT 500)
"""

_FIGURES = """
SELECT (SELECT count(*) FROM tasks) AS tasks,
       (SELECT count(*) FROM companies) AS companies,
       (SELECT count(*) FROM tasks WHERE status = 'pending' AND run_after <= now()) AS runnable,
       (SELECT count(*) FROM tasks WHERE status = 'pending' AND run_after > now()) AS delayed,
       (SELECT count(*) FROM tasks WHERE status = 'processing') AS processing,
       (SELECT count(*) FROM tasks WHERE status IN ('completed', 'failed', 'cancelled'))
           AS finished,
       (SELECT count(*) FROM tasks WHERE status IN ('completed', 'failed')
          AND finished_at >= now() - interval '1 hour') AS finished_last_hour
"""

_LABEL = re.compile(r"^\s*/\*\s*(\S+)\s*\*/")


def marker(args: argparse.Namespace) -> str:
    """The table comment identifying this script's seed (the seeding time last)."""
    return (
        f"bench_stats companies={args.companies} rows={args.rows} whale={args.whale_rows} "
        f"schema={perf_seed.schema_fingerprint()} seeded_at="
    )


def reusable(engine: Engine, args: argparse.Namespace) -> bool:
    """Whether the database holds this seed, younger than `REUSE_SECONDS`."""
    current = perf_seed.current_marker(engine) or ""
    prefix = marker(args)
    if not current.startswith(prefix):
        return False
    return time.time() - float(current.removeprefix(prefix)) < REUSE_SECONDS


def seed(engine: Engine, args: argparse.Namespace) -> None:
    """perf_seed's workload, then the statuses of a live queue and the whale."""
    shape = perf_seed.Shape(
        companies=args.companies, active=args.companies, rows=args.rows - args.whale_rows
    )
    print(f"seeding: {shape.describe()}, then the status mix and a whale of {args.whale_rows:,}")
    started = time.perf_counter()
    perf_seed.seed(engine, shape)
    with engine.begin() as conn:
        conn.execute(text(_MIX))
        conn.execute(text(_WHALE), {"rows": args.whale_rows})
        conn.execute(text(_WHALE_LEASES))
        conn.execute(text(f"COMMENT ON TABLE tasks IS '{marker(args)}{time.time():.0f}'"))
    perf_seed.vacuum(engine, analyze=True)
    print(f"seeded in {time.perf_counter() - started:.0f}s")


class StatementTimer:
    """Times every statement an engine sends, by the label of its opening comment."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.samples: dict[str, list[float]] = defaultdict(list)
        # The last statement of each label as sent, with its driver parameters (`--plans`).
        self.sent: dict[str, tuple[str, Any]] = {}
        self.prefix = ""
        event.listen(engine, "before_cursor_execute", self._before)
        event.listen(engine, "after_cursor_execute", self._after)

    def close(self) -> None:
        """Stop timing."""
        event.remove(self.engine, "before_cursor_execute", self._before)
        event.remove(self.engine, "after_cursor_execute", self._after)

    def _before(self, conn: Connection, *_args: Any) -> None:
        conn.info["bench_started"] = time.perf_counter()

    def _after(
        self, conn: Connection, _cursor: Any, statement: str, parameters: Any, *_args: Any
    ) -> None:
        elapsed = time.perf_counter() - conn.info.pop("bench_started")
        found = _LABEL.match(statement)
        # Only the statistics' own statements (not SET LOCAL, not the gauges').
        if self.prefix and found and found.group(1).startswith("tenant_stats."):
            label = f"{self.prefix}: {found.group(1).removeprefix('tenant_stats.')}"
            self.samples[label].append(elapsed)
            self.sent[label] = (statement, parameters)

    @contextmanager
    def labelled(self, prefix: str) -> Iterator[None]:
        """Record the block's statements under `prefix`."""
        self.prefix = prefix
        try:
            yield
        finally:
            self.prefix = ""


def in_transaction(engine: Engine, read: Callable[[Connection], object]) -> None:
    """Run `read` as the API does: a transaction of its own under the statement timeout."""
    with (
        engine.connect() as conn,
        conn.begin(),
        tenant_stats.time_limit(driver_connection(conn, transaction=False), TIMEOUT_MS),
    ):
        read(conn)


def gauge_scrape(conn: Connection) -> None:
    """What `api.metrics.QueueCollector` reads per scrape."""
    driver = driver_connection(conn, transaction=False)
    gauges.tasks_by_status(driver)
    gauges.oldest_xmin_holder_age(driver)
    queue_health.waiting(driver)
    queue_health.table_tuples(driver)


def measure_queries(
    engine: Engine, typical: uuid.UUID, whale: uuid.UUID, rounds: int
) -> tuple[StatementTimer, dict[str, list[float]]]:
    """(the statements' timer, seconds per function) over `rounds` rounds."""
    timer = StatementTimer(engine)
    functions: dict[str, list[float]] = defaultdict(list)
    variants: dict[str, Callable[[Connection], object]] = {
        "gauges' scrape (reference)": gauge_scrape,
        "company_stats, typical company": lambda c: tenant_stats.company_stats(
            driver_connection(c, transaction=False), typical
        ),
        "company_stats, whale": lambda c: tenant_stats.company_stats(
            driver_connection(c, transaction=False), whale
        ),
        "queue_stats": lambda c: tenant_stats.queue_stats(driver_connection(c, transaction=False)),
    }
    for round_ in range(rounds + 1):  # round 0 warms the cache, not counted
        for name, read in variants.items():
            started = time.perf_counter()
            with timer.labelled(name.split(",")[-1].strip() if round_ else ""):
                in_transaction(engine, read)
            if round_:
                functions[name].append(time.perf_counter() - started)
    timer.close()
    return timer, dict(functions)


def measure_endpoints(
    url: str, typical: uuid.UUID, typical_key: str, whale: uuid.UUID, rounds: int
) -> dict[str, list[float]]:
    """Seconds per request of each endpoint over `rounds` rounds, against real gunicorn."""
    admin = secrets.token_urlsafe(32)
    own = {"Authorization": f"Bearer {typical_key}"}
    whale_key = {"Authorization": "Bearer perf-seed-key-1"}
    variants = {
        "GET /companies/{id} (reference)": (f"/companies/{typical}", own),
        "GET /companies/{id}/stats, typical company": (f"/companies/{typical}/stats", own),
        "GET /companies/{id}/stats, whale": (f"/companies/{whale}/stats", whale_key),
        "GET /stats": ("/stats", {"Authorization": f"Bearer {admin}"}),
    }
    samples: dict[str, list[float]] = defaultdict(list)
    with (
        tempfile.TemporaryDirectory(prefix="fairq-bench-stats-") as workdir,
        stack.api_server(
            url, Path(workdir), admin_token=admin, env={"LOG_LEVEL": "WARNING"}
        ) as api,
        requests.Session() as session,
    ):
        for round_ in range(rounds + 1):
            for name, (path, headers) in variants.items():
                started = time.perf_counter()
                response = session.get(
                    api.base_url + path, headers=headers, timeout=REQUEST_TIMEOUT_SECONDS
                )
                elapsed = time.perf_counter() - started
                if response.status_code != 200:
                    raise SystemExit(f"{name}: {response.status_code} {response.text[:300]}")
                if round_:
                    samples[name].append(elapsed)
    return dict(samples)


def print_table(title: str, samples: dict[str, list[float]], reference: float) -> None:
    """Median ms of each row, and its ratio to `reference` (seconds)."""
    base = reference
    width = max(len(name) for name in samples)
    print(f"\n{title}")
    print(f"{'':{width}}  {'median ms':>10}  {'p90 ms':>8}  {'x ref':>6}")
    for name, values in samples.items():
        ordered = sorted(values)
        median = statistics.median(ordered)
        p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        print(f"{name:{width}}  {median * 1000:10.2f}  {p90 * 1000:8.2f}  {median / base:6.2f}")


def print_plans(engine: Engine, timer: StatementTimer) -> None:
    """EXPLAIN (ANALYZE, BUFFERS) of each statement as last sent, with its parameters."""
    with engine.connect() as conn:
        for label, (statement, parameters) in timer.sent.items():
            if "planner_rows" in label:
                continue  # an EXPLAIN itself
            print(f"\n-- {label}")
            plan = conn.exec_driver_sql(
                "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + statement, parameters
            ).scalars()
            for line in plan:
                print(line)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line of this script."""
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench_stats",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    parser.add_argument("--companies", type=int, default=20_000, help="default 20000")
    parser.add_argument("--rows", type=int, default=1_000_000, help="tasks in all (1000000)")
    parser.add_argument(
        "--whale-rows", type=int, default=250_000, help="the whale's tasks (250000)"
    )
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (default 15)")
    parser.add_argument("--plans", action="store_true", help="print each statement's plan")
    parser.add_argument("--reseed", action="store_true", help="seed even if a seed is fresh")
    stack.add_database_url_argument(
        parser,
        "postgresql+psycopg:// URL (created if missing); default DATABASE_URL, else an "
        "embedded server with data in .pgdata/bench",
    )
    args = parser.parse_args(argv)
    if not 0 < args.whale_rows < args.rows:
        parser.error("need 0 < --whale-rows < --rows")
    return args


def main(argv: list[str] | None = None) -> int:
    """Seed (or reuse), measure, print."""
    args = parse_args(argv)
    with perf_seed.database(args.database_url) as url:
        engine = perf_seed.bench_engine(url)
        try:
            if args.reseed or not reusable(engine, args):
                seed(engine, args)
            with engine.connect() as conn:
                figures = conn.execute(text(_FIGURES)).one()
                whale, typical = (
                    conn.execute(
                        text("SELECT id FROM companies WHERE name = :n"), {"n": name}
                    ).scalar_one()
                    for name in (WHALE_NAME, "company-2")
                )
            print(
                f"{figures.tasks:,} tasks of {figures.companies:,} companies: "
                f"{figures.runnable:,} runnable, {figures.delayed:,} delayed, "
                f"{figures.processing:,} processing, {figures.finished:,} finished "
                f"({figures.finished_last_hour:,} completed or failed in the last hour)"
            )
            with engine.connect() as conn:
                for name, company in (("typical", typical), ("whale", whale)):
                    stats = tenant_stats.company_stats(
                        driver_connection(conn, transaction=False), company
                    )
                    print(f"{name}: {stats.tasks}, runnable {stats.runnable:,}, estimated "
                          f"{list(stats.estimated)}")  # fmt: skip
                queue = tenant_stats.queue_stats(driver_connection(conn, transaction=False))
                print(f"queue: {queue.tasks}, runnable {queue.runnable:,}, "
                      f"completed_last_60m {queue.completed_last_60m:,}, "
                      f"estimated {list(queue.estimated)}")  # fmt: skip
            timer, per_function = measure_queries(engine, typical, whale, args.rounds)
            endpoints = measure_endpoints(url, typical, "perf-seed-key-2", whale, args.rounds)
            reference = statistics.median(per_function["gauges' scrape (reference)"])
            print_table(
                "functions, each in its own transaction under the statement timeout "
                "(x ref: the gauges' scrape)",
                per_function,
                reference,
            )
            print_table("their statements (x ref: the gauges' scrape)", timer.samples, reference)
            print_table(
                "endpoints over HTTP (gunicorn, one keep-alive client; x ref: GET /companies/{id})",
                endpoints,
                statistics.median(endpoints["GET /companies/{id} (reference)"]),
            )
            if args.plans:
                print_plans(engine, timer)
        finally:
            engine.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
