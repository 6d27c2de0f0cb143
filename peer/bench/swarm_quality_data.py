"""The data `anchormesh bench swarm-quality` trains on (peer/bench/swarm_quality.py): the corpus
prepared once (`data prepare`), and the in-process rows' windows drawn from it in the order the
swarms' tracker hands them out.

Why a module of its own: the bench's claim rests on both sides training on the same windows;
that is this module's one job.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

from bootstrap.data_order import DataOrder
from peer.bench.quality_rows import QualitySetup
from peer.config import TINY_MODEL_PREFIX
from peer.dataset.shards import PreparedData

CORPUS_BYTES = 3_000_000  # text prepared per task: ~900 k tokens of Python with SmolLM2's tokenizer, ~150 files
HELDOUT_FRACTION = 0.08  # of the documents, each for the eval and the confirmation split: ~12 whole files each


def default_source(task: str) -> str:
    """The text each task trains on when `--corpus` is not given: this Python's standard library
    (Python source: the adaptation domain), or the licence texts (general prose)."""
    if task == "adapt":
        return str(Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}")
    return "/usr/share/common-licenses"


def tokenizer_of(model: str) -> str:
    """What `data prepare` calls the model's tokenizer: bytes for the tiny models (as their runs read)."""
    return "bytes" if model.startswith(TINY_MODEL_PREFIX) else model


def prepare_data(folder: Path, model: str, source: str, seq_len: int) -> PreparedData:
    """The corpus tokenized once with the model's tokenizer: eval and confirmation documents held out."""
    from peer.dataset.prepare import prepare

    prepare(
        source,
        tokenizer_of(model),
        folder,
        force=True,
        max_bytes=CORPUS_BYTES,
        show_progress=False,
        eval_fraction=HELDOUT_FRACTION,
        confirm_fraction=HELDOUT_FRACTION,
        min_heldout_tokens=16 * (seq_len + 1),
    )
    return PreparedData(folder, tokenizer=tokenizer_of(model))


def window_batches(data: PreparedData, setup: QualitySetup) -> Callable[..., torch.Tensor]:
    """`run_row`'s batch function over the prepared training windows: micro-batch j of step s
    (in the synchronous rows' numbering, which the DP rows share) takes the next `bs` windows of
    one seeded permutation, so every row trains on the same windows, each at most once; anchor
    passes (replica 99) read from the permutation's far end. The permutation is the tracker's
    first epoch (bootstrap/data_order.py), so the rows train on the windows the swarms train on."""
    windows = data.windows(setup.seq_len)
    order = DataOrder(windows.count, setup.seq_len, seed=setup.seed, shard_ends=windows.shard_ends).permutation(0)
    m = setup.micro_batches

    def batch(step: int, replica: int, j: int, *, bs: int, T: int) -> torch.Tensor:
        if T != setup.seq_len:
            raise ValueError(f"seq_len {T}: the prepared windows are {setup.seq_len} tokens")
        first = (step * m + j) * bs if replica != 99 else windows.count - (step * m + j + 1) * bs
        if not 0 <= first <= windows.count - bs:
            raise ValueError(f"the prepared data holds {windows.count} windows; step {step} needs more")
        return torch.from_numpy(windows.batch([int(i) for i in order[first : first + bs]]))

    return batch
