"""LiteLLM's proxy (PyPI) as a benchmark baseline, in a virtual environment of its own.

LiteLLM pins versions that conflict with the project's (openai, httpx, pydantic…), so it
never enters `.venv`: `ensure_litellm()` installs it on demand into `.venv-litellm` (kept
out of git) and answers None, with the reason, when that is not possible (no network),
so a benchmark can report LiteLLM's figures as null instead of failing.

    if (exe := ensure_litellm()).path is not None:
        with LiteLLMProxy(exe.path, work_dir, model="bench-model", api_base=node_url + "/v1") as p:
            post(p.url + "/v1/chat/completions", headers={"authorization": f"Bearer {p.master_key}"})
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx

from meridian.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
LITELLM_VENV = REPO_ROOT / ".venv-litellm"
# Pinned so that figures from different runs compare the same proxy.
LITELLM_REQUIREMENT = "litellm[proxy]==1.106.2"
INSTALL_TIMEOUT_S = 900.0
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class LiteLLMInstall:
    """Where the `litellm` command is, or why there is none."""

    path: Path | None
    reason: str = ""


def ensure_litellm(venv: Path = LITELLM_VENV) -> LiteLLMInstall:
    """The `litellm` command in `venv`, installing it there first when it is missing."""
    exe = venv / "bin" / "litellm"
    if exe.exists():
        return LiteLLMInstall(exe)
    log = venv / "install.log"
    print(f"# installing {LITELLM_REQUIREMENT} into {venv} (log: {log})…", file=sys.stderr, flush=True)
    try:
        venv.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            # The base interpreter, not this venv's: the new venv must not see the project's packages.
            base = Path(getattr(sys, "_base_executable", sys.executable))
            for cmd in (
                [str(base), "-m", "venv", str(venv)],
                # Without a network, fail in seconds rather than retry for minutes.
                [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--retries", "1",
                 "--timeout", "15", LITELLM_REQUIREMENT],
            ):
                subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               check=True, timeout=INSTALL_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
        # A half-made venv is left for pip to complete on the next run.
        return LiteLLMInstall(None, f"cannot install {LITELLM_REQUIREMENT} ({exc}): {' | '.join(tail)}")
    if not exe.exists():
        return LiteLLMInstall(None, f"{LITELLM_REQUIREMENT} installed no `litellm` command in {venv}")
    return LiteLLMInstall(exe)


class LiteLLMProxy:
    """`litellm --config` on a loopback port, serving `model` as an `openai/` model at `api_base`.

    One uvicorn worker, like the router it is compared with; request logging and callbacks
    off; a master key, since the router checks an API key on every request too.
    """

    def __init__(self, exe: Path, work_dir: Path, *, model: str, api_base: str, workers: int = 1) -> None:
        self.exe = exe
        self.work_dir = Path(work_dir)
        self.model = model
        self.api_base = api_base
        self.workers = workers
        self.master_key = "sk-meridian-bench"
        self.port = 0
        self.log_path = self.work_dir / "litellm.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The proxy's process (also its process group: it runs in a session of its own)."""
        return self._process.pid if self._process is not None else None

    def _config(self) -> str:
        return f"""model_list:
  - model_name: {self.model}
    litellm_params:
      model: openai/{self.model}
      api_base: {self.api_base}
      api_key: not-checked
litellm_settings:
  telemetry: false
  drop_params: true
  set_verbose: false
  json_logs: false
general_settings:
  master_key: {self.master_key}
  disable_spend_logs: true
  disable_error_logs: true
"""

    def start(self) -> LiteLLMProxy:
        """Start the proxy and wait until it answers its liveness probe."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        config = self.work_dir / "litellm.yaml"
        config.write_text(self._config())
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LITELLM", "OPENAI"))}
        env |= {
            # No network at start-up (the model price map ships with the package) and no telemetry.
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_TELEMETRY": "False",
            "LITELLM_LOG": "ERROR",
            "NO_PROXY": "127.0.0.1,localhost",
        }
        with open(self.log_path, "wb") as out:
            self._process = subprocess.Popen(
                [str(self.exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(self.port),
                 "--num_workers", str(self.workers)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                cwd=self.work_dir, start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        with httpx.Client(timeout=2.0, trust_env=False) as http:
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    break
                try:
                    if http.get(self.url + "/health/liveliness").status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        tail = self.log_path.read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"LiteLLM proxy did not start:\n{tail}")

    def stop(self) -> None:
        """Stop the proxy (SIGTERM to its process group, then SIGKILL)."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        # Its own session: the group holds the worker processes uvicorn may have forked.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=STOP_TIMEOUT_S)

    def __enter__(self) -> LiteLLMProxy:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
