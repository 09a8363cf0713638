"""/companies: create a tenant (admin), read it (the tenant or the admin), set its limits
(admin), pause and resume it, list, issue, rotate and revoke its API keys (the tenant or the
admin)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from flask import current_app, g
from flask.views import MethodView

from api import auth, database, settings
from api.companies.schemas import (
    ApiKeyExpirySchema,
    ApiKeyIssuedSchema,
    ApiKeyListSchema,
    ApiKeyRotatedSchema,
    ApiKeyRotateSchema,
    ApiKeySchema,
    CompanyCreatedSchema,
    CompanyCreateSchema,
    CompanyLimitsSchema,
    CompanySchema,
)
from api.parser import Blueprint
from db import api_keys, companies, workers

blp = Blueprint("companies", __name__, url_prefix="/companies", description="Tenants.")


@blp.route("")
class Companies(MethodView):
    """The collection of companies."""

    @blp.doc(operationId="create_company")
    @auth.admin_required
    @blp.arguments(CompanyCreateSchema())
    @blp.response(201, CompanyCreatedSchema)
    @blp.error(400, "Malformed JSON.")
    @blp.error(401, "Missing or invalid admin token.")
    @blp.error(413, "Body larger than 1 MiB.")
    @blp.error(415, "Body is not JSON.")
    @blp.error(503, "ADMIN_TOKEN is not configured.")
    def post(self, body: dict[str, Any]) -> dict[str, Any]:
        """Create a company and return its API key (admin only)."""
        key = auth.new_api_key()
        # The company and its first key commit together.
        with database.transaction() as conn:
            company = companies.create_company(
                conn,
                name=body["name"],
                weight=body["weight"],
                max_in_flight=body["max_in_flight"],
                max_pending=body.get("max_pending", settings.current().default_max_pending),
            )
            issued = api_keys.issue_key(conn, company.id, auth.hash_api_key(key))
        return {
            "id": company.id,
            "name": company.name,
            "created_at": company.created_at,
            "weight": company.weight,
            "max_in_flight": company.max_in_flight,
            "max_pending": company.max_pending,
            "paused": company.paused,
            "api_key": key,
            "api_key_id": issued.id,
        }


@blp.route("/<uuid:company_id>")
class CompanyById(MethodView):
    """One company."""

    @blp.doc(operationId="get_company")
    @auth.company_required(allow_admin=True)
    @blp.response(200, CompanySchema)
    @blp.error(401, "Missing or invalid token.")
    @blp.error(404, "No such company, or not yours.")
    def get(self, company_id: uuid.UUID) -> Any:
        """Read a company (its own key, or the admin token)."""
        return companies.get_company(database.connection(), company_id)

    @blp.doc(operationId="update_company")
    @auth.admin_required
    @blp.arguments(
        CompanyLimitsSchema(),
        description="At least one of weight, max_in_flight and max_pending; the others keep "
        "their values.",
    )
    @blp.response(200, CompanySchema)
    @blp.error(400, "Malformed JSON.")
    @blp.error(401, "Missing or invalid admin token (a company's own key is refused too).")
    @blp.error(404, "No such company.")
    @blp.error(413, "Body larger than 1 MiB.")
    @blp.error(415, "Body is not JSON.")
    @blp.error(503, "ADMIN_TOKEN is not configured.")
    def patch(self, body: dict[str, Any], company_id: uuid.UUID) -> Any:
        """Set a company's weight, max_in_flight and/or max_pending (admin only)."""
        return companies.update_company_limits(database.connection(), company_id, **body)


@blp.route("/<uuid:company_id>/pause")
class CompanyPause(MethodView):
    """Stop claiming a company's tasks."""

    @blp.doc(operationId="pause_company")
    @auth.company_required(allow_admin=True)
    @blp.response(200, CompanySchema)
    @blp.error(401, "Missing or invalid token.")
    @blp.error(404, "No such company, or not yours.")
    def post(self, company_id: uuid.UUID) -> Any:
        """Pause a company's tasks (its own key, or the admin token).

        New tasks are accepted and kept, but none is started: once this answers, no worker
        starts another of its tasks (those already claimed are handed back unstarted). Tasks
        already running finish; one retried or whose worker was lost waits. Pausing a paused
        company changes nothing.
        """
        # Several statements that must commit together (db.companies.pause_company).
        with database.transaction() as conn:
            company = companies.pause_company(conn, company_id)
        # Workers trust what they read of pauses this long: answered later, none starts a task.
        time.sleep(workers.PAUSE_SEEN_WITHIN_SECONDS)
        return company


