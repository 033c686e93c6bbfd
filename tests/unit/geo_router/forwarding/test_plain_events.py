"""A migratable stream's plain events read in bulk (geo_router.forwarding.migration.plain_events) give
the client and the ledger exactly what reading every event whole gives: the contract that
lets the relay skip parsing, held over generated streams cut into runs at random bytes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from geo_router.forwarding.migration.budget import MigrationBudget
from geo_router.forwarding.migration.ledger import StreamLedger
from geo_router.forwarding.migration.plain_events import PlainReader, plain
from geo_router.forwarding.migration.plan import CHAT_ROUTE, COMPLETIONS_ROUTE, plan_for
from geo_router.forwarding.migration.stream import _LEARN_TRIES, MigratingStream, MigrationContext, Piece
from geo_router.selection.candidates import Candidate
from geo_router.sse import SSEFramer, StreamTally
from meridian.clock import ManualClock
from meridian.contracts import NodeStatus, RegionInfo, RoutingNode

REGION = RegionInfo(name="aws:us-east-1", provider="aws", location="us-east-1", zones=["us"],
                    latitude=38.9, longitude=-77.4)
NODE = RoutingNode(node_id="n1", region=REGION.name, url="http://127.0.0.1:9", models=["m"],
                   status=NodeStatus.READY)


class _Silence:
    """SilenceWatch's start, off the loop (the relay itself never reads the clock)."""

    def started(self, node_id: str) -> None:
        pass


class _Host:
    """What a MigratingStream asks of its host when it is built (no piece is opened here)."""

    def __init__(self) -> None:
        self.budget = MigrationBudget(ManualClock(), percent=100, min_concurrency=1, tokens_per_s=1e9,
                                      burst_tokens=10**9)
        self.silence = _Silence()
        self.inter_token_timeout_s = self.read_timeout_s = 5.0


def _stream(route: str, wants_ids: bool) -> tuple[MigratingStream, Piece]:
    payload: dict[str, Any] = {"model": "m", "stream": True, "max_tokens": 64}
    payload |= {"messages": [{"role": "user", "content": "hi"}]} if route == CHAT_ROUTE else {"prompt": "hi"}
    if wants_ids:
        payload["return_token_ids"] = True
    plan = plan_for(route, payload, json.dumps(payload).encode())
    assert plan is not None
    candidate = Candidate(node=NODE, region=REGION, rtt_ms=0.0, in_flight=0)
    piece = Piece(candidate, None, SSEFramer(True), b"", False)  # type: ignore[arg-type]
    return MigratingStream(_Host(), MigrationContext(plan, [candidate], "r1"), piece, 1e9, 0.0), piece


# --- generated streams ------------------------------------------------------------------

_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8)
_IDS = st.lists(st.integers(0, 2**40), min_size=1, max_size=3)
_HEAD = {"id": "chatcmpl-7", "object": "chat.completion.chunk", "created": 1700000000, "model": "m"}


def _choice(chat: bool, text: str, ids: list[int], **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"index": 0}
    body |= {"delta": {"content": text}} if chat else {"text": text}
    return body | {"logprobs": None, "finish_reason": None, "token_ids": ids} | extra


