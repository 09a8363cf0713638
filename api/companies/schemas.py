"""Request and response schemas of /companies."""

from __future__ import annotations

import datetime as dt
from typing import Any

from marshmallow import RAISE, Schema, ValidationError, fields, validate, validates_schema

from api import validators
from db.api_keys import MAX_ACTIVE_KEYS
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


API_KEY_DESCRIPTION = (
    "Bearer token for this company's endpoints. Shown only this once: store it now."
)
# The longest lifetime and rotation overlap a request may ask for.
MAX_KEY_LIFETIME_SECONDS = 10 * 365 * 86400
MAX_OVERLAP_SECONDS = 30 * 86400
DEFAULT_OVERLAP_SECONDS = 86400


class CompanyCreatedSchema(CompanySchema):
    """A new company with its API key, which is shown only this once."""

    api_key = fields.String(dump_only=True, metadata={"description": API_KEY_DESCRIPTION})
    api_key_id = fields.UUID(
        dump_only=True, metadata={"description": "Id of that key (GET /companies/{id}/keys)."}
    )


class ApiKeyExpirySchema(Schema):
    """When a new key expires: `expires_in_seconds` or `expires_at`, not both; neither: never."""

    class Meta:
        unknown = RAISE

    expires_in_seconds = fields.Integer(
        strict=True,
        validate=validate.Range(min=1, max=MAX_KEY_LIFETIME_SECONDS),
        metadata={
            "description": f"The new key stops working this many seconds from now "
            f"(1..{MAX_KEY_LIFETIME_SECONDS})."
        },
    )
    expires_at = fields.AwareDateTime(
        metadata={"description": "The new key stops working at this moment, ISO 8601 with an "
                  "offset, in the future (at most ten years ahead)."},
    )  # fmt: skip

    @validates_schema
    def _one_expiry(self, data: dict[str, Any], **_kwargs: Any) -> None:
        expires_at = data.get("expires_at")
        if expires_at is not None and "expires_in_seconds" in data:
            raise ValidationError("give expires_at or expires_in_seconds, not both", "expires_at")
        if expires_at is not None:
            ahead = (expires_at - dt.datetime.now(dt.UTC)).total_seconds()
            if not 0 < ahead <= MAX_KEY_LIFETIME_SECONDS:
                raise ValidationError(
                    "must be in the future, at most ten years ahead", "expires_at"
                )


class ApiKeyRotateSchema(ApiKeyExpirySchema):
    """Body of POST /companies/{companyId}/keys/{keyId}/rotate (every field optional)."""

    overlap_seconds = fields.Integer(
        strict=True,
        load_default=DEFAULT_OVERLAP_SECONDS,
        validate=validate.Range(min=0, max=MAX_OVERLAP_SECONDS),
        metadata={
            "description": f"How long the old key keeps working beside the new one, in seconds "
            f"(0..{MAX_OVERLAP_SECONDS}; default {DEFAULT_OVERLAP_SECONDS}: a day). It then "
            "expires (sooner if it was due to)."
        },
    )


class ApiKeySchema(Schema):
    """An API key as listed: never its secret nor its hash."""

    id = fields.UUID(dump_only=True)
    company_id = fields.UUID(dump_only=True)
    created_at = fields.AwareDateTime(dump_only=True)
    last_used_at = fields.AwareDateTime(
        dump_only=True,
        allow_none=True,
        metadata={"description": "Last successful authentication, to the minute; null: never."},
    )
    expires_at = fields.AwareDateTime(
        dump_only=True, allow_none=True, metadata={"description": "null: never expires."}
    )
    revoked_at = fields.AwareDateTime(
        dump_only=True, allow_none=True, metadata={"description": "null: not revoked."}
    )
    active = fields.Boolean(
        dump_only=True,
        metadata={"description": "Neither revoked nor expired: the key authenticates."},
    )


class ApiKeyListSchema(Schema):
    """A company's keys: every active one (at most the company's limit), then its newest
    revoked or expired ones."""

    company_id = fields.UUID(dump_only=True)
    keys = fields.List(
        fields.Nested(ApiKeySchema),
        dump_only=True,
        metadata={
            "description": f"Active keys first (at most {MAX_ACTIVE_KEYS}), then up to 100 "
            "revoked or expired ones; newest first within each."
        },
    )


class ApiKeyIssuedSchema(ApiKeySchema):
    """A new key with its secret, which is shown only this once."""

    api_key = fields.String(dump_only=True, metadata={"description": API_KEY_DESCRIPTION})


class ApiKeyRotatedSchema(ApiKeyIssuedSchema):
    """The new key with its secret, and the old key with its new expiry."""

    replaces = fields.Nested(
        ApiKeySchema,
        dump_only=True,
        metadata={"description": "The old key: it works until its expires_at."},
    )
