"""The gateway's nesting check reads the depth of any JSON without decoding it, exactly as a
decoder would count it, whatever the strings hold (brackets, quotes, backslashes)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.protocol import json_depth

# strings full of what could fool a scan: brackets, quotes, backslashes, escapes
TRICKY = st.text(alphabet=st.sampled_from('[]{}"\\/ abc\n\u00e9'), max_size=12)
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TRICKY,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TRICKY, inner, max_size=4),
    max_leaves=40,
)


def depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    return 0


@settings(max_examples=400, deadline=None, derandomize=True)  # a fixed seed
@given(VALUES, st.booleans())
def test_depth_equals_the_decoded_values_depth(value, ascii_only):
    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert json_depth(body) == depth(value)


def test_hostile_bodies():
    assert json_depth(b"[" * 100_000 + b"]" * 100_000) == 100_000
    assert json_depth(b"[" * 100_000) == 100_000  # unterminated: still counted, not decoded
    assert json_depth(b'{"a": "' + b"[" * 100_000 + b'"}') == 1
    assert json_depth(b'["\\\\", [["\\"[[["]]]') == 3
    assert json_depth(b"") == 0 and json_depth(b"]]]") == 0
