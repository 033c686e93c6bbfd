"""The official clients of the router's other protocols, as the protocol tests drive them:
`openai`'s Responses WebSocket mode and Triton's `tritonclient.grpc` (KServe v2), against a
migration rig (migration_fabric), for the torch engine's tests and vLLM's alike."""

from __future__ import annotations

import json
import queue
from typing import Any

import numpy as np
import openai
import tritonclient.grpc as triton_sync
from migration_fabric import CAROL, MigrationRig, stream, stream_response
from tenant_fabric import MODEL

HEADERS = {"authorization": f"Bearer {CAROL.key}"}
FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed", "error")


def openai_client(rig: MigrationRig, key: str = CAROL.key) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=rig.router_url + "/v1", api_key=key, max_retries=0, timeout=120)


async def turn(conn: Any, event: dict[str, Any], on_delta: Any = None) -> list[Any]:
    """Send one response.create on a Responses WebSocket; its events up to the one that ends it."""
    await conn.send({"type": "response.create", **event})
    events: list[Any] = []
    deltas = 0
    while True:
        e = await conn.recv()
        events.append(e)
        if e.type == "response.output_text.delta":
            deltas += 1
            if on_delta is not None:
                on_delta(deltas)
        if e.type in FINAL_EVENTS:
            return events


def text_of(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def as_http(event: dict[str, Any]) -> dict[str, Any]:
    """A turn's fields as `client.responses.create` takes them (vLLM's extras in extra_body)."""
    body = {k: v for k, v in event.items() if k != "ignore_eos"}
    return body | {"extra_body": {"ignore_eos": True}} if event.get("ignore_eos") else body


async def whole_conversation_text(rig: MigrationRig, first: dict[str, Any], answer: str,
                                  second: dict[str, Any]) -> str:
    """What `second` says when sent over HTTP as one self-contained request: the first
    turn's input and `answer`, then its own input."""
    history = [{"role": "user", "content": first["input"]}, {"role": "assistant", "content": answer}]
    whole = {**second, "input": [*history, {"role": "user", "content": second["input"]}]}
    return (await stream_response(rig, as_http(whole))).text


def triton_inputs(module: Any, prompt: str, sampling: dict[str, Any], *, stream: bool,
                  exclude: bool | None = None) -> list[Any]:
    """Triton's vLLM-backend inputs, for `module` (tritonclient.grpc or its aio twin)."""
    text = module.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    flag = module.InferInput("stream", [1], "BOOL")
    flag.set_data_from_numpy(np.array([stream], dtype=bool))
    params = module.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=np.object_))
    inputs = [text, flag, params]
    if exclude is not None:
        ex = module.InferInput("exclude_input_in_output", [1], "BOOL")
        ex.set_data_from_numpy(np.array([exclude], dtype=bool))
        inputs.append(ex)
    return inputs


def triton_stream(target: str, prompt: str, sampling: dict[str, Any], on_piece: Any = None) -> list[Any]:
    """start_stream + async_stream_infer with the thread-based client, as its users do
    (run it in a thread: it blocks). Returns every result up to the final one."""
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = triton_sync.InferenceServerClient(target)
    client.start_stream(callback=lambda result, error: results.put((result, error)), headers=HEADERS)
    try:
        client.async_stream_infer(MODEL, triton_inputs(triton_sync, prompt, sampling, stream=True),
                                  request_id="s1", enable_empty_final_response=True)
        got = []
        while True:
            result, error = results.get(timeout=120)
            assert error is None, error
            got.append(result)
            if on_piece is not None:
                on_piece(len(got))
            if result.get_response().parameters["triton_final_response"].bool_param:
                return got
    finally:
        client.stop_stream()
        client.close()


def triton_text(results: list[Any]) -> str:
    out = []
    for r in results:
        array = r.as_numpy("text_output")
        if array is not None:
            out.extend(x.decode() for x in array)
    return "".join(out)


async def completion_text(rig: MigrationRig, prompt: str, sampling: dict[str, Any]) -> str:
    """The streamed /v1/completions text of `prompt` over HTTP (the reference)."""
    return (await stream(rig, "/v1/completions", {"model": MODEL, "prompt": prompt, **sampling, "stream": True})).text
