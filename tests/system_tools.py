"""System programs some tests need besides Python, found or the test skipped (failed in CI).

`.ci/run` installs each with apt (the package named here); README, "Running the tests", lists
them for a developer's machine.
"""

from __future__ import annotations

import os
import shutil

import pytest

# Where Debian puts daemons such as pgbouncer, often not on a user's PATH.
_SYSTEM_DIRECTORIES = ("/usr/bin", "/usr/sbin")


def in_ci() -> bool:
    """True when running in CI, where a missing program is an error, not a skip."""
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def require(program: str, *, package: str) -> str:
    """Path of `program`; skip the test (fail it in CI) when it is not installed."""
    found = shutil.which(program) or shutil.which(
        program, path=os.pathsep.join(_SYSTEM_DIRECTORIES)
    )
    if found:
        return found
    reason = f"{program} is not installed: apt-get install {package} (.ci/run does it in CI)"
    if in_ci():
        pytest.fail(reason)
    pytest.skip(reason)
