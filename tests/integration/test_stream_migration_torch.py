"""Stream migration on the torch engine: a real node, a real router, the stream cut mid-way.

Greedy streams are broken at several points (first token, early, middle, near the end,
inside a stop string that two tokens make) by resetting the connection under them (a
killed node; frozen nodes are the unit tests' and the gray drill's);
the router resumes each on the same engine under another name, and the client's stream
must be token-identical to an unbroken run: same ids, same text, one `id`, usage that
counts every token received; the router's access line names where it resumed and how many
tokens came before the break and after.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from migration_fabric import MigrationRig, stream, stream_response, torch_rig
from openai.types.responses import ResponseCompletedEvent
from tenant_fabric import MODEL

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "write a long poem about the sea"}],
        "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True}}
COMPLETION = {"model": MODEL, "prompt": "the sea is", "max_tokens": 48, "temperature": 0, "ignore_eos": True,
              "stream": True, "return_token_ids": True}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[MigrationRig]:
    async with torch_rig(tmp_path_factory.mktemp("migration"), inter_token_timeout_s=1.0) as r:
        yield r


@pytest.mark.parametrize("break_after", [1, 7, 24, 42])
@pytest.mark.parametrize("route,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)],
                         ids=["chat", "completions"])
async def test_a_killed_stream_resumes_token_identical(rig: MigrationRig, route: str, body: dict[str, object],
                                                       break_after: int, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="meridian.access")
    unbroken = await stream(rig, route, body)
    assert unbroken.done and unbroken.trailer is None and len(unbroken.token_ids) == 48
    got = await stream(rig, route, body, break_after=break_after)
    assert got.error is None and got.done
    assert got.token_ids == unbroken.token_ids and got.text == unbroken.text
    assert len({e["id"] for e in got.events}) == 1
    assert got.trailer is not None and got.trailer["node"] == "far"
    if "stream_options" in body:
        assert got.events[-1]["usage"]["completion_tokens"] == 48
    line = await access_line(caplog, got.request_id)
    assert (line.node, line.migrations, line.resumed_on) == ("near", 1, "far")  # type: ignore[attr-defined]
    # The router may have read a few tokens more than the client had when the path broke.
    before, after = line.tokens_before_break, line.tokens_after_resume  # type: ignore[attr-defined]
    assert break_after <= before < 48 and before + after == 48


async def access_line(caplog: pytest.LogCaptureFixture, request_id: str) -> logging.LogRecord:
    """The router's access line of `request_id`: written as the stream closes, just after the
    client read its end."""
    for _ in range(100):
        lines = [r for r in caplog.records if r.name == "meridian.access" and r.request_id == request_id]  # type: ignore[attr-defined]
        if lines:
            return lines[0]
        await asyncio.sleep(0.05)
    raise AssertionError(f"no access line for {request_id}")


async def test_a_stop_string_across_the_seam_stops_as_it_would_unbroken(rig: MigrationRig) -> None:
    unbroken = await stream(rig, "/v1/completions", COMPLETION)
    texts = [c.get("text") or "" for e in unbroken.events for c in e["choices"]]
    k = next(i for i in range(20, 40) if len(texts[i]) >= 2 and len(texts[i + 1]) >= 2)
    stop = texts[k][-2:] + texts[k + 1][:2]  # a stop string that two tokens make
    body = {**COMPLETION, "stop": [stop]}
    stopped = await stream(rig, "/v1/completions", body)
    assert stopped.text == unbroken.text[: unbroken.text.find(stop)] and len(stopped.token_ids) == k + 2
    for at in (k - 1, k, k + 1):
        got = await stream(rig, "/v1/completions", body, break_after=at)
        assert got.error is None and got.text == stopped.text, at
        assert got.token_ids == stopped.token_ids, at
        assert got.trailer is not None and got.trailer["migrations"] == 1, at
        assert [c["finish_reason"] for e in got.events for c in e["choices"] if c.get("finish_reason")] == ["stop"]


RESPONSE = {"model": MODEL, "input": "write a long poem about the sea", "instructions": "you are a poet",
            "max_output_tokens": 48, "temperature": 0, "store": False, "extra_body": {"ignore_eos": True}}


@pytest.mark.parametrize("break_after", [1, 24, 42])
async def test_a_killed_responses_stream_resumes_token_identical(rig: MigrationRig, break_after: int,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="meridian.access")
    # The torch engine serves no /v1/responses: the router serves it as a chat completion.
    unbroken = await stream_response(rig, RESPONSE)
    done = unbroken.completed.response
    assert done.usage.output_tokens == 48 and done.output_text == unbroken.text and unbroken.text
    got = await stream_response(rig, RESPONSE, break_after=break_after)
    assert got.text == unbroken.text and got.types == unbroken.types
    usage = got.completed.response.usage
    # (A migrated stream's usage is the router's count: it knows no prefix-cache hits.)
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (
        done.usage.input_tokens, 48, done.usage.total_tokens)
    assert got.completed.response.output_text == unbroken.text
    assert len({e.response.id for e in got.events if hasattr(e, "response")}) == 1
    assert [e.sequence_number for e in got.events] == list(range(len(got.events)))
    assert isinstance(got.events[-1], ResponseCompletedEvent) and got.events[-1].response.status == "incomplete"
    trailer = (got.completed.model_extra or {}).get("meridian")
    assert trailer is not None and trailer["node"] == "far" and trailer["migrations"] == 1
    line = await access_line(caplog, got.request_id)
    assert line.resumed_on == "far" and line.tokens_before_break + line.tokens_after_resume == 48  # type: ignore[attr-defined]
