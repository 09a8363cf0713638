"""The deployment files agree with each other, with the code and with design §5, §7 and §9.

Docker does not run where the tests run, so these tests read docker-compose.yml, the
Dockerfile, the Prometheus and Grafana files as data, and run the entrypoint script for real.
`E2E_COMMANDS` is the contract with the end-to-end test: it starts exactly these commands, and
the compose file must run exactly these.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import secrets
import stat
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any, Final

import pytest
import yaml
from flask.testing import FlaskClient

from api.settings import ApiSettings
from tests import system_tools
from worker.settings import WorkerSettings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"
ENTRYPOINT = ROOT / "deploy" / "entrypoint.sh"
PROMETHEUS_FILE = ROOT / "deploy" / "prometheus.yml"
ALERTS_FILE = ROOT / "deploy" / "alerts.yml"
ALERT_TESTS_FILE = ROOT / "deploy" / "alerts_test.yml"
DASHBOARD_FILE = ROOT / "deploy" / "grafana" / "dashboard.json"
GRAFANA_PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"

# The commands the image runs, per compose service; the end-to-end test imports this.
E2E_COMMANDS: Final[dict[str, list[str]]] = {
    "api": ["gunicorn", "-c", "deploy/gunicorn.conf.py", "wsgi:app"],
    "worker": ["python", "-m", "worker"],
    "migrate": ["alembic", "upgrade", "head"],
}
IMAGE_SERVICES: Final = tuple(E2E_COMMANDS)
IMAGE_ENTRYPOINT: Final = ["/app/deploy/entrypoint.sh"]

# Published ports (host:container), design §9.
EXPECTED_PORTS: Final[dict[str, set[str]]] = {
    "api": {"8000:8000"},
    "worker": {"9100:9100"},
    "mailpit": {"8025:8025", "1025:1025"},
    "prometheus": {"9090:9090"},
}

# Metric names, design §7 (worker port and the API's queue gauges), plus what
# prometheus-flask-exporter exposes for HTTP requests and what Prometheus adds per target.
_COUNTERS = (
    "tasks_claimed_total",
    "tasks_completed_total",
    "tasks_retried_total",
    "tasks_failed_total",
    "tasks_released_total",
    "tasks_lease_lost_total",
    "worker_child_restarts_total",
    "worker_child_timeouts_total",
    "auth_failures_total",
    "flask_http_request_total",
    "flask_http_request_exceptions_total",
)
_GAUGES = (
    "tasks_by_status",
    "oldest_eligible_pending_age_seconds",
    "oldest_runnable_pending_age_seconds",
    "oldest_held_pending_age_seconds",
    "due_companies",
    "due_backlog_tasks",
    "oldest_xmin_holder_age_seconds",
    "queue_table_dead_tuples",
    "queue_table_live_tuples",
    "worker_children",
    "up",
)
_HISTOGRAMS = (
    "task_duration_seconds",
    "claim_duration_seconds",
    "flask_http_request_duration_seconds",
)
ALLOWED_METRICS: Final = frozenset(
    {*_COUNTERS, *_GAUGES}
    | {f"{name}_{suffix}" for name in _HISTOGRAMS for suffix in ("bucket", "sum", "count")}
)
# Labels those metrics carry (bounded values only, design §7), plus Prometheus's target labels.
ALLOWED_LABELS: Final = frozenset(
    {
        "type",
        "status",
        "reason",
        "table",
        "method",
        "url_rule",
        "le",
        "job",
        "instance",
        "surface",
        "outcome",
    }
)

_PROMQL_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
    | {"and", "or", "unless", "atan2"}
)


def load_yaml(path: Path) -> Any:
    """The parsed YAML document at `path`."""
    with path.open(encoding="utf-8") as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """docker-compose.yml, parsed (anchors and `<<` merge keys resolved by PyYAML)."""
    document: dict[str, Any] = load_yaml(COMPOSE_FILE)
    return document


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The compose services by name."""
    result: dict[str, dict[str, Any]] = compose["services"]
    return result


