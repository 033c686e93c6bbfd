"""Inputs are checked before any work: `node run --model-dir` (exists, is a checkpoint),
`model push` (checkpoint, URI scheme, residency zone), `model import-gguf` (a GGUF it can
convert); one red line and exit 2, no traceback, nothing written. A push that passes the checks
lands, and the cache lists it in human-readable sizes; an import writes a checkpoint."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q
from gguf_files import write_gguf
from typer.testing import CliRunner

from cli.main import app
from data_plane.model.make_tiny import TinyArch, make_tiny_checkpoint
from meridian.tokenizer import ChatTokenizer

runner = CliRunner()
NODE_ENV = {"MERIDIAN_CLUSTER_TOKEN": "a-long-enough-cluster-token-for-tests-0123456789"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", seed=0)


def one_red_line(r, code: int = 2) -> str:
    assert r.exit_code == code, r.output
    assert "Traceback" not in r.output and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_node_run_refuses_a_missing_model_dir_before_starting():
    line = one_red_line(runner.invoke(app, ["node", "run", "--model-dir", "/nonexistent"], env=NODE_ENV))
    assert line == "--model-dir /nonexistent does not exist"


def test_node_run_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
    line = one_red_line(runner.invoke(app, ["node", "run", "--model-dir", str(tmp_path)], env=NODE_ENV))
    assert line.endswith("has no config.json: not a model checkpoint")
    (tmp_path / "file").write_text("x")
    line = one_red_line(runner.invoke(app, ["node", "run", "--model-dir", str(tmp_path / "file")], env=NODE_ENV))
    assert line.endswith("is not a directory")


def test_node_run_needs_a_model(monkeypatch):
    monkeypatch.delenv("MERIDIAN_NODE_MODEL_DIR", raising=False)
    monkeypatch.delenv("MERIDIAN_NODE_MODEL_URI", raising=False)
    line = one_red_line(runner.invoke(app, ["node", "run"], env=NODE_ENV))
    assert line == "a node needs --model-dir or --model-uri"


def test_node_run_checks_the_model_dir_from_the_environment_too():
    r = runner.invoke(app, ["node", "run"], env={**NODE_ENV, "MERIDIAN_NODE_MODEL_DIR": "/nonexistent"})
    assert one_red_line(r) == "--model-dir /nonexistent does not exist"


def test_model_push_refuses_an_unknown_zone_before_any_work(checkpoint, tmp_path):
    origin = tmp_path / "origin"
    line = one_red_line(runner.invoke(app, ["model", "push", str(checkpoint), f"file://{origin}", "--zone", "mars"]))
    assert line.startswith("unknown zone 'mars'; known: ") and "eu" in line and "global" in line
    assert not origin.exists()


@pytest.mark.parametrize(("uri", "why"), [
    ("ftp://host/dir", "the URI must start with one of file://, gs://, s3://"),
    ("https://example.com/w", "the URI must start with one of"),
    ("bucket/prefix", "the URI must start with one of"),
])
def test_model_push_refuses_a_uri_it_cannot_write(checkpoint, uri, why):
    line = one_red_line(runner.invoke(app, ["model", "push", str(checkpoint), uri]))
    assert line.startswith(f"cannot push to {uri!r}") and why in line


def test_model_push_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
    line = one_red_line(runner.invoke(app, ["model", "push", str(tmp_path), f"file://{tmp_path}/o"]))
    assert line.endswith("has no config.json: not a model checkpoint")
    line = one_red_line(runner.invoke(app, ["model", "push", str(tmp_path / "nope"), f"file://{tmp_path}/o"]))
    assert line.endswith("is not a directory")


def test_a_checked_push_lands_and_the_cache_lists_it_in_human_sizes(checkpoint, tmp_path):
    origin, cache = tmp_path / "origin", tmp_path / "cache"
    r = runner.invoke(app, ["model", "push", str(checkpoint), f"file://{origin}", "--zone", "eu"],
                      env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert re.search(r"\d+\.\d (KiB|MiB)", r.stdout) and (origin / "meridian-manifest.json").exists()
    r = runner.invoke(app, ["model", "pull", f"file://{origin}", "--cache-dir", str(cache)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["model", "cache", "--cache-dir", str(cache)], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    size = sum(p.stat().st_size for p in checkpoint.iterdir() if p.is_file())
    assert "…" not in r.stdout and "tiny-llama" in r.stdout and "eu" in r.stdout
    assert re.search(r"\d+\.\d (KiB|MiB) used", r.stdout) and str(size) not in r.stdout


def test_node_run_refuses_a_uri_no_origin_reads():
    line = one_red_line(runner.invoke(app, ["node", "run", "--model-uri", "ftp://host/m"], env=NODE_ENV))
    assert line.startswith("--model-uri 'ftp://host/m': the URI must start with one of") and "s3://" in line


@pytest.fixture(scope="module")
def gguf_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint whose rows divide into quantization blocks, to write GGUFs from."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("src") / "tiny", seed=2, arch=TinyArch(intermediate_size=192))


def test_a_gguf_becomes_a_checkpoint_with_a_chat_template(gguf_source: Path, tmp_path: Path) -> None:
    gguf_path = write_gguf(gguf_source, tmp_path / "m.gguf", Q.Q8_0)
    r = runner.invoke(app, ["model", "import-gguf", str(gguf_path), str(tmp_path / "out")], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert f"wrote checkpoint {tmp_path / 'out'}" in r.stdout
    messages = [{"role": "user", "content": "Hi"}]
    assert ChatTokenizer.from_dir(tmp_path / "out").render_chat(messages) == ChatTokenizer.from_dir(gguf_source).render_chat(
        messages)


def test_another_architecture_is_one_red_line_and_nothing_written(gguf_source: Path, tmp_path: Path) -> None:
    gguf_path = write_gguf(gguf_source, tmp_path / "m.gguf", arch="qwen2")
    line = one_red_line(runner.invoke(app, ["model", "import-gguf", str(gguf_path), str(tmp_path / "out")],
                                       env={"COLUMNS": "80"}))
    assert line == "architecture 'qwen2' cannot be imported (only llama)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_a_missing_file_isone_red_line(tmp_path: Path) -> None:
    line = one_red_line(runner.invoke(app, ["model", "import-gguf", str(tmp_path / "nope.gguf"), str(tmp_path / "o")]))
    assert line == f"{tmp_path / 'nope.gguf'}: no such file"


def test_a_non_empty_directory_is_kept(gguf_source: Path, tmp_path: Path) -> None:
    gguf_path = write_gguf(gguf_source, tmp_path / "m.gguf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    line = one_red_line(runner.invoke(app, ["model", "import-gguf", str(gguf_path), str(tmp_path / "out")],
                                       env={"COLUMNS": "200"}), code=1)
    assert line.endswith("exists and is not empty; pass --overwrite to replace it")