@st.composite
def _event(draw: st.DrawFn, chat: bool) -> str:
    """One `data:` event (or comment) of the many shapes a node sends, mostly plain."""
    text, ids = draw(_TEXT), draw(_IDS)
    kind = draw(st.sampled_from(["plain"] * 6 + ["finish", "usage", "reasoning", "tools", "second", "null_ids",
                                                 "comment", "other_id", "spaced", "stop_reason", "negative_id",
                                                 "bad_quote", "bad_backslash"]))
    head = dict(_HEAD, object="chat.completion.chunk" if chat else "text_completion")
    event: dict[str, Any]
    if kind == "comment":
        return ": keep-alive\n\n"
    if kind in ("bad_quote", "bad_backslash"):  # not JSON: a text with a bare quote, or a
        # backslash that escapes the quote closing it (a node's bug; passed on, not read)
        good = json.dumps(head | {"choices": [_choice(chat, "@@", ids)]}, separators=(",", ":"))
        return "data: " + good.replace("@@", 'a"b' if kind == "bad_quote" else "a\\", 1) + "\n\n"
    if kind == "plain":
        event = head | {"choices": [_choice(chat, text, ids)]}
    elif kind == "negative_id":
        event = head | {"choices": [_choice(chat, text, [-1, *ids])]}
    elif kind == "finish":
        event = head | {"choices": [_choice(chat, text, ids, finish_reason="length")]}
    elif kind == "usage":
        event = head | {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    elif kind == "reasoning":
        choice = _choice(chat, text, ids)
        if chat:
            choice["delta"] = {"reasoning_content": text or "x"}
        event = head | {"choices": [choice]}
    elif kind == "tools":
        choice = _choice(chat, text, ids)
        if chat:
            choice["delta"] = {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                               "function": {"name": "f", "arguments": "{}"}}]}
        event = head | {"choices": [choice]}
    elif kind == "second":
        event = head | {"choices": [_choice(chat, text, ids) | {"index": 1}]}
    elif kind == "null_ids":
        event = head | {"choices": [_choice(chat, text, ids) | {"token_ids": None}]}
    elif kind == "other_id":
        event = head | {"id": "chatcmpl-other", "created": 1700000001, "choices": [_choice(chat, text, ids)]}
    elif kind == "stop_reason":
        event = head | {"choices": [_choice(chat, text, ids) | {"stop_reason": 7}]}
    else:  # spaced: JSON with spaces, as another server might write it
        return "data: " + json.dumps(head | {"choices": [_choice(chat, text, ids)]}) + "\n\n"
    return "data: " + json.dumps(event, separators=(",", ":"), ensure_ascii=draw(st.booleans())) + "\n\n"


@st.composite
def _streams(draw: st.DrawFn) -> tuple[bool, bytes, list[int]]:
    chat = draw(st.booleans())
    first = dict(_HEAD, object="chat.completion.chunk" if chat else "text_completion")
    choice = _choice(chat, "", [])
    choice.pop("token_ids")
    if chat:
        choice["delta"] = {"role": "assistant", "content": ""}
    else:
        choice["prompt_token_ids"] = [1, 2, 3]
    first |= {"choices": [choice]} | ({"prompt_token_ids": [1, 2, 3]} if chat else {})
    events = ["data: " + json.dumps(first, separators=(",", ":")) + "\n\n"]
    events += draw(st.lists(_event(chat), max_size=40))
    if draw(st.booleans()):
        events.append("data: [DONE]\n\n")
    body = "".join(events).encode()
    cuts = sorted(draw(st.lists(st.integers(1, max(1, len(body) - 1)), max_size=6)))
    return chat, body, cuts


def _relay(stream: MigratingStream, piece: Piece, body: bytes, cuts: list[int],
           sent: bytearray | None = None) -> tuple[list[Any], bool]:
    """The client's events for `body` arriving in reads cut at `cuts`, and whether it completed
    (the client's bytes added to `sent`)."""
    out = bytearray()
    for chunk in (body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)):
        run = piece.framer.feed(chunk)
        if run:
            events, broken = stream._events(piece, run)
            out += events
            if broken is not None or stream._complete:
                break
    if sent is not None:
        sent += out
    return [_parsed(e) for e in bytes(out).split(b"\n\n") if e], stream._complete


def _parsed(event: bytes) -> Any:
    """An event's JSON (so that key order and spacing do not count), else its bytes."""
    try:
        return json.loads(event[6:]) if event.startswith(b"data: {") else event
    except ValueError:
        return event


def _ledger_view(ledger: StreamLedger) -> tuple[Any, ...]:
    return (ledger.id, ledger.model, ledger.created, ledger.system_fingerprint, ledger.prompt_ids, ledger.generated,
            ledger.delivered_text, ledger.finish_reason, ledger.usage_sent, ledger.tool_calls, ledger.unresumable)