@pytest.fixture(scope="module")
def prometheus() -> dict[str, Any]:
    """deploy/prometheus.yml, parsed."""
    document: dict[str, Any] = load_yaml(PROMETHEUS_FILE)
    return document


@pytest.fixture(scope="module")
def alert_rules() -> list[dict[str, Any]]:
    """Every rule of deploy/alerts.yml."""
    document = load_yaml(ALERTS_FILE)
    return [rule for group in document["groups"] for rule in group["rules"]]


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    """deploy/grafana/dashboard.json, parsed."""
    document: dict[str, Any] = json.loads(DASHBOARD_FILE.read_text(encoding="utf-8"))
    return document


# Variables compose must be given (`${NAME:?message}`), and the values the tests give them.
REQUIRED_VARIABLES = {"ADMIN_TOKEN": secrets.token_urlsafe(32)}


def compose_default(value: str) -> str:
    """The value compose uses for `value` when no optional variable is set (`${NAME:-default}`)
    and the required ones are `REQUIRED_VARIABLES`' (`${NAME:?message}`)."""
    value = re.sub(r"\$\{(\w+):\?[^}]*\}", lambda found: REQUIRED_VARIABLES[found[1]], value)
    return re.sub(r"\$\{\w+:?-([^}]*)\}", r"\1", value)


def environment(service: dict[str, Any]) -> dict[str, str]:
    """A service's environment as compose would pass it with only the required variables set."""
    env = service.get("environment", {})
    assert isinstance(env, dict), "write environment as a mapping, not a list"
    return {str(k): compose_default(str(v)) for k, v in env.items()}


def seconds(duration: str) -> float:
    """A compose or Prometheus duration (`40s`, `1m30s`, `2m`) in seconds."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+)s)?(?:(\d+)ms)?", duration)
    assert duration, "empty duration"
    assert parts, f"not a duration: {duration!r}"
    h, m, s, ms = (int(p or 0) for p in parts.groups())
    return h * 3600 + m * 60 + s + ms / 1000


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile, continuation lines joined."""
    logical: list[str] = []
    pending = ""
    for line in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical.append(pending + stripped)
        pending = ""
    assert not pending, "Dockerfile ends inside a continuation line"
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1]) for text in logical]


