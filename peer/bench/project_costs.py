"""The measured and derived costs `bench project` predicts from (peer/bench/project.py): compute,
codec time and message bytes of every mode for one (model, shape, device).

Why a module of its own: measuring is the slow part (a 3-layer model timed on the CPU, every
codec run), done once and reused across bandwidths and modes; `scaled` rescales it when this
CPU runs slower than when it was measured (the bed test).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import SimpleNamespace

from peer.bench.project_bytes import SWARM_NAMES, Framing, MessageBytes, Names, message_bytes, mode_mask
from peer.bench.project_codec import CodecCost, measure_codec, on_device
from peer.bench.project_compute import StageCompute, gpu_compute, measure_cpu_compute
from peer.bench.project_model import DEFAULT_MFU, Device, ModelDims, Shape
from peer.bench.throughput_modes import MODES
from peer.config import DPConfig
from peer.errors import ConfigError


@dataclass
class Costs:
    """Everything measured or derived once per (model, shape, device): reused across bandwidths."""

    dims: ModelDims
    shape: Shape
    stages: int
    replicas: int
    compute: StageCompute
    codec: dict[str, CodecCost]
    bytes: dict[str, MessageBytes]
    device: Device
    mfu: float | None
    dp_every: int
    framing: Framing = field(default_factory=Framing)
    link_share: float = 0.0  # dp.link_share of the DP modes: 0 as the throughput bench runs them; `bench project` uses the swarm's default
    min_period_s: float = DPConfig.min_period_s  # dp.min_period_s, used with link_share


def scaled(c: Costs, factor: float) -> Costs:
    """`c` with every CPU cost (compute on "cpu", codec everywhere) times `factor`: this machine's
    CPU running slower (or faster) now than when it was measured (the bed test measures that)."""
    k = factor if c.device.peak_tflops is None else 1.0
    compute = StageCompute(
        [x * k for x in c.compute.fwd], [x * k for x in c.compute.bwd], [x * k for x in c.compute.opt], c.compute.how
    )
    codec = {
        m: replace(
            v,
            send_fwd=v.send_fwd * factor,
            recv_fwd=v.recv_fwd * factor,
            send_bwd=v.send_bwd * factor,
            recv_bwd=v.recv_bwd * factor,
            refresh=v.refresh * factor,
            ship_basis=v.ship_basis * factor,
        )
        for m, v in c.codec.items()
    }
    return replace(c, compute=compute, codec=codec)


def measure_costs(
    dims: ModelDims,
    shape: Shape,
    stages: int,
    replicas: int,
    device: Device,
    mfu: float | None,
    dp_every: int,
    names: Names = SWARM_NAMES,
) -> Costs:
    """Compute (measured or from FLOPs), codec cost (measured) and message sizes of every mode."""
    if stages < 2:
        raise ConfigError("--stages", stages, "must be >= 2 (a pipeline needs a link)")
    if stages > dims.layers:
        raise ConfigError("--stages", stages, f"must be <= the model's {dims.layers} layers")
    compute = (
        measure_cpu_compute(dims, shape, stages)
        if device.peak_tflops is None
        else gpu_compute(dims, shape, stages, device, mfu)
    )
    # one measurement per codec the modes use (dense's fp16 mask codec, the compressed modes' scheme)
    gpu = (
        None
        if device.peak_tflops is None
        else SimpleNamespace(
            flops_per_s=device.peak_tflops * 1e12 * (mfu if mfu is not None else DEFAULT_MFU), mem_gbps=device.mem_gbps
        )
    )
    measured = {}
    for m in MODES:
        scheme = mode_mask(m).scheme
        if scheme not in measured:
            measured[scheme] = on_device(measure_codec(m, dims, shape, names), gpu)
    codec = {m: measured[mode_mask(m).scheme] for m in MODES}
    sizes = {m: message_bytes(m, dims, shape, names=names) for m in MODES}
    return Costs(dims, shape, stages, replicas, compute, codec, sizes, device, mfu, dp_every)
