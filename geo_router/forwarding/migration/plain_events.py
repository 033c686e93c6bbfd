"""Plain events of a migratable stream read in bulk: the ids and text, never the whole JSON.

Almost every event of a stream is the same bytes but for its text and ids: one choice
(index 0) whose delta carries a bit of content and whose `token_ids` carry its ids, the
stream's id, object, created and model, nulls. Parsing each as JSON, walking it, and writing
it again without its ids cost ≈ 5 µs an event and halved a router's stream throughput. So
the first such event of a stream becomes its *template*: its own bytes with the text and
the ids left open. `PlainReader.split` cuts a run of events into the events matching it,
whose text and ids are decoded a stretch at a time and whose client bytes are the
template's with the text put in, and the others, which the caller reads whole. The usual
run (a stream's id, object, created and model repeat in every event) is cut by finding only
the texts and ids, then comparing the events rebuilt from them with the run's bytes; any
other (heads that vary, plain events between others) by one `re.split` with an expression
of the whole template. Both are C loops.

An event matches only if every byte outside its text and ids is the template's, and the
template is taken only from an event that tells the ledger nothing but its text and ids
(`plain`: no finish_reason, usage, error, tool calls, reasoning, other choices, prompt ids
or fingerprint). So reading a matching event in bulk gives the ledger what reading it whole
would, and the client the same JSON (a contract test holds the two paths to it).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from typing import Any

import msgspec

from .plan import Api

_INTS = msgspec.json.Decoder(list[int])
_STRS = msgspec.json.Decoder(list[str])
_TEXT_KEY = {Api.CHAT: b'"content":"', Api.COMPLETIONS: b'"text":"'}
IDS_KEY = b'"token_ids":['
# A JSON string's inside, and a list of ids' (what the template leaves open).
_STRING_INSIDE = rb'([^"\\\x00-\x1f]*+(?:\\.[^"\\\x00-\x1f]*+)*+)'
_IDS_INSIDE = rb"([0-9]{1,18}+(?:,[0-9]{1,18}+)*+)"  # int64 at most, as msgspec decodes


@dataclass(frozen=True, slots=True)
class Plain:
    """Consecutive events that matched the template: their ids, their non-empty texts, and
    the client's bytes for them."""

    ids: list[int]
    texts: list[str]
    client: bytes
    events: int  # how many events (texts counts only the non-empty ones)


def plain(event: dict[str, Any], api: Api) -> bool:
    """Whether reading `event` whole tells a ledger only its text and ids (and it has both)."""
    if set(event) - {"id", "object", "created", "model", "choices"}:
        return False
    choices = event.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return False
    choice = choices[0]
    if choice.get("index") != 0 or choice.get("finish_reason") is not None or choice.get("stop_reason") is not None:
        return False
    if set(choice) - {"index", "delta", "text", "logprobs", "finish_reason", "stop_reason", "token_ids"}:
        return False
    if choice.get("logprobs") is not None or not isinstance(choice.get("token_ids"), list):
        return False
    if api is Api.CHAT:
        delta = choice.get("delta")
        return isinstance(delta, dict) and set(delta) == {"content"} and isinstance(delta["content"], str)
    return isinstance(choice.get("text"), str) and "delta" not in choice


