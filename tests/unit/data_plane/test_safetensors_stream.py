"""Our safetensors reader: same tensors as safetensors' own loader on every path, clear errors on
malformed files, zero-copy private mappings on CPU, and shards consumed as they arrive."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file as reference_load_file
from safetensors.torch import save_file

from data_plane.model.loader import CheckpointError, load_model, safetensors_files
from data_plane.model.safetensors_stream import (
    SAFETENSORS_DTYPES,
    SafetensorsError,
    load_file,
    read_header,
    stream_tensors,
)

# Every way of reading: the CPU mapping, and the staged pipeline with roomy buffers and with
# buffers smaller than most tensors (odd size: copies split mid-element, tensors span chunks).
PATHS = {
    "mmap": {},
    "staged": {"staged": True},
    "staged-tiny-buffers": {"staged": True, "buffer_bytes": 1000, "buffers": 2, "read_threads": 3},
}


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 4).abs().to(dtype)
    return torch.randint(0, 100, shape, generator=gen).to(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe): same dtype, shape and bytes."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def write_raw(path: Path, header: dict[str, Any] | bytes = b"", data: bytes = b"", *,
              length: int | None = None, whole: bytes | None = None) -> Path:
    """A file of `header` (JSON-encoded unless bytes) and `data`, or just the bytes `whole`."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    length = len(raw) if length is None else length
    path.write_bytes(whole if whole is not None else struct.pack("<Q", length) + raw + data)
    return path


@pytest.fixture
def every_dtype(tmp_path: Path) -> Path:
    tensors = {f"{name}.{i}": sample(dtype, shape, i)
               for name, dtype in SAFETENSORS_DTYPES.items()
               for i, shape in enumerate([(), (0,), (3, 0, 2), (7, 13, 3)])}
    tensors["large"] = sample(torch.bfloat16, (513, 1031))  # ~1 MB: many chunks of 1000 bytes
    path = tmp_path / "every-dtype.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("how", PATHS)
def test_same_tensors_as_safetensors_load_file(every_dtype: Path, how: str) -> None:
    expected = reference_load_file(str(every_dtype))
    got = dict(stream_tensors([every_dtype], "cpu", **PATHS[how]))
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert same_bytes(got[name], tensor), name


def test_header_lists_tensors_in_file_order(every_dtype: Path) -> None:
    header = read_header(every_dtype)
    assert header.metadata == {"format": "pt"}
    assert header.data_start + header.data_size == every_dtype.stat().st_size
    assert [t.start for t in header.tensors] == sorted(t.start for t in header.tensors)
    large = next(t for t in header.tensors if t.name == "large")
    assert (large.dtype, large.shape, large.nbytes) == (torch.bfloat16, (513, 1031), 513 * 1031 * 2)


@pytest.mark.parametrize("how", PATHS)
def test_dtype_converts_floating_point_tensors_only(every_dtype: Path, how: str) -> None:
    expected = reference_load_file(str(every_dtype))
    got = dict(stream_tensors([every_dtype], "cpu", torch.float32, **PATHS[how]))
    for name, tensor in expected.items():
        if tensor.dtype.is_floating_point:
            assert got[name].dtype == torch.float32
            torch.testing.assert_close(got[name], tensor.to(torch.float32), equal_nan=True)
        else:
            assert same_bytes(got[name], tensor), name


def _mapping_of(path: Path) -> list[tuple[int, int, int]]:
    """(start, end, file offset) of each mapping of `path` in this process."""
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            found.append((lo, hi, int(fields[2], 16)))
    return found


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_cpu_tensors_view_a_private_mapping_of_the_file(every_dtype: Path) -> None:
    header = read_header(every_dtype)
    tensors = load_file(every_dtype)
    (lo, hi, offset), = _mapping_of(every_dtype.resolve())
    for spec in header.tensors:
        if spec.nbytes:
            # No copy: the tensor's bytes are the file's bytes at the tensor's offset.
            assert tensors[spec.name].data_ptr() == lo - offset + header.data_start + spec.start
            assert lo <= tensors[spec.name].data_ptr() < hi
    large = tensors["large"]
    del tensors
    assert _mapping_of(every_dtype.resolve()), "the mapping lives as long as a tensor does"
    del large
    assert not _mapping_of(every_dtype.resolve()), "and goes with the last one"


