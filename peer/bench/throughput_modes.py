"""What each mode of `anchormesh bench throughput` runs (peer/bench/throughput.py), and the GPU world
the CPU test bed stands in for.

Why a module of its own: the modes' run.toml content and the GPU-equivalent bandwidth are what
the other benches (project, mixed, profile, plot) share with the throughput bench; they need
them without the bed that measures.
"""

from __future__ import annotations

from dataclasses import dataclass

from peer.config import TINY_RUN, MaskConfig
from peer.errors import ConfigError

MODES = ("compute_bound", "dense", "masked", "masked_dp")
SYNC = "dense_sync"  # stock GPipe + a synchronous fp32 all-reduce, not the swarm (peer/bench/sync_baseline.py)
ALL_MODES = (*MODES, SYNC)
TINY_HIDDEN = 128


@dataclass(frozen=True)
class GpuScenario:
    """The GPU world the CPU test bed stands in for (figures from public spec sheets)."""

    gpu: str = "RTX 4090"
    peak_tflops: float = 165.2  # dense bf16 tensor throughput, fp32 accumulate (spec sheet)
    mfu: float = 0.40  # a typical achieved fraction for a 1B model's training step
    model: str = "Llama-3.2-1B"
    hidden: int = 2048
    layers: int = 16
    params: float = 1.236e9  # embeddings tied: the head's matmul still costs its FLOPs
    seq_len: int = 2048
    link_mbit: float = 200.0

    def flops_per_token(self) -> float:
        """Forward + backward: 6 FLOPs per parameter, plus attention scores 12 * L * h * seq."""
        return 6 * self.params + 12 * self.layers * self.hidden * self.seq_len

    def stage_tokens_per_s(self, stages: int) -> float:
        return self.peak_tflops * 1e12 * self.mfu / (self.flops_per_token() / stages)

    def rho(self, stages: int) -> float:
        """Dense activation link time over compute time, per token and stage (bf16 activations)."""
        link_s = 2 * self.hidden * 8 / (self.link_mbit * 1e6)
        return link_s * self.stage_tokens_per_s(stages)


def equivalent_mbit(scenario: GpuScenario, stages: int, stage_tokens_per_s: float) -> float:
    """The bandwidth at which the CPU swarm's dense link/compute ratio equals the scenario's;
    `stage_tokens_per_s` is one peer's compute rate at its stage (not the pipeline's throughput,
    which bubbles lower: the GPU side is a compute rate too)."""
    return 2 * TINY_HIDDEN * 8 * stage_tokens_per_s / scenario.rho(stages) / 1e6


# the run's data in shards of 2^18 ids (512 KiB): a stage-0 peer starts once its first shard is in,
# and the bed's links stand for links ~40x faster (the GPU-equivalent rule), so the default 32 MiB
# shard would keep a slow-linked peer out of the run for a minute that stands for seconds
BED_SHARD_TOKENS = 1 << 18


def mode_config(mode: str, stages: int, steps: int, dp_every: int, seed: int = 0, max_staleness: int = 0) -> dict:
    """run.toml content of one mode (`max_staleness`: steps stage 0 may run ahead; 0 drains the
    pipeline every step, the recommended run's 1 does not)."""
    if mode not in MODES:
        raise ConfigError("mode", mode, f"must be one of {', '.join(MODES)}")
    # the recommended run's codec (MaskConfig's defaults: 2-bit activations, 1-bit dithered gradients), its
    # settings pinned against the tiny model's profile (TINY_RUN): the bed carries the bytes a real model's run
    # sends. Its gradients' rotation is drawn per message (the same bytes): through the fixed rotation the 1-bit
    # clip's bias adds up and the tiny model's stage-0 output grows without bound at its lr (peer/config/codec.py)
    compressed_pp = {
        "scheme": "transform",
        "adapt": False,
        **{k: getattr(MaskConfig(), k) for k in TINY_RUN["mask"]},
        "grad_rotation": "message",
    }
    dense_pp = {"scheme": "mask", "drop": 0.0, "values": "fp16", "adapt": False}
    dense_dp = {
        "inner_steps": 1,
        "outer_compression": "none",
        "link_share": 0.0,
        "min_period_s": 1.0,
    }  # every step, as far as hivemind allows
    compressed_dp = {"inner_steps": dp_every, "outer_compression": "int8", "link_share": 0.0}
    mask, dp = {
        "dense": (dense_pp, dense_dp),
        "masked": (compressed_pp, dense_dp),
        "masked_dp": (compressed_pp, compressed_dp),
        "compute_bound": (compressed_pp, compressed_dp),
    }[mode]
    return {
        "seed": seed,
        "model": {
            "name": "tiny-llama",
            "num_stages": stages,
            "hidden_size": TINY_HIDDEN,
            "num_layers": 2 * stages,
            "num_heads": 4,
            "max_seq_len": 128,
        },
        "mask": mask,
        "dp": dp,
        "data": {"shard_tokens": BED_SHARD_TOKENS},
        "anchor": {"every": 0},
        "optim": {"lr": 2e-3},
        "pipeline": {
            "micro_batch_size": 8,
            "micro_batches": 2,
            "seq_len": 128,
            "eval_every": steps,
            "eval_batches": 8,
            "max_staleness": max_staleness,
        },
    }