def strip_promql(expr: str) -> str:
    """`expr` without string literals, Grafana variables and range selectors."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\$\{?\w+\}?", "", expr)
    return re.sub(r"\[[^\]]*\]", "", expr)


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords, labels dropped)."""
    text = strip_promql(expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = set()
    for match in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = match.group()
        if word in _PROMQL_KEYWORDS or text[match.end() :].lstrip().startswith("("):
            continue
        names.add(word)
    return names


def promql_label_names(expr: str) -> set[str]:
    """Label names a PromQL expression matches on or aggregates by."""
    text = strip_promql(expr)
    labels: set[str] = set()
    for matchers in re.findall(r"\{([^}]*)\}", text):
        labels.update(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
    for grouping in re.findall(
        r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", text
    ):
        labels.update(label.strip() for label in grouping.split(",") if label.strip())
    return labels


def assert_balanced(expr: str) -> None:
    """Brackets of `expr` (outside strings) open and close in order."""
    stack: list[str] = []
    pairs = {")": "(", "]": "[", "}": "{"}
    for char in re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr):
        if char in "([{":
            stack.append(char)
        elif char in pairs:
            assert stack, f"unbalanced {char!r} in {expr!r}"
            assert stack.pop() == pairs[char], f"mismatched {char!r} in {expr!r}"
    assert not stack, f"unclosed {stack!r} in {expr!r}"


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    """Every query expression of the dashboard, rows' nested panels included."""
    panels = list(dashboard["panels"])
    for panel in dashboard["panels"]:
        panels.extend(panel.get("panels", []))
    return [target["expr"] for panel in panels for target in panel.get("targets", [])]


# --- docker-compose.yml ----------------------------------------------------------------------


def test_api_worker_and_migrate_share_one_image_built_from_deploy_dockerfile(
    services: dict[str, dict[str, Any]],
) -> None:
    images = {services[name].get("image") for name in IMAGE_SERVICES}
    builds = [services[name].get("build") for name in IMAGE_SERVICES]

    assert len(images) == 1, f"one image name for {IMAGE_SERVICES}, got {images}"
    assert None not in images
    for build in builds:
        assert build == {"context": ".", "dockerfile": "deploy/Dockerfile"}
    others = {name for name, svc in services.items() if "build" in svc}
    assert others == set(IMAGE_SERVICES), "only our services are built; the rest are images"
    for name, svc in services.items():
        if name not in IMAGE_SERVICES:
            tag = svc["image"].rpartition(":")[2] if ":" in svc["image"] else "latest"
            assert tag != "latest", f"{name}: pin the image tag"


def test_services_publish_the_documented_ports(services: dict[str, dict[str, Any]]) -> None:
    for name, expected in EXPECTED_PORTS.items():
        ports = services[name].get("ports", [])
        # Unquoted 8000:8000 is a base-60 integer in YAML 1.1: ports must be strings.
        assert all(isinstance(port, str) for port in ports), f"{name}: quote the ports"
        assert set(ports) == expected, name


def test_db_is_postgres_16_with_a_pg_isready_healthcheck(
    services: dict[str, dict[str, Any]],
) -> None:
    db = services["db"]

    assert db["image"].split(":")[0] == "postgres"
    assert db["image"].split(":")[1].split(".")[0] == "16"
    assert db["healthcheck"]["test"][0] == "CMD"
    assert "pg_isready" in db["healthcheck"]["test"]


def test_migration_waits_for_a_healthy_db_and_the_processes_for_the_migration(
    services: dict[str, dict[str, Any]],
) -> None:
    assert services["migrate"]["depends_on"]["db"]["condition"] == "service_healthy"
    assert services["migrate"].get("restart", "no") == "no", "a one-shot job"
    for name in ("api", "worker"):
        condition = services[name]["depends_on"]["migrate"]["condition"]
        assert condition == "service_completed_successfully", name


def test_commands_are_exec_form_and_the_ones_the_end_to_end_test_runs(
    services: dict[str, dict[str, Any]],
) -> None:
    for name, svc in services.items():
        command = svc.get("command")
        if command is not None:
            assert isinstance(command, list), f"{name}: exec form (a list), not a shell string"
            assert all(isinstance(arg, str) for arg in command), name
        assert "entrypoint" not in svc, f"{name}: keep the image's exec-ing entrypoint"
    for name, command in E2E_COMMANDS.items():
        assert services[name]["command"] == command, name


def test_api_and_worker_write_metrics_to_different_multiproc_dirs(
    services: dict[str, dict[str, Any]],
) -> None:
    api_dir = environment(services["api"])["PROMETHEUS_MULTIPROC_DIR"]
    worker_dir = environment(services["worker"])["PROMETHEUS_MULTIPROC_DIR"]

    assert api_dir.startswith("/")
    assert worker_dir.startswith("/")
    assert api_dir != worker_dir
    # Nested directories would also mix the two process trees' files.
    assert not api_dir.startswith(worker_dir + "/")
    assert not worker_dir.startswith(api_dir + "/")


def test_compose_environment_is_accepted_by_the_settings_parsers(
    services: dict[str, dict[str, Any]],
) -> None:
    db_env = environment(services["db"])
    api = ApiSettings.from_env(environment(services["api"]))
    worker = WorkerSettings.from_env(environment(services["worker"]))
    migrate_env = environment(services["migrate"])

    expected_url = (
        f"postgresql+psycopg://{db_env['POSTGRES_USER']}:{db_env['POSTGRES_PASSWORD']}"
        f"@db:5432/{db_env['POSTGRES_DB']}"
    )
    assert api.database_url == worker.database_url == migrate_env["DATABASE_URL"] == expected_url
    assert api.admin_token == REQUIRED_VARIABLES["ADMIN_TOKEN"]
    assert api.metrics_dir is not None
    assert f"{worker.metrics_port}:{worker.metrics_port}" in services["worker"]["ports"]
    assert worker.handler_config.smtp_url == "smtp://mailpit:1025"


def test_sigterm_reaches_the_processes_and_they_get_time_to_stop(
    services: dict[str, dict[str, Any]],
) -> None:
    worker = WorkerSettings.from_env(environment(services["worker"]))
    graceful = float(environment(services["api"]).get("GUNICORN_GRACEFUL_TIMEOUT", "30"))
    margins = {"worker": worker.shutdown_timeout, "api": graceful}

    for name, stop_timeout in margins.items():
        svc = services[name]
        # The entrypoint execs the command, so the process itself is PID 1.
        assert svc.get("init", False) is False, name
        assert svc.get("stop_signal", "SIGTERM") == "SIGTERM", name
        grace = seconds(svc.get("stop_grace_period", "10s"))
        assert grace >= stop_timeout + 5, f"{name}: stop_grace_period {grace}s < {stop_timeout}+5"


def test_healthchecks_probe_health_without_a_shell(services: dict[str, dict[str, Any]]) -> None:
    for name, port in (("api", 8000), ("worker", 9100)):
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD", f"{name}: exec form; the slim image has no curl"
        assert any(f"127.0.0.1:{port}/health" in arg for arg in test), name


def test_monitoring_services_are_opt_in_and_mount_the_repository_files(
    services: dict[str, dict[str, Any]], prometheus: dict[str, Any]
) -> None:
    for name in ("prometheus", "grafana"):
        assert services[name].get("profiles") == ["monitoring"], name
    for name in ("db", "migrate", "api", "worker", "mailpit"):
        assert "profiles" not in services[name], f"{name} must start with a plain `up`"
    mounts = {
        volume.split(":")[1]: volume.split(":")[0] for volume in services["prometheus"]["volumes"]
    }
    assert mounts["/etc/prometheus/prometheus.yml"] == "./deploy/prometheus.yml"
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    for rule_file in prometheus["rule_files"]:
        assert mounts[rule_file] == "./deploy/alerts.yml"


def test_grafana_provisioning_loads_the_dashboard_from_its_mount(
    services: dict[str, dict[str, Any]],
) -> None:
    mounts = {
        volume.split(":")[1]: volume.split(":")[0] for volume in services["grafana"]["volumes"]
    }
    providers = load_yaml(GRAFANA_PROVISIONING / "dashboards" / "fairq.yml")["providers"]
    datasources = load_yaml(GRAFANA_PROVISIONING / "datasources" / "prometheus.yml")

    assert mounts["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    dashboard_mount = next(path for path, src in mounts.items() if src.endswith("dashboard.json"))
    assert Path(dashboard_mount).parent.as_posix() == providers[0]["options"]["path"]
    assert datasources["datasources"][0]["url"] == "http://prometheus:9090"


# --- deploy/Dockerfile -----------------------------------------------------------------------


def test_dockerfile_builds_one_non_root_image_with_the_exec_entrypoint() -> None:
    instructions = dockerfile_instructions()
    args = dict(instructions)  # the last one of each instruction wins, as in Docker

    assert [arg for name, arg in instructions if name == "FROM"] == ["python:3.12-slim"]
    assert args["WORKDIR"] == "/app"
    assert json.loads(args["ENTRYPOINT"]) == IMAGE_ENTRYPOINT
    assert json.loads(args["CMD"]) == E2E_COMMANDS["api"]
    names = [name for name, _ in instructions]
    user_at = names.index("USER")
    assert args["USER"] not in {"root", "0"}
    assert "RUN" not in names[user_at:], "nothing runs as root after USER"


def test_dockerfile_installs_the_project_without_extras() -> None:
    runs = " ".join(arg for name, arg in dockerfile_instructions() if name == "RUN")

    assert re.search(r"pip install (?:--no-deps )?\.(?:\s|$)", runs)
    assert ".[" not in runs, "no extras: dev and embedded are not for the image"


def test_dockerfile_copies_every_package_and_the_context_filter_lets_them_in() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    setuptools = pyproject["tool"]["setuptools"]
    needed = {package.split(".")[0] for package in setuptools["packages"]}
    needed |= {f"{module}.py" for module in setuptools["py-modules"]}
    needed |= {"pyproject.toml", "README.md", "deploy"}
    copied: set[str] = set()
    for name, arg in dockerfile_instructions():
        if name == "COPY":
            copied.update(Path(src).as_posix() for src in arg.split()[:-1])
    ignore = DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}

    assert needed <= copied, f"not copied into the image: {needed - copied}"
    assert "*" in ignore, "the context filter is an allow-list"
    assert copied <= allowed, f"copied but filtered out of the context: {copied - allowed}"
    for path in copied:
        assert (ROOT / path).exists(), path


# --- deploy/entrypoint.sh --------------------------------------------------------------------


def run_entrypoint(
    command: list[str], multiproc_dir: Path | None
) -> tuple[subprocess.CompletedProcess[str], int]:
    """Run the entrypoint with `sh` (POSIX mode: dash on Debian); return the result and pid."""
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    if multiproc_dir is not None:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(multiproc_dir)
    with subprocess.Popen(
        ["sh", str(ENTRYPOINT), *command],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        out, err = proc.communicate(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), proc.pid


def test_entrypoint_is_an_executable_posix_script_that_execs() -> None:
    lines = ENTRYPOINT.read_text(encoding="utf-8").splitlines()
    code = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]

    assert lines[0] == "#!/bin/sh"
    assert ENTRYPOINT.stat().st_mode & stat.S_IXUSR, "chmod +x deploy/entrypoint.sh"
    assert code[0] == "set -eu"
    assert code[-1] == 'exec "$@"'


def test_entrypoint_passes_the_metrics_directory_on_untouched_and_execs(tmp_path: Path) -> None:
    # Creating and emptying it is the processes' job (worker/metrics_dir.py), not the shell's.
    multiproc = tmp_path / "metrics"
    multiproc.mkdir()
    (multiproc / "counter_4242.db").write_bytes(b"stale")
    command = ["sh", "-c", 'echo "pid=$$ dir=$PROMETHEUS_MULTIPROC_DIR"']

    result, pid = run_entrypoint(command, multiproc)

    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"pid={pid} dir={multiproc}"], "exec replaced the shell"
    assert [path.name for path in multiproc.iterdir()] == ["counter_4242.db"]


