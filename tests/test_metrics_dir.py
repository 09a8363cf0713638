"""The multiprocess metrics directory has one owner (`common.metrics_dir`, design §7).

No database. This process imported prometheus_client long ago, so what must happen before
that import runs in a fresh interpreter, as in the supervisor or gunicorn's master.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from common import metrics_dir

ROOT = Path(__file__).resolve().parent.parent


def run_python(code: str, *args: str, env: dict[str, str] | None = None) -> list[str]:
    """Run `code` in a fresh interpreter from the repository root; return its stdout lines."""
    result = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_a_configured_directory_is_created_emptied_of_metric_files_and_exported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    configured = tmp_path / "not" / "yet"
    monkeypatch.setenv(metrics_dir.ENV_VAR, str(configured))

    assert metrics_dir.prepare(configured, prefix="unused-") == configured
    assert configured.is_dir()

    (configured / "counter_4242.db").write_bytes(b"stale")
    (configured / "gauge_livesum_4243.db").write_bytes(b"stale")
    (configured / "notes.txt").write_text("not ours")
    metrics_dir.prepare(configured, prefix="unused-")
    metrics_dir.remove_temporary()

    assert [path.name for path in configured.iterdir()] == ["notes.txt"]
    assert os.environ[metrics_dir.ENV_VAR] == str(configured)


def test_a_new_directory_is_refused_once_prometheus_client_is_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its value class is chosen: every child's metrics would stay in memory, unseen.
    assert "prometheus_client" in sys.modules
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv(metrics_dir.ENV_VAR, raising=False)

    with pytest.raises(metrics_dir.MetricsDirError, match="imported before"):
        metrics_dir.prepare(None, prefix="fairq-test-")
    with pytest.raises(metrics_dir.MetricsDirError, match="imported before"):
        metrics_dir.prepare(tmp_path / "elsewhere", prefix="fairq-test-")

    assert list(tmp_path.iterdir()) == []
    assert metrics_dir.ENV_VAR not in os.environ


def test_without_a_configured_directory_a_temporary_one_lives_until_removed(
    tmp_path: Path,
) -> None:
    code = """if True:
        import os, sys, tempfile
        from pathlib import Path
        from common import metrics_dir
        tempfile.tempdir = sys.argv[1]
        made = metrics_dir.prepare(None, prefix="fairq-test-")
        import prometheus_client.values  # after prepare: files, not memory
        print(made, os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(made), made.is_dir())
        print(prometheus_client.values.ValueClass.__name__)
        metrics_dir.remove_temporary()
        print(made.exists())
    """
    env = {k: v for k, v in os.environ.items() if k != metrics_dir.ENV_VAR}

    made_line, value_class, exists_after = run_python(code, str(tmp_path), env=env)

    made, exported, existed = made_line.split()
    assert Path(made).parent == tmp_path
    assert Path(made).name.startswith("fairq-test-")
    assert (exported, existed) == ("True", "True")
    assert value_class == "MmapedValue"
    assert exists_after == "False"


@pytest.mark.parametrize("module", ["worker.cli", "worker.supervisor", "worker.child"])
def test_the_supervisor_side_imports_no_prometheus_client_before_it_prepares(
    module: str,
) -> None:
    # What keeps `prepare` in time without a hand-kept import order: checked, not trusted.
    [imported] = run_python(f"import sys, {module}; print('prometheus_client' in sys.modules)")

    assert imported == "False"
