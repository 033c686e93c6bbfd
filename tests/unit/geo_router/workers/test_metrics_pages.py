"""One /metrics page for several workers (geo_router.workers.metrics_pages): each worker's
series kept apart by a `worker` label, a sibling that does not answer left out and counted."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from geo_router.workers import WorkerSlot
from geo_router.workers.metrics_pages import PageServer, gathered_page, merge_pages


def page(requests: int) -> bytes:
    registry = CollectorRegistry()
    counter = Counter("meridian_router_requests", "Requests.", ["node"], registry=registry)
    counter.labels("eu-1").inc(requests)
    latency = Histogram("meridian_router_latency_seconds", "Latency.", registry=registry, buckets=(0.1, 1.0))
    latency.observe(0.05)
    return generate_latest(registry)


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name == name}


def test_each_workers_series_keeps_its_own_label_and_families_stay_whole() -> None:
    merged = merge_pages({0: page(3).decode(), 1: page(4).decode()}, 2).decode()
    assert samples(merged, "meridian_router_requests_total") == {
        (("node", "eu-1"), ("worker", "0")): 3.0, (("node", "eu-1"), ("worker", "1")): 4.0}
    assert samples(merged, "meridian_router_latency_seconds_count") == {
        (("worker", "0"),): 1.0, (("worker", "1"),): 1.0}
    assert merged.count("# TYPE meridian_router_requests_total counter") == 1
    assert samples(merged, "meridian_router_workers_scraped") == {(): 2.0}


async def test_a_scrape_gathers_the_siblings_and_counts_the_missing(tmp_path: Path) -> None:
    slots = [WorkerSlot(i, 3, tmp_path) for i in range(3)]
    sibling = PageServer(slots[1], lambda: page(7))
    await sibling.start()  # worker 2 is down (restarting)
    try:
        merged = (await gathered_page(slots[0], page(1))).decode()
    finally:
        await sibling.stop()
    assert samples(merged, "meridian_router_requests_total") == {
        (("node", "eu-1"), ("worker", "0")): 1.0, (("node", "eu-1"), ("worker", "1")): 7.0}
    assert samples(merged, "meridian_router_workers_scraped") == {(): 2.0}
    assert samples(merged, "meridian_router_workers") == {(): 3.0}
    assert not slots[1].metrics_socket(1).exists()
