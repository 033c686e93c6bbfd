"""Long streams struck mid-generation, judged against their reference: what the client
read (chaos.streams), the history round trip, and the checker's stream criteria."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chaos.checker import check
from chaos.drill import DRILLS_DIR, Drill, load_drill
from chaos.faults.mid_stream import pick_victims
from chaos.history import ClientOp, History, HistoryWriter, Outcome, Reference, Routed, Served, StreamDetail
from chaos.stream_check import compare
from chaos.streams import StreamReading, StreamTracker, split_tenants
from localfabric import Proc

ZONES = {"aws:us-east-1": ["us"], "gcp:europe-west4": ["eu"], "onprem:tokyo-1": ["apac"]}
REF = tuple(range(100, 140))  # the reference's 40 token ids
REF_TEXT = "".join(f"<{t}>" for t in REF)


def drill(**streams: object) -> Drill:
    """A 30 s mid-stream drill (fault [10, 20) s) whose pass.streams are the given criteria."""
    return Drill.model_validate({
        "name": "t", "description": "test drill",
        "steady_state": {"min_success_rate": 0.99, "window_s": 5},
        "load": {"arrivals_per_s": 1, "duration_s": 30, "streaming_fraction": 0,
                 "tenants": [{"name": "g", "zone": "global", "weight": 1}, {"name": "e", "zone": "eu", "weight": 1}],
                 "long_streams": {"count": 4, "at_s": 10, "max_tokens": 40, "return_token_ids": True}},
        "fault": {"kind": "mid_stream_crash", "target": {"region": "aws:us-east-1"}, "start_s": 10, "end_s": 20},
        "pass": {"streams": {"max_resume_p99_s": 1.0, **streams}},
    })


def text(ids: tuple[int, ...]) -> str:
    return "".join(f"<{t}>" for t in ids)


def stream(h: History, key: str, ids: tuple[int, ...], *, zone: str = "global", done: bool = True,
           error: str | None = None, migrations: int = 1, final_region: str = "gcp:europe-west4",
           resume_at: int | None = 20, gap_s: float = 0.4, response_ids: tuple[str, ...] = ("chatcmpl-1",),
           first_region: str | None = None) -> None:
    """A long stream that ran on `first_region` (us-east-1, europe-west4 for eu), resumed
    (migration 1) at token `resume_at`."""
    first_region = first_region or ("gcp:europe-west4" if zone == "eu" else "aws:us-east-1")
    tenant = "g" if zone == "global" else "e"
    outcome = Outcome.OK if done and error is None else Outcome.FAIL
    detail = StreamDetail(text=text(ids), token_ids=ids, ids=response_ids, events=len(ids),
                          finish_reason="length" if done else None, prompt_tokens=30,
                          completion_tokens=len(ids) if done else None, done=done, error_code=error,
                          migrations=migrations if done else 0, final_region=final_region if done else None,
                          longest_gap_s=gap_s, longest_gap_end_s=11.0)
    h.client.append(ClientOp(key, tenant, zone, True, 10.0, 10.1, 12.0, outcome, 200, error_code=error,
                             region=first_region, stream_error_event=error is not None, detail=detail))
    h.routed.append(Routed(key, "n1", first_region, 1))
    if resume_at is not None and (done or migrations):
        h.routed.append(Routed(key, "n2", final_region, 1, migration=1, resume_tokens=resume_at))
    if done:
        h.served.append(Served(key, "n2", True))
    h.reference.append(Reference(key, REF_TEXT, len(REF), "length", REF, prompt_tokens=30,
                                 prefill_s=0.05 if key == "k0" else None))


def failures(h: History, d: Drill) -> dict[str, str]:
    """The failed criteria but the steady state's (these histories hold long streams only)."""
    verdict = check(h, d, ZONES).verdict(d)
    return {c.name: c.detail for c in verdict.failures() if c.name != "steady_state_before_fault"}


def test_streams_resumed_token_exact_pass_and_the_resume_bound_adds_one_prefill() -> None:
    h = History()
    stream(h, "k0", REF, gap_s=1.02)  # over 1 s, but within 1 s + the 0.05 s prefill
    stream(h, "k1", REF, zone="eu", gap_s=0.3)
    result = check(h, drill(), ZONES)
    assert result.streams is not None
    assert result.streams.migrated == ("k0", "k1")
    assert result.streams.resume_p99_s == pytest.approx(1.02)
    assert failures(h, drill()) == {}
    assert "resume_p99_s" in failures(h, drill(max_resume_p99_s=0.9))


def test_a_duplicated_or_missing_run_at_the_seam_is_a_token_mismatch() -> None:
    h = History()
    stream(h, "dup", REF[:20] + REF[17:37], resume_at=20)  # three tokens sent twice
    stream(h, "gap", REF[:20] + REF[22:40], resume_at=20)  # two tokens never sent
    stream(h, "seam", REF[:20] + (7,) + REF[21:], resume_at=20)  # another token right at the seam
    s = check(h, drill(), ZONES).streams
    assert s is not None
    assert s.token_mismatches == ("dup (3 token(s) duplicated at token 20)", "gap (2 token(s) missing at token 20)",
                                  "seam (another token right at the seam, token 20)")
    assert "token_mismatches" in failures(h, drill())