def test_entrypoint_without_multiproc_dir_just_execs() -> None:
    command = ["sh", "-c", 'echo "pid=$$ dir=${PROMETHEUS_MULTIPROC_DIR-}"']

    result, pid = run_entrypoint(command, None)

    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"pid={pid} dir="]


def test_entrypoint_passes_the_exit_status_through(tmp_path: Path) -> None:
    result, _ = run_entrypoint(["sh", "-c", "exit 3"], tmp_path)

    assert result.returncode == 3


# --- deploy/prometheus.yml, deploy/alerts.yml ------------------------------------------------


def test_prometheus_scrapes_the_compose_services_on_their_metrics_ports(
    prometheus: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    expected = {"api": "api:8000", "worker": "worker:9100"}

    assert set(jobs) == set(expected)
    for name, target in expected.items():
        job = jobs[name]
        targets = [t for config in job["static_configs"] for t in config["targets"]]
        assert targets == [target], name
        assert job.get("metrics_path", "/metrics") == "/metrics"
        host, port = target.split(":")
        assert host in services
        published = {p.split(":")[-1] for p in services[host].get("ports", [])}
        exposed = {str(p) for p in services[host].get("expose", [])}
        assert port in published | exposed, f"{host} does not listen on {port}"


def test_alert_rules_are_complete(alert_rules: list[dict[str, Any]]) -> None:
    names = [rule["alert"] for rule in alert_rules]

    assert len(names) == len(set(names)), "alert names are unique"
    for rule in alert_rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert isinstance(rule["expr"], str), rule["alert"]
        assert rule["expr"].strip(), rule["alert"]
        seconds(str(rule["for"]))
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]
        assert rule["annotations"]["description"].strip(), rule["alert"]
        assert_balanced(rule["expr"])


