"""`bench throughput --dp-like MODEL`: the bed's data-parallel traffic shaped as a real model's.

Why: the bed's link rate makes the tiny model's pipeline bytes stand to its compute as a real
model's do at the GPU scenario's link (peer/bench/throughput.py), but its averaging bytes are far
too cheap: a real model holds many more parameters per stage for each activation byte that
crosses a boundary. So each host's traffic to and from its stage mates (the swarm's stage-group
averaging, dense_sync's all-reduce) gets a class of its own on its link (NetBed.set_rate's
`dp_mbit`), at the rate that makes DP bytes stand to pipeline bytes, and so to compute, as the
real model's would. The rest (pipeline, DHT, tracker) keeps the link's rate.

Per stage s, both models at the bed's tokens per replica and step N:

    DP_s     = 2 * 4 * params_s     a ring all-reduce of the stage's fp32 gradients, bytes each
                                    member sends per step (2 (n-1)/n of it in a group of n: the
                                    same n on both sides, so it cancels)
    PP       = 2 * 2 * hidden * N   fp16 activations forward and their gradients back, across
                                    one boundary per step
    factor_s = (DP_s / PP)_tiny / (DP_s / PP)_real
             = (params_s / hidden)_tiny / (params_s / hidden)_real   (N cancels too)
    dp_rate_s = link rate * factor_s

The real model is split into the bed's stages (its layers as the swarm splits them, the
embedding on the first stage, norm and head on the last).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from peer.bench.bedswarm import host_of
from peer.bench.project_model import KNOWN_MODELS, ModelDims, resolve_model
from peer.bench.throughput_modes import GpuScenario, mode_config
from peer.errors import ConfigError

if TYPE_CHECKING:
    from peer.bench.netbed import NetBed

GRAD_BYTES = 4  # fp32 gradients in the all-reduce
LINK_BYTES = 2  # fp16 / bf16 activations and gradients across a boundary
FORMULA = (
    "dp_rate[s] = link_rate * factor[s]; factor[s] = (DP[s] / PP)_tiny / (DP[s] / PP)_real "
    "= (params[s] / hidden)_tiny / (params[s] / hidden)_real; DP[s] = 2 * 4 * params[s] "
    "(ring all-reduce of stage s's fp32 gradients, bytes per member and step); "
    "PP = 2 * 2 * hidden * tokens_per_step (fp16 activations forward and gradients back over one "
    "boundary); both models at the bed's tokens per replica and step"
)


def bed_tokens_per_step() -> int:
    """Tokens one replica trains on per step on the bed: micro-batch size x seq_len x micro-batches."""
    p = mode_config("dense", 2, 1, 1)["pipeline"]
    return p["micro_batch_size"] * p["seq_len"] * p["micro_batches"]


def step_bytes(dims: ModelDims, stage: int, stages: int, tokens: int) -> tuple[int, int]:
    """(DP, PP) bytes per step of one member of `stage`: its fp32 gradients' ring all-reduce, and
    the fp16 activations and gradients of `tokens` across one boundary (module docstring)."""
    return 2 * GRAD_BYTES * dims.stage_params(stage, stages), 2 * LINK_BYTES * dims.hidden * tokens


def dp_factor(tiny: ModelDims, real: ModelDims, stage: int, stages: int, tokens: int) -> float:
    """The DP class's rate over the link's for `stage`: (DP / PP)_tiny / (DP / PP)_real."""
    dp_tiny, pp_tiny = step_bytes(tiny, stage, stages, tokens)
    dp_real, pp_real = step_bytes(real, stage, stages, tokens)
    return (dp_tiny / pp_tiny) / (dp_real / pp_real)


def dp_like_dims(name: str) -> ModelDims:
    """The published shape `--dp-like` names (the models `bench project` knows)."""
    dims = KNOWN_MODELS.get(name.lower())
    if dims is None:
        raise ConfigError("--dp-like", name, f"unknown model; known: {', '.join(KNOWN_MODELS)}")
    return dims


def scenario_like(dims: ModelDims) -> GpuScenario:
    """The GPU scenario with `dims`' shape: the link rate then stands for that model's pipeline
    at the scenario's link, as the DP class stands for its averaging."""
    return replace(GpuScenario(), model=dims.name, hidden=dims.hidden, layers=dims.layers, params=float(dims.params()))


