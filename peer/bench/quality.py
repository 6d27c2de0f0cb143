"""`anchormesh bench quality`: does masked pipeline training reach the loss of dense training?

Two kinds of base model. By default one small model is "pretrained" on corpus A (general prose)
inside the benchmark and cached. With `--model` (a hub id, a folder, a `.gguf` file, or
`smollm2-135m`) the real pretrained model is the base, with its own tokenizer: domain adaptation
of what practitioners actually adapt. Either way every row adapts a copy of the base on corpus B
(Python source) with the same token budget, the same data order and the same seed, through the
local pipeline runner. Eval losses are dense (unmasked) forward passes of the trained stages on
held-out B and held-out A (forgetting): what the exported model would score. Nothing here is
tuned to pass: it reports what it measures.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm import tqdm

from peer.bench.project_model import Shape
from peer.bench.quality_clock import MODELLED_SEQ, equal_wall_clock, long_sequence_bytes, model_dims
from peer.bench.quality_rows import QualitySetup, rows
from peer.config import TINY_MODEL_PREFIX, ComputeConfig, ModelConfig, OptimConfig, TrainConfig
from peer.data import TokenStream, default_corpus, read_path
from peer.errors import ConfigError
from peer.model.loading import load_causal_lm, resolve_dims
from peer.model.placement import CPU_FP32, DTYPE_NAMES, Placement, resolve_placement
from peer.model.source import load_tokenizer
from peer.model.stages import lm_loss
from peer.pipeline.local import LocalPipelineRunner, evaluate_stages

CACHE_DIR = Path(os.environ.get("ANCHORMESH_CACHE", ".anchormesh-cache"))


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


def _windows(stream: TokenStream, seed: int) -> Callable[[int, int, int], torch.Tensor]:
    """Deterministic data order: the same (step, replica, micro-batch) gives the same windows in every row."""

    def batch(step: int, replica: int, j: int, *, bs: int, T: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((seed, step, replica, j)) & 0x7FFFFFFF)
        return stream.batch(bs, T, g)

    return batch


def pretrain(setup: QualitySetup, corpus_a: TokenStream, key: str) -> dict[str, torch.Tensor]:
    """Dense single-process pretraining on corpus A; cached on disk by `key`."""
    path = CACHE_DIR / f"pretrained-{key}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    model = load_causal_lm(setup.model, seed=setup.seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=setup.pretrain_lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(setup.seed + 1)
    bs = setup.micro_batch_size * setup.micro_batches
    for step in tqdm(range(setup.pretrain_steps), desc="pretrain on corpus A", unit="step", leave=False):
        lr = setup.pretrain_lr * min(1.0, (step + 1) / 30)
        for group in opt.param_groups:
            group["lr"] = lr
        window = corpus_a.batch(bs, setup.seq_len, g)
        loss = lm_loss(model(input_ids=window[:, :-1]).logits, window[:, 1:])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
    return state


def run_row(
    name: str,
    cfg: TrainConfig,
    fresh_model: Callable[[], torch.nn.Module],
    setup: QualitySetup,
    corpus_b: TokenStream | None,
    eval_b: list,
    eval_a: list,
    curve_steps: tuple[int, ...] = (),
    placement: Placement = CPU_FP32,
    batch_fn: Callable[..., torch.Tensor] | None = None,
) -> dict:
    """Train one row and evaluate it; `curve_steps`: also evaluate on held-out B after those
    steps; `placement`: where the stages train (the GPU of `--device`); `batch_fn(step, replica,
    j, bs=, T=)`: the row's windows instead of random windows of `corpus_b`."""
    model = fresh_model()
    long_bytes = long_sequence_bytes(cfg, model_dims(model.config))
    batch = batch_fn or _windows(corpus_b, setup.seed)
    bs, T = cfg.pipeline.micro_batch_size, cfg.pipeline.seq_len
    m_dense = setup.micro_batches  # anchor batches use the dense row's micro-batch numbering space
    runner = LocalPipelineRunner(
        cfg,
        model,
        lambda step, r, j: (
            batch(step, r, j, bs=bs, T=T)
            if cfg.dp.replicas == 1
            else batch(step, 0, r * cfg.pipeline.micro_batches + j, bs=bs, T=T)
        ),
        anchor_batch_fn=lambda step, j: batch(step, 99, m_dense + j, bs=bs, T=T),
        placement=placement,
    )
    t0 = time.perf_counter()
    bar = tqdm(total=cfg.steps, desc=f"{name:>24}", unit="step", leave=False)
    losses: list[float] = []
    curve: dict[int, float] = {}

    def on_step(rep) -> None:
        losses.append(rep.loss)
        if len(losses) in curve_steps:
            curve[len(losses)] = evaluate_stages(runner.stages(0), eval_b)
        bar.update(1)
        bar.set_postfix(loss=f"{rep.loss:.3f}")

    reports = runner.run(on_step=on_step)
    bar.close()
    seconds = time.perf_counter() - t0
    runner.close()
    tokens = sum(r.tokens for r in reports)
    pp = sum(r.pp_bytes for r in reports)
    state = sum(w.state_bytes_sent for row in runner.workers for w in row)
    dp = sum(r.dp_bytes for r in reports)
    return {
        "eval_loss": evaluate_stages(runner.stages(0), eval_b),
        "eval_loss_a": evaluate_stages(runner.stages(0), eval_a),
        # measured: every serialized message that crossed a stage link in this run, at its own
        # sequence length (headers, token ids, codes, statistics, dense rows, coders and refits)
        "seq_len": T,
        "pp_bytes_per_token": pp / tokens,
        # of which codec state shipped after each refit (a basis, a coder): a fixed cost per refit
        # that a run's length amortises; the rest is what every token costs on the link
        "pp_state_bytes_per_token": state / tokens,
        "pp_stream_bytes_per_token": (pp - state) / tokens,
        # modelled, not measured: one message each way of one MODELLED_SEQ-token sequence, encoded
        # by the row's codec (no coders, headers or token ids): what a real run's length costs
        "pp_bytes_per_token_modelled": long_bytes,
        "anchor_pp_bytes_per_token": runner.anchor_bytes / tokens,
        "dp_bytes_per_step": dp / len(reports),
        "train_loss_last10": sum(losses[-10:]) / len(losses[-10:]),
        "tokens": tokens,
        "anchor_passes": runner.anchor.launched if runner.anchor else 0,
        "anchor_seconds": runner.anchor_seconds,
        "seconds": seconds,
        **({"eval_curve": curve} if curve_steps else {}),
    }


