"""Request parsing that turns every malformed request into a 4xx, never a 500.

The stock parser accepts `NaN`/`Infinity`, numbers no double can hold, duplicate object keys and
unpaired surrogate escapes (which jsonb and UTF-8 reject later), lets a deeply nested document
raise `RecursionError`, decodes any declared charset as UTF-8, silently truncates a streamed
body at `MAX_CONTENT_LENGTH`, and takes the first of a repeated query parameter. This one
answers malformed JSON with 400, a non-JSON or non-UTF-8 body with 415, an oversized streamed
body with 413 and a repeated single-valued query parameter with 422.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar, cast

import flask
import flask_smorest
from flask_smorest import abort
from marshmallow import RAISE, Schema, ValidationError, fields
from webargs import core
from webargs.flaskparser import FlaskParser, is_json_request
from werkzeug.exceptions import ClientDisconnected, HTTPException
from werkzeug.wsgi import get_input_stream

from api.errors import ErrorSchema, header_fault

log = logging.getLogger("fairq.api.parser")

# A \uD800-\uDFFF escape. json.loads turns an unpaired one into a lone surrogate, which UTF-8
# (so the hash, psycopg and jsonb) cannot encode: a 500 later. A pair is one valid character.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")

# Digits of the longest integer literal worth converting: one more makes it at least 10**309,
# beyond every double whatever the digits. Checked before `int()`, whose cost grows
# quadratically with length (CVE-2020-10735) and whose own limit error leaks a Python hint.
_MAX_INT_DIGITS = 309

# `charset` values meaning UTF-8 (RFC 8259 section 8.1: JSON exchanged between systems is UTF-8).
_UTF8_CHARSETS = frozenset({"utf-8", "utf8"})

REPEATED_PARAMETER = "given more than once; send it once"
# marshmallow's message for an unknown field, also for a query parameter no schema declares.
UNKNOWN_FIELD = "Unknown field."


class _Rejected(ValueError):
    """A JSON document we refuse; its message is ours and safe to show to the client."""


def _reject_constant(name: str) -> Any:
    raise _Rejected(f"{name} is not valid JSON")


def _out_of_range(text: str) -> _Rejected:
    return _Rejected(f"number {text[:40]}{'...' if len(text) > 40 else ''} is out of range")


def _parse_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _out_of_range(text)
    return value


def _parse_int(text: str) -> int:
    # Same rule as floats: every number must be a finite double (RFC 8259 section 6), so
    # clients and jsonb agree on its value.
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise _out_of_range(text)
    value = int(text)
    try:
        float(value)
    except OverflowError:
        raise _out_of_range(text) from None
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # RFC 8259 section 4: with duplicate names "the behavior of software ... is unpredictable".
    # Python keeps the last, other parsers (and a proxy or a WAF in front of us) the first, so
    # the body we validate, store and fingerprint for Idempotency-Key would not be the one
    # the client or an intermediary saw.
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Rejected(f"duplicate key {key[:100]!r} in an object")
            seen.add(key)
    return obj


def loads_strict(data: bytes) -> Any:
    """Parse JSON as RFC 8259 defines it, refusing what its section 8 calls non-interoperable.

    No NaN/Infinity, no number beyond the range of a double, no duplicate key in an object,
    no unpaired surrogate, no byte order mark. Raises `json.JSONDecodeError` with a message fit
    for the client for any of these, for malformed input and for nesting too deep to parse.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        # Not "" as the document: webargs reads an empty document as "no body" (a 422 for
        # missing fields instead of this 400).
        raise json.JSONDecodeError(f"body is not UTF-8: {exc.reason}", "x", 0) from None
    if text.startswith("\ufeff"):
        # json.loads' own message advises "decode using utf-8-sig": a Python hint, not ours.
        raise json.JSONDecodeError("body starts with a byte order mark (BOM)", "x", 0)
    try:
        value = json.loads(
            text,
            parse_constant=_reject_constant,
            parse_float=_parse_float,
            parse_int=_parse_int,
            object_pairs_hook=_unique_keys,
        )
        if _SURROGATE_ESCAPE.search(text):
            json.dumps(value, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise json.JSONDecodeError("JSON is nested too deeply", "x", 0) from None
    except UnicodeEncodeError:
        raise json.JSONDecodeError("a string has an unpaired surrogate escape", "x", 0) from None
    except _Rejected as exc:
        raise json.JSONDecodeError(str(exc), "x", 0) from None
    except json.JSONDecodeError:
        raise
    except ValueError:
        # Any other conversion error carries Python's wording, never shown to clients.
        raise json.JSONDecodeError("a value cannot be parsed", "x", 0) from None
    return value


def read_body(req: flask.Request) -> bytes:
    """The request body, at most `req.max_content_length` bytes.

    Aborts with 413 when the body is larger, also when it is streamed without Content-Length
    (chunked), and with 400 when the server cannot deliver it (broken chunked framing, a client
    that hung up). The body is read once; call this at most once per request.
    """
    limit = req.max_content_length
    try:
        if limit is None or req.content_length is not None:
            # werkzeug refuses a Content-Length over the limit (413) and reads exactly that.
            return req.get_data(cache=True)
        # Streamed: werkzeug's stream stops at the limit without an error, so `get_data()`
        # would return the first MiB of a larger body. Read one byte past the limit instead.
        data = get_input_stream(req.environ, max_content_length=limit + 1).read()
        if len(data) > limit:
            abort(413, message=f"the request body must be at most {limit} bytes")
    except ClientDisconnected:
        # werkzeug's own 400 for a body that ended early says nothing about the body.
        _unreadable("ClientDisconnected")
    except HTTPException:
        raise  # our 413 and werkzeug's
    except Exception as exc:
        # The WSGI input stream is the server's and its errors are not standardized
        # (gunicorn raises InvalidChunkSize, a plain Exception): any of them means the body
        # the client sent cannot be read, a client error.
        _unreadable(exc.__class__.__name__)
    return data


def _unreadable(reason: str) -> NoReturn:
    log.info("unreadable request body: %s", reason)
    abort(400, message="the request body could not be read: broken chunked encoding or cut short")
    raise AssertionError("unreachable")  # abort raises; this satisfies the type checker


def _single_valued_names(schema: Schema) -> list[str]:
    """Request-side names of the schema's fields that take one value (not a List/Tuple)."""
    multi = (fields.List, fields.Tuple)
    return [
        field.data_key or name
        for name, field in schema.fields.items()
        if not getattr(field, "is_multiple", isinstance(field, multi))
    ]


class StrictJsonParser(FlaskParser):
    """webargs' Flask parser with strict JSON, strict bodies and strict query strings.

    Through webargs' public hooks: `load_json` and `load_querystring` (the loaders of a
    location) and `DEFAULT_UNKNOWN_BY_LOCATION`.
    """

    # An unknown query parameter is a 422 naming it, as an unknown body field is: webargs
    # would drop it, and `?stauts=failed` would then list every task instead of the failed.
    DEFAULT_UNKNOWN_BY_LOCATION: dict[str, str | None] = {  # noqa: RUF012  # webargs' name
        **FlaskParser.DEFAULT_UNKNOWN_BY_LOCATION,
        "query": RAISE,
        "querystring": RAISE,
    }

    def load_json(self, req: flask.Request, schema: Schema) -> Any:
        """The body parsed by `loads_strict`, or `missing` when there is none.

        Aborts with 400 for malformed JSON (`{"json": [why]}`), 413 for a body over the
        limit, 415 for a body that is not JSON or not UTF-8 by its `Content-Type`.
        """
        data = read_body(req)
        if not is_json_request(req):
            if data:
                _unsupported("the request body must be JSON (Content-Type: application/json)")
            return core.missing
        if not data:
            return core.missing  # as webargs: no body, so a 422 for missing fields
        charset = req.mimetype_params.get("charset")
        if charset is not None and charset.strip().lower() not in _UTF8_CHARSETS:
            # We decode as UTF-8 whatever is declared: bytes another charset meant (latin-1
            # "Ã©" is UTF-8 "é") would be stored as something the client never sent.
            _unsupported(f"JSON must be UTF-8 encoded, not charset={charset[:40]}")
        try:
            return loads_strict(data)
        except json.JSONDecodeError as error:
            abort(400, message=f"malformed JSON body: {error.msg}", errors={"json": [error.msg]})

    def load_querystring(self, req: flask.Request, schema: Schema) -> Any:
        """Query arguments; 422 naming each single-valued parameter given more than once.

        Frameworks disagree on `?limit=1&limit=2` (first, last, or a list), so a proxy or
        a cache may act on another value than we do (HTTP parameter pollution).
        """
        repeated = {
            name: [REPEATED_PARAMETER]
            for name in _single_valued_names(schema)
            if len(req.args.getlist(name)) > 1
        }
        if repeated:
            raise ValidationError(repeated)
        return super().load_querystring(req, schema)


def _unsupported(message: str) -> NoReturn:
    """415, naming the `Content-Type` header as the input at fault."""
    abort(415, message=message, errors=header_fault("Content-Type", message))
    raise AssertionError("unreachable")  # abort raises


F = TypeVar("F", bound=Callable[..., Any])


# The attribute that marks a view (a function, or a MethodView's method) whose arguments
# include the query string: `Blueprint.arguments` sets it, `functools.wraps` carries it up.
_TAKES_QUERY = "_fairq_takes_query"
_QUERY_LOCATIONS = frozenset({"query", "querystring"})


def _refuse_undeclared_query() -> None:
    """422 naming each query parameter of a request whose view takes none.

    A view that declares query arguments has its schema refuse the unknown ones
    (`StrictJsonParser`); the others would ignore `?priority=high` without a word.
    """
    request = flask.request
    if not request.args:
        return
    view = flask.current_app.view_functions.get(request.endpoint or "")
    view_class = getattr(view, "view_class", None)
    if view_class is not None:
        method = request.method.lower()
        view = getattr(view_class, method, None) or (
            getattr(view_class, "get", None) if method == "head" else None
        )
    if view is None or getattr(view, _TAKES_QUERY, False):
        return
    abort(422, errors={"query": {name: [UNKNOWN_FIELD] for name in request.args}})


class Blueprint(flask_smorest.Blueprint):  # type: ignore[misc]  # untyped library
    """flask-smorest Blueprint using `StrictJsonParser` for every argument.

    `strict_query`: a query parameter that none of the view's arguments declares is a 422
    naming it (`_refuse_undeclared_query`). Off for probes that load balancers may call
    with a cache-busting query string.
    """

    ARGUMENTS_PARSER = StrictJsonParser()

    def __init__(self, *args: Any, strict_query: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if strict_query:
            self.before_request(_refuse_undeclared_query)

    def arguments(self, schema: Any, *, location: str = "json", **kwargs: Any) -> Any:
        """flask-smorest's `arguments`; a query location marks the view as taking a query."""
        decorate = super().arguments(schema, location=location, **kwargs)
        if location not in _QUERY_LOCATIONS:
            return decorate

        def marked(view: F) -> F:
            decorated = decorate(view)
            setattr(decorated, _TAKES_QUERY, True)
            return cast(F, decorated)

        return marked

    def error(self, status: int, description: str) -> Any:
        """Document an error `status` of an operation, with the error body's schema."""
        return self.alt_response(status, schema=ErrorSchema, description=description)
