"""First run from a clean clone: `make demo` until its first real answer, timed.

    python3 bench/first_run.py [--ref REF ...] [--cold-cache] [--repo DIR]

For each git ref it clones the repository into a fresh temporary directory, checks the ref
out and runs `make demo` there, timing three phases from the output: the install (until make
echoes the `.venv/bin/meridian demo` command), the start (until the demo prints "Meridian
demo is up": the model fetched and converted on a cold cache, the processes started) and the
first answer (the demo's own question, printed as "answer …"). Then it asks the router for
a chat completion with the demo's global key through /v1/models' first model (the run fails
unless it answers 200), stops the demo with SIGINT and deletes the clone. One JSON line per
ref, with the venv's size and package count and the model cache's size.

--cold-cache gives each run an empty pip cache (PIP_CACHE_DIR) and an empty model cache
(MERIDIAN_MODEL_CACHE_DIR), a fresh machine's; without it both caches are used as they
are. Standard library only: it runs before any venv exists. Not part of `python -m bench`
(it installs gigabytes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

INSTALL_DONE = ".venv/bin/meridian demo"
UP = "Meridian demo is up"
# The demo's own question's answer (refs before it printed one end at UP).
ANSWER = "answer "


def _du_bytes(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _chat(fabric_json: Path) -> dict[str, object]:
    state = json.loads(fabric_json.read_text())
    auth = {"authorization": f"Bearer {state['keys']['global']}", "content-type": "application/json"}
    with urllib.request.urlopen(urllib.request.Request(f"{state['router_url']}/v1/models", headers=auth),
                                timeout=60) as r:
        model = json.load(r)["data"][0]["id"]
    body = json.dumps({"model": model, "max_tokens": 16, "temperature": 0,
                       "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    req = urllib.request.Request(f"{state['router_url']}/v1/chat/completions", data=body.encode(), method="POST",
                                 headers=auth)
    with urllib.request.urlopen(req, timeout=60) as r:
        answer = json.load(r)
        return {"status": r.status, "region": r.headers.get("x-meridian-region"), "model": model,
                "content": answer["choices"][0]["message"]["content"]}


def run_one(repo: Path, ref: str, cold_cache: bool, timeout_s: float, log: Path) -> dict[str, object]:
    """Clone `repo` at `ref`, time `make demo` to ready, query it, stop it, delete the clone."""
    tmp = Path(tempfile.mkdtemp(prefix="meridian-first-run-"))
    clone = tmp / "meridian"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MERIDIAN_")}
    env["COLUMNS"] = "200"
    if cold_cache:
        env["PIP_CACHE_DIR"] = str(tmp / "pip-cache")
        env["MERIDIAN_MODEL_CACHE_DIR"] = str(tmp / "model-cache")
    try:
        subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
        subprocess.run(["git", "-C", str(clone), "checkout", "-q", ref], check=True)
        start = time.monotonic()
        load_before = os.getloadavg()[0]
        install_s = up_s = answer_s = None
        demo_answer = ""
        load_up = 0.0
        with open(log, "w") as out:
            proc = subprocess.Popen(["make", "demo"], cwd=clone, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
            assert proc.stdout is not None
            try:
                for line in proc.stdout:
                    now = time.monotonic() - start
                    out.write(f"[{now:7.1f}s] {line}")
                    if install_s is None and line.startswith(INSTALL_DONE):
                        install_s = now
                    if up_s is None and UP in line:
                        up_s = now
                        load_up = os.getloadavg()[0]
                    elif up_s is not None and line.startswith(ANSWER):
                        answer_s, demo_answer = now, line[len(ANSWER):].strip()
                    if answer_s is not None or "try it" in line or now > timeout_s:
                        break
                if up_s is None:
                    try:  # stdout closed: make is exiting
                        exited: int | None = proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        exited = None
                    why = (f"make demo exited ({exited}) before the demo was up" if exited is not None
                           else f"the demo was not up within {timeout_s:g}s")
                    raise RuntimeError(f"{ref}: {why}; see {log}")
                answer = _chat(clone / ".meridian" / "demo" / "fabric.json")
            finally:
                with contextlib.suppress(ProcessLookupError):  # a make that exited took its group
                    os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.communicate(timeout=90)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        venv = clone / ".venv"
        pip_list = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"],
                                  capture_output=True, text=True, check=True)
        return {
            "ref": ref,
            "commit": subprocess.run(["git", "-C", str(clone), "rev-parse", "--short", "HEAD"],
                                     capture_output=True, text=True).stdout.strip(),
            "pip_cache": "empty" if cold_cache else "as is",
            "install_s": round(install_s or 0.0, 1),
            "demo_up_s": round(up_s - (install_s or 0.0), 1),
            "total_s": round(up_s, 1),
            # From `make demo` to the demo's printed answer to its own question.
            "first_answer_s": round(answer_s, 1) if answer_s is not None else None,
            "demo_answer": demo_answer,
            "venv_packages": len(json.loads(pip_list.stdout)),
            "venv_gb": round(_du_bytes(venv) / 1e9, 2),
            "model_cache_mb": round(_du_bytes(Path(env["MERIDIAN_MODEL_CACHE_DIR"])) / 1e6) if cold_cache else None,
            "chat_completion": answer,
            # The machine's 1-minute load average at the start and at "up": neighbours' load
            # stretches both phases.
            "load_avg": [round(load_before, 1), round(load_up, 1)],
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--ref", action="append", help="git ref to time (repeatable; default HEAD)")
    parser.add_argument("--cold-cache", action="store_true", help="an empty pip cache for each run")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds until the demo must be up")
    parser.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    for ref in args.ref or ["HEAD"]:
        log = args.log_dir / f"first-run-{ref.replace('/', '_')}.log"
        print(json.dumps(run_one(args.repo.resolve(), ref, args.cold_cache, args.timeout, log)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
