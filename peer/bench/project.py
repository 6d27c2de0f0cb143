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
            (peer/codec, peer/wire): the sender's encode (low-rank: observe + project) and
            serialisation; the receiver's two parses (gRPC handler, then drain), its validation
            decode and its second decode (+ lift); the same for gradients; the low-rank basis
            refresh (SVD + prior) and its shipping, amortised over `basis_refresh` steps. The app
            runs this wire path on the CPU whatever the device, so a GPU projection charges it
            at this CPU's speed (shapes above 2**21 elements are measured with fewer sequences
            and scaled linearly in tokens).
  bytes     app bytes per message: the serialized ActivationChunk / GradientChunk, sized by
            building the real proto with a payload of the codec's exact length (dense: fp16
            B*T*H; low-rank: int8 B*T*r + one float32 scale per 256 values; token ids in the
            narrowest dtype; a (prior, basis) pair of fp16 [V, H] + [H, r] once per refresh and
            next-stage peer). On the wire: + 5 bytes gRPC prefix, + 9 bytes per 16 KiB HTTP/2
            frame, + 66 bytes Ethernet/IPv4/TCP-with-timestamps header per 1448-byte segment
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
well: stage 0 runs the M forwards of step n only after applying step n-1 (its in-flight limit is
M and max_staleness is 0), every peer's main loop is serial (step > backward > forward), and a
micro-batch goes to a next-stage peer drawn at random. So the prediction is an event simulation
of exactly that schedule (`simulate`): K stages x R peers, each a serial worker, each link a
FIFO, R * M * B * T tokens per round of stage-0 steps.

DP, two ways. `dp_kept`: DP must keep its configured cadence (synchronous data parallelism, the
baseline the issue's targets compare with); its bytes per step take bandwidth from every link,
solved as a fixed point (the step time T with T = simulate(B - DP bytes per step / T)); `bound`
"dp" when DP's link time is the largest term. The app (`tokens_per_s`, the bench's own
definition: "as often as the averager manages"): rounds run in the background and never hold a
step back. While DP needs at most half a link at its cadence, that is the same as dp_kept. Beyond
that, the PP and DP TCP flows share the link (PP sees B / 2; an assumption: equal TCP shares),
and rounds come only as often as what PP leaves of the link carries them
(`dp_every_achieved` steps per round); `bound` is then "dp" if the halved link binds PP.

