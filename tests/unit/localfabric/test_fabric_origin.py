"""The local fabric pushes its checkpoint to its file:// origin once, and again only when the
directory's files changed (another checkpoint under the same name): origin_holds against a
real push by `push_model`."""

from __future__ import annotations

import asyncio
from pathlib import Path

from data_plane.model.make_tiny import make_tiny_checkpoint
from data_plane.weights.push import push_model
from localfabric.checkpoint import origin_holds
from meridian.settings.node import WeightSettings


def _push(model_dir: Path, origin: Path) -> None:
    asyncio.run(push_model(model_dir, f"file://{origin}", WeightSettings()))


def test_a_fresh_push_is_held_and_a_changed_directory_is_not(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "m", seed=1)
    (ckpt / ".cache").mkdir()
    (ckpt / ".cache" / "lock").write_text("hidden files are not pushed")
    origin = tmp_path / "origin" / "m"
    assert not origin_holds(origin, ckpt)  # nothing pushed yet
    _push(ckpt, origin)
    assert origin_holds(origin, ckpt)
    (ckpt / "generation_config.json").write_text("{}")  # a file added
    assert not origin_holds(origin, ckpt)
    _push(ckpt, origin)
    assert origin_holds(origin, ckpt)


def test_another_checkpoint_under_the_same_name_is_pushed_again(tmp_path):
    small = make_tiny_checkpoint(tmp_path / "a" / "m", seed=1)
    origin = tmp_path / "origin" / "m"
    _push(small, origin)
    other = tmp_path / "b" / "m"
    other.mkdir(parents=True)
    for f in small.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    with open(other / "model.safetensors", "ab") as f:
        f.write(b"\0" * 64)  # same names, another size
    assert not origin_holds(origin, other)


def test_a_kept_origin_without_its_source_is_reused_and_a_broken_manifest_is_not(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "m", seed=1)
    origin = tmp_path / "origin" / "m"
    _push(ckpt, origin)
    assert origin_holds(origin, tmp_path / "gone")
    (origin / "meridian-manifest.json").write_text("{not json")
    assert not origin_holds(origin, ckpt)
