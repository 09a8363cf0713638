"""Properties of the input validators and of the retry backoff, checked with hypothesis.

Validators (design §1.6, §3): whatever JSON a client sends, validation either accepts it or
raises `ValidationError` (a 422), never another exception (a 500); what it accepts is within
the documented limits and survives a JSON round trip. Backoff (design §4, Fail): a delay in
`[0, min(cap, base * 2 ** (attempt - 1))]` for every attempt, however large, without overflow.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from marshmallow import ValidationError

from api.parser import loads_strict
from api.tasks.schemas import (
    MAX_PAYLOAD_BYTES,
    MAX_PAYLOAD_DEPTH,
    TaskCreateSchema,
    check_payload_limits,
)
from tests.strategies import json_scalars, json_text, json_values
from worker import backoff, tasktypes

# Reproducible in CI: the same examples every run, no example database between runs.
settings.register_profile(
    "fairq-properties",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROPERTIES = settings.get_profile("fairq-properties")


def nest(value: Any, levels: int, as_list: bool) -> Any:
    """`value` wrapped in `levels` lists or single-key objects."""
    for _ in range(levels):
        value = [value] if as_list else {"k": value}
    return value


# Around the limits, which plain recursive values never reach: 32 levels, 64 KiB.
deep_values = st.builds(
    nest, json_values, st.integers(MAX_PAYLOAD_DEPTH - 3, MAX_PAYLOAD_DEPTH + 2), st.booleans()
)
big_values = st.integers(MAX_PAYLOAD_BYTES - 40, MAX_PAYLOAD_BYTES + 10).map(lambda n: "x" * n)
payloads = st.one_of(
    st.dictionaries(json_text, st.one_of(json_values, deep_values, big_values), max_size=3),
    st.dictionaries(json_text, deep_values, min_size=1, max_size=2),
    json_values,
)


def depth(value: Any) -> int:
    """Nesting depth as design §3 counts it: the top object is 1, scalars add nothing."""
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    return 0


def contains_nul(value: Any) -> bool:
    """True if any key or string anywhere in `value` holds U+0000."""
    if isinstance(value, dict):
        return any("\x00" in k or contains_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(contains_nul(v) for v in value)
    return isinstance(value, str) and "\x00" in value


def compact_size(value: Any) -> int:
    """Bytes of `value` as compact UTF-8 JSON, the size design §3 limits."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


@PROPERTIES
@given(payloads)
def test_payload_limits_accept_exactly_the_objects_within_the_limits(payload: Any) -> None:
    within = (
        isinstance(payload, dict)
        and depth(payload) <= MAX_PAYLOAD_DEPTH
        and not contains_nul(payload)
        and compact_size(payload) <= MAX_PAYLOAD_BYTES
    )

    try:
        check_payload_limits(payload)
    except ValidationError:
        accepted = False
    else:
        accepted = True

    assert accepted == within
    if accepted:
        assert json.loads(json.dumps(payload)) == payload


def rejection(load: Callable[[Any], Any], value: Any) -> Any:
    """The `ValidationError` messages of `load(value)`, None if it loads; other errors propagate."""
    try:
        load(value)
    except ValidationError as exc:
        return exc.messages
    return None


def _payload_for(type_name: str) -> st.SearchStrategy[Any]:
    """Objects using the type's own field names, with any JSON values, or any JSON at all."""
    schema = tasktypes.REGISTRY[type_name].payload_schema()
    names = st.sampled_from([*schema.fields, "extra"])
    return st.one_of(json_values, st.dictionaries(names, payloads, max_size=4))


@PROPERTIES
@pytest.mark.parametrize("type_name", tasktypes.names())
@given(data=st.data())
def test_each_payload_schema_accepts_or_raises_validation_error_only(
    type_name: str, data: st.DataObject
) -> None:
    payload = data.draw(_payload_for(type_name), label="payload")
    schema = tasktypes.REGISTRY[type_name].payload_schema()

    messages = rejection(schema.load, payload)

    assert messages if messages is not None else isinstance(payload, dict)


