"""Scale-from-zero on a local fabric: a deployment with no node, a request, a node started for it."""

from collections.abc import Iterator

import httpx
import openai
import pytest
from e2e_fabric import e2e_spec, running

from localfabric import LocalDeployment, LocalFabric
from meridian.contracts import HEADER_REGION, HEADER_SCALE_WAIT_MS

pytestmark = pytest.mark.e2e

COLD_MODEL = "tiny-llama-cold"
MESSAGES = [{"role": "user", "content": "Say something about the sea."}]


@pytest.fixture(scope="module")
def cold_fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFabric]:
    spec = e2e_spec(
        tmp_path_factory.mktemp("cold-fabric"),
        regions=(),  # no node at all until a request asks for one
        deployments=(LocalDeployment(COLD_MODEL, zone="global", min_replicas=0, max_replicas=1),),
        scaler_interval_s=0.2,
    )
    yield from running(spec)


def test_a_request_scales_a_deployment_up_from_zero(cold_fabric: LocalFabric):
    info = cold_fabric.info
    assert info is not None
    admin = httpx.Client(base_url=info.control_plane_url, timeout=10,
                         headers={"authorization": f"Bearer {info.admin_key}"})
    assert admin.get("/v1/nodes").json() == []
    assert admin.get(f"/v1/deployments/{COLD_MODEL}").json()["desired_replicas"] == 0

    # An EU tenant: the replica must be started where it may be served.
    client = openai.OpenAI(base_url=info.router_url + "/v1", api_key=info.keys["eu"], max_retries=0,
                           timeout=120)
    raw = client.chat.completions.with_raw_response.create(model=COLD_MODEL, messages=MESSAGES, max_tokens=4)
    assert int(raw.headers[HEADER_SCALE_WAIT_MS]) > 0
    chat = raw.parse()
    assert chat.model == COLD_MODEL and chat.choices[0].message.content is not None

    region = raw.headers[HEADER_REGION]
    zones = {r["name"]: r["zones"] for r in admin.get("/v1/regions").json()}
    assert "eu" in zones[region]
    scaled = cold_fabric.scaled_nodes(COLD_MODEL)
    assert [p.region for p in scaled] == [region]
    deployment = admin.get(f"/v1/deployments/{COLD_MODEL}").json()
    assert deployment["desired_replicas"] == 1
    assert deployment["last_scale_reason"].startswith("scale-from-zero")
    assert deployment["last_scale_region"] == region

    # Warm now: served at once, and the scaler starts nothing more.
    raw = client.chat.completions.with_raw_response.create(model=COLD_MODEL, messages=MESSAGES, max_tokens=4)
    assert HEADER_SCALE_WAIT_MS not in raw.headers and raw.headers[HEADER_REGION] == region
    assert len(cold_fabric.scaled_nodes(COLD_MODEL)) == 1
    admin.close()
