"""`meridian demo --model-dir / --model-uri` serves an operator's checkpoint, not the tiny one.

The checkpoint is made apart from the demo (another seed, another name), as an operator's
would be; the demo's fabric serves it under the directory's name (or the URI's last segment)
in every region, through the router, and the generated tiny model is neither made nor served.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from data_plane.model.make_tiny import make_tiny_checkpoint
from localfabric import DEMO_MODEL
from meridian.ports import free_port

pytestmark = pytest.mark.e2e


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MERIDIAN_")}
    return {**env, "COLUMNS": "200"}


def _run_demo(work: Path, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    """Start the demo and read its output until it is up (or gives up)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "demo", "--work-dir", str(work), "--port", str(free_port()), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env(), start_new_session=True,
    )
    out: list[str] = []
    deadline = time.monotonic() + 300
    assert proc.stdout is not None
    for line in proc.stdout:
        out.append(line.decode(errors="replace"))
        if "Ctrl-C drains" in out[-1] or time.monotonic() > deadline:
            break
    return proc, "".join(out)


def _push(checkpoint: Path, origin: Path) -> None:
    subprocess.run([sys.executable, "-m", "cli", "model", "push", str(checkpoint), f"file://{origin}"],
                   check=True, capture_output=True, env=_env(), timeout=120)


@pytest.mark.parametrize("source", ["dir", "uri"])
def test_demo_serves_an_operators_checkpoint_under_its_name(tmp_path, source):
    checkpoint = make_tiny_checkpoint(tmp_path / "ckpt" / "acme-llama", seed=7)
    if source == "dir":
        args, served = ["--model-dir", str(checkpoint)], "acme-llama"
    else:
        origin = tmp_path / "store" / "acme-llama-v2"
        _push(checkpoint, origin)
        args, served = ["--model-uri", f"file://{origin}"], "acme-llama-v2"
    work = tmp_path / "demo"
    proc, text = _run_demo(work, *args)
    try:
        assert "Meridian demo is up" in text, text
        assert f'"model": "{served}"' in text  # the curl to paste names it
        state = json.loads((work / "fabric.json").read_text())
        auth = {"authorization": f"Bearer {state['keys']['global']}"}
        with httpx.Client(base_url=state["router_url"], headers=auth, timeout=60) as http:
            models = http.get("/v1/models").json()["data"]
            assert [m["id"] for m in models] == [served]
            regions = set()
            for _ in range(6):
                r = http.post("/v1/chat/completions", json={
                    "model": served, "max_tokens": 4, "messages": [{"role": "user", "content": "Hello!"}]})
                assert r.status_code == 200, r.text
                assert r.json()["model"] == served and r.json()["usage"]["completion_tokens"] > 0
                regions.add(r.headers["x-meridian-region"])
            assert regions  # served through the router by a region's node
            assert http.post("/v1/chat/completions", json={
                "model": DEMO_MODEL, "messages": [{"role": "user", "content": "Hi"}]}).status_code == 404
        # The tiny model was never generated.
        assert not (work / "models" / DEMO_MODEL).exists()
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "all processes stopped" in rest.decode()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
