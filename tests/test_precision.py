"""Placement and mixed precision on the CPU: bf16 compute with fp32 master weights trains like
fp32, the working copy is one persistent tensor per parameter, activation checkpointing changes
no gradient, and a device or precision that cannot run here is refused with the fix."""

from __future__ import annotations

import pytest
import torch
from test_runner import MODEL, PIPE, windows  # the same learnable stream as the fp32 runner tests

from peer.config import (
    AnchorConfig,
    ComputeConfig,
    DPConfig,
    MaskConfig,
    OptimConfig,
    PipelineConfig,
    SpectralConfig,
    TrainConfig,
)
from peer.errors import ConfigError
from peer.model.loading import load_causal_lm
from peer.model.placement import CPU_FP32, Placement, parse_device, resolve_placement
from peer.model.stages import lm_loss, split_model
from peer.runtoml import config_from_dict

BF16 = Placement(compute_dtype=torch.bfloat16)


def _run(cfg: TrainConfig, placement: Placement, steps: int):
    from peer.pipeline.local import LocalPipelineRunner

    runner = LocalPipelineRunner(cfg, load_causal_lm(MODEL, seed=3), windows, placement=placement)
    losses = [r.loss for r in runner.run(steps)]
    runner.close()
    return losses, runner


def test_bf16_with_fp32_masters_tracks_fp32_training() -> None:
    cfg = TrainConfig(
        model=MODEL, pipeline=PIPE, optim=OptimConfig(lr=3e-3), mask=MaskConfig(scheme="mask", values="fp32"), steps=8
    )
    fp32, _ = _run(cfg, CPU_FP32, 8)
    bf16, runner = _run(cfg, BF16, 8)
    assert all(abs(a - b) < 0.05 * a for a, b in zip(fp32, bf16)), (fp32, bf16)
    assert sum(bf16[-2:]) < sum(bf16[:2]) - 0.5, bf16
    for w in (row[0] for row in runner.workers):
        # masters and AdamW state in fp32; the layers ran on one bf16 copy kept across steps
        assert all(p.dtype == torch.float32 for p in w.stage.parameters())
        assert all(
            st["exp_avg"].dtype == torch.float32 and st["exp_avg_sq"].dtype == torch.float32
            for st in w.optimizer.opt.state.values()
        )
        assert w.weights.work is not None and all(t.dtype == torch.bfloat16 for t in w.weights.work.values())


def test_working_copy_is_persistent_and_follows_the_masters() -> None:
    """One low-precision copy per parameter for the whole run, refreshed in place after each
    step: never a new one per micro-batch or per step."""
    cfg = TrainConfig(model=MODEL, mask=MaskConfig(scheme="mask"), pipeline=PIPE, optim=OptimConfig(lr=3e-3), steps=3)
    from peer.pipeline.local import LocalPipelineRunner

    runner = LocalPipelineRunner(cfg, load_causal_lm(MODEL, seed=3), windows, placement=BF16)
    runner.run(1)
    w = runner.workers[0][0]
    ids = {n: t.data_ptr() for n, t in w.weights.work.items()}
    runner.run(3)
    assert {n: t.data_ptr() for n, t in w.weights.work.items()} == ids
    w.weights.working()
    for n, p in w.stage.named_parameters():
        torch.testing.assert_close(w.weights.work[n], p.detach().to(torch.bfloat16), rtol=0, atol=0)
    runner.close()