def test_writes_to_cpu_tensors_never_reach_the_file(every_dtype: Path) -> None:
    before = every_dtype.read_bytes()
    tensors = load_file(every_dtype)
    tensors["large"].fill_(1.5)
    tensors["F32.3"].add_(1)
    assert torch.all(tensors["large"] == 1.5)
    assert every_dtype.read_bytes() == before
    assert same_bytes(load_file(every_dtype)["large"], reference_load_file(str(every_dtype))["large"])


def _valid_file(tmp_path: Path) -> Path:
    path = tmp_path / "valid.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(3, dtype=torch.int64)}, str(path))
    return path


F32x2 = {"dtype": "F32", "shape": [2]}
MALFORMED: dict[str, tuple[dict[str, Any], str]] = {
    # name: (write_raw kwargs, the reason the error gives)
    "shorter than the length field": ({"whole": b"\x01\x02"}, "too short for the 8-byte header length"),
    "zero header length": ({"header": b"", "length": 0}, "header length 0 is too short for a JSON object"),
    "header length beyond the file": ({"header": b"{}", "length": 4096}, "runs past the end"),
    "absurd header length": ({"header": b"{}", "length": 2**63}, "exceeds the 100000000-byte limit"),
    "non-JSON header": ({"header": b"{'a': 1"}, "not valid JSON"),
    "not UTF-8": ({"header": b'{"\xff": 1}'}, "not valid UTF-8"),
    "header not an object": ({"header": b"[1, 2]"}, "JSON list, not an object"),
    "unknown dtype": ({"header": {"a": {"dtype": "F4X", "shape": [1], "data_offsets": [0, 1]}},
                       "data": b"\0"}, "unknown or unsupported dtype 'F4X'"),
    "shape/size mismatch": ({"header": {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
                             "data": bytes(8)}, "needs 12 bytes but data_offsets span 8"),
    "overlapping offsets": ({"header": {"a": {**F32x2, "data_offsets": [0, 8]},
                                        "b": {**F32x2, "data_offsets": [4, 12]}}, "data": bytes(12)},
                            "'b' data_offsets [4, 12] overlap tensor 'a'"),
    "offsets past the data": ({"header": {"a": {**F32x2, "data_offsets": [0, 8]}}, "data": bytes(5)},
                              "run past the 5-byte data section"),
    "gap between tensors": ({"header": {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                                        "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}},
                             "data": bytes(12)}, "gap of 4 bytes before tensor 'b'"),
    "trailing bytes": ({"header": {"a": {**F32x2, "data_offsets": [0, 8]}}, "data": bytes(9)},
                       "tensors cover 8 bytes but the data section has 9"),
    "end before begin": ({"header": {"a": {"dtype": "U8", "shape": [0], "data_offsets": [4, 0]}},
                          "data": bytes(4)}, "end before they begin"),
    "negative size": ({"header": {"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}},
                      "is not a list of sizes"),
    "boolean offsets": ({"header": {"a": {"dtype": "U8", "shape": [1], "data_offsets": [False, True]}},
                         "data": b"\0"}, "is not [begin, end]"),
    "duplicate tensor": ({"header": b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
                                    b'"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',
                          "data": b"\0"}, "duplicate key 'a'"),
    "metadata not strings": ({"header": {"__metadata__": {"step": 1}}}, "__metadata__ must be an object"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_files_raise_a_clear_error(tmp_path: Path, case: str) -> None:
    kwargs, reason = MALFORMED[case]
    path = write_raw(tmp_path / "bad.safetensors", **kwargs)
    with pytest.raises(SafetensorsError, match=re.escape(reason)) as err:
        read_header(path)
    assert err.value.path == path and str(path) in str(err.value)
    for how in PATHS.values():
        with pytest.raises(SafetensorsError, match=re.escape(reason)):
            list(stream_tensors([path], "cpu", **how))


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    path = _valid_file(tmp_path)
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(SafetensorsError, match=r"run past .* \(truncated\?\)"):
        load_file(path)
    missing = tmp_path / "missing.safetensors"
    with pytest.raises(SafetensorsError, match="no such file"):
        load_file(missing)


def _shards(tmp_path: Path, count: int) -> tuple[list[Path], dict[str, torch.Tensor]]:
    everything: dict[str, torch.Tensor] = {}
    files = []
    for i in range(count):
        # Later shards are bigger: staging buffers sized for the first must grow.
        tensors = {f"shard{i}.w{j}": sample(torch.float16, (64 + j, 33 * (i + 1)), 10 * i + j)
                   for j in range(5)}
        files.append(tmp_path / f"model-{i:05d}.safetensors")
        save_file(tensors, str(files[-1]))
        everything.update(tensors)
    return files, everything


@pytest.mark.parametrize("how", PATHS)
def test_files_are_loaded_as_a_blocking_iterator_hands_them_over(tmp_path: Path, how: str) -> None:
    files, expected = _shards(tmp_path, 3)
    arrivals: queue.Queue[Path | None] = queue.Queue()

    def downloaded() -> Iterator[Path]:
        while (path := arrivals.get(timeout=10)) is not None:
            yield path

    got: dict[str, torch.Tensor] = {}
    stream = stream_tensors(downloaded(), "cpu", **PATHS[how])
    for i, path in enumerate(files):
        arrivals.put(path)
        # Every tensor of a shard comes out before the loader asks for the next shard (which
        # is not there yet: asking would block until the queue's timeout fails the test).
        while len(got) < 5 * (i + 1):
            name, tensor = next(stream)
            got[name] = tensor
    arrivals.put(None)
    assert next(stream, None) is None
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert same_bytes(got[name], tensor), name


def _open_fds_to(path: Path) -> int:
    fd_dir = Path("/proc/self/fd")
    return sum(1 for fd in fd_dir.iterdir() if os.path.realpath(fd) == str(path.resolve()))


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs /proc/self/fd")
def test_abandoned_staged_stream_closes_its_files(tmp_path: Path) -> None:
    files, _ = _shards(tmp_path, 2)
    stream = stream_tensors(files, "cpu", staged=True, buffer_bytes=512, buffers=2)
    next(stream)
    assert _open_fds_to(files[0]) == 1
    stream.close()
    assert _open_fds_to(files[0]) == 0


def test_on_header_can_refuse_a_file_before_its_data_is_read(tmp_path: Path) -> None:
    files, _ = _shards(tmp_path, 2)

    def refuse_second(header: Any) -> None:
        if header.path == files[1]:
            raise RuntimeError(f"not wanted: {header.names()[0]}")

    for how in PATHS.values():
        seen = []
        with pytest.raises(RuntimeError, match="not wanted: shard1.w0"):
            for name, _ in stream_tensors(files, "cpu", on_header=refuse_second, **how):
                seen.append(name)
        assert len(seen) == 5


def test_model_loads_from_shards_as_they_arrive(tiny_checkpoint: Path, tmp_path: Path) -> None:
    dst = tmp_path / "sharded"
    shutil.copytree(tiny_checkpoint, dst)
    tensors = reference_load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    for i, part in enumerate((names[::2], names[1::2])):
        save_file({n: tensors[n] for n in part}, str(dst / f"model-{i + 1:05d}-of-00002.safetensors"))
    arrivals: queue.Queue[Path | None] = queue.Queue()
    for path in safetensors_files(dst):
        arrivals.put(path)
    arrivals.put(None)

    model = load_model(dst, files=iter(lambda: arrivals.get(timeout=10), None))
    torch.testing.assert_close(model.model.norm.weight, tensors["model.norm.weight"])
    torch.testing.assert_close(model.lm_head.weight, tensors["lm_head.weight"])


def test_model_load_reports_a_corrupt_shard_as_a_checkpoint_error(tiny_checkpoint: Path,
                                                                  tmp_path: Path) -> None:
    dst = tmp_path / "corrupt"
    shutil.copytree(tiny_checkpoint, dst)
    weights = dst / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: .*truncated"):
        load_model(dst)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_staged_cuda_load_matches_safetensors(every_dtype: Path) -> None:
    expected = reference_load_file(str(every_dtype))
    for how in ({}, {"buffer_bytes": 1000, "buffers": 2}):
        got = dict(stream_tensors([every_dtype], "cuda", **how))
        for name, tensor in expected.items():
            assert got[name].device.type == "cuda"
            assert same_bytes(got[name].cpu(), tensor), name
        converted = dict(stream_tensors([every_dtype], "cuda", torch.float32, **how))
        torch.testing.assert_close(converted["large"].cpu(), expected["large"].float())
