"""Sampling and stop strings, on plain tensors and text."""

from __future__ import annotations

import torch

from data_plane.sampling import (
    RowSampling,
    Sampled,
    SamplingFailed,
    make_generator,
    sample_batch,
    sample_next,
)
from meridian.stop_strings import StopStringMatcher


def test_greedy_picks_the_argmax() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample_next(logits, temperature=0.0, top_p=1.0, generator=make_generator(0)) == 1


def test_same_seed_same_choices_different_seed_different_choices() -> None:
    logits = torch.zeros(1000)

    def draw(seed: int) -> list[int]:
        gen = make_generator(seed)
        return [sample_next(logits, temperature=1.0, top_p=1.0, generator=gen) for _ in range(20)]

    assert draw(123) == draw(123)
    assert draw(123) != draw(124)


def test_top_p_keeps_only_the_nucleus() -> None:
    # Probabilities ~ [0.5, 0.3, 0.15, 0.05]: top_p 0.7 keeps the first two tokens.
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    gen = make_generator(1)
    seen = {sample_next(logits, temperature=1.0, top_p=0.7, generator=gen) for _ in range(300)}
    assert seen == {0, 1}
    tiny = {sample_next(logits, temperature=1.0, top_p=1e-6, generator=gen) for _ in range(50)}
    assert tiny == {0}


def test_stop_string_across_deltas_is_cut_and_never_leaked() -> None:
    m = StopStringMatcher(["</end>"])
    out = []
    for delta in ["Hello wor", "ld </", "en", "d> ignored"]:
        text, stopped = m.feed(delta)
        out.append(text)
        if stopped:
            break
    assert "".join(out) == "Hello world "
    assert m.matched == "</end>"
    assert not any("<" in piece for piece in out)


def test_held_back_prefix_is_released_when_it_does_not_match() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("go ST") == ("go ", False)
    assert m.feed("ART") == ("START", False)
    assert m.feed("ends S") == ("ends ", False)
    assert m.flush() == "S"


def test_earliest_of_several_stop_strings_wins() -> None:
    m = StopStringMatcher(["b", "xyz", "a"])
    assert m.feed("123a456b") == ("123", True)
    assert m.matched == "a"


def test_values_that_underflow_float32_sample_like_vllm() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    gen = make_generator(0)
    # Under vLLM's epsilon a temperature is greedy; 1/1e-300 would be inf in float32.
    for t in (1e-300, 5e-324, 1e-6):
        assert sample_next(logits, temperature=t, top_p=1.0, generator=gen) == 1
    # top_p 1e-300 is 0 in float32: the nucleus still keeps its most likely token.
    assert {sample_next(logits, temperature=1.0, top_p=1e-300, generator=gen) for _ in range(20)} == {1}


def test_a_row_that_cannot_be_sampled_fails_alone() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.9], [float("nan"), 1.0, 0.0], [5.0, 0.0, 0.0]])
    rows = [RowSampling(1.0, 1.0, 0, make_generator(0), None),
            RowSampling(1.0, 1.0, 0, make_generator(0), None),
            RowSampling(0.0, 1.0, 0, None, 2)]
    first, broken, greedy = sample_batch(logits, rows)
    assert isinstance(first, Sampled) and first.token_id in (0, 1, 2)
    assert isinstance(broken, SamplingFailed) and "finite" in broken.reason
    assert isinstance(greedy, Sampled) and greedy.token_id == 0 and greedy.logprob is not None
