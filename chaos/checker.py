"""Check a drill's history the way Jepsen's total-queue checker does, then judge its criteria.

A request is identified by its idempotency key. Think of the client's request as an
enqueue and a node serving it to completion (a `served` record with `completed`) as its
dequeue. Per key, with the client's final outcome and the nodes' completed serves:

- attempts: keys the client invoked.
- acknowledged: client outcome `ok`. Every acknowledged key is either `ok` (a node
  completed it) or `lost` (no node did: the client was told "done" about work nobody did).
- lost also counts a non-streaming request that has no final client outcome at all: it was
  neither answered nor timed out, so it hung past the end of the run. (A stream with no
  outcome is `pending` and breaks `streams_end_with_error_event`.)
- indeterminate: timeout or connection lost after sending. It may legitimately have been
  served or not, so it is never lost; `recovered` counts those a node completed.
- duplicated: keys completed by nodes more than once (a retry of work already done).
- unexpected: keys a router or node handled that the client never invoked.
- clean_errors: `fail` outcomes the drill declares correct under its fault (an allowed
  status + OpenAI error `code`, with Retry-After where required; with
  `streams_end_with_error_event`, a stream that ended with an SSE error event).
  unclean_errors: every other `fail`.
- residency_violations: keys of a zoned tenant that a router sent, or the client saw
  served (x-meridian-region), in a region whose zones do not include the tenant's zone.
  A region missing from the region→zones map cannot be shown to be in the zone and counts.

Rates and latencies group requests by invoke time (long streams, which carry a StreamDetail,
are left out: chaos.stream_check judges them against their reference, under pass.streams). A request is *good* when it is `ok` or
a clean error (the correct answer under the fault); the error rate is the share that is
not good (unclean failures, indeterminate, pending). Latency is time to first byte for a
stream and time to the end otherwise; p99 is nearest-rank over `ok` requests only.

- steady state: success (good) rate and p99 over the `steady_state.window_s` seconds
  before the fault starts.
- during the fault: requests invoked in [fault start, fault end).
- recovery_s: from the fault end (or start, per `recovery_from`) to the start of the first
  sliding window of `recovery_window_s` seconds after which every window lying wholly
  inside the load meets the steady-state hypothesis (good rate and p99); None when the
  fabric had not recovered, or stayed recovered, by the end of the load.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from chaos.drill import Drill, PassCriteria, SteadyState, StreamCriteria
from chaos.history import ClientOp, History, HistoryError, Outcome
from chaos.stream_check import StreamResult, check_streams, is_clean_no_replica
from meridian import residency


@dataclass(frozen=True, slots=True)
class ResidencyViolation:
    """A zoned tenant's request that reached a region outside its zone."""

    key: str
    tenant: str
    zone: str
    region: str
    seen_by: str  # "router" (routed there) or "client" (x-meridian-region)


@dataclass(frozen=True, slots=True)
class CriterionResult:
    """One pass criterion: what was measured against which bound."""

    name: str
    passed: bool
    measured: float | None
    bound: float | None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Verdict:
    """Per-criterion results of one drill run; it passes when all of them do."""

    drill: str
    criteria: tuple[CriterionResult, ...]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.criteria)

    def failures(self) -> list[CriterionResult]:
        return [c for c in self.criteria if not c.passed]


@dataclass(frozen=True, slots=True)
class UnmetWindow:
    """A recovery window that missed the steady state, and the request that did most to miss
    it (a failure, else the slowest): what an operator reads first when recovery is late."""

    start_s: float
    end_s: float
    requests: int
    good_rate: float
    p99_ms: float | None
    worst: ClientOp

    def describe(self) -> str:
        w = self.worst
        lat = latency_ms(w)
        how = (f"{w.outcome.value if w.outcome else 'no outcome'} {w.status or ''} {w.error_code or ''}".strip()
               if w.outcome is not Outcome.OK else f"{lat:.0f} ms")
        p99 = "n/a" if self.p99_ms is None else f"{self.p99_ms:.0f} ms"
        return (f"last unmet window [{self.start_s:.1f}, {self.end_s:.1f}) s: {self.requests} requests, "
                f"good {self.good_rate:.0%}, p99 {p99}; worst {w.key} ({w.protocol}"
                f"{', stream' if w.stream else ''}, node {w.node or '-'}, invoked {w.invoke_s:.1f} s): {how}")


