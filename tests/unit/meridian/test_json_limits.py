"""The one JSON nesting limit of routers and nodes."""

from __future__ import annotations

import json

from meridian.json_limits import MAX_JSON_DEPTH, too_deep


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_depth_is_counted_by_containers_not_brackets() -> None:
    assert not too_deep(nested(MAX_JSON_DEPTH), json.loads(nested(MAX_JSON_DEPTH)))
    assert too_deep(nested(MAX_JSON_DEPTH + 1), json.loads(nested(MAX_JSON_DEPTH + 1)))
    # Many shallow containers (a long chat) are fine; brackets inside strings do not count.
    wide = {"messages": [{"role": "user", "content": "[[[{{{"} for _ in range(500)]}
    raw = json.dumps(wide).encode()
    assert not too_deep(raw, wide)
    deep_in_dict: object = "leaf"
    for _ in range(MAX_JSON_DEPTH + 1):
        deep_in_dict = {"k": deep_in_dict}
    assert too_deep(json.dumps(deep_in_dict).encode(), deep_in_dict)
