"""Driver errors that escape a view become the right status, never a bare 500 for the client's
input, and never a retry loop for our bugs (api/errors.py)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from flask import Flask
from sqlalchemy.exc import DataError, IntegrityError, OperationalError, ProgrammingError

from db import models
from tests.conftest import make_test_app


class _DriverError(Exception):
    """Stands in for a psycopg error: what the handlers read is `diag`."""

    def __init__(self, constraint: str | None = None) -> None:
        super().__init__("driver says no")
        self.diag = SimpleNamespace(constraint_name=constraint, message_primary="driver says no")


RAISED = {
    "operational": OperationalError("SELECT 1", {}, _DriverError()),
    "data": DataError("INSERT", {}, _DriverError()),
    "programming": ProgrammingError("SELEC", {}, _DriverError()),
    "unique": IntegrityError("INSERT", {}, _DriverError(models.UQ_TASK_IDEMPOTENCY_KEY)),
    "foreign": IntegrityError("INSERT", {}, _DriverError(models.FK_TASK_COMPANY)),
    "check": IntegrityError("INSERT", {}, _DriverError(models.CK_TASK_MAX_ATTEMPTS)),
}


@pytest.fixture(scope="module")
def raising_app(main_db_url: str) -> Iterator[Flask]:
    """An app with one extra route per driver error, raising it."""
    app = make_test_app(main_db_url)
    app.config["TESTING"] = False  # let error handlers run as in production

    @app.get("/raise/<kind>")
    def raise_it(kind: str) -> str:
        raise RAISED[kind]

    yield app
    from api import database

    database.close(app)


@pytest.mark.parametrize(
    ("kind", "status"),
    [
        ("operational", 503),
        ("data", 422),
        ("programming", 500),
        ("unique", 409),
        ("foreign", 404),
        ("check", 422),
    ],
)
def test_driver_error_maps_to_its_status_with_the_error_body(
    raising_app: Flask, kind: str, status: int
) -> None:
    response = raising_app.test_client().get(f"/raise/{kind}")

    assert response.status_code == status
    body = response.get_json()
    assert body["code"] == status
    assert "driver says no" not in body["message"]  # driver text stays in the log
    if status == 503:
        assert response.headers["Retry-After"] == "1"
