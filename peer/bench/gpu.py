"""`anchormesh bench gpu --out OUT`: the GPU path checked end to end, in one short run.

Three parts, each a yes/no a volunteer or a reviewer can read off OUT:

(a) `precision`: a Llama-3.2-1B-shaped model built from a config (random init, no download), 2
    stages in one process through the real runner (low-rank codec, serialized wire messages), in
    fp32, bf16 (fp32 masters) and bf16 with activation checkpointing: tokens/s, the peak memory
    against the plan's estimate (peer/daemon/memory.py), and host syncs per micro-batch (CUDA's sync
    debug mode counts them; the two wire crossings per message are the expected ones).
(b) `swarm`: bootstrap + 2 stages x 2 peers as processes with `--device DEVICE`, 40 steps:
    averaging rounds done and none refused, an anchor prior folded in, an eval loss, and one
    peer SIGKILLed at step 20 and restarted from its checkpoint.
(c) `memory_refusal`: a run whose memory budget no stage fits: the peer exits 2 naming the
    estimate, before anything loads.

On a CPU (`--device cpu`, what CI can run) the same code runs a small model shape, and the peak
is the live tensor storages plus the profiler's allocation peak over one step (torch keeps no
CPU allocator statistics).

Where the parts live: (a) in gpu_precision.py, (b) and (c) in gpu_swarm.py; this module runs them.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import torch

from peer.bench import emit_json
from peer.bench.gpu_precision import SHAPES, precision, precision_pipeline
from peer.bench.gpu_swarm import memory_refusal, swarm
from peer.model.placement import parse_device

log = logging.getLogger("anchormesh.bench.gpu")

PARTS = ("precision", "swarm", "memory_refusal")


def run(device: str = "auto", parts: tuple[str, ...] = PARTS, quick: bool = False, shape: str | None = None) -> dict:
    dev = parse_device(device)
    shape_name = shape or ("llama-3.2-1b" if dev.type == "cuda" else "small")
    dims = SHAPES[shape_name]
    t0 = time.monotonic()
    result: dict = {
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "shape": shape_name,
        "model_dims": dims,
        "seq_len": precision_pipeline(dev, quick).seq_len,
    }
    with tempfile.TemporaryDirectory(prefix="anchormesh-gpu-") as tmp:
        root = Path(tmp)
        for part in parts:
            (root / part).mkdir()
            log.info("bench gpu: %s ...", part)
            if part == "precision":
                result[part] = precision(dev, dims, root / part, steps=3 if quick else 10, quick=quick)
            elif part == "swarm":
                result[part] = swarm(str(dev), root / part)
            elif part == "memory_refusal":
                result[part] = memory_refusal(str(dev), root / part)
    result["seconds"] = time.monotonic() - t0
    return result


def main_json(path: Path | None, device: str, parts: tuple[str, ...], quick: bool, shape: str | None) -> dict:
    from peer.logs import setup_logging

    setup_logging()
    return emit_json(run(device, parts, quick, shape), path)