@dataclass(frozen=True, slots=True)
class CheckResult:
    """Counts, offending keys and timings of one run (definitions in the module docstring)."""

    attempts: int
    acknowledged: int
    ok: int
    lost: tuple[str, ...]
    duplicated: tuple[str, ...]
    unexpected: tuple[str, ...]
    recovered: tuple[str, ...]
    indeterminate: tuple[str, ...]
    pending: tuple[str, ...]
    clean_errors: tuple[str, ...]
    unclean_errors: tuple[str, ...]
    streams_without_error_event: tuple[str, ...]
    residency_violations: tuple[ResidencyViolation, ...]
    fault_start_s: float
    fault_end_s: float
    steady_state_success_rate: float | None
    steady_state_p99_ms: float | None
    requests_during_fault: int
    error_rate_during_fault: float | None
    p99_during_fault_ms: float | None
    max_latency_during_fault_ms: float | None
    recovery_s: float | None
    # Long streams under a mid-stream fault (chaos.stream_check), when the drill checks them.
    streams: StreamResult | None = None
    # The last window after the recovery reference that missed the steady state: why the
    # recovery came when it did (None: none missed it).
    last_unmet: UnmetWindow | None = None

    def verdict(self, drill: Drill, invariants: Mapping[str, bool] | None = None) -> Verdict:
        """Judge the drill's pass criteria; `invariants` are the runner's observations."""
        return _judge(self, drill, invariants or {})


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile (an observed value, never interpolated); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def latency_ms(op: ClientOp) -> float | None:
    """Time to first byte for a stream, to the end otherwise; None when not recorded."""
    end = op.first_byte_s if op.stream and op.first_byte_s is not None else op.end_s
    return None if end is None else (end - op.invoke_s) * 1000


def join_client(ops: Sequence[ClientOp]) -> dict[str, ClientOp]:
    """One operation per key: the record with a final outcome wins over send-time records."""
    by_key: dict[str, ClientOp] = {}
    for op in ops:
        prev = by_key.get(op.key)
        if prev is None:
            by_key[op.key] = op
            continue
        if (prev.tenant, prev.zone, prev.stream) != (op.tenant, op.zone, op.stream):
            raise HistoryError(f"idempotency key {op.key!r} was used for two different requests")
        if prev.outcome is not None and op.outcome is not None:
            raise HistoryError(f"idempotency key {op.key!r} has two final outcomes ({prev.outcome}, {op.outcome})")
        if op.outcome is not None:
            by_key[op.key] = op
    return by_key


