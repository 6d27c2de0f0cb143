"""The local pipeline runner: exactness with masking/DP off, and training with them on."""

from __future__ import annotations

import copy

import pytest
import torch

from peer.config import (
    AnchorConfig,
    DPConfig,
    MaskConfig,
    ModelConfig,
    OptimConfig,
    PipelineConfig,
    SpectralConfig,
    TrainConfig,
)
from peer.model.loading import load_causal_lm
from peer.model.stages import lm_loss, merged_state_dict
from peer.pipeline.local import LocalPipelineRunner

MODEL = ModelConfig(name="tiny-llama", hidden_size=64, num_layers=4, num_heads=4, max_seq_len=64)
PIPE = PipelineConfig(micro_batch_size=4, micro_batches=2, seq_len=32, max_staleness=0)


def windows(step: int, replica: int, j: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * replica + j)
    # a learnable stream: repeated random phrases, so the loss can fall in a few steps
    phrase = torch.randint(0, 256, (8,), generator=torch.Generator().manual_seed(j % 3))
    base = phrase.repeat(10)[: PIPE.seq_len + 1]
    noise = torch.randint(0, 256, (PIPE.micro_batch_size, PIPE.seq_len + 1), generator=g)
    keep = torch.rand(PIPE.micro_batch_size, PIPE.seq_len + 1, generator=g) < 0.8
    return torch.where(keep, base.expand_as(noise), noise)


def reference_steps(model, steps: int, optim: OptimConfig, micro_batches: int, replicas: int = 1) -> list[float]:
    """Plain single-process training: the same windows, mean loss over micro-batches, AdamW."""
    model.train()
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=optim.lr,
        betas=(optim.beta1, optim.beta2),
        eps=optim.eps,
        weight_decay=optim.weight_decay,
    )
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        n = micro_batches * replicas
        for r in range(replicas):
            for j in range(micro_batches):
                w = windows(step, r, j)
                loss = lm_loss(model(input_ids=w[:, :-1]).logits, w[:, 1:])
                (loss / n).backward()
                total += float(loss.detach()) / n
        opt.step()
        losses.append(total)
    return losses


