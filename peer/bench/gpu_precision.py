"""Part (a) of `anchormesh bench gpu` (peer/bench/gpu.py): the model shapes it builds, and each
precision mode's tokens/s, peak memory against the plan's estimate, and host syncs.

Why a module of its own: it is the in-process half of the bench (one process, the real runner
and codec), with its own memory accounting for a CPU, which torch gives no allocator statistics.
"""

from __future__ import annotations

import functools
import gc
import logging
import time
import warnings
from pathlib import Path

import torch

from peer.config import MaskConfig, ModelConfig, OptimConfig, PipelineConfig, TrainConfig
from peer.daemon.memory import GIB, plan_stages
from peer.model.placement import Placement

log = logging.getLogger("anchormesh.bench.gpu")

# Llama-3.2-1B's published config (hidden 2048, 16 layers, GQA 32/8, vocab 128256, tied head)
LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
    rope_theta=500000.0,
)
# the 1B's width, heads and vocabulary with 4 of its 16 layers: what a 2-core CPU box can measure
LLAMA_1B_4L = {**LLAMA_1B, "num_hidden_layers": 4}
SMALL = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=4096,
    tie_word_embeddings=True,
    max_position_embeddings=512,
)
SHAPES = {"llama-3.2-1b": LLAMA_1B, "llama-3.2-1b-4l": LLAMA_1B_4L, "small": SMALL}


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in this process (each storage once)."""
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if torch.is_tensor(obj) and obj.device.type == "cpu" and not obj.is_meta:
                st = obj.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        except Exception:  # an object that looks like a tensor but has no storage
            continue
    return sum(seen.values())


def cpu_peak_bytes(step) -> int:
    """Peak tensor bytes on the CPU while `step()` runs: what was alive before it plus the
    highest point of the allocations the profiler records during it (torch has no CPU
    allocator statistics like CUDA's max_memory_allocated)."""
    from torch.profiler import ProfilerActivity, profile

    before = live_tensor_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    now = peak = 0
    for e in sorted(
        prof.events(), key=lambda e: e.time_range.start
    ):  # op granularity: each op's own net bytes, frees outside ops
        now += e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        peak = max(peak, now)
    return before + peak


def _shape_dir(shape: dict, root: Path) -> Path:
    """A model folder holding only config.json: enough for the meta build the plan needs."""
    from transformers import LlamaConfig

    path = root / "model"
    LlamaConfig(**shape).save_pretrained(path)
    return path


def precision_pipeline(device: torch.device, quick: bool) -> PipelineConfig:
    if device.type == "cuda":
        return PipelineConfig(micro_batch_size=4, micro_batches=4, seq_len=512, eval_every=0, max_staleness=0)
    return PipelineConfig(
        micro_batch_size=2, micro_batches=2, seq_len=64 if quick else 128, eval_every=0, max_staleness=0
    )


def precision(device: torch.device, shape: dict, root: Path, steps: int, quick: bool) -> dict:
    """Part (a): tokens/s, peak memory vs plan and host syncs, per precision mode."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from peer.pipeline.local import LocalPipelineRunner

    folder = _shape_dir(shape, root)
    pipe = precision_pipeline(device, quick)
    cfg = TrainConfig(
        model=ModelConfig(
            name=str(folder),
            num_stages=2,
            num_layers=shape["num_hidden_layers"],
            hidden_size=shape["hidden_size"],
            num_heads=shape["num_attention_heads"],
            max_seq_len=pipe.seq_len,
        ),
        mask=MaskConfig(scheme="lowrank", rank=64, values="int8", basis_refresh=100),
        optim=OptimConfig(lr=1e-4),
        pipeline=pipe,
        steps=steps,
    )
    gen = torch.Generator().manual_seed(0)
    windows = [
        torch.randint(0, shape["vocab_size"], (pipe.micro_batch_size, pipe.seq_len + 1), generator=gen)
        for _ in range(8)
    ]
    modes = {
        "fp32": Placement(device=device),
        "bf16": Placement(device=device, compute_dtype=torch.bfloat16),
        "bf16_checkpointing": Placement(device=device, compute_dtype=torch.bfloat16, checkpointing=True),
    }
    out = {}
    for name, placement in modes.items():
        t0 = time.monotonic()
        plans = plan_stages(cfg, placement)
        config = LlamaConfig(**shape)
        config._attn_implementation = "sdpa"
        with torch.device(device):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        runner = LocalPipelineRunner(
            cfg, model, lambda step, r, j: windows[(step * pipe.micro_batches + j) % len(windows)], placement=placement
        )
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        runner.run(2)  # warm-up: kernels, the first basis, the working copy
        syncs = 0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.set_sync_debug_mode("warn")
        t1 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reports = runner.run(2 + steps)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            syncs = sum(1 for w in caught if "synchroniz" in str(w.message).lower())
        seconds = time.perf_counter() - t1
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
        micro_batches = steps * pipe.micro_batches
        planned = sum(p.total for p in plans)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
        else:  # one more step under the profiler (slow: after the timed ones)
            peak = cpu_peak_bytes(functools.partial(runner.run, 3 + steps))
        out[name] = {
            "tokens_per_s": steps * pipe.micro_batches * pipe.micro_batch_size * pipe.seq_len / seconds,
            "loss_first": reports[0].loss,
            "loss_last": reports[-1].loss,
            "planned_gib": planned / GIB,
            "planned_per_stage_gib": [p.total / GIB for p in plans],
            "peak_gib": peak / GIB,
            "peak_over_plan": peak / planned,
            "peak_measured_by": "torch.cuda.max_memory_allocated"
            if device.type == "cuda"
            else "live tensor storages + the profiler's allocation peak over one step",
            "host_syncs": syncs if device.type == "cuda" else None,
            "host_syncs_per_micro_batch": syncs / micro_batches if device.type == "cuda" else None,
            "seconds": time.monotonic() - t0,
        }
        log.info(
            "precision %s: %.0f tokens/s, planned %.2f GiB, peak %.2f GiB (%.0fs)",
            name,
            out[name]["tokens_per_s"],
            planned / GIB,
            peak / GIB,
            out[name]["seconds"],
        )
        runner.close()
        del runner
        gc.collect()  # the next mode builds its model in this memory
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out