Test-bed factors (all off by default; the bed test sets them from the bed): `shared_cores` (the
peers share this many cores equally: the machine's cores less what other processes took),
`burst_bytes` (tbf's bucket: a transfer on a link that rested sends its first `burst` bytes at
line rate) and `queue_s` (a full tbf queue, latency + burst / rate: a message with another one
queued behind it on the same connection arrives that much later, because TCP fills the
drop-tail queue and the lost segments' retransmissions wait behind it; a plain TCP probe on the
bed shows it: 263 kB alone 243 ms, the first of two back to back 255-487 ms, mean +83 ms at
8 Mbit/s, where the queue is 83 ms).

Not modelled: the CPU of hivemind's DHT, averager and p2pd processes (on the CPU bed they take
a lot when rounds are attempted often: docs/benchmarks.md), gRPC's own threads (about 1 ms per
message each side, measured), the daemon loop, retransmitted bytes, latency (netem is not
available; a real link adds a round trip per transfer), status and heartbeat traffic.
"""

from __future__ import annotations

import heapq
import math
import os
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from peer.bench.throughput import MODES, GpuScenario, mode_config
from peer.errors import ConfigError

# -- devices and models --------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    """Where a stage computes. peak_tflops None = measured here (the CPU)."""

    name: str
    label: str
    peak_tflops: float | None
    mem_gbps: float | None
    source: str


DEVICES: dict[str, Device] = {
    "rtx4090": Device("rtx4090", GpuScenario.gpu, GpuScenario.peak_tflops, 1008.0, "NVIDIA Ada whitepaper: 165.2 TFLOP/s dense bf16 (fp32 accumulate), 1008 GB/s"),
    "a100": Device("a100", "A100 80GB SXM", 312.0, 2039.0, "NVIDIA A100 datasheet: 312 TFLOP/s dense bf16, 2039 GB/s"),
    "h100": Device("h100", "H100 SXM", 989.4, 3350.0, "NVIDIA H100 datasheet: 989.4 TFLOP/s dense bf16, 3.35 TB/s"),
    "h200": Device("h200", "H200 SXM", 989.4, 4800.0, "NVIDIA H200 datasheet: 989 TFLOP/s dense bf16 (the H100's tensor cores), 4.8 TB/s"),
    "cpu": Device("cpu", "this machine's CPU, one torch thread per peer (measured)", None, None, "measured here"),
}
DEFAULT_MFU = GpuScenario.mfu
ADAMW_BYTES_PER_PARAM = 28  # reads param, grad, m, v (16 B) and writes param, m, v (12 B), fp32


@dataclass(frozen=True)
class ModelDims:
    """A decoder-only LM's sizes: enough for FLOPs, parameters and boundary tensors."""

    name: str
    family: str  # llama | qwen2 | mistral | gpt2 (transformers' model_type)
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    max_positions: int = 0  # gpt2's learned position table
    source: str = ""

    def layer_params(self) -> int:
        h, i = self.hidden, self.intermediate
        if self.family == "gpt2":  # c_attn (3h x h + 3h), c_proj, c_fc, c_proj (with biases), 2 layer norms
            return 4 * h * h + 4 * h + 2 * h * i + i + h + 4 * h
        kv = self.kv_heads * (h // self.heads)
        bias = h + 2 * kv if self.qkv_bias else 0
        return 2 * h * h + 2 * h * kv + bias + 3 * h * i + 2 * h

    def embed_params(self) -> int:
        return self.vocab * self.hidden + (self.max_positions * self.hidden if self.family == "gpt2" else 0)

    def head_params(self) -> int:
        """Final norm + head as the last stage holds them (a tied head is a copy there)."""
        return self.vocab * self.hidden + (2 if self.family == "gpt2" else 1) * self.hidden

    def params(self) -> int:
        """Unique parameters of the whole model (a tied head counted once)."""
        return self.embed_params() + self.layers * self.layer_params() + self.head_params() - (self.vocab * self.hidden if self.tied else 0)

    def stage_params(self, index: int, stages: int) -> int:
        from peer.model.stages import layer_ranges

        a, b = layer_ranges(self.layers, stages)[index]
        return (b - a) * self.layer_params() + (self.embed_params() if index == 0 else 0) + (self.head_params() if index == stages - 1 else 0)


_HF = "the model's config.json on the Hugging Face hub"
KNOWN_MODELS: dict[str, ModelDims] = {
    "llama-3.2-1b": ModelDims("Llama-3.2-1B", "llama", 2048, 16, 32, 8, 8192, 128256, True, source=_HF),
    "llama-3.2-3b": ModelDims("Llama-3.2-3B", "llama", 3072, 28, 24, 8, 8192, 128256, True, source=_HF),
    "qwen2.5-0.5b": ModelDims("Qwen2.5-0.5B", "qwen2", 896, 24, 14, 2, 4864, 151936, True, qkv_bias=True, source=_HF),
    "qwen2.5-1.5b": ModelDims("Qwen2.5-1.5B", "qwen2", 1536, 28, 12, 2, 8960, 151936, True, qkv_bias=True, source=_HF),
}


@dataclass(frozen=True)
class Shape:
    """The pipeline's micro-batch: B sequences of T tokens, M micro-batches per optimizer step."""

    micro_batch_size: int
    seq_len: int
    micro_batches: int

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.seq_len


def _bench_pipeline() -> dict:
    return mode_config("dense", 2, 1, 1)["pipeline"]


def _tiny_dims(name: str, hidden: int, layers: int, heads: int, max_seq_len: int) -> ModelDims:
    from peer.config import ModelConfig
    from peer.model.loading import TINY_PREFIX, tiny_config

    family = name[len(TINY_PREFIX):]
    c = tiny_config(family, ModelConfig(name=name, num_stages=1, hidden_size=hidden, num_layers=layers, num_heads=heads, max_seq_len=max_seq_len))
    if family == "gpt2":
        return ModelDims(name, "gpt2", c.n_embd, c.n_layer, c.n_head, c.n_head, 4 * c.n_embd, c.vocab_size, False, max_positions=c.n_positions, source="built from a config (peer/model/loading.py)")
    return ModelDims(name, family, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, c.vocab_size, bool(c.tie_word_embeddings), qkv_bias=family == "qwen2", source="built from a config (peer/model/loading.py)")


def _hf_dims(path: str) -> ModelDims:
    """Dims of a local Hugging Face model folder (config.json only; nothing is downloaded)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(path, local_files_only=True)
    if c.model_type == "gpt2":
        return ModelDims(path, "gpt2", c.n_embd, c.n_layer, c.n_head, c.n_head, c.n_inner or 4 * c.n_embd, c.vocab_size, bool(c.tie_word_embeddings), max_positions=c.n_positions, source=f"{path}/config.json")
    return ModelDims(
        path, c.model_type, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        c.intermediate_size, c.vocab_size, bool(c.tie_word_embeddings), qkv_bias=c.model_type == "qwen2", source=f"{path}/config.json",
    )


def _named_dims(name: str, stages: int) -> ModelDims:
    key = name.lower().rsplit("/", 1)[-1]
    if key in KNOWN_MODELS:
        return KNOWN_MODELS[key]
    if name.startswith("tiny-"):
        cfg = mode_config("dense", stages, 1, 1)["model"]  # the bench's tiny model: 2 layers per stage
        return _tiny_dims(name, cfg["hidden_size"], cfg["num_layers"], cfg["num_heads"], cfg["max_seq_len"])
    if Path(name).is_dir() and (Path(name) / "config.json").exists():
        return _hf_dims(name)
    raise ConfigError("--model", name, f"unknown model: give a run.toml, a local model folder or one of tiny-llama, {', '.join(k for k in KNOWN_MODELS)}")


def resolve_model(spec: str, stages: int) -> tuple[ModelDims, Shape, str]:
    """(dims, micro-batch shape, what it came from) for a run.toml path or a model name.

    Shapes: a run.toml's [pipeline]; the bench's (8 x 128, M = 2) for tiny models; 4 x 2048,
    M = 2 for the published models (2048 as in throughput.py's GPU scenario)."""
    if spec.endswith(".toml"):
        from peer.config import load_run_toml

        if not Path(spec).is_file():
            raise ConfigError("--model", spec, "no such run.toml")
        cfg = load_run_toml(spec)
        m = cfg.model
        if m.name.startswith("tiny-"):
            dims = _tiny_dims(m.name, m.hidden_size, m.num_layers, m.num_heads, m.max_seq_len)
        else:
            dims = _named_dims(m.name, stages)
        p = cfg.pipeline
        return dims, Shape(p.micro_batch_size, p.seq_len, p.micro_batches), f"run.toml {spec}"
    dims = _named_dims(spec, stages)
    if spec.startswith("tiny-"):
        p = _bench_pipeline()
        return dims, Shape(p["micro_batch_size"], p["seq_len"], p["micro_batches"]), "the throughput bench's tiny model and pipeline"
    return dims, Shape(4, GpuScenario.seq_len, 2), "published dims; pipeline 4 x 2048, 2 micro-batches"


# -- compute ------------------------------------------------------------------------------------


@dataclass
class StageCompute:
    """Seconds per micro-batch (forward, backward) and per optimizer step, per stage."""

    fwd: list[float]
    bwd: list[float]
    opt: list[float]
    how: str


def _time(fn: Callable[[], object], min_s: float = 0.3, max_reps: int = 30, slow_s: float = 1.0) -> float:
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


class _OneThread:
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
    from transformers import (
        AutoModelForCausalLM,
        GPT2Config,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
    )

    from peer.model.stages import split_model

    if dims.family == "gpt2":
        config = GPT2Config(vocab_size=dims.vocab, n_positions=max(seq_len, dims.max_positions), n_embd=dims.hidden, n_layer=3, n_head=dims.heads, n_inner=dims.intermediate, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False)
    else:
        cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}.get(dims.family)
        if cls is None:
            raise ConfigError("--model", dims.name, f"family {dims.family!r} cannot be timed here; supported: llama, qwen2, mistral, gpt2")
        config = cls(vocab_size=dims.vocab, hidden_size=dims.hidden, intermediate_size=dims.intermediate, num_hidden_layers=3, num_attention_heads=dims.heads,
                     num_key_value_heads=dims.kv_heads, max_position_embeddings=seq_len, tie_word_embeddings=False)
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

    with _OneThread():
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

        t = {name: _time(fn) for name, fn in [("f0", fwd_first), ("fb0", fb_first), ("fm", fwd_mid), ("fbm", fb_mid), ("fl", fwd_last), ("fbl", fb_last)]}
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

        per_param = _time(step) / sum(p.numel() for _, p in named)
    fwd, bwd, optim = [], [], []
    for i, (a, b) in enumerate(layer_ranges(dims.layers, stages)):
        n = b - a
        fwd.append(n * layer_f + (embed_f if i == 0 else 0.0) + (head_f if i == stages - 1 else 0.0))
        bwd.append(n * layer_b + (embed_b if i == 0 else 0.0) + (head_b if i == stages - 1 else 0.0))
        optim.append(per_param * dims.stage_params(i, stages))
    how = (f"measured here, 1 thread: decoder layer {layer_f * 1e3:.2f} ms forward + {layer_b * 1e3:.2f} ms backward, embedding {embed_f * 1e3:.2f} + {embed_b * 1e3:.2f} ms, "
           f"norm+head+loss {head_f * 1e3:.2f} + {head_b * 1e3:.2f} ms per micro-batch; AdamW {per_param * 1e9:.2f} ns per parameter")
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


# -- bytes ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Names:
    """Header fields that set a message's size (varints, strings): the swarm's by default."""

    run_id: str = "run-00000000"
    sender: str = "peer-00000000"
    micro_batch_id: int = 1 << 20  # replica id (20 bits) * M + j: three varint bytes
    step: int = 1000
    basis_version: int = 50  # one refresh per 20 steps


def _mask_cfg(mode: str):
    from peer.config import MaskConfig

    return MaskConfig(**mode_config(mode, 2, 1, 1)["mask"])


def _link_codec(mask):
    """The codec on the link, as StageWorker builds it: coefficients (low-rank) or hidden states."""
    from peer.codec.mask import MaskCodec
    from peer.config import MaskConfig

    return MaskCodec(MaskConfig(values=mask.values, seed=mask.seed)) if mask.scheme == "lowrank" else MaskCodec(mask)


def _payload(codec, shape: tuple[int, ...], boundary: int, names: Names, n_bytes: int):
    """A TensorPayload as `codec.encode` makes it for a tensor of `shape`, with a payload of n bytes."""
    import torch

    msg = codec.encode(torch.zeros((1,) * len(shape)), boundary=boundary, step=names.step, micro_batch=names.micro_batch_id)
    del msg.shape[:]
    msg.shape.extend(shape)
    msg.payload = b"\0" * n_bytes
    return msg


def link_payload_bytes(mask, numel: int) -> int:
    """Payload bytes of `numel` link values: kept values (drop 0 here: all) + int8 block scales."""
    from peer.codec.mask import (
        _SCALE_BYTES,
        _VALUE_BYTES,
        DEFAULT_BLOCK_SIZE,
        VALUE_WIRE,
    )
    from peer.wire import anchormesh_pb2 as pb

    if mask.scheme == "mask" and mask.drop:
        raise ConfigError("mask.drop", mask.drop, "the projection sizes drop = 0 codecs only (the bench's modes)")
    values = VALUE_WIRE[mask.values]
    return numel * _VALUE_BYTES[values] + (_SCALE_BYTES * -(-numel // DEFAULT_BLOCK_SIZE) if values == pb.INT8 else 0)


def prior_rows(mask, vocab: int) -> tuple[int, bool]:
    """(rows of the token prior that travel, whether their token ids travel too): the whole
    [V, H] table up to `mask.prior_rows` rows, else the most frequent tokens' rows plus one
    shared row (peer/codec/basis.py; assumes the sender has seen that many distinct tokens)."""
    cap = getattr(mask, "prior_rows", None)  # older configs ship the whole table
    if cap is None or vocab <= cap:
        return vocab, False
    return cap, True


@dataclass
class MessageBytes:
    """App bytes (serialized protos) of one micro-batch on one stage link."""

    activation: int
    gradient: int
    basis: int  # extra bytes of the message that ships a new (prior, basis) pair; 0 without one


def message_bytes(mode: str, dims: ModelDims, shape: Shape, boundary: int = 0, names: Names = Names()) -> MessageBytes:
    """Sizes of the ActivationChunk and GradientChunk one micro-batch sends over `boundary`."""
    import torch

    from peer.wire import anchormesh_pb2 as pb
    from peer.wire.tensors import tensor_to_proto, token_dtype

    mask = _mask_cfg(mode)
    codec = _link_codec(mask)
    B, T = shape.micro_batch_size, shape.seq_len
    width = mask.rank if mask.scheme == "lowrank" else dims.hidden
    header = pb.MicroBatchHeader(run_id=names.run_id, micro_batch_id=names.micro_batch_id, step=names.step, sender=names.sender, boundary=boundary)
    ids = tensor_to_proto(torch.zeros(B, T + 1, dtype=token_dtype(dims.vocab)))
    act = pb.ActivationChunk(header=header, token_ids=ids)
    act.hidden.CopyFrom(_payload(codec, (B, T, width), boundary, names, link_payload_bytes(mask, B * T * width)))
    basis = 0
    if mask.scheme == "lowrank":
        act.basis_version = names.basis_version
        with_basis = pb.ActivationChunk()
        with_basis.CopyFrom(act)
        rows, with_ids = prior_rows(mask, dims.vocab)
        with_basis.basis_prior.CopyFrom(tensor_to_proto(torch.zeros(rows, dims.hidden, dtype=torch.float16)))
        with_basis.basis.CopyFrom(tensor_to_proto(torch.zeros(dims.hidden, mask.rank, dtype=torch.float16)))
        if with_ids:
            with_basis.basis_prior_ids.CopyFrom(tensor_to_proto(torch.zeros(rows - 1, dtype=torch.int32)))
        basis = with_basis.ByteSize() - act.ByteSize()
    grad = pb.GradientChunk(header=header)
    grad.grad.CopyFrom(_payload(codec, (B, T, width), boundary, names, link_payload_bytes(mask, B * T * width)))
    return MessageBytes(act.ByteSize(), grad.ByteSize(), basis)


@dataclass(frozen=True)
class Framing:
    """What a message of n app bytes costs on an Ethernet link (defaults: MTU 1500, TCP timestamps)."""

    mtu: int = 1500
    ip_tcp_header: int = 52  # IPv4 20 + TCP 20 + timestamps option 12
    ethernet_header: int = 14  # counted by tbf and by the interface byte counters
    http2_frame: int = 16384  # default max DATA frame
    http2_header: int = 9
    grpc_prefix: int = 5
    segments_per_ack: int = 2  # delayed ACK

    @property
    def mss(self) -> int:
        return self.mtu - self.ip_tcp_header

    @property
    def segment_header(self) -> int:
        return self.ip_tcp_header + self.ethernet_header

    def segments(self, n: float) -> tuple[int, float]:
        """(TCP segments, HTTP/2 bytes) of one gRPC message of n app bytes."""
        body = n + self.grpc_prefix
        body += self.http2_header * math.ceil(body / self.http2_frame)
        return math.ceil(body / self.mss), body

    def wire(self, n: float) -> float:
        """Bytes on the sending link for one message of n app bytes."""
        segs, body = self.segments(n)
        return body + segs * self.segment_header

    def acks(self, n: float) -> float:
        """Bytes of the ACKs the receiver sends back for it."""
        segs, _ = self.segments(n)
        return math.ceil(segs / self.segments_per_ack) * self.segment_header


def dp_round_bytes(dims: ModelDims, stage: int, stages: int, replicas: int, compression: str) -> int:
    """Bytes one peer of `stage` uploads (and downloads) per averaging round (peer/dp/group.py)."""
    from peer.dp.group import round_bytes

    return round_bytes(dims.stage_params(stage, stages), replicas, compression) if replicas > 1 else 0


# -- codec cost -----------------------------------------------------------------------------------


@dataclass
class CodecCost:
    """CPU seconds per micro-batch of the wire path (and per refresh of a low-rank basis)."""

    send_fwd: float  # sender: encode (low-rank: observe + project) + serialize
    recv_fwd: float  # receiver: parse, validate-decode, parse again, decode (+ lift)
    send_bwd: float  # receiver: gradient through the lift + encode + serialize
    recv_bwd: float  # sender: parse, validate-decode, parse again, decode (+ back through the basis)
    refresh: float  # sender: BasisLearner.maybe_refresh (SVD + prior), once per version
    ship_basis: float  # one (prior, basis) pair: to proto on the sender, two parses + two decodes on the receiver
    scaled_by: float  # measured on 1/scaled_by of the micro-batch's sequences, then scaled


MEASURE_MAX_ELEMENTS = 1 << 21


def measure_codec(mode: str, dims: ModelDims, shape: Shape, names: Names = Names()) -> CodecCost:
    """Run the app's wire path for one micro-batch of `mode` here (one thread) and time it."""
    import torch

    from peer.codec.basis import BasisLearner
    from peer.pipeline.worker import MAX_MESSAGE_BYTES, check_token_window
    from peer.wire import anchormesh_pb2 as pb
    from peer.wire.tensors import (
        parse_message,
        proto_to_tensor,
        tensor_to_proto,
        token_dtype,
    )

    mask = _mask_cfg(mode)
    codec = _link_codec(mask)
    H, V = dims.hidden, dims.vocab
    B, T = shape.micro_batch_size, shape.seq_len
    b = B
    while b > 1 and b * T * H > MEASURE_MAX_ELEMENTS:
        b //= 2
    scale = B / b
    lowrank = mask.scheme == "lowrank"
    width = mask.rank if lowrank else H
    key = dict(boundary=0, step=names.step, micro_batch=names.micro_batch_id)
    gen = torch.Generator().manual_seed(0)
    with _OneThread():
        window = torch.randint(0, V, (b, T + 1), generator=gen)
        ids = window[:, :-1]
        out = torch.randn(b, T, H, generator=gen)
        rows, with_ids = prior_rows(mask, V)
        learner = BasisLearner(V, H, mask.rank, mask.basis_refresh, **({"max_rows": mask.prior_rows} if with_ids else {})) if lowrank else None
        if learner is not None:
            while sum(r.shape[0] for r in learner.rows) < learner.buffer_tokens:
                learner.observe(torch.randn(b, T, H, generator=gen), ids)
            refresh = _time(lambda: learner.maybe_refresh(learner._last_refresh_step + mask.basis_refresh if learner._last_refresh_step is not None else 0), min_s=0.0, max_reps=3)
        state = learner.current if learner is not None else None
        header = pb.MicroBatchHeader(run_id=names.run_id, micro_batch_id=names.micro_batch_id, step=names.step, sender=names.sender, boundary=0)

        def send_fwd() -> bytes:
            msg = pb.ActivationChunk(header=header, token_ids=tensor_to_proto(window.to(token_dtype(V))))
            h = out
            if learner is not None:
                learner.observe(h, ids)
                msg.basis_version = state.version
                h = state.project(h, ids)
            msg.hidden.CopyFrom(codec.encode(h, **key))
            return msg.SerializeToString()

        data = send_fwd()
        leaf: list = []

        def recv_fwd():
            m = parse_message(pb.ActivationChunk, data, MAX_MESSAGE_BYTES)  # the gRPC handler
            got = check_token_window(m.token_ids, V)[:, :-1].long()
            codec.decode(m.hidden, expect_shape=(*got.shape, width), **key)  # validate
            m = parse_message(pb.ActivationChunk, data, MAX_MESSAGE_BYTES)  # drain
            w = proto_to_tensor(m.token_ids).to(torch.long)
            x = codec.decode(m.hidden, expect_shape=(*w[:, :-1].shape, width), **key)
            x.requires_grad_(True)
            h = state.lift(x, w[:, :-1]) if state is not None else x
            leaf[:] = [x, h]

        recv_fwd()
        g_out = torch.randn(b, T, H, generator=gen)

        def send_bwd() -> bytes:
            x, h = leaf
            x.grad = None
            if state is not None:
                h.backward(g_out, retain_graph=True)  # dL/dc = dL/dh~ B, inside the stage's backward
                g = x.grad
            else:
                g = g_out
            msg = pb.GradientChunk(header=header, grad=codec.encode(g, **key))
            return msg.SerializeToString()

        gdata = send_bwd()

        def recv_bwd():
            m = parse_message(pb.GradientChunk, gdata, MAX_MESSAGE_BYTES)
            codec.decode(m.grad, expect_shape=(b, T, width), **key)  # validate
            m = parse_message(pb.GradientChunk, gdata, MAX_MESSAGE_BYTES)
            g = codec.decode(m.grad, expect_shape=(b, T, width), **key)
            if state is not None:
                g = g @ state.basis.T
            return g.to(torch.float32)

        t_send_fwd, t_recv_fwd = _time(send_fwd), _time(recv_fwd)
        t_send_bwd, t_recv_bwd = _time(send_bwd), _time(recv_bwd)
        ship = 0.0
        if state is not None:
            def ship_pair():
                m = pb.ActivationChunk(basis_version=state.version)
                m.basis_prior.CopyFrom(tensor_to_proto(state.prior.half()))
                m.basis.CopyFrom(tensor_to_proto(state.basis.half()))
                if getattr(state, "row_ids", None) is not None:
                    m.basis_prior_ids.CopyFrom(tensor_to_proto(state.row_ids))
                raw = m.SerializeToString()
                for _ in range(2):  # validate, then _lift
                    m2 = parse_message(pb.ActivationChunk, raw, MAX_MESSAGE_BYTES)
                    proto_to_tensor(m2.basis, expect_shape=(H, mask.rank)).float()
                    proto_to_tensor(m2.basis_prior, expect_shape=tuple(state.prior.shape)).float()
                    if m2.HasField("basis_prior_ids"):
                        proto_to_tensor(m2.basis_prior_ids)

            ship = _time(ship_pair, min_s=0.0, max_reps=3)
    return CodecCost(t_send_fwd * scale, t_recv_fwd * scale, t_send_bwd * scale, t_recv_bwd * scale, refresh if lowrank else 0.0, ship, scale)


# -- the schedule ---------------------------------------------------------------------------------


@dataclass
class Tasks:
    """Per stage, per micro-batch: busy seconds of each task and wire bytes of each message."""

    fwd: list[float]  # stage 0: inject; middle: forward; last: forward + loss + backward
    bwd: list[float]  # stages < K-1: backward (the last stage's is inside fwd)
    step: list[float]  # optimizer step
    act_wire: list[float]  # stage s -> s+1, per micro-batch (amortised basis included)
    grad_wire: list[float]  # stage s+1 -> s
    act_ack: list[float]  # ACK bytes the activation's receiver sends back
    grad_ack: list[float]


@dataclass
class Schedule:
    step_s: float  # mean seconds between optimizer steps of a stage-0 peer
    tokens_per_s: float


class _Link:
    """One shaped direction of one host's access link (a tbf bucket of `burst` bytes)."""

    def __init__(self, burst: float) -> None:
        self.free_at = 0.0
        self.tokens = burst
        self.at = 0.0

    def credit(self, now: float, rate: float, burst: float) -> float:
        return min(burst, self.tokens + (now - self.at) * rate)


def simulate(tasks: Tasks, stages: int, replicas: int, micro_batches: int, tokens_per_mb: int, rate_bytes_s: float | None,
             burst_bytes: float = 0.0, shared_cores: float | None = None, queue_s: float = 0.0, steps: int | None = None, seed: int = 0) -> Schedule:
    """Event simulation of the swarm's schedule (module docstring); tokens/s of all stage-0 peers.

    Each peer is a serial worker: a step when M micro-batches are done, else the oldest backward,
    else a forward (stage 0: inject while it has applied the previous step and has fewer than M
    in flight). Messages go to a next-stage peer drawn uniformly (the app draws by capacity,
    equal here), gradients back to the sender. A transfer holds the sender's upload and the
    receiver's download. With `shared_cores`, the running tasks share that many cores equally
    (the bed: the cores this machine has, less what other processes took meanwhile).

    `queue_s` (a drop-tail queue of that many seconds at the link rate, e.g. tbf's latency +
    burst / rate): a message that has another one queued behind it on the same connection is
    delivered that much later (at most until the next one ends). Why: with more data to send,
    TCP fills the queue and loses segments, and their retransmissions wait behind the full
    queue, so the receiver gets the message's last bytes about one queue later; the last
    message of a burst finds the queue draining and is on time (a plain TCP probe on the bed
    shows this)."""
    K, R, M = stages, replicas, micro_batches
    steps = steps or (8 if R == 1 else 30)
    warm = 2 if R == 1 else 6
    rng = random.Random(seed)
    peers = [(s, i) for s in range(K) for i in range(R)]
    version = {p: 0 for p in peers}
    done = {p: 0 for p in peers}
    next_mb = {p: 0 for p in peers}
    inflight = {p: 0 for p in peers}
    fwd_q: dict = {p: deque() for p in peers}
    bwd_q: dict = {p: deque() for p in peers}
    running: dict = {}  # peer -> [remaining work, kind, payload]
    up = {p: _Link(burst_bytes) for p in peers}
    down = {p: _Link(burst_bytes) for p in peers}
    pending: deque = deque()  # transfers waiting for both ends: (src, dst, bytes, ack_bytes, kind, payload)
    events: list = []  # (time, seq, dst, kind, payload) arrivals
    on_link: dict = {}  # (src, dst) -> [end time, arrival event] of the transfer in progress
    cancelled: set = set()  # seq numbers of arrivals that were moved
    seq = 0
    now = 0.0
    step_times: dict = {i: [] for i in range(R)}

    def pick(p) -> tuple[float, str, object] | None:
        s, _ = p
        if done[p] >= M:
            return tasks.step[s], "step", None
        if bwd_q[p]:
            return tasks.bwd[s], "bwd", bwd_q[p].popleft()
        if s > 0 and fwd_q[p]:
            return tasks.fwd[s], "fwd", fwd_q[p].popleft()
        if s == 0 and next_mb[p] // M == version[p] and inflight[p] < M:
            return tasks.fwd[0], "inject", None
        return None

    def send(src, dst, nbytes: float, kind: str, payload) -> None:
        nonlocal seq
        if rate_bytes_s is None:
            heapq.heappush(events, (now, seq, dst, kind, payload))
            seq += 1
            return
        busy = on_link.get((src, dst))
        if queue_s and busy is not None and busy[0] > now and not busy[2]:  # queued behind a transfer in progress: it arrives late
            end, event, _ = busy
            cancelled.add(event[1])
            moved = (end + min(queue_s, nbytes / rate_bytes_s), seq, *event[2:])
            seq += 1
            heapq.heappush(events, moved)
            busy[2] = True
        pending.append((src, dst, nbytes, kind, payload))

    def start_transfers() -> None:
        nonlocal seq
        waiting = len(pending)
        for _ in range(waiting):
            src, dst, nbytes, kind, payload = pending.popleft()
            a, b = up[src], down[dst]
            if a.free_at > now or b.free_at > now:
                pending.append((src, dst, nbytes, kind, payload))
                continue
            ca, cb = a.credit(now, rate_bytes_s, burst_bytes), b.credit(now, rate_bytes_s, burst_bytes)
            d = max(nbytes - min(ca, cb), 0.0) / rate_bytes_s
            for link, c in ((a, ca), (b, cb)):
                link.tokens = max(min(burst_bytes, c + d * rate_bytes_s) - nbytes, 0.0)
                link.at = now + d
                link.free_at = now + d
            event = (now + d, seq, dst, kind, payload)
            heapq.heappush(events, event)
            on_link[(src, dst)] = [now + d, event, False]
            seq += 1

    def finish(p, kind: str, payload) -> None:
        s, i = p
        if kind == "step":
            version[p] += 1
            done[p] = 0
            if s == 0:
                step_times[i].append(now)
        elif kind == "inject":
            next_mb[p] += 1
            inflight[p] += 1
            send(p, (1, rng.randrange(R)), tasks.act_wire[0], "act", (p,))
        elif kind == "fwd" and s < K - 1:
            send(p, (s + 1, rng.randrange(R)), tasks.act_wire[s], "act", payload + (p,))
        elif kind == "fwd":  # last stage: forward + loss + backward
            done[p] += 1
            send(p, payload[-1], tasks.grad_wire[s - 1], "grad", payload[:-1])
        elif kind == "bwd":
            done[p] += 1
            if s == 0:
                inflight[p] -= 1
            else:
                send(p, payload[-1], tasks.grad_wire[s - 1], "grad", payload[:-1])

    while min(len(v) for v in step_times.values()) < warm + steps:
        for p in peers:
            if p not in running:
                task = pick(p)
                if task is not None:
                    running[p] = list(task)
        if rate_bytes_s is not None:
            start_transfers()
        speed = min(1.0, shared_cores / len(running)) if shared_cores and running else 1.0
        first = min(running, key=lambda q: running[q][0]) if running else None
        t_cpu = now + running[first][0] / speed if running else math.inf
        t_evt = events[0][0] if events else math.inf
        t_link = min([l.free_at for l in (*up.values(), *down.values()) if l.free_at > now], default=math.inf) if pending else math.inf
        t_next = min(t_cpu, t_evt, t_link)
        if t_next == math.inf:
            raise RuntimeError("the simulated pipeline stalled (a bug in the schedule model)")
        for r in running.values():
            r[0] -= (t_next - now) * speed
        if t_next == t_cpu:  # exactly done, whatever rounding `now + remaining` suffered at large times
            running[first][0] = 0.0
        now = t_next
        for p in [p for p, r in running.items() if r[0] <= 1e-12]:
            _, kind, payload = running.pop(p)
            finish(p, kind, payload)
        while events and events[0][0] <= now:
            _, n, dst, kind, payload = heapq.heappop(events)
            if n not in cancelled:
                (fwd_q if kind == "act" else bwd_q)[dst].append(payload)
    tokens_per_s = sum(steps * M * tokens_per_mb / (t[warm + steps - 1] - t[warm - 1]) for t in step_times.values())
    return Schedule(R * M * tokens_per_mb / tokens_per_s, tokens_per_s)


# -- the projection -------------------------------------------------------------------------------


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


def scaled(c: Costs, factor: float) -> Costs:
    """`c` with every CPU cost (compute on "cpu", codec everywhere) times `factor`: this machine's
    CPU running slower (or faster) now than when it was measured (the bed test measures that)."""
    from dataclasses import replace

    k = factor if c.device.peak_tflops is None else 1.0
    compute = StageCompute([x * k for x in c.compute.fwd], [x * k for x in c.compute.bwd], [x * k for x in c.compute.opt], c.compute.how)
    codec = {m: replace(v, send_fwd=v.send_fwd * factor, recv_fwd=v.recv_fwd * factor, send_bwd=v.send_bwd * factor, recv_bwd=v.recv_bwd * factor,
                        refresh=v.refresh * factor, ship_basis=v.ship_basis * factor) for m, v in c.codec.items()}
    return replace(c, compute=compute, codec=codec)


def _dp_of(mode: str, dp_every: int) -> dict:
    return mode_config(mode, 2, 1, dp_every)["dp"]


def measure_costs(dims: ModelDims, shape: Shape, stages: int, replicas: int, device: Device, mfu: float | None, dp_every: int, names: Names = Names()) -> Costs:
    """Compute (measured or from FLOPs), codec cost (measured) and message sizes of every mode."""
    if stages < 2:
        raise ConfigError("--stages", stages, "must be >= 2 (a pipeline needs a link)")
    if stages > dims.layers:
        raise ConfigError("--stages", stages, f"must be <= the model's {dims.layers} layers")
    compute = measure_cpu_compute(dims, shape, stages) if device.peak_tflops is None else gpu_compute(dims, shape, stages, device, mfu)
    codecs = {"dense": "dense", "lowrank": "masked"}
    measured = {k: measure_codec(m, dims, shape, names) for k, m in codecs.items()}
    codec = {m: measured["dense" if _mask_cfg(m).scheme == "mask" else "lowrank"] for m in MODES}
    sizes = {m: message_bytes(m, dims, shape, names=names) for m in MODES}
    return Costs(dims, shape, stages, replicas, compute, codec, sizes, device, mfu, dp_every)


def _tasks(c: Costs, mode: str) -> Tasks:
    K, R, M = c.stages, c.replicas, c.shape.micro_batches
    cc, mb = c.codec[mode], c.bytes[mode]
    refresh = _mask_cfg(mode).basis_refresh
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
    return Tasks(fwd, bwd, list(c.compute.opt), [act_wire] * (K - 1), [f.wire(mb.gradient)] * (K - 1),
                 [f.acks(mb.activation) * act_app / mb.activation] * (K - 1), [f.acks(mb.gradient)] * (K - 1))


def project_mode(c: Costs, mode: str, bandwidth_mbit: float | None, burst_bytes: float = 0.0, shared_cores: float | None = None, queue_s: float = 0.0) -> dict:
    """One mode's prediction at `bandwidth_mbit` (None: unshaped links; compute_bound always is)."""
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
    up = [M * ((tasks.act_wire[s] + tasks.grad_ack[s] if s < K - 1 else 0.0) + (tasks.grad_wire[s - 1] + tasks.act_ack[s - 1] if s > 0 else 0.0)) for s in range(K)]
    if bandwidth_mbit is None:
        link_s = dp_s = 0.0
        rate = None
    else:
        rate = bandwidth_mbit * 1e6 / 8
        link_s = max(up) / rate
        dp_s = max(dp_wire_step) / rate
    bound_s = max(compute_s, link_s + dp_s)
    bound = "compute" if compute_s >= link_s + dp_s else ("dp" if dp_s > link_s else "link")

    def run(rate_pp: float | None) -> Schedule:
        return simulate(tasks, K, R, M, c.shape.tokens, rate_pp, burst_bytes, shared_cores, queue_s)

    if rate is None or dp_s == 0.0:
        kept = run(rate)
    else:  # DP takes dp_wire / step_s of every link: find the step time T = sim(rate - dp/T)
        dp_bps = max(dp_wire_step)
        lo = max(run(rate).step_s, dp_bps / rate * (1 + 1e-9))
        hi = max(2 * lo, bound_s)
        while run(rate - dp_bps / hi).step_s > hi:
            hi *= 2
        for _ in range(40):
            mid = (lo + hi) / 2
            if run(rate - dp_bps / mid).step_s > mid:
                lo = mid
            else:
                hi = mid
            if hi - lo < 1e-4 * hi:
                break
        kept = Schedule(hi, tokens_step / hi)
    # the app: rounds run in the background and never hold a step back. While DP's share at its
    # cadence stays under half the link it keeps the cadence (= kept); beyond, the two TCP flows
    # split the link (PP sees rate / 2 while both send) and rounds come as often as the rest of
    # the link carries them
    app, every, app_bound = kept, float(dp["inner_steps"]), bound
    if rate is not None and dp_s > 0.0 and rate - max(dp_wire_step) / kept.step_s < rate / 2:
        app = run(rate / 2)
        pp_rate = max(up) / app.step_s
        dp_rate = max(rate - pp_rate, 1e-9)
        every = max(every, max(dp_wire_step) * dp["inner_steps"] / (dp_rate * app.step_s))
        app_bound = "dp" if max(up) / (rate / 2) > compute_s else "compute"
    pp_app = M * R * (K - 1) * (c.bytes[mode].activation + c.bytes[mode].gradient + (R * c.bytes[mode].basis / (_mask_cfg(mode).basis_refresh * M) if c.bytes[mode].basis else 0.0))
    pp_wire = M * R * (K - 1) * (tasks.act_wire[0] + tasks.grad_wire[0] + tasks.act_ack[0] + tasks.grad_ack[0])
    dp_app = R * sum(dp_app_step)
    slow = dp["inner_steps"] / every  # DP bytes per step at the achieved cadence, relative to the configured one
    return {
        "tokens_per_s": app.tokens_per_s,
        "bound": app_bound,
        "dp_every_achieved": every if dp_s > 0.0 else None,
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
        "dp": dp,
        "task_s": {"fwd": tasks.fwd, "bwd": tasks.bwd, "step": tasks.step},
    }


def project(costs: Costs, bandwidth_mbit: float, modes: tuple[str, ...] = MODES, burst_bytes: float = 0.0, shared_cores: float | None = None, queue_s: float = 0.0) -> dict:
    """The JSON of `bench project` for measured/derived `costs` at one bandwidth."""
    c = costs
    out = {m: project_mode(c, m, bandwidth_mbit, burst_bytes, shared_cores, queue_s) for m in modes}
    codec = {k: asdict(v) for k, v in {"dense": c.codec["dense"], "lowrank": c.codec["masked"]}.items()}
    return {
        "modes": out,
        "setup": {
            "model": {**asdict(c.dims), "params": c.dims.params(), "stage_params": [c.dims.stage_params(s, c.stages) for s in range(c.stages)]},
            "device": asdict(c.device),
            "mfu": c.mfu,
            "bandwidth_mbit": bandwidth_mbit,
            "stages": c.stages,
            "replicas": c.replicas,
            "micro_batch": asdict(c.shape),
            "dp_every": c.dp_every,
            "compute": {"fwd_s": c.compute.fwd, "bwd_s": c.compute.bwd, "optimizer_s": c.compute.opt, "how": c.compute.how},
            "codec_s": codec,
            "message_bytes": {m: asdict(b) for m, b in c.bytes.items()},
            "framing": asdict(c.framing),
            "shared_cores": shared_cores,
            "queue_s": queue_s,
            "burst_bytes": burst_bytes,
            "model_doc": "peer/bench/project.py (module docstring); docs/benchmarks.md, Projection",
        },
    }


def check_args(device: str, bandwidth_mbit: float, stages: int, replicas: int, mfu: float | None, dp_every: int, shared_cores: int | None = None) -> Device:
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
    return DEVICES[device]


GPU_RUNS = Path(__file__).resolve().parents[2] / "docs"  # `anchormesh bench gpu` results: gpu-bench-<device>.json


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
        raise ConfigError("--mfu-from", str(path), f"not an `anchormesh bench gpu` result with a bf16 precision row ({exc})") from None
    if run.get("shape") != "llama-3.2-1b":
        raise ConfigError("--mfu-from", str(path), f"measured on shape {run.get('shape')!r}; the MFU is taken from the llama-3.2-1b shape")
    dims = KNOWN_MODELS["llama-3.2-1b"]
    flops = 6 * dims.layer_params() * dims.layers + 12 * dims.hidden * seq_len * dims.layers + 6 * dims.vocab * dims.hidden
    mfu = tokens_per_s * flops / (device.peak_tflops * 1e12)
    return min(mfu, 1.0), f"measured by `anchormesh bench gpu` on {run.get('device_name', '?')} ({path}): {tokens_per_s:,.0f} bf16 tokens/s"


def run_project(model: str, device: str, bandwidth_mbit: float, stages: int = 2, replicas: int = 2, mfu: float | None = None, dp_every: int = 10,
                shared_cores: int | None = None, burst_kb: float = 0.0, mfu_from: Path | None = None) -> dict:
    """`anchormesh bench project`: resolve, measure, project (see the module docstring). A GPU's
    MFU is `--mfu`, else what a `bench gpu` run on that device measured (`--mfu-from`, or
    docs/gpu-bench-<device>.json when it exists), else 40%."""
    dev = check_args(device, bandwidth_mbit, stages, replicas, mfu, dp_every, shared_cores)
    dims, shape, source = resolve_model(model, stages)
    if stages > dims.layers:
        raise ConfigError("--stages", stages, f"must be <= the model's {dims.layers} layers")
    mfu_source = "--mfu" if mfu is not None else None
    if dev.peak_tflops is not None and mfu is None:
        found = mfu_from or (GPU_RUNS / f"gpu-bench-{dev.name}.json")
        if mfu_from is not None or found.exists():
            mfu, mfu_source = mfu_from_gpu_run(found, dev)
        else:
            mfu, mfu_source = DEFAULT_MFU, "assumed (no `anchormesh bench gpu` run on this device)"
    costs = measure_costs(dims, shape, stages, replicas, dev, mfu, dp_every)
    out = project(costs, bandwidth_mbit, burst_bytes=burst_kb * 1024, shared_cores=shared_cores)
    out["setup"]["mfu_source"] = mfu_source
    out["setup"]["model_source"] = source
    out["setup"]["measured_on"] = {"cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    return out


def main_json(path: Path | None, **kwargs) -> dict:
    from peer.bench import emit_json

    return emit_json(run_project(**kwargs), path)


