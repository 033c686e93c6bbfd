"""Check long streams struck mid-generation against their reference (pass.streams).

Per long stream (a client record with a StreamDetail), with its `reference` record (the
same request answered unbroken by the healthy fabric, chaos.streams):

- migrated: the router resumed it at least once: the `meridian.migrations` of its last
  event, or a `routed` journal line of its key with `migration` >= 1.
- clean_no_replica: it ended with an SSE error event of code `upstream_disconnected`, its
  tenant's zone is one of `unmigratable_zones` (no other replica of the zone survives the
  fault), and what it received is a prefix of the reference. The correct answer: a zoned
  stream never resumes outside its zone. Never a residency violation, never broken.
- broken: every other stream that did not end with `[DONE]` (an error event, a cut, a
  timeout, no answer).
- token_mismatches: a stream that ended with `[DONE]` whose tokens differ from the
  reference's in a way a seam explains: tokens duplicated or missing (the first difference
  is at a seam, and the received ids from it on match the reference's shifted by up to
  MAX_SHIFT), or a different token right at a seam (a continuation's first token, the `resume_tokens` of a
  `routed` continuation line); for a clean_no_replica stream the same of what it received
  (it must be a prefix of the reference). Without token ids on both sides (the drill did
  not ask return_token_ids) any difference in text counts. A stream without a reference
  cannot be shown right and counts too.
- diverged: with token ids, a stream whose greedy decode took another token than the
  reference's away from any seam (after a continuation's first token, or none): float32
  on a CPU sums in a different order in a different batch, and a near-tie flips. Unmigrated
  streams show it too. The tokens after a divergence cannot be checked against the
  reference; the drill bounds how many streams may diverge (max_diverged_streams).
- identity_mismatches: a stream that ended with `[DONE]` but saw more than one response
  `id`, or whose usage (completion and prompt tokens) or finish_reason differ from the
  reference's: the client can tell the seam.
- residency_violations: a zoned tenant's stream that a router sent (any piece: routed
  lines, continuations included) or finished (the `meridian` region) in a region outside
  its zone. A region missing from the region -> zones map counts.
- resume_s: per migrated stream that ended with `[DONE]`, the longest silence between
  two of its events (the client's view of the kill, the detection, the re-prefill and the
  first continued token). resume_p99_s is their nearest-rank p99; the bound is the
  drill's `max_resume_p99_s` plus one prefill of the longest prompt (`prefill_s`, timed
  alone by the reference run).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from chaos.drill import StreamCriteria
from chaos.history import ClientOp, History, Reference, StreamDetail
from meridian import residency

UPSTREAM_DISCONNECTED = "upstream_disconnected"
# How far (in tokens) a duplicated or missing run at a seam is looked for, and how many
# tokens must then match for the shift to explain the difference.
MAX_SHIFT = 64
_SHIFT_MATCH = 8


@dataclass(frozen=True, slots=True)
class StreamResult:
    """Long streams' outcomes by key (definitions in the module docstring)."""

    streams: int
    completed: tuple[str, ...]
    migrated: tuple[str, ...]
    clean_no_replica: tuple[str, ...]
    broken: tuple[str, ...]
    token_mismatches: tuple[str, ...]  # "key (why)"
    diverged: tuple[str, ...]
    identity_mismatches: tuple[str, ...]
    residency_violations: tuple[str, ...]  # "key (zone tenant in region)"
    resume_s: tuple[float, ...]
    resume_p99_s: float | None
    prefill_s: float | None
    max_migrations: int


def is_clean_no_replica(op: ClientOp, criteria: StreamCriteria | None) -> bool:
    """A zoned stream that ended with the router's clean error, in a zone the drill leaves
    without a replica (whether its text is a prefix of the reference is checked apart)."""
    d = op.detail
    return (criteria is not None and d is not None and op.zone in criteria.unmigratable_zones  # residency: the drill's list
            and d.error_code == UPSTREAM_DISCONNECTED)


