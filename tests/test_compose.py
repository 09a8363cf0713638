"""`docker compose up` for real: the project's docker-compose.yml, image and entrypoint.

The first command of the README's compose section, run against a Docker daemon. The image is
built from deploy/Dockerfile, `up --wait` brings up db, migrate, api, worker and mailpit, and
everything is then checked through the ports the README names, as a user would:

- a company's noop, sleep, webhook (to a receiver on this host) and send_email (to the
  mailpit service) tasks complete, and the API's and the worker's /metrics count them;
- `stop worker` while sleep tasks run: the supervisor is the container's PID 1 and gets the
  SIGTERM, finishes the task in hand, hands the others back (pending, no attempt counted)
  and exits 0; `start worker` finishes them;
- `restart db`: /ready answers 503, then 200; the worker container carries on; nothing lost;
- `down` then `up`: the data is still there (the pgdata volume); `down -v` removes it;
- the pooler profile (PgBouncer in transaction mode) and the monitoring profile (Prometheus
  scraping the API and the worker; Grafana only when the daemon has its image).

tests/compose.override.yml is the only change to the project's files: every service on the
host's network, listening on loopback addresses, so no traffic goes to container bridge
addresses. Base images the daemon lacks are built as stand-ins, in a private daemon only
(tests/compose_images.py); the report at the end of the run says which were stand-ins.
`make test` never starts a daemon: without one this test is skipped (failed in CI), saying
how to run it (scripts/with-dockerd). The steps share one stack, so they are one test.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from devtools.stack import metric_total, parse_metrics
from devtools.webhook_receiver import Receiver
from tests import compose_images, system_tools

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
OVERRIDE_FILE = ROOT / "tests" / "compose.override.yml"
ALERTS_FILE = ROOT / "deploy" / "alerts.yml"
PROJECT = "fairq-compose-test"
ADMIN_TOKEN = "Cb-Gb1wuMmGi1EEP58eiO6U-qHk83f_qhOn8O2wSPF8"
API = "http://127.0.0.1:8000"
WORKER = "http://127.0.0.1:9100"
MAILPIT = "http://127.0.0.1:8025"
PROMETHEUS = "http://127.0.0.1:9090"
GRAFANA = "http://127.0.0.1:3000"
# README, "Behind PgBouncer": the variables that route the API and the worker through it.
POOLED = {
    "FAIRQ_DATABASE_URL": "postgresql+psycopg://fairq:fairq@pooler:6432/fairq",
    "DATABASE_POOL_MODE": "transaction",
}
ALL_PROFILES = ("pooler", "monitoring")
# Where the stack listens under the override: db and pooler on 127.0.0.2, the rest at the
# ports docker-compose.yml publishes.
LISTENS = {
    "db": ("127.0.0.2", 5432),
    "pooler": ("127.0.0.2", 6432),
    "api": ("127.0.0.1", 8000),
    "worker": ("127.0.0.1", 9100),
    "mailpit SMTP": ("127.0.0.1", 1025),
    "mailpit UI": ("127.0.0.1", 8025),
    "prometheus": ("127.0.0.1", 9090),
    "grafana": ("127.0.0.1", 3000),
}
HOW_TO_RUN = (
    "The compose test needs a Docker daemon with Compose v2; `make test` never starts one. "
    "On a throwaway machine, as root: `scripts/with-dockerd .venv/bin/pytest "
    "tests/test_compose.py` starts a private daemon the way CI does (README, 'Testing the "
    "compose stack')"
)


# -- the override, read as data (no Docker needed) ---------------------------------------------


class _ComposeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, plus compose's `!reset` tag (read as the value it resets to)."""


_ComposeLoader.add_constructor(
    "!reset",
    lambda loader, node: loader.construct_sequence(node),  # type: ignore[arg-type]
)


def load_compose(path: Path) -> dict[str, Any]:
    """A compose file, parsed (merge keys and anchors resolved, `!reset` read as its value)."""
    with path.open(encoding="utf-8") as f:
        document: dict[str, Any] = yaml.load(f, Loader=_ComposeLoader)
    return document


