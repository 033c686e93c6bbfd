"""What relaying a migratable stream costs the router: events parsed and re-written, against
the same stream passed through as bytes, one run.

    python -m bench.stream_relay [--events 128] [--seconds 3] [--rounds 3] [--concurrency 16]

Stream migration (geo_router.forwarding.migration) needs the token ids of every event, so the router
parses each event of a chat or completions stream, keeps a ledger, and re-writes the event
without the ids the client did not ask for. Before it, a stream's bytes were passed through
untouched. The node is nginx answering a streamed chat completion from memory: `--events`
chunk events the shape vLLM sends with `return_token_ids` (ids on every chunk, the prompt's
on the first), then `[DONE]`. Two `meridian router serve` processes in front of it, one with
migration on (the default) and one with MERIDIAN_ROUTER_MIGRATION_ENABLED=false, take turns
at closed-loop maximum throughput (bench/http_load.py); figures are medians over rounds.

Figures (bench `stream_relay`): `streams_per_s` (ours: migration on; baseline: off) and
`relay_us_per_event` (ours: the router's extra CPU per event, from its CPU per stream read
from /proc with migration on and off; baseline: the pass-through's whole CPU per event).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import uvloop

from bench.common import Figure, median
from bench.http_load import Target, post_target, saturate_rounds
from bench.nginx import NginxServer, nginx_available
from bench.router import IDLE_NODE_METRICS, MODEL, ROUTE, TENANT_KEY, _NginxConf, router_process

BENCH = "stream_relay"
PROMPT_IDS = list(range(100, 164))


def stream_answer(events: int) -> str:
    """The SSE body of a streamed chat completion as vLLM sends it with return_token_ids."""
    head = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1700000000, "model": MODEL}
    out = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}], "prompt_token_ids": PROMPT_IDS}]
    for i in range(events):
        last = i == events - 1
        out.append({**head, "choices": [{"index": 0, "delta": {"content": f" word{i % 50}"}, "logprobs": None,
                                         "finish_reason": "length" if last else None, "token_ids": [1000 + i]}]})
    return "".join(f"data: {json.dumps(e, separators=(',', ':'))}\n\n" for e in out) + "data: [DONE]\n\n"


def stream_node(work_dir: Path, events: int) -> NginxServer:
    """nginx answering a POST to the chat route with the stream from a file (its config
    strings are too short for it): a POST to a static file is a 405, sent as 200 with the file."""
    root = work_dir / "www"
    answer = root / ROUTE.lstrip("/")
    answer.parent.mkdir(parents=True, exist_ok=True)
    answer.write_text(stream_answer(events))
    return _NginxConf(work_dir, f"""    server {{
        listen 127.0.0.1:{{port}};
        root {root};
        location = {ROUTE} {{
            default_type text/event-stream;
            error_page 405 =200 $uri;
        }}
        location = /metrics {{
            default_type text/plain;
            return 200 '{IDLE_NODE_METRICS}';
        }}
    }}""")


def stream_target(name: str, url: str, pgid: int) -> Target:
    """A streamed chat completion's POST to a router at `url` (the node answers stream_node's stream)."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Go on."}], "stream": True,
                       "max_tokens": 1024}).encode()
    return post_target(name, int(url.rsplit(":", 1)[1]), ROUTE, body, TENANT_KEY, pgid)


def run(events: int = 128, seconds: float = 3.0, rounds: int = 3, concurrency: int = 16) -> list[Figure]:
    if not nginx_available():
        raise RuntimeError("nginx is needed for the stand-in node (apt-get install nginx)")
    with tempfile.TemporaryDirectory(prefix="bench-stream-relay-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        node = stack.enter_context(stream_node(work / "node", events))
        on = stack.enter_context(router_process(work / "on", node.url))
        off = stack.enter_context(router_process(work / "off", node.url,
                                                 {"MERIDIAN_ROUTER_MIGRATION_ENABLED": "false"}))
        targets = [stream_target("migration on", on.url, on.pid), stream_target("migration off", off.url, off.pid)]
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runs = runner.run(saturate_rounds(targets, rounds, concurrency, seconds))
    rates = {name: [x.rps for x in xs] for name, xs in runs.items()}
    cpu = {name: [x.cpu_per_request_ms or 0.0 for x in xs] for name, xs in runs.items()}
    ours, base = median(rates["migration on"]), median(rates["migration off"])
    for name, xs in rates.items():
        print(f"# {name:14s} streams/s {' '.join(f'{x:.0f}' for x in xs)} (median {median(xs):.0f}), CPU per "
              f"stream {' '.join(f'{x * 1000:.0f}' for x in cpu[name])} us (median {median(cpu[name]) * 1000:.0f}),"
              f" {events} events each", file=sys.stderr, flush=True)
    # The router's own CPU per stream, read from /proc (steadier than the rates: the load
    # generator shares the cores): the difference over the events is what parsing and
    # re-writing each event adds.
    on_us, off_us = median(cpu["migration on"]) * 1000, median(cpu["migration off"]) * 1000
    return [
        Figure(BENCH, "streams_per_s", ours, base, f"the same router with migration off ({events} events a stream)",
               "ratio >= 0.85", "streams/s"),
        Figure(BENCH, "relay_us_per_event", (on_us - off_us) / events, off_us / events,
               "pass-through CPU per event (migration off)", "ours <= 1.5", "us"),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    for fig in run(args.events, args.seconds, args.rounds, args.concurrency):
        print(fig.json_line(), flush=True)


if __name__ == "__main__":
    main()