@settings(max_examples=300, deadline=None)
@given(_streams(), st.booleans())
def test_bulk_reading_gives_what_reading_each_event_whole_gives(stream_case: tuple[bool, bytes, list[int]],
                                                                wants_ids: bool) -> None:
    chat, body, cuts = stream_case
    route = CHAT_ROUTE if chat else COMPLETIONS_ROUTE
    bulk, bulk_piece = _stream(route, wants_ids)
    whole, whole_piece = _stream(route, wants_ids)
    whole._learn_tries = _LEARN_TRIES  # never looks for a template: every event read whole
    client = bytearray()
    assert _relay(bulk, bulk_piece, body, cuts, client) == _relay(whole, whole_piece, body, cuts)
    assert _ledger_view(bulk._ledger) == _ledger_view(whole._ledger)
    # The stream counts what it sends as it goes: what counting the client's bytes would give.
    sent = StreamTally()
    sent.feed(bytes(client))
    assert (bulk.tally.events, bulk.tally.usage) == (whole.tally.events, whole.tally.usage) == (sent.events, sent.usage)


def _plain_bytes(text: str, ids: str) -> str:
    """A plain chat event with `text` and `ids` put into its bytes as they are."""
    good = json.dumps(_HEAD | {"choices": [_choice(True, "@@", [987654])]}, separators=(",", ":"))
    return "data: " + good.replace("@@", text, 1).replace("987654", ids, 1) + "\n\n"


_PRE, _MIDDLE, _POST = _plain_bytes("@", "1").split("@")[0], '"},"logprobs":null,"finish_reason":null,"token_ids":[', "]}]}\n\n"
_BROKEN = {
    # A text ending in a bare backslash swallows the quote after it, and one with a bare quote
    # splits in two: together they decode as as many texts as there are events.
    "two_broken_texts": [_plain_bytes(t, i) for t, i in [(" a", "1"), ("b\\", "2"), (',"c', "3"), (" e", "4")]],
    # An event holding the template's fixed bytes twice, and one holding them but once: cut at
    # those bytes, they give two texts and two id lists that decode.
    "fixed_bytes_out_of_place": [_plain_bytes(" a", "1"), _plain_bytes("x", "5" + _MIDDLE + "y"), _PRE + "7" + _POST,
                                 _plain_bytes(" e", "9")],
}


@pytest.mark.parametrize("case", sorted(_BROKEN))
def test_events_that_only_look_plain_in_bulk_are_read_whole(case: str) -> None:
    # Read whole, no broken event is JSON: each reaches the client as sent and the ledger
    # counts none of them.
    body = "".join(_BROKEN[case]).encode()
    bulk, bulk_piece = _stream(CHAT_ROUTE, False)
    whole, whole_piece = _stream(CHAT_ROUTE, False)
    whole._learn_tries = _LEARN_TRIES
    assert _relay(bulk, bulk_piece, body, []) == _relay(whole, whole_piece, body, [])
    assert _ledger_view(bulk._ledger) == _ledger_view(whole._ledger)
    assert bulk._ledger.generated[0] == 1 and bulk._ledger.delivered_text.startswith(" a")


def test_a_plain_stream_is_read_in_bulk() -> None:
    # The fast path is taken (else the contract above holds trivially): a template is learned
    # from the first plain event and the rest match it.
    reader = PlainReader(_stream(CHAT_ROUTE, False)[0]._ctx.plan.api, keep_ids=False)
    events = [_HEAD | {"choices": [_choice(True, f" w{i}", [100 + i])]} for i in range(50)]
    raws = [b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events]
    assert plain(events[0], reader._api)
    reader.learn(raws[0], events[0])
    # by its fixed bytes alone (no expression), and by the expression when the heads vary
    assert reader._split_fixed(b"".join(raws)) is not None
    [part] = list(reader.split(b"".join(raws)))
    assert not isinstance(part, bytes)
    assert part.ids == list(range(100, 150)) and "".join(part.texts) == "".join(f" w{i}" for i in range(50))
    assert b"token_ids" not in part.client and json.loads(part.client.split(b"\n\n")[7][6:]) == {
        **_HEAD, "choices": [{"index": 0, "delta": {"content": " w7"}, "logprobs": None, "finish_reason": None}]}