@PROPERTIES
@given(
    type_name=st.one_of(st.sampled_from(tasktypes.names()), json_scalars),
    payload=payloads,
    max_attempts=json_scalars,
    run_at=st.one_of(json_text, st.datetimes(timezones=st.timezones()).map(str)),
)
def test_create_body_is_accepted_within_limits_or_rejected_with_validation_error(
    type_name: Any, payload: Any, max_attempts: Any, run_at: str
) -> None:
    body = {"type": type_name, "payload": payload, "max_attempts": max_attempts, "run_at": run_at}

    messages = rejection(TaskCreateSchema().load, body)

    if messages is not None:
        assert messages
        return
    loaded = TaskCreateSchema().load(body)
    check_payload_limits(loaded["payload"])
    assert json.loads(json.dumps(loaded["payload"])) == loaded["payload"]
    assert 1 <= loaded["max_attempts"] <= 50


def _document_error(data: bytes) -> str | None:
    """The message `loads_strict` refuses `data` with, or None when it parses."""
    try:
        loads_strict(data)
    except json.JSONDecodeError as exc:
        return exc.msg
    return None


def _duplicate_key_document(key: str, first: Any, second: Any) -> bytes:
    """`{"key": first, "key": second}` as bytes: json.dumps cannot write a duplicate."""
    name = json.dumps(key)
    return f"{{{name}: {json.dumps(first)}, {name}: {json.dumps(second)}}}".encode()


@PROPERTIES
@given(st.binary(max_size=200) | json_text.map(str.encode))
def test_strict_json_parser_returns_a_value_or_a_decode_error_for_any_bytes(data: bytes) -> None:
    message = _document_error(data)  # any other exception fails the test

    assert message is None or message.strip()


@PROPERTIES
@given(st.integers(1, 6000), st.booleans())
def test_integers_are_accepted_exactly_within_the_range_of_a_double(
    digits: int, negative: bool
) -> None:
    text = ("-" if negative else "") + "9" * digits

    message = _document_error(text.encode())

    if digits <= 308:  # 10**308 - 1 < 1.797e308, the largest double
        assert message is None
    else:
        assert message is not None
        assert "out of range" in message
        assert "sys." not in message  # no Python hint (sys.set_int_max_str_digits)


@PROPERTIES
@given(json_text, json_values, json_values)
def test_objects_with_a_duplicate_key_are_always_refused(key: str, first: Any, second: Any) -> None:
    message = _document_error(_duplicate_key_document(key, first, second))

    assert message is not None
    assert "duplicate key" in message


@PROPERTIES
@given(json_values)
def test_strict_json_parser_round_trips_every_json_value(value: Any) -> None:
    assert loads_strict(json.dumps(value).encode()) == value


@PROPERTIES
@given(
    attempt=st.one_of(st.integers(1, 100), st.integers(min_value=1)),
    base=st.floats(1e-3, 1e4),
    cap=st.floats(1e-3, 1e7),
    seed=st.integers(0, 2**32),
)
def test_backoff_delay_is_between_zero_and_the_capped_exponential(
    attempt: int, base: float, cap: float, seed: int
) -> None:
    # Exact arithmetic for the bound: 2 ** (attempt - 1) as a float overflows past 1023.
    exponent = min(attempt - 1, 64)  # base * 2**64 > 1e7 >= cap for every base drawn
    bound = min(Fraction(cap), Fraction(base) * 2**exponent)

    top = backoff.ceiling(attempt, base=base, cap=cap)
    delay = backoff.delay(attempt, base=base, cap=cap, rng=random.Random(seed))

    assert Fraction(top) == bound
    assert 0.0 <= delay <= top <= cap


@PROPERTIES
@given(attempt=st.one_of(st.integers(1, 40), st.integers(min_value=1)))
def test_backoff_with_the_defaults_never_exceeds_an_hour(attempt: int) -> None:
    delay = backoff.delay(attempt)

    assert (
        0.0 <= delay <= min(backoff.CAP_SECONDS, backoff.BASE_SECONDS * 2 ** min(attempt - 1, 12))
    )


@PROPERTIES
@given(st.integers(max_value=0))
def test_backoff_refuses_attempts_below_one(attempt: int) -> None:
    with pytest.raises(ValueError, match="attempt"):
        backoff.delay(attempt)
