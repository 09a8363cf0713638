"""Validators and fields shared by the request schemas, documented portably in OpenAPI."""

from __future__ import annotations

import re
from typing import Any

from marshmallow import ValidationError, fields, validate


class FullMatch(validate.Regexp):
    """The whole string must match `body`, a regex valid in both Python and ECMA-262.

    OpenAPI's `pattern` is ECMA-262 (what apispec publishes is `regex.pattern`): Python-only
    anchors such as `\\A...\\Z` are not regexes there, so clients' validators and generators
    reject the spec. `^(?:body)$` means "the whole string" in ECMA-262; in Python `$` also
    matches before a final newline, which `fullmatch` rules out.
    """

    def __init__(self, body: str, *, error: str | None = None) -> None:
        pattern = f"^(?:{body})$"
        super().__init__(pattern, error=error)
        self._pattern = re.compile(pattern)

    def __call__(self, value: Any) -> Any:
        """Return `value` if it matches entirely; else raise `ValidationError`."""
        if not isinstance(value, str) or self._pattern.fullmatch(value) is None:
            raise ValidationError(self._format_error(value))
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
