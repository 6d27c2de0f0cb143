"""`bench quality --gpu-suite`: the quality evidence a GPU can give in about ten minutes.

Why a preset: a lent GPU is short-lived, so the run it should make is decided beforehand and
takes one command. Dense and the recommended run's row, both tasks (domain adaptation and
continual pretraining), SmolLM2-135M, 1,250 steps of 16,384 tokens (8 micro-batches of 8 x 256
accumulated): 20.5 M tokens a row, 82 M in all, scored like every `bench quality` run (held-out
documents, the confirmation split, the step deficit on dense's curve). Everything a run needs is
checked before the model loads: a CUDA device and, for continual pretraining, the prose corpus
(the device machines reach no network: carry it and pass `--corpus-a`).
"""

from __future__ import annotations

import time

from peer.bench.quality import DEFAULT_ROW, run_quality
from peer.bench.quality_corpora import check_continual, documents
from peer.config import ComputeConfig
from peer.errors import ConfigError
from peer.model.placement import resolve_placement

MODEL = "smollm2-135m"
STEPS = 1250
TOKENS_PER_STEP = 16_384  # the full setup's 8 x 256-token micro-batch, 8 of them a step
ROWS = ["dense", DEFAULT_ROW]


def check_suite(device: str, corpus_a: str | None) -> None:
    """Refuse, before anything loads, a suite this machine cannot run."""
    placement = resolve_placement(device, ComputeConfig())
    if placement.device.type != "cuda":
        raise ConfigError(
            "--gpu-suite",
            device,
            f"needs a CUDA device (it trains {4 * STEPS * TOKENS_PER_STEP:,} tokens); got {placement.device}",
        )
    check_continual(*documents("a", corpus_a))


def run_gpu_suite(device: str, corpus_a: str | None, corpus_b: str | None, seed: int = 0) -> dict:
    """Both tasks' rows, one JSON: {"suite": what ran, "adapt": ..., "continual": ...}."""
    check_suite(device, corpus_a)
    out: dict = {
        "suite": {"model": MODEL, "rows": ROWS, "steps": STEPS, "tokens_per_step": TOKENS_PER_STEP, "seed": seed}
    }
    for task in ("adapt", "continual"):
        t0 = time.perf_counter()
        out[task] = run_quality(
            False,
            corpus_a,
            corpus_b,
            list(ROWS),
            model=MODEL,
            seed=seed,
            device=device,
            task=task,
            steps=STEPS,
            tokens_per_step=TOKENS_PER_STEP,
        )
        out[task]["wall_seconds"] = time.perf_counter() - t0
    return out
