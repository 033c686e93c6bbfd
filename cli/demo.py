"""`meridian demo`: a three-region fabric on embedded defaults, stopped by Ctrl-C.

Once it is up, the demo asks the served model one question through the router (greedy, so the
same answer every time) and prints the answer: the first thing a newcomer sees is the whole
path working, and, with the default SmolLM2 model, a real answer.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import time
from pathlib import Path
from types import FrameType

import httpx
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel

from cli.admin_session import DEMO_STATE_FILES
from cli.demo_model import DemoModel
from cli.status_view import status_table
from localfabric import FabricSpec, LocalFabric
from meridian.admin_client import AdminClient
from meridian.contracts import HEADER_REGION
from meridian.cpus import worker_count
from meridian.logs import configure_logging


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _tracing(component: str, otlp_endpoint: str | None) -> dict[str, str]:
    return {f"MERIDIAN_{component}_OTLP_ENDPOINT": otlp_endpoint} if otlp_endpoint else {}


def _router_workers() -> str:
    """The demo's router uses every core (geo_router.workers) unless the environment says otherwise."""
    return os.environ.get("MERIDIAN_ROUTER_WORKERS", "0")


def _workers_line() -> str:
    count = worker_count(int(_router_workers()))
    return f"{count} router worker{'s' if count != 1 else ''}"


def _tracing_line(otlp_endpoint: str | None) -> str:
    """Where the router's and nodes' spans go: the flag, else the environment the children inherit."""
    endpoint = otlp_endpoint or os.environ.get("MERIDIAN_ROUTER_OTLP_ENDPOINT")
    return f"OTLP to {endpoint}" if endpoint else "off (--otlp-endpoint URL turns them on)"


DRILL_REPORTS = Path(".meridian/chaos")
QUESTION = "What is the capital of France?"
# Three nodes loading at once on a small CPU host answer the first request slowly.
ASK_TIMEOUT_S = 120.0


def ask(router_url: str, key: str, model: str, question: str = QUESTION) -> str:
    """The model's greedy answer to `question` through the router, or why there is none."""
    try:
        r = httpx.post(f"{router_url}/v1/chat/completions", timeout=ASK_TIMEOUT_S,
                       headers={"authorization": f"Bearer {key}"},
                       json={"model": model, "max_tokens": 48, "temperature": 0,
                             "messages": [{"role": "user", "content": question}]})
    except httpx.HTTPError as e:
        return f"(no answer: {type(e).__name__} {e})"
    if r.status_code != 200:
        return f"(no answer: HTTP {r.status_code} {r.text[:200]})"
    return str(r.json()["choices"][0]["message"]["content"]).strip()


