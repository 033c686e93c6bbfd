"""Tool calls of a migrated chat stream, rebuilt the way vLLM's `pythonic` parser streams them.

A continuation is a /v1/completions stream of raw text: the tool-call deltas the client
gets after a seam must be made by the router. It replays exactly one format, vLLM's
`--tool-call-parser pythonic` (`[get_weather(city='Paris'), get_time(zone='CET')]`), with
the same algorithm vLLM runs on every delta (vllm/tool_parsers/pythonic_tool_parser.py and
utils.py: close the open brackets and quotes, `ast.parse`, arguments as literals,
`json.dumps(..., ensure_ascii=False)`, the closing characters it added held back), seeded
with what the client was already sent per call. Replaying the streaming algorithm rather
than parsing the final text keeps the client's view identical to an unbroken stream's, a
truncated (`length`) answer included, and lets the continuation stream its arguments as
they come. What was sent must stay a prefix of what the text now says; when it does not
(a text that changed under the seam), `ToolCallMismatch` ends the stream with an error
rather than sending calls that contradict the ones sent. Streams from nodes that read tool
calls with another parser are never replayed here: each node advertises its parser and
only `pythonic` ones are resumed (decide.py).

Pure functions and one small state class: no I/O, and no vLLM import (the router has none).
"""

from __future__ import annotations

import ast
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class ToolCallMismatch(Exception):
    """The text no longer says what the client was sent about a call."""


@dataclass(slots=True)
class SentCall:
    """What the client holds of one tool call (by its index): the parts its deltas carried."""

    id: str | None = None
    type: str | None = None
    name: str | None = None
    arguments: str = ""


def record(calls: list[SentCall], deltas: Any) -> None:
    """Add one event's `delta.tool_calls` to what the client holds (`calls`, by index), as
    an OpenAI client assembles them: the first delta of an index names the call, the rest
    append to its arguments."""
    for delta in deltas if isinstance(deltas, list) else ():
        index = delta.get("index") if isinstance(delta, dict) else None
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index <= len(calls):
            continue
        if index == len(calls):
            calls.append(SentCall())
        call, function = calls[index], delta.get("function")
        call.id = call.id or _str(delta.get("id"))
        call.type = call.type or _str(delta.get("type"))
        if isinstance(function, dict):
            call.name = call.name or _str(function.get("name"))
            call.arguments += _str(function.get("arguments")) or ""


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def tool_call_id() -> str:
    """A new call's id, in vLLM's format (`make_tool_call_id`: 16 hex digits of a uuid4)."""
    return f"chatcmpl-tool-{uuid.uuid4().int & (2**64 - 1):016x}"


def starts_tool_calls(text: str) -> bool:
    """Whether vLLM's pythonic parser reads `text` as tool calls: it starts with `[`, as is
    (the parser does not strip; a leading space makes it content)."""
    return text.startswith("[")


_CLOSING = {"[": "]", "(": ")", "{": "}", "'": "'", '"': '"'}


def make_valid_python(text: str) -> tuple[str, str] | None:
    """vLLM's `make_valid_python`: `text` with its open brackets and quotes closed, and what
    was added; None while the text is too incomplete (mid-name, after `=`).
    Raises ValueError on mismatched brackets (vLLM's UnexpectedAstError)."""
    stack = _bracket_stack(text)
    text = text.rstrip()
    if text.endswith("=") or text.endswith(":"):
        return None
    if stack and stack[-1] == "{":
        head = text[: text.rfind("{")]
        if head.count(":") <= head.count(","):
            return None
    if stack and stack[-1] == "(":
        head = text[: text.rfind("(")]
        if head.count("=") <= head.count(","):
            return None
    if text.endswith(","):
        text = text[:-1]
    if stack and stack[-1] == "[" and not text.endswith("[") and not text.endswith(")"):
        return None
    added = "".join(_CLOSING[c] for c in reversed(stack))
    candidate = text + added
    try:
        module = ast.parse(candidate)
    except SyntaxError:
        return None
    if not module.body:
        return None
    if "}" in added and any(isinstance(node, ast.Set) for node in ast.walk(module)):
        return None
    return candidate, added


def _bracket_stack(text: str) -> list[str]:
    stack: list[str] = []
    for index, char in enumerate(text):
        if stack and stack[-1] in {"'", '"'}:  # inside a string only its closing quote counts
            if char == stack[-1] and not _is_escaped(text, index):
                stack.pop()
            continue
        if char in "[({":
            stack.append(char)
        elif char in "])}":
            opener = {"]": "[", ")": "(", "}": "{"}[char]
            if not stack or stack.pop() != opener:
                raise ValueError(f"mismatched {char!r}")
        elif char in {"'", '"'}:
            stack.append(char)
    return stack


def _is_escaped(text: str, index: int) -> bool:
    backslashes = 0
    while index - backslashes - 1 >= 0 and text[index - backslashes - 1] == "\\":
        backslashes += 1
    return backslashes % 2 == 1


def parse_calls(python: str) -> list[tuple[str, str]]:
    """The calls of a whole pythonic call list: (name, arguments as vLLM's JSON), in order.
    Raises ValueError when `python` is not a list of calls with literal arguments."""
    try:
        module = ast.parse(python)
    except SyntaxError as exc:
        raise ValueError(str(exc)) from None
    parsed = getattr(module.body[0], "value", None) if module.body else None
    if not isinstance(parsed, ast.List) or not all(isinstance(e, ast.Call) for e in parsed.elts):
        raise ValueError("tool output must be a list of function calls")
    return [_call(e) for e in parsed.elts if isinstance(e, ast.Call)]


