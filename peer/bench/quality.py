"""`anchormesh bench quality`: does masked pipeline training reach the loss of dense training?

Two kinds of base model. By default one small model is "pretrained" on corpus A (general prose)
inside the benchmark and cached. With `--model` (a hub id, a folder, a `.gguf` file, or
`smollm2-135m`) the real pretrained model is the base, with its own tokenizer: domain adaptation
of what practitioners actually adapt. Either way every row adapts a copy of the base on corpus B
(Python source) with the same token budget, the same data order and the same seed, through the
local pipeline runner. Eval losses are dense (unmasked) forward passes of the trained stages on
held-out B and held-out A (forgetting): what the exported model would score. Nothing here is
tuned to pass: it reports what it measures.

Where the parts live: the setups and rows in quality_rows.py; pretraining and one row's training
in quality_train.py; the equal-wall-clock model in quality_clock.py; memory in proc_memory.py.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from dataclasses import asdict, replace

import torch

from peer.bench.corpus_split import EVAL_TOKENS
from peer.bench.deficit import against_dense, curve_steps
from peer.bench.proc_memory import release_memory, rss_gb
from peer.bench.project_model import Shape
from peer.bench.quality_clock import MODELLED_SEQ, equal_wall_clock, model_dims
from peer.bench.quality_corpora import corpora
from peer.bench.quality_rows import QualitySetup, rows
from peer.bench.quality_train import pretrain, run_row
from peer.config import TINY_MODEL_PREFIX, ComputeConfig, ModelConfig, OptimConfig
from peer.data import TokenStream
from peer.errors import ConfigError
from peer.model.loading import load_causal_lm, resolve_dims
from peer.model.placement import DTYPE_NAMES, resolve_placement
from peer.model.source import load_tokenizer
from peer.pipeline.local import evaluate_stages


def setup_for(quick: bool, model: str | None = None) -> QualitySetup:
    """The toy setup (a model pretrained here), or with `model` a pretrained model's.

    A pretrained model is adapted as practitioners adapt one: AdamW at a constant lr of 1e-4
    (betas 0.9/0.95, clip 1.0; the swarm has no lr schedule), no pretraining here, 2 stages cut
    at the middle layer, the low-rank codec at rank 64 (what the boundary probes measured).
    `quick` fits 2 CPU cores in 30 minutes (40 steps of 512 tokens per row); the full run is
    for a GPU (300 steps of 2048 tokens)."""
    if model and not model.startswith(TINY_MODEL_PREFIX):
        dims = resolve_dims(ModelConfig(name=model, num_stages=2, max_seq_len=256))
        if quick:
            return QualitySetup(
                dims, 0, 40, 4, 2, 64, 0.0, 1e-4, 8, anchor_every=10, lowrank_rank=min(64, dims.hidden_size // 2)
            )
        return QualitySetup(
            dims, 0, 300, 8, 1, 256, 0.0, 1e-4, 32, anchor_every=20, lowrank_rank=min(64, dims.hidden_size // 2)
        )
    if quick:
        return QualitySetup(
            ModelConfig(hidden_size=128, num_layers=4, num_heads=4, max_seq_len=128), 300, 120, 8, 2, 128, 3e-3, 1e-3, 8
        )
    return QualitySetup(
        ModelConfig(hidden_size=192, num_layers=6, num_heads=6, max_seq_len=256), 1200, 400, 8, 4, 256, 2e-3, 6e-4, 32
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt_bytes(b: float | None) -> str:
    return "-" if b is None else f"{b:.1f}"


def _describe(o: OptimConfig) -> str:
    """The adaptation's optimizer in words, for OUT's setup."""
    sched = (
        "constant"
        if o.schedule == "constant"
        else f"{o.schedule} to {o.min_lr_ratio:g} x lr at step {o.decay_steps}, warmup {o.warmup_steps} steps"
    )
    return f"AdamW lr {o.lr:g} {sched} (betas {o.beta1:g}/{o.beta2:g}, clip {o.grad_clip:g}, no weight decay)"


# what `--quick` runs unless `--rows` says otherwise: the comparison's core rows (the paper's
# rows, the former codec, the default codec with and without anchors, compressed DP) and the
# default run's row. The other rows are explorations; with a pretrained model every row takes
# 2.5-6 minutes on 2 cores; the eight took about 25 (docs/results/quality-smollm2-135m-rows.json).
QUICK_ROWS = (
    "dense",
    "masked",
    "masked_anchor",
    "lowrank",
    "transform",
    "transform_anchor",
    "transform_dp",
    "transform_stale1",
)
# the recommended run (peer/config's defaults: what a run.toml naming only its model runs, the
# demo, the swarm without --config on the tiny model): built from those defaults in quality_rows.py
DEFAULT_ROW = "transform_stale1"
TASKS = ("adapt", "continual")  # domain adaptation (train on corpus B), continual pretraining (on the general text)


def _corpora(
    setup: QualitySetup, corpus_a: str | None, corpus_b: str | None, swap: bool = False
) -> tuple[TokenStream, TokenStream, dict]:
    """Corpus A (the other text) and B (what the rows train on), cut by document: bytes for the
    toy, the model's own tokenizer for a pretrained model (peer/bench/quality_corpora.py).
    `swap` (continual pretraining): the rows train on the general text."""
    if setup.model.name.startswith(TINY_MODEL_PREFIX):
        tokenize, how = (lambda text: list(text.encode())), "bytes"
    else:
        tok = load_tokenizer(setup.model.name)
        tokenize, how = (lambda text: tok(text, add_special_tokens=False)["input_ids"]), "model"
    # the held-out documents are the same whatever the run's seed: a confirmation document must
    # never have been an eval document that chose a setting in another seed's run
    a, b, info = corpora(tokenize, corpus_a, corpus_b, SPLIT_SEED, swap, pretrains_on_a=setup.pretrain_steps > 0)
    return a, b, {**info, "tokenizer": how, "corpus_a_tokens": len(a.train), "corpus_b_tokens": len(b.train)}


SPLIT_SEED = 0


def eval_windows(setup: QualitySetup) -> int:
    """Eval batches per pass: the setup's, and at least enough for the held-out sets' tokens."""
    per_batch = setup.micro_batch_size * (setup.seq_len + 1)
    return max(setup.eval_batches, -(-EVAL_TOKENS // per_batch))


def scaled_setup(setup: QualitySetup, steps: int | None, tokens_per_step: int | None) -> QualitySetup:
    """The setup run for `steps` steps of `tokens_per_step` tokens (micro-batches accumulated at
    the setup's micro-batch size and sequence length); ConfigError naming the flag and what is
    allowed, before anything loads."""
    if steps is not None:
        if steps < 8:
            raise ConfigError("--steps", steps, "must be >= 8 (the eval curve needs points before the end)")
        setup = replace(setup, adapt_steps=steps)
    if tokens_per_step is not None:
        per_micro = setup.micro_batch_size * setup.seq_len
        if tokens_per_step < 2 * per_micro or tokens_per_step % per_micro:
            raise ConfigError(
                "--tokens-per-step",
                tokens_per_step,
                f"must be a multiple of {per_micro} (micro-batch {setup.micro_batch_size} x {setup.seq_len} tokens), "
                f"at least {2 * per_micro} (the DP rows split a step's micro-batches over 2 replicas)",
            )
        setup = replace(setup, micro_batches=tokens_per_step // per_micro)
    return setup


def chosen_rows(quick: bool, only: list[str] | None) -> list[str] | None:
    """The rows to run (None: all): `--rows` as given, `all`, or `QUICK_ROWS` for `--quick`."""
    if only == ["all"] or (only is None and not quick):
        return None
    return only if only is not None else list(QUICK_ROWS)


def run_quality(
    quick: bool,
    corpus_a: str | None,
    corpus_b: str | None,
    only: list[str] | None = None,
    model: str | None = None,
    seed: int = 0,
    lr: float | None = None,
    schedule: str | None = None,
    device: str = "cpu",
    task: str = "adapt",
    steps: int | None = None,
    tokens_per_step: int | None = None,
    codec_seed: int | None = None,
) -> dict:
    """The rows' JSON. `seed`: another data order, other codec draws (rotations, dither, masks;
    `codec_seed` sets them apart) and, for the toy, another pretraining: a replicate of the same
    comparison, since one run's rows differ by about its own noise. `steps`, `tokens_per_step`:
    a longer run, or more tokens a step by accumulating micro-batches (as the swarm does).
    `lr`, `schedule`: the adaptation's peak lr and lr schedule instead of the setup's.
    `device`: where the rows train (`--device`: auto takes a visible GPU, in bf16 as a peer's
    `compute.dtype = "auto"` does; the toy's pretraining stays on the CPU).
    `task`: "adapt" (train on corpus B, the domain; held-out A, general text, measures
    forgetting) or "continual" (continual pretraining: the corpora swap roles, so the rows train
    on the general text, `eval_loss` is its held-out part and `eval_loss_a` the domain's)."""
    if task not in TASKS:
        raise ConfigError("--task", task, f"must be one of {', '.join(TASKS)}")
    if task == "continual" and (not model or model.startswith(TINY_MODEL_PREFIX)):
        raise ConfigError(
            "--task",
            task,
            "continual pretraining needs a pretrained model (--model NAME): the toy is pretrained here on the general text itself",
        )
    placement = resolve_placement(device, ComputeConfig())  # a bad --device exits here, before the model loads
    setup = scaled_setup(replace(setup_for(quick, model), seed=seed, codec_seed=codec_seed), steps, tokens_per_step)
    setup = replace(setup, adapt_lr=setup.adapt_lr if lr is None else lr, schedule=schedule or setup.schedule)
    setup.optim()  # a bad --lr or --schedule exits here, before the model loads
    table, only = rows(setup), chosen_rows(quick, only)
    unknown = sorted(set(only or ()) - set(table))
    if unknown:  # before the model loads
        raise ConfigError(
            "--rows",
            ",".join(only or ()),
            f"unknown row(s) {', '.join(unknown)}; the rows are {', '.join(table)} (or all)",
        )
    stream_a, stream_b, corpora = _corpora(setup, corpus_a, corpus_b, swap=task == "continual")
    t0 = time.perf_counter()
    if setup.pretrain_steps:  # the toy: pretrained here on corpus A, cached
        pre = {
            k: v
            for k, v in asdict(setup).items()
            if k in ("model", "pretrain_steps", "micro_batch_size", "micro_batches", "seq_len", "pretrain_lr", "seed")
        }
        key = hashlib.sha256(
            json.dumps(pre, sort_keys=True).encode() + hashlib.sha256(stream_a.train.numpy().tobytes()).digest()
        ).hexdigest()[:16]
        base_state = pretrain(setup, stream_a, key)
        base = load_causal_lm(setup.model, seed=setup.seed)
        base.load_state_dict(base_state)
    else:  # a real pretrained model: the base as loaded
        base = load_causal_lm(setup.model, seed=setup.seed)
    pretrain_s = time.perf_counter() - t0
    n_eval = eval_windows(setup)
    eval_b = stream_b.eval_batches(setup.micro_batch_size, setup.seq_len, n_eval)
    confirm_b = stream_b.eval_batches(setup.micro_batch_size, setup.seq_len, n_eval, split="confirm")
    eval_a = stream_a.eval_batches(setup.micro_batch_size, setup.seq_len, n_eval)
    from peer.model.stages import split_model

    base_stages = split_model(base, setup.model.num_stages)
    out = {
        "setup": {
            **asdict(setup),
            **corpora,
            "pretrain_seconds": pretrain_s,
            "eval": "dense forward of the trained stages on held-out windows of whole held-out documents",
            "eval_tokens": sum(int(x.numel()) for x in eval_b),
            "confirm_tokens": sum(int(x.numel()) for x in confirm_b),
            "threads": torch.get_num_threads(),
            "optimizer": _describe(setup.optim()),
            "task": task,
            "device": str(placement.device),
            "compute_dtype": DTYPE_NAMES[placement.compute_dtype],
            "tokens_per_step": setup.micro_batch_size * setup.micro_batches * setup.seq_len,
        },
        "pretrained": {
            "eval_loss": evaluate_stages(base_stages, eval_b),
            "confirm_loss": evaluate_stages(base_stages, confirm_b),
            "eval_loss_a": evaluate_stages(base_stages, eval_a),
        },
        "default_row": DEFAULT_ROW,
        "runs": {},
    }
    del base_stages
    out["setup"]["rows"] = list(only or table)
    for name, cfg in table.items():
        if only and name not in only:
            continue
        points = curve_steps(setup.adapt_steps, dense=name == "dense")
        result = run_row(
            name,
            cfg,
            lambda: copy.deepcopy(base),
            setup,
            stream_b,
            eval_b,
            eval_a,
            points,
            placement,
            confirm=confirm_b,
        )
        result["eval_curve"] = {
            0: out["pretrained"]["eval_loss"],
            **result.get("eval_curve", {}),
            setup.adapt_steps: result["eval_loss"],
        }
        release_memory()
        result["rss_gb_after"] = rss_gb()
        out["runs"][name] = result
        print(
            f"{name:>24}: eval_loss {result['eval_loss']:.4f}  eval_loss_a {result['eval_loss_a']:.4f}  pp B/token measured {result['pp_bytes_per_token']:.1f} at {result['seq_len']} tokens (stream {result['pp_stream_bytes_per_token']:.1f}); at {MODELLED_SEQ} tokens {_fmt_bytes(result['pp_bytes_per_token_modelled'])} modelled)  dp B/step {result['dp_bytes_per_step']:.0f}  {result['seconds']:.1f}s",
            flush=True,
        )
    dense = out["runs"].get("dense")
    if dense:
        shape = Shape(setup.micro_batch_size, setup.seq_len, setup.micro_batches)
        out["equal_wall_clock"] = equal_wall_clock(
            out["runs"], model_dims(base.config), shape, setup.model.num_stages, setup.adapt_steps
        )
        out["vs_dense"] = {
            name: {
                "eval_loss_ratio": r["eval_loss"] / dense["eval_loss"],
                "confirm_loss_ratio": r["confirm_loss"] / dense["confirm_loss"],  # the split claims are made on
                "pp_bytes_reduction": dense["pp_bytes_per_token"]
                / r["pp_bytes_per_token"],  # measured, everything on the wire
                "pp_stream_bytes_reduction": dense["pp_stream_bytes_per_token"]
                / r["pp_stream_bytes_per_token"],  # measured, coder refits left out
                "pp_bytes_reduction_modelled": _ratio(
                    dense["pp_bytes_per_token_modelled"], r["pp_bytes_per_token_modelled"]
                ),  # at MODELLED_SEQ tokens
                **against_dense(dense["eval_curve"], r["eval_curve"], setup.adapt_steps),
            }
            for name, r in out["runs"].items()
        }
    return out
