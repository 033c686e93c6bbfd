"""First run from a clean clone: `make demo` until "Meridian demo is up", timed.

    python3 bench/first_run.py [--ref REF ...] [--cold-cache] [--repo DIR]

For each git ref it clones the repository into a fresh temporary directory, checks the ref
out and runs `make demo` there, timing two phases from the output: the install (until make
echoes the `.venv/bin/meridian demo` command) and the start (until the demo prints "Meridian
demo is up"). Then it asks the router for a chat completion with the demo's global key (the
run fails unless it answers 200), stops the demo with SIGINT and deletes the clone. One JSON
line per ref, with the venv's size and package count.

--cold-cache gives each run an empty pip cache (PIP_CACHE_DIR), a fresh machine's; without
it pip's own cache is used as it is. Standard library only: it runs before any venv exists.
Not part of `python -m bench` (it installs gigabytes).
"""

from __future__ import annotations

import argparse
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


def _du_bytes(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _chat(fabric_json: Path, model: str) -> dict[str, object]:
    state = json.loads(fabric_json.read_text())
    body = json.dumps({"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "Hello!"}]})
    req = urllib.request.Request(
        f"{state['router_url']}/v1/chat/completions", data=body.encode(), method="POST",
        headers={"authorization": f"Bearer {state['keys']['global']}", "content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return {"status": r.status, "region": r.headers.get("x-meridian-region")}


def run_one(repo: Path, ref: str, cold_cache: bool, timeout_s: float, log: Path) -> dict[str, object]:
    """Clone `repo` at `ref`, time `make demo` to ready, query it, stop it, delete the clone."""
    tmp = Path(tempfile.mkdtemp(prefix="meridian-first-run-"))
    clone = tmp / "meridian"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MERIDIAN_")}
    env["COLUMNS"] = "200"
    if cold_cache:
        env["PIP_CACHE_DIR"] = str(tmp / "pip-cache")
    try:
        subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
        subprocess.run(["git", "-C", str(clone), "checkout", "-q", ref], check=True)
        start = time.monotonic()
        load_before = os.getloadavg()[0]
        install_s = up_s = None
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
                    if UP in line:
                        up_s = now
                        load_up = os.getloadavg()[0]
                        break
                    if now > timeout_s:
                        break
                if up_s is None:
                    raise RuntimeError(f"{ref}: the demo was not up within {timeout_s:g}s; see {log}")
                answer = _chat(clone / ".meridian" / "demo" / "fabric.json", "tiny-llama")
            finally:
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
            "venv_packages": len(json.loads(pip_list.stdout)),
            "venv_gb": round(_du_bytes(venv) / 1e9, 2),
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
