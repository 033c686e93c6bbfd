"""Debian's Prometheus server (`prometheus`, the package CI installs for promtool) on a free
loopback port, scraping what a test names every second, with Meridian's rules loaded.

Without the binary the fixture skips, except where services are required (CI,
MERIDIAN_REQUIRE_SERVICES=1): it fails there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from meridian.ports import free_port

RULES = Path(__file__).parents[2] / "observability" / "prometheus" / "alerts.yml"


@dataclass(frozen=True)
class ScrapeJob:
    name: str
    targets: list[str]  # host:port
    labels: dict[str, str]
    token: str | None = None


def require_prometheus() -> str:
    path = shutil.which("prometheus")
    if path is None:
        message = "prometheus is not installed (apt-get install prometheus)"
        if os.environ.get("MERIDIAN_REQUIRE_SERVICES") == "1":
            pytest.fail(f"{message} (MERIDIAN_REQUIRE_SERVICES=1)", pytrace=False)
        pytest.skip(message)
    return path


def _config(jobs: list[ScrapeJob], work: Path) -> dict[str, Any]:
    scrape = []
    for job in jobs:
        entry: dict[str, Any] = {"job_name": job.name, "static_configs": [{"targets": job.targets, "labels": job.labels}]}
        if job.token is not None:
            token_file = work / f"{job.name}.token"
            token_file.write_text(job.token)
            entry["authorization"] = {"credentials_file": str(token_file)}
        scrape.append(entry)
    shutil.copy(RULES, work / RULES.name)
    return {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [RULES.name], "scrape_configs": scrape}


@contextlib.contextmanager
def prometheus(jobs: list[ScrapeJob], work: Path) -> Iterator[str]:
    """The URL of a Prometheus scraping `jobs` until the block ends."""
    binary = require_prometheus()
    work.mkdir(parents=True, exist_ok=True)
    (work / "prometheus.yml").write_text(yaml.safe_dump(_config(jobs, work)))
    port = free_port()
    log = (work / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=work)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, (work / "prometheus.log").read_text()[-2000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        log.close()


def query(url: str, expr: str) -> list[dict[str, Any]]:
    """An instant query's result vector (a PromQL error fails the test)."""
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "success", f"{expr}: {r.text}"
    result: list[dict[str, Any]] = r.json()["data"]["result"]
    return result


def wait_until_scraped(url: str, timeout_s: float = 30.0) -> None:
    """Every target scraped successfully at least once (else fail with their errors)."""
    deadline = time.monotonic() + timeout_s
    while True:
        targets = httpx.get(f"{url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        if targets and all(t["health"] == "up" for t in targets):
            return
        if time.monotonic() > deadline:
            pytest.fail("scrape targets not up: " + "; ".join(
                f"{t['scrapeUrl']}: {t['health']} {t['lastError']}" for t in targets), pytrace=False)
        time.sleep(0.5)