@pytest.mark.parametrize(
    "name,kw",
    [
        ("masked_prior", dict(mask=MaskConfig(scheme="mask", drop=0.9, fill="prior_rescale"))),
        ("lowrank_int8", dict(mask=MaskConfig(scheme="lowrank", rank=8, values="int8", basis_refresh=4))),
        ("transform", dict(mask=MaskConfig(scheme="transform", bits=2.0, grad_bits=1.0, basis_refresh=4))),
        (
            "anchor_paper",
            dict(
                mask=MaskConfig(scheme="mask", drop=0.9),
                anchor=AnchorConfig(every=3),
                spectral=SpectralConfig(mode="paper"),
            ),
        ),
        (
            "stale_lookahead",
            dict(
                mask=MaskConfig(scheme="mask", drop=0.9),
                pipeline=PipelineConfig(micro_batch_size=4, micro_batches=2, seq_len=32, max_staleness=2),
            ),
        ),
        (
            "dp_diloco",
            dict(
                mask=MaskConfig(scheme="mask", drop=0.9),
                dp=DPConfig(replicas=2, scheme="diloco", inner_steps=4),
                pipeline=PipelineConfig(micro_batch_size=4, micro_batches=1, seq_len=32, max_staleness=0),
            ),
        ),
    ],
)
def test_bf16_variants_train(name: str, kw: dict) -> None:
    cfg = TrainConfig(
        **{
            "model": MODEL,
            "mask": MaskConfig(scheme="mask"),
            "optim": OptimConfig(lr=3e-3),
            "pipeline": PIPE,
            "steps": 12,
            **kw,
        }
    )
    losses, _ = _run(cfg, BF16, 12)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, f"{name}: loss did not fall: {losses}"


def test_activation_checkpointing_changes_no_gradient() -> None:
    stages = split_model(load_causal_lm(MODEL, seed=1), 2)
    w = windows(0, 0, 0)
    grads = []
    for ckpt in (False, True):
        for s in stages:
            s.zero_grad(set_to_none=True)
            s.checkpointing = ckpt
        lm_loss(stages[1](stages[0](w[:, :-1])), w[:, 1:]).backward()
        grads.append({n: p.grad.clone() for s in stages for n, p in s.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-6, msg=n)


def test_compute_config_keys_and_refusals() -> None:
    cfg = config_from_dict({"compute": {"dtype": "bf16", "activation_checkpointing": True, "memory_budget_gib": 20}})
    assert (cfg.compute.dtype, cfg.compute.activation_checkpointing, cfg.compute.memory_budget_gib) == (
        "bf16",
        True,
        20,
    )
    with pytest.raises(ConfigError, match="compute.dtype.*loss scaler"):
        ComputeConfig(dtype="fp16")
    with pytest.raises(ConfigError, match="compute.dtype"):
        ComputeConfig(dtype="int4")
    with pytest.raises(ConfigError, match="compute.memory_budget_gib"):
        config_from_dict({"compute": {"memory_budget_gib": -1}})


def test_placement_on_this_machine() -> None:
    assert parse_device("cpu") == torch.device("cpu")
    assert resolve_placement("cpu", ComputeConfig()) == CPU_FP32  # auto on the CPU: fp32
    p = resolve_placement("cpu", ComputeConfig(dtype="bf16", activation_checkpointing=True))
    assert p.mixed and p.checkpointing and p.compute_dtype == torch.bfloat16 and p.master_dtype == torch.float32
    if not torch.cuda.is_available():
        assert parse_device("auto") == torch.device("cpu")
        for bad in ("cuda", "cuda:0", "cuda:7"):
            with pytest.raises(ConfigError, match="no CUDA device is visible"):
                parse_device(bad)
    with pytest.raises(ConfigError, match="cuda:N"):
        parse_device("cuda:first")
    with pytest.raises(ConfigError, match="must be auto, cpu, cuda or cuda:N"):
        parse_device("tpu")


def test_bf16_with_activation_checkpointing_trains_like_without() -> None:
    """Checkpointing recomputes each layer on the weights the forward saw: the bf16 working copy
    (functional_call), not the fp32 masters; both runs step identically."""
    cfg = TrainConfig(
        model=MODEL, pipeline=PIPE, optim=OptimConfig(lr=3e-3), mask=MaskConfig(scheme="mask", values="fp32"), steps=4
    )
    plain, _ = _run(cfg, BF16, 4)
    ckpt, runner = _run(cfg, Placement(compute_dtype=torch.bfloat16, checkpointing=True), 4)
    assert all(w.stage.checkpointing for row in runner.workers for w in row)
    torch.testing.assert_close(ckpt, plain, rtol=1e-4, atol=1e-4)
