"""Training for `anchormesh bench quality` (peer/bench/quality.py): the toy base pretrained on
corpus A (cached on disk), and one row trained and evaluated through the local pipeline runner.

Why a module of its own: what a row measures (losses, bytes per token measured and modelled,
anchor work, time) is the contract both quality benches compare on; the in-process rows of
`bench swarm-quality` come from here too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from peer.bench.quality_clock import long_sequence_bytes, model_dims
from peer.bench.quality_rows import HELD_GRADIENT_ROWS, QualitySetup
from peer.config import TrainConfig
from peer.data import TokenStream
from peer.model.loading import load_causal_lm
from peer.model.placement import CPU_FP32, Placement
from peer.model.stages import lm_loss
from peer.pipeline.local import LocalPipelineRunner, evaluate_stages
from peer.pipeline.transport import Address, LocalTransport

CACHE_DIR = Path(os.environ.get("ANCHORMESH_CACHE", ".anchormesh-cache"))


def _windows(stream: TokenStream, seed: int) -> Callable[[int, int, int], torch.Tensor]:
    """Deterministic data order: the same (step, replica, micro-batch) gives the same windows in every row."""

    def batch(step: int, replica: int, j: int, *, bs: int, T: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((seed, step, replica, j)) & 0x7FFFFFFF)
        return stream.batch(bs, T, g)

    return batch


class HeldLinks(LocalTransport):
    """In-process queues whose `channels` report a link of one byte a second: an adapting sender
    (mask.adapt) sends at its floor on them from the step its compute time is known. Why: what
    a codec's floor costs in quality is measured on the run it would be, the rest unchanged."""

    def __init__(self, channels: tuple[str, ...]) -> None:
        super().__init__()
        self.channels = channels

    def link_bps(self, dst: Address, channel: str) -> float | None:
        return 1.0 if channel in self.channels else None


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
    confirm: list | None = None,
) -> dict:
    """Train one row and evaluate it; `curve_steps`: also evaluate on held-out B after those
    steps; `placement`: where the stages train (the GPU of `--device`); `batch_fn(step, replica,
    j, bs=, T=)`: the row's windows instead of random windows of `corpus_b`; `confirm`: the
    confirmation windows, scored once at the end (`confirm_loss`)."""
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
        transport=HeldLinks(("backward",)) if name in HELD_GRADIENT_ROWS else None,
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
        **({"confirm_loss": evaluate_stages(runner.stages(0), confirm)} if confirm else {}),
        # measured: every serialized message that crossed a stage link in this run, at its own
        # sequence length (headers, token ids, codes, statistics, dense rows, coders and refits)
        "seq_len": T,
        "pp_bytes_per_token": pp / tokens,
        # of which codec state shipped after each refit (a basis, a coder): a fixed cost per refit
        # that a run's length amortises; the rest is what every token costs on the link
        "pp_state_bytes_per_token": state / tokens,
        "pp_stream_bytes_per_token": (pp - state) / tokens,
        # of which the gradients' link (what a floor on their bits changes)
        "pp_grad_bytes_per_token": runner.transport.total_bytes("backward") / tokens,
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
