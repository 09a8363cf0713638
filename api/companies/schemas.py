"""Request and response schemas of /companies."""

from __future__ import annotations

from marshmallow import RAISE, Schema, fields, validate

from api import validators


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
        metadata={"description": "Display name, 1..200 characters, one line, not blank."},
    )


class CompanySchema(Schema):
    """A company as returned by the API."""

    id = fields.UUID(dump_only=True)
    name = fields.String(dump_only=True)
    created_at = fields.AwareDateTime(dump_only=True)


class CompanyCreatedSchema(CompanySchema):
    """A new company with its API key, which is shown only this once."""

    api_key = fields.String(
        dump_only=True,
        metadata={"description": "Bearer token for this company's endpoints. Store it now."},
    )
