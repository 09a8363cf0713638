"""The API's own metrics (design §7): tasks run by POST /workers/process, and route labels."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from flask import Flask
from flask.testing import FlaskClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine

from api import database
from api.metrics import UNMATCHED_RULE
from devtools import stack
from tests.conftest import ADMIN_TOKEN, make_test_app
from tests.factories import insert_company, insert_tasks, json_of
from worker import tasktypes

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
def fresh_app(fresh_db_url: str) -> Iterator[Flask]:
    """An app of its own on the fresh database: its metrics start from zero."""
    app = make_test_app(fresh_db_url)
    yield app
    database.close(app)


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(client: FlaskClient) -> Samples:
    """One /metrics scrape: (sample name, sorted labels) -> value."""
    response = client.get("/metrics")
    assert response.status_code == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.get_data(as_text=True))
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample `name{labels}`; fails the test when it is not exposed."""
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"{name}{labels} not exposed"
    return samples[key]


def test_tasks_run_by_post_workers_process_are_counted_in_the_api_metrics(
    fresh_app: Flask, fresh_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    company = insert_company(fresh_engine).id
    insert_tasks(fresh_engine, company, 3)
    # The SSRF guard fails a webhook to loopback for good, with no network involved.
    insert_tasks(
        fresh_engine, company, 1, task_type="webhook", payload={"url": "http://127.0.0.1:9/"}
    )
    client = fresh_app.test_client()
    before = scrape(client)
    for task_type in tasktypes.names():  # every type's series exists from the start, at 0
        assert value(before, "tasks_completed_total", type=task_type) == 0
        assert value(before, "tasks_failed_total", type=task_type) == 0
    assert value(before, "tasks_claimed_total") == 0

    with caplog.at_level("WARNING", logger="fairq.worker.processing"):
        response = client.post("/workers/process", headers=ADMIN)

    assert response.status_code == 200
    assert json_of(response)["claimed"] == 4
    after = scrape(client)
    assert value(after, "tasks_claimed_total") == 4
    assert value(after, "tasks_completed_total", type="noop") == 3
    assert value(after, "tasks_failed_total", type="webhook") == 1
    assert value(after, "task_duration_seconds_count", type="noop") == 3
    assert value(after, "claim_duration_seconds_count") >= 1


def test_unknown_paths_share_one_fixed_route_label(fresh_app: Flask) -> None:
    client = fresh_app.test_client()
    for path in ("/no/such/path", "/another-missing-path", "/companies/not-a-uuid/tasks"):
        assert client.get(path).status_code == 404
    assert client.delete("/health").status_code == 405  # no rule matched this method either
    assert client.get("/health").status_code == 200

    samples = scrape(client)

    unmatched: dict[str, float] = {}
    for (name, labels), count in samples.items():
        label = dict(labels)
        if name == "flask_http_request_duration_seconds_count" and label["status"] >= "400":
            unmatched[label["url_rule"]] = unmatched.get(label["url_rule"], 0) + count
    assert unmatched == {UNMATCHED_RULE: 4}
    assert UNMATCHED_RULE == "<unmatched>"
    rules = {dict(labels).get("url_rule") for _, labels in samples}
    assert "None" not in rules
    assert "/health" in rules


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_under_gunicorn_every_worker_process_counts_its_passes_in_the_shared_metrics(
    tmp_path: Path, fresh_db_url: str, fresh_engine: Engine
) -> None:
    """Multiprocess mode: each gunicorn worker writes its own files, a scrape sums them."""
    company = insert_company(fresh_engine).id
    (tmp_path / "api").mkdir()
    env = {"GUNICORN_WORKERS": "2", "GUNICORN_THREADS": "2", "LOG_LEVEL": "WARNING"}
    with stack.api_server(fresh_db_url, tmp_path / "api", admin_token=ADMIN_TOKEN, env=env) as api:
        claimed = 0
        for _ in range(6):  # a new connection each: whichever worker process accepts it
            insert_tasks(fresh_engine, company, 5)
            response = requests.post(f"{api.base_url}/workers/process", headers=ADMIN, timeout=30)
            assert response.status_code == 200, response.text
            claimed += response.json()["claimed"]
        assert requests.get(f"{api.base_url}/no/such/path", timeout=10).status_code == 404
        samples = stack.parse_metrics(requests.get(f"{api.base_url}/metrics", timeout=10).text)

    assert claimed == 30
    assert stack.metric_total(samples, "tasks_claimed_total") == 30
    assert samples['tasks_completed_total{type="noop"}'] == 30
    unmatched = [
        name
        for name in samples
        if name.startswith("flask_http_request_duration_seconds_count{")
        and f'url_rule="{UNMATCHED_RULE}"' in name
    ]
    assert unmatched, sorted(samples)
    assert not [name for name in samples if 'url_rule="None"' in name]


def test_a_scrape_under_gunicorn_passes_over_the_empty_file_of_a_worker_creating_it(
    tmp_path: Path, fresh_db_url: str
) -> None:
    # A gunicorn worker that has created its metrics file but not sized it yet: reading that
    # file failed the whole scrape with struct.error (prometheus/client_python#604).
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    written = MmapedDict(str(tmp_path / "counter_201.db"))  # type: ignore[no-untyped-call]
    key = mmap_key("tasks_claimed", "tasks_claimed_total", [], [], "Tasks claimed.")
    written.write_value(key, 7.0, 0.0)  # type: ignore[no-untyped-call]
    written.close()  # type: ignore[no-untyped-call]
    (tmp_path / "counter_202.db").touch()
    app = make_test_app(fresh_db_url, metrics_dir=tmp_path)
    try:
        samples = scrape(app.test_client())
    finally:
        database.close(app)

    assert value(samples, "tasks_claimed_total") == 7.0
