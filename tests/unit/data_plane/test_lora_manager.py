"""LoRA residency: on-demand loading, LRU eviction, pinning by running requests, capacity."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from data_plane.lora import (
    LoraCapacityError,
    LoraConfigError,
    LoraManager,
    LoraRankError,
    UnknownLoraError,
)
from data_plane.lora.make_tiny import make_tiny_lora
from data_plane.model.llama import LlamaConfig
from meridian.settings.node import NodeSettings


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Template adapters a, b, c, d (different seeds, rank 4) in one directory."""
    root = tmp_path_factory.mktemp("loras")
    for seed, name in enumerate("abcd"):
        make_tiny_lora(tiny_checkpoint, root / name, seed=seed, rank=4)
    return root


@pytest.fixture
def lora_dir(adapters: Path, tmp_path: Path) -> Path:
    """A fresh copy per test, so tests may add, break or delete adapters."""
    return Path(shutil.copytree(adapters, tmp_path / "loras"))


def manager(base: LlamaConfig, lora_dir: Path, *, dtype: torch.dtype = torch.float32) -> LoraManager:
    return LoraManager(base, lora_dir=lora_dir, max_loras=2, max_lora_rank=8, dtype=dtype)


def test_names_are_configured_modules_and_adapter_directories(
    base: LlamaConfig, lora_dir: Path, tmp_path: Path
) -> None:
    (lora_dir / "not-an-adapter").mkdir()
    shutil.copytree(lora_dir / "a", lora_dir / ".a.tmp-123")  # a writer's temp dir
    extra = Path(shutil.copytree(lora_dir / "a", tmp_path / "elsewhere"))
    m = LoraManager(base, modules={"extra": extra}, lora_dir=lora_dir, max_loras=2, max_lora_rank=8)
    assert m.names() == ["a", "b", "c", "d", "extra"]
    assert "extra" in m and "b" in m
    assert "not-an-adapter" not in m and ".a.tmp-123" not in m
    assert m.resident() == ()


def test_adapters_added_to_the_directory_are_found_without_a_restart(
    base: LlamaConfig, lora_dir: Path
) -> None:
    m = manager(base, lora_dir)
    assert "e" not in m.names()
    shutil.copytree(lora_dir / "a", lora_dir / "e")
    assert "e" in m.names()
    m.acquire("e")
    assert m.resident() == ("e",)


def test_acquire_loads_once_and_pins(base: LlamaConfig, lora_dir: Path) -> None:
    m = manager(base, lora_dir, dtype=torch.float64)
    slot = m.acquire("a")
    adapter = m.adapter(slot)
    assert adapter.name == "a"
    assert next(iter(adapter.weights.values())).a.dtype == torch.float64
    assert m.acquire("a") == slot
    assert m.adapter(slot) is adapter  # not loaded again
    assert m.pinned() == ("a",)
    m.release("a")
    assert m.pinned() == ("a",)  # still held by the second acquire
    m.release("a")
    assert m.pinned() == ()
    assert m.resident() == ("a",)  # unpinned adapters stay loaded until evicted
    with pytest.raises(ValueError, match="not acquired"):
        m.release("a")


def test_evicts_the_least_recently_used_unpinned_adapter(base: LlamaConfig, lora_dir: Path) -> None:
    m = manager(base, lora_dir)
    slot_a = m.acquire("a")
    m.release("a")
    slot_b = m.acquire("b")
    m.release("b")
    assert slot_a != slot_b
    m.acquire("a")  # a becomes the most recently used
    m.release("a")
    assert m.resident() == ("b", "a")
    slot_c = m.acquire("c")
    assert m.resident() == ("a", "c")
    assert slot_c == slot_b  # c took b's slot
    assert m.slot_of("b") is None
    assert m.adapter(slot_a).name == "a"


def test_pinned_adapters_are_never_evicted(base: LlamaConfig, lora_dir: Path) -> None:
    m = manager(base, lora_dir)
    slot_a, slot_b = m.acquire("a"), m.acquire("b")
    assert not m.can_acquire("c")
    with pytest.raises(LoraCapacityError):
        m.acquire("c")
    assert m.resident() == ("a", "b")
    assert (m.slot_of("a"), m.slot_of("b")) == (slot_a, slot_b)
    # An adapter already resident can still be shared by another request.
    assert m.can_acquire("a")
    m.acquire("a")
    m.release("a")

    m.release("b")
    assert m.can_acquire("c")
    assert m.acquire("c") == slot_b
    assert m.resident() == ("a", "c")
    assert m.adapter(slot_a).name == "a"


