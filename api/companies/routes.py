"""/companies: create a tenant (admin), read it (the tenant or the admin), set its limits
(admin), pause and resume it (the tenant or the admin)."""

from __future__ import annotations

import uuid
from typing import Any

from flask import current_app
from flask.views import MethodView

from api import auth, database
from api.companies.schemas import (
    CompanyCreatedSchema,
    CompanyCreateSchema,
    CompanyLimitsSchema,
    CompanySchema,
)
from api.parser import Blueprint
from db import companies

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
        company = companies.create_company(
            database.connection(),
            name=body["name"],
            api_key_hash=auth.hash_api_key(key),
            weight=body["weight"],
            max_in_flight=body["max_in_flight"],
            max_pending=body.get(
                "max_pending", current_app.config["FAIRQ_SETTINGS"].default_max_pending
            ),
        )
        return {
            "id": company.id,
            "name": company.name,
            "created_at": company.created_at,
            "weight": company.weight,
            "max_in_flight": company.max_in_flight,
            "max_pending": company.max_pending,
            "paused": company.paused,
            "api_key": key,
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
        claims another of its tasks. Tasks already running finish; one retried or whose
        worker was lost waits. Pausing a paused company changes nothing.
        """
        # Several statements that must commit together (db.companies.pause_company).
        with database.transaction() as conn:
            return companies.pause_company(conn, company_id)


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
                notify_channel=current_app.config["FAIRQ_SETTINGS"].notify_channel,
            )
