"""A handler's result as `tasks.result` stores it: compact JSON text, checked in the pass.

A handler may return a JSON value (`tasktypes.base.JsonValue`; None: no result). The pass
turns it into text here, in its own thread, before the completion is buffered: a value that
cannot be stored is an error of its task (`outcome.unstorable_result`), never of the
completion statement, which writes a whole batch (`db.claims.complete_tasks`). A result
`jsonb` refused there would fail that statement, and the batch with it, on every retry.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

# The most a result may take, as compact UTF-8 JSON: a result reports on the work (an id, a
# status, an excerpt), it is not a place for the work's data. Every read of the task carries
# it: a task listing of 100 such rows is 6.4 MiB.
MAX_RESULT_BYTES = 64 * 1024

# jsonb refuses the escape of U+0000 ("unsupported Unicode escape sequence"), which is how
# JSON writes that character, in a string or a key. In JSON text a backslash starts an escape
# and `\\` is one escaped backslash, so an escape `\u0000` is one preceded by an even number
# of backslashes (the text `\\u0000` is a backslash followed by "u0000").
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


class UnstorableResult(ValueError):
    """A handler's result that `tasks.result` cannot store; the message says why."""


def _as_json_container(value: object) -> object:
    # Called by the encoder for what it cannot write itself: mappings and sequences other
    # than dict, list and tuple become objects and arrays; anything else is refused.
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        return list(value)
    raise TypeError(f"a {type(value).__name__} is not a JSON value")


# One encoder, made once: compact, the characters themselves (UTF-8) rather than \u escapes,
# and no NaN or Infinity, which are not JSON (jsonb refuses them).
_encode = json.JSONEncoder(
    ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=_as_json_container
).encode


def encode(value: object) -> str:
    """The JSON text of a result that `tasks.result` can store.

    Objects' keys may be strings, numbers, booleans or None (written as strings, as `json`
    does). Raises `UnstorableResult` for anything else: a value that is not JSON (a set,
    bytes, an object; NaN or Infinity; a cycle; an integer of more digits than Python
    writes), one nested too deeply to write, a string with U+0000 or a lone surrogate (not
    UTF-8), or more than `MAX_RESULT_BYTES` of JSON.
    """
    try:
        text = _encode(value)
    except RecursionError:
        raise UnstorableResult("the result is nested too deeply to be written as JSON") from None
    except (TypeError, ValueError) as exc:
        raise UnstorableResult(f"the result is not JSON: {exc}") from None
    if text.isascii():
        size = len(text)
    else:
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError:
            raise UnstorableResult(
                "the result has a string with a lone surrogate, which is not UTF-8"
            ) from None
    if size > MAX_RESULT_BYTES:
        raise UnstorableResult(
            f"the result is {size:,} bytes of JSON, more than the {MAX_RESULT_BYTES:,} allowed"
        )
    if "\\u0000" in text and _NUL_ESCAPE.search(text):
        raise UnstorableResult("the result has a string with U+0000, which jsonb cannot store")
    return text