def test_alerts_cover_backlog_failures_workers_and_api_errors(
    alert_rules: list[dict[str, Any]],
) -> None:
    by_metric: dict[str, list[dict[str, Any]]] = {}
    for rule in alert_rules:
        for metric in promql_metric_names(rule["expr"]):
            by_metric.setdefault(metric, []).append(rule)

    # Only work waiting for a worker pages: a tenant's own pause or limit is no backlog.
    assert "oldest_eligible_pending_age_seconds" not in by_metric
    backlog = by_metric["oldest_runnable_pending_age_seconds"][0]
    assert seconds(backlog["for"]) >= 300
    [held] = by_metric["oldest_held_pending_age_seconds"]
    assert held["labels"]["severity"] == "info"
    assert float(held["expr"].rsplit(">", 1)[1]) >= 86400  # a pause of a day is no news
    cleanup = by_metric["oldest_xmin_holder_age_seconds"][0]
    assert seconds(cleanup["for"]) >= 300
    assert "pg_terminate_backend" in cleanup["annotations"]["description"]
    failures = by_metric["tasks_failed_total"][0]
    assert "tasks_completed_total" in failures["expr"]
    # Counters of several processes or instances are summed per type before dividing.
    assert failures["expr"].count("sum by (type)") >= 3
    assert "worker_children" in by_metric
    assert any('up{job="worker"}' in rule["expr"] for rule in alert_rules)
    api_errors = by_metric["flask_http_request_duration_seconds_count"][0]
    assert 'status=~"5.."' in api_errors["expr"]