def run_demo(work_dir: Path, router_port: int, console: Console, *, engine: str = "torch",
             model: DemoModel | None = None, otlp_endpoint: str | None = None) -> None:
    """Start the fabric, print how to use it, and stop everything on Ctrl-C or SIGTERM.

    `otlp_endpoint`: the router and the nodes send their traces there (OTLP/HTTP); the
    demo's own MERIDIAN_* environment reaches every process too (localfabric.fabric)."""
    signal.signal(signal.SIGTERM, _raise_interrupt)
    # Python leaves SIGINT ignored when it starts ignored, as under `nohup` or in a background job
    # of a non-interactive shell: the demo's documented way to stop (Ctrl-C, `kill -INT`) must
    # work however it was started.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    configure_logging()  # the launcher's own warnings, in the children's format
    model = model or DemoModel()
    # Three vLLM processes start in a minute or two on a small CPU host; so do three nodes
    # loading a real checkpoint.
    slow = engine == "vllm" or model.model_dir is not None or model.model_uri is not None
    # The console lists the drill reports `meridian chaos run` writes (to .meridian/chaos by default).
    spec = FabricSpec(work_dir=work_dir, router_port=router_port, control_plane_port=8081, engine=engine,
                      model_name=model.name, model_dir=model.model_dir, model_uri=model.model_uri,
                      start_timeout_s=600.0 if slow else 180.0, register_served_model=True,
                      control_plane_env={"MERIDIAN_CP_DRILL_REPORTS_DIR": str(DRILL_REPORTS.resolve())},
                      router_env=_tracing("ROUTER", otlp_endpoint) | {"MERIDIAN_ROUTER_WORKERS": _router_workers()},
                      node_env=_tracing("NODE", otlp_endpoint))
    progress = console.status("starting the fabric…")
    fabric = LocalFabric(spec, on_step=progress.update)
    try:
        with progress:
            info = fabric.start()
        key = info.keys["global"]
        body = json.dumps({"model": model.name, "max_tokens": 16,
                           "messages": [{"role": "user", "content": "Hello!"}]})
        curl = (f"curl -sS -D - {info.router_url}/v1/chat/completions "
                f"-H 'authorization: Bearer {key}' -H 'content-type: application/json' -d {shlex.quote(body)}")
        console.print(Panel.fit(
            f"[bold]endpoint[/bold]  {info.router_url}/v1  (OpenAI-compatible; HTTP/1.1, HTTP/2, "
            f"Responses WebSocket; {_workers_line()})\n"
            f"[bold]gRPC[/bold]      {info.grpc_targets[0] if info.grpc_targets else 'off'}  "
            f"(KServe v2 / Triton clients)\n"
            f"[bold]model[/bold]     {escape(model.name)}  [dim]({escape(model.source)})[/dim]\n"
            f"[bold]keys[/bold]      global, eu, us, apac in {work_dir / 'fabric.json'} (mode 0600)\n"
            f"[bold]admin[/bold]     control plane {info.control_plane_url}\n"
            f"[bold]console[/bold]   {info.control_plane_url}/console (sign in with the admin key below)\n"
            f"[bold]metrics[/bold]   {info.router_url}/metrics, {info.control_plane_url}/metrics "
            f"(bearer: metrics_token in fabric.json; nodes' /metrics need none)\n"
            f"[bold]traces[/bold]    {escape(_tracing_line(otlp_endpoint))}\n"
            f"[bold]logs[/bold]      {work_dir / 'logs'}",
            title="Meridian demo is up", border_style="green"))
        console.print(f"[bold]asked[/bold] {escape(model.name)}: {QUESTION}")
        console.print(f"[bold]answer[/bold] {escape(ask(info.router_url, key, model.name))}", highlight=False)
        if model.random_weights:
            console.print(f"[dim]{model.name} has random weights (--model tiny, made here in a second), so its "
                          "answers are noise; without --model tiny the demo serves SmolLM2-135M-Instruct.[/dim]")
        # Plain prints, not wrapped in a panel, so they copy and paste as one command.
        console.print(f"try it (the {HEADER_REGION} response header says which region served it):")
        print(curl)
        console.print("status:")
        if any((work_dir / "fabric.json").resolve() == f.resolve() for f in DEMO_STATE_FILES):
            # The CLI finds this demo's admin key and control plane in its fabric.json by itself.
            print(".venv/bin/meridian status")
        else:
            print(f"MERIDIAN_API_KEY={info.admin_key} .venv/bin/meridian status --control-plane {info.control_plane_url}")
        with AdminClient(info.control_plane_url, info.admin_key) as admin:
            console.print(status_table(admin.regions(), admin.nodes()))
        console.print("[dim]Ctrl-C drains and stops every process.[/dim]")
        warned: set[str] = set()
        while True:
            time.sleep(1.0)
            for p in fabric.processes:
                if p.popen.poll() is not None and p.name not in warned:
                    warned.add(p.name)
                    console.print(f"[yellow]{p.name} exited ({p.popen.returncode}); see {p.log}[/yellow]")
    except KeyboardInterrupt:
        console.print("\n[bold]stopping:[/bold] draining nodes, then router and control plane…")
    finally:
        fabric.stop(on_stopped=lambda name: console.print(f"  stopped {name}"))
    console.print("[green]all processes stopped[/green]")
