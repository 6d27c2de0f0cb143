"""The lr schedule (optim.schedule): its curve, its config errors, and a pipelined run that steps
with it exactly as single-process training does."""

from __future__ import annotations

import copy

import pytest
import torch

from peer.config import MaskConfig, OptimConfig, PipelineConfig, TrainConfig
from peer.errors import ConfigError
from peer.model.loading import load_causal_lm
from peer.model.stages import lm_loss, merged_state_dict
from peer.optim.schedule import lr_at
from peer.pipeline.local import LocalPipelineRunner
from tests.test_runner import MODEL, windows


def test_warmup_then_cosine_falls_to_the_floor_and_stays() -> None:
    o = OptimConfig(lr=1e-3, schedule="cosine", warmup_steps=4, decay_steps=20, min_lr_ratio=0.1)
    lrs = [lr_at(o, s) for s in range(30)]
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert lrs[4] == pytest.approx(1e-3)
    assert lrs[12] == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # half way through the decay
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert lrs[20:] == pytest.approx([1e-4] * 10)


def test_linear_and_constant() -> None:
    lin = OptimConfig(lr=2.0, schedule="linear", decay_steps=10, min_lr_ratio=0.0)
    assert [lr_at(lin, s) for s in (0, 5, 10, 99)] == pytest.approx([2.0, 1.0, 0.0, 0.0])
    const = OptimConfig(lr=3e-4, warmup_steps=2)
    assert [lr_at(const, s) for s in (0, 1, 2, 500)] == pytest.approx([1.5e-4, 3e-4, 3e-4, 3e-4])


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(schedule="step"), "optim.schedule"),
        (dict(schedule="cosine"), "optim.decay_steps"),  # a swarm runs until stopped: the horizon must be said
        (dict(schedule="cosine", warmup_steps=10, decay_steps=10), "optim.decay_steps"),
        (dict(min_lr_ratio=1.5), "optim.min_lr_ratio"),
        (dict(warmup_steps=-1), "optim.warmup_steps"),
    ],
)
def test_bad_schedules_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        OptimConfig(**kw)


def test_pipelined_run_follows_the_schedule_like_single_process_training() -> None:
    optim = OptimConfig(lr=2e-3, grad_clip=0.0, schedule="cosine", warmup_steps=2, decay_steps=5, min_lr_ratio=0.2)
    pipe = PipelineConfig(micro_batch_size=4, micro_batches=2, seq_len=32, max_staleness=0)
    cfg = TrainConfig(
        model=MODEL, mask=MaskConfig(scheme="mask", drop=0.0, values="fp32"), optim=optim, pipeline=pipe, steps=6
    )
    model = load_causal_lm(MODEL, seed=3)
    ref = copy.deepcopy(model)
    runner = LocalPipelineRunner(cfg, model, windows)
    runner.run()
    opt = torch.optim.AdamW(
        ref.parameters(), lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, weight_decay=0.0
    )
    for step in range(6):
        for g in opt.param_groups:
            g["lr"] = lr_at(optim, step)
        opt.zero_grad()
        for j in range(2):
            w = windows(step, 0, j)
            (lm_loss(ref(input_ids=w[:, :-1]).logits, w[:, 1:]) / 2).backward()
        opt.step()
    state = merged_state_dict(runner.stages(0))
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    # and it differs from the constant-lr run: the schedule is what made them equal
    const = LocalPipelineRunner(
        TrainConfig(
            model=MODEL,
            mask=MaskConfig(scheme="mask", drop=0.0, values="fp32"),
            optim=OptimConfig(lr=2e-3, grad_clip=0.0),
            pipeline=pipe,
            steps=6,
        ),
        load_causal_lm(MODEL, seed=3),
        windows,
    )
    const.run()
    other = merged_state_dict(const.stages(0))
    assert any(not torch.allclose(other[n], p.detach(), atol=1e-6) for n, p in ref.named_parameters())
    runner.close()
    const.close()