def test_the_override_runs_every_service_on_the_host_network_on_loopback() -> None:
    services = load_compose(COMPOSE_FILE)["services"]
    override = load_compose(OVERRIDE_FILE)["services"]

    assert set(override) == set(services), "every service, or one would get a bridge network"
    for name, service in override.items():
        assert service["network_mode"] == "host", name
        hosts = dict(entry.split(":", 1) for entry in service["extra_hosts"])
        assert all(address.startswith("127.") for address in hosts.values()), name
        # The names the compose file's URLs and the Prometheus targets use all resolve.
        assert set(hosts) >= {"db", "pooler", "mailpit", "api", "worker", "prometheus"}, name
        if services[name].get("ports"):
            assert service["ports"] == [], f"{name}: published ports are reset"
        for key, value in service.get("environment", {}).items():
            if "BIND" in key or "ADDR" in key or key.endswith("_HOST"):
                assert str(value).startswith("127."), f"{name}: {key}={value}"


def test_the_override_changes_no_image_command_or_healthcheck_of_the_project() -> None:
    services = load_compose(COMPOSE_FILE)["services"]
    override = load_compose(OVERRIDE_FILE)["services"]

    for name, service in override.items():
        assert "image" not in service, name
        assert "healthcheck" not in service, name
        if "command" in service:
            # Only flags added after the compose file's own command (db has none: the image's).
            base = services[name].get("command", ["postgres"])
            assert service["command"][: len(base)] == base, name
        if "build" in service:
            assert service["build"] == {"network": "host"}, name
    assert override["db"]["command"] == ["postgres", "-c", "listen_addresses=127.0.0.2"]


def test_the_listen_addresses_are_the_published_ports_on_loopback() -> None:
    services = load_compose(COMPOSE_FILE)["services"]
    published = {
        int(port.split(":")[0]) for svc in services.values() for port in svc.get("ports", [])
    }
    # pgbouncer publishes 6432 in the compose file; db publishes nothing (internal).
    assert {port for _, port in LISTENS.values()} == published | {5432}


def test_the_pooler_step_sets_the_variables_the_readme_gives() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### Behind PgBouncer") :]
    command = section[section.index("```sh\n") : section.index("\n```", section.index("```sh"))]

    for name, value in POOLED.items():
        assert f"{name}={value}" in command, name


# -- Docker ---------------------------------------------------------------------------------------