def test_every_alert_is_explained_in_the_readme_with_its_severity(
    alert_rules: list[dict[str, Any]],
) -> None:
    readme = (ROOT / "README.md").read_text()
    for rule in alert_rules:
        assert f"| `{rule['alert']}` ({rule['labels']['severity']}) |" in readme, rule["alert"]


def test_alert_jobs_exist_in_the_scrape_config(
    alert_rules: list[dict[str, Any]], prometheus: dict[str, Any]
) -> None:
    jobs = {job["job_name"] for job in prometheus["scrape_configs"]}
    for rule in alert_rules:
        for value in re.findall(r'job\s*=~?\s*"([^"]+)"', rule["expr"]):
            assert set(value.split("|")) <= jobs, rule["alert"]


def test_alerts_and_dashboard_use_only_metrics_and_labels_that_exist(
    alert_rules: list[dict[str, Any]], dashboard: dict[str, Any]
) -> None:
    exprs = [rule["expr"] for rule in alert_rules] + dashboard_exprs(dashboard)

    for expr in exprs:
        unknown = promql_metric_names(expr) - ALLOWED_METRICS
        assert not unknown, f"not in design §7 or the flask exporter: {unknown} in {expr!r}"
        labels = promql_label_names(expr) - ALLOWED_LABELS
        assert not labels, f"unknown labels {labels} in {expr!r}"


