"""Failover: every node of the nearest region is killed under steady load.

    python -m bench.failover [--rate R] [--seconds S]

A local fabric with two torch-engine nodes in each of three regions: the clients' own
(aws:us-east-1), the next nearest (aws:us-east-2) and an eu region (gcp:europe-west4).
A global tenant sends short non-streaming requests at a steady rate (open loop: a request
is sent on schedule whatever the previous ones do) and an `eu` tenant does the same
alongside. After a warm-up every node of aws:us-east-1 is SIGKILLed at once.

- `lost_requests`: requests of either tenant that got neither a success nor a clean
  OpenAI error body: a transport error, a timeout, or an error that is not OpenAI JSON.
  Goal 0. (A clean 503 would count as answered, but none is expected: the next region
  is there.)
- `seconds_to_next_region`: from the kill until the last response to the global tenant
  that did not come from aws:us-east-2; after it, all of that tenant's traffic is on the
  next region. Goal <= 1.
- `eu_outside_eu`: responses to the eu tenant served outside the eu zone. Goal 0.
The baseline column is the same figure before the kill (warm-up), for scale.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.common import Figure
from localfabric import DEMO_MODEL, FabricSpec, local_fabric
from meridian.contracts import HEADER_REGION

BENCH = "failover"
NEAREST = "aws:us-east-1"
NEXT = "aws:us-east-2"
EU = "gcp:europe-west4"
EU_REGIONS = {EU}


@dataclass(frozen=True, slots=True)
class Outcome:
    tenant: str
    sent_at: float
    done_at: float
    status: int | None  # None: no HTTP answer at all
    region: str
    clean: bool  # a success, or an error in OpenAI's JSON shape

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def log(msg: str) -> None:
    print(f"[bench.failover] {msg}", file=sys.stderr, flush=True)


async def _one(http: httpx.AsyncClient, url: str, key: str, tenant: str, out: list[Outcome]) -> None:
    body = {"model": DEMO_MODEL, "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 1, "temperature": 0}
    sent = time.perf_counter()
    try:
        r = await http.post(f"{url}/v1/chat/completions", json=body,
                            headers={"authorization": f"Bearer {key}"})
    except httpx.HTTPError:
        out.append(Outcome(tenant, sent, time.perf_counter(), None, "", False))
        return
    clean = r.status_code < 300
    if not clean:
        try:
            err = r.json().get("error")
            clean = isinstance(err, dict) and isinstance(err.get("message"), str)
        except ValueError:
            clean = False
    out.append(Outcome(tenant, sent, time.perf_counter(), r.status_code, r.headers.get(HEADER_REGION, ""), clean))


async def _load(url: str, keys: dict[str, str], rate: float, seconds: float, out: list[Outcome]) -> None:
    """Open-loop load: both tenants send `rate` requests per second each for `seconds`."""
    tasks: list[asyncio.Task[None]] = []
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0), limits=limits) as http:
        start = time.perf_counter()
        n = int(rate * seconds)
        for i in range(n):
            at = start + i / rate
            delay = at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            for tenant in ("global", "eu"):
                tasks.append(asyncio.create_task(_one(http, url, keys[tenant], tenant, out)))
        await asyncio.gather(*tasks)


def run(rate: float = 20.0, seconds: float = 8.0, kill_after_s: float = 3.0) -> list[Figure]:
    with tempfile.TemporaryDirectory() as tmp:
        spec = FabricSpec(work_dir=Path(tmp), regions=(NEAREST, NEXT, EU), nodes_per_region=2,
                          default_client_location=NEAREST)
        with local_fabric(spec, on_step=log) as fabric:
            info = fabric.info
            assert info is not None
            outcomes: list[Outcome] = []
            killed_at: list[float] = []

            async def main() -> None:
                load = asyncio.create_task(_load(info.router_url, info.keys, rate, seconds, outcomes))
                await asyncio.sleep(kill_after_s)
                killed_at.append(time.perf_counter())
                await asyncio.to_thread(fabric.kill_region, NEAREST)
                log(f"killed every node of {NEAREST}")
                await load

            asyncio.run(main())
    t_kill = killed_at[0]
    before = [o for o in outcomes if o.done_at < t_kill]
    after = [o for o in outcomes if o.done_at >= t_kill]
    lost = [o for o in outcomes if not o.clean]
    lost_before = [o for o in before if not o.clean]
    not_next = [o for o in after if o.tenant == "global" and not (o.ok and o.region == NEXT)]
    to_next = max((o.done_at - t_kill for o in not_next), default=0.0)
    eu_outside = [o for o in outcomes if o.tenant == "eu" and o.ok and o.region not in EU_REGIONS]
    log(f"{len(outcomes)} requests ({len(before)} before the kill): lost {len(lost)}, "
        f"not on {NEXT} after the kill {len(not_next)}, eu outside eu {len(eu_outside)}; "
        f"statuses {sorted({o.status for o in outcomes}, key=str)}")
    return [
        Figure(BENCH, "lost_requests", len(lost), len(lost_before), "lost before the kill",
               "ours = 0 (every request succeeds elsewhere or gets a clean error)", "requests"),
        Figure(BENCH, "seconds_to_next_region", to_next, 1.0, "goal",
               "ours <= 1 s from the kill to the last response not served by the next region", "s"),
        Figure(BENCH, "eu_outside_eu", len(eu_outside), 0, "none",
               "ours = 0 (an eu tenant stays in eu throughout)", "requests"),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=20.0, help="requests per second per tenant")
    ap.add_argument("--seconds", type=float, default=8.0)
    args = ap.parse_args()
    for fig in run(rate=args.rate, seconds=args.seconds):
        print(fig.json_line(), flush=True)


if __name__ == "__main__":
    main()