def test_can_acquire_has_no_side_effects(base: LlamaConfig, lora_dir: Path) -> None:
    m = manager(base, lora_dir)
    for name in ("a", "b"):
        m.acquire(name)
        m.release(name)
    for name in ("a", "c", "zzz"):
        m.can_acquire(name)
    assert m.resident() == ("a", "b")  # order untouched: can_acquire("a") is not a use
    assert m.pinned() == ()
    m.acquire("c")
    assert m.resident() == ("b", "c")


def test_unknown_names(base: LlamaConfig, lora_dir: Path) -> None:
    m = manager(base, lora_dir)
    for name in ("zzz", "../loras/a", ".", "", "a/"):
        assert not m.can_acquire(name)
        assert name not in m
        with pytest.raises(UnknownLoraError):
            m.acquire(name)
    assert m.resident() == ()


def test_a_bad_adapter_does_not_poison_the_cache(base: LlamaConfig, lora_dir: Path) -> None:
    shutil.copytree(lora_dir / "a", lora_dir / "bad")
    config_file = lora_dir / "bad" / "adapter_config.json"
    good_config = config_file.read_text()
    config_file.write_text(json.dumps({**json.loads(good_config), "bias": "all"}))

    m = manager(base, lora_dir)
    for name in ("a", "b"):
        m.acquire(name)
        m.release(name)
    assert m.can_acquire("bad")  # a slot can be made; the files are only read by acquire
    with pytest.raises(LoraConfigError):
        m.acquire("bad")
    assert m.resident() == ("a", "b")  # nothing evicted for it
    with pytest.raises(LoraConfigError):
        m.acquire("bad")  # the failure was not cached either way: the files are read again

    config_file.write_text(good_config)
    slot = m.acquire("bad")
    assert m.adapter(slot).name == "bad"
    assert m.resident() == ("b", "bad")


def test_rank_above_the_node_limit_is_refused_on_acquire(
    base: LlamaConfig, tiny_checkpoint: Path, lora_dir: Path
) -> None:
    make_tiny_lora(tiny_checkpoint, lora_dir / "big", seed=9, rank=16)
    m = manager(base, lora_dir)
    assert "big" in m.names()
    with pytest.raises(LoraRankError):
        m.acquire("big")
    assert m.resident() == ()


def test_resident_adapter_survives_removal_of_its_files(base: LlamaConfig, lora_dir: Path) -> None:
    m = manager(base, lora_dir)
    slot = m.acquire("a")
    shutil.rmtree(lora_dir / "a")
    assert m.acquire("a") == slot
    m.release("a")
    m.release("a")
    m.evict("a")
    assert m.resident() == ()
    with pytest.raises(UnknownLoraError):
        m.acquire("a")


def test_evict_refuses_a_pinned_adapter(base: LlamaConfig, lora_dir: Path) -> None:
    m = manager(base, lora_dir)
    m.acquire("a")
    with pytest.raises(ValueError, match="in use"):
        m.evict("a")
    assert m.resident() == ("a",)


def test_empty_slots_hold_no_adapter(base: LlamaConfig, lora_dir: Path) -> None:
    m = manager(base, lora_dir)
    m.acquire("a")
    for slot in (-1, 1, 2):
        with pytest.raises(ValueError, match="holds no adapter"):
            m.adapter(slot)


def test_from_settings(base: LlamaConfig, tiny_checkpoint: Path, lora_dir: Path) -> None:
    settings = NodeSettings(
        model_dir=tiny_checkpoint,
        control_plane_url=None,
        lora_modules={"first": lora_dir / "a"},
        lora_dir=lora_dir,
        max_loras=3,
        max_lora_rank=4,
    )
    m = LoraManager.from_settings(settings, base, dtype=torch.bfloat16)
    assert (m.max_loras, m.max_lora_rank) == (3, 4)
    assert m.names() == ["a", "b", "c", "d", "first"]
    adapter = m.adapter(m.acquire("first"))
    assert adapter.path == lora_dir / "a"
    assert next(iter(adapter.weights.values())).b.dtype == torch.bfloat16
