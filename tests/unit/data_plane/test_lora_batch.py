"""Batched LoRA deltas: base projection + delta equals the adapter merged into the weights,
token by token, with several adapters (and tokens without one) in the same step."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn

from data_plane.lora import LORA_MODULES, NO_LORA, LoraAdapter, LoraBatch, LoraManager
from data_plane.lora.adapter import module_shapes
from data_plane.lora.make_tiny import make_tiny_lora
from data_plane.model.llama import LlamaConfig, LlamaForCausalLM
from data_plane.model.loader import load_model


@pytest.fixture(scope="module")
def lora_dir(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three adapters: two on every projection (ranks 8 and 4), one on q_proj/v_proj only."""
    root = tmp_path_factory.mktemp("batch-loras")
    make_tiny_lora(tiny_checkpoint, root / "all8", seed=1, rank=8)
    make_tiny_lora(tiny_checkpoint, root / "all4", seed=2, rank=4)
    make_tiny_lora(tiny_checkpoint, root / "qv", seed=3, rank=2, targets=("q_proj", "v_proj"))
    return root


def float64_manager(base: LlamaConfig, lora_dir: Path) -> LoraManager:
    return LoraManager(base, lora_dir=lora_dir, max_loras=3, max_lora_rank=8, dtype=torch.float64)


def merged_linear(base_linear: nn.Linear, adapter: LoraAdapter | None, layer: int, module: str) -> nn.Linear:
    """A copy of base_linear with the adapter folded into its weight: W + scaling * B @ A."""
    merged = nn.Linear(base_linear.in_features, base_linear.out_features, bias=False, dtype=torch.float64)
    weight = base_linear.weight.detach().clone()
    w = adapter.get(layer, module) if adapter is not None else None
    if w is not None:
        weight += w.scaling * w.b @ w.a
    merged.weight = nn.Parameter(weight)
    return merged


@pytest.mark.parametrize("module", LORA_MODULES)
def test_base_plus_delta_equals_merged_weights_row_by_row(
    base: LlamaConfig, lora_dir: Path, module: str
) -> None:
    m = float64_manager(base, lora_dir)
    slot = {name: m.acquire(name) for name in ("all8", "all4", "qv")}
    token_adapters = ["all8", None, "qv", "all4", "all8", None, "all4", "qv", "all8"]
    slots = [slot[a] if a is not None else NO_LORA for a in token_adapters]
    batch = LoraBatch.build(m, slots)

    gen = torch.Generator().manual_seed(0)
    in_features, out_features = module_shapes(base)[module]
    base_linear = nn.Linear(in_features, out_features, bias=False, dtype=torch.float64)
    nn.init.normal_(base_linear.weight, std=0.02, generator=gen)
    x = torch.randn(len(slots), in_features, generator=gen, dtype=torch.float64)

    for layer in range(base.num_hidden_layers):
        with torch.no_grad():
            base_out = base_linear(x)
            delta = batch.delta(layer, module, x)
            assert delta is not None
            out = base_out + delta
            for row, name in enumerate(token_adapters):
                adapter = m.adapter(slot[name]) if name is not None else None
                expected = merged_linear(base_linear, adapter, layer, module)(x[row:row + 1])[0]
                if adapter is None or adapter.get(layer, module) is None:
                    # No adapter on this token (or on this projection): exactly the base.
                    assert torch.equal(out[row], base_out[row])
                else:
                    torch.testing.assert_close(out[row], expected, rtol=1e-10, atol=1e-12)
                    assert not torch.allclose(out[row], base_out[row])


def test_no_delta_when_no_token_uses_an_adapter_on_that_projection(
    base: LlamaConfig, lora_dir: Path
) -> None:
    m = float64_manager(base, lora_dir)
    qv = m.acquire("qv")
    x = torch.randn(4, base.hidden_size, dtype=torch.float64)
    nobody = LoraBatch.build(m, [NO_LORA] * 4)
    assert nobody.is_empty
    assert all(nobody.delta(0, module, x) is None for module in LORA_MODULES)

    only_qv = LoraBatch.build(m, [NO_LORA, qv, qv, NO_LORA])
    assert only_qv.delta(0, "k_proj", x) is None
    assert only_qv.delta(1, "gate_proj", x) is None
    delta = only_qv.delta(0, "q_proj", x)
    assert delta is not None
    assert torch.count_nonzero(delta[[0, 3]]) == 0
    assert torch.count_nonzero(delta[[1, 2]]) == delta[[1, 2]].numel()


