"""What `bench project` projects for: the devices (peak FLOP/s, memory bandwidth), a model's
dimensions (published, tiny, a local folder or a run.toml) and the pipeline's micro-batch shape.
See peer/bench/project.py for the projection these feed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from peer.bench.throughput_modes import GpuScenario, mode_config
from peer.errors import ConfigError


@dataclass(frozen=True)
class Device:
    """Where a stage computes. peak_tflops None = measured here (the CPU)."""

    name: str
    label: str
    peak_tflops: float | None
    mem_gbps: float | None
    source: str


DEVICES: dict[str, Device] = {
    "rtx4090": Device(
        "rtx4090",
        GpuScenario.gpu,
        GpuScenario.peak_tflops,
        1008.0,
        "NVIDIA Ada whitepaper: 165.2 TFLOP/s dense bf16 (fp32 accumulate), 1008 GB/s",
    ),
    "a100": Device("a100", "A100 80GB SXM", 312.0, 2039.0, "NVIDIA A100 datasheet: 312 TFLOP/s dense bf16, 2039 GB/s"),
    "h100": Device("h100", "H100 SXM", 989.4, 3350.0, "NVIDIA H100 datasheet: 989.4 TFLOP/s dense bf16, 3.35 TB/s"),
    "h200": Device(
        "h200",
        "H200 SXM",
        989.4,
        4800.0,
        "NVIDIA H200 datasheet: 989 TFLOP/s dense bf16 (the H100's tensor cores), 4.8 TB/s",
    ),
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
        return (
            self.embed_params()
            + self.layers * self.layer_params()
            + self.head_params()
            - (self.vocab * self.hidden if self.tied else 0)
        )

    def stage_params(self, index: int, stages: int) -> int:
        from peer.model.stages import layer_ranges

        a, b = layer_ranges(self.layers, stages)[index]
        return (
            (b - a) * self.layer_params()
            + (self.embed_params() if index == 0 else 0)
            + (self.head_params() if index == stages - 1 else 0)
        )


_HF = "the model's config.json on the Hugging Face hub"
KNOWN_MODELS: dict[str, ModelDims] = {
    "llama-3.2-1b": ModelDims("Llama-3.2-1B", "llama", 2048, 16, 32, 8, 8192, 128256, True, source=_HF),
    "llama-3.2-3b": ModelDims("Llama-3.2-3B", "llama", 3072, 28, 24, 8, 8192, 128256, True, source=_HF),
    "llama-3.1-8b": ModelDims("Llama-3.1-8B", "llama", 4096, 32, 32, 8, 14336, 128256, False, source=_HF),
    "qwen2.5-0.5b": ModelDims("Qwen2.5-0.5B", "qwen2", 896, 24, 14, 2, 4864, 151936, True, qkv_bias=True, source=_HF),
    "qwen2.5-1.5b": ModelDims("Qwen2.5-1.5B", "qwen2", 1536, 28, 12, 2, 8960, 151936, True, qkv_bias=True, source=_HF),
}


@dataclass(frozen=True)
class Shape:
    """The pipeline's micro-batch: B sequences of T tokens, M micro-batches per optimizer step,
    and how many steps stage 0 may run ahead of the gradients it applied (`pipeline.max_staleness`:
    0 drains the pipeline every step)."""

    micro_batch_size: int
    seq_len: int
    micro_batches: int
    max_staleness: int = 0

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.seq_len


def _bench_pipeline() -> dict:
    return mode_config("dense", 2, 1, 1)["pipeline"]


def _tiny_dims(name: str, hidden: int, layers: int, heads: int, max_seq_len: int) -> ModelDims:
    from peer.config import ModelConfig
    from peer.model.loading import TINY_PREFIX, tiny_config

    family = name[len(TINY_PREFIX) :]
    c = tiny_config(
        family,
        ModelConfig(
            name=name, num_stages=1, hidden_size=hidden, num_layers=layers, num_heads=heads, max_seq_len=max_seq_len
        ),
    )
    if family == "gpt2":
        return ModelDims(
            name,
            "gpt2",
            c.n_embd,
            c.n_layer,
            c.n_head,
            c.n_head,
            4 * c.n_embd,
            c.vocab_size,
            False,
            max_positions=c.n_positions,
            source="built from a config (peer/model/loading.py)",
        )
    return ModelDims(
        name,
        family,
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.intermediate_size,
        c.vocab_size,
        bool(c.tie_word_embeddings),
        qkv_bias=family == "qwen2",
        source="built from a config (peer/model/loading.py)",
    )


def dims_of_config(c, name: str, source: str) -> ModelDims:
    """Dims of a transformers config object (a loaded model's `.config`, or one read from disk)."""
    if c.model_type == "gpt2":
        return ModelDims(
            name,
            "gpt2",
            c.n_embd,
            c.n_layer,
            c.n_head,
            c.n_head,
            c.n_inner or 4 * c.n_embd,
            c.vocab_size,
            bool(c.tie_word_embeddings),
            max_positions=c.n_positions,
            source=source,
        )
    return ModelDims(
        name,
        c.model_type,
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        c.intermediate_size,
        c.vocab_size,
        bool(c.tie_word_embeddings),
        qkv_bias=c.model_type == "qwen2",
        source=source,
    )


def _hf_dims(path: str) -> ModelDims:
    """Dims of a local Hugging Face model folder (config.json only; nothing is downloaded)."""
    from transformers import AutoConfig

    return dims_of_config(AutoConfig.from_pretrained(path, local_files_only=True), path, f"{path}/config.json")


def _named_dims(name: str, stages: int) -> ModelDims:
    key = name.lower().rsplit("/", 1)[-1]
    if key in KNOWN_MODELS:
        return KNOWN_MODELS[key]
    if name.startswith("tiny-"):
        cfg = mode_config("dense", stages, 1, 1)["model"]  # the bench's tiny model: 2 layers per stage
        return _tiny_dims(name, cfg["hidden_size"], cfg["num_layers"], cfg["num_heads"], cfg["max_seq_len"])
    if Path(name).is_dir() and (Path(name) / "config.json").exists():
        return _hf_dims(name)
    raise ConfigError(
        "--model",
        name,
        f"unknown model: give a run.toml, a local model folder or one of tiny-llama, {', '.join(k for k in KNOWN_MODELS)}",
    )


def resolve_model(spec: str, stages: int) -> tuple[ModelDims, Shape, str]:
    """(dims, micro-batch shape, what it came from) for a run.toml path or a model name.

    Shapes: a run.toml's [pipeline]; the bench's (8 x 128, M = 2) for tiny models; 4 x 2048,
    M = 2 for the published models (2048 as in throughput.py's GPU scenario)."""
    if spec.endswith(".toml"):
        from peer.runtoml import load_run_toml

        if not Path(spec).is_file():
            raise ConfigError("--model", spec, "no such run.toml")
        cfg = load_run_toml(spec)
        m = cfg.model
        if m.name.startswith("tiny-"):
            dims = _tiny_dims(m.name, m.hidden_size, m.num_layers, m.num_heads, m.max_seq_len)
        else:
            dims = _named_dims(m.name, stages)
        p = cfg.pipeline
        return dims, Shape(p.micro_batch_size, p.seq_len, p.micro_batches, p.max_staleness), f"run.toml {spec}"
    dims = _named_dims(spec, stages)
    if spec.startswith("tiny-"):
        p = _bench_pipeline()
        return (
            dims,
            Shape(p["micro_batch_size"], p["seq_len"], p["micro_batches"]),
            "the throughput bench's tiny model and pipeline",
        )
    return dims, Shape(4, GpuScenario.seq_len, 2), "published dims; pipeline 4 x 2048, 2 micro-batches"
