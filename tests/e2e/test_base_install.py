"""A newcomer's first run: the base install alone starts `meridian demo` and answers a chat.

CI's venv has the dev extra, whose packages pull in others (grpcio-status came that way):
a module the router imports but the base dependencies do not declare passes every other
test and fails every `make demo`. This test builds what a newcomer gets, a fresh venv with
the base package only (no extras; pip's cache allowed), from a copy of the source tree (so
that nothing is built inside the checkout), starts `meridian demo` from it with no
`MERIDIAN_*` setting, asks for the model list and a chat through the openai client, and
stops the demo with SIGINT as Ctrl-C would.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from meridian.ports import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
# What a source checkout holds besides the package: venvs, state and build output.
_NOT_SOURCE = shutil.ignore_patterns(".git", ".venv*", ".meridian", "__pycache__", "build", "dist",
                                     "*.egg-info", ".pytest_cache", ".ruff_cache", ".import_linter_cache")
# Packages of the dev extra and of the optional extras: none may be in a base install.
_EXTRAS_ONLY = {"pytest", "openai", "tritonclient", "grpcio-tools", "transformers", "boto3",
                "google-cloud-compute", "cdktf", "matplotlib", "moto"}


def _base_env() -> dict[str, str]:
    """The environment of a newcomer's shell: none of the suite's settings or paths."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MERIDIAN_", "PYTHON", "VIRTUAL_ENV", "PYTEST", "COV_"))}
    env["COLUMNS"] = "200"
    return env


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("first-run")
    src, venv = tmp / "src", tmp / "venv"
    shutil.copytree(REPO, src, ignore=_NOT_SOURCE)
    env = _base_env()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env)
    install = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         "-c", str(src / "constraints-cpu.txt"), str(src)],
        env=env, capture_output=True, text=True, timeout=1200,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    return venv


def test_the_base_install_holds_no_extra(base_venv: Path) -> None:
    listed = subprocess.run([str(base_venv / "bin" / "python"), "-m", "pip", "list", "--format=json"],
                            capture_output=True, text=True, check=True)
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert "meridian" in names and "grpcio-status" in names
    assert not names & _EXTRAS_ONLY


# What a deployment runs: the planes, the kernel, the CLI and what its commands reach.
_SHIPPED = {"meridian", "control_plane", "data_plane", "geo_router", "providers", "iac", "cli", "localfabric", "chaos"}


def test_the_wheel_ships_only_what_production_runs(base_venv: Path) -> None:
    listing = ("import importlib.metadata as m; "
               "print('\\n'.join(sorted({f.parts[0] for f in m.files('meridian') if f.suffix == '.py'})))")
    shown = subprocess.run([str(base_venv / "bin" / "python"), "-c", listing], cwd=base_venv,
                           capture_output=True, text=True, check=True)
    assert set(shown.stdout.split()) == _SHIPPED  # no bench, no tests, nothing left out


def test_demo_from_the_base_install_answers_a_chat_and_stops_on_ctrl_c(base_venv: Path, tmp_path: Path) -> None:
    work = tmp_path / "demo"
    proc = subprocess.Popen(
        [str(base_venv / "bin" / "meridian"), "demo", "--work-dir", str(work), "--port", str(free_port())],
        cwd=tmp_path, env=_base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    out: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 900
        for line in proc.stdout:
            out.append(line)
            if "Ctrl-C drains" in line or time.monotonic() > deadline:
                break
        text = "".join(out)
        assert "Meridian demo is up" in text, text[-4000:]

        state = json.loads((work / "fabric.json").read_text())
        client = openai.OpenAI(base_url=f"{state['router_url']}/v1", api_key=state["keys"]["global"],
                               timeout=120, max_retries=0)
        models = [m.id for m in client.models.list().data]
        assert models, "the router lists no model"
        answer = client.chat.completions.create(
            model=models[0], max_tokens=16, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert answer.choices[0].message.content
        assert answer.usage is not None and answer.usage.completion_tokens > 0

        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, rest[-3000:]
        assert "all processes stopped" in rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