def rss_gb(pid: int | str = "self") -> float | None:
    """A process's resident memory now (Linux; this one by default), GB; None elsewhere or once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) / 1e6
    except (OSError, StopIteration, ValueError):
        return None


def tree_pss_gb(pid: int) -> float | None:
    """The proportional resident memory (Pss: shared pages split among their sharers) of a process
    and every process under it, GB (Linux); None once it has exited. Why Pss of the tree: a peer's
    forked averaging process and its p2pd count against the machine too, and summing their RSS
    would count the pages a fork shares twice."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    total, todo, seen = 0.0, [pid], False
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                total += next(int(x.split()[1]) for x in f if x.startswith("Pss:")) / 1e6
            seen = True
        except (OSError, StopIteration, ValueError):
            pass
        todo += children.get(p, [])
    return total if seen else None


def release_memory() -> None:
    """Free what the last row left (the SmolLM2 run grew to 23.7 GB by its tenth row and was
    killed, though no tensor outlives a row; each row's `rss_gb_after` shows whether this holds)."""
    from peer.model.loading import trim_host_memory

    trim_host_memory()


# what `--quick` runs unless `--rows` says otherwise: the rows issue 15 asks for (the paper's
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
# the recommended run (peer/config.py's defaults: what a run.toml naming only its model runs, the
# demo, the swarm without --config on the tiny model): built from those defaults in quality_rows.py
DEFAULT_ROW = "transform_stale1"
TASKS = ("adapt", "continual")  # domain adaptation (train on corpus B), continual pretraining (on the general text)
TOKENIZE_BYTES = 1_000_000  # corpus bytes a pretrained model's tokenizer reads per corpus (~300 k tokens of Python)


