"""The chaos run from the command line: SIGKILL worker children while webhook tasks flow.

What the run does and what its report counts: `devtools.chaos` (each option sets the
`ChaosConfig` field of the same name). Exit status 1 when a task is lost, not completed,
completed without a delivery, or unknown.

Usage (from the repository root):
    .venv/bin/python -m scripts.chaos [--tasks 10000] [--companies 20] [--supervisors 2]
        [--children 2] [--api-threads 4] [--kill-interval 3] [--fail-percent 0]
        [--delivery-delay 0] [--stale-after 3] [--max-attempts 10] [--workdir DIR]
        [--database-url postgresql+psycopg://postgres@127.0.0.1:5432/fairq_chaos]
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from devtools import stack
from devtools.chaos import ChaosConfig, format_report, run


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    d = ChaosConfig()
    parser = argparse.ArgumentParser(
        prog="python -m scripts.chaos",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--tasks", type=int, default=d.tasks)
    parser.add_argument("--companies", type=int, default=d.companies)
    parser.add_argument("--supervisors", type=int, default=d.supervisors)
    parser.add_argument("--children", type=int, default=d.children, help="per supervisor")
    parser.add_argument("--api-threads", type=int, default=d.api_threads,
                        help="threads calling POST /workers/process")  # fmt: skip
    parser.add_argument("--create-threads", type=int, default=d.create_threads)
    parser.add_argument("--kill-interval", type=float, default=d.kill_interval,
                        help="seconds between kills (each ±50%%); 0 disables kills")  # fmt: skip
    parser.add_argument("--fail-percent", type=float, default=d.fail_percent,
                        help="share of deliveries the receiver answers 503 (retried)")  # fmt: skip
    parser.add_argument(
        "--delivery-delay",
        type=float,
        default=d.delivery_delay,
        help="seconds the receiver waits before answering (longer batches)",
    )
    parser.add_argument("--stale-after", type=float, default=d.stale_after,
                        help="STALE_AFTER_SECONDS of workers and API")  # fmt: skip
    parser.add_argument("--max-attempts", type=int, default=d.max_attempts)
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--chaos-seconds", type=float, default=d.chaos_seconds,
                        help="stop killing after this long even if work remains")  # fmt: skip
    parser.add_argument("--drain-timeout", type=float, default=d.drain_timeout)
    parser.add_argument("--seed", type=int, default=d.seed)
    stack.add_database_url_argument(
        parser,
        "PostgreSQL to use (its tasks and companies are deleted); default: embedded in "
        ".pgdata/chaos",
    )
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where process logs go (default: a temporary directory, "
                             "kept only when the run fails)")  # fmt: skip
    return parser.parse_args(argv)


@contextlib.contextmanager
def _workdir(given: Path | None) -> Iterator[tuple[Path, list[bool]]]:
    """Yield the working directory and a flag list; a temporary one is kept if flagged."""
    keep: list[bool] = []
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given, keep
        return
    path = Path(tempfile.mkdtemp(prefix="fairq-chaos-"))
    try:
        yield path, keep
    finally:
        if keep:
            print(f"logs kept in {path}", file=sys.stderr)
        else:
            shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Run the chaos test, print the report; 0 when nothing was lost, else 1."""
    args = parse_args(argv)
    if args.kill_interval <= 0:
        args.kill_interval = 1e9
    config = ChaosConfig(
        tasks=args.tasks,
        companies=args.companies,
        supervisors=args.supervisors,
        children=args.children,
        api_threads=args.api_threads,
        create_threads=args.create_threads,
        kill_interval=args.kill_interval,
        fail_percent=args.fail_percent,
        delivery_delay=args.delivery_delay,
        stale_after=args.stale_after,
        max_attempts=args.max_attempts,
        batch_size=args.batch_size,
        chaos_seconds=args.chaos_seconds,
        drain_timeout=args.drain_timeout,
        seed=args.seed,
        database_url=args.database_url,
    )
    with stack.sigterm_as_interrupt(), _workdir(args.workdir) as (workdir, keep):
        try:
            report = run(config, workdir=workdir, log=lambda line: print(line, flush=True))
        except BaseException:
            keep.append(True)
            raise
        print(format_report(report), flush=True)
        if not report.ok:
            keep.append(True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
