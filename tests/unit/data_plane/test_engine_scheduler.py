"""Scheduling policy: token budget, SplitFuse chunking, prefill priority, preemption."""

from __future__ import annotations

import itertools

from data_plane.engine.base import GenerationRequest
from data_plane.engine.kv_cache.manager import KVCacheManager
from data_plane.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from data_plane.engine.sequence import SeqStatus, Sequence

BS = 4
_arrivals = itertools.count()


def seq(n_prompt: int, rid: str) -> Sequence:
    tokens = [(7 * i + len(rid)) % 500 + 1 for i in range(n_prompt)]
    return Sequence(GenerationRequest(rid, tokens), arrival=next(_arrivals), token_ids=list(tokens))


def make(budget: int = 16, *, chunked: bool = True, max_seqs: int = 8, blocks: int = 64) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=256,
                          enable_chunked_prefill=chunked)
    return Scheduler(cfg, KVCacheManager(blocks, BS, enable_caching=False))


def step(s: Scheduler) -> SchedulerOutput:
    """Schedule, pretend the model ran, append a sampled token where one is due."""
    out = s.schedule()
    s.update(out)
    for c in out.chunks:
        if c.samples:
            c.seq.token_ids.append(1)
    return out


def plan(out: SchedulerOutput) -> dict[str, int]:
    return {c.seq.request_id: c.num_tokens for c in out.chunks}


def test_long_prompt_is_chunked_and_fused_with_running_decodes() -> None:
    s = make(budget=16)
    a = seq(3, "a")
    s.add(a)
    assert plan(step(s)) == {"a": 3}  # a is now decoding
    long = seq(40, "long")
    s.add(long)
    seen = []
    while long.num_remaining > 1 or long.status is SeqStatus.WAITING:
        out = step(s)
        assert out.num_tokens <= 16
        seen.append(plan(out))
    # Every step decodes `a` and spends the rest of the budget on the long prompt.
    assert all(p["a"] == 1 for p in seen)
    assert [p["long"] for p in seen] == [15, 15, 10]


def test_without_chunking_a_prompt_runs_whole_in_one_step() -> None:
    s = make(budget=16, chunked=False)
    a, long = seq(3, "a"), seq(40, "long")
    s.add(a)
    step(s)
    s.add(long)
    assert plan(step(s)) == {"a": 1, "long": 40}


def test_a_short_new_prompt_goes_before_the_rest_of_a_long_one() -> None:
    s = make(budget=16)
    long = seq(60, "long")
    s.add(long)
    assert plan(step(s)) == {"long": 16}
    short = seq(5, "short")
    s.add(short)
    # The short prompt gets its whole prefill (and first token) now; the long one the rest.
    assert plan(step(s)) == {"short": 5, "long": 11}


def test_running_sequences_are_capped_by_max_num_seqs() -> None:
    s = make(budget=64, max_seqs=2)
    for i in range(4):
        s.add(seq(3, f"r{i}"))
    out = step(s)
    assert sorted(plan(out)) == ["r0", "r1"]
    assert len(s.running) == 2 and len(s.waiting) == 2


def test_out_of_blocks_preempts_the_newest_and_it_recomputes_with_its_outputs() -> None:
    s = make(budget=64, blocks=4)  # 16 token slots
    old, new = seq(8, "old"), seq(8, "new")
    s.add(old)
    s.add(new)
    assert plan(step(s)) == {"old": 8, "new": 8}  # 2 full blocks each: the pool is full
    # Both need a third block for their next token; only the older one may have it.
    out = step(s)
    assert plan(out) == {"old": 1}
    assert out.preempted == [new] and new.status is SeqStatus.WAITING and new.blocks == []
    assert s.num_preemptions == 1
    # Its prompt and generated token are recomputed once there is room.
    s.finish(old)
    out = step(s)
    assert plan(out) == {"new": 9}
    assert new.num_computed_tokens == 9 and new.num_output_tokens == 2