class PlainReader:
    """One stream's template, once a plain event gave it (`learn`), and the bulk reading of
    what matches it."""

    def __init__(self, api: Api, keep_ids: bool) -> None:
        self._api, self._keep_ids = api, keep_ids
        self._pattern: re.Pattern[bytes] | None = None
        # The template's own bytes up to its text: a stream's id, object, created and model
        # are the same in all its events (vLLM's and ours), so most runs need no expression.
        self._pre = b""
        self._inner: re.Pattern[bytes] | None = None
        # A matching event's bytes: its own head (id, object, created, model) + choice +
        # its text (as JSON escapes it) + middle + its ids + rest.
        self._choice = self._middle = self._rest = b""
        # The client's bytes of one: head + choice + text + tail (the ids and a comma cut out).
        self._tail = b""
        # What the template event tells a ledger besides its text and ids (its id, model, created).
        self.identity: dict[str, Any] = {}

    @property
    def ready(self) -> bool:
        return self._pattern is not None

    def learn(self, raw: bytes, event: dict[str, Any]) -> None:
        """Take `raw` (a whole `data: {…}\\n\\n` event, `event` parsed, known `plain`) as the
        template, if its bytes can be one."""
        text_key = _TEXT_KEY[self._api]
        choices = raw.find(b'"choices":[')
        start = raw.find(text_key)
        if choices < 0 or start < 0 or raw.count(text_key) != 1 or raw.count(IDS_KEY) != 1:
            return
        head = _head_pattern(raw[:choices], event)
        start += len(text_key)
        end = _string_end(raw, start)
        ids_at = raw.find(IDS_KEY, end) if end >= 0 else -1
        if head is None or ids_at < 0:
            return
        ids_start = ids_at + len(IDS_KEY)
        ids_end = raw.find(b"]", ids_start)
        self._choice, self._middle, self._rest = raw[choices:start], raw[end:ids_start], raw[ids_end:]
        self._pre = raw[:start]
        self._inner = _inner(text_key, self._middle)
        self._pattern = _template(head, self._choice, self._middle, self._rest)
        cut, after = self._middle[: -len(IDS_KEY)], self._rest[1:]
        if cut.endswith(b",") and after.startswith(b"}"):
            cut = cut[:-1]
        elif after.startswith(b","):
            after = after[1:]
        self._tail = cut + after
        self.identity = {k: event[k] for k in ("id", "model", "created") if k in event}

    def split(self, run: bytes) -> Iterable[Plain | bytes]:
        """`run` (whole events) in order: Plain for each stretch of events matching the
        template, bytes for each stretch of others (to be read whole)."""
        fast = self._split_fixed(run)
        return fast if fast is not None else self._split_pattern(run)

    def _split_fixed(self, run: bytes) -> list[Plain | bytes] | None:
        """The usual run: other events, then events that are the template's very bytes but
        for their text and ids, then others. The texts and ids are found by a short expression
        (from the text's key to the ids' end: a third of an event's bytes), and the events
        rebuilt from what it found are compared with the run's own bytes: the rest of each
        event is the template's, and no other event lies among them. None: not such a run
        (the whole expression reads it); a run with no text and ids at all is read whole."""
        pre, inner_pattern = self._pre, self._inner
        assert inner_pattern is not None
        start = run.find(pre)
        found = inner_pattern.findall(run, max(start, 0))
        if not found:  # the whole expression holds this one: it would find nothing either
            return [run] if run else []
        if start < 0:
            return None
        inner, texts, ids = zip(*found, strict=True)
        raw = pre + (self._rest + pre).join(inner) + self._rest
        if not run.startswith(raw, start):  # other events among them, or a head of its own
            return None
        read = _decoded(texts, ids)
        if read is None:
            return None
        client = raw if self._keep_ids else pre + (self._tail + pre).join(texts) + self._tail
        end = start + len(raw)
        return [x for x in (run[:start], Plain(*read, client, len(texts)), run[end:]) if x]

    def _split_pattern(self, run: bytes) -> Iterator[Plain | bytes]:
        """`split` by the template's expression: events whose head fields vary, or stretches
        of matching events between others."""
        assert self._pattern is not None
        parts = self._pattern.split(run)
        # parts: other, head, text, ids, other, head, text, ids, …, other
        others = parts[0::4]
        if not any(others[1:-1]):  # the usual run: others only before and after
            if others[0]:
                yield others[0]
            if len(parts) > 1:
                yield self._matched(parts[1::4], parts[2::4], parts[3::4])
            if len(others) > 1 and others[-1]:
                yield others[-1]
            return
        if others[0]:
            yield others[0]
        start = 1  # where the stretch of matches now going begins (a head's index)
        for i in range(4, len(parts) - 1, 4):  # the others between matches
            if parts[i]:
                if i > start:
                    yield self._matched(parts[start:i:4], parts[start + 1:i:4], parts[start + 2:i:4])
                yield parts[i]
                start = i + 1
        if len(parts) - 1 > start:
            yield self._matched(parts[start::4], parts[start + 1::4], parts[start + 2::4])
        if parts[-1]:
            yield parts[-1]

    def _matched(self, heads: list[bytes], texts: list[bytes], ids: list[bytes]) -> Plain | bytes:
        """Plain for events the expression matched (each with its own head)."""
        raw = self._raw(heads, texts, ids)
        read = _decoded(texts, ids)
        if read is None:
            return raw
        if self._keep_ids:
            return Plain(*read, raw, len(texts))
        # one join of the parts, interleaved in C
        client = b"".join(chain.from_iterable(zip(heads, repeat(self._choice), texts, repeat(self._tail))))
        return Plain(*read, client, len(texts))

    def _raw(self, heads: list[bytes], texts: list[bytes], ids: list[bytes]) -> bytes:
        """The node's own bytes of matching events (the template's, but for these parts)."""
        return b"".join(chain.from_iterable(zip(heads, repeat(self._choice), texts, repeat(self._middle), ids,
                                                repeat(self._rest))))


