"""Triton's vLLM-backend tensor convention, read from and written to KServe v2 messages.

A generation request names the model and carries the inputs of Triton's vLLM backend
(triton-inference-server/vllm_backend, its model.json's inputs):

- `text_input` BYTES [1]: the prompt;
- `stream` BOOL [1] (optional): one response per new piece of text (ModelStreamInfer);
- `sampling_parameters` BYTES [1] (optional): vLLM's SamplingParams as a JSON object, its
  values as numbers or as the strings Triton's parameters carry; without it, the request's
  `parameters` map is read the same way;
- `exclude_input_in_output` BOOL [1] (optional): whether `text_output` leaves the prompt
  out; by default a non-streamed answer starts with the prompt, as the backend's does, and a
  streamed one may not include it (the backend refuses that too);
- `return_finish_reason`, `return_num_input_tokens`, `return_num_output_tokens` BOOL [1]
  (optional): the extra outputs of the same names.

It becomes a /v1/completions request (`completion_body`) for the router's pipeline; the
answer's text becomes `text_output` BYTES [1]. Tensors come as `raw_input_contents`
(tritonclient's way: a BYTES element is a 4-byte little-endian length and its bytes, a
BOOL one byte) or as typed `contents`. Anything malformed is an InvalidInput naming the
tensor, which the service answers INVALID_ARGUMENT. Pure: no I/O.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import msgspec

from . import kserve_v2_pb2 as pb

INPUTS = (("text_input", "BYTES"), ("stream", "BOOL"), ("sampling_parameters", "BYTES"),
          ("exclude_input_in_output", "BOOL"), ("return_finish_reason", "BOOL"),
          ("return_num_input_tokens", "BOOL"), ("return_num_output_tokens", "BOOL"))
OUTPUTS = (("text_output", "BYTES"), ("finish_reason", "BYTES"), ("num_input_tokens", "UINT32"),
           ("num_output_tokens", "UINT32"))
_OPTIONAL = frozenset(n for n, _ in INPUTS) - {"text_input"}
_DATATYPES = dict(INPUTS)
_ENCODE = msgspec.json.Encoder()
_DECODE = msgspec.json.Decoder()
# SamplingParams fields a /v1/completions request takes under the same name, by type.
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INTS = ("top_k", "seed", "max_tokens", "min_tokens", "n", "logprobs")
_BOOLS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "spaces_between_special_tokens")
_LISTS = ("stop", "stop_token_ids")
# The request parameters Triton itself reads (never sampling parameters).
_TRITON = frozenset({"triton_enable_empty_final_response", "sequence_id", "sequence_start", "sequence_end",
                     "priority", "timeout", "headers"})


class InvalidInput(ValueError):
    """The request is not one this endpoint can serve; the message says why."""


@dataclass(frozen=True, slots=True)
class Generation:
    """One inference request, read: the prompt, how to answer it, and its sampling."""

    model: str
    request_id: str
    prompt: str
    stream: bool
    include_prompt: bool
    sampling: dict[str, Any]
    extras: frozenset[str]  # the extra outputs asked for (finish_reason, num_*_tokens)
    empty_final: bool  # Triton's `triton_enable_empty_final_response`


def read_request(request: pb.ModelInferRequest) -> Generation:
    """The generation `request` asks for (InvalidInput when it is not one)."""
    if not request.model_name:
        raise InvalidInput("model_name is required")
    tensors = _tensors(request)
    if "text_input" not in tensors:
        raise InvalidInput("input 'text_input' (BYTES) is required")
    unknown = sorted(set(tensors) - {n for n, _ in INPUTS})
    if unknown:
        raise InvalidInput(f"unexpected input(s) {', '.join(unknown)}: this model takes {', '.join(n for n, _ in INPUTS)}")
    prompt = _text(tensors["text_input"], "text_input")
    stream = _flag(tensors.get("stream"), "stream", False)
    exclude = tensors.get("exclude_input_in_output")
    include_prompt = not _flag(exclude, "exclude_input_in_output", stream)
    if include_prompt and stream:
        raise InvalidInput("when streaming, exclude_input_in_output = false is not allowed")
    if "sampling_parameters" in tensors:
        raw: Any = _text(tensors["sampling_parameters"], "sampling_parameters")
        try:
            raw = _DECODE.decode(raw) if raw.strip() else {}
        except msgspec.DecodeError as exc:
            raise InvalidInput(f"sampling_parameters is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise InvalidInput("sampling_parameters must be a JSON object")
    else:
        raw = {k: _parameter(v) for k, v in request.parameters.items() if k not in _TRITON}
    extras = frozenset(n[len("return_"):] for n in ("return_finish_reason", "return_num_input_tokens",
                                                     "return_num_output_tokens") if _flag(tensors.get(n), n, False))
    empty_final = _parameter(request.parameters["triton_enable_empty_final_response"]) is True \
        if "triton_enable_empty_final_response" in request.parameters else False
    return Generation(request.model_name, request.id, prompt, stream, include_prompt, sampling(raw), extras,
                      empty_final)


def sampling(raw: dict[str, Any]) -> dict[str, Any]:
    """vLLM's SamplingParams fields as /v1/completions takes them, each of its own type."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _FLOATS:
            out[key] = _number(key, value, float)
        elif key in _INTS:
            out[key] = _number(key, value, int)
        elif key in _BOOLS:
            out[key] = _boolean(key, value)
        elif key in _LISTS:
            out[key] = _list(key, value)
        else:
            raise InvalidInput(f"unknown sampling parameter '{key[:64]}'")
    if out.get("n", 1) != 1:
        raise InvalidInput("n must be 1: text_output holds one answer")
    return out


