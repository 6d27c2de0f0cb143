"""The flags of `anchormesh bench project` checked before anything is measured, and the GPU's MFU
taken from a `bench gpu` run (peer/bench/project.py).

Why a module of its own: what a user may ask for, and where the one assumed number (the MFU)
comes from, read apart from the model that predicts.
"""

from __future__ import annotations

import math
from pathlib import Path

from peer.bench.project_model import DEVICES, KNOWN_MODELS, Device
from peer.bench.throughput import check_max_staleness
from peer.errors import ConfigError


def check_args(
    device: str,
    bandwidth_mbit: float,
    stages: int,
    replicas: int,
    mfu: float | None,
    dp_every: int,
    shared_cores: int | None = None,
    max_staleness: int | None = None,
    link_share: float = 0.0,
) -> Device:
    """Every flag checked before anything is measured; ConfigError names the flag."""
    if device not in DEVICES:
        raise ConfigError("--gpu", device, f"unknown; known: {', '.join(DEVICES)}")
    if not bandwidth_mbit > 0 or math.isinf(bandwidth_mbit):
        raise ConfigError("--bandwidth-mbit", bandwidth_mbit, "must be a finite number > 0")
    if stages < 2:
        raise ConfigError("--stages", stages, "must be >= 2 (a pipeline needs a link)")
    if replicas < 1:
        raise ConfigError("--replicas", replicas, "must be >= 1")
    if mfu is not None and not (0 < mfu <= 1):
        raise ConfigError("--mfu", mfu, "must be in (0, 1]")
    if mfu is not None and device == "cpu":
        raise ConfigError("--mfu", mfu, "applies to a GPU; the CPU is measured")
    if dp_every < 1:
        raise ConfigError("--dp-every", dp_every, "must be >= 1")
    if shared_cores is not None and shared_cores < 1:
        raise ConfigError("--shared-cores", shared_cores, "must be >= 1")
    if max_staleness is not None:
        check_max_staleness(max_staleness)
    if not 0.0 <= link_share <= 1.0:
        raise ConfigError(
            "--link-share",
            link_share,
            "must be in [0, 1]: the share of the link's time averaging rounds may take (0 = no bound)",
        )
    return DEVICES[device]


GPU_RUNS = Path(__file__).resolve().parents[2] / "docs" / "results"  # `bench gpu` results: gpu-bench-<device>.json


def mfu_from_gpu_run(path: Path, device: Device) -> tuple[float, str]:
    """The MFU `anchormesh bench gpu` measured on `device`: its bf16 tokens/s on the Llama-3.2-1B
    shape (both stages in one process, the real runner and codec) times the FLOPs per token of
    `gpu_compute`'s rule, over the device's peak. Why: a measured rate beats the 40% guess."""
    import json

    try:
        run = json.loads(Path(path).read_text())
        tokens_per_s = float(run["precision"]["bf16"]["tokens_per_s"])
        seq_len = int(run.get("seq_len", 512))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            "--mfu-from", str(path), f"not an `anchormesh bench gpu` result with a bf16 precision row ({exc})"
        ) from None
    if run.get("shape") != "llama-3.2-1b":
        raise ConfigError(
            "--mfu-from",
            str(path),
            f"measured on shape {run.get('shape')!r}; the MFU is taken from the llama-3.2-1b shape",
        )
    dims = KNOWN_MODELS["llama-3.2-1b"]
    flops = (
        6 * dims.layer_params() * dims.layers + 12 * dims.hidden * seq_len * dims.layers + 6 * dims.vocab * dims.hidden
    )
    mfu = tokens_per_s * flops / (device.peak_tflops * 1e12)
    return (
        min(mfu, 1.0),
        f"measured by `anchormesh bench gpu` on {run.get('device_name', '?')} ({path}): {tokens_per_s:,.0f} bf16 tokens/s",
    )
