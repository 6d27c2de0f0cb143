"""`anchormesh bench project`: predicted tokens/s of the throughput bench's four modes, from first
principles plus a few measured costs, for a model on a device at a link speed.

Why: the shaped-link bench runs a tiny model on CPUs; this says what the same app would do with
a real model on real GPUs and links, and `tests/test_project.py` checks the model against the
bench's test bed (within 25 %).

Inputs, per micro-batch of the run's shape [B, T] (M micro-batches per optimizer step):
  compute   forward and backward time of each stage: on "cpu" measured here (one torch thread, as
            a peer runs) by timing the app's own StageModules of a 3-layer copy of the model
            (first = embedding + 1 layer, middle = 1 layer, last = 1 layer + norm + head + loss),
            so layer = middle, embedding = first - middle, head = last - middle; on a GPU
            6 * params + 12 * hidden * T FLOPs per token and layer (forward 1/3, backward 2/3)
            at peak bf16 FLOP/s * MFU, plus 6 * vocab * hidden for the head. Optimizer step:
            AdamW measured per parameter on "cpu"; 28 bytes per parameter at the GPU's memory
            bandwidth otherwise.
  codec     measured here, on the CPU, for every mode's codec, by running the code the app runs
            (peer/codec, peer/wire): encode and serialise, two parses, a validation and a decode,
            both ways; the basis or coder refit and its shipping, amortised over `basis_refresh`
            steps (project_codec.py). A GPU projection charges this at this CPU's speed, except
            the transform coder's device work (rotations, quantising, packing), charged at the
            device's rates (shapes above 2**21 elements: fewer sequences, scaled in tokens).
  bytes     app bytes per message: the serialized ActivationChunk / GradientChunk, sized by
            building the real proto with a payload of the codec's exact length (dense: fp16
            B*T*H; low-rank: int8 B*T*r + a float32 scale per 256 values; transform: packed codes,
            a bf16 gain per row, the sink in bf16; token ids in the narrowest dtype; the basis pair
            or coder once per refresh and next-stage peer). On the wire: + 5 bytes gRPC prefix, + 9
            bytes per 16 KiB HTTP/2 frame, + 66 bytes Ethernet/IPv4/TCP-with-timestamps header per 1448-byte segment
            (MTU 1500), and on the reverse link one 66-byte ACK per two segments.
            DP: one averaging round moves 2 (n-1)/n * stage parameters * (4 bytes fp32 | 1 byte
            int8) up and as much down per peer (peer/dp/group.py: round_bytes), once every
            `inner_steps` steps.

The model: every host has an upload and a download of `bandwidth` each (full duplex: the bed
shapes eth0's egress and the bridge port's egress with separate tbf qdiscs); a transfer from
host a to host b holds a's upload and b's download for wire bytes / bandwidth. The simplest
bound is the slowest resource with perfect overlap:

    step >= max(compute busy of the busiest peer, (PP + DP) link bytes of the busiest link / B)

(`tokens_per_s_bound`; `busy_s_per_step` gives the three terms). The app does not overlap that
well: with `max_staleness` 0 (the default; `--max-staleness`) stage 0 runs step n's forwards only
after applying step n-1 (the pipeline drains every step); each peer's loop is serial (step >
backward > forward); a micro-batch goes to a next-stage peer drawn at random. So the prediction
is an event simulation of that schedule (`simulate`): K stages x R serial peers, FIFO links.

DP, two ways (peer/bench/project_dp.py). `dp_kept`: DP must keep its configured cadence
(synchronous data parallelism); its bytes per step take bandwidth from every link (a fixed
point); `bound` "dp" when DP's link time is the largest term. The app (`tokens_per_s`): rounds
run in the background and never hold a step back, spaced as the swarm spaces them: with
`dp.link_share` (`--link-share`, default the swarm's 0.2) at slot periods that keep a round's
bytes to that share of the link, PP and DP sharing the link while a round runs
(`dp_link.busy` of the time); with 0 (the throughput bench's modes, and the bed test) as often
as the link carries them. `dp_every_achieved`: steps per round that results in.

Test-bed factors (all off by default; the bed test sets them from the bed): `shared_cores` (the
peers share this many cores equally: the machine's cores less what other processes took),
`burst_bytes` (tbf's bucket: a transfer on a link that rested sends its first `burst` bytes at
line rate) and `queue_s` (a full tbf queue, latency + burst / rate: a message with another one
queued behind it on the same connection arrives that much later, because TCP fills the
drop-tail queue and the lost segments' retransmissions wait behind it; a plain TCP probe on the
bed shows it: 263 kB alone 243 ms, the first of two back to back 255-487 ms, mean +83 ms at
8 Mbit/s, where the queue is 83 ms).

Not modelled: the CPU of hivemind's DHT, averager and p2pd processes (on the CPU bed they take
a lot when rounds are attempted often: docs/benchmarks.md, "Where the CPU goes"), gRPC's own threads (about 1 ms per
message each side, measured), the daemon loop, retransmitted bytes, latency (netem is not
available; a real link adds a round trip per transfer), status and heartbeat traffic.

Where the parts live: devices, model dims and shapes in project_model.py; compute in
project_compute.py; message and DP bytes in project_bytes.py; codec cost in project_codec.py;
the event simulation in project_sim.py; the measured costs in project_costs.py; the CLI's checks
and the GPU's MFU in project_args.py. This module puts them together: each mode's tasks and
prediction, and the run of `anchormesh bench project`.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

from peer.bench.project_args import GPU_RUNS, check_args, mfu_from_gpu_run
from peer.bench.project_bytes import dp_round_bytes, mode_mask
from peer.bench.project_costs import Costs, measure_costs
from peer.bench.project_dp import dp_greedy, dp_kept, dp_shared
from peer.bench.project_model import DEFAULT_MFU, resolve_model
from peer.bench.project_sim import Schedule, Tasks, simulate
from peer.bench.throughput_modes import MODES, mode_config
from peer.config import DPConfig
from peer.errors import ConfigError

# -- the projection -------------------------------------------------------------------------------


def _dp_of(mode: str, dp_every: int) -> dict:
    return mode_config(mode, 2, 1, dp_every)["dp"]


def _tasks(c: Costs, mode: str) -> Tasks:
    K, R, M = c.stages, c.replicas, c.shape.micro_batches
    cc, mb = c.codec[mode], c.bytes[mode]
    refresh = mode_mask(mode).basis_refresh
    # a sender refreshes once per `refresh` steps and ships the pair to each of the R next-stage peers it uses
    basis_cpu = (cc.refresh + R * cc.ship_basis) / (refresh * M) if mb.basis else 0.0
    act_app = mb.activation + (R * mb.basis / (refresh * M) if mb.basis else 0.0)
    f = c.framing
    fwd, bwd = [], []
    for s in range(K):
        first, last = s == 0, s == K - 1
        t = c.compute.fwd[s] + (0.0 if first else cc.recv_fwd)
        if last:
            t += c.compute.bwd[s] + cc.send_bwd
        else:
            t += cc.send_fwd + basis_cpu
        fwd.append(t)
        bwd.append(0.0 if last else cc.recv_bwd + c.compute.bwd[s] + (0.0 if first else cc.send_bwd))
    # the basis message is rare: frame the common message and add the pair's bytes at the same overhead ratio
    act_wire = f.wire(mb.activation) * act_app / mb.activation
    return Tasks(
        fwd,
        bwd,
        list(c.compute.opt),
        [act_wire] * (K - 1),
        [f.wire(mb.gradient)] * (K - 1),
        [f.acks(mb.activation) * act_app / mb.activation] * (K - 1),
        [f.acks(mb.gradient)] * (K - 1),
    )


SYNC = "dense_sync"  # the baseline a user would run instead: projected only (the swarm has no synchronous mode)
PROJECT_MODES = (SYNC, *MODES)


def project_sync(
    c: Costs,
    bandwidth_mbit: float | None,
    burst_bytes: float = 0.0,
    shared_cores: float | None = None,
    queue_s: float = 0.0,
) -> dict:
    """`dense_sync`: stock pipeline + data parallelism, the research's 9x / 40x baseline. Dense
    fp16 activations (dense's messages and codec costs), R fixed pipelines flushed every step
    (GPipe), and before every optimizer step an fp32 gradient all-reduce of each stage group
    (ring: 2 (R-1)/R of the stage's gradients up and down per peer), on links the flushed pipeline
    leaves idle; nothing overlaps it."""
    K, R, M = c.stages, c.replicas, c.shape.micro_batches
    tasks = _tasks(c, "dense")
    tokens_step = R * M * c.shape.tokens
    allreduce = [dp_round_bytes(c.dims, s, K, R, "none") for s in range(K)]
    wire = [c.framing.wire(b) if b else 0.0 for b in allreduce]
    rate = None if bandwidth_mbit is None else bandwidth_mbit * 1e6 / 8
    sync_s = [w / rate if rate else 0.0 for w in wire]
    sched = simulate(tasks, K, R, M, c.shape.tokens, rate, burst_bytes, shared_cores, queue_s, sync_s=sync_s)
    pp_wire = tasks.pp_wire_per_step(R, M)
    return {
        "tokens_per_s": sched.tokens_per_s,
        "bound": "sync",  # the flush and the all-reduce: neither overlaps the other's work
        "step_s": sched.step_s,
        "allreduce_s_per_step": max(sync_s),
        "wire_bytes_per_token": (pp_wire + R * sum(wire)) / tokens_step,
        "app_bytes_per_token": {
            "pp": M * R * (K - 1) * (c.bytes["dense"].activation + c.bytes["dense"].gradient) / tokens_step,
            "dp": R * sum(allreduce) / tokens_step,
        },
        "bandwidth_mbit": bandwidth_mbit,
        "pp": mode_config("dense", 2, 1, c.dp_every)["mask"],
        "dp": {"inner_steps": 1, "outer_compression": "none", "synchronous": True},
        "schedule": "GPipe: R fixed pipelines flushed every step; an fp32 gradient all-reduce of every stage group before each optimizer step",
        "task_s": {"fwd": tasks.fwd, "bwd": tasks.bwd, "step": tasks.step, "allreduce": sync_s},
    }


def project_mode(
    c: Costs,
    mode: str,
    bandwidth_mbit: float | None,
    burst_bytes: float = 0.0,
    shared_cores: float | None = None,
    queue_s: float = 0.0,
) -> dict:
    """One mode's prediction at `bandwidth_mbit` (None: unshaped links; compute_bound always is)."""
    if mode == SYNC:
        return project_sync(c, bandwidth_mbit, burst_bytes, shared_cores, queue_s)
    if mode == "compute_bound":
        bandwidth_mbit = None
    K, R, M = c.stages, c.replicas, c.shape.micro_batches
    tasks = _tasks(c, mode)
    dp = _dp_of(mode, c.dp_every)
    tokens_step = R * M * c.shape.tokens  # all stage-0 peers, one step each
    dp_round = [dp_round_bytes(c.dims, s, K, R, dp["outer_compression"]) for s in range(K)]
    dp_app_step = [b / dp["inner_steps"] for b in dp_round]  # per peer, per step, each way
    dp_wire_step = [c.framing.wire(b) / dp["inner_steps"] if b else 0.0 for b in dp_round]
    # busy seconds per step of the busiest peer / link (perfect overlap)
    compute = [M * (tasks.fwd[s] + tasks.bwd[s]) + tasks.step[s] for s in range(K)]
    compute_s = max(compute)
    if shared_cores:
        compute_s = max(compute_s / min(1.0, shared_cores), R * sum(compute) / shared_cores)
    # host of stage s uploads activations to s+1, gradients to s-1, ACKs of what it receives
    up = [
        M
        * (
            (tasks.act_wire[s] + tasks.grad_ack[s] if s < K - 1 else 0.0)
            + (tasks.grad_wire[s - 1] + tasks.act_ack[s - 1] if s > 0 else 0.0)
        )
        for s in range(K)
    ]
    if bandwidth_mbit is None:
        link_s = dp_s = 0.0
        rate = None
    else:
        rate = bandwidth_mbit * 1e6 / 8
        link_s = max(up) / rate
        dp_s = max(dp_wire_step) / rate
    bound_s = max(compute_s, link_s + dp_s)
    bound = "compute" if compute_s >= link_s + dp_s else ("dp" if dp_s > link_s else "link")

    @functools.lru_cache(maxsize=None)  # the DP models ask for the whole link and half of it more than once
    def run(rate_pp: float | None) -> Schedule:
        return simulate(
            tasks, K, R, M, c.shape.tokens, rate_pp, burst_bytes, shared_cores, queue_s, staleness=c.shape.max_staleness
        )

    kept = run(rate) if rate is None or dp_s == 0.0 else dp_kept(run, rate, max(dp_wire_step), bound_s, tokens_step)
    app, every, app_bound, shared = kept, float(dp["inner_steps"]), bound, None
    if (
        rate is not None and dp_s > 0.0 and c.link_share > 0.0
    ):  # the swarm's default: rounds spaced to a share of the link
        busiest = max(range(K), key=lambda s: dp_wire_step[s])
        shared = dp_shared(
            run,
            rate,
            dp_round[busiest],
            dp_wire_step[busiest] * dp["inner_steps"],
            max(up),
            dp["inner_steps"],
            c.link_share,
            c.min_period_s,
            tokens_step,
        )
        app, every = shared.schedule, shared.every
        app_bound = (
            "link"
            if link_s > compute_s
            else ("dp" if shared.busy > 0 and max(up) / (rate / 2) > compute_s else "compute")
        )
    elif (
        rate is not None and dp_s > 0.0
    ):  # dp.link_share 0 (the throughput bench's modes): as often as the averager manages
        app, every, split = dp_greedy(run, kept, rate, max(dp_wire_step), max(up), dp["inner_steps"])
        if split:
            app_bound = "dp" if max(up) / (rate / 2) > compute_s else "compute"
    pp_app = (
        M
        * R
        * (K - 1)
        * (
            c.bytes[mode].activation
            + c.bytes[mode].gradient
            + (R * c.bytes[mode].basis / (mode_mask(mode).basis_refresh * M) if c.bytes[mode].basis else 0.0)
        )
    )
    pp_wire = tasks.pp_wire_per_step(R, M)
    dp_app = R * sum(dp_app_step)
    slow = dp["inner_steps"] / every  # DP bytes per step at the achieved cadence, relative to the configured one
    return {
        "tokens_per_s": app.tokens_per_s,
        "bound": app_bound,
        "dp_every_achieved": every if dp_s > 0.0 else None,
        "dp_link": None
        if shared is None
        else {"link_share": c.link_share, "period_s": shared.period_s, "busy": shared.busy},
        "tokens_per_s_bound": tokens_step / bound_s,
        "step_s": app.step_s,
        "busy_s_per_step": {"compute": compute_s, "link": link_s, "dp": dp_s},
        "wire_bytes_per_token": (pp_wire + slow * R * sum(dp_wire_step)) / tokens_step,
        "app_bytes_per_token": {"pp": pp_app / tokens_step, "dp": slow * dp_app / tokens_step},
        "dp_kept": {  # a DP that must keep its cadence (synchronous data parallelism)
            "tokens_per_s": kept.tokens_per_s,
            "bound": bound,
            "step_s": kept.step_s,
            "wire_bytes_per_token": (pp_wire + R * sum(dp_wire_step)) / tokens_step,
            "dp_bytes_per_token": dp_app / tokens_step,
        },
        "bandwidth_mbit": bandwidth_mbit,
        "pp": mode_config(mode, 2, 1, c.dp_every)["mask"],
        "dp": {**dp, "link_share": c.link_share, "min_period_s": c.min_period_s} if shared is not None else dp,
        "task_s": {"fwd": tasks.fwd, "bwd": tasks.bwd, "step": tasks.step},
    }


def project(
    costs: Costs,
    bandwidth_mbit: float,
    modes: tuple[str, ...] = PROJECT_MODES,
    burst_bytes: float = 0.0,
    shared_cores: float | None = None,
    queue_s: float = 0.0,
) -> dict:
    """The JSON of `bench project` for measured/derived `costs` at one bandwidth; each mode's
    tokens/s also as a ratio to `dense_sync`, `dense` and `compute_bound` (those projected)."""
    c = costs
    out = {m: project_mode(c, m, bandwidth_mbit, burst_bytes, shared_cores, queue_s) for m in modes}
    for r in out.values():
        r["vs"] = {
            b: r["tokens_per_s"] / out[b]["tokens_per_s"]
            for b in (SYNC, "dense", "compute_bound")
            if b in out and out[b]["tokens_per_s"] > 0
        }
    codec = {
        k: asdict(v) for k, v in {"dense": c.codec["dense"], mode_mask("masked").scheme: c.codec["masked"]}.items()
    }
    return {
        "modes": out,
        "setup": {
            "model": {
                **asdict(c.dims),
                "params": c.dims.params(),
                "stage_params": [c.dims.stage_params(s, c.stages) for s in range(c.stages)],
            },
            "device": asdict(c.device),
            "mfu": c.mfu,
            "bandwidth_mbit": bandwidth_mbit,
            "stages": c.stages,
            "replicas": c.replicas,
            "micro_batch": asdict(c.shape),
            "dp_every": c.dp_every,
            "dp_link_share": c.link_share,
            "compute": {
                "fwd_s": c.compute.fwd,
                "bwd_s": c.compute.bwd,
                "optimizer_s": c.compute.opt,
                "how": c.compute.how,
            },
            "codec_s": codec,
            "message_bytes": {m: asdict(b) for m, b in c.bytes.items()},
            "framing": asdict(c.framing),
            "shared_cores": shared_cores,
            "queue_s": queue_s,
            "burst_bytes": burst_bytes,
            "model_doc": "peer/bench/project.py (module docstring); docs/benchmarks.md, Projection to real GPUs",
        },
    }


def run_project(
    model: str,
    device: str,
    bandwidth_mbit: float,
    stages: int = 2,
    replicas: int = 2,
    mfu: float | None = None,
    dp_every: int = 10,
    shared_cores: int | None = None,
    burst_kb: float = 0.0,
    mfu_from: Path | None = None,
    max_staleness: int | None = None,
    link_share: float | None = None,
) -> dict:
    """`anchormesh bench project`: resolve, measure, project (see the module docstring). A GPU's
    MFU is `--mfu`, else what a `bench gpu` run on that device measured (`--mfu-from`, or
    docs/results/gpu-bench-<device>.json when it exists), else 40%."""
    link_share = DPConfig.link_share if link_share is None else link_share  # the swarm's default
    dev = check_args(device, bandwidth_mbit, stages, replicas, mfu, dp_every, shared_cores, max_staleness, link_share)
    dims, shape, source = resolve_model(model, stages)
    shape = shape if max_staleness is None else replace(shape, max_staleness=max_staleness)  # else the run.toml's, or 0
    if stages > dims.layers:
        raise ConfigError("--stages", stages, f"must be <= the model's {dims.layers} layers")
    mfu_source = "--mfu" if mfu is not None else None
    if dev.peak_tflops is not None and mfu is None:
        found = mfu_from or (GPU_RUNS / f"gpu-bench-{dev.name}.json")
        if mfu_from is not None or found.exists():
            mfu, mfu_source = mfu_from_gpu_run(found, dev)
        else:
            mfu, mfu_source = DEFAULT_MFU, "assumed (no `anchormesh bench gpu` run on this device)"
    costs = replace(measure_costs(dims, shape, stages, replicas, dev, mfu, dp_every), link_share=link_share)
    out = project(costs, bandwidth_mbit, burst_bytes=burst_kb * 1024, shared_cores=shared_cores)
    out["setup"]["mfu_source"] = mfu_source
    out["setup"]["model_source"] = source
    out["setup"]["measured_on"] = {"cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    return out


def main_json(path: Path | None, **kwargs) -> dict:
    from peer.bench import emit_json

    return emit_json(run_project(**kwargs), path)