@blp.route("/<uuid:company_id>/resume")
class CompanyResume(MethodView):
    """Claim a paused company's tasks again."""

    @blp.doc(operationId="resume_company")
    @auth.company_required(allow_admin=True)
    @blp.response(200, CompanySchema)
    @blp.error(401, "Missing or invalid token.")
    @blp.error(404, "No such company, or not yours.")
    def post(self, company_id: uuid.UUID) -> Any:
        """Resume a paused company's tasks (its own key, or the admin token).

        Its waiting tasks are started again in their usual order (longest runnable first),
        sharing the workers with the other companies by weight as before the pause, with
        no catching up. Resuming a company that is not paused changes nothing.
        """
        # The update and the wake-up of idle workers (NOTIFY) commit together.
        with database.transaction() as conn:
            return companies.resume_company(
                conn,
                company_id,
                notify_channel=settings.current().notify_channel,
            )


def _issued(record: api_keys.ApiKeyRecord, key: str) -> dict[str, Any]:
    return {**record.__dict__, "api_key": key}


@blp.route("/<uuid:company_id>/keys")
class CompanyKeys(MethodView):
    """A company's API keys."""

    @blp.doc(operationId="list_api_keys")
    @auth.company_required(allow_admin=True)
    @blp.response(200, ApiKeyListSchema)
    @blp.error(401, "Missing or invalid token.")
    @blp.error(404, "No such company, or not yours.")
    def get(self, company_id: uuid.UUID) -> Any:
        """List a company's API keys, never their secrets (its own key, or the admin token)."""
        keys = api_keys.list_keys(database.connection(), company_id)
        return {"company_id": company_id, "keys": keys}

    @blp.doc(operationId="issue_api_key")
    @auth.company_required(allow_admin=True)
    @blp.arguments(ApiKeyExpirySchema())
    @blp.response(201, ApiKeyIssuedSchema)
    @blp.error(400, "Malformed JSON.")
    @blp.error(401, "Missing or invalid token.")
    @blp.error(404, "No such company, or not yours.")
    @blp.error(409, f"The company has {api_keys.MAX_ACTIVE_KEYS} active keys already.")
    @blp.error(415, "Body is not JSON.")
    def post(self, body: dict[str, Any], company_id: uuid.UUID) -> Any:
        """Issue a new API key and return it, shown only this once (its own key, or the
        admin token).

        The company's other keys keep working: to rotate a key without downtime, issue a
        new one, deploy it, then revoke the old one (or use .../rotate).
        """
        key = auth.new_api_key()
        with database.transaction() as conn:
            record = api_keys.issue_key(conn, company_id, auth.hash_api_key(key), **body)
        return _issued(record, key)


@blp.route("/<uuid:company_id>/keys/<uuid:key_id>")
class CompanyKey(MethodView):
    """One API key of a company."""

    @blp.doc(operationId="revoke_api_key")
    @auth.company_required(allow_admin=True)
    @blp.response(200, ApiKeySchema)
    @blp.error(401, "Missing or invalid token.")
    @blp.error(404, "No such company or key, or not yours.")
    @blp.error(409, "A company cannot revoke its own last active key.")
    def delete(self, company_id: uuid.UUID, key_id: uuid.UUID) -> Any:
        """Revoke an API key now and return it (its own key, or the admin token).

        From then on the key gets 401: at once on this API process, within
        KEY_CACHE_SECONDS (5 s) on the others. It stays listed with its revoked_at.
        Revoking a revoked key changes nothing. A company may not revoke its last active key
        (409: it would lock itself out); the admin token may.
        """
        principal: auth.Principal = g.fairq_principal
        with database.transaction() as conn:
            record = api_keys.revoke_key(
                conn, company_id, key_id, keep_one_active=not principal.is_admin
            )
        auth.key_cache(current_app).clear()
        return record


@blp.route("/<uuid:company_id>/keys/<uuid:key_id>/rotate")
class CompanyKeyRotate(MethodView):
    """Replace an API key, the old one working a while longer."""

    @blp.doc(operationId="rotate_api_key")
    @auth.company_required(allow_admin=True)
    @blp.arguments(ApiKeyRotateSchema())
    @blp.response(201, ApiKeyRotatedSchema)
    @blp.error(400, "Malformed JSON.")
    @blp.error(401, "Missing or invalid token.")
    @blp.error(404, "No such company or key, or not yours.")
    @blp.error(409, "The key is revoked or expired already, or the company is at its limit.")
    @blp.error(415, "Body is not JSON.")
    def post(self, body: dict[str, Any], company_id: uuid.UUID, key_id: uuid.UUID) -> Any:
        """Issue a new key and let the old one expire after `overlap_seconds` (its own key,
        or the admin token).

        The new key is returned, shown only this once, with the old key's new expires_at in
        `replaces`. Both work during the overlap; revoke the old one sooner when done.
        """
        key = auth.new_api_key()
        with database.transaction() as conn:
            old, new = api_keys.rotate_key(conn, company_id, key_id, auth.hash_api_key(key), **body)
        # The old key's expiry moved: this process forgets what it remembered of it.
        auth.key_cache(current_app).clear()
        return {**_issued(new, key), "replaces": old}
