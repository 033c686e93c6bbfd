"""The manifest of a model artifact: every file with its size, sha256 and per-chunk
sha256 digests. It is what a node verifies downloaded bytes against, and its own
digest names the model in the node cache and among peers."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from meridian.contracts import GLOBAL_ZONE, ZONE_PATTERN

MANIFEST_NAME = "meridian-manifest.json"
FORMAT = "meridian.weights/v1"
# Manifests are small; a bigger one is not ours (or is an attack on the parser).
MAX_MANIFEST_BYTES = 8 * 1024 * 1024
_SHA256 = r"^[0-9a-f]{64}$"
_READ_BYTES = 4 * 1024 * 1024


class ManifestError(ValueError):
    """A manifest is malformed, or a directory cannot be described by one."""


class ManifestFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(min_length=1, max_length=512)
    size: int = Field(ge=0)
    sha256: str = Field(pattern=_SHA256)
    chunk_size: int = Field(ge=4096)
    chunks: list[str]

    @field_validator("path")
    @classmethod
    def _relative(cls, v: str) -> str:
        p = PurePosixPath(v)
        if p.is_absolute() or ".." in p.parts or "\\" in v or v != p.as_posix() or v.startswith("./"):
            raise ValueError(f"file path {v!r} must be relative, without '..'")
        if any(ord(c) < 0x20 or c == "\x7f" for c in v):
            raise ValueError(f"file path {v!r} must not contain control characters")
        # A model directory in a node cache holds the model's files and the cache's own:
        # the manifest and hidden bookkeeping (`.last-used`, `.tmp-*`). A file named like
        # one of them would be linked to a shared blob and then written over, changing
        # another model's file (push never uploads hidden files or the manifest itself).
        if v == MANIFEST_NAME or any(part.startswith(".") for part in p.parts):
            raise ValueError(f"file path {v!r} is reserved (the manifest, or a hidden name)")
        return v

    @field_validator("chunks")
    @classmethod
    def _digests(cls, v: list[str]) -> list[str]:
        for d in v:
            if len(d) != 64 or any(c not in "0123456789abcdef" for c in d):
                raise ValueError("chunk digests must be lowercase sha256 hex")
        return v

    @model_validator(mode="after")
    def _chunk_count(self) -> ManifestFile:
        if len(self.chunks) != self.chunk_count:
            raise ValueError(f"{self.path}: {len(self.chunks)} chunk digests for {self.chunk_count} chunks")
        return self

    @property
    def chunk_count(self) -> int:
        return max(1, -(-self.size // self.chunk_size))

    def chunk_span(self, index: int) -> tuple[int, int]:
        """Byte range [start, end) of chunk `index`."""
        start = index * self.chunk_size
        return start, min(self.size, start + self.chunk_size)


class Manifest(BaseModel):
    """What `meridian model push` writes next to the files as meridian-manifest.json."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["meridian.weights/v1"] = FORMAT
    name: str = Field(min_length=1, max_length=200)
    # Residency: a zoned model is only fetched by nodes, from peers and origins, in its zone.
    zone: str = Field(GLOBAL_ZONE, pattern=ZONE_PATTERN)
    created_at: datetime
    files: list[ManifestFile] = Field(min_length=1, max_length=10_000)

    @model_validator(mode="after")
    def _unique_paths(self) -> Manifest:
        paths = [f.path for f in self.files]
        if len(set(paths)) != len(paths):
            raise ValueError("file paths in a manifest must be unique")
        return self

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def canonical_json(self) -> bytes:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()

    @property
    def digest(self) -> str:
        """sha256 of the canonical JSON: the model's identity in caches and among peers."""
        return hashlib.sha256(self.canonical_json()).hexdigest()

    @classmethod
    def parse(cls, raw: bytes) -> Manifest:
        """Validate a manifest's bytes; ManifestError with the reason if they are not one."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest is {len(raw)} bytes, more than {MAX_MANIFEST_BYTES}")
        try:
            return cls.model_validate_json(raw)
        except ValueError as exc:
            raise ManifestError(f"not a valid {FORMAT} manifest: {exc}") from None


def describe_file(path: Path, chunk_size: int, progress: Callable[[int], None] | None = None) -> tuple[int, str, list[str]]:
    """(size, sha256, per-chunk sha256) of a file, read once."""
    whole = hashlib.sha256()
    chunks: list[str] = []
    size = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk_size)
            if not block and chunks:
                break
            whole.update(block)
            chunks.append(hashlib.sha256(block).hexdigest())
            size += len(block)
            if progress is not None and block:
                progress(len(block))
            if len(block) < chunk_size:
                break
    return size, whole.hexdigest(), chunks


def model_files(model_dir: Path) -> list[Path]:
    """Files of a model directory (hidden files and the manifest itself left out)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ManifestError(f"{model_dir} is not a directory")
    files = []
    for root, dirs, names in os.walk(model_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if name.startswith(".") or name == MANIFEST_NAME:
                continue
            p = Path(root) / name
            if p.is_symlink() and not p.resolve().is_file():
                raise ManifestError(f"{p} is a dangling symlink")
            files.append(p)
    if not files:
        raise ManifestError(f"{model_dir} holds no files")
    return files


def build_manifest(
    model_dir: Path,
    *,
    name: str | None = None,
    zone: str = GLOBAL_ZONE,
    chunk_size: int = 16 * 1024 * 1024,
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    """Describe every file of a model directory (hashing each once)."""
    model_dir = Path(model_dir)
    entries = []
    for path in model_files(model_dir):
        size, sha, chunks = describe_file(path, chunk_size, progress)
        entries.append(
            ManifestFile(
                path=path.relative_to(model_dir).as_posix(), size=size, sha256=sha,
                chunk_size=chunk_size, chunks=chunks,
            )
        )
    return Manifest(name=name or model_dir.name, zone=zone, created_at=datetime.now(UTC), files=entries)
