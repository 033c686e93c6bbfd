"""A stand-in node that generates real token ids, for stream-migration tests.

Its "model" is deterministic in the token ids it is given: the next token is a function
of the sequence so far (prompt plus generated), so a continuation sent prompt + generated
ids yields exactly what an unbroken run would, as a greedy engine does. Tokens are single
printable ASCII characters (id = code - 32), events carry vLLM's `return_token_ids` fields,
text is held back for stop strings as engines do (meridian.stop_strings), and `/detokenize`
answers like vLLM's. Knobs make the next stream die, stall or send an error event after a
given number of generated tokens: what a SIGKILL, a SIGSTOP or an engine fault looks like
from the router.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from geo_router.forwarding.migration.tool_calls import PythonicStream
from meridian.stop_strings import StopStringMatcher

_ALPHABET = "abcdefghijklmnopqrstuvwxyz    "
EOS = 95  # decodes to nothing, as a skipped special token


def encode(text: str) -> list[int]:
    return [ord(c) - 32 if 32 <= ord(c) < 127 else ord("?") - 32 for c in text]


def decode(ids: list[int]) -> str:
    return "".join(chr(i + 32) for i in ids if i != EOS)


def scripted(seq: list[int], script: list[int]) -> int:
    """The script's next token: it continues from the longest suffix of `seq` that begins
    the script (so a continuation primed with part of it writes the rest), then EOS."""
    for k in range(min(len(seq), len(script)), 0, -1):
        if seq[-k:] == script[:k]:
            return script[k] if k < len(script) else EOS
    return script[0]


def next_token(seq: list[int], seed: int | None) -> int:
    """The model: greedy without a seed, seeded sampling with one; a function of `seq` only."""
    if seed is None:
        a, b = (seq[-1] if seq else 0), (seq[-2] if len(seq) > 1 else 0)
        return encode(_ALPHABET[(7 * a + 13 * b + 3 * len(seq)) % len(_ALPHABET)])[0]
    return encode(random.Random(f"{seed}:{len(seq)}:{seq[-3:]}").choice(_ALPHABET))[0]


def chat_prompt(messages: list[dict[str, Any]]) -> list[int]:
    return encode("".join(f"<{m['role']}>{_content(m.get('content'))}" for m in messages) + "<assistant>")


def _content(content: Any) -> str:
    if isinstance(content, list):  # text parts, joined as vLLM's string content format does
        return "\n".join(p["text"] for p in content)
    return content or ""


@dataclass
class Fault:
    """What the next stream does after `after` generated tokens: die, stall or error."""

    kind: str  # "die" | "stall" | "error"
    after: int


@dataclass
class TokenNode:
    name: str
    faults: list[Fault] = field(default_factory=list)  # consumed one per stream, in order
    requests: list[dict[str, Any]] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    # Set when one of its streams freezes (a "stall" fault begins): tests order on it, not on sleeps.
    stalled: asyncio.Event = field(default_factory=asyncio.Event)
    # A non-streamed answer dies after this many tokens (the connection closes, no status).
    die_whole: bool = False
    # What its /detokenize makes of a text: another tokenizer than the other nodes'.
    detokenize_as: Callable[[str], str] | None = None


def token_node_app(node: TokenNode) -> FastAPI:
    app = FastAPI()

    async def generate(request: Request) -> Response:
        body = await request.json()
        node.requests.append({"path": request.url.path, **body})
        chat = request.url.path.endswith("/chat/completions")
        prompt = chat_prompt(body["messages"]) if chat else _prompt_ids(body["prompt"])
        fault = node.faults.pop(0) if node.faults and body.get("stream") else None
        if not body.get("stream"):
            if node.die_whole:
                raise RuntimeError("node killed while generating")
            ids, text, reason = _generate_all(body, prompt)
            return JSONResponse(_whole(body, chat, prompt, ids, text, reason))
        return StreamingResponse(_stream(node, body, chat, prompt, fault), media_type="text/event-stream")

    async def detokenize(request: Request) -> Response:
        body = await request.json()
        text = decode(body["tokens"])
        return JSONResponse({"prompt": node.detokenize_as(text) if node.detokenize_as else text})

    async def responses(request: Request) -> Response:
        # No Responses API here (as on the torch engine): the request is only recorded, so
        # tests see which Responses requests reached a node as they were sent.
        node.requests.append({"path": request.url.path, **(await request.json())})
        return JSONResponse({"error": {"message": "no Responses API here", "type": "invalid_request_error",
                                       "code": None}}, status_code=404)

    app.post("/v1/chat/completions")(generate)
    app.post("/v1/responses")(responses)
    app.post("/v1/completions")(generate)
    app.post("/detokenize")(detokenize)
    return app


def _prompt_ids(prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        return encode(prompt)
    return [int(t) for t in prompt]


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    return [stop] if isinstance(stop, str) else list(stop or [])


def _generate_all(body: dict[str, Any], prompt: list[int]) -> tuple[list[int], str, str]:
    ids: list[int] = []
    text = ""
    matcher = StopStringMatcher(_stops(body))
    for _ in range(body.get("max_tokens") or 64):
        token = next_token(prompt + ids, body.get("seed") if body.get("temperature") else None)
        ids.append(token)
        emit, stopped = matcher.feed(decode([token]))
        text += emit
        if stopped:
            return ids, text, "stop"
    return ids, text + matcher.flush(), "length"


def _whole(body: dict[str, Any], chat: bool, prompt: list[int], ids: list[int], text: str,
           reason: str) -> dict[str, Any]:
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
    if chat:
        return {"id": "chatcmpl-w", "object": "chat.completion", "created": 1, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": reason}], "usage": usage}
    return {"id": "cmpl-w", "object": "text_completion", "created": 1, "model": body["model"],
            "choices": [{"index": 0, "text": text, "finish_reason": reason}], "usage": usage}


async def _stream(node: TokenNode, body: dict[str, Any], chat: bool, prompt: list[int],
                  fault: Fault | None) -> AsyncIterator[str]:
    ids_on = body.get("return_token_ids") is True
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{node.name}-{len(node.requests)}"
    head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": 1700000000,
            "model": body["model"]}
    seed = body.get("seed") if body.get("temperature") else None
    script = encode(str((body.get("vllm_xargs") or {}).get("script") or "")) or None
    parser = _ToolParser(chat and bool(body.get("tools")) and body.get("tool_choice") in (None, "auto"),
                         parallel=body.get("parallel_tool_calls") is not False)
    matcher = StopStringMatcher(_stops(body))
    if chat:
        first: dict[str, Any] = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}]}
        if ids_on:
            first["prompt_token_ids"] = prompt
        yield _sse(first)
    ids: list[int] = []
    max_tokens = body.get("max_tokens") or 64
    for n in range(max_tokens):
        if fault is not None and n == fault.after:
            async for line in _fail(node, fault):
                yield line
        token = scripted(prompt + ids, script) if script else next_token(prompt + ids, seed)
        ids.append(token)
        emit, stopped = matcher.feed(decode([token]))
        reason = "stop" if stopped or token == EOS else ("length" if n == max_tokens - 1 else None)
        if reason is not None:
            emit += matcher.flush() if not stopped else ""
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason}
        if chat:
            choice["delta"] = parser.delta(emit)
            if reason == "stop" and parser.called:
                choice["finish_reason"] = "tool_calls"
        else:
            choice["text"] = emit
            if n == 0 and ids_on:
                choice["prompt_token_ids"] = prompt
        if ids_on:
            choice["token_ids"] = [token]
        yield _sse({**head, "choices": [choice]})
        await asyncio.sleep(0)
        if reason is not None:
            break
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
        yield _sse({**head, "choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


class _ToolParser:
    """vLLM's pythonic parser in a chat stream with tools: a text that starts with `[` is
    tool calls, anything else content; without parallel calls only the first is sent."""

    def __init__(self, on: bool, parallel: bool) -> None:
        self.on, self.parallel, self.text, self.called = on, parallel, "", False
        self._stream = PythonicStream([])

    def delta(self, emit: str) -> dict[str, Any]:
        self.text += emit
        if not self.on or not self.text.startswith("["):
            return {"content": emit} if emit else {}
        message = self._stream.feed(self.text) or {}
        self.called = self.called or bool(message.get("tool_calls"))
        if message.get("tool_calls") and not self.parallel:
            message["tool_calls"] = [c for c in message["tool_calls"] if c["index"] == 0]
        return message


async def _fail(node: TokenNode, fault: Fault) -> AsyncIterator[str]:
    if fault.kind == "die":
        raise RuntimeError("node killed mid-stream")
    if fault.kind == "error":
        yield _sse({"error": {"message": "engine fault", "type": "server_error", "code": None}})
        await node.release.wait()
    if fault.kind == "stall":
        node.stalled.set()
        await node.release.wait()  # frozen: the connection stays open, nothing comes


def _sse(event: dict[str, Any]) -> str:
    return f"data: {json.dumps(event)}\n\n"
