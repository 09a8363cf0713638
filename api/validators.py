"""Validators and fields shared by the request schemas, documented portably in OpenAPI."""

from __future__ import annotations

from typing import Any

from marshmallow import ValidationError, fields

from common.fields import SINGLE_LINE, FullMatch

__all__ = ["NO_NUL", "SINGLE_LINE", "FullMatch", "QueryInteger", "not_blank"]


def not_blank(value: str) -> str:
    """Reject a string of only whitespace. A function, not a regex: a field publishes one
    `pattern` in OpenAPI, and the single-line rule already is one."""
    if not value.strip():
        raise ValidationError("must not be blank")
    return value


# PostgreSQL text cannot hold NUL: reject it in validation, not as a driver error (a 5xx).
NO_NUL = FullMatch(r"[^\x00]*", error="must not contain the NUL character")


class QueryInteger(fields.Integer):
    """An integer query parameter written in ASCII decimal digits, with an optional minus.

    `int()` also accepts `" 5"`, `"+5"`, `"1_0"` and other scripts' digits (U+0663,
    ARABIC-INDIC DIGIT THREE, is 3), so `?limit=1_0` would be served as `limit=10`; an API
    documenting `type: integer` should not. Beyond `int()`'s digit limit it is "Not a valid
    integer." as well.
    """

    _DIGITS = FullMatch(r"-?[0-9]+")

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> Any:
        if isinstance(value, str):
            try:
                self._DIGITS(value)
            except ValidationError:
                raise self.make_error("invalid") from None
        return super()._deserialize(value, attr, data, **kwargs)
