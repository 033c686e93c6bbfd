"""bench.migration's reading of what clients received: a seam is where the router's journal
says the continuation began (not the stream's largest gap), a stream is broken unless it
ended with [DONE] and no error, and a mismatch is any difference from the reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.migration import (
    Phase,
    StreamResult,
    figures,
    mismatches,
    pick_victim,
    read_event,
    read_seams,
    seams,
)


def _stream(prompt: int, ids: list[int], at: list[float], *, request_id: str = "", migrations: int = 0,
            node: str = "n1") -> StreamResult:
    s = StreamResult(prompt, node=node, status=200, request_id=request_id, opened=at[0] - 0.01)
    for i, t in zip(ids, at, strict=True):
        read_event(s, json.dumps({"choices": [{"delta": {"content": f"<{i}>"}, "token_ids": [i]}]}), t)
    if migrations:
        read_event(s, json.dumps({"choices": [], "meridian": {"migrations": migrations, "node": "n2"}}), at[-1])
    read_event(s, "[DONE]", at[-1])
    return s


def test_the_seam_is_where_the_journal_says_not_the_largest_gap(tmp_path: Path) -> None:
    # Token 2 came 0.3 s after token 1 (the seam); a longer wait later is a busy node, not a seam.
    s = _stream(0, [5, 6, 7, 8], [1.0, 1.001, 1.301, 2.0], request_id="r1", migrations=1)
    journal = tmp_path / "router.jsonl"
    journal.write_text("\n".join(json.dumps(r) for r in [
        {"type": "routed", "key": "r1", "node": "n1", "region": "a", "attempt": 1},
        {"type": "routed", "key": "r1", "node": "n2", "region": "a", "attempt": 1, "migration": 1,
         "resume_tokens": 2},
        {"type": "routed", "key": "other", "node": "n2", "region": "a", "attempt": 1, "migration": 1,
         "resume_tokens": 1},
    ]) + "\n")
    read_seams(journal, [s])
    assert s.resumed_at == [2]
    assert seams(s) == [pytest.approx(0.3)]
    assert s.final_node == "n2" and s.migrations == 1


def test_a_stream_is_broken_without_done_or_with_an_error_event() -> None:
    whole = _stream(0, [1, 2], [1.0, 1.1])
    cut = StreamResult(0, status=200)
    read_event(cut, json.dumps({"choices": [{"delta": {"content": "x"}, "token_ids": [1]}]}), 1.0)
    failed = StreamResult(0, status=200)
    read_event(failed, json.dumps({"error": {"message": "gone", "code": "upstream_disconnected"}}), 1.0)
    read_event(failed, "[DONE]", 1.1)
    assert not whole.broken and cut.broken and failed.broken and StreamResult(0, status=503, done=True).broken


def test_mismatches_count_finished_streams_that_differ_from_the_reference() -> None:
    ref = {0: _stream(0, [1, 2, 3], [1.0, 1.1, 1.2])}
    same, other = _stream(0, [1, 2, 3], [2.0, 2.1, 2.2]), _stream(0, [1, 2, 4], [2.0, 2.1, 2.2])
    cut = StreamResult(0, status=200, ids=[9])
    assert mismatches([same, other, cut], ref) == (1, 1)


def test_the_victim_is_the_busiest_live_node_and_never_the_last() -> None:
    flight = {1: "a", 2: "b", 3: "b", 4: "dead"}
    assert pick_victim(["a", "b"], flight) == "b"
    assert pick_victim(["a"], flight) is None
    assert pick_victim(["a", "c"], {}) is None


def test_figures_keep_the_contract_names() -> None:
    ref = {0: _stream(0, [1, 2, 3], [1.0, 1.1, 1.2])}
    calm = Phase([_stream(0, [1, 2, 3], [1.0, 1.01, 1.02])], 1.0)
    moved = _stream(0, [1, 2, 3], [2.0, 2.01, 2.2], migrations=1)
    moved.resumed_at = [2]
    names = [f.metric for f in figures(calm, Phase([moved], 1.0, kills=[2.05]), ref, 3.0)]
    assert {"broken_streams", "token_mismatches", "resume_p50_ms", "resume_p99_ms", "resume_p99_vs_itl",
            "throughput_under_crashes"} <= set(names)
