"""What the local fabric's children inherit of the launcher's MERIDIAN_* environment: every
setting (tracing, limits, policies), except those that would make its processes collide or
leave its loopback HTTP (tests/e2e/test_fabric_tracing.py starts a fabric this way and
gets its spans); and `meridian demo --otlp-endpoint` refuses what is not a URL."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from localfabric.fabric import passed_through

PASSED = {
    "MERIDIAN_ROUTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
    "MERIDIAN_NODE_OTLP_ENDPOINT": "http://127.0.0.1:4318",
    "MERIDIAN_ROUTER_OTLP_ZONE_ENDPOINTS": '{"eu": "http://otel.eu:4318"}',
    "MERIDIAN_ROUTER_ROUTING_POLICY": "least-load",
    "MERIDIAN_NODE_MAX_NUM_SEQS": "8",
    "MERIDIAN_LOG_FORMAT": "json",
    "MERIDIAN_WEIGHTS_S3_ENDPOINT_URL": "http://127.0.0.1:9000",
    "MERIDIAN_ROUTER_REDIS_URL": "redis://127.0.0.1:6379/0",
    "PATH": "/usr/bin",
}
KEPT_BACK = {
    "MERIDIAN_CONFIG": "/etc/meridian/production.yaml",
    "MERIDIAN_ROUTER_PORT": "9999",
    "MERIDIAN_ROUTER_METRICS_PORT": "9100",
    "MERIDIAN_ROUTER_GRPC_HOST": "0.0.0.0",
    "MERIDIAN_NODE_VLLM_KV_EVENTS_REPLAY_PORT": "5558",
    "MERIDIAN_CP_HOST": "10.0.0.1",
    "MERIDIAN_NODE_ADVERTISE_URL": "http://10.0.0.5:8000",
    "MERIDIAN_NODE_KV_EVENTS_ADVERTISE": "tcp://10.0.0.5:5557",
    "MERIDIAN_NODE_REQUEST_JOURNAL_PATH": "/var/log/node.jsonl",
    "MERIDIAN_ROUTER_REQUEST_JOURNAL_PATH": "/var/log/router.jsonl",
    "MERIDIAN_ROUTER_TLS_CERT_FILE": "/etc/tls/cert.pem",
    "MERIDIAN_NODE_ROLE": "prefill",
    "MERIDIAN_NODE_ENGINE": "vllm",
    "MERIDIAN_NODE_MODEL_DIR": "/models/llama",
}


def test_every_setting_passes_to_the_children_but_those_that_would_collide():
    assert passed_through(PASSED | KEPT_BACK) == PASSED


@pytest.mark.parametrize("endpoint", ["localhost:4318", "grpc://127.0.0.1:4317", "http://", "http://host:port"])
def test_the_demo_refuses_an_otlp_endpoint_that_is_not_an_http_url(tmp_path: Path, endpoint: str):
    work = tmp_path / "work"
    r = CliRunner().invoke(app, ["demo", "--work-dir", str(work), "--port", "0", "--otlp-endpoint", endpoint],
                           env={"COLUMNS": "200"})
    assert r.exit_code == 2, r.output
    assert "--otlp-endpoint must be an http:// or https:// URL" in r.output and "Traceback" not in r.output
    assert not work.exists()
