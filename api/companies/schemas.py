"""Request and response schemas of /companies."""

from __future__ import annotations

from typing import Any

from marshmallow import RAISE, Schema, ValidationError, fields, validate, validates_schema

from api import validators
from db.models import (
    MAX_IN_FLIGHT,
    MAX_PENDING,
    MAX_WEIGHT,
    MIN_IN_FLIGHT,
    MIN_PENDING,
    MIN_WEIGHT,
)

WEIGHT_DESCRIPTION = (
    f"Share of claimed tasks while several companies have runnable work, proportional to "
    f"the weight: an integer {MIN_WEIGHT}..{MAX_WEIGHT}."
)
MAX_IN_FLIGHT_DESCRIPTION = (
    f"Most tasks of this company processing at once across every worker: an integer "
    f"{MIN_IN_FLIGHT}..{MAX_IN_FLIGHT}, or null for unlimited."
)
MAX_PENDING_DESCRIPTION = (
    f"Most unfinished (pending or processing) tasks of this company at once: an integer "
    f"{MIN_PENDING}..{MAX_PENDING}, or null for unlimited. A create beyond it is refused "
    "with 429. Default on create: the server's DEFAULT_MAX_PENDING."
)
PAUSED_DESCRIPTION = (
    "Its tasks are accepted and kept but not started (running ones finish): "
    "POST /companies/{companyId}/pause and /resume."
)
LIMIT_FIELDS = ("weight", "max_in_flight", "max_pending")


def weight_field(**kwargs: Any) -> fields.Integer:
    """`weight` in a request: a JSON integer (no bool, float or string) in range."""
    return fields.Integer(
        strict=True,
        validate=validate.Range(min=MIN_WEIGHT, max=MAX_WEIGHT),
        metadata={"description": WEIGHT_DESCRIPTION},
        **kwargs,
    )


def max_in_flight_field(**kwargs: Any) -> fields.Integer:
    """`max_in_flight` in a request: a JSON integer in range, or null (unlimited)."""
    return fields.Integer(
        strict=True,
        allow_none=True,
        validate=validate.Range(min=MIN_IN_FLIGHT, max=MAX_IN_FLIGHT),
        metadata={"description": MAX_IN_FLIGHT_DESCRIPTION},
        **kwargs,
    )


def max_pending_field(**kwargs: Any) -> fields.Integer:
    """`max_pending` in a request: a JSON integer in range, or null (unlimited)."""
    return fields.Integer(
        strict=True,
        allow_none=True,
        validate=validate.Range(min=MIN_PENDING, max=MAX_PENDING),
        metadata={"description": MAX_PENDING_DESCRIPTION},
        **kwargs,
    )


class CompanyCreateSchema(Schema):
    """Body of POST /companies."""

    class Meta:
        unknown = RAISE

    name = fields.String(
        required=True,
        validate=[
            validate.Length(min=1, max=200),
            validators.SINGLE_LINE,
            validators.not_blank,
        ],
        metadata={
            "description": "Display name, 1..200 characters, one line, not blank. Need not be "
            "unique: the id identifies a company."
        },
    )
    weight = weight_field(load_default=1)
    max_in_flight = max_in_flight_field(load_default=None)
    # Absent: the server's default (api.settings); null: unlimited.
    max_pending = max_pending_field()


class CompanyLimitsSchema(Schema):
    """Body of PATCH /companies/{companyId}: at least one of the limits."""

    class Meta:
        unknown = RAISE

    weight = weight_field()
    max_in_flight = max_in_flight_field()
    max_pending = max_pending_field()

    @validates_schema
    def _at_least_one(self, data: dict[str, Any], **_kwargs: Any) -> None:
        if not data:
            raise ValidationError(f"send at least one of: {', '.join(LIMIT_FIELDS)}")


class CompanySchema(Schema):
    """A company as returned by the API."""

    id = fields.UUID(dump_only=True)
    name = fields.String(dump_only=True)
    created_at = fields.AwareDateTime(dump_only=True)
    weight = fields.Integer(dump_only=True, metadata={"description": WEIGHT_DESCRIPTION})
    max_in_flight = fields.Integer(
        dump_only=True, allow_none=True, metadata={"description": MAX_IN_FLIGHT_DESCRIPTION}
    )
    max_pending = fields.Integer(
        dump_only=True, allow_none=True, metadata={"description": MAX_PENDING_DESCRIPTION}
    )
    paused = fields.Boolean(dump_only=True, metadata={"description": PAUSED_DESCRIPTION})


class CompanyCreatedSchema(CompanySchema):
    """A new company with its API key, which is shown only this once."""

    api_key = fields.String(
        dump_only=True,
        metadata={"description": "Bearer token for this company's endpoints. Store it now."},
    )
