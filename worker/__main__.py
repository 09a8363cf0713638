"""`python -m worker`: see `worker.cli`."""

from __future__ import annotations

import sys

from worker import cli

if __name__ == "__main__":
    sys.exit(cli.main())