def _decoded(texts: Sequence[bytes], ids: Sequence[bytes]) -> tuple[list[int], list[str]] | None:
    """The ids and the non-empty texts of matching events; None when JSON refuses an escape
    in them (the node's fault: the events are then read whole)."""
    try:
        decoded = _STRS.decode(b'["' + b'","'.join(texts) + b'"]')
        return _INTS.decode(b"[" + b",".join(ids) + b"]"), list(filter(None, decoded))
    except msgspec.DecodeError:
        return None


@functools.lru_cache(maxsize=256)
def _template(head: bytes, choice: bytes, middle: bytes, rest: bytes) -> re.Pattern[bytes]:
    """The expression matching a template's events. The same for every stream of a
    deployment: compiled once (a compile costs ≈ 0.3 ms, as much as relaying a short stream)."""
    return re.compile(head + re.escape(choice) + _STRING_INSIDE + re.escape(middle) + _IDS_INSIDE + re.escape(rest))


@functools.lru_cache(maxsize=256)
def _inner(text_key: bytes, middle: bytes) -> re.Pattern[bytes]:
    """The expression finding a template's texts and ids (from the text's key to the end of
    the ids): what _split_fixed matches instead of the whole event."""
    return re.compile(re.escape(text_key) + b"(" + _STRING_INSIDE + re.escape(middle) + _IDS_INSIDE + rb")\]")


def _head_pattern(head: bytes, event: dict[str, Any]) -> bytes | None:
    """A capturing expression for an event's bytes before "choices" with the values of its
    fields left open (a stream's id and time differ from every other's): `data: {` and each
    field as compact JSON, in `event`'s order; None when `head` is not that."""
    fields = []
    for key, value in event.items():
        if key == "choices":
            break
        if isinstance(value, str):
            # Ids, object and model names hold no escapes (one that does: no template).
            fields.append(b'"' + key.encode() + b'":"[^"\\\\\\x00-\\x1f]*+",')
        elif isinstance(value, int) and not isinstance(value, bool):
            fields.append(b'"' + key.encode() + b'":-?[0-9]++,')
        else:
            return None
    pattern = b"data: \\{" + b"".join(fields)
    if re.fullmatch(pattern, head) is None:
        return None
    return b"(" + pattern + b")"


def _string_end(raw: bytes, start: int) -> int:
    """The index of the quote that ends the JSON string starting at `start` (-1: none)."""
    at = raw.find(b'"', start)
    while at >= 0:
        backslashes = 0
        while raw[at - 1 - backslashes] == 0x5C:  # "\\"
            backslashes += 1
        if backslashes % 2 == 0:
            return at
        at = raw.find(b'"', at + 1)
    return -1
