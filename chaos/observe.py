"""What a drill reads off the routers while it runs: their Prometheus counters (ejections,
predicted cache hits), scraped over HTTP, the same for a local fabric and a deployment."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterMetrics:
    """The `/metrics` of every router of the fabric under test."""

    router_urls: Sequence[str]
    timeout_s: float = 5.0
    # Routers' /metrics answer only their metrics token or the cluster token.
    token: str | None = None

    async def metric(self, name: str, **labels: str) -> float:
        """Sum of a counter/gauge sample over every router (labels must match); routers that
        do not answer count as 0."""
        return sum(value for sample_labels, value in await self.samples(name)
                   if all(sample_labels.get(k) == v for k, v in labels.items()))

    async def requests_by_node(self) -> dict[str, float]:
        """Requests the routers have sent to each node so far, whatever their status."""
        return await self.by_node("meridian_router_requests")

    async def by_node(self, name: str) -> dict[str, float]:
        """A counter's samples summed per `node` label over every router (and other labels)."""
        counts: dict[str, float] = {}
        for labels, value in await self.samples(name):
            node = labels.get("node")
            if node:
                counts[node] = counts.get(node, 0.0) + value
        return counts

    async def ejections(self, node_ids: Iterable[str]) -> dict[str, float]:
        """How often the routers have ejected each node so far (summed over routers)."""
        counts = dict.fromkeys(node_ids, 0.0)
        for labels, value in await self.samples("meridian_router_ejections"):
            node = labels.get("node")
            if node in counts:
                counts[node] += value
        return counts

    async def all_ejected_since(self, before: Mapping[str, float]) -> bool:
        """Whether the routers ejected every node of `before` (counts from ejections()) since."""
        if not before:
            return False
        after = await self.ejections(before)
        return all(after[node] > count for node, count in before.items())

    async def held_by_flow_control(self) -> float:
        """Requests the routers' flow control held for room (waited more than 5 ms) so far."""
        waited = not_held = 0.0
        for _labels, value in await self.samples("meridian_router_flow_wait_seconds_count"):
            waited += value
        for labels, value in await self.samples("meridian_router_flow_wait_seconds_bucket"):
            if labels.get("le") == "0.005":
                not_held += value
        return waited - not_held

    async def samples(self, name: str) -> list[tuple[dict[str, str], float]]:
        """(labels, value) of every sample of metric `name` on every router that answers."""
        samples: list[tuple[dict[str, str], float]] = []
        headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=headers) as http:
            for url in self.router_urls:
                try:
                    response = await http.get(f"{url}/metrics")
                    response.raise_for_status()
                    text = response.text
                except httpx.HTTPError as exc:
                    log.warning("could not scrape %s/metrics: %s", url, exc)
                    continue
                samples += metric_samples(text, name)
        return samples


def metric_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of metric `name` (or its `_total`) in a /metrics text."""
    return [(dict(s.labels), s.value) for family in text_string_to_metric_families(text)
            for s in family.samples if s.name in (name, f"{name}_total")]


async def answers(url: str, path: str = "/health") -> bool:
    """Whether `url` answers `path` with 200 right now."""
    try:
        async with httpx.AsyncClient(timeout=2.0) as http:
            return (await http.get(url + path)).status_code == 200
    except httpx.HTTPError:
        return False


T = TypeVar("T")


def busiest(candidates: Sequence[T], node_id: Callable[[T], str], served: Mapping[str, float], seed: int) -> T:
    """The candidate the routers sent the most requests to (a fault on an idle node proves
    nothing); a seeded choice among ties, so a run can be repeated."""
    top = max(served.get(node_id(c), 0.0) for c in candidates)
    return random.Random(seed).choice([c for c in candidates if served.get(node_id(c), 0.0) == top])
