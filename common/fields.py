"""Fields and validators for payload schemas (also used by the API's request schemas).

JSON gives numbers and strings distinct types; marshmallow's `Float` accepts `"5"` and
`true` as numbers. Payloads are stored as sent, so a type mismatch accepted here would reach
the handler as the wrong type.
"""

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


class JsonNumber(fields.Float):
    """A JSON number: an int or a float, never a string or a boolean; finite."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(allow_nan=False, **kwargs)

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.make_error("invalid")
        return super()._deserialize(value, attr, data, **kwargs)


# RFC 9110 section 5.1: a field name is a token.
HTTP_FIELD_NAME = FullMatch(
    r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", error="must be an HTTP header name (RFC 9110 token)"
)
# RFC 9110 section 5.5, restricted to ASCII: no CR, LF or NUL, which would split or end the
# header (request smuggling), and nothing `requests` cannot encode.
HTTP_FIELD_VALUE = FullMatch(r"[\t\x20-\x7e]*", error="must be printable ASCII without line breaks")

# One line of text: no control characters (C0, DEL, C1). A line break in an email subject
# would end the header; in a display name it forges lines in logs and UIs.
SINGLE_LINE = FullMatch(
    r"[^\x00-\x1f\x7f-\x9f]*", error="must be one line without control characters"
)
