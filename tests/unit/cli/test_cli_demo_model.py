"""`meridian demo --model-dir / --model-uri`: which checkpoint is served, and every option that
cannot be served refused before anything starts (one line, exit 2, no work directory)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.demo_model import DemoModel, DemoModelError, resolve_demo_model
from cli.main import app
from data_plane.model.make_tiny import make_tiny_checkpoint
from localfabric import DEMO_MODEL

runner = CliRunner()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "my-llama", seed=3)


def _demo(tmp_path: Path, *args: str) -> tuple[int, str]:
    work = tmp_path / "work"
    r = runner.invoke(app, ["demo", "--work-dir", str(work), "--port", "0", *args], env={"COLUMNS": "80"})
    assert not work.exists(), "nothing may start before the model is validated"
    return r.exit_code, r.output


def test_model_tiny_is_the_generated_tiny_model():
    assert resolve_demo_model(None, None, None, "torch", "tiny") == DemoModel(name=DEMO_MODEL)
    assert DemoModel(name=DEMO_MODEL).random_weights


def test_a_checkpoint_directory_is_served_under_its_name(checkpoint):
    m = resolve_demo_model(checkpoint, None, None, "torch")
    assert (m.name, m.model_dir, m.model_uri) == ("my-llama", checkpoint.resolve(), None)
    assert resolve_demo_model(checkpoint, None, "acme/llama-tiny", "torch").name == "acme/llama-tiny"


def test_a_file_uri_of_a_plain_checkpoint_is_a_model_dir(checkpoint):
    m = resolve_demo_model(None, f"file://{checkpoint}", None, "torch")
    assert m.model_dir == checkpoint.resolve() and m.model_uri is None


def test_a_file_uri_of_a_pushed_model_is_pulled_from_there(tmp_path):
    origin = tmp_path / "origin" / "pushed-llama"
    origin.mkdir(parents=True)
    (origin / "meridian-manifest.json").write_text("{}")
    m = resolve_demo_model(None, f"file://{origin}/", None, "torch")
    assert (m.name, m.model_uri, m.model_dir) == ("pushed-llama", f"file://{origin}/", None)


@pytest.mark.parametrize(("uri", "name"), [
    ("s3://weights-eu/models/llama-3.2-1b", "llama-3.2-1b"),
    ("gs://weights/qwen2-0.5b/", "qwen2-0.5b"),
    ("https://weights.example.com/m/mistral", "mistral"),
])
def test_remote_uris_are_named_after_their_last_segment(uri, name):
    assert resolve_demo_model(None, uri, None, "torch") == DemoModel(name=name, model_uri=uri)


@pytest.mark.parametrize(("args", "message"), [
    (["--model-dir", "/nonexistent/ckpt"], "--model-dir /nonexistent/ckpt: no such directory"),
    (["--model-uri", "ftp://host/model"], "ftp:// is not a weight store"),
    (["--model-uri", "peer://10.0.0.1:8000/abc"], "peer:// is not a weight store"),
    (["--model-uri", "/just/a/path"], "no scheme is not a weight store"),
    (["--model-uri", "s3:///no-bucket"], "no bucket or host"),
    (["--model-uri", "s3://bucket"], "give --model-name"),
    (["--model-uri", "file:///nonexistent/model"], "no such directory"),
    (["--model-dir", ".", "--model-uri", "s3://b/m"], "not both"),
    (["--model", "tiny", "--model-dir", "."], "give --model or --model-dir/--model-uri, not both"),
    (["--model", "llama-70b"], "the demo's models are smollm2, tiny"),
])
def test_unservable_options_are_one_line_and_exit_2(tmp_path, args, message):
    code, out = _demo(tmp_path, *args)
    assert code == 2, out
    assert message in out and "Traceback" not in out
    assert len(out.strip().splitlines()) == 1, out


def test_a_directory_without_config_json_is_refused(tmp_path, checkpoint):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.safetensors").write_bytes((checkpoint / "model.safetensors").read_bytes())
    code, out = _demo(tmp_path, "--model-dir", str(bare))
    assert code == 2 and "no config.json" in out and len(out.strip().splitlines()) == 1


@pytest.mark.parametrize(("remove", "message"), [
    ("model.safetensors", "no *.safetensors weights"),
    ("tokenizer.json", "no tokenizer.json"),
])
def test_a_directory_missing_weights_or_tokenizer_is_refused(tmp_path, checkpoint, remove, message):
    partial = tmp_path / "partial"
    partial.mkdir()
    for f in checkpoint.iterdir():
        if f.name != remove:
            (partial / f.name).write_bytes(f.read_bytes())
    code, out = _demo(tmp_path, "--model-dir", str(partial))
    assert code == 2 and message in out, out


def test_an_architecture_the_torch_engine_cannot_run_points_to_vllm(tmp_path, checkpoint):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    for f in checkpoint.iterdir():
        (gpt2 / f.name).write_bytes(f.read_bytes())
    config = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    code, out = _demo(tmp_path, "--model-dir", str(gpt2))
    assert code == 2 and "'gpt2' is not supported" in out and "--engine vllm" in out, out
    # vLLM runs far more architectures: the same directory passes for it.
    assert resolve_demo_model(gpt2, None, None, "vllm").name == "gpt2"


def test_a_name_clients_cannot_send_is_refused(checkpoint):
    with pytest.raises(DemoModelError, match="--model-name"):
        resolve_demo_model(checkpoint, None, "bad name!", "torch")
