"""`anchormesh bench throughput`: tokens/s of one swarm on shaped links, four ways, and of the synchronous baseline, side by side.

Modes (the same tiny model, stages x replicas, batches and seed; only the wire differs):
  dense          no PP compression (fp16 activations and gradients), DP = fp32 parameter
                 averaging as often as the averager manages (every step at most)
  masked         PP compressed (MaskConfig's transform defaults: 2-bit activations, 1-bit dithered gradients), DP as dense
  masked_dp      PP compressed, DP = 8-bit deltas every `dp_every` steps
  compute_bound  masked_dp on unshaped links: what the same swarm does when the link is free
  dense_sync     not the swarm: what a user would run instead, stock GPipe + a synchronous fp32
                 gradient all-reduce every step (torch.distributed over gloo; peer/bench/sync_baseline.py),
                 same bed, links, model, micro-batches and optimizer; tokens/s only (random tokens)

Each mode starts a fresh NetBed (bootstrap on host 0, one peer per further host, every link
shaped with tbf at the same rate), waits until every peer has done `warmup` steps of its own
(the run's step is the fastest stage-0 peer's: a slow peer may still be starting), then measures
the next `steps - warmup` run steps (to `steps` at least): tokens/s from the tracker's token count and clock, and bytes/token from the kernel's
interface counters of all hosts (what really crossed the links: PP, DP, DHT, heartbeats,
headers) and from the app's own counters. Eval loss is the tracker's held-out evaluation
launched at step `steps`: every mode has then trained on the same number of tokens.

GPU-equivalent bandwidth (`--bandwidth-mbit` not given): a tiny model on a CPU computes far
slower than a 1B model on a GPU, so 200 Mbit/s here would make every mode compute-bound. The
bench first runs compute_bound, then sets the bandwidth so that one dense micro-batch's link
time over its compute time equals that of the GPU scenario (`GpuScenario`) at its link speed:

  rho        = (2 * hidden_gpu * 8 / link_bps) * stage_tokens_per_s_gpu   (link time / compute time)
  bandwidth  = 2 * hidden_cpu * 8 * stage_tokens_per_s_cpu / rho

with stage_tokens_per_s_gpu = peak FLOP/s * MFU / (FLOPs per token / stages), and
stage_tokens_per_s_cpu = the median peer capacity of the compute_bound run (tokens/s over the
fraction of time the peer computed: its stage's compute rate, as on the GPU side), not
compute_bound tokens/s / replicas: that is the pipeline's throughput with its bubbles, about
half the compute rate, and would make the bed stand for ~100 Mbit/s, not 200.

`--dp-like MODEL` (llama-3.2-1b, llama-3.1-8b, ...): the GPU scenario takes that model's shape, and
each peer's traffic to and from its stage mates (averaging; dense_sync's all-reduce) runs on a
class of its own, slower than the link by the factor that makes DP bytes stand to pipeline bytes
as the model's would (peer/bench/dp_shape.py); compute_bound stays unshaped.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict
from pathlib import Path

from peer.bench.dp_shape import (
    bed_tokens_per_step,
    dp_like_dims,
    dp_like_setup,
    scenario_like,
    shape_groups,
    swarm_groups,
    sync_seconds_per_step,
)
from peer.bench.netbed import available
from peer.bench.throughput_measure import measure_mode, median
from peer.bench.throughput_modes import ALL_MODES, SYNC, TINY_HIDDEN, GpuScenario, equivalent_mbit, mode_config
from peer.errors import ConfigError


def check_max_staleness(max_staleness: int) -> None:
    """`--max-staleness` of `bench throughput` and `bench project`: steps stage 0 may run ahead."""
    if not 0 <= max_staleness <= 8:
        raise ConfigError("--max-staleness", max_staleness, "must be in [0, 8] (steps stage 0 may run ahead)")


def check_bed_args(what: str, stages: int, bandwidth_mbit: float | None) -> None:
    """The checks every bench on the namespace bed makes before it starts anything."""
    if stages < 2:
        raise ConfigError("--stages", stages, "must be >= 2 (a pipeline needs a link)")
    if bandwidth_mbit is not None and bandwidth_mbit <= 0:
        raise ConfigError("--bandwidth-mbit", bandwidth_mbit, "must be > 0")
    why = available()
    if why:
        raise ConfigError(what, "network namespaces", why)


RATIOS = {
    "masked_vs_dense": ("masked", "dense"),
    "masked_dp_vs_dense": ("masked_dp", "dense"),
    "masked_dp_vs_compute_bound": ("masked_dp", "compute_bound"),
    "masked_vs_dense_sync": ("masked", SYNC),
    "masked_dp_vs_dense_sync": ("masked_dp", SYNC),
    "dense_vs_dense_sync": ("dense", SYNC),
    "compute_bound_vs_dense_sync": ("compute_bound", SYNC),
}


def combine_repeats(repeats: list[dict[str, dict]]) -> tuple[dict[str, dict], dict[str, dict]]:
    """Several interleaved measurements of the same modes -> (each mode: its median run, plus
    `tokens_per_s_runs` in repeat order; each ratio: median, min, max and every repeat's value).
    Ratios are taken within one repeat (modes measured minutes apart, not an hour), then their
    median: one noisy run no longer decides a row. The median run of an even count is the lower."""
    modes: dict[str, dict] = {}
    for mode in repeats[0]:
        runs = [r[mode] for r in repeats if mode in r]
        rates = [r["tokens_per_s"] for r in runs]
        median_run = sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2]
        modes[mode] = {**median_run, "tokens_per_s": median(rates), "tokens_per_s_runs": rates, "runs": len(runs)}
    ratios: dict[str, dict] = {}
    for name, (a, b) in RATIOS.items():
        values = [r[a]["tokens_per_s"] / r[b]["tokens_per_s"] for r in repeats if a in r and b in r]
        if values:
            ratios[name] = {"median": median(values), "min": min(values), "max": max(values), "runs": values}
    return modes, ratios


def run_throughput(
    quick: bool,
    bandwidth_mbit: float | None,
    stages: int,
    replicas: int,
    modes: list[str] | None = None,
    workdir: Path | None = None,
    repeat: int | None = None,
    max_staleness: int = 0,
    steps: int | None = None,
    dp_like: str | None = None,
) -> dict:
    """All modes, compute_bound first (it sets the GPU-equivalent bandwidth), `repeat` times
    interleaved (A B C D A B C D ...; default 1 with `quick`, else 3); the swarm's modes with
    `max_staleness` (dense_sync is GPipe: it flushes every step) and measured to run step `steps`
    (default 30 with `quick`, else 100; a longer window averages over more DP rounds); with
    `dp_like`, DP traffic on classes shaped as that model's (module docstring); returns the JSON."""
    if replicas < 1:
        raise ConfigError("--replicas", replicas, "must be >= 1")
    repeat = repeat if repeat is not None else (1 if quick else 3)
    if repeat < 1:
        raise ConfigError("--repeat", repeat, "must be >= 1")
    check_max_staleness(max_staleness)
    warmup, default_steps, dp_every = (6, 30, 5) if quick else (10, 100, 10)
    steps = default_steps if steps is None else steps
    if steps < warmup + 10:
        raise ConfigError(
            "--steps",
            steps,
            f"must be >= {warmup + 10}: the warm-up ends at step {warmup}, and a window of fewer than 10 steps measures noise",
        )
    modes = modes or list(ALL_MODES)
    for m in modes:
        if m not in ALL_MODES:
            raise ConfigError("--modes", m, f"unknown; known: {', '.join(ALL_MODES)}")
    like = dp_like_dims(dp_like) if dp_like else None
    check_bed_args("bench throughput", stages, bandwidth_mbit)
    timeout_s = 300.0 if quick else 1800.0
    workdir = workdir or Path(tempfile.mkdtemp(prefix="anchormesh-throughput-"))
    scenario = scenario_like(like) if like else GpuScenario()
    dp_shape: dict | None = None
    out: dict = {"modes": {}, "setup": {}}
    rate = bandwidth_mbit
    repeats: list[dict[str, dict]] = []
    for r in range(repeat):
        got: dict[str, dict] = {}
        tag = f" (repeat {r + 1} of {repeat})" if repeat > 1 else ""
        (workdir / f"r{r}").mkdir(parents=True, exist_ok=True)
        if "compute_bound" in modes or (rate is None and r == 0):
            print(f"compute_bound{tag}", flush=True)
            got["compute_bound"] = measure_mode(
                "compute_bound",
                [None] * (1 + stages * replicas),
                stages,
                replicas,
                warmup,
                steps,
                dp_every,
                workdir / f"r{r}",
                10,
                timeout_s,
                config=mode_config("compute_bound", stages, steps, dp_every, max_staleness=max_staleness),
            )
        if rate is None:  # from the first compute_bound run: every repeat runs on the same links
            cb = got["compute_bound"]
            per_peer = (
                cb["peer_capacity_tokens_per_s"] or cb["tokens_per_s"] / replicas
            )  # no capacity measured: the throughput (under-states it)
            rate = equivalent_mbit(scenario, stages, per_peer)
            print(
                f"GPU-equivalent bandwidth: {rate:.2f} Mbit/s stands for {scenario.link_mbit:.0f} Mbit/s ({scenario.model} on an {scenario.gpu})",
                flush=True,
            )
        if dp_like and dp_shape is None:
            dp_shape = dp_like_setup(dp_like, stages, rate)
            per_stage = ", ".join(f"{d:.4f}" for d in dp_shape["dp_rates_mbit"])
            print(f"DP classes ({dp_shape['model']['name']}-shaped): {per_stage} Mbit/s, stage 0 first", flush=True)
            if dp_shape["part_over_timeout"]:
                print(f"warning: {dp_shape['part_note']}", flush=True)
        for i, mode in enumerate(m for m in modes if m != "compute_bound"):
            print(f"{mode}{tag}", flush=True)
            if mode == SYNC:  # a few steps suffice: every step is the same flush and all-reduce
                from peer.bench.sync_baseline import measure_sync

                sync_steps = 6 if quick else 15
                got[mode] = measure_sync(
                    mode_config("dense", stages, steps, dp_every),
                    rate,
                    stages,
                    replicas,
                    2,
                    sync_steps,
                    workdir / f"r{r}" / SYNC,
                    11 + i,
                    timeout_s + (2 * (2 + sync_steps) * sync_seconds_per_step(dp_shape, replicas) if dp_shape else 0),
                    dp_rates_mbit=dp_shape["dp_rates_mbit"] if dp_shape else None,
                )
            else:
                got[mode] = measure_mode(
                    mode,
                    [rate] * (1 + stages * replicas),
                    stages,
                    replicas,
                    warmup,
                    steps,
                    dp_every,
                    workdir / f"r{r}",
                    11 + i,
                    timeout_s,
                    config=mode_config(mode, stages, steps, dp_every, max_staleness=max_staleness),
                    reshape=_dp_reshape(stages, rate, dp_shape),
                )
        if "compute_bound" not in modes:
            got.pop("compute_bound", None)
        repeats.append(got)
    m, spread = combine_repeats(repeats)
    out["modes"] = m
    out["ratios"] = {
        **{name: spread[name]["median"] if name in spread else None for name in RATIOS},
        "eval_loss_vs_dense": {
            k: v["eval_loss"] / m["dense"]["eval_loss"] - 1 for k, v in m.items() if v.get("eval_loss") is not None
        }
        if "dense" in m
        else None,
    }
    out["ratio_spread"] = spread
    out["setup"] = {
        "quick": quick,
        "repeat": repeat,
        "stages": stages,
        "replicas": replicas,
        "hosts": 1 + stages * replicas,
        "bandwidth_mbit": rate,
        "bandwidth_given": bandwidth_mbit is not None,
        "warmup_steps": warmup,
        "steps": steps,
        "tokens_per_step_per_replica": bed_tokens_per_step(),
        "dp_every": dp_every,
        "max_staleness": max_staleness,
        "model": {"name": "tiny-llama", "hidden": TINY_HIDDEN, "layers": 2 * stages},
        "scaling_rule": (
            "bandwidth = 2*hidden_cpu*8 * cpu_stage_tokens_per_s / rho, cpu_stage_tokens_per_s = "
            "compute_bound's median peer capacity (tokens/s while computing), "
            "rho = (2*hidden_gpu*8 / link_bps) * gpu_stage_tokens_per_s, "
            "gpu_stage_tokens_per_s = peak_flops * mfu / (flops_per_token / stages): the dense "
            "link-time / compute-time ratio per token and stage equals the GPU scenario's"
        ),
        "gpu_scenario": {
            **asdict(scenario),
            "flops_per_token": scenario.flops_per_token(),
            "stage_tokens_per_s": scenario.stage_tokens_per_s(stages),
            "rho": scenario.rho(stages),
        },
        "shaping": "tc tbf on every host's eth0 (upload) and its bridge port (download), burst 32 KiB; no added latency (netem unavailable)"
        + ("; DP traffic on its own class (dp_like)" if dp_shape else ""),
        "dp_like": dp_shape,
        "wire_bytes": "sum of all hosts' eth0 tx byte counters (ip -s link) over the measured window / tokens in it",
        "workdir": str(workdir),
    }
    return out


def _dp_reshape(stages: int, rate: float, dp_shape: dict | None):
    """measure_mode's hook that puts each peer's stage mates on its stage's DP class (None: no hook)."""
    if dp_shape is None:
        return None
    return lambda bed, status: shape_groups(bed, swarm_groups(status, stages), rate, dp_shape["dp_rates_mbit"])


def main_json(path: Path, **kwargs) -> dict:
    from peer.bench import emit_json

    return emit_json(run_throughput(**kwargs), path)
