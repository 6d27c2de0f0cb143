"""The memory plan matches what a real stage holds, scales to an 8B model on meta in seconds,
and refuses a stage that does not fit with a message that says what to change."""

from __future__ import annotations

import resource
import time
from pathlib import Path

import pytest
import torch

from peer.config import AnchorConfig, MaskConfig, ModelConfig, PipelineConfig, TrainConfig
from peer.daemon.memory import (
    GIB,
    MemoryPlan,
    anchor_snapshot_slots,
    check_fits,
    free_bytes,
    plan_stage,
    plan_stages,
    plan_table,
    saved_activation_bytes,
)
from peer.errors import ConfigError
from peer.model.loading import load_stage, meta_stage
from peer.model.placement import Placement

FP32 = Placement()
BF16 = Placement(compute_dtype=torch.bfloat16)
CKPT = Placement(checkpointing=True)


def _cfg(name: str = "tiny-llama", stages: int = 2, layers: int = 6, **pipe) -> TrainConfig:
    model = ModelConfig(name=name, num_stages=stages, hidden_size=64, num_layers=layers, num_heads=4, max_seq_len=4096)
    return TrainConfig(
        model=model,
        mask=MaskConfig(scheme="mask"),
        pipeline=PipelineConfig(
            **{"micro_batch_size": 2, "seq_len": 32, "micro_batches": 1, "max_staleness": 0} | pipe
        ),
    )


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_weights_grads_optimizer_equal_a_real_adamw_step() -> None:
    cfg = _cfg()
    for index in range(2):
        stage = load_stage(cfg.model, index)
        opt = torch.optim.AdamW(stage.parameters())
        x = torch.randint(0, 256, (2, 32)) if index == 0 else torch.randn(2, 32, 64)
        stage(x).float().square().mean().backward()
        opt.step()
        plan = plan_stage(cfg, FP32, index)
        assert plan.weights == _nbytes(stage.parameters())
        assert plan.grads == _nbytes(p.grad for p in stage.parameters())
        assert plan.optimizer == _nbytes(s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
        assert plan.working_copy == plan.dp_copies == plan.host == plan.anchor_snapshot == 0
        assert (plan.logits > 0) == (index == 1)


def _real_saved_bytes(stage, x: torch.Tensor) -> int:
    """Saved-tensor bytes of a real forward, deduplicated by storage, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = stage(x)
    y.float().square().mean().backward()
    return sum(seen.values())


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_activation_estimate_matches_a_real_forward(family: str) -> None:
    cfg = _cfg(f"tiny-{family}", seq_len=96)
    for index in range(2):
        stage = load_stage(cfg.model, index).train()
        x = torch.randint(0, 256, (2, 96)) if index == 0 else torch.randn(2, 96, 64, requires_grad=True)
        real = _real_saved_bytes(stage, x)
        outside, per_layer = saved_activation_bytes(meta_stage(cfg.model, index), 2, 96, torch.float32)
        assert abs(outside + sum(per_layer) - real) <= 0.2 * real, (outside, per_layer, real)
        assert plan_stage(cfg, FP32, index).activations == outside + sum(per_layer)


def test_activations_scale_with_micro_batches_in_flight() -> None:
    one = plan_stage(_cfg(), FP32, 0).activations
    assert plan_stage(_cfg(micro_batches=3, max_staleness=1), FP32, 0).activations == 6 * one


def test_checkpointing_reduces_activations() -> None:
    plain, ckpt = plan_stage(_cfg(), FP32, 0), plan_stage(_cfg(), CKPT, 0)
    assert ckpt.activations < 0.6 * plain.activations
    assert ckpt.activations == plain.activations_checkpointed


def test_bf16_halves_working_copy_and_activations() -> None:
    fp32, bf16 = plan_stage(_cfg(), FP32, 1), plan_stage(_cfg(), BF16, 1)
    assert fp32.working_copy == 0 and bf16.working_copy == bf16.weights // 2
    assert bf16.weights == fp32.weights and bf16.optimizer == fp32.optimizer
    # about half: RMSNorm keeps its fp32 upcast for the backward
    assert 0.45 * fp32.activations < bf16.activations < 0.6 * fp32.activations


def test_dp_group_anchor_and_codec_components() -> None:
    cfg = _cfg()
    cfg.anchor = AnchorConfig(every=10)
    cfg.mask = MaskConfig(scheme="mask", drop=0.9, fill="token_prior")
    first, last = plan_stage(cfg, FP32, 0, dp_group=True), plan_stage(cfg, FP32, 1, dp_group=True)
    assert first.dp_copies == first.weights and first.host == 2 * first.weights  # the shared copy and the commitment's
    assert first.anchor_snapshot == first.weights  # a snapshot in the compute dtype: fp32 here
    assert plan_stage(cfg, BF16, 0).anchor_snapshot == first.weights // 2
    assert first.codec == 0 and last.codec == 2 * (256 * 64 + 64) * 4
    assert last.need("cpu") == last.total + last.host and last.need("cuda:0") == last.total
    cfg.mask = MaskConfig(scheme="transform")
    first, last = plan_stage(cfg, FP32, 0), plan_stage(cfg, FP32, 1)
    assert first.codec == last.codec > 4 * 64 * 64 * 4  # one direction each: a row buffer of 4 H rows and more
    cfg3 = _cfg(stages=3)
    cfg3.mask = MaskConfig(scheme="transform")
    assert plan_stage(cfg3, FP32, 1).codec == 2 * first.codec  # a middle stage produces both ways


def test_an_in_memory_replica_of_the_next_stage_is_counted_on_the_host() -> None:
    cfg = _cfg(stages=3)
    real = [sum(p.numel() for p in load_stage(cfg.model, i, seed=0).parameters()) for i in range(3)]
    plans = plan_stages(cfg, FP32, dp_group=True, replica_in_memory=True)
    # fp32 weights and both AdamW moments of the next stage (the last stage keeps stage 0's)
    assert [p.replica for p in plans] == [12 * real[1], 12 * real[2], 12 * real[0]]
    assert plans[0].need("cpu") == plans[0].total + plans[0].host + plans[0].replica
    assert plans[0].need("cuda:0") == plans[0].total  # host memory, not the device's
    assert all(p.replica == 0 for p in plan_stages(cfg, FP32, dp_group=True))  # a state dir keeps it on disk
    cfg.checkpoint.replicate_every_s = 0
    assert all(p.replica == 0 for p in plan_stages(cfg, FP32, dp_group=True, replica_in_memory=True))
    assert plan_stages(_cfg(stages=1), FP32, dp_group=True, replica_in_memory=True)[0].replica == 0


def _config_dir(tmp_path: Path, **kw) -> str:
    from transformers import LlamaConfig

    LlamaConfig(
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, **kw
    ).save_pretrained(tmp_path)
    return str(tmp_path)


def test_8b_plan_on_meta_is_fast_and_allocates_nothing(tmp_path: Path) -> None:
    H, I, L, V, KV = 4096, 14336, 32, 128256, 1024
    name = _config_dir(tmp_path, hidden_size=H, num_hidden_layers=L, intermediate_size=I)
    cfg = TrainConfig(
        model=ModelConfig(name=name, num_stages=4, max_seq_len=4096),
        mask=MaskConfig(scheme="mask"),
        pipeline=PipelineConfig(micro_batch_size=1, seq_len=2048, max_staleness=0),
    )
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.monotonic()
    plans = [plan_stage(cfg, BF16, i) for i in range(4)]
    assert time.monotonic() - t0 < 30
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss < GIB  # one stage's fp32 weights are 7 GiB
    per_layer = 2 * H * H + 2 * H * KV + 3 * H * I + 2 * H
    for plan in plans[1:3]:
        assert abs(plan.weights - 4 * 8 * per_layer) <= 0.01 * plan.weights
    assert plans[0].weights == 4 * (8 * per_layer + V * H)
    assert plans[3].logits == 2048 * V * (2 + 4 + 4)
    assert 5 * GIB < plans[1].total < 80 * GIB


def test_check_fits_refuses_with_both_figures_and_the_fix() -> None:
    plan = plan_stage(_cfg(micro_batch_size=8, seq_len=256), FP32, 1)
    assert plan.activations == max(getattr(plan, c) for c in ("weights", "optimizer", "activations", "logits"))
    free = plan.total // 2
    with pytest.raises(ConfigError) as err:
        check_fits(plan, free, device="cuda:0")
    text = str(err.value)
    assert err.value.field == "compute.activation_checkpointing"
    assert f"needs {plan.total / 2**20:.1f} MiB on cuda:0" in text and f"{free / 2**20:.1f} MiB are free" in text
    assert text.index("activation_checkpointing") < text.index("model.num_stages")
    check_fits(plan, plan.total, device="cuda:0")
    check_fits(plan, 0, budget_gib=1.0, device="cuda:0")
    with pytest.raises(ConfigError, match="memory_budget_gib allows"):
        check_fits(plan, 100 * GIB, budget_gib=plan.total / GIB / 2, device="cuda:0")


def test_weights_dominated_plan_suggests_more_stages() -> None:
    plan = MemoryPlan(
        stage=0,
        layers=4,
        device="cuda:0",
        weights=8 * GIB,
        grads=8 * GIB,
        optimizer=16 * GIB,
        activations=GIB,
        activations_checkpointed=GIB // 4,
        num_stages=2,
    )
    with pytest.raises(ConfigError, match="more stages") as err:
        check_fits(plan, 20 * GIB)
    assert (
        err.value.field == "model.num_stages"
        and "33.00 GiB on cuda:0" in str(err.value)
        and "20.00 GiB are free" in str(err.value)
    )


def test_anchor_snapshot_slots() -> None:
    assert anchor_snapshot_slots(10 * GIB, GIB, 0.25) == 2
    assert anchor_snapshot_slots(GIB, 4 * GIB, 0.25) == 1
    assert anchor_snapshot_slots(1000 * GIB, GIB, 1.0) == 8
    assert anchor_snapshot_slots(-GIB, GIB, 0.5) == 1


def test_free_bytes_on_the_host() -> None:
    assert 0 < free_bytes("cpu") < 2**50


def test_plan_table_for_a_llama_1b_shape(tmp_path: Path) -> None:
    H, V = 2048, 128256
    name = _config_dir(tmp_path, hidden_size=H, num_hidden_layers=16, intermediate_size=8192, tie_word_embeddings=True)
    cfg = TrainConfig(
        model=ModelConfig(name=name, num_stages=2, max_seq_len=4096),
        mask=MaskConfig(scheme="mask"),
        pipeline=PipelineConfig(micro_batch_size=1, seq_len=1024, max_staleness=0),
    )
    rows = plan_table(cfg, BF16, dp_group=True)
    assert [r["stage"] for r in rows] == [0, 1] and [r["layers"] for r in rows] == [8, 8]
    full = 16 * (2 * H * H + 2 * H * 512 + 3 * H * 8192 + 2 * H) + V * H + H
    # the tied head is its own copy on the last stage
    assert sum(r["weights"] for r in rows) == pytest.approx((full + V * H) * 4 / GIB)
    assert all(r["total"] > r["weights"] and r["host"] == 2 * r["weights"] for r in rows)


def test_a_swarm_stage_that_stashes_plans_two_copies_of_its_forward_weights() -> None:
    """In the swarm a middle stage runs its forwards on stashed weights, and so does stage 0 when
    it runs ahead (pipeline.max_staleness > 0): two versions can be alive at once. With the
    look-ahead (the default correction), one stash per delay at the current version plus the last
    version's, and the last update: 1 + 2 + 1 copies at max_staleness 1 (FP32: all 4 bytes)."""
    model = ModelConfig(name="tiny-llama", num_stages=3, hidden_size=32, num_layers=3, num_heads=2, max_seq_len=16)
    for staleness, fix, copies in ((0, "lookahead", [0, 2, 0]), (1, "none", [2, 2, 0]), (1, "lookahead", [4, 4, 0])):
        cfg = TrainConfig(
            model=model,
            mask=MaskConfig(scheme="mask"),
            pipeline=PipelineConfig(
                micro_batch_size=2, micro_batches=2, seq_len=8, max_staleness=staleness, staleness_correction=fix
            ),
        )
        plans = plan_stages(cfg, FP32, dp_group=True)
        assert [p.working_copy for p in plans] == [c * p.weights for c, p in zip(copies, plans)], (staleness, fix)
    assert all(p.working_copy == 0 for p in plan_stages(cfg, FP32))  # the local runner: no swarm stashes