def check(
    history: History,
    drill: Drill,
    region_zones: Mapping[str, Collection[str]],
    *,
    fault_start_s: float | None = None,
    fault_end_s: float | None = None,
) -> CheckResult:
    """Join the client, router and node histories of a run of `drill`.

    The fault window defaults to the drill's; pass the times the injector actually
    applied and removed the fault when they differ.
    """
    crit = drill.pass_criteria
    fs = drill.fault.start_s if fault_start_s is None else fault_start_s
    fe = drill.fault.end_s if fault_end_s is None else fault_end_s
    ops = join_client(history.client)
    # A prefill worker's hop is not an answer: the decode worker's is (or the prefill hop
    # of one attempt and the decode of another would read as the request served twice).
    completions = Counter(s.key for s in history.served if s.completed and not s.prefill)
    handled = {r.key for r in history.routed} | {s.key for s in history.served}

    acked = [k for k, op in ops.items() if op.outcome is Outcome.OK]
    lost = [k for k in acked if completions[k] == 0]
    lost += [k for k, op in ops.items() if op.outcome is None and not op.stream]
    indeterminate = [k for k, op in ops.items() if op.outcome is Outcome.INDETERMINATE]
    failed = [k for k, op in ops.items() if op.outcome is Outcome.FAIL]
    clean = [k for k in failed if _is_clean(ops[k], crit) or is_clean_no_replica(ops[k], crit.streams)]
    clean_set = set(clean)
    broken_streams = [
        k
        for k, op in ops.items()
        if op.stream
        and (op.outcome is None or (op.outcome is not Outcome.OK and op.first_byte_s is not None and not op.stream_error_event))
    ]

    # Long streams are judged apart (pass.streams); a burst of them right before the fault
    # would otherwise stand for the steady state.
    windows = _Windows({k: op for k, op in ops.items() if op.detail is None}, clean_set)
    ss = drill.steady_state
    steady = windows.between(fs - ss.window_s, fs)
    during = windows.between(fs, fe)
    ends = [math.inf if o.end_s is None else (o.end_s - o.invoke_s) * 1000 for o in during]
    ref = fe if crit.recovery_from == "fault_end" else fs
    recovery, unmet_at = _recovery(ref, drill.load.duration_s, crit.recovery_window_s, windows.starts,
                                   windows.between, lambda window: windows.meets(window, ss))

    return CheckResult(
        attempts=len(ops),
        acknowledged=len(acked),
        ok=len(acked) - len([k for k in acked if completions[k] == 0]),
        lost=tuple(sorted(lost)),
        duplicated=tuple(sorted(k for k, n in completions.items() if n > 1)),
        unexpected=tuple(sorted(handled - ops.keys())),
        recovered=tuple(sorted(k for k in indeterminate if completions[k] > 0)),
        indeterminate=tuple(sorted(indeterminate)),
        pending=tuple(sorted(k for k, op in ops.items() if op.outcome is None)),
        clean_errors=tuple(sorted(clean)),
        unclean_errors=tuple(sorted(k for k in failed if k not in clean_set)),
        streams_without_error_event=tuple(sorted(broken_streams)),
        residency_violations=tuple(_residency(ops, history, region_zones)),
        fault_start_s=fs,
        fault_end_s=fe,
        steady_state_success_rate=sum(map(windows.good, steady)) / len(steady) if steady else None,
        steady_state_p99_ms=_ok_p99(steady),
        requests_during_fault=len(during),
        error_rate_during_fault=sum(not windows.good(o) for o in during) / len(during) if during else None,
        p99_during_fault_ms=_ok_p99(during),
        max_latency_during_fault_ms=max(ends) if ends else None,
        recovery_s=recovery,
        streams=None if crit.streams is None else check_streams(history, ops, crit.streams, region_zones),
        last_unmet=None if unmet_at is None else windows.unmet(unmet_at, unmet_at + crit.recovery_window_s),
    )


class _Windows:
    """The run's requests ordered by invoke time, and what is judged over a span of them.

    A request is good when it is `ok` or a clean error (`clean`: the correct answer under
    the fault).
    """

    def __init__(self, ops: Mapping[str, ClientOp], clean: Collection[str]) -> None:
        self._ordered = sorted(ops.values(), key=lambda o: o.invoke_s)
        self.starts = [o.invoke_s for o in self._ordered]
        self._clean = clean

    def good(self, op: ClientOp) -> bool:
        return op.outcome is Outcome.OK or op.key in self._clean

    def between(self, a: float, b: float) -> list[ClientOp]:
        """The requests invoked in [a, b)."""
        return self._ordered[bisect.bisect_left(self.starts, a) : bisect.bisect_left(self.starts, b)]

    def meets(self, window: Sequence[ClientOp], ss: SteadyState) -> bool:
        """Whether a non-empty window meets the steady-state hypothesis (good rate and p99)."""
        rate = sum(map(self.good, window)) / len(window)
        p99 = _ok_p99(window)
        return rate >= ss.min_success_rate and (ss.max_p99_ms is None or p99 is None or p99 <= ss.max_p99_ms)

    def unmet(self, a: float, b: float) -> UnmetWindow:
        """The window [a, b) described: its failure, else its slowest request, stands for it."""
        window = self.between(a, b)
        worst = max(window, key=lambda o: (not self.good(o), latency_ms(o) or 0.0))
        return UnmetWindow(a, b, len(window), sum(map(self.good, window)) / len(window), _ok_p99(window), worst)