def dp_like_setup(name: str, stages: int, link_mbit: float) -> dict:
    """What `--dp-like` declares in OUT's setup: the shape, each stage's parameters and factor,
    the DP classes' rates (one per stage) and the formula."""
    from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES

    from peer.dp.group_process import NEXT_CHUNK_S

    real = dp_like_dims(name)
    tiny, _, _ = resolve_model("tiny-llama", stages)
    tokens = bed_tokens_per_step()
    rows = []
    for s in range(stages):
        f = dp_factor(tiny, real, s, stages, tokens)
        dp_t, pp_t = step_bytes(tiny, s, stages, tokens)
        dp_r, pp_r = step_bytes(real, s, stages, tokens)
        rows.append(
            {
                "stage": s,
                "tiny_params": tiny.stage_params(s, stages),
                "real_params": real.stage_params(s, stages),
                "tiny_dp_over_pp": dp_t / pp_t,
                "real_dp_over_pp": dp_r / pp_r,
                "factor": f,
                "dp_rate_mbit": link_mbit * f,
                "averaging_part_s": DEFAULT_PART_SIZE_BYTES * 8 / (link_mbit * f * 1e6),
            }
        )
    slowest = max(r["averaging_part_s"] for r in rows)
    return {
        "model": {
            "key": name.lower(),
            "name": real.name,
            "hidden": real.hidden,
            "layers": real.layers,
            "params": real.params(),
            "source": real.source,
        },
        "tiny": {"hidden": tiny.hidden, "layers": tiny.layers, "params": tiny.params()},
        "tokens_per_step_per_replica": tokens,
        "link_mbit": link_mbit,
        "stages": rows,
        "dp_rates_mbit": [r["dp_rate_mbit"] for r in rows],
        "formula": FORMULA,
        "part_over_timeout": slowest > NEXT_CHUNK_S,
        "part_note": f"one averaging part ({DEFAULT_PART_SIZE_BYTES // 1024} KiB) takes up to {slowest:.1f} s on a DP "
        f"class; the averager leaves out a member silent for {NEXT_CHUNK_S:g} s (peer/dp/group_process.py)",
        "classes": "htb on every peer's eth0 (ip dst) and bridge port (ip src): its stage mates' "
        "addresses at its stage's dp_rate_mbit, the rest at link_mbit; each class shaped by its own tbf",
    }


def sync_seconds_per_step(setup: dict, replicas: int) -> float:
    """Seconds dense_sync's fp32 all-reduce of the slowest stage takes per step on its DP class
    (2 (n-1)/n of the stage's gradients each way): what its time limit must allow for."""
    if replicas < 2:
        return 0.0
    return max(
        2 * (replicas - 1) / replicas * GRAD_BYTES * row["tiny_params"] * 8 / (row["dp_rate_mbit"] * 1e6)
        for row in setup["stages"]
    )


def swarm_groups(status: dict, stages: int) -> list[list[int]]:
    """Bed hosts per stage from a swarm status: peer `bed-peerN` runs on host N."""
    groups: list[list[int]] = [[] for _ in range(stages)]
    for p in status["peers"]:
        host = host_of(p["id"])
        if host is not None and p["state"] in ("active", "idle") and p.get("stage") is not None:
            groups[p["stage"]].append(host)
    return [sorted(g) for g in groups]


def sync_groups(stages: int, replicas: int) -> list[list[int]]:
    """Bed hosts per stage of dense_sync: rank stage * replicas + replica runs on host = rank."""
    return [[s * replicas + j for j in range(replicas)] for s in range(stages)]


def shape_groups(bed: NetBed, groups: list[list[int]], link_mbit: float, dp_rates_mbit: list[float]) -> None:
    """Every host of stage s: its traffic to and from its stage mates at dp_rates_mbit[s], the rest
    at `link_mbit` (a host alone in its stage keeps one tbf)."""
    for s, hosts in enumerate(groups):
        for h in hosts:
            bed.set_rate(h, link_mbit, dp_mbit=dp_rates_mbit[s], dp_hosts=[o for o in hosts if o != h])
