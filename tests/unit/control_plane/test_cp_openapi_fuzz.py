"""Fuzz every operation of the published OpenAPI spec (schemathesis): no input makes the API answer
5xx, and every error it answers is the problem+json body the spec documents for that status.

Valid and invalid inputs both (schemathesis' positive and negative modes), on SQLite. Admin
operations go with the admin key, node and router operations with the cluster token, so that
requests get past authentication to the code that parses and stores them. Seeded: a run is
reproducible.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from cp_harness import ADMIN_KEY, CLUSTER_TOKEN
from fastapi import FastAPI
from hypothesis import HealthCheck, settings
from pydantic import SecretStr
from schemathesis.checks import (
    CheckContext,
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
)
from schemathesis.python import asgi as schemathesis_asgi

from control_plane.app import create_app
from meridian.settings.control_plane import ControlPlaneSettings

EXAMPLES_PER_OPERATION = 20


def _fuzz_settings(database: Path) -> ControlPlaneSettings:
    values: dict[str, Any] = {
        "database_url": f"sqlite:///{database}",
        "cluster_token": SecretStr(CLUSTER_TOKEN),
        "bootstrap_admin_key": SecretStr(ADMIN_KEY),
        # Long-polls the fuzzer sends (If-None-Match: * with ?wait=) return at once.
        "max_long_poll_s": 0.01,
        "max_request_bytes": 65_536,
    }
    # The fleet loops act on what the fuzzer creates; they are not under test here.
    for loop in ("reconciler_enabled", "autoscaler_enabled"):
        if loop in ControlPlaneSettings.model_fields:
            values[loop] = False
    return ControlPlaneSettings(**values)


def _cluster_token_operations(spec: dict[str, Any]) -> frozenset[tuple[str, str]]:
    """(METHOD, path) of every operation whose published security scheme is the cluster token."""
    return frozenset(
        (method.upper(), path)
        for path, operations in spec["paths"].items()
        for method, operation in operations.items()
        if any("clusterToken" in requirement for requirement in operation.get("security", []))
    )


def _published_spec() -> dict[str, Any]:
    """The app's OpenAPI document; building it touches no database."""
    return create_app(_fuzz_settings(Path("unused.db"))).openapi()


# Loaded from the spec at collection (not from a fixture: schemathesis' lazy loader does not run
# on pytest 9); requests go to the fixture's app through an in-process ASGI session.
SPEC = _published_spec()
CLUSTER_TOKEN_OPERATIONS = _cluster_token_operations(SPEC)
schema = schemathesis.openapi.from_dict(SPEC)


def test_the_spec_says_which_operations_take_the_cluster_token() -> None:
    assert ("POST", "/v1/nodes/register") in CLUSTER_TOKEN_OPERATIONS
    assert ("GET", "/v1/routing-table") in CLUSTER_TOKEN_OPERATIONS
    assert ("GET", "/v1/nodes") not in CLUSTER_TOKEN_OPERATIONS
    assert all(
        operation.get("security") for path, operations in SPEC["paths"].items() if path != "/health"
        for operation in operations.values()
    )


@pytest.fixture(scope="module")
def fuzzed_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FastAPI]:
    app = create_app(_fuzz_settings(tmp_path_factory.mktemp("fuzz") / "control-plane.db"))
    yield app
    # schemathesis ran the app's lifespan (migrations, reaper) in its own event loop thread.
    schemathesis_asgi.shutdown_lifespans()


@pytest.fixture(scope="module")
def session(fuzzed_app: FastAPI) -> Iterator[schemathesis_asgi.ASGIClient]:
    with schemathesis_asgi.get_client(fuzzed_app) as client:
        yield client


def errors_are_documented_problems(ctx: CheckContext, response: schemathesis.Response, case: schemathesis.Case) -> bool:
    """A 4xx answers with the media type and schema the spec gives its status (a Problem)."""
    if response.status_code >= 400:
        content_type_conformance(ctx, response, case)
        response_schema_conformance(ctx, response, case)
    return True


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_no_input_makes_a_server_error(case: schemathesis.Case, session: schemathesis_asgi.ASGIClient) -> None:
    secret = CLUSTER_TOKEN if (case.method.upper(), case.path) in CLUSTER_TOKEN_OPERATIONS else ADMIN_KEY
    response = case.call(base_url=session.base_url, session=session, headers={"Authorization": f"Bearer {secret}"})
    case.validate_response(response, checks=[not_a_server_error, errors_are_documented_problems])
