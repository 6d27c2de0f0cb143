"""`anchormesh bench mixed`: one swarm on two link speeds at once, codec fixed vs self-tuning.

Half the peers get a link `--slow-factor` times slower than the others: once every peer has
joined, the second peer (by id) of each stage group is slowed, so every group and every stage
boundary has a fast and a slow end, the same in every mode. Modes
(the same tiny model, batches and seed as `bench throughput`):

  compute_bound  the swarm on unshaped links (also sets the GPU-equivalent fast link, as there)
  fixed          the PP codec at its configured payload, int8 DP deltas every `dp_every`
                 steps: hand-tuned for the fast links, and the slow ones hold everyone back
  adaptive       the same bounds, but each sender picks per link how much of that payload fits
                 its measured bandwidth (mask.adapt, floor mask.min_keep), and each peer spaces
                 its averaging rounds to take at most dp.link_share of its uplink

The PP codec (`--codec`): "transform", the swarm's (2-bit activations, 1-bit gradients; adapting,
the activations go down to min_keep of their bits, the gradients to `--grad-min-bits` per value,
default 1: the 1-bit gradients do not adapt), or
"lowrank" at rank 64 (the config's most; adapting, down to 8 coefficients), the first runs' codec.

The pipeline runs as the recommended run does (`--max-staleness`, default pipeline.max_staleness's
1: stage 0 sends the next step's micro-batches while this step's gradients come back, so a link
carries several at once), the one a link meter has runs of messages to measure.

The question it answers: does a swarm on mixed links stay near compute-bound without hand tuning?
Reported per mode: tokens/s, its ratio to compute_bound, wire bytes/token, eval loss at the same
step, and per peer: its host's link, the link it measured, the share of the rank it sent and its
averaging period.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from peer.bench.dp_shape import swarm_groups
from peer.bench.throughput import check_bed_args, check_max_staleness
from peer.bench.throughput_measure import measure_mode
from peer.bench.throughput_modes import GpuScenario, equivalent_mbit, mode_config
from peer.config import MaskConfig, PipelineConfig
from peer.errors import ConfigError

MIXED_MODES = ("compute_bound", "fixed", "adaptive")
MIXED_CODECS = ("transform", "lowrank")
MAX_RANK = 64
MIN_KEEP = 0.125
RUN_STALENESS = PipelineConfig().max_staleness  # the recommended run's: stage 0 a step ahead


def mixed_config(
    mode: str,
    stages: int,
    steps: int,
    dp_every: int,
    codec: str = "transform",
    grad_min_bits: float = 1.0,
    max_staleness: int = RUN_STALENESS,
) -> dict:
    """run.toml content of one mode (see the module docstring)."""
    if mode not in MIXED_MODES:
        raise ConfigError("mode", mode, f"must be one of {', '.join(MIXED_MODES)}")
    if codec not in MIXED_CODECS:
        raise ConfigError("--codec", codec, f"must be one of {', '.join(MIXED_CODECS)}")
    if grad_min_bits != 1.0 and codec != "transform":
        raise ConfigError(
            "--grad-min-bits",
            grad_min_bits,
            "applies to --codec transform only (the low-rank codec's gradients adapt with min_keep)",
        )
    cfg = mode_config("masked_dp", stages, steps, dp_every, max_staleness=max_staleness)
    adapt = mode == "adaptive"
    pp = (
        cfg["mask"] if codec == "transform" else {"scheme": "lowrank", "rank": MAX_RANK, "values": "int8"}
    )  # transform: the recommended run's codec
    cfg["mask"] = {
        **pp,
        "adapt": adapt,
        "min_keep": MIN_KEEP,
        **({"grad_min_bits": grad_min_bits} if grad_min_bits != 1.0 else {}),
    }
    cfg["dp"] = {"inner_steps": dp_every, "outer_compression": "int8", "link_share": 0.2 if adapt else 0.0}
    return cfg


def slow_hosts(status: dict) -> list[int]:
    """Host indexes of the second peer (by host) of each stage: the ones to slow."""
    stages = 1 + max((p.get("stage") or 0 for p in status["peers"]), default=0)
    return sorted(hosts[1] for hosts in swarm_groups(status, stages) if len(hosts) > 1)


def run_mixed(
    quick: bool,
    bandwidth_mbit: float | None,
    slow_factor: float,
    stages: int,
    replicas: int,
    workdir: Path | None = None,
    codec: str = "transform",
    grad_min_bits: float = 1.0,
    max_staleness: int = RUN_STALENESS,
    drop: bool = False,
) -> dict:
    """compute_bound, then fixed and adaptive on mixed links (then, with `drop`, the run whose
    link falls mid-run: peer/bench/mixed_drop.py); returns the JSON."""
    if replicas < 2:
        raise ConfigError(
            "--replicas", replicas, "must be >= 2 (the second peer of each stage group gets the slow link)"
        )
    if not slow_factor > 1:
        raise ConfigError("--slow-factor", slow_factor, "must be > 1 (how many times slower the slow links are)")
    check_max_staleness(max_staleness)  # flags first: the bed's check probes a namespace
    check_bed_args("bench mixed", stages, bandwidth_mbit)
    MaskConfig(
        **mixed_config("adaptive", stages, 1, 1, codec, grad_min_bits)["mask"]
    )  # a bad --codec or --grad-min-bits fails before any namespace exists
    # longer than bench throughput's quick run: a self-tuned swarm does 30 steps in ~8 s, too
    # short a window for 1 s status lines and for its (rarer) averaging rounds
    warmup, steps, dp_every = (10, 100, 5) if quick else (10, 150, 10)
    timeout_s = 300.0 if quick else 1800.0
    workdir = workdir or Path(tempfile.mkdtemp(prefix="anchormesh-mixed-"))
    n = stages * replicas
    out: dict = {"modes": {}}

    slowed: dict[str, list[int]] = {}

    def measure(mode: str, fast: float | None, subnet: int) -> dict:
        def reshape(bed, status: dict) -> None:
            slowed[mode] = slow_hosts(status)
            for i in slowed[mode]:
                bed.set_rate(i, fast / slow_factor)

        return measure_mode(
            mode,
            [fast] * (1 + n),
            stages,
            replicas,
            warmup,
            steps,
            dp_every,
            workdir,
            subnet,
            timeout_s,
            config=mixed_config(mode, stages, steps, dp_every, codec, grad_min_bits, max_staleness),
            reshape=reshape if fast is not None else None,
        )

    out["modes"]["compute_bound"] = cb = measure("compute_bound", None, 20)
    fast = bandwidth_mbit or equivalent_mbit(
        GpuScenario(), stages, cb["peer_capacity_tokens_per_s"] or cb["tokens_per_s"] / replicas
    )
    print(
        f"links: {fast:.2f} Mbit/s fast, {fast / slow_factor:.2f} Mbit/s slow (the second peer of each stage)",
        flush=True,
    )
    for i, mode in enumerate(("fixed", "adaptive")):
        out["modes"][mode] = measure(mode, fast, 21 + i)
    if drop:
        from peer.bench.mixed_drop import run_drop

        cfg = mixed_config("adaptive", stages, steps, dp_every, codec, grad_min_bits, max_staleness)
        out["drop"] = run_drop(fast, stages, replicas, cfg, workdir, 23, warmup)
        out["drop"]["settled_vs_compute_bound"] = out["drop"]["settled_tokens_per_s"] / cb["tokens_per_s"]
    m = out["modes"]
    out["ratios"] = {
        "fixed_vs_compute_bound": m["fixed"]["tokens_per_s"] / cb["tokens_per_s"],
        "adaptive_vs_compute_bound": m["adaptive"]["tokens_per_s"] / cb["tokens_per_s"],
        "adaptive_vs_fixed": m["adaptive"]["tokens_per_s"] / m["fixed"]["tokens_per_s"],
        "eval_loss_vs_compute_bound": {k: v["eval_loss"] / cb["eval_loss"] - 1 for k, v in m.items()},
    }
    out["setup"] = {
        "quick": quick,
        "stages": stages,
        "replicas": replicas,
        "hosts": 1 + n,
        "warmup_steps": warmup,
        "steps": steps,
        "dp_every": dp_every,
        "max_staleness": max_staleness,
        "fast_mbit": fast,
        "slow_mbit": fast / slow_factor,
        "slow_factor": slow_factor,
        "bandwidth_given": bandwidth_mbit is not None,
        "slowed_hosts": slowed,
        "codec": codec,
        "max_rank": MAX_RANK if codec == "lowrank" else None,
        "min_keep": MIN_KEEP,
        "grad_min_bits": grad_min_bits,
        "link_share": 0.2,
        "scaling_rule": "fast link = bench throughput's GPU-equivalent of 200 Mbit/s (see its setup.scaling_rule) unless --bandwidth-mbit",
        "workdir": str(workdir),
    }
    return out


def main_json(path: Path, **kwargs) -> dict:
    from peer.bench import emit_json

    return emit_json(run_mixed(**kwargs), path)