def test_a_divergence_after_a_seam_is_not_read_as_a_shift_however_well_one_fits() -> None:
    # The continuation matched the reference for 10 tokens after the seam, then took the
    # tokens the reference has 3 further on (as greedy output in a cycle does): a divergence.
    h = History()
    stream(h, "k0", REF[:30] + REF[33:40], resume_at=20)
    s = check(h, drill(), ZONES).streams
    assert s is not None and s.diverged == ("k0",) and s.token_mismatches == ()


def test_a_greedy_divergence_away_from_any_seam_is_counted_apart_within_its_bound() -> None:
    h = History()
    stream(h, "k0", REF[:30] + (1, 2, 3, 4, 5, 6, 7, 8, 9, 10), resume_at=20)
    s = check(h, drill(), ZONES).streams
    assert s is not None and s.diverged == ("k0",) and s.token_mismatches == ()
    assert "diverged_streams" in failures(h, drill())
    assert failures(h, drill(max_diverged_streams=1)) == {}


def test_text_is_compared_whole_when_there_are_no_token_ids() -> None:
    d = StreamDetail(text="abc", done=True)
    assert compare(d, Reference("k", "abc"), [], whole=True) is None
    assert compare(d, Reference("k", "abcd"), [], whole=True) is not None
    assert compare(d, Reference("k", "abcd"), [], whole=False) is None  # a prefix, for a clean error


def test_an_error_event_breaks_a_stream_unless_its_zone_is_left_without_a_replica() -> None:
    h = History()
    stream(h, "k0", REF[:12], zone="eu", done=False, error="upstream_disconnected", migrations=0, resume_at=None,
           first_region="gcp:europe-west4")
    crash = check(h, drill(), ZONES)
    assert crash.streams is not None and crash.streams.broken == ("k0",)
    assert crash.unclean_errors == ("k0",)
    assert {"broken_streams", "unclean_errors"} <= failures(h, drill()).keys()

    gray = drill(unmigratable_zones=["eu"], min_migrated=0)
    result = check(h, gray, ZONES)
    assert result.streams is not None and result.streams.clean_no_replica == ("k0",)
    assert result.clean_errors == ("k0",) and result.streams.broken == ()
    assert "broken_streams" not in failures(h, gray)


def test_a_clean_error_after_text_that_is_not_the_reference_is_a_mismatch() -> None:
    h = History()
    stream(h, "k0", REF[:5] + REF[3:12], zone="eu", done=False, error="upstream_disconnected", migrations=1,
           resume_at=5, first_region="gcp:europe-west4")
    s = check(h, drill(unmigratable_zones=["eu"]), ZONES).streams
    assert s is not None and s.token_mismatches == ("k0 (2 token(s) duplicated at token 5)",)


def test_an_eu_stream_resumed_or_finished_outside_eu_violates_residency() -> None:
    h = History()
    stream(h, "k0", REF, zone="eu", final_region="aws:us-east-1", first_region="gcp:europe-west4")
    s = check(h, drill(), ZONES).streams
    assert s is not None and s.residency_violations == ("k0 (eu tenant e in aws:us-east-1)",)
    assert "stream_residency_violations" in failures(h, drill())


def test_a_second_response_id_or_wrong_usage_shows_the_seam_to_the_client() -> None:
    h = History()
    stream(h, "k0", REF, response_ids=("chatcmpl-1", "cmpl-2"))
    s = check(h, drill(), ZONES).streams
    assert s is not None and s.identity_mismatches == ("k0",)


def test_a_fault_that_moved_no_stream_fails_min_migrated() -> None:
    h = History()
    stream(h, "k0", REF, migrations=0, resume_at=None)
    assert "migrated_streams" in failures(h, drill())


def test_a_stream_with_no_final_record_is_broken() -> None:
    h = History()
    h.client.append(ClientOp("k0", "g", "global", True, 10.0, detail=StreamDetail()))
    s = check(h, drill(), ZONES).streams
    assert s is not None and s.broken == ("k0",)