def _corpora(
    setup: QualitySetup, corpus_a: str | None, corpus_b: str | None, swap: bool = False
) -> tuple[TokenStream, TokenStream, dict]:
    """Corpus A (the other text) and B (what the rows train on) as token streams: bytes for the
    toy, the model's own tokenizer for a pretrained model. `corpus_a` / `corpus_b` are the
    general and the domain text as the user names them; adaptation trains on the domain text,
    `swap` (continual pretraining) on the general one."""
    general = (read_path(corpus_a), corpus_a) if corpus_a else default_corpus("a")
    domain = (read_path(corpus_b), corpus_b) if corpus_b else default_corpus("b")
    (data_a, src_a), (data_b, src_b) = (domain, general) if swap else (general, domain)
    info = {"corpus_a": src_a, "corpus_b": src_b, "corpus_a_bytes": len(data_a), "corpus_b_bytes": len(data_b)}
    if setup.model.name.startswith(TINY_MODEL_PREFIX):
        return TokenStream(data_a), TokenStream(data_b), {**info, "tokenizer": "bytes"}
    tok = load_tokenizer(setup.model.name)

    def ids(data: bytes) -> torch.Tensor:
        return torch.tensor(
            tok(data[:TOKENIZE_BYTES].decode("utf-8", errors="replace"), add_special_tokens=False)["input_ids"],
            dtype=torch.long,
        )

    a, b = ids(data_a), ids(data_b)
    return (
        TokenStream(a),
        TokenStream(b),
        {**info, "tokenizer": "model", "corpus_a_tokens": len(a), "corpus_b_tokens": len(b)},
    )


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
) -> dict:
    """The rows' JSON. `seed`: another data order (and, for the toy, another pretraining): a
    replicate of the same comparison, since one run's rows differ by about its own noise.
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
    setup = replace(setup_for(quick, model), seed=seed)
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
    eval_b = stream_b.eval_batches(setup.micro_batch_size, setup.seq_len, setup.eval_batches)
    eval_a = stream_a.eval_batches(setup.micro_batch_size, setup.seq_len, setup.eval_batches)
    from peer.model.stages import split_model

    base_stages = split_model(base, setup.model.num_stages)
    out = {
        "setup": {
            **asdict(setup),
            **corpora,
            "pretrain_seconds": pretrain_s,
            "eval": "dense forward of the trained stages on held-out windows",
            "threads": torch.get_num_threads(),
            "optimizer": _describe(setup.optim()),
            "task": task,
            "device": str(placement.device),
            "compute_dtype": DTYPE_NAMES[placement.compute_dtype],
            "tokens_per_step": setup.micro_batch_size * setup.micro_batches * setup.seq_len,
        },
        "pretrained": {
            "eval_loss": evaluate_stages(base_stages, eval_b),
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
        curve_steps = tuple(setup.adapt_steps * k // 8 for k in (1, 2, 4, 6)) if name == "dense" else ()
        result = run_row(
            name, cfg, lambda: copy.deepcopy(base), setup, stream_b, eval_b, eval_a, curve_steps, placement
        )
        if name == "dense":
            result["eval_curve"] = {
                0: out["pretrained"]["eval_loss"],
                **result["eval_curve"],
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
                "pp_bytes_reduction": dense["pp_bytes_per_token"]
                / r["pp_bytes_per_token"],  # measured, everything on the wire
                "pp_stream_bytes_reduction": dense["pp_stream_bytes_per_token"]
                / r["pp_stream_bytes_per_token"],  # measured, coder refits left out
                "pp_bytes_reduction_modelled": _ratio(
                    dense["pp_bytes_per_token_modelled"], r["pp_bytes_per_token_modelled"]
                ),  # at MODELLED_SEQ tokens
            }
            for name, r in out["runs"].items()
        }
    return out
