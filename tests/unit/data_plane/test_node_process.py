"""`serve()` in a real process: SIGTERM drains the node and exits with status 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import httpx
from node_testkit import (
    CHAT_REQUEST,
    NODE_ID,
    TOKEN,
    StandInControlPlane,
    eventually,
    running_server,
)

from meridian.contracts import NodeStatus
from meridian.ports import free_port

SERVE = """
import sys
from pathlib import Path
from data_plane.node import serve
from meridian.settings.node import NodeSettings
serve(NodeSettings(model_dir=Path(sys.argv[1]), port=int(sys.argv[2]),
                   control_plane_url=sys.argv[3], region="aws:us-east-1", node_id=sys.argv[4],
                   cluster_token=sys.argv[5], drain_timeout_s=20))
"""


async def test_sigterm_drains_in_flight_requests_then_exits_zero(tiny_checkpoint: Path) -> None:
    cp = StandInControlPlane()
    port = free_port()
    async with running_server(cp.app()) as cp_url:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", SERVE, str(tiny_checkpoint), str(port), cp_url, NODE_ID, TOKEN,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            base = f"http://127.0.0.1:{port}"
            auth = {"authorization": f"Bearer {TOKEN}"}
            async with httpx.AsyncClient(base_url=base, timeout=10, headers=auth) as client:
                await eventually(
                    lambda: any(h.status == NodeStatus.READY for h in cp.heartbeats()), within=30)
                assert (await client.get("/health")).status_code == 200

                request = {**CHAT_REQUEST, "max_tokens": 400, "temperature": 0,
                           "ignore_eos": True, "stream": True}
                async with client.stream("POST", "/v1/chat/completions", json=request) as stream:
                    lines = stream.aiter_lines()
                    async for line in lines:
                        if '"content"' in line:
                            break
                    proc.send_signal(signal.SIGTERM)

                    health = await _poll_until_503(client)
                    assert health.json() == {"status": "draining"}
                    refused = await client.post("/v1/completions", json={
                        "model": "tiny-llama", "prompt": "hi", "max_tokens": 2})
                    assert refused.status_code == 503
                    assert refused.json()["error"]["code"] == "draining"

                    rest = [line async for line in lines if line.startswith("data: ")]
                assert rest[-1] == "data: [DONE]"
                final = json.loads(rest[-2][len("data: "):])
                assert final["choices"][0]["finish_reason"] == "length"

            output, _ = await asyncio.wait_for(proc.communicate(), 30)
            assert proc.returncode == 0, output.decode()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

        statuses = [body.status for kind, body in cp.events if kind == "heartbeat"]
        assert NodeStatus.DRAINING in statuses
        assert cp.kinds()[-1] == "delete"


async def _poll_until_503(client: httpx.AsyncClient) -> httpx.Response:
    for _ in range(200):
        resp = await client.get("/health")
        if resp.status_code == 503:
            return resp
        await asyncio.sleep(0.02)
    raise AssertionError("/health never turned 503 after SIGTERM")