def _ok_p99(window: Sequence[ClientOp]) -> float | None:
    lat = [latency_ms(o) for o in window if o.outcome is Outcome.OK]
    return percentile([x for x in lat if x is not None], 99)


def _is_clean(op: ClientOp, crit: PassCriteria) -> bool:
    if crit.streams_end_with_error_event and op.stream and op.stream_error_event:
        return True
    return any(
        op.status == a.status and op.error_code == a.code and (op.retry_after or not a.retry_after)
        for a in crit.allowed_errors
    )


def _residency(
    ops: Mapping[str, ClientOp], history: History, region_zones: Mapping[str, Collection[str]]
) -> list[ResidencyViolation]:
    seen: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for op in ops.values():
        if op.region is not None:
            seen[op.key].append((op.region, "client"))
    for r in history.routed:
        seen[r.key].append((r.region, "router"))
    out = []
    for key, places in sorted(seen.items()):
        op = ops.get(key)
        if op is None:
            continue
        for region, by in places:
            if not residency.admits(region_zones.get(region, ()), op.zone):
                out.append(ResidencyViolation(key, op.tenant, op.zone, region, by))
                break  # one violation per request is enough to count it
    return out


def _recovery(
    ref: float,
    load_end: float,
    window_s: float,
    starts: Sequence[float],
    between: Callable[[float, float], list[ClientOp]],
    meets: Callable[[Sequence[ClientOp]], bool],
) -> tuple[float | None, float | None]:
    """Seconds from ref until every later full window meets the steady state (see module doc),
    and where the last window that missed it starts (None: none did)."""
    last = load_end - window_s
    if last < ref:
        return None, None
    lo, hi = bisect.bisect_right(starts, ref), bisect.bisect_right(starts, last)
    candidates = sorted({ref, last, *starts[lo:hi]})
    recovered_at: float | None = None
    unmet_at: float | None = None
    for s in candidates:
        window = between(s, s + window_s)
        if not window:
            continue  # no evidence either way
        if meets(window):
            if recovered_at is None:
                recovered_at = s
        else:
            recovered_at, unmet_at = None, s
    return (None if recovered_at is None else max(0.0, recovered_at - ref)), unmet_at


def _at_most(name: str, measured: float | None, bound: float | None, what: str = "") -> CriterionResult:
    if bound is None:
        raise ValueError(name)
    if measured is None:
        return CriterionResult(name, False, None, bound, what or "nothing to measure")
    return CriterionResult(name, measured <= bound, measured, bound, what)


def _fmt(value: float | None, spec: str) -> str:
    return "none" if value is None else format(value, spec)