@pytest.mark.parametrize("num_stages,replicas", [(2, 1), (3, 1), (2, 2)])
def test_step_equals_single_process_step_with_masking_and_compression_off(num_stages: int, replicas: int) -> None:
    optim = OptimConfig(lr=1e-3, grad_clip=0.0)
    pipe = PipelineConfig(micro_batch_size=4, micro_batches=2 // replicas, seq_len=32, max_staleness=0)
    cfg = TrainConfig(
        model=MODEL.__class__(**{**MODEL.__dict__, "num_stages": num_stages}),
        mask=MaskConfig(scheme="mask", drop=0.0, values="fp32"),
        dp=DPConfig(replicas=replicas, scheme="dense"),
        optim=optim,
        pipeline=pipe,
        steps=3,
    )
    model = load_causal_lm(MODEL, seed=3)
    ref_model = copy.deepcopy(model)
    runner = LocalPipelineRunner(cfg, model, windows)
    reports = runner.run()
    ref_losses = reference_steps(ref_model, 3, optim, pipe.micro_batches, replicas)
    assert [r.step for r in reports] == [0, 1, 2]
    torch.testing.assert_close([r.loss for r in reports], ref_losses, rtol=1e-5, atol=1e-5)
    for replica in range(replicas):
        runner_state = merged_state_dict(runner.stages(replica))
        for name, p in ref_model.named_parameters():
            torch.testing.assert_close(
                runner_state[name], p.detach(), rtol=1e-5, atol=1e-6, msg=f"replica {replica} {name}"
            )


def _train(cfg: TrainConfig, steps: int) -> tuple[list[float], LocalPipelineRunner]:
    runner = LocalPipelineRunner(cfg, load_causal_lm(MODEL, seed=3), windows)
    losses = [r.loss for r in runner.run(steps)]
    runner.close()
    return losses, runner


@pytest.mark.parametrize(
    "name,kw",
    [
        ("masked", dict(mask=MaskConfig(scheme="mask", drop=0.95))),
        ("masked_prior_int8", dict(mask=MaskConfig(scheme="mask", drop=0.9, fill="token_prior", values="int8"))),
        ("masked_prior_rescale", dict(mask=MaskConfig(scheme="mask", drop=0.95, fill="prior_rescale"))),
        ("lowrank_int8", dict(mask=MaskConfig(scheme="lowrank", rank=8, values="int8", basis_refresh=4))),
        (
            "lowrank_top_rows",
            dict(mask=MaskConfig(scheme="lowrank", rank=8, values="int8", basis_refresh=4, prior_rows=24)),
        ),  # a "large vocabulary": 23 token rows + 1 shared
        (
            "transform",
            dict(mask=MaskConfig(scheme="transform", bits=2.0, grad_bits=1.0, basis_refresh=4)),
        ),  # refits every 4 steps after a dense warm-up
        (
            "anchor_paper",
            dict(
                mask=MaskConfig(scheme="mask", drop=0.95),
                anchor=AnchorConfig(every=3),
                spectral=SpectralConfig(mode="paper"),
            ),
        ),
        (
            "anchor_ef_thread",
            dict(
                mask=MaskConfig(scheme="mask", drop=0.95),
                anchor=AnchorConfig(every=3, executor="thread"),
                spectral=SpectralConfig(mode="ef"),
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
            "dp_powersgd",
            dict(
                mask=MaskConfig(scheme="mask", drop=0.9),
                dp=DPConfig(replicas=2, scheme="powersgd", rank=4),
                pipeline=PipelineConfig(micro_batch_size=4, micro_batches=1, seq_len=32, max_staleness=0),
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
def test_training_variants_reduce_the_loss(name: str, kw: dict) -> None:
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
    losses, runner = _train(cfg, 12)
    assert all(torch.isfinite(torch.tensor(losses)))
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.3, f"{name}: loss did not fall: {losses}"
    if cfg.anchor.enabled and cfg.anchor.executor == "inline":
        assert runner.anchor.launched == 12 // 3  # at steps 3, 6, 9, 12 on the snapshots of 0, 3, 6, 9
        assert runner.newest_anchor == 12 - 3  # K-step stale: the pass launched at step 12 ran on the weights of step 9
    if cfg.pipeline.max_staleness:
        assert sum(w.forwards_ahead for row in runner.workers for w in row) > 0, "no forward ran ahead of the optimizer"
    if cfg.dp.replicas > 1:
        a, b = (merged_state_dict(runner.stages(r)) for r in (0, 1))
        if cfg.dp.scheme != "diloco":
            assert all(torch.equal(a[k], b[k]) for k in a), "replicas diverged after gradient sync"


def test_masked_link_carries_about_keep_times_the_dense_bytes() -> None:
    """Bytes counted by the transport: masked (drop 0.95, fp16) is ~1/20 of dense plus the token ids."""
    dense = _train(TrainConfig(model=MODEL, mask=MaskConfig(scheme="mask"), pipeline=PIPE, steps=2), 2)[
        1
    ].transport.total_bytes()
    masked = _train(TrainConfig(model=MODEL, pipeline=PIPE, steps=2, mask=MaskConfig(scheme="mask", drop=0.95)), 2)[
        1
    ].transport.total_bytes()
    tokens = 2 * PIPE.micro_batches * PIPE.micro_batch_size * PIPE.seq_len
    hidden = 2 * 2 * tokens * MODEL.hidden_size  # fp16 values, forward + backward
    ids = (
        1 * 2 * PIPE.micro_batches * PIPE.micro_batch_size * (PIPE.seq_len + 1)
    )  # uint8 token windows (byte vocabulary), forward only
    assert hidden + ids <= dense < 1.05 * (hidden + ids)
    expected = 0.05 * hidden + ids
    assert 0.85 * expected < masked < 1.25 * expected, (masked, expected)