def test_long_stream_records_survive_the_history_file(tmp_path: Path) -> None:
    h = History()
    stream(h, "k0", REF)
    path = tmp_path / "history.jsonl"
    with HistoryWriter(path) as w:
        for r in [*h.client, *h.routed, *h.served, *h.reference]:
            w.append(r)
    back = History.read(path)
    assert back.client == h.client and back.routed == h.routed and back.reference == h.reference
    # The router's continuation line as meridian.request_journal writes it.
    line = {"type": "routed", "key": "k0", "node": "n", "region": "r:x", "attempt": 1, "migration": 2,
            "resume_tokens": 17}
    path.write_text(json.dumps(line) + "\n")
    assert History.read(path).routed == [Routed("k0", "n", "r:x", 1, migration=2, resume_tokens=17)]


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_reading_keeps_text_ids_usage_the_meridian_field_and_the_longest_gap() -> None:
    clock, tracker = _Clock(), StreamTracker(expected=1)
    reading = StreamReading(0.0, tracker.start("k0"), clock)
    events = [
        (0.1, {"id": "c1", "choices": [{"index": 0, "delta": {"role": "assistant"}, "token_ids": []}],
               "prompt_token_ids": [1, 2]}),
        (0.2, {"id": "c1", "choices": [{"index": 0, "delta": {"content": "ab"}, "token_ids": [5, 6]}]}),
        (1.5, {"id": "c1", "choices": [{"index": 0, "delta": {"content": "c"}, "token_ids": [7],
                                        "finish_reason": "length"}]}),
        (1.6, {"id": "c1", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3},
               "meridian": {"migrations": 1, "node": "n2", "region": "gcp:europe-west4"}}),
    ]
    for at, event in events:
        clock.now = at
        assert reading.on_event(json.dumps(event)) is False
    clock.now = 1.7
    assert reading.on_event("[DONE]") is True
    d = reading.detail()
    assert (d.text, d.token_ids, d.ids, d.finish_reason) == ("abc", (5, 6, 7), ("c1",), "length")
    assert (d.prompt_tokens, d.completion_tokens, d.migrations, d.final_region) == (2, 3, 1, "gcp:europe-west4")
    assert d.longest_gap_s == pytest.approx(1.3) and d.longest_gap_end_s == pytest.approx(1.5)
    assert reading.outcome() == (Outcome.OK, None)
    assert tracker.all_under_way(3) and not tracker.all_under_way(4)


def test_a_reading_ends_at_an_error_event_with_its_code() -> None:
    reading = StreamReading(0.0)
    assert reading.on_event(json.dumps({"error": {"code": "upstream_disconnected", "message": "x"}})) is True
    assert reading.outcome() == (Outcome.FAIL, "upstream_disconnected")


def test_tenants_split_by_weight_and_interleaved() -> None:
    names = split_tenants([("g", 1), ("e", 1)], 5)
    assert names == ["g", "e", "g", "e", "g"]
    assert split_tenants([("a", 3), ("b", 1)], 8).count("a") == 6


def _proc(name: str, region: str) -> Proc:
    return Proc(name=name, popen=None, url="", log=Path("x"), region=region, node_id=name)  # type: ignore[arg-type]


def test_victims_are_the_target_nodes_plus_the_busiest_node_of_the_other_region() -> None:
    us, eu1, eu2 = _proc("us", "aws:us-east-1"), _proc("eu1", "gcp:europe-west4"), _proc("eu2", "gcp:europe-west4")
    victims = pick_victims([us], "gcp:europe-west4", [us, eu1, eu2], {"eu1": 3, "eu2": 9})
    assert [p.name for p in victims] == ["us", "eu2"]
    assert pick_victims([us], None, [us, eu1, eu2], {}) == [us]


def test_the_mid_stream_drills_are_valid_and_their_short_forms_strike_the_burst() -> None:
    for name in ("15-mid-stream-crash.yaml", "16-mid-stream-gray.yaml"):
        d = load_drill(DRILLS_DIR / name).short_version()
        ls = d.load.long_streams
        assert ls is not None and ls.count >= 50 and ls.max_tokens >= 200
        assert d.fault.start_s <= ls.at_s < d.fault.end_s
        assert d.pass_criteria.streams is not None


def test_a_drill_whose_streams_start_after_the_fault_ended_is_refused() -> None:
    data = drill().model_dump(by_alias=True)
    data["load"]["long_streams"]["at_s"] = 25
    with pytest.raises(ValueError, match="before the fault ends"):
        Drill.model_validate(data)
    data = drill().model_dump(by_alias=True)
    data["load"]["long_streams"] = None
    with pytest.raises(ValueError, match="pass.streams needs load.long_streams"):
        Drill.model_validate(data)


def test_the_report_shows_the_long_streams_in_markdown_and_json(tmp_path: Path) -> None:
    from datetime import UTC, datetime

    from chaos.report import RunReport, write_report

    h = History()
    stream(h, "k0", REF)
    stream(h, "k1", REF[:20] + REF[17:37], resume_at=20)
    d = drill()
    result = check(h, d, ZONES)
    report = RunReport(drill=d, short=True, started_at=datetime(2026, 1, 1, tzinfo=UTC), duration_s=30,
                       fault_start_s=10, fault_end_s=20, events=(), result=result, verdict=result.verdict(d),
                       invariants={})
    files = write_report(report, h, tmp_path)
    md = files.report_md.read_text(encoding="utf-8")
    assert "## Long streams" in md and "- token mismatches: `k1 (3 token(s) duplicated at token 20)`" in md
    streams = json.loads(files.report_json.read_text())["streams"]
    assert streams["migrated"] == ["k0", "k1"] and streams["token_mismatches"] == ["k1 (3 token(s) duplicated at token 20)"]
