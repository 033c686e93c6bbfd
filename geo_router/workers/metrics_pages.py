"""One /metrics page for N workers: whichever worker is scraped gathers its siblings' pages.

A scrape reaches one worker (the kernel picks it, as for any connection), yet must see the
whole router. Each worker serves its own page, unauthenticated and raw, on a Unix socket in
the supervisor's private directory (mode 0700: only the router's user reaches it); the
scraped worker reads every sibling's page and answers one page in which each series carries
a `worker` label ("0".."N-1"), so `sum without (worker)` gives the router's figure. A sibling
that does not answer within _READ_TIMEOUT_S (restarting, say) is left out of that scrape, and
the page says so in `meridian_router_workers_scraped`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator

from prometheus_client import generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from . import WorkerSlot

log = logging.getLogger(__name__)

# A sibling's page must arrive within this, or the scrape goes on without it.
_READ_TIMEOUT_S = 2.0
# A page larger than this is not a metrics page.
_MAX_PAGE_BYTES = 64 << 20


class PageServer:
    """Serves this worker's own page on its Unix socket to the sibling being scraped."""

    def __init__(self, slot: WorkerSlot, render: Callable[[], bytes]) -> None:
        self._path = slot.metrics_socket(slot.index)
        self._render = render
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._path.unlink(missing_ok=True)  # left by the worker this one replaces
        self._server = await asyncio.start_unix_server(self._answer, path=str(self._path))

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self._path.unlink(missing_ok=True)

    async def _answer(self, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(self._render())
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


async def gathered_page(slot: WorkerSlot, own: bytes) -> bytes:
    """Every worker's page as one, each series labelled with its worker."""
    others = [i for i in range(slot.count) if i != slot.index]
    pages = await asyncio.gather(*(_sibling_page(slot, i) for i in others))
    by_worker = {slot.index: own.decode("utf-8")} | {
        i: page for i, page in zip(others, pages, strict=True) if page is not None
    }
    return merge_pages(by_worker, slot.count)


async def _sibling_page(slot: WorkerSlot, index: int) -> str | None:
    try:
        async with asyncio.timeout(_READ_TIMEOUT_S):
            reader, writer = await asyncio.open_unix_connection(str(slot.metrics_socket(index)),
                                                                limit=_MAX_PAGE_BYTES)
            try:
                data = await reader.read(_MAX_PAGE_BYTES)
            finally:
                writer.close()
        return data.decode("utf-8")
    except (OSError, TimeoutError, UnicodeDecodeError) as exc:
        log.info("metrics: worker %d did not answer (%s); its series are left out of this scrape",
                 index, type(exc).__name__)
        return None


def merge_pages(pages: dict[int, str], workers: int) -> bytes:
    """One exposition page of `pages` (worker index -> its page; of `workers` in all), each
    series labelled `worker`."""
    families: dict[str, Metric] = {}
    for worker, page in sorted(pages.items()):
        label = str(worker)
        for family in text_string_to_metric_families(page):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                         family.unit)
            merged.samples.extend(
                Sample(s.name, {"worker": label, **s.labels}, s.value, s.timestamp, s.exemplar)
                for s in family.samples
            )
    scraped = GaugeMetricFamily("meridian_router_workers_scraped",
                                "Workers whose series this page holds (of meridian_router_workers).")
    scraped.add_metric([], len(pages))
    total = GaugeMetricFamily("meridian_router_workers", "Worker processes of this router.")
    total.add_metric([], workers)
    return generate_latest(_Families([*families.values(), scraped, total]))


class _Families:
    """A collector of ready families (generate_latest's argument)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
