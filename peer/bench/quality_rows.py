"""The sizes of an `anchormesh bench quality` run and the rows it compares: one TrainConfig each, the same model, data,
token budget and seed, differing only in how the pipeline's links (and DP's rounds) carry data."""

from __future__ import annotations

from dataclasses import dataclass, replace

from peer.config import (
    TINY_RUN,
    AnchorConfig,
    DPConfig,
    MaskConfig,
    ModelConfig,
    OptimConfig,
    PipelineConfig,
    SpectralConfig,
    TrainConfig,
    recommended_mask,
)


@dataclass
class QualitySetup:
    """Sizes of one benchmark run; `quick` fits in 5 minutes on 2 CPU cores."""

    model: ModelConfig
    pretrain_steps: int
    adapt_steps: int
    micro_batch_size: int
    micro_batches: int
    seq_len: int
    pretrain_lr: float
    adapt_lr: float
    eval_batches: int
    drop: float = 0.95
    anchor_every: int = 20
    lowrank_rank: int = 20
    seed: int = 0  # data order, the toy's pretraining and, unless codec_seed sets it apart, the codec's draws
    codec_seed: int | None = None  # the codecs' rotations, dither offsets and masks; None = seed
    schedule: str = "constant"  # optim.schedule of the adaptation; a decaying one warms up over a tenth of the steps, decays to 0.1 x lr at the last

    def optim(self) -> OptimConfig:
        """The adaptation's AdamW and lr schedule, the same for every row."""
        if self.schedule == "constant":
            return OptimConfig(lr=self.adapt_lr)
        return OptimConfig(
            lr=self.adapt_lr,
            schedule=self.schedule,
            warmup_steps=max(1, self.adapt_steps // 10),
            decay_steps=self.adapt_steps,
        )


# rows whose gradient links report a rate too slow for more than their floor: every gradient
# message after the first step goes at `mask.grad_min_bits` bits per value (peer/bench/quality_train.HeldLinks)
HELD_GRADIENT_ROWS = frozenset({"transform_stale1_g05", "transform_stale1_g025"})


def rows(setup: QualitySetup) -> dict[str, TrainConfig]:
    """The compared runs. DP rows keep the token budget: 2 replicas x half the micro-batches."""
    m = setup.micro_batches
    # the rows' base is synchronous and dense; the default row takes the recommended run's settings
    pipe = PipelineConfig(
        micro_batch_size=setup.micro_batch_size, micro_batches=m, seq_len=setup.seq_len, max_staleness=0
    )
    pipe_dp = replace(pipe, micro_batches=max(1, m // 2))
    stale1 = replace(pipe, max_staleness=1)  # stage 0 one step ahead, as the swarm's default run
    recommended = PipelineConfig()
    default_pipe = replace(
        pipe, max_staleness=recommended.max_staleness, staleness_correction=recommended.staleness_correction
    )
    optim = setup.optim()
    anchor = AnchorConfig(every=setup.anchor_every, micro_batches=max(1, m // 2))
    mask = MaskConfig(scheme="mask", drop=setup.drop)
    # DiLoCo H=10 with int8 deltas. Outer step = plain averaging (lr 1, no momentum): with only
    # ~adapt_steps/10 outer steps, Nesterov (0.7, 0.9) measured worse here (1.89 vs 1.76 on lowrank_dp).
    dp = DPConfig(
        replicas=2, scheme="diloco", inner_steps=10, outer_lr=1.0, outer_momentum=0.0, outer_compression="int8"
    )

    def cfg(**kw) -> TrainConfig:
        base = dict(
            model=setup.model,
            mask=MaskConfig(scheme="mask"),
            pipeline=pipe,
            optim=optim,
            steps=setup.adapt_steps,
            seed=setup.seed,
        )
        base.update(kw)
        codec_seed = setup.seed if setup.codec_seed is None else setup.codec_seed
        base["mask"] = replace(base["mask"], seed=codec_seed)  # a replicate redraws the codec's randomness too
        return TrainConfig(**base)

    lowrank = MaskConfig(scheme="lowrank", rank=setup.lowrank_rank, values="int8")
    transform = recommended_mask(setup.model.name)  # the recommended run's codec (the tiny models: TINY_RUN's)
    rows_mask = replace(transform, grad_rates="row", grad_rounding="dither")
    two_bit = MaskConfig(
        **TINY_RUN["mask"]
    )  # the tiny models' codec: 2-bit stochastic gradients, the coder's statistics
    return {
        # the paper's method, as docs/design.md states it
        "dense": cfg(),
        "masked": cfg(mask=mask),
        "masked_anchor": cfg(mask=mask, anchor=anchor, spectral=SpectralConfig(mode="paper")),
        "masked_anchor_ef": cfg(mask=mask, anchor=anchor, spectral=SpectralConfig(mode="ef")),
        # our variants: unbiased fill around a learned token prior; low-rank basis + token prior
        "masked_prior_rescale": cfg(mask=replace(mask, fill="prior_rescale")),
        "lowrank": cfg(mask=lowrank),
        "lowrank_anchor": cfg(mask=lowrank, anchor=anchor, spectral=SpectralConfig(mode="paper")),
        # a transform coder made for real boundaries (peer/codec/transform.py), with the swarm's defaults
        "transform": cfg(mask=transform),
        # the former default, 2-bit gradients rounded stochastically at twice the Gaussian-optimal step, and variants of it
        "transform_2bit": cfg(mask=two_bit),
        "transform_grad1": cfg(mask=replace(two_bit, grad_bits=1.0)),  # half the gradient's bytes
        # gradients with subtractive dither (mask.grad_rounding): half the mean square error of stochastic rounding
        "transform_dither": cfg(mask=replace(two_bit, grad_rounding="dither")),
        "transform_grad1_dither": cfg(mask=replace(two_bit, grad_bits=1.0, grad_rounding="dither")),
        # dither's steps at the Gaussian-optimal width (mask.grad_step_scale 1): half the noise again
        "transform_grad1_dither_s1": cfg(
            mask=replace(two_bit, grad_bits=1.0, grad_rounding="dither", grad_step_scale=1.0)
        ),  # the default's gradients, the coder's statistics
        "transform_grad1_dither_s15": cfg(
            mask=replace(two_bit, grad_bits=1.0, grad_rounding="dither", grad_step_scale=1.5)
        ),
        "transform_dither_s1": cfg(mask=replace(two_bit, grad_rounding="dither", grad_step_scale=1.0)),
        "transform_b15_g15_s1": cfg(
            mask=replace(two_bit, bits=1.5, grad_bits=1.5, grad_rounding="dither", grad_step_scale=1.0)
        ),  # 2 + 1 bits' bytes, split evenly
        # and the activations with subtractive dither too (mask.act_rounding): an error independent of the value
        "transform_grad1_dither_both": cfg(
            mask=replace(two_bit, grad_bits=1.0, grad_rounding="dither", act_rounding="dither")
        ),
        # probes: each direction alone (the other at 8 bits), and the codec's path at 8 bits both ways
        "probe_act2_only": cfg(mask=replace(two_bit, grad_bits=8.0)),
        "probe_act2_msgstats": cfg(
            mask=replace(two_bit, grad_bits=8.0, act_stats="message")
        ),  # each message's own component statistics (mask.act_stats)
        "transform_msgstats": cfg(mask=replace(transform, act_stats="message")),  # on a real model: the default
        "probe_act2_refresh2": cfg(
            mask=replace(two_bit, grad_bits=8.0, basis_refresh=2)
        ),  # the activations' coder refitted every 2 steps instead of 20
        "probe_grad1_dither_only": cfg(mask=replace(two_bit, bits=8.0, grad_bits=1.0, grad_rounding="dither")),
        "probe_grad1_only": cfg(mask=replace(transform, bits=8.0)),  # the default's gradients alone (8-bit activations)
        "probe_8bit_both": cfg(mask=replace(two_bit, bits=8.0, grad_bits=8.0)),
        "transform_anchor": cfg(mask=transform, anchor=anchor, spectral=SpectralConfig(mode="paper")),
        # the anchors' filter truncated to its top directions (the control variate, spectral "ef", needs
        # a compressed twin of the anchor pass, which only the element mask has: masked_anchor_ef)
        "transform_anchor_r8": cfg(mask=transform, anchor=anchor, spectral=SpectralConfig(mode="paper", rank=8)),
        # stage 0 one step ahead of its applied gradients (pipeline.max_staleness 1): the pipeline no longer drains every step
        # the recommended run (peer/config defaults: bench quality's DEFAULT_ROW): its codec, staleness, no anchors
        "transform_stale1": cfg(
            mask=transform, pipeline=default_pipe, anchor=AnchorConfig(), spectral=SpectralConfig()
        ),
        # each gradient row its own rate (mask.grad_rates "row", dithered), the same bits per message
        "transform_rows": cfg(mask=rows_mask),
        "transform_rows_stale1": cfg(mask=rows_mask, pipeline=stale1),
        # every gradient row coded, the massive activations' rows too (mask.grad_outliers 0: before they went dense by default)
        "transform_all_coded": cfg(mask=replace(transform, grad_outliers=0.0)),
        "transform_rows_all_coded": cfg(mask=replace(rows_mask, grad_outliers=0.0)),
        # the gradients' dither steps other than Gaussian-optimal (mask.grad_step_scale): wider clip less and add more noise, narrower the reverse
        "transform_stale1_gs075": cfg(mask=replace(transform, grad_step_scale=0.75), pipeline=stale1),
        "transform_stale1_gs15": cfg(mask=replace(transform, grad_step_scale=1.5), pipeline=stale1),
        "transform_stale1_gs2": cfg(mask=replace(transform, grad_step_scale=2.0), pipeline=stale1),
        "transform_stale1_b15_g15": cfg(
            mask=replace(transform, bits=1.5, grad_bits=1.5), pipeline=stale1
        ),  # the same bytes, split evenly
        # the gradients' rotation drawn per message (a signed permutation before the fixed one: mask.grad_rotation),
        # and nearest rounding instead of dither (less noise; its bias is the one the rotation turns into noise)
        "transform_stale1_near_msg": cfg(
            mask=replace(transform, grad_rounding="nearest", grad_rotation="message"), pipeline=stale1
        ),
        "transform_stale1_msg": cfg(mask=replace(transform, grad_rotation="message"), pipeline=stale1),
        # the recommended run with its gradient links held at a floor below a bit per value
        # (mask.grad_min_bits; each message other components of the rotation): what a slow link's
        # sub-bit gradients cost, were the floor lowered (the held links: HELD_GRADIENT_ROWS)
        "transform_stale1_g05": cfg(
            mask=replace(transform, grad_min_bits=0.5), pipeline=default_pipe, anchor=AnchorConfig()
        ),
        "transform_stale1_g025": cfg(
            mask=replace(transform, grad_min_bits=0.25), pipeline=default_pipe, anchor=AnchorConfig()
        ),
        # one more bit on one side (~8x instead of 10x at 2,048 tokens): what continual pretraining's gap costs in bytes
        "transform_stale1_b3": cfg(mask=replace(transform, bits=3.0), pipeline=stale1),
        "transform_stale1_g2": cfg(mask=replace(transform, grad_bits=2.0), pipeline=stale1),
        "transform_stale1_8bit": cfg(
            mask=replace(transform, bits=8.0, grad_bits=8.0), pipeline=stale1
        ),  # the default row's path with bits to spare: what its structure costs
        "transform_stale1_stash": cfg(
            mask=transform, pipeline=replace(pipe, max_staleness=1, staleness_correction="none")
        ),  # plain stashing, as the swarm's stage 0 did before the look-ahead
        "dense_stale1": cfg(pipeline=stale1),  # what the staleness alone costs, with the look-ahead
        "dense_stale1_stash": cfg(
            pipeline=replace(pipe, max_staleness=1, staleness_correction="none")
        ),  # and with plain stashing
        # data parallel, same token budget: 2 replicas x half the micro-batches
        "dense_dp": cfg(dp=DPConfig(replicas=2, scheme="dense"), pipeline=pipe_dp),
        "masked_anchor_dp": cfg(
            mask=mask, anchor=anchor, spectral=SpectralConfig(mode="paper"), dp=dp, pipeline=pipe_dp
        ),
        "lowrank_dp": cfg(mask=lowrank, dp=dp, pipeline=pipe_dp),
        "transform_dp": cfg(mask=transform, dp=dp, pipeline=pipe_dp),
    }
