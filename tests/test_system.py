"""Operational endpoints and the API description: health, readiness, task types, OpenAPI, docs."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient

from api import database
from devtools.embedded_postgres import free_port
from tests.conftest import make_test_app
from tests.factories import json_of

TASK_TYPES = {"noop", "send_email", "sleep", "webhook"}
# Views registered by flask-smorest blueprints of ours, i.e. the documented API.
API_BLUEPRINTS = ("system", "companies", "tasks", "workers")


@pytest.fixture(scope="module")
def offline_client() -> Iterator[FlaskClient]:
    """A client of an app whose DATABASE_URL points at a closed port."""
    app = make_test_app(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/nowhere")
    yield app.test_client()
    database.close(app)


@pytest.fixture(scope="module")
def spec(shared_app: Flask) -> dict[str, Any]:
    """The OpenAPI document as served."""
    response = shared_app.test_client().get("/openapi.json")
    assert response.status_code == 200
    document: dict[str, Any] = json.loads(response.get_data(as_text=True))
    return document


def test_health_is_200_ok(client: FlaskClient) -> None:
    response = client.get("/health")

    assert response.status_code == 200
    assert json_of(response) == {"status": "ok"}


def test_health_touches_no_database(offline_client: FlaskClient) -> None:
    response = offline_client.get("/health")

    assert response.status_code == 200
    assert json_of(response) == {"status": "ok"}


def test_ready_is_200_when_the_database_answers(client: FlaskClient) -> None:
    response = client.get("/ready")

    assert response.status_code == 200
    assert json_of(response) == {"status": "ok", "database": "ok"}


def test_ready_is_503_when_the_database_is_unreachable(offline_client: FlaskClient) -> None:
    response = offline_client.get("/ready")

    assert response.status_code == 503
    body = json_of(response)
    assert body["status"] == "unavailable"
    assert body["database"] == "unreachable"


@pytest.fixture
def silent_server_url() -> Iterator[str]:
    """A database URL whose server accepts TCP connections and never answers (hung server)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)  # the kernel completes handshakes; nobody ever reads
        yield f"postgresql+psycopg://postgres@127.0.0.1:{listener.getsockname()[1]}/hung"


def test_ready_is_503_within_seconds_when_the_database_does_not_answer(
    silent_server_url: str,
) -> None:
    app = make_test_app(silent_server_url)
    try:
        started = time.monotonic()
        response = app.test_client().get("/ready")
        elapsed = time.monotonic() - started
    finally:
        database.close(app)

    assert response.status_code == 503
    assert json_of(response) == {"status": "unavailable", "database": "unreachable"}
    # A probe's verdict must come before a typical probe timeout, not after the API's
    # 5-second connect timeout.
    assert elapsed < 3.0


def test_an_api_call_with_the_database_down_is_503_not_500(
    offline_client: FlaskClient,
) -> None:
    # Authentication needs the database: a company key cannot be checked without it.
    response = offline_client.get(
        "/companies/00000000-0000-0000-0000-000000000000",
        headers={"Authorization": "Bearer fq_some-company-key"},
    )

    assert response.status_code == 503
    assert json_of(response)["code"] == 503
    assert response.headers["Retry-After"] == "1"


def test_task_types_lists_the_four_types_with_payload_schemas(client: FlaskClient) -> None:
    response = client.get("/task-types")

    assert response.status_code == 200
    types = {item["name"]: item for item in response.get_json()}
    assert set(types) == TASK_TYPES
    for item in types.values():
        assert item["description"]
        assert item["payload_schema"]["type"] == "object"
    assert types["sleep"]["payload_schema"]["properties"]["seconds"]["maximum"] == 300
    assert set(types["send_email"]["payload_schema"]["required"]) == {"to", "subject"}
    assert types["webhook"]["payload_schema"]["required"] == ["url"]


def test_openapi_lists_every_api_route(shared_app: Flask, spec: dict[str, Any]) -> None:
    routes = {
        re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule)
        for rule in shared_app.url_map.iter_rules()
        if rule.endpoint.split(".")[0] in API_BLUEPRINTS
    }

    assert spec["openapi"].startswith("3.")
    assert routes <= set(spec["paths"])
    assert {
        "/health",
        "/ready",
        "/task-types",
        "/companies",
        "/companies/{company_id}",
        "/companies/{company_id}/tasks",
        "/companies/{company_id}/tasks/{task_id}",
        "/companies/{company_id}/tasks/{task_id}/cancel",
        "/companies/{company_id}/tasks/{task_id}/retry",
    } <= set(spec["paths"])


def _responses(spec: dict[str, Any], path: str, method: str) -> set[str]:
    return set(spec["paths"][path][method]["responses"])


@pytest.mark.parametrize(
    ("path", "method", "statuses"),
    [
        ("/companies", "post", {"201", "400", "401", "413", "415", "422", "503"}),
        ("/companies/{company_id}", "get", {"200", "401", "404"}),
        (
            "/companies/{company_id}/tasks",
            "post",
            {"200", "201", "400", "401", "403", "404", "413", "415", "422"},
        ),
        ("/companies/{company_id}/tasks", "get", {"200", "401", "403", "404", "422"}),
        ("/companies/{company_id}/tasks/{task_id}", "get", {"200", "401", "403", "404"}),
        (
            "/companies/{company_id}/tasks/{task_id}/cancel",
            "post",
            {"200", "401", "403", "404", "409"},
        ),
        (
            "/companies/{company_id}/tasks/{task_id}/retry",
            "post",
            {"200", "401", "403", "404", "409"},
        ),
        ("/ready", "get", {"200", "503"}),
    ],
)
def test_openapi_documents_every_status_an_endpoint_returns(
    spec: dict[str, Any], path: str, method: str, statuses: set[str]
) -> None:
    assert statuses <= _responses(spec, path, method)


def test_openapi_documents_bearer_auth_and_public_endpoints_need_none(
    spec: dict[str, Any],
) -> None:
    assert spec["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
    }
    assert spec["security"] == [{"bearer": []}]
    for path in ("/health", "/ready", "/task-types"):
        assert spec["paths"][path]["get"]["security"] == [], path


def test_openapi_documents_the_idempotency_key_header(spec: dict[str, Any]) -> None:
    parameters = spec["paths"]["/companies/{company_id}/tasks"]["post"]["parameters"]

    headers = {p["name"]: p for p in parameters if p["in"] == "header"}
    assert headers["Idempotency-Key"]["schema"]["maxLength"] == 255


def test_docs_page_is_served_from_local_assets(client: FlaskClient) -> None:
    response = client.get("/docs")

    assert response.status_code == 200
    assert response.mimetype == "text/html"
    page = response.get_data(as_text=True)
    assert "/docs/assets/" in page
    assert "/openapi.json" in page
    for cdn in ("unpkg", "jsdelivr", "cdnjs", "//cdn", "http://", "https://"):
        assert cdn not in page


def test_every_docs_asset_the_page_references_loads(client: FlaskClient) -> None:
    page = client.get("/docs").get_data(as_text=True)
    assets = re.findall(r"""(?:src|href)=["'](/docs/assets/[^"']+)["']""", page)

    assert any(asset.endswith("swagger-ui-bundle.js") for asset in assets), assets
    assert any(asset.endswith(".css") for asset in assets), assets
    for asset in assets:
        with client.get(asset) as response:
            assert response.status_code == 200, asset
            assert len(response.get_data()) > 1000, asset


def test_unknown_path_is_a_json_404(client: FlaskClient) -> None:
    response = client.get("/no/such/path")

    assert response.status_code == 404
    assert json_of(response)["code"] == 404
