"""The whole path, client → router → node, through the official OpenAI client."""

import json

import httpx
import openai
import pytest

from localfabric import DEMO_MODEL, LocalFabric
from meridian.contracts import HEADER_NODE, HEADER_OVERHEAD_MS, HEADER_REGION, HEADER_REQUEST_ID

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Say something about the sea."}]


def _client(fabric: LocalFabric, zone: str) -> openai.OpenAI:
    assert fabric.info is not None
    return openai.OpenAI(base_url=fabric.info.router_url + "/v1", api_key=fabric.info.keys[zone],
                         max_retries=0, timeout=60)


def test_errors_are_openai_json_never_tracebacks(fabric: LocalFabric):
    client = _client(fabric, "global")
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4)
    assert nf.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as br:
        client.chat.completions.create(model=DEMO_MODEL, messages=MESSAGES, temperature=5.0)
    assert "temperature" in json.dumps(br.value.body)
    bad_key = openai.OpenAI(base_url=fabric.info.router_url + "/v1", api_key="mrd_not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.chat.completions.create(model=DEMO_MODEL, messages=MESSAGES, max_tokens=4)
    r = httpx.post(fabric.info.router_url + "/v1/chat/completions", content=b"{not json",
                   headers={"authorization": f"Bearer {fabric.info.keys['global']}",
                            "content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "error" in r.json() and "Traceback" not in r.text
    # Tenants cannot bypass the router (and its residency check) by calling a node.
    node_url = fabric.info.nodes["gcp:europe-west4"].url
    r = httpx.post(node_url + "/v1/chat/completions", timeout=30,
                   json={"model": DEMO_MODEL, "messages": MESSAGES, "max_tokens": 2},
                   headers={"authorization": f"Bearer {fabric.info.keys['us']}"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_chat_stream_completion_then_failover_to_next_region(fabric: LocalFabric):
    client = _client(fabric, "global")

    raw = client.chat.completions.with_raw_response.create(
        model=DEMO_MODEL, messages=MESSAGES, max_tokens=8, seed=7)
    # The client sits by aws:us-east-1 (the router's default location), the nearest region.
    assert raw.headers[HEADER_REGION] == "aws:us-east-1"
    assert raw.headers[HEADER_NODE] and raw.headers[HEADER_REQUEST_ID]
    assert float(raw.headers[HEADER_OVERHEAD_MS]) >= 0
    chat = raw.parse()
    assert chat.model == DEMO_MODEL
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert 0 < chat.usage.completion_tokens <= 8 and chat.usage.prompt_tokens > 0

    with client.chat.completions.with_streaming_response.create(
        model=DEMO_MODEL, messages=MESSAGES, max_tokens=8, seed=7, stream=True
    ) as resp:
        assert resp.headers[HEADER_REGION] == "aws:us-east-1"
        chunks = list(resp.parse())
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") or chunks[-2].choices[0].finish_reason
    # Same seed, same model, same prompt: streaming and non-streaming agree.
    assert streamed == chat.choices[0].message.content

    comp = client.completions.create(model=DEMO_MODEL, prompt="Once upon a time", max_tokens=6)
    assert comp.choices[0].text is not None and 0 < comp.usage.completion_tokens <= 6

    # A trusted edge header moves the client to Tokyo: the on-prem region is now nearest.
    raw = client.chat.completions.with_raw_response.create(
        model=DEMO_MODEL, messages=MESSAGES, max_tokens=4,
        extra_headers={"x-meridian-client-location": "35.6,139.7"})
    assert raw.headers[HEADER_REGION] == "onprem:tokyo-1"

    fabric.kill_node("aws:us-east-1")
    raw = client.chat.completions.with_raw_response.create(model=DEMO_MODEL, messages=MESSAGES, max_tokens=4)
    assert raw.headers[HEADER_REGION] in ("gcp:europe-west4", "onprem:tokyo-1")
    assert raw.parse().choices[0].message.content is not None


def test_eu_key_is_never_served_outside_eu(fabric: LocalFabric):
    client = _client(fabric, "eu")
    # Even a client standing next to the US and Tokyo regions is served in the EU.
    for location in ("aws:us-east-1", "35.6,139.7"):
        raw = client.chat.completions.with_raw_response.create(
            model=DEMO_MODEL, messages=MESSAGES, max_tokens=4,
            extra_headers={"x-meridian-client-location": location})
        assert raw.headers[HEADER_REGION] == "gcp:europe-west4"

    fabric.kill_node("gcp:europe-west4")
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(
                model=DEMO_MODEL, messages=MESSAGES, max_tokens=4, stream=stream,
                extra_headers={"x-meridian-client-location": "aws:us-east-1",
                               # A client cannot talk its way out of its zone.
                               "x-meridian-zone": "us", "x-meridian-residency": "global"})
        assert e.value.status_code == 503
        assert e.value.body["code"] == "no_replica_in_zone"
        assert "eu" in e.value.body["message"]

    # Other tenants are unaffected: the global key is still served (outside the EU).
    raw = _client(fabric, "global").chat.completions.with_raw_response.create(
        model=DEMO_MODEL, messages=MESSAGES, max_tokens=4)
    assert raw.headers[HEADER_REGION] != "gcp:europe-west4"