def _readme_shell_block(after_heading: str) -> str:
    """The first ```sh block of README.md after the heading `after_heading`."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index(after_heading) :]
    start = section.index("```sh\n") + len("```sh\n")
    return section[start : section.index("\n```", start)]


def test_the_readme_compose_token_reaches_compose_and_every_later_shell(tmp_path: Path) -> None:
    # Run the compose block's own lines (not docker) in a checkout-like directory, then the
    # API walkthrough's token line in a new shell: both must see the token compose gets.
    setup = "\n".join(
        line
        for line in _readme_shell_block("## Deploying with docker compose").splitlines()
        if not line.startswith("docker ")
    )
    subprocess.run(["bash", "-euc", setup], cwd=tmp_path, check=True)
    env_file = dict(
        line.split("=", 1) for line in (tmp_path / ".env").read_text().splitlines() if line
    )
    walkthrough = _readme_shell_block("## Using the API")
    token_line = next(line for line in walkthrough.splitlines() if line.startswith("ADMIN_TOKEN="))
    later_shell = subprocess.run(
        ["bash", "-euc", f'{token_line}\nprintf %s "$ADMIN_TOKEN"'],
        cwd=tmp_path, check=True, capture_output=True, text=True,
    )  # fmt: skip

    assert ApiSettings.from_env({"DATABASE_URL": "postgresql://db/fairq", **env_file}).admin_token
    assert later_shell.stdout == env_file["ADMIN_TOKEN"]


def test_compose_refuses_to_run_without_an_admin_token(services: dict[str, Any]) -> None:
    """No published fallback: compose stops with a message when ADMIN_TOKEN is unset."""
    value = services["api"]["environment"]["ADMIN_TOKEN"]
    required = re.fullmatch(r"\$\{ADMIN_TOKEN:\?(.+)\}", value)
    assert required, f"ADMIN_TOKEN must be required (${{ADMIN_TOKEN:?...}}), not {value!r}"
    assert "README" in required[1]
    assert "change-me" not in COMPOSE_FILE.read_text()


def test_promtool_accepts_the_rules_and_config() -> None:
    promtool = system_tools.require("promtool", package="prometheus")
    rules = subprocess.run(
        [promtool, "check", "rules", str(ALERTS_FILE)], capture_output=True, text=True, check=False
    )
    assert rules.returncode == 0, rules.stdout + rules.stderr


def test_the_alert_rules_pass_their_promtool_unit_tests() -> None:
    promtool = system_tools.require("promtool", package="prometheus")
    tests = subprocess.run(
        [promtool, "test", "rules", str(ALERT_TESTS_FILE)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert tests.returncode == 0, tests.stdout + tests.stderr


def test_the_backlog_and_spiral_alerts_have_promtool_unit_tests(
    alert_rules: list[dict[str, Any]],
) -> None:
    tested = {
        case["alertname"]
        for group in load_yaml(ALERT_TESTS_FILE)["tests"]
        for case in group["alert_rule_test"]
    }
    spiral = {"FairqQueueBacklog", "FairqTenantPausedLong", "FairqDeadTuplesHigh", "FairqClaimSlow"}

    assert spiral <= tested
    assert tested <= {rule["alert"] for rule in alert_rules}


# --- deploy/grafana/dashboard.json -----------------------------------------------------------


def test_dashboard_is_a_grafana_dashboard_with_unique_panels(dashboard: dict[str, Any]) -> None:
    panels = dashboard["panels"]
    ids = [panel["id"] for panel in panels]

    assert dashboard["title"]
    assert dashboard["uid"]
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert len(ids) == len(set(ids))
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert ref_ids, panel["title"]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert_balanced(target["expr"])


def test_dashboard_shows_every_queue_worker_and_api_metric(dashboard: dict[str, Any]) -> None:
    exprs = dashboard_exprs(dashboard)
    used = set().union(*(promql_metric_names(expr) for expr in exprs))
    required = {
        "tasks_by_status",
        "oldest_runnable_pending_age_seconds",
        "oldest_held_pending_age_seconds",
        "due_companies",
        "due_backlog_tasks",
        "oldest_xmin_holder_age_seconds",
        "queue_table_dead_tuples",
        "queue_table_live_tuples",
        "tasks_completed_total",
        "tasks_failed_total",
        "tasks_retried_total",
        "task_duration_seconds_bucket",
        "claim_duration_seconds_bucket",
        "worker_children",
        "worker_child_restarts_total",
        "tasks_lease_lost_total",
        "tasks_released_total",
        "flask_http_request_duration_seconds_count",
        "flask_http_request_duration_seconds_bucket",
    }

    assert required <= used, f"missing panels for {required - used}"
    assert any("histogram_quantile(0.95" in expr and "le" in expr for expr in exprs)
    assert any("histogram_quantile(0.99" in expr and "claim_duration" in expr for expr in exprs)
    assert any("url_rule" in promql_label_names(expr) for expr in exprs)


# --- the allowed list against the running code ----------------------------------------------


@pytest.fixture
def api_metrics_text(client: FlaskClient) -> str:
    """The API's /metrics after one request to a templated route."""
    client.get("/companies/00000000-0000-0000-0000-000000000000/tasks")
    # A failed authentication, so the labelled counter has a sample to expose.
    client.get("/stats", headers={"Authorization": "Bearer wrong"})
    response = client.get("/metrics")
    assert response.status_code == 200
    return response.get_data(as_text=True)


