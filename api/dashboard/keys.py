"""The dashboard's company keys: issue, rotate and revoke a company's API keys, and the one
page that shows a new key's secret (issue 14).

Views of the dashboard's blueprint (`views.blp`), so its guard (login, CSRF) and headers apply
to them as to every other; `init_app` imports this module to register them. A key is made and
hashed by `api.auth` and stored by `db.api_keys`, as by the API's key endpoints.
"""

from __future__ import annotations

import uuid

from flask import current_app, flash, render_template, url_for
from flask.typing import ResponseReturnValue
from flask_smorest import abort

from api import auth, database, errors
from api.dashboard import views
from api.dashboard.forms import KeyIssueForm, KeyRotateForm
from db import api_keys, companies, dashboard


def _key_issued(
    company_id: uuid.UUID, key: str, record: api_keys.ApiKeyRecord, replaces: str | None = None
) -> ResponseReturnValue:
    """The one page that shows a new key's secret: rendered by the POST itself (no redirect,
    so the secret is never kept in the session cookie for a flash message), sent `no-store`."""
    with views.reading() as reader:
        stored = companies.get_company(reader, company_id)
        now = dashboard.now(reader)
    page = render_template(
        "dashboard/key_issued.html",
        company=stored,
        key=key,
        record=record,
        replaces=replaces,
        now=now,
    )
    return page, 201


@views.blp.post("/companies/<uuid:company_id>/keys")
def issue_key(company_id: uuid.UUID) -> ResponseReturnValue:
    """Issue a company a new API key and show its secret once; 422 naming a bad field."""
    form = KeyIssueForm()
    if not form.validate():
        return views.company_page(company_id, issue_form=form, status=422)
    days = form.expires_in_days.data
    key = auth.new_api_key()
    with database.transaction() as writer:
        record = api_keys.issue_key(
            writer,
            company_id,
            auth.hash_api_key(key),
            expires_in_seconds=None if days is None else days * 86400,
        )
    return _key_issued(company_id, key, record)


@views.blp.post("/companies/<uuid:company_id>/keys/<uuid:key_id>/rotate")
def rotate_key(company_id: uuid.UUID, key_id: uuid.UUID) -> ResponseReturnValue:
    """Replace a key with a new one (shown once), the old one working `overlap_hours` more."""
    form = KeyRotateForm()
    if not form.validate():
        found = {"form": form.errors}
        abort(422, message=errors.validation_message(found), errors=found)
    hours = form.overlap_hours.data
    assert isinstance(hours, int)  # InputRequired passed
    key = auth.new_api_key()
    with database.transaction() as writer:
        old, new = api_keys.rotate_key(
            writer,
            company_id,
            key_id,
            auth.hash_api_key(key),
            overlap_seconds=hours * 3600,
        )
    auth.key_cache(current_app).clear()
    return _key_issued(company_id, key, new, replaces=_until(old))


def _until(key: api_keys.ApiKeyRecord) -> str:
    return f"{key.id} works until {views.when(key.expires_at)}"


@views.blp.post("/companies/<uuid:company_id>/keys/<uuid:key_id>/revoke")
def revoke_key(company_id: uuid.UUID, key_id: uuid.UUID) -> ResponseReturnValue:
    """Revoke a key now: 401 at once on this process, within 5 s on the others."""
    with database.transaction() as writer:
        api_keys.revoke_key(writer, company_id, key_id, keep_one_active=False)
    auth.key_cache(current_app).clear()
    flash(f"Revoked API key {key_id}.")
    return views.back(url_for(".company", company_id=company_id) + "#keys-title")
