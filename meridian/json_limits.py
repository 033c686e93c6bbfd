"""How deeply a request body's JSON may nest: one limit for the router and every node.

The router decoded bodies nested 951 to 955 deep, but a node's `json.loads` raised
RecursionError on them: an uncaught 500 that counted towards ejecting the node, so a
request could take a healthy node out of rotation. Both now refuse the same bodies with a
400, well below either parser's recursion limit: OpenAI requests nest a few levels (a
JSON schema in `response_format` or `tools` a few dozen at most).
"""

from __future__ import annotations

from typing import Any

MAX_JSON_DEPTH = 64


def too_deep(raw: bytes, value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the decoded `value` of the JSON text `raw` nests deeper than `limit`.

    A text with no more brackets than `limit` cannot (the common case, counted in C); only
    other bodies are walked, without recursion.
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False
