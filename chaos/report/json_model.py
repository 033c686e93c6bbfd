"""report.json: its pydantic models (the file's schema, field order is key order) and the
mapping of a run onto them. Numbers are rounded for people reading the file; mappings are
sorted by key so that the same run always writes the same bytes."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from chaos.checker import CheckResult
from chaos.report.inputs import RunReport, utc_iso
from chaos.report.series import TimelineSeries
from chaos.stream_check import StreamResult

REPORT_VERSION = 1
MAX_EXAMPLES = 20  # offending keys listed per count in report.json


class _Model(BaseModel):
    # Infinity (a request that never ended has an infinite latency) is written as the string
    # "Infinity": strict JSON has no such number and null would read as "nothing measured".
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="strings")


class EventModel(_Model):
    at_s: float
    action: str
    detail: str


class FaultModel(_Model):
    kind: str
    target: dict[str, str]
    params: dict[str, float | int | str | bool]
    planned_start_s: float
    planned_end_s: float
    start_s: float
    end_s: float


class CountsModel(_Model):
    attempts: int
    acknowledged: int
    ok: int
    lost: int
    duplicated: int
    unexpected: int
    indeterminate: int
    recovered: int
    pending: int
    clean_errors: int
    unclean_errors: int
    streams_without_error_event: int
    residency_violations: int


class ResidencyViolationModel(_Model):
    key: str
    tenant: str
    zone: str
    region: str
    seen_by: str


class ExamplesModel(_Model):
    """Up to MAX_EXAMPLES keys of each non-empty list (sorted, as the checker returns them)."""

    lost: list[str]
    duplicated: list[str]
    unexpected: list[str]
    indeterminate: list[str]
    recovered: list[str]
    pending: list[str]
    unclean_errors: list[str]
    streams_without_error_event: list[str]
    residency_violations: list[ResidencyViolationModel]


class SteadyStateModel(_Model):
    window_s: float
    success_rate: float | None
    p99_ms: float | None
    min_success_rate: float
    max_p99_ms: float | None


class DuringFaultModel(_Model):
    requests: int
    error_rate: float | None
    p99_ms: float | None
    max_latency_ms: float | None


class CriterionModel(_Model):
    name: str
    passed: bool
    measured: float | None
    bound: float | None
    detail: str


class VerdictModel(_Model):
    passed: bool
    criteria: list[CriterionModel]


class FailoverModel(_Model):
    """`count` requests invoked in the bucket at `at_s` that a router retried on `to_node`."""

    at_s: float
    from_node: str
    to_node: str
    count: int


class TrafficShiftModel(_Model):
    """From the bucket at `at_s`, `from_node` served nothing and its sibling `to_node` more."""

    at_s: float
    from_node: str
    to_node: str


class TimelineModel(_Model):
    """The per-bucket series. The fields after `p99_ms` came later: they have defaults, so
    a report.json written before them still reads."""

    bucket_s: float
    starts_s: list[float]
    regions: list[str]
    requests_per_s: dict[str, list[float]]
    errors_per_s: dict[str, list[float]]
    p99_ms: list[float | None]
    nodes: list[str] = []
    node_regions: dict[str, str] = {}
    node_requests_per_s: dict[str, list[float]] = {}
    errors: list[int] = []
    failovers: list[FailoverModel] = []
    traffic_shifts: list[TrafficShiftModel] = []


class StreamsModel(_Model):
    """Long streams under a mid-stream fault (chaos.stream_check); keys of each kind."""

    streams: int
    completed: int
    migrated: list[str]
    clean_no_replica: list[str]
    broken: list[str]
    token_mismatches: list[str]
    diverged: list[str]
    identity_mismatches: list[str]
    residency_violations: list[str]
    resume_p99_s: float | None
    resume_max_s: float | None
    prefill_s: float | None
    max_migrations: int


class ReportModel(_Model):
    """report.json. Field order is the key order in the file; mappings are sorted by key."""

    version: int
    drill: str
    description: str
    short: bool
    started_at: str
    duration_s: float
    passed: bool
    aborted: str | None
    fault: FaultModel
    events: list[EventModel]
    counts: CountsModel
    examples: ExamplesModel
    steady_state: SteadyStateModel
    during_fault: DuringFaultModel
    recovery_s: float | None
    invariants: dict[str, bool]
    verdict: VerdictModel
    not_checked: list[str]
    timeline: TimelineModel
    # Came later, so a report.json written before it still reads.
    streams: StreamsModel | None = None


def counts(r: CheckResult) -> dict[str, int]:
    """The checker's counts by report.json's names, in its order (report.md reads them too)."""
    return {
        "attempts": r.attempts,
        "acknowledged": r.acknowledged,
        "ok": r.ok,
        "lost": len(r.lost),
        "duplicated": len(r.duplicated),
        "unexpected": len(r.unexpected),
        "indeterminate": len(r.indeterminate),
        "recovered": len(r.recovered),
        "pending": len(r.pending),
        "clean_errors": len(r.clean_errors),
        "unclean_errors": len(r.unclean_errors),
        "streams_without_error_event": len(r.streams_without_error_event),
        "residency_violations": len(r.residency_violations),
    }


def _r(x: float | None, digits: int) -> float | None:
    """Round for the report; None and infinities pass through unchanged."""
    if x is None or not math.isfinite(x):
        return x
    return round(x, digits)


def _s(x: float) -> float:
    return round(x, 3) if math.isfinite(x) else x


def report_model(report: RunReport, timeline: TimelineSeries, not_checked: Sequence[str]) -> ReportModel:
    """report.json's content for the run, its timeline series and the notes on what was not checked."""
    r, d = report.result, report.drill
    return ReportModel(
        version=REPORT_VERSION,
        drill=d.name,
        description=d.description.strip(),
        short=report.short,
        started_at=utc_iso(report.started_at),
        duration_s=_s(report.duration_s),
        passed=report.passed,
        aborted=report.aborted,
        fault=_fault(report),
        events=[EventModel(at_s=_s(e.at_s), action=e.action, detail=e.detail) for e in report.events],
        counts=CountsModel(**counts(r)),
        examples=_examples(r),
        steady_state=SteadyStateModel(
            window_s=_s(d.steady_state.window_s),
            success_rate=_r(r.steady_state_success_rate, 4),
            p99_ms=_r(r.steady_state_p99_ms, 1),
            min_success_rate=d.steady_state.min_success_rate,
            max_p99_ms=d.steady_state.max_p99_ms,
        ),
        during_fault=DuringFaultModel(
            requests=r.requests_during_fault,
            error_rate=_r(r.error_rate_during_fault, 4),
            p99_ms=_r(r.p99_during_fault_ms, 1),
            max_latency_ms=_r(r.max_latency_during_fault_ms, 1),
        ),
        recovery_s=_r(r.recovery_s, 3),
        invariants=dict(sorted(report.invariants.items())),
        verdict=_verdict(report),
        not_checked=list(not_checked),
        timeline=_timeline(timeline),
        streams=None if r.streams is None else _streams(r.streams),
    )


