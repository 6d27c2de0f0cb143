"""Compute time of each stage for `bench project`: measured here on the CPU (the app's own
StageModules, one torch thread, as a peer runs) or derived from FLOPs on a GPU. `time_call` and
`OneThread` are the measuring tools the codec cost (project_codec.py) uses too."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from peer.bench.project_model import ADAMW_BYTES_PER_PARAM, Device, ModelDims, Shape
from peer.errors import ConfigError


@dataclass
class StageCompute:
    """Seconds per micro-batch (forward, backward) and per optimizer step, per stage."""

    fwd: list[float]
    bwd: list[float]
    opt: list[float]
    how: str


def time_call(fn: Callable[[], object], min_s: float = 0.3, max_reps: int = 30, slow_s: float = 1.0) -> float:
    """Median CPU time of this thread per call, after one warm-up call (at least 5 calls, until
    `min_s` or `max_reps`). CPU time, not wall time: other work on this machine then does not
    inflate the cost; on the bed, sharing cores is the schedule model's business. A call
    slower than `slow_s` is timed once (its warm-up): a basis refresh of a large vocabulary
    takes seconds."""
    t0 = time.thread_time()
    fn()
    first = time.thread_time() - t0
    if first > slow_s:
        return first
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 5 or time.perf_counter() - start < min_s):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


class OneThread:
    """Torch on one thread while measuring: a peer runs with torch.set_num_threads(1)."""

    def __enter__(self) -> None:
        import torch

        self.n = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc) -> None:
        import torch

        torch.set_num_threads(self.n)


def _build_stages(dims: ModelDims, seq_len: int) -> list:
    """First, middle and last StageModule of a 3-layer model with these dims (random weights)."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    from peer.model.stages import split_model

    if dims.family == "gpt2":
        config = GPT2Config(
            vocab_size=dims.vocab,
            n_positions=max(seq_len, dims.max_positions),
            n_embd=dims.hidden,
            n_layer=3,
            n_head=dims.heads,
            n_inner=dims.intermediate,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=False,
        )
    else:
        cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}.get(dims.family)
        if cls is None:
            raise ConfigError(
                "--model",
                dims.name,
                f"family {dims.family!r} cannot be timed here; supported: llama, qwen2, mistral, gpt2",
            )
        config = cls(
            vocab_size=dims.vocab,
            hidden_size=dims.hidden,
            intermediate_size=dims.intermediate,
            num_hidden_layers=3,
            num_attention_heads=dims.heads,
            num_key_value_heads=dims.kv_heads,
            max_position_embeddings=seq_len,
            tie_word_embeddings=False,
        )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    stages = split_model(model, 3)
    for s in stages:
        s.train()
    return stages


def measure_cpu_compute(dims: ModelDims, shape: Shape, stages: int) -> StageCompute:
    """Time the app's StageModules here (one thread) and build per-stage costs from per-layer ones."""
    import torch

    from peer.config import OptimConfig, SpectralConfig
    from peer.model.stages import layer_ranges, lm_loss
    from peer.optim.stage_optimizer import StageOptimizer

    with OneThread():
        first, mid, last = _build_stages(dims, shape.seq_len)
        gen = torch.Generator().manual_seed(0)
        window = torch.randint(0, dims.vocab, (shape.micro_batch_size, shape.seq_len + 1), generator=gen)
        ids, targets = window[:, :-1], window[:, 1:]
        h = torch.randn(shape.micro_batch_size, shape.seq_len, dims.hidden, generator=gen)

        def fwd_first():
            return first(ids)

        def fb_first():
            out = first(ids)
            out.backward(torch.ones_like(out))

        def fwd_mid():
            return mid(h.requires_grad_(True))

        def fb_mid():
            x = h.detach().requires_grad_(True)
            out = mid(x)
            out.backward(torch.ones_like(out))

        def fwd_last():
            return lm_loss(last(h.detach().requires_grad_(True)), targets)

        def fb_last():
            lm_loss(last(h.detach().requires_grad_(True)), targets).backward()

        t = {
            name: time_call(fn)
            for name, fn in [
                ("f0", fwd_first),
                ("fb0", fb_first),
                ("fm", fwd_mid),
                ("fbm", fb_mid),
                ("fl", fwd_last),
                ("fbl", fb_last),
            ]
        }
        layer_f, layer_b = t["fm"], max(t["fbm"] - t["fm"], 0.0)
        embed_f, embed_b = max(t["f0"] - t["fm"], 0.0), max(t["fb0"] - t["f0"] - layer_b, 0.0)
        head_f, head_b = max(t["fl"] - t["fm"], 0.0), max(t["fbl"] - t["fl"] - layer_b, 0.0)

        named = list(mid.named_parameters())
        for _, p in named:
            p.grad = torch.randn_like(p)
        opt = StageOptimizer(named, mid.decoder_matrices(), SpectralConfig(), OptimConfig())

        def step():
            opt.step()
            for _, p in named:  # the app zeroes then refills the gradients each step
                p.grad = torch.ones_like(p)

        per_param = time_call(step) / sum(p.numel() for _, p in named)
    fwd, bwd, optim = [], [], []
    for i, (a, b) in enumerate(layer_ranges(dims.layers, stages)):
        n = b - a
        fwd.append(n * layer_f + (embed_f if i == 0 else 0.0) + (head_f if i == stages - 1 else 0.0))
        bwd.append(n * layer_b + (embed_b if i == 0 else 0.0) + (head_b if i == stages - 1 else 0.0))
        optim.append(per_param * dims.stage_params(i, stages))
    how = (
        f"measured here, 1 thread: decoder layer {layer_f * 1e3:.2f} ms forward + {layer_b * 1e3:.2f} ms backward, embedding {embed_f * 1e3:.2f} + {embed_b * 1e3:.2f} ms, "
        f"norm+head+loss {head_f * 1e3:.2f} + {head_b * 1e3:.2f} ms per micro-batch; AdamW {per_param * 1e9:.2f} ns per parameter"
    )
    return StageCompute(fwd, bwd, optim, how)


def gpu_compute(dims: ModelDims, shape: Shape, stages: int, device: Device, mfu: float) -> StageCompute:
    """Stage times from FLOPs at peak * MFU (forward 1/3, backward 2/3) and AdamW at memory bandwidth."""
    from peer.model.stages import layer_ranges

    rate = device.peak_tflops * 1e12 * mfu
    per_layer = 6 * dims.layer_params() + 12 * dims.hidden * shape.seq_len  # FLOPs per token, forward + backward
    head = 6 * dims.vocab * dims.hidden
    fwd, bwd, opt = [], [], []
    for i, (a, b) in enumerate(layer_ranges(dims.layers, stages)):
        flops = shape.tokens * ((b - a) * per_layer + (head if i == stages - 1 else 0))
        fwd.append(flops / 3 / rate)
        bwd.append(flops * 2 / 3 / rate)
        opt.append(dims.stage_params(i, stages) * ADAMW_BYTES_PER_PARAM / (device.mem_gbps * 1e9))
    how = f"{device.label}: {device.peak_tflops} TFLOP/s x MFU {mfu}; per token and layer 6 x {dims.layer_params():,} + 12 x {dims.hidden} x {shape.seq_len} FLOPs, head 6 x {dims.vocab} x {dims.hidden}; AdamW {ADAMW_BYTES_PER_PARAM} B/param at {device.mem_gbps} GB/s"
    return StageCompute(fwd, bwd, opt, how)