def check_streams(history: History, ops: Mapping[str, ClientOp], criteria: StreamCriteria,
                  region_zones: Mapping[str, Collection[str]]) -> StreamResult:
    """Judge every long stream of the run (the ops that carry a StreamDetail)."""
    refs: dict[str, Reference] = {r.key: r for r in history.reference}
    continued: dict[str, int] = defaultdict(int)
    seams: dict[str, list[int]] = defaultdict(list)
    regions: dict[str, set[str]] = defaultdict(set)
    for r in history.routed:
        regions[r.key].add(r.region)
        continued[r.key] = max(continued[r.key], r.migration)
        if r.migration:
            seams[r.key].append(r.resume_tokens)
    long = {k: op for k, op in ops.items() if op.detail is not None}
    completed, migrated, clean, broken, identity, diverged = [], [], [], [], [], []
    tokens: list[str] = []
    resume: list[float] = []
    violations: list[str] = []
    for key, op in sorted(long.items()):
        d, ref = op.detail, refs.get(key)
        assert d is not None
        moves = max(d.migrations, continued.get(key, 0))
        if moves:
            migrated.append(key)
        where = regions.get(key, set()) | ({d.final_region} if d.final_region else set())
        bad = sorted(r for r in where if not residency.admits(region_zones.get(r, ()), op.zone))
        if bad:
            violations.append(f"{key} ({op.zone} tenant {op.tenant} in {', '.join(bad)})")
        ending = d.done and d.error_code is None
        if ending:
            completed.append(key)
            if ref is None or not _same_identity(d, ref):
                identity.append(key)
            if moves and d.longest_gap_s is not None:
                resume.append(d.longest_gap_s)
        elif is_clean_no_replica(op, criteria):
            clean.append(key)
        else:
            broken.append(key)
            continue
        why = "no reference" if ref is None else compare(d, ref, seams.get(key, []), whole=ending)
        if why == "diverged":
            diverged.append(key)
        elif why is not None:
            tokens.append(f"{key} ({why})")
    prefills = [r.prefill_s for r in history.reference if r.prefill_s is not None]
    return StreamResult(
        streams=len(long), completed=tuple(completed), migrated=tuple(migrated), clean_no_replica=tuple(clean),
        broken=tuple(broken), token_mismatches=tuple(tokens), diverged=tuple(diverged),
        identity_mismatches=tuple(identity),
        residency_violations=tuple(violations), resume_s=tuple(resume), resume_p99_s=_p99(resume),
        prefill_s=max(prefills) if prefills else None,
        max_migrations=max((max(o.detail.migrations, continued.get(k, 0)) for k, o in long.items()
                            if o.detail is not None), default=0),
    )


def compare(d: StreamDetail, ref: Reference, seams: Sequence[int], *, whole: bool) -> str | None:
    """None when the stream received the reference (`whole`) or a prefix of it; else why
    not: "diverged" (see the module docstring) or a mismatch a seam explains."""
    if d.token_ids is None or ref.token_ids is None:
        same = d.text == ref.text if whole else ref.text.startswith(d.text)
        return None if same else "text differs (no token ids to place the difference)"
    got, want = d.token_ids, ref.token_ids
    i = next((n for n, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    if i == len(got) and (i == len(want) or not whole):
        # The right tokens; the text must be theirs too (a seam may drop or repeat held-back text).
        if d.text == ref.text if whole else ref.text.startswith(d.text):
            return None
        at = next((n for n, (a, b) in enumerate(zip(d.text, ref.text, strict=False)) if a != b),
                  min(len(d.text), len(ref.text)))
        return f"the token ids match but the text differs from character {at}"
    if i >= len(got) or i >= len(want):
        return f"{len(got)} tokens received, the reference has {len(want)}"
    # A seam duplicates or drops tokens where a continuation starts: the first difference is
    # at the seam itself. One later (the continuation matched the reference for a while) is a
    # divergence, however well a shift fits it there: the tiny model's greedy output runs in
    # cycles, and a near-tie flipped inside one matches the reference shifted by the cycle's
    # length (a CI run read a divergence 30 tokens after a seam as "29 tokens missing").
    at_seam = i in seams
    tail = tuple(got[i:i + _SHIFT_MATCH])
    for shift in range(1, MAX_SHIFT + 1) if at_seam else ():
        if i >= shift and tuple(want[i - shift:i - shift + len(tail)]) == tail:
            return f"{shift} token(s) duplicated at token {i}"
        if tuple(want[i + shift:i + shift + len(tail)]) == tail:
            return f"{shift} token(s) missing at token {i}"
    if i in seams:
        return f"another token right at the seam, token {i}"
    return "diverged"


def _same_identity(d: StreamDetail, ref: Reference) -> bool:
    return (len(d.ids) == 1 and d.finish_reason == ref.finish_reason
            and d.completion_tokens == ref.completion_tokens and d.prompt_tokens == ref.prompt_tokens)


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(0.99 * len(ordered))) - 1]