def completion_body(g: Generation) -> bytes:
    """The /v1/completions request that serves `g`."""
    body: dict[str, Any] = {**g.sampling, "model": g.model, "prompt": g.prompt, "stream": g.stream}
    if g.stream:
        body["stream_options"] = {"include_usage": True}
    return _ENCODE.encode(body)


def response(g: Generation, text: str, *, finish_reason: str | None = None, usage: dict[str, Any] | None = None,
             final: bool | None = None) -> pb.ModelInferResponse:
    """A response carrying `text` (and the extras asked for, once known)."""
    out = pb.ModelInferResponse(model_name=g.model, model_version="1", id=g.request_id)
    values: list[tuple[str, str, bytes]] = [("text_output", "BYTES", _bytes_element(text.encode()))]
    if "finish_reason" in g.extras and finish_reason is not None:
        values.append(("finish_reason", "BYTES", _bytes_element(finish_reason.encode())))
    if usage is not None:
        for name, key in (("num_input_tokens", "prompt_tokens"), ("num_output_tokens", "completion_tokens")):
            if name in g.extras and isinstance(usage.get(key), int):
                values.append((name, "UINT32", struct.pack("<I", usage[key])))
    for name, datatype, raw in values:
        out.outputs.add(name=name, datatype=datatype, shape=[1])
        out.raw_output_contents.append(raw)
    if final is not None:
        out.parameters["triton_final_response"].bool_param = final
    return out


def empty_final(g: Generation) -> pb.ModelInferResponse:
    """Triton's empty last response of a stream (asked for by triton_enable_empty_final_response)."""
    out = pb.ModelInferResponse(model_name=g.model, model_version="1", id=g.request_id)
    out.parameters["triton_final_response"].bool_param = True
    return out


def _tensors(request: pb.ModelInferRequest) -> dict[str, tuple[str, bytes | list[Any]]]:
    """Each input's (datatype, raw bytes or typed values)."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput("raw_input_contents must hold one entry per input")
    out: dict[str, tuple[str, bytes | list[Any]]] = {}
    for i, tensor in enumerate(request.inputs):
        # Each field read of a protobuf message is a call into its C code: once each.
        name, datatype = tensor.name, tensor.datatype
        if name in out:
            raise InvalidInput(f"input '{name[:64]}' is given twice")
        expected = _DATATYPES.get(name)
        if expected is not None:
            if datatype != expected:
                raise InvalidInput(f"input '{name}' must be {expected}, not {datatype[:16]}")
            if any(d != 1 for d in tensor.shape):
                raise InvalidInput(f"input '{name}' must hold one element (shape [1])")
        if raw:
            out[name] = (datatype, raw[i])
        else:
            values = tensor.contents.bytes_contents if datatype == "BYTES" else tensor.contents.bool_contents
            out[name] = (datatype, list(values))
    return out


def _text(tensor: tuple[str, bytes | list[Any]], name: str) -> str:
    _, value = tensor
    if isinstance(value, bytes):
        if len(value) < 4:
            raise InvalidInput(f"input '{name}' is not a serialized BYTES element")
        (length,) = struct.unpack_from("<I", value)
        if 4 + length != len(value):
            raise InvalidInput(f"input '{name}' must hold one element (its length prefix disagrees)")
        element = value[4:]
    else:
        if len(value) != 1:
            raise InvalidInput(f"input '{name}' must hold one element")
        element = value[0]
    try:
        return bytes(element).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInput(f"input '{name}' is not UTF-8 text") from None


def _flag(tensor: tuple[str, bytes | list[Any]] | None, name: str, default: bool) -> bool:
    if tensor is None:
        return default
    _, value = tensor
    if isinstance(value, bytes):
        if len(value) != 1:
            raise InvalidInput(f"input '{name}' must hold one BOOL element")
        return value != b"\x00"
    if len(value) != 1:
        raise InvalidInput(f"input '{name}' must hold one BOOL element")
    return bool(value[0])


def _bytes_element(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def _parameter(p: pb.InferParameter) -> Any:
    kind = p.WhichOneof("parameter_choice")
    return getattr(p, kind) if kind else None


def _number(key: str, value: Any, kind: type) -> Any:
    if isinstance(value, bool):
        raise InvalidInput(f"sampling parameter '{key}' must be a number")
    try:
        number = kind(value) if kind is float else int(str(value), 10) if isinstance(value, str) else value
    except (TypeError, ValueError):
        raise InvalidInput(f"sampling parameter '{key}' must be a number") from None
    if kind is int and not isinstance(number, int):
        raise InvalidInput(f"sampling parameter '{key}' must be an integer")
    return number


def _boolean(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise InvalidInput(f"sampling parameter '{key}' must be a boolean")


def _list(key: str, value: Any) -> Any:
    if isinstance(value, str) and key == "stop_token_ids":
        try:
            value = json.loads(value)
        except ValueError:
            raise InvalidInput(f"sampling parameter '{key}' must be a list of integers") from None
    if isinstance(value, str) and key == "stop" and value.startswith("["):
        try:
            value = json.loads(value)
        except ValueError:
            pass
    return value