def _keys(keys: Sequence[str], limit: int = 5) -> str:
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _judge(r: CheckResult, drill: Drill, invariants: Mapping[str, bool]) -> Verdict:
    c, ss = drill.pass_criteria, drill.steady_state
    out: list[CriterionResult] = []

    ss_ok = (
        r.steady_state_success_rate is not None
        and r.steady_state_success_rate >= ss.min_success_rate
        and (ss.max_p99_ms is None or (r.steady_state_p99_ms is not None and r.steady_state_p99_ms <= ss.max_p99_ms))
    )
    out.append(
        CriterionResult(
            "steady_state_before_fault",
            ss_ok,
            r.steady_state_success_rate,
            ss.min_success_rate,
            f"success rate {_fmt(r.steady_state_success_rate, '.4f')}, "
            f"p99 {_fmt(r.steady_state_p99_ms, '.1f')} ms (bound {ss.max_p99_ms})",
        )
    )
    counted = [
        ("lost", r.lost, c.max_lost),
        ("duplicated", r.duplicated, c.max_duplicated),
        ("unexpected", r.unexpected, c.max_unexpected),
        ("unclean_errors", r.unclean_errors, c.max_unclean_errors),
    ]
    if c.max_indeterminate is not None:
        counted.append(("indeterminate", r.indeterminate, c.max_indeterminate))
    if c.streams_end_with_error_event:
        counted.append(("streams_without_error_event", r.streams_without_error_event, 0))
    for name, keys, bound in counted:
        out.append(_at_most(name, len(keys), bound, _keys(keys)))
    violations = [f"{v.key} ({v.zone} tenant {v.tenant} in {v.region}, {v.seen_by})" for v in r.residency_violations]
    out.append(_at_most("residency_violations", len(violations), c.max_residency_violations, _keys(violations)))

    window = f"fault window [{r.fault_start_s:g}, {r.fault_end_s:g}) s, {r.requests_during_fault} requests"
    if c.max_error_rate_during_fault is not None:
        out.append(_at_most("error_rate_during_fault", r.error_rate_during_fault, c.max_error_rate_during_fault, window))
    if c.max_p99_during_fault_ms is not None:
        out.append(_at_most("p99_during_fault_ms", r.p99_during_fault_ms, c.max_p99_during_fault_ms, window))
    if c.max_latency_during_fault_ms is not None:
        out.append(_at_most("max_latency_during_fault_ms", r.max_latency_during_fault_ms, c.max_latency_during_fault_ms, window))
    if c.max_recovery_s is not None:
        detail = f"from {c.recovery_from.replace('_', ' ')}" if r.recovery_s is not None else "did not recover"
        if r.last_unmet is not None:
            detail += f"; {r.last_unmet.describe()}"
        out.append(_at_most("recovery_s", r.recovery_s, c.max_recovery_s, detail))
    if c.streams is not None and r.streams is not None:
        out += _stream_criteria(r.streams, c.streams)
    for name in c.invariants:
        seen = invariants.get(name)
        out.append(
            CriterionResult(
                f"invariant:{name}",
                seen is True,
                None if seen is None else float(seen),
                1.0,
                "not observed by the runner" if seen is None else "",
            )
        )
    return Verdict(drill.name, tuple(out))


def _stream_criteria(s: StreamResult, c: StreamCriteria) -> list[CriterionResult]:
    """pass.streams: the long streams against their reference (chaos.stream_check)."""
    summary = (f"{s.streams} long streams, {len(s.completed)} completed, {len(s.migrated)} migrated "
               f"(at most {s.max_migrations} times), {len(s.clean_no_replica)} clean errors without a replica")
    out = [
        _at_most("broken_streams", len(s.broken), c.max_broken_streams, _keys(s.broken) or summary),
        _at_most("token_mismatches", len(s.token_mismatches), c.max_token_mismatches, _keys(s.token_mismatches)),
        _at_most("diverged_streams", len(s.diverged), c.max_diverged_streams, _keys(s.diverged)),
        _at_most("stream_identity_mismatches", len(s.identity_mismatches), 0, _keys(s.identity_mismatches)),
        _at_most("stream_residency_violations", len(s.residency_violations), c.max_residency_violations,
                 _keys(s.residency_violations)),
        CriterionResult("migrated_streams", len(s.migrated) >= c.min_migrated, len(s.migrated), c.min_migrated,
                        summary),
    ]
    if c.max_resume_p99_s is not None:
        bound = c.max_resume_p99_s + (s.prefill_s or 0.0)
        prefill = "no prefill measured" if s.prefill_s is None else f"one prefill {s.prefill_s:.3f} s"
        out.append(_at_most("resume_p99_s", s.resume_p99_s, bound,
                            f"{len(s.resume_s)} resumed streams; bound {c.max_resume_p99_s:g} s + {prefill}"))
    return out


__all__ = [
    "CheckResult",
    "CriterionResult",
    "ResidencyViolation",
    "Verdict",
    "check",
    "join_client",
    "latency_ms",
    "percentile",
]