def test_a_step_where_every_token_shares_one_adapter(base: LlamaConfig, lora_dir: Path) -> None:
    m = float64_manager(base, lora_dir)
    slot = m.acquire("all4")
    x = torch.randn(5, base.intermediate_size, dtype=torch.float64)
    shared = LoraBatch.build(m, torch.tensor([slot] * 5)).delta(1, "down_proj", x)
    # The same tokens, computed through the gather/scatter path (one extra token without).
    mixed = LoraBatch.build(m, [slot] * 5 + [NO_LORA]).delta(
        1, "down_proj", torch.cat([x, torch.zeros(1, base.intermediate_size, dtype=torch.float64)])
    )
    assert shared is not None and mixed is not None
    torch.testing.assert_close(shared, mixed[:5])


def test_delta_has_the_activations_dtype(base: LlamaConfig, lora_dir: Path) -> None:
    m = LoraManager(base, lora_dir=lora_dir, max_loras=1, max_lora_rank=8, dtype=torch.bfloat16)
    slot = m.acquire("all8")
    x = torch.randn(3, base.hidden_size, dtype=torch.bfloat16)
    delta = LoraBatch.build(m, [slot, NO_LORA, slot]).delta(0, "gate_proj", x)
    assert delta is not None
    assert delta.dtype == torch.bfloat16
    assert tuple(delta.shape) == (3, base.intermediate_size)


def test_rows_must_match_the_tokens_the_batch_was_built_for(base: LlamaConfig, lora_dir: Path) -> None:
    m = float64_manager(base, lora_dir)
    batch = LoraBatch.build(m, [m.acquire("all8"), NO_LORA])
    with pytest.raises(ValueError, match="2 tokens"):
        batch.delta(0, "q_proj", torch.zeros(3, base.hidden_size, dtype=torch.float64))


def test_a_slot_nobody_holds_is_refused(base: LlamaConfig, lora_dir: Path) -> None:
    m = float64_manager(base, lora_dir)
    with pytest.raises(ValueError, match="holds no adapter"):
        LoraBatch.build(m, [0, NO_LORA])


@contextmanager
def lora_hooks(model: LlamaForCausalLM, batch: LoraBatch) -> Iterator[None]:
    """Call batch.delta around every projection, as the model's forward will (the contract)."""
    handles = []
    for i, layer in enumerate(model.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name, proj in parent.named_children():
                if name not in LORA_MODULES:
                    continue

                def hook(
                    _: nn.Module, inputs: tuple[torch.Tensor], output: torch.Tensor,
                    layer_index: int = i, module: str = name,
                ) -> torch.Tensor:
                    delta = batch.delta(layer_index, module, inputs[0])
                    return output if delta is None else output + delta

                handles.append(proj.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def test_whole_model_with_deltas_matches_the_merged_model(
    tiny_checkpoint: Path, base: LlamaConfig, lora_dir: Path
) -> None:
    model = load_model(tiny_checkpoint, dtype=torch.float64)
    m = float64_manager(base, lora_dir)
    slot = m.acquire("all8")
    ids = torch.tensor([1, 40, 41, 300, 7, 512, 99])
    base_logits = model.forward_full(ids)

    with lora_hooks(model, LoraBatch.build(m, [slot] * len(ids))):
        lora_logits = model.forward_full(ids)
    with lora_hooks(model, LoraBatch.build(m, [NO_LORA] * len(ids))):
        assert torch.equal(model.forward_full(ids), base_logits)

    merged = load_model(tiny_checkpoint, dtype=torch.float64)
    adapter = m.adapter(slot)
    with torch.no_grad():
        for (layer, module), w in adapter.weights.items():
            blocks = merged.model.layers[layer]
            parent = blocks.self_attn if hasattr(blocks.self_attn, module) else blocks.mlp
            getattr(parent, module).weight += w.scaling * w.b @ w.a
    torch.testing.assert_close(lora_logits, merged.forward_full(ids), rtol=1e-9, atol=1e-9)
    assert not torch.allclose(lora_logits, base_logits, atol=1e-3)