def _call(call: ast.Call) -> tuple[str, str]:
    parts: list[str] = []
    func: ast.expr = call.func
    while isinstance(func, ast.Attribute):  # a.b.c(...) keeps its dotted name
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        raise ValueError("invalid tool call name")
    name = ".".join([func.id, *reversed(parts)])
    arguments = {k.arg: _value(k.value) for k in call.keywords}
    return name, json.dumps(arguments, ensure_ascii=False)


_JSON_NAMES = {"null": None, "true": True, "false": False}


def _value(node: ast.expr) -> Any:
    """vLLM's `get_parameter_value`: a literal argument's value."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, str | int | float):
            return node.value
        raise ValueError("tool call arguments must be JSON values")
    if isinstance(node, ast.Dict):
        if not all(isinstance(k, ast.Constant) for k in node.keys):
            raise ValueError("dict arguments must have literal keys")
        return {k.value: _value(v) for k, v in zip(node.keys, node.values, strict=True)
                if isinstance(k, ast.Constant)}
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return [_value(v) for v in node.elts]
    if isinstance(node, ast.JoinedStr) and all(isinstance(p, ast.Constant) for p in node.values):
        return "".join(str(p.value) for p in node.values if isinstance(p, ast.Constant))
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _value(node.operand)
        if isinstance(operand, int | float) and not isinstance(operand, bool):
            return -operand if isinstance(node.op, ast.USub) else operand
    raise ValueError("tool call arguments must be literals")


class PythonicStream:
    """vLLM's pythonic parser mid-stream, resumed from what the client was sent.

    `feed(text)` takes the whole generated text so far (vLLM's `current_text`) and returns
    the delta message vLLM would send for it: `{"tool_calls": [...]}`, `{"content": ""}`
    once every call is complete and nothing is new, or None (nothing to send yet)."""

    def __init__(self, sent: list[SentCall], new_id: Callable[[], str] = tool_call_id) -> None:
        self._sent = [SentCall(c.id, c.type, c.name, c.arguments) for c in sent]
        self._streamed = [c.arguments for c in sent]
        # vLLM's current_tool_index: the last call it started (it may have finished it: then
        # its arguments come out whole again and add nothing).
        self._index = len(sent) - 1
        self._new_id = new_id
        self._checked = False

    def feed(self, text: str) -> dict[str, Any] | None:
        """The delta for `text`. Raises ToolCallMismatch when `text` contradicts what was sent."""
        try:
            valid = make_valid_python(text)
            if valid is None:
                return None
            python, added = valid
            calls = parse_calls(python)
        except ValueError:
            return None  # vLLM logs and skips the chunk
        self._check(calls)
        deltas: list[dict[str, Any]] = []
        try:
            for index, call in enumerate(calls):
                if index < self._index:
                    continue
                delta = self._step(index, call, last=index == len(calls) - 1, added=added)
                if delta is not None:
                    deltas.append(delta)
        except ValueError:
            return None  # vLLM's compute_tool_delta raised: the chunk is skipped, state kept
        if deltas:
            return {"tool_calls": deltas}
        if not added and self._index > 0:
            return {"content": ""}  # every call is complete: vLLM's cue to set finish_reason
        return None

    def _step(self, index: int, call: tuple[str, str], last: bool, added: str) -> dict[str, Any] | None:
        """vLLM's loop body for one call: the arguments it can stream, without the closing
        characters the completion added."""
        self._index = index
        if len(self._streamed) == index:
            self._streamed.append("")
        complete = not last or ")]" not in added
        if complete:
            self._index += 1
        withheld = added[:-2] if not complete else ""
        if not complete and added[-2] == ")":
            withheld += "}"
        withheld = withheld.replace("'", '"')
        name, arguments = call
        if withheld:
            if not arguments.endswith(withheld):
                raise ValueError("arguments do not end with the withheld suffix")
            arguments = arguments[: -len(withheld)]
        previous = self._streamed[index]
        if not previous:
            self._streamed[index] += arguments
            return {"id": self._new_id(), "type": "function", "index": index,
                    "function": {"name": name, "arguments": arguments}}
        diff = arguments[len(previous):]
        if not diff:
            return None
        self._streamed[index] += diff
        return {"id": None, "index": index, "function": {"arguments": diff}}

    def _check(self, calls: list[tuple[str, str]]) -> None:
        """The calls sent must be the text's: same names always; on the first parse after
        the seam, the arguments sent a prefix of the text's (later parses stream as vLLM
        does, even where vLLM's own partial parses disagree, as `1` then `1e5`)."""
        if len(calls) < len(self._sent) and not self._checked:
            raise ToolCallMismatch(f"{len(self._sent)} calls were sent, the text has {len(calls)}")
        for sent, (name, arguments) in zip(self._sent, calls, strict=False):
            if sent.name is not None and sent.name != name:
                raise ToolCallMismatch(f"call {sent.name!r} was sent, the text calls {name!r}")
            if not self._checked and not arguments.startswith(sent.arguments):
                raise ToolCallMismatch(f"the arguments sent for {name!r} are not the text's")
        self._checked = True
