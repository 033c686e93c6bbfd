"""`meridian demo` starts the fabric, answers its question with its real model (SmolLM2,
fetched once into the user's cache), and Ctrl-C leaves nothing running."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from meridian.ports import free_port

pytestmark = pytest.mark.e2e


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited but not been reaped.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _meridian(cwd, env, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI as an operator runs it next to the demo: no key given, so it reads fabric.json."""
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60)


def test_demo_prints_endpoint_and_ctrl_c_stops_everything(tmp_path):
    work = tmp_path / ".meridian" / "demo"  # the default work dir, where the CLI looks for fabric.json
    env = {k: v for k, v in os.environ.items() if not k.startswith("MERIDIAN_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "demo", "--port", str(free_port())], cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**env, "COLUMNS": "200", "MERIDIAN_LOG_FORMAT": "json"},
        start_new_session=True,
    )
    out: list[str] = []
    try:
        deadline = time.monotonic() + 240
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line.decode(errors="replace"))
            if "Ctrl-C drains" in out[-1] or time.monotonic() > deadline:
                break
        text = "".join(out)
        assert "Meridian demo is up" in text, text
        assert "curl" in text and "/v1/chat/completions" in text
        # The question the demo asks through the router, answered by a real model.
        assert "asked smollm2-135m-instruct: What is the capital of France?" in text
        assert any(line.startswith("answer ") and "Paris" in line for line in out), text
        for region in ("aws:us-east-1", "gcp:europe-west4", "onprem:tokyo-1"):
            assert region in text
        # How to scrape the router: its /metrics and the token fabric.json records.
        assert "/metrics" in text and "metrics_token in fabric.json" in text
        state = json.loads((work / "fabric.json").read_text())
        router_url = state["router_url"]
        assert httpx.get(f"{router_url}/metrics", timeout=10).status_code == 401
        assert httpx.get(f"{router_url}/metrics", timeout=10,
                         headers={"authorization": f"Bearer {state['metrics_token']}"}).status_code == 200
        pids = state["pids"]
        assert len(pids) == 5 and all(_alive(p) for p in pids.values())
        # The model the demo serves (as its router lists it) is registered, with a deployment sized
        # to its three nodes.
        served = httpx.get(f"{state['router_url']}/v1/models", timeout=10,
                           headers={"authorization": f"Bearer {state['keys']['global']}"}).json()["data"]
        [model] = [m["id"] for m in served]
        registered = json.loads(_meridian(tmp_path, env, "models", "-o", "json").stdout)
        assert [m["name"] for m in registered] == [model]
        [deployment] = json.loads(_meridian(tmp_path, env, "deployments", "list", "-o", "json").stdout)
        assert (deployment["model"], deployment["zone"], deployment["min_replicas"], deployment["max_replicas"],
                deployment["desired_replicas"]) == (model, "global", 3, 3, 3)

        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        assert "all processes stopped" in rest.decode()
        assert not [name for name, pid in pids.items() if _alive(pid)]
        # Its fabric.json stays behind: the CLI calls it stale rather than using it.
        stale = _meridian(tmp_path, env, "status")
        assert stale.returncode == 1 and stale.stdout == ""
        assert " is not running (stale .meridian/demo/fabric.json: its processes have exited)" in stale.stderr
        # A clean stop: no process logged an error or a traceback (the control plane used to
        # cancel a router's routing-table long-poll with both on every stop).
        logs = {log.name: log.read_text(errors="replace") for log in (work / "logs").glob("*.log")}
        assert len(logs) == 5
        assert not {name: text[-2000:] for name, text in logs.items() if "ERROR" in text or "Traceback" in text}
        # One format across the processes, the launcher's (MERIDIAN_LOG_FORMAT=json here):
        # every line of every log is a JSON object with the same fields.
        records = [json.loads(line) for text in logs.values() for line in text.splitlines()]
        assert records and all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
        assert {r["logger"] for r in records} >= {"uvicorn.error", "control_plane.leader", "data_plane.runtime",
                                                 "geo_router.state.table"}
    finally:
        if proc.poll() is None:
            proc.kill()
