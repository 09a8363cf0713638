"""The OpenAPI document is one real clients can use.

A maintained validator (openapi-spec-validator) accepts it; it keeps the rules a linter's
recommended set checks (unique snake_case operationIds, servers, a schema on every error
response, no unused components); and a client generated from it by openapi-python-client runs
the README's flow against a real HTTP server, with 404 and 409 parsed as the `Error` model.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from openapi_spec_validator import validate

from tests import pg
from tests.conftest import ADMIN_TOKEN, serve_app

_SNAKE_CASE = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")
_METHODS = {"get", "put", "post", "patch", "delete", "head", "options", "trace"}


@pytest.fixture(scope="module")
def live_api_url(server: pg.TestServer) -> Iterator[str]:
    """A real HTTP server on a database of this module's own: the client's flow writes."""
    name = server.create_from_template("fairq_test_client")
    try:
        with serve_app(server.url(name)) as port:
            yield f"http://127.0.0.1:{port}"
    finally:
        server.drop(name)


@pytest.fixture(scope="module")
def spec(live_api_url: str) -> dict[str, Any]:
    """The OpenAPI document as the running server serves it."""
    with urllib.request.urlopen(f"{live_api_url}/openapi.json", timeout=10) as response:
        document: dict[str, Any] = json.load(response)
    return document


def _operations(spec: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            if method in _METHODS:
                yield method, path, operation


def _references(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _references(value)
    elif isinstance(node, list):
        for value in node:
            yield from _references(value)


def test_a_maintained_validator_accepts_the_document(spec: dict[str, Any]) -> None:
    validate(spec)


def test_every_operation_has_a_unique_snake_case_operation_id(spec: dict[str, Any]) -> None:
    ids = [operation.get("operationId") for _, _, operation in _operations(spec)]
    assert all(isinstance(op, str) and _SNAKE_CASE.match(op) for op in ids), ids
    assert len(set(ids)) == len(ids), ids
    assert {"create_task", "cancel_task", "retry_task", "get_task", "list_tasks"} <= set(ids)


def test_servers_are_declared(spec: dict[str, Any]) -> None:
    assert spec["servers"], "no servers"


def test_every_error_response_has_the_error_schema(spec: dict[str, Any]) -> None:
    components = spec["components"]["responses"]
    missing = []
    for method, path, operation in _operations(spec):
        for status, response in operation["responses"].items():
            if status.startswith("2"):
                continue
            resolved = response
            if "$ref" in response:
                resolved = components[response["$ref"].rsplit("/", 1)[-1]]
            if "schema" not in resolved.get("content", {}).get("application/json", {}):
                missing.append(f"{method.upper()} {path} {status}")
    assert not missing


def test_a_replayed_create_declares_its_headers(spec: dict[str, Any]) -> None:
    replay = spec["paths"]["/companies/{company_id}/tasks"]["post"]["responses"]["200"]
    assert {"Location", "Idempotent-Replayed"} <= set(replay["headers"])


def test_no_component_is_unused(spec: dict[str, Any]) -> None:
    used = set(_references({"paths": spec["paths"]}))
    # Components reach others (a response component names a schema): follow them.
    while True:
        reached = {
            ref for name in used for ref in _references(_component(spec, name)) if ref not in used
        }
        if not reached:
            break
        used |= reached
    defined = {
        f"#/components/{kind}/{name}"
        for kind, entries in spec["components"].items()
        if kind != "securitySchemes"
        for name in entries
    }
    assert defined - used == set()


def _component(spec: dict[str, Any], ref: str) -> Any:
    _, _, kind, name = ref.split("/")
    return spec["components"][kind][name]


@pytest.fixture(scope="module")
def generated_client(
    spec: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ModuleType]:
    """The package openapi-python-client generates from the served document, imported."""
    workdir = tmp_path_factory.mktemp("client")
    document = workdir / "openapi.json"
    document.write_text(json.dumps(spec))
    scripts = str(Path(sys.executable).parent)
    generator = shutil.which("openapi-python-client", path=scripts)
    assert generator, "openapi-python-client is part of the dev extra"
    result = subprocess.run(
        [generator, "generate", "--path", str(document), "--meta", "none",
         "--output-path", str(workdir / "fairq_client")],
        capture_output=True, text=True, timeout=120, check=False, cwd=workdir,
        # Its post-generation hook runs ruff, found on PATH next to the interpreter.
        env={**os.environ, "PATH": f"{scripts}{os.pathsep}{os.environ.get('PATH', '')}"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Warning" not in result.stdout, result.stdout
    package = workdir / "fairq_client"
    found = importlib.util.spec_from_file_location(
        "fairq_client", package / "__init__.py", submodule_search_locations=[str(package)]
    )
    assert found is not None
    assert found.loader is not None
    client = importlib.util.module_from_spec(found)
    sys.modules["fairq_client"] = client
    try:
        found.loader.exec_module(client)
        yield client
    finally:
        for name in [name for name in sys.modules if name.split(".")[0] == "fairq_client"]:
            del sys.modules[name]


def test_a_generated_client_runs_the_readme_flow(
    generated_client: ModuleType, live_api_url: str
) -> None:
    def module(name: str) -> Any:
        return importlib.import_module(f"fairq_client.{name}")

    models = module("models")
    admin = generated_client.AuthenticatedClient(base_url=live_api_url, token=ADMIN_TOKEN)

    created = module("api.companies.create_company").sync(
        client=admin, body=models.CompanyCreate(name="Acme", weight=2)
    )
    assert isinstance(created, models.CompanyCreated)
    assert created.weight == 2
    tenant = generated_client.AuthenticatedClient(base_url=live_api_url, token=created.api_key)

    limits = module("api.companies.update_company").sync(
        created.id, client=admin, body=models.CompanyLimits(weight=3, max_in_flight=20)
    )
    assert isinstance(limits, models.Company)
    assert (limits.weight, limits.max_in_flight) == (3, 20)

    create_task = module("api.tasks.create_task")
    body = models.TaskCreate(type_="noop", payload=models.TaskCreatePayload())
    first = create_task.sync_detailed(created.id, client=tenant, body=body, idempotency_key="k-1")
    assert first.status_code == 201
    assert isinstance(first.parsed, models.Task)
    replay = create_task.sync_detailed(created.id, client=tenant, body=body, idempotency_key="k-1")
    assert replay.status_code == 200
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.parsed.id == first.parsed.id

    task = module("api.tasks.get_task").sync(created.id, first.parsed.id, client=tenant)
    assert isinstance(task, models.Task)
    assert task.status == "pending"
    page = module("api.tasks.list_tasks").sync(
        created.id, client=tenant, status=models.ListTasksStatus.PENDING
    )
    assert isinstance(page, models.TaskPage)
    assert [item.id for item in page.items] == [first.parsed.id]

    cancel = module("api.tasks.cancel_task")
    cancelled = cancel.sync(created.id, first.parsed.id, client=tenant)
    assert isinstance(cancelled, models.Task)
    assert cancelled.status == "cancelled"
    conflict = cancel.sync_detailed(created.id, first.parsed.id, client=tenant)
    assert conflict.status_code == 409
    assert isinstance(conflict.parsed, models.Error)
    assert conflict.parsed.code == 409
    assert "pending" in conflict.parsed.message

    missing = module("api.tasks.get_task").sync_detailed(created.id, uuid.uuid4(), client=tenant)
    assert missing.status_code == 404
    assert isinstance(missing.parsed, models.Error)
    assert missing.parsed.status == "Not Found"
