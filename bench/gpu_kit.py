"""The wheels that let bench.gpu_proof run on a GPU machine that reaches no package registry.

    python -m bench.gpu_kit [--out .whl] [--python-version 3.12] [--have FILE]

The GPU this project is lent now and then (the device tool: one H200) runs an image with
PyTorch's CUDA build on Python 3.12, reaches no package registry, and takes a working tree
of at most 64 MiB. `make install` cannot run there, so the proof's torch-engine steps need
Meridian's base install brought along as wheels: this writes them. It takes the base
install's dependencies as this checkout's venv has them (`meridian` and what it requires,
extras followed, the exact versions installed), leaves out what the image already has
(`--have`: one distribution name a line; by default the H200 image's list as its page in
the device tool gives it, bench/gpu_image.txt) and torch (the image's is the CUDA build),
and downloads the rest as binary wheels for `--python-version` on x86-64 Linux.

Always carried, even where the image has them: protobuf and grpcio. The router's KServe
stubs are protoc 7.35's and check their runtime's version when imported, and the image's
versions are not known.

Then, on the GPU machine, from the repository root (the device tool's `run` with `.whl`
carried; a `.whl` folder is ignored by git through `.git/info/exclude`):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:. python3 -m bench.gpu_proof --out $OUT/proof --only engine,weights_load,pd,routing,migration,flow_control

vLLM's GPU build does not travel (its wheels are hundreds of MB against the 64 MiB): its
steps need a machine with a registry, or a wheelhouse there (`bench.gpu_proof --wheelhouse`).
Measured on 2026-12-01: 52 wheels, 48 MB (botocore's 17 MB the largest), with a 9.8 MB tree.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
IMAGE = Path(__file__).with_name("gpu_image.txt")
# What the device tool takes: the working tree and the carried wheels together.
TREE_LIMIT_BYTES = 64 * 1024 * 1024
# Carried even when the image has them (module doc).
ALWAYS = frozenset({"protobuf", "grpcio"})
# The image's own, whatever --have says: the CUDA build of torch is the point of the machine.
NEVER = frozenset({"torch", "meridian"})
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux1_x86_64")

Requires = Callable[[str], tuple[str, list[str]] | None]


def installed(name: str) -> tuple[str, list[str]] | None:
    """A distribution of this venv: its version and its requirement strings (None: not installed)."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    return dist.version, list(dist.requires or [])


def closure(root: str, requires: Requires = installed) -> dict[str, str]:
    """Every distribution `root` needs, by canonical name, with its version installed: its
    requirements, those of the extras it asks for (uvicorn[standard]), and so on; none of
    any extra it does not ask for (meridian's dev extra stays out)."""
    found: dict[str, str] = {}
    stack: list[tuple[str, frozenset[str]]] = [(root, frozenset())]
    while stack:
        name, extras = stack.pop()
        key = canonicalize_name(name)
        if key in found:
            continue
        dist = requires(name)
        if dist is None:
            continue  # a requirement for another platform or Python, not installed here
        found[key] = dist[0]
        for line in dist[1]:
            req = Requirement(line)
            environments = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(env) for env in environments):
                stack.append((req.name, frozenset(req.extras)))
    return found


def to_carry(needed: dict[str, str], have: Iterable[str]) -> dict[str, str]:
    """What must travel: what is needed, less what the image has (but ALWAYS) and NEVER."""
    image = {canonicalize_name(n) for n in have}
    return {n: v for n, v in sorted(needed.items())
            if n not in NEVER and (n in ALWAYS or n not in image)}


def read_have(path: Path) -> list[str]:
    """Distribution names, one a line; blank lines and # comments left out."""
    return [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()
            if line.split("#", 1)[0].strip()]


def download_command(carry: dict[str, str], out: Path, python_version: str) -> list[str]:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    return [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
            "--python-version", python_version, "--implementation", "cp", *platforms, "--dest", str(out),
            *(f"{n}=={v}" for n, v in carry.items())]


def tree_bytes() -> int:
    """The bytes of this checkout's tracked files: what travels with the wheels."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return sum((ROOT / n).stat().st_size for n in names.decode().split("\0") if n and (ROOT / n).is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / ".whl", help="where the wheels go (default .whl)")
    ap.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    ap.add_argument("--have", type=Path, default=IMAGE, help="the image's distributions, one name a line")
    args = ap.parse_args()
    carry = to_carry(closure("meridian"), read_have(args.have))
    print(f"[bench.gpu_kit] {len(carry)} wheels for Python {args.python_version} into {args.out}", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    subprocess.run(download_command(carry, args.out, args.python_version), check=True)
    wheels = sum(p.stat().st_size for p in args.out.glob("*.whl"))
    tree = tree_bytes()
    print(f"[bench.gpu_kit] wheels {wheels / 1e6:.1f} MB + tree {tree / 1e6:.1f} MB = {(wheels + tree) / 1e6:.1f} MB "
          f"of the device tool's {TREE_LIMIT_BYTES / 1e6:.1f} MB", file=sys.stderr)
    if wheels + tree > TREE_LIMIT_BYTES:
        raise SystemExit("bench.gpu_kit: over the device tool's limit: carry less (see --have)")


if __name__ == "__main__":
    main()