def docker_unavailable(env: Mapping[str, str]) -> str | None:
    """Why no compose stack can run against a daemon from here, or None when one can."""
    if shutil.which("docker") is None:
        return "no docker client is installed (Debian: docker.io)"
    where = env.get("DOCKER_HOST") or "the default socket"
    try:
        daemon = subprocess.run(
            ["docker", "version", "--format", "{{.Server.Version}}"],
            env=dict(env), capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"the Docker daemon at {where} did not answer within 30s"
    if daemon.returncode != 0:
        lines = daemon.stderr.strip().splitlines() or ["no answer"]
        return f"no Docker daemon answers at {where} ({lines[-1]})"
    plugin = subprocess.run(
        ["docker", "compose", "version"],
        env=dict(env), capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    if plugin.returncode != 0:
        return "the docker client has no Compose v2 plugin (`docker compose`)"
    return None


def compose_env() -> dict[str, str]:
    """This environment without what would change the compose file's meaning.

    Without the variables it interpolates (`${FAIRQ_DATABASE_URL:-...}`, ...) and COMPOSE_*,
    the compose file means what it says; each step adds its own.
    """
    interpolated = set(re.findall(r"\$\{(\w+)", COMPOSE_FILE.read_text(encoding="utf-8")))
    return {
        key: value
        for key, value in os.environ.items()
        if key not in interpolated and not key.startswith("COMPOSE_")
    }


def private_daemon(env: Mapping[str, str]) -> bool:
    """True when the daemon is one scripts/with-dockerd started for this run."""
    private = env.get("FAIRQ_PRIVATE_DOCKER_HOST")
    return bool(private) and private == env.get("DOCKER_HOST")


def skip_or_fail(reason: str) -> None:
    """Skip the test, or fail it in CI, where the compose test must run."""
    if system_tools.in_ci():
        pytest.fail(reason)
    pytest.skip(reason)


@dataclass
class Compose:
    """`docker compose` on the project's files plus the override, as project `PROJECT`."""

    env: dict[str, str]
    workdir: Path
    log: Path = field(init=False)
    # How long `docker compose build` of the project's image took.
    build_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.log = self.workdir / "compose.log"
        # Replaces the checkout's .env, which a developer's `docker compose up` may have left.
        (self.workdir / "compose.env").write_text(f"ADMIN_TOKEN={ADMIN_TOKEN}\n")

    def argv(self, *args: str, profiles: tuple[str, ...] = ()) -> list[str]:
        """The command line of `docker compose ARGS` for this project."""
        chosen = [arg for profile in profiles for arg in ("--profile", profile)]
        return [
            "docker", "compose", "-p", PROJECT, "-f", str(COMPOSE_FILE), "-f", str(OVERRIDE_FILE),
            "--env-file", str(self.workdir / "compose.env"), *chosen, *args,
        ]  # fmt: skip

    def __call__(
        self,
        *args: str,
        profiles: tuple[str, ...] = (),
        env: Mapping[str, str] | None = None,
        timeout: float = 300,
    ) -> subprocess.CompletedProcess[str]:
        """Run `docker compose ARGS`; fail the test with its output and the logs if it fails."""
        argv = self.argv(*args, profiles=profiles)
        started = time.monotonic()
        try:
            result = subprocess.run(
                argv, cwd=ROOT, env={**self.env, **(env or {})}, capture_output=True, text=True,
                timeout=timeout, check=False, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            pytest.fail(f"`docker compose {' '.join(args)}` still running after {timeout}s")
        with self.log.open("a", encoding="utf-8") as f:
            took = time.monotonic() - started
            f.write(f"$ {' '.join(argv)}  # {took:.1f}s\n{result.stdout}{result.stderr}\n")
        if result.returncode != 0:
            pytest.fail(
                f"`docker compose {' '.join(args)}` exited {result.returncode}:\n"
                f"{result.stdout[-2000:]}{result.stderr[-2000:]}\n{self.logs()}"
            )
        return result

    def up(self, *services: str, profiles: tuple[str, ...] = (), **env: str) -> None:
        """`up --wait`, with the images the test prepared: never a pull, never a build."""
        self(
            "up", "--wait", "--wait-timeout", "180", "--pull", "never", "--no-build", *services,
            profiles=profiles, env=env,
        )  # fmt: skip

    def logs(self, tail: int = 40) -> str:
        """The end of every service's log (for failure messages)."""
        result = subprocess.run(
            self.argv("logs", "--no-color", "--tail", str(tail), profiles=ALL_PROFILES),
            cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        return f"-- docker compose logs --tail {tail}:\n{result.stdout}{result.stderr}"

    def container(self, service: str) -> dict[str, Any]:
        """`docker inspect` of the service's container."""
        ids = self("ps", "-aq", service, profiles=ALL_PROFILES).stdout.split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        result = subprocess.run(
            ["docker", "inspect", ids[0]],
            env=self.env, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        [inspected] = json.loads(result.stdout)
        container: dict[str, Any] = inspected
        return container

    def volume_exists(self, name: str) -> bool:
        """True while the project's volume `name` exists."""
        result = subprocess.run(
            ["docker", "volume", "inspect", f"{PROJECT}_{name}"],
            env=self.env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        return result.returncode == 0

    def wait(self, condition: Callable[[], Any], timeout: float, what: str) -> Any:
        """Poll `condition` until it returns something truthy; fail with the logs after `timeout`.

        A connection error while polling counts as not yet.
        """
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(requests.RequestException):
                if value := condition():
                    return value
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout}s waiting for {what}\n{self.logs()}")
            time.sleep(0.1)


@pytest.fixture(scope="module")
def docker_env() -> dict[str, str]:
    """The environment for docker commands, once a daemon with Compose v2 answers."""
    env = compose_env()
    reason = docker_unavailable(env)
    if reason is not None:
        skip_or_fail(f"{reason}. {HOW_TO_RUN}")
    return env


@dataclass
class Images:
    """What the stack runs on, and the stand-ins still being built in the background."""

    env: dict[str, str]
    images: list[compose_images.Image]
    timings: dict[str, float] = field(default_factory=dict)
    building: concurrent.futures.Future[dict[str, float]] | None = None

    def finish(self) -> None:
        """Wait for the stand-ins built in the background; fail the test if a build failed."""
        if self.building is not None:
            building, self.building = self.building, None
            try:
                self.timings.update(building.result())
            except compose_images.ImageError as exc:
                pytest.fail(f"could not build the stand-ins: {exc}")
            self.images = compose_images.survey(self.env)

    def report(self) -> str:
        """Which images are stand-ins, for the end of the run."""
        lines = [image.describe() for image in self.images]
        stand_ins = [image.name for image in self.images if image.stand_in]
        lines.append(f"stand-ins: {', '.join(stand_ins) or 'none'}")
        lines += [f"built {what} in {seconds:.0f}s" for what, seconds in self.timings.items()]
        return "\n".join(lines)


@pytest.fixture(scope="module")
def images(
    docker_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Images]:
    """The base images; stand-ins for the missing ones, made in a private daemon only.

    The Python stand-in (and the Debian base) first; the others build in the background
    while the project's image is built on it (`Images.finish` waits for them).
    """
    found = compose_images.survey(docker_env)
    needed = [
        image for image in found if not image.present and image.role in compose_images.DOCKERFILES
    ]
    if not needed:
        yield Images(docker_env, found)
        return
    if not private_daemon(docker_env):
        skip_or_fail(
            f"the daemon has no image {', '.join(image.name for image in needed)}, and the "
            "test makes stand-ins only in a private daemon: pull them (`docker compose "
            f"--profile pooler --profile monitoring pull`) or run it that way. {HOW_TO_RUN}"
        )
    workdir = tmp_path_factory.mktemp("images")
    log = workdir / "build.log"
    first = [image for image in needed if image.role == "python"]
    rest = [image for image in needed if image.role != "python"]
    try:
        timings = compose_images.build_stand_ins(first, workdir, docker_env, log)
    except compose_images.ImageError as exc:
        pytest.fail(f"could not build the stand-ins: {exc}")
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stand-ins") as executor:
        building = executor.submit(compose_images.build_stand_ins, rest, workdir, docker_env, log)
        # Leaving the block waits for the builds, should the test end before `finish`.
        yield Images(docker_env, compose_images.survey(docker_env), timings, building)


@pytest.fixture(scope="module")
def compose(
    docker_env: dict[str, str], images: Images, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Compose]:
    """The project's image built from deploy/Dockerfile; the stack removed, volumes too, after."""
    stack = Compose(docker_env, tmp_path_factory.mktemp("compose"))
    # What an earlier run left behind (it was stopped before its teardown), then the ports.
    stack("down", "--volumes", "--remove-orphans", profiles=ALL_PROFILES, timeout=120)
    for what, address in LISTENS.items():
        with socket.socket() as probe:
            # As the servers do: connections closed by an earlier run (TIME_WAIT) are no obstacle.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                pytest.fail(f"{address[0]}:{address[1]} ({what} of the stack) is taken: {exc}")
    started = time.monotonic()
    stack("build", timeout=900)
    stack.build_seconds = time.monotonic() - started
    images.finish()
    try:
        yield stack
    finally:
        stack("down", "--volumes", "--remove-orphans", profiles=ALL_PROFILES, timeout=180)


# -- the API, as a client ---------------------------------------------------------------------


@dataclass(frozen=True)
class Company:
    """A company of the stack and its API key."""

    id: str
    key: str

    def call(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        """A request to the company's own resources with its key."""
        return request(method, f"/companies/{self.id}{path}", self.key, **kwargs)

    def create(self, type_: str, payload: dict[str, Any]) -> str:
        """Create a task; its id."""
        response = self.call("POST", "/tasks", json={"type": type_, "payload": payload})
        assert response.status_code == 201, response.text
        task_id: str = response.json()["id"]
        return task_id

    def create_retrying(self, type_: str, payload: dict[str, Any]) -> tuple[str, int]:
        """Create a task as a client does after an outage: a 503 says try again. Id, 503s."""
        refused = 0
        while (
            response := self.call("POST", "/tasks", json={"type": type_, "payload": payload})
        ).status_code == 503 and refused < 20:
            refused += 1
            time.sleep(0.25)
        assert response.status_code == 201, response.text
        return str(response.json()["id"]), refused

    def create_batch(self, bodies: list[dict[str, Any]]) -> list[str]:
        """Create tasks in one request (one transaction, one wake-up); their ids."""
        response = self.call("POST", "/task-batches", json={"tasks": bodies})
        assert response.status_code == 201, response.text
        return [str(task["id"]) for task in response.json()["items"]]

    def tasks(self) -> dict[str, dict[str, Any]]:
        """Every task of the company by id (at most 100)."""
        response = self.call("GET", "/tasks", params={"limit": 100})
        assert response.status_code == 200, response.text
        return {task["id"]: task for task in response.json()["items"]}


def request(method: str, path: str, token: str, **kwargs: Any) -> requests.Response:
    """One request to the API on :8000 with a bearer token."""
    headers = {"Authorization": f"Bearer {token}"}
    return requests.request(method, API + path, headers=headers, timeout=10, **kwargs)


def create_company(name: str) -> Company:
    """A new company, created with the admin token."""
    response = request("POST", "/companies", ADMIN_TOKEN, json={"name": name})
    assert response.status_code == 201, response.text
    body = response.json()
    return Company(body["id"], body["api_key"])


def ready_status() -> int:
    """What /ready answers now (0: no answer)."""
    try:
        return requests.get(f"{API}/ready", timeout=5).status_code
    except requests.RequestException:
        return 0


def completed(company: Company, ids: list[str]) -> bool:
    """True once every task of `ids` is completed; fails at once on one that failed."""
    tasks = company.tasks()
    statuses = {task_id: tasks[task_id]["status"] for task_id in ids}
    failed = {
        task_id: tasks[task_id]["last_error"]
        for task_id in ids
        if statuses[task_id] in {"failed", "cancelled"}
    }
    assert not failed, failed
    return set(statuses.values()) == {"completed"}


def run_one_of_each(
    compose: Compose, company: Company, receiver: Receiver, *, timeout: float = 60
) -> dict[str, str]:
    """Create a noop, sleep, webhook and send_email task, see them completed; their ids.

    The webhook reached the receiver with the task id as its Idempotency-Key, and Mailpit's
    API lists the mail, its Message-ID made from the task id.
    """
    subject = f"compose test {uuid.uuid4().hex[:8]}"
    ids = {
        "noop": company.create("noop", {}),
        "sleep": company.create("sleep", {"seconds": 0.5}),
        "webhook": company.create("webhook", {"url": receiver.url, "body": {"hello": "compose"}}),
        "send_email": company.create(
            "send_email", {"to": "compose@example.com", "subject": subject, "body": "Hello."}
        ),
    }
    compose.wait(lambda: completed(company, list(ids.values())), timeout, f"tasks {ids}")
    assert receiver.deliveries()[ids["webhook"]] == [200]
    messages = requests.get(f"{MAILPIT}/api/v1/messages", timeout=10).json()["messages"]
    mails = [message for message in messages if message["Subject"] == subject]
    assert [mail["MessageID"] for mail in mails] == [f"{ids['send_email']}@fairq"]
    assert [to["Address"] for to in mails[0]["To"]] == ["compose@example.com"]
    return ids


# -- the test -----------------------------------------------------------------------------------


@dataclass
class Steps:
    """How long each step took, for the report."""

    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Time the block; its duration goes into the report even when it fails."""
        started = time.monotonic()
        try:
            yield
        finally:
            self.timings[name] = time.monotonic() - started

    def report(self) -> str:
        """One line per step."""
        total = sum(self.timings.values())
        lines = [f"{name}: {seconds:.1f}s" for name, seconds in self.timings.items()]
        return "\n".join([*lines, f"steps in all: {total:.0f}s", *self.notes])


@pytest.mark.slow
@pytest.mark.longest
@pytest.mark.timeout(1500)
def test_docker_compose_up_runs_tasks_and_survives_stops_restarts_down_and_profiles(
    images: Images, compose: Compose, record_property: Callable[[str, object], None]
) -> None:
    record_property("report", f"docker compose test: images\n{images.report()}")
    steps = Steps()
    steps.timings["build fairq:local from deploy/Dockerfile"] = compose.build_seconds
    try:
        with Receiver() as receiver:
            _run_steps(compose, images, steps, receiver)
    finally:
        record_property("report", f"docker compose test: steps\n{steps.report()}")


def _run_steps(compose: Compose, images: Images, steps: Steps, receiver: Receiver) -> None:
    with steps.step("up --wait (db, migrate, api, worker, mailpit)"):
        compose.up()
        assert requests.get(f"{API}/ready", timeout=5).status_code == 200
        migrate = compose.container("migrate")["State"]
        assert (migrate["Status"], migrate["ExitCode"]) == ("exited", 0)

    with steps.step("one task of each type, metrics"):
        acme = create_company("compose-acme")
        run_one_of_each(compose, acme, receiver)
        api_metrics = parse_metrics(requests.get(f"{API}/metrics", timeout=10).text)
        assert api_metrics['tasks_by_status{status="completed"}'] == 4
        worker_metrics = parse_metrics(requests.get(f"{WORKER}/metrics", timeout=10).text)
        assert metric_total(worker_metrics, "tasks_completed_total") == 4
        assert worker_metrics["worker_children"] == 2

    with steps.step("stop worker while sleeps run, start"):
        _stop_worker_mid_batch(compose, acme)

    with steps.step("restart db"):
        _restart_db(compose, acme, steps)

    with steps.step("down, up: the data stays"):
        before = acme.tasks()
        compose("down", timeout=180)
        assert compose.volume_exists("pgdata")
        compose.up()
        assert acme.call("GET", "").json()["name"] == "compose-acme"
        after = acme.tasks()
        assert {i: t["status"] for i, t in after.items()} == {
            i: t["status"] for i, t in before.items()
        }

    with steps.step("down -v: the data goes"):
        compose("down", "--volumes", timeout=180)
        assert not compose.volume_exists("pgdata")

    with steps.step("pooler profile: through PgBouncer"):
        compose.up(profiles=("pooler",), **POOLED)
        # A new, empty database: the old company is gone.
        assert request("GET", f"/companies/{acme.id}", ADMIN_TOKEN).status_code == 404
        pooled = create_company("compose-pooled")
        run_one_of_each(compose, pooled, receiver)
        # The API's connections go through the pooler: without it, not ready.
        compose("stop", "pooler", profiles=("pooler",), env=POOLED)
        compose.wait(lambda: ready_status() == 503, 30, "/ready 503 without the pooler")
        compose("start", "pooler", profiles=("pooler",), env=POOLED)
        compose.wait(lambda: ready_status() == 200, 60, "/ready 200 with the pooler back")

    with steps.step("monitoring profile: Prometheus scrapes api and worker"):
        grafana = next(image for image in images.images if image.role == "grafana")
        services = ["prometheus"] + (["grafana"] if grafana.present else [])
        compose.up(*services, profiles=ALL_PROFILES, **POOLED)
        _check_prometheus(compose)
        if grafana.present:
            _check_grafana(compose)


def _stop_worker_mid_batch(compose: Compose, company: Company) -> None:
    """`stop worker` mid-batch: the task in hand finishes, the rest go back; `start` runs them."""
    pid1 = compose("exec", "-T", "worker", "cat", "/proc/1/cmdline").stdout.split("\0")
    assert pid1[1:3] == ["-m", "worker"], f"PID 1 of the worker container: {pid1}"
    # Created at once, so one child claims all four (a company alone gets whole batches) and
    # runs them in turn.
    ids = company.create_batch([{"type": "sleep", "payload": {"seconds": 1.5}}] * 4)

    def started() -> bool:
        tasks = company.tasks()
        return any(tasks[task_id]["status"] == "processing" for task_id in ids)

    compose.wait(started, 30, "a sleep task to start")
    stopping = time.monotonic()
    compose("stop", "worker", timeout=120)
    took = time.monotonic() - stopping

    state = compose.container("worker")["State"]
    assert state["ExitCode"] == 0, f"the supervisor exits 0 after SIGTERM: {state}"
    assert took < 30, f"stopped by SIGTERM, not killed at the end of the grace period: {took:.1f}s"
    tasks = company.tasks()
    by_status: dict[str, list[int]] = {}
    for task_id in ids:
        by_status.setdefault(tasks[task_id]["status"], []).append(tasks[task_id]["attempts"])
    # The tasks in hand finished; the others are back in the queue, no attempt counted.
    assert set(by_status) == {"completed", "pending"}, by_status
    assert set(by_status["completed"]) == {1}
    assert set(by_status["pending"]) == {0}
    # Claimed, then handed back unstarted by the stopping child (not merely never claimed).
    log = compose("logs", "--no-color", "worker").stdout
    for task_id in ids:
        if tasks[task_id]["status"] == "pending":
            assert f"task {task_id} (company {company.id}, type sleep) released unstarted" in log

    compose("start", "worker")
    compose.wait(lambda: completed(company, ids), 60, "the handed-back tasks to complete")
    tasks = company.tasks()
    assert [tasks[task_id]["attempts"] for task_id in ids] == [1, 1, 1, 1]


def _restart_db(compose: Compose, company: Company, steps: Steps) -> None:
    """`restart db`: /ready 503 then 200, the worker container carries on, nothing lost."""
    worker_before = compose.container("worker")["State"]
    answers: list[int] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            answers.append(ready_status())
            time.sleep(0.05)

    poller = threading.Thread(target=poll, name="ready-poller")
    poller.start()
    try:
        compose("restart", "db", timeout=120)

        def back() -> bool:
            return 503 in answers and answers[-1] == 200 and answers.index(503) < len(answers) - 1

        compose.wait(back, 60, f"/ready 503, then 200 (answers so far {answers[-20:]})")
    finally:
        done.set()
        poller.join(10)
    assert set(answers) <= {200, 503}, f"/ready answered {set(answers)}"

    # /ready probes on a fresh connection; a request on a pooled connection the restart broke
    # answers 503 ("try again") once, as that connection was used too recently to be pinged
    # (db/engine.py, ping_after_idle): clients retry.
    created = [company.create_retrying("noop", {}) for _ in range(3)]
    ids = [task_id for task_id, _ in created]
    steps.notes.append(
        f"restart db: /ready answered {answers.count(503)} times 503 before 200; then "
        f"{sum(refused for _, refused in created)} creates answered 503 (stale pooled "
        "connections) before 201"
    )
    compose.wait(lambda: completed(company, ids), 60, "tasks created after the restart")
    worker_after = compose.container("worker")["State"]
    assert worker_after["Running"]
    assert worker_after["StartedAt"] == worker_before["StartedAt"], "the worker was not restarted"
    tasks = company.tasks()
    # 4 of each type, 4 sleeps, 3 noops: every one there, and completed.
    assert len(tasks) == 11, "a create answered 503 stored nothing"
    assert {task["status"] for task in tasks.values()} == {"completed"}


def _check_prometheus(compose: Compose) -> None:
    """Both scrape targets up, and the alert rules of deploy/alerts.yml loaded."""

    def targets() -> dict[str, str]:
        body = requests.get(f"{PROMETHEUS}/api/v1/targets", timeout=10).json()
        return {t["labels"]["job"]: t["health"] for t in body["data"]["activeTargets"]}

    compose.wait(lambda: targets() == {"api": "up", "worker": "up"}, 90, "both targets up")
    with ALERTS_FILE.open(encoding="utf-8") as f:
        groups = yaml.safe_load(f)["groups"]
    expected = {rule["alert"] for group in groups for rule in group["rules"]}
    rules = requests.get(f"{PROMETHEUS}/api/v1/rules", timeout=10).json()["data"]["groups"]
    assert {rule["name"] for group in rules for rule in group["rules"]} == expected
    up = requests.get(f"{PROMETHEUS}/api/v1/query", params={"query": "up"}, timeout=10).json()
    assert {r["metric"]["job"]: r["value"][1] for r in up["data"]["result"]} == {
        "api": "1",
        "worker": "1",
    }


def _check_grafana(compose: Compose) -> None:
    """Grafana answers and has provisioned the fairq dashboard."""
    auth = ("admin", "admin")
    compose.wait(
        lambda: requests.get(f"{GRAFANA}/api/health", timeout=5).status_code == 200,
        90, "Grafana's /api/health",
    )  # fmt: skip
    found = requests.get(f"{GRAFANA}/api/search", params={"query": "fairq"}, auth=auth, timeout=10)
    assert any(item.get("type") == "dash-db" for item in found.json()), found.text
