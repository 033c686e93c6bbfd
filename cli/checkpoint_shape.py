"""A model's shape for the admin API (ModelUpsert's fields), read from its checkpoint.

Placement sizes a model from params_b, layers, kv_heads and head_dim; a Hugging Face
checkpoint already says them: `config.json` (num_hidden_layers, num_key_value_heads,
head_dim or hidden_size / num_attention_heads, max_position_embeddings, torch_dtype) and
its safetensors headers (every tensor's shape: the exact parameter count). Reading them
saves the operator hand-copying four numbers that must match the weights.

From a directory the files are read as they are; from a weight URI (file://, s3://, gs://,
https://, through data_plane.weights.origins) only `config.json`, the safetensors index and
each safetensors file's header (two ranged reads) are fetched, never the weights. Without
safetensors the parameter count is estimated from the config (a Llama-style decoder).
"""

from __future__ import annotations

import asyncio
import json
import math
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from data_plane.weights.origins import WeightOrigin

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# A safetensors header larger than this is not one (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024

_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8"}
_QUANT_METHODS = {"awq": "awq", "gptq": "gptq", "fp8": "fp8"}


class CheckpointShapeError(ValueError):
    """The checkpoint does not say its shape (no config.json, a key missing, a bad header)."""


def shape_fields(config: dict[str, Any], param_count: int | None) -> dict[str, Any]:
    """ModelUpsert fields from a config.json and the weights' parameter count (None: estimate it)."""
    text = config.get("text_config") if "num_hidden_layers" not in config else None
    c = text if isinstance(text, dict) else config

    def need(key: str) -> int:
        value = c.get(key)
        if not isinstance(value, int) or value <= 0:
            raise CheckpointShapeError(f"config.json has no positive integer {key!r}")
        return value

    layers, heads, hidden = need("num_hidden_layers"), need("num_attention_heads"), need("hidden_size")
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or hidden // heads
    fields: dict[str, Any] = {
        "params_b": (param_count or _estimated_params(c, hidden, layers, heads, kv_heads, head_dim)) / 1e9,
        "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
        "attention_heads": heads, "hidden_size": hidden,
    }
    if isinstance(c.get("max_position_embeddings"), int):
        fields["max_context"] = c["max_position_embeddings"]
    quant = config.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    dtype = config.get("torch_dtype") or c.get("torch_dtype")
    if method in _QUANT_METHODS:
        fields["quantization"] = _QUANT_METHODS[method]
    elif dtype in _DTYPES:
        fields["quantization"] = _DTYPES[dtype]
    return fields


def _estimated_params(c: dict[str, Any], hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """A Llama-style decoder's parameter count from its config (used without safetensors)."""
    vocab = int(c.get("vocab_size") or 32000)
    inter = int(c.get("intermediate_size") or 4 * hidden)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings") else 2)
    return layers * per_layer + embeddings + hidden


def params_in_header(header: dict[str, Any], where: str) -> int:
    """Elements of every tensor a safetensors header lists."""
    try:
        return sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    except (TypeError, KeyError) as e:
        raise CheckpointShapeError(f"{where}: not a safetensors header ({e})") from None


def _header_length(prefix: bytes, where: str) -> int:
    if len(prefix) != 8:
        raise CheckpointShapeError(f"{where}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", prefix)
    if not 2 <= n <= MAX_HEADER_BYTES:
        raise CheckpointShapeError(f"{where}: not a safetensors file (header length {n})")
    return int(n)


def _parse_json(data: bytes, where: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as e:
        raise CheckpointShapeError(f"{where}: not JSON ({e})") from None


# --- from a directory ----------------------------------------------------------------------


def shape_from_dir(path: Path) -> dict[str, Any]:
    """ModelUpsert fields of the checkpoint in directory `path`."""
    if not path.is_dir():
        raise CheckpointShapeError(f"{path} is not a directory")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointShapeError(f"{path} has no config.json: not a model checkpoint")
    config = _parse_json(config_path.read_bytes(), str(config_path))
    files = sorted(path.glob("*.safetensors"))
    total = 0
    for f in files:
        with f.open("rb") as fh:
            n = _header_length(fh.read(8), str(f))
            total += params_in_header(_parse_json(fh.read(n), str(f)), str(f))
    return shape_fields(config, total or None)


# --- from a weight origin -------------------------------------------------------------------


def shape_from_uri(uri: str) -> dict[str, Any]:
    """ModelUpsert fields of the checkpoint at a weight URI (config and headers only)."""
    from data_plane.weights.origins import OriginError, OriginNotFound, open_origin
    from meridian.settings.node import WeightSettings

    async def run() -> dict[str, Any]:
        origin = open_origin(uri, WeightSettings())
        try:
            config = _parse_json(await origin.read("config.json"), f"{uri}/config.json")
            names = await _safetensors_names(origin, uri)
            total = 0
            for name in names:
                where = f"{uri}/{name}"
                n = _header_length(await origin.read_range(name, 0, 8), where)
                total += params_in_header(_parse_json(await origin.read_range(name, 8, 8 + n), where), where)
            return shape_fields(config, total or None)
        finally:
            await origin.aclose()

    try:
        return asyncio.run(run())
    except OriginNotFound as e:
        raise CheckpointShapeError(f"{uri}: {e} (is config.json there?)") from None
    except OriginError as e:
        raise CheckpointShapeError(f"{uri}: {e}") from None


async def _safetensors_names(origin: WeightOrigin, uri: str) -> list[str]:
    """The index's files, or the single model.safetensors, or none."""
    from data_plane.weights.origins import OriginNotFound

    try:
        index = _parse_json(await origin.read(INDEX_NAME), f"{uri}/{INDEX_NAME}")
    except OriginNotFound:
        try:
            await origin.size(SINGLE_NAME)
        except OriginNotFound:
            return []
        return [SINGLE_NAME]
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointShapeError(f"{uri}/{INDEX_NAME} has no weight_map")
    return sorted({str(v) for v in weight_map.values()})
