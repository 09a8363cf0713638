"""Request-body parsing that turns every malformed body into a 4xx, never a 500.

The stock parser accepts `NaN`/`Infinity` and unpaired surrogate escapes (which jsonb and
UTF-8 reject later) and lets a deeply nested document raise `RecursionError`; this one rejects
all of them as malformed JSON (400) and answers a non-JSON `Content-Type` with 415.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import flask
import flask_smorest
from flask_smorest import abort
from webargs import core
from webargs.flaskparser import FlaskParser, is_json_request

# A \uD800-\uDFFF escape. json.loads turns an unpaired one into a lone surrogate, which UTF-8
# (so the hash, psycopg and jsonb) cannot encode: a 500 later. A pair is one valid character.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _parse_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def loads_strict(data: bytes) -> Any:
    """Parse JSON as RFC 8259 defines it: no NaN/Infinity, huge numbers or lone surrogates.

    Raises `json.JSONDecodeError` for malformed input, including nesting too deep to parse
    and unpaired surrogates (RFC 8259 section 8.2).
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        # Not "" as the document: webargs reads an empty document as "no body" (a 422 for
        # missing fields instead of this 400).
        raise json.JSONDecodeError(f"body is not UTF-8: {exc.reason}", "x", 0) from None
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_parse_float)
        if _SURROGATE_ESCAPE.search(text):
            json.dumps(value, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise json.JSONDecodeError("JSON is nested too deeply", "x", 0) from None
    except UnicodeEncodeError:
        raise json.JSONDecodeError("a string has an unpaired surrogate escape", "x", 0) from None
    except ValueError as exc:
        if isinstance(exc, json.JSONDecodeError):
            raise
        raise json.JSONDecodeError(str(exc), "x", 0) from None
    return value


class StrictJsonParser(FlaskParser):
    """webargs' Flask parser with strict JSON and a 415 for bodies that are not JSON."""

    def _raw_load_json(self, req: flask.Request) -> Any:
        data = req.get_data(cache=True)
        if not is_json_request(req):
            if data:
                abort(415, message="the request body must be JSON (Content-Type: application/json)")
            return core.missing
        return loads_strict(data)

    def _handle_invalid_json_error(
        self, error: Any, req: flask.Request, *args: Any, **kwargs: Any
    ) -> Any:
        abort(400, message=f"malformed JSON body: {error.msg}", errors={"json": [error.msg]})


class Blueprint(flask_smorest.Blueprint):  # type: ignore[misc]  # untyped library
    """flask-smorest Blueprint using `StrictJsonParser` for every argument."""

    ARGUMENTS_PARSER = StrictJsonParser()