def _streams(s: StreamResult) -> StreamsModel:
    return StreamsModel(
        streams=s.streams, completed=len(s.completed), migrated=list(s.migrated),
        clean_no_replica=list(s.clean_no_replica), broken=list(s.broken), token_mismatches=list(s.token_mismatches),
        diverged=list(s.diverged), identity_mismatches=list(s.identity_mismatches),
        residency_violations=list(s.residency_violations), resume_p99_s=_r(s.resume_p99_s, 3),
        resume_max_s=_r(max(s.resume_s), 3) if s.resume_s else None, prefill_s=_r(s.prefill_s, 4),
        max_migrations=s.max_migrations,
    )


def _fault(report: RunReport) -> FaultModel:
    f = report.drill.fault
    target = {k: str(v) for k, v in f.target.model_dump(exclude_none=True).items()}
    return FaultModel(
        kind=f.kind,
        target=dict(sorted(target.items())),
        params=dict(sorted(f.params.items())),
        planned_start_s=_s(f.start_s),
        planned_end_s=_s(f.end_s),
        start_s=_s(report.fault_start_s),
        end_s=_s(report.fault_end_s),
    )


def _examples(r: CheckResult) -> ExamplesModel:
    return ExamplesModel(
        lost=list(r.lost[:MAX_EXAMPLES]),
        duplicated=list(r.duplicated[:MAX_EXAMPLES]),
        unexpected=list(r.unexpected[:MAX_EXAMPLES]),
        indeterminate=list(r.indeterminate[:MAX_EXAMPLES]),
        recovered=list(r.recovered[:MAX_EXAMPLES]),
        pending=list(r.pending[:MAX_EXAMPLES]),
        unclean_errors=list(r.unclean_errors[:MAX_EXAMPLES]),
        streams_without_error_event=list(r.streams_without_error_event[:MAX_EXAMPLES]),
        residency_violations=[
            ResidencyViolationModel(key=v.key, tenant=v.tenant, zone=v.zone, region=v.region, seen_by=v.seen_by)
            for v in r.residency_violations[:MAX_EXAMPLES]
        ],
    )


def _verdict(report: RunReport) -> VerdictModel:
    return VerdictModel(
        passed=report.verdict.passed,
        criteria=[
            CriterionModel(
                name=c.name, passed=c.passed, measured=_r(c.measured, 4), bound=_r(c.bound, 4), detail=c.detail
            )
            for c in report.verdict.criteria
        ],
    )


def _timeline(timeline: TimelineSeries) -> TimelineModel:
    return TimelineModel(
        bucket_s=timeline.bucket_s,
        starts_s=[_s(x) for x in timeline.starts_s],
        regions=list(timeline.regions),
        requests_per_s={k: [round(x, 3) for x in v] for k, v in timeline.requests_per_s.items()},
        errors_per_s={k: [round(x, 3) for x in v] for k, v in timeline.errors_per_s.items()},
        p99_ms=[_r(x, 1) for x in timeline.p99_ms],
        nodes=list(timeline.nodes),
        node_regions=dict(sorted(timeline.node_regions.items())),
        node_requests_per_s={k: [round(x, 3) for x in v] for k, v in sorted(timeline.node_requests_per_s.items())},
        errors=list(timeline.errors),
        failovers=[
            FailoverModel(at_s=_s(f.at_s), from_node=f.from_node, to_node=f.to_node, count=f.count)
            for f in timeline.failovers
        ],
        traffic_shifts=[
            TrafficShiftModel(at_s=_s(t.at_s), from_node=t.from_node, to_node=t.to_node)
            for t in timeline.traffic_shifts
        ],
    )
