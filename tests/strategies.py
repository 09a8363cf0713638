"""hypothesis strategies shared by the property tests."""

from __future__ import annotations

from hypothesis import strategies as st

# What a JSON parser can hand us: no NaN/Infinity, no lone surrogates (loads_strict refuses
# both), but NUL, any other character, huge and negative numbers, empty containers.
json_text = st.text(st.characters(codec="utf-8"), max_size=30)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    json_text,
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(json_text, children, max_size=4)
    ),
    max_leaves=20,
)
