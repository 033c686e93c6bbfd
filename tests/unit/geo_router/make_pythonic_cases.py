"""Records what vLLM's own pythonic tool parser streams, for test_tool_calls.py.

The router's tests run without vLLM, so its replay (geo_router.forwarding.migration.tool_calls) is
checked against these recorded outputs. Regenerate with vLLM's venv after a vLLM upgrade:
    .venv-vllm/bin/python tests/unit/geo_router/make_pythonic_cases.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm.tool_parsers.pythonic_tool_parser import PythonicToolParser

TEXTS = [
    '[get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]',
    "[get_weather(city='Paris', unit='celsius')]",
    "[f(n=12, x=-1.5, ok=True, none=None, tags=['a', 'b'], opts={'k': 'v'})]",
    "[a.b.search(q='caf\u00e9 \"quoted\"', limit=3), noop()]",
    "[get_weather(city='Paris', unit='cel",  # truncated: max_tokens ran out
    "[1, 2, 3]",
    "[not a call",
    "hello [get_weather(city='x')]",
]
CHUNKS = [1, 3]


def stream(text: str, size: int) -> list[dict[str, Any] | None]:
    parser = PythonicToolParser(None)  # type: ignore[arg-type]  # the tokenizer is unused
    out: list[dict[str, Any] | None] = []
    current = ""
    for at in range(0, len(text), size):
        delta = text[at:at + size]
        previous, current = current, current + delta
        message = parser.extract_tool_calls_streaming(previous, current, delta, [], [], [], None)  # type: ignore[arg-type]
        dumped = None if message is None else message.model_dump(exclude_unset=True)
        for call in (dumped or {}).get("tool_calls") or ():
            if call.get("id"):
                call["id"] = "<id>"
        out.append(dumped)
    return out


def main() -> None:
    cases = [{"text": t, "chunk": n, "deltas": stream(t, n)} for t in TEXTS for n in CHUNKS]
    lines = ",\n".join(json.dumps(c, ensure_ascii=False) for c in cases)
    Path(__file__).with_name("pythonic_cases.json").write_text(f"[\n{lines}\n]\n")


if __name__ == "__main__":
    main()
