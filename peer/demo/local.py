"""`anchormesh demo --local`: the tiny default run trained in local pipeline stages, with live progress.

This is the training core on one machine (no network): stage workers exchange coded
activations and gradients as serialized wire messages and each stage's optimizer steps, as in
the swarm's default run. The progress bar shows loss, tokens/s and the bytes per token that
crossed the pipeline link, next to what dense fp16 transfer would cost.
"""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

from peer.config import MaskConfig, TrainConfig
from peer.data import TokenStream, default_corpus
from peer.model.loading import load_causal_lm
from peer.pipeline.codecs import codec_class
from peer.pipeline.local import LocalPipelineRunner, evaluate_stages
from peer.runtoml import resolve_run


def demo_config(stages: int, codec: str, drop: float, rank: int) -> TrainConfig:
    """The demo's run: the recommended run on the tiny model (what `anchormesh bootstrap` runs
    without --config), cut in `stages`, with the low-rank codec or the paper's element mask
    instead of the transform codec when asked."""
    cfg = resolve_run({"model": {"num_stages": stages}}).config
    if codec == "lowrank":
        cfg.mask = MaskConfig(scheme="lowrank", rank=rank, values="int8")
    elif codec == "mask":
        cfg.mask = MaskConfig(scheme="mask", drop=drop, fill="prior_rescale")
    cfg.steps = 10**9  # until the clock runs out
    return cfg


def codec_label(cfg: TrainConfig) -> str:
    return codec_class(cfg.mask.scheme).label(cfg.mask)


def run_demo(
    seconds: float = 60.0,
    stages: int = 2,
    codec: str = "transform",
    drop: float = 0.95,
    rank: int = 20,
    threads: int = 0,
) -> dict:
    if threads:
        torch.set_num_threads(threads)
    cfg = demo_config(stages, codec, drop, rank)
    data, source = default_corpus("b")
    stream = TokenStream(data)
    gen = torch.Generator().manual_seed(0)
    p = cfg.pipeline
    print(
        f"anchormesh demo: tiny-llama ({cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}) in {stages} pipeline stages, "
        f"PP codec {codec_label(cfg)}, {f'anchor every {cfg.anchor.every} steps' if cfg.anchor.every else 'anchors off'}; corpus: {source.split(',')[0]}… ({len(data) / 1e6:.1f} MB)"
    )
    runner = LocalPipelineRunner(
        cfg, load_causal_lm(cfg.model), lambda step, r, j: stream.batch(p.micro_batch_size, p.seq_len, gen)
    )
    eval_batches = stream.eval_batches(p.micro_batch_size, p.seq_len, 8)
    dense_bpt = 2 * 2 * cfg.model.hidden_size * (stages - 1)  # fp16 activations + gradients, every link
    start_eval = evaluate_stages(runner.stages(), eval_batches)
    t0 = time.perf_counter()
    tokens, first_loss, loss = 0, None, float("nan")
    bar = tqdm(total=round(seconds), unit="s", bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}s {postfix}")
    try:
        while (elapsed := time.perf_counter() - t0) < seconds:
            rep = runner.run(runner.step_count + 1)[-1]
            tokens += rep.tokens
            loss = rep.loss if first_loss is None else 0.9 * loss + 0.1 * rep.loss
            first_loss = first_loss or rep.loss
            elapsed = time.perf_counter() - t0
            bar.n = min(round(elapsed), bar.total)
            bar.set_postfix_str(
                f"step {rep.step + 1} loss {loss:.3f} {tokens / elapsed:,.0f} tok/s "
                f"PP {runner.transport.total_bytes() / tokens:.1f} B/tok (dense {dense_bpt} B/tok) anchor@{rep.anchor_step}"
            )
    except KeyboardInterrupt:
        print("\ninterrupted: summarising what ran")
    finally:
        bar.close()
        runner.close()
    elapsed = time.perf_counter() - t0
    summary = {
        "steps": runner.step_count,
        "tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "train_loss_first": first_loss,
        "train_loss_ema": loss,
        "eval_loss_before": start_eval,
        "eval_loss_after": evaluate_stages(runner.stages(), eval_batches),
        "pp_bytes_per_token": runner.transport.total_bytes() / max(tokens, 1),
        "dense_pp_bytes_per_token": dense_bpt,
        "anchor_passes": runner.anchor.launched if runner.anchor else 0,
    }
    print(
        f"summary: {summary['steps']} steps, {tokens:,} tokens in {elapsed:.0f}s ({summary['tokens_per_s']:,.0f} tok/s); "
        f"held-out loss {start_eval:.3f} -> {summary['eval_loss_after']:.3f}; "
        f"PP link {summary['pp_bytes_per_token']:.1f} B/token vs {dense_bpt} dense "
        f"({dense_bpt / summary['pp_bytes_per_token']:.1f}x less); {summary['anchor_passes']} anchor passes"
    )
    return summary