def test_the_api_exposes_the_metric_names_the_alerts_and_dashboard_use(
    api_metrics_text: str,
) -> None:
    exposed = set(re.findall(r"^([a-zA-Z_:][\w:]*)[{ ]", api_metrics_text, re.MULTILINE))
    api_names = {
        "tasks_by_status",
        "oldest_eligible_pending_age_seconds",
        "oldest_runnable_pending_age_seconds",
        "oldest_held_pending_age_seconds",
        "due_companies",
        "due_backlog_tasks",
        "oldest_xmin_holder_age_seconds",
        "queue_table_dead_tuples",
        "queue_table_live_tuples",
        "tasks_completed_total",
        "tasks_claimed_total",
        "flask_http_request_total",
        "flask_http_request_duration_seconds_bucket",
        "flask_http_request_duration_seconds_count",
        "auth_failures_total",
    }

    assert api_names <= exposed, f"not exposed by the API: {api_names - exposed}"
    assert 'url_rule="/companies/<uuid:company_id>/tasks"' in api_metrics_text


GUNICORN_CONFIG = ROOT / "deploy" / "gunicorn.conf.py"


def test_gunicorn_empties_the_configured_metrics_directory_at_start_and_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    configured = tmp_path / "metrics"
    configured.mkdir()
    (configured / "counter_4242.db").write_bytes(b"stale")
    (configured / "notes.txt").write_text("not a metrics file")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(configured))

    config = runpy.run_path(str(GUNICORN_CONFIG))
    assert (configured / "counter_4242.db").exists(), "loading the config changes nothing"
    config["on_starting"](None)
    config["on_exit"](None)

    assert [path.name for path in configured.iterdir()] == ["notes.txt"]
    assert list((tmp_path / "tmp").iterdir()) == [], "no temporary directory"
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(configured)


def test_gunicorn_without_a_metrics_directory_uses_a_temporary_one_until_exit(
    tmp_path: Path,
) -> None:
    # A fresh interpreter, like gunicorn's master: this one imported prometheus_client long
    # ago, and exporting a new directory after that is refused (worker/metrics_dir.py).
    script = """if True:
        import os, runpy, sys, tempfile
        tempfile.tempdir = sys.argv[2]
        config = runpy.run_path(sys.argv[1])
        assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ, "set at start, not at load"
        config["on_starting"](None)
        created = os.environ["PROMETHEUS_MULTIPROC_DIR"]
        print(created, os.path.isdir(created))
        config["on_exit"](None)
        print(os.path.exists(created))
    """
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}

    result = subprocess.run(
        [sys.executable, "-c", script, str(GUNICORN_CONFIG), str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip

    assert result.returncode == 0, result.stderr
    created, existed, exists_after_exit = result.stdout.split()
    assert Path(created).parent == tmp_path
    assert (existed, exists_after_exit) == ("True", "False")
