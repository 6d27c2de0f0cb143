"""Local pipeline runner: K stages x R replicas in one process, micro-batches flowing as wire messages.

Each (stage, replica) is a `StageWorker` (worker.py) with its own module copy, optimizer and codec
ends; they talk through a `Transport`, so the bytes counted are the bytes a network would carry
and the gRPC transport can replace the local one. A stage group steps as soon as all of its
replicas have the gradients of that step (the DP sync is the only point where replicas of one
stage meet). With max_staleness = 0, masking off and one replica, a step equals a plain
single-process step.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from peer.anchor import AnchorPrior, AnchorReplica, AnchorScheduler
from peer.codec.mask import MaskCodec
from peer.config import TrainConfig
from peer.dp import build_dp_sync
from peer.model.placement import CPU_FP32, Placement
from peer.model.stages import StageModule, lm_loss, split_model
from peer.pipeline.transport import LocalTransport, Transport
from peer.pipeline.worker import StageWorker, mean_loss

BatchFn = Callable[[int, int, int], torch.Tensor]  # (step, replica, micro_batch) -> windows [B, T+1]


@dataclass
class StepReport:
    """What one optimizer step of the whole pipeline did (all stage groups applied `step`)."""

    step: int
    loss: float
    tokens: int
    pp_bytes: int  # fast-circuit bytes on all stage links during this step (both directions)
    dp_bytes: int  # bytes one replica uploaded for DP sync, summed over stages
    anchor_step: int | None  # weights' step of the newest anchor prior applied so far
    seconds: float


class LocalPipelineRunner:
    """Trains K stages x R replicas of `model` in this process.

    Args:
        cfg: the run's config; cfg.model.num_stages stages, cfg.dp.replicas replicas per stage.
        model: the full causal LM; it is split and copied, never modified.
        batch_fn: (step, replica, micro_batch) -> token windows [B, T+1].
        anchor_batch_fn: (anchor_step, micro_batch) -> token windows; defaults to batch_fn(step, 0, 10_000 + j).
        transport: defaults to in-process queues.
        placement: the device and precision every worker computes in (peer/model/placement.py).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        model: PreTrainedModel,
        batch_fn: BatchFn,
        *,
        anchor_batch_fn: Callable[[int, int], torch.Tensor] | None = None,
        transport: Transport | None = None,
        run_id: str = "local",
        placement: Placement = CPU_FP32,
    ) -> None:
        self.cfg, self.batch_fn, self.run_id, self.placement = cfg, batch_fn, run_id, placement
        self.transport = transport or LocalTransport()
        self.codec = MaskCodec(cfg.mask)
        base = split_model(model, cfg.model.num_stages)
        for stage in base:
            stage.train()
        R, K = cfg.dp.replicas, cfg.model.num_stages
        self.workers: list[list[StageWorker]] = [
            [
                StageWorker(
                    copy.deepcopy(base[s]) if r else base[s], r, cfg, self.transport, run_id, placement=placement
                )
                for r in range(R)
            ]
            for s in range(K)
        ]
        self.dp = [build_dp_sync(cfg.dp, [p.shape for p in base[s].parameters()]) if R > 1 else None for s in range(K)]
        for row in self.workers:
            for w in row:
                self.transport.attach(w.addr, w.validate)
        for s, dp in enumerate(self.dp):
            if dp is not None:
                dp.init_params([list(w.stage.parameters()) for w in self.workers[s]])
        self.dp_bytes = [0] * K
        self.anchor: AnchorScheduler | None = None
        self._pending_priors: list[list[AnchorPrior]] = [[] for _ in range(K)]
        self.anchor_bytes = 0
        self.anchor_seconds = 0.0
        self.newest_anchor: int | None = None
        if cfg.anchor.enabled:
            replica = AnchorReplica(
                stages=[row[0].stage for row in self.workers],
                codec=self.codec,
                batch_fn=anchor_batch_fn or (lambda step, j: batch_fn(step, 0, 10_000 + j)),
                micro_batches=cfg.anchor.micro_batches,
                fill_fn=self._anchor_fill,
            )
            self.anchor = AnchorScheduler(cfg.anchor, replica)
            self.anchor.on_step(0, self.weights)  # the snapshot the first pass (at step K) runs on
        self.step_count = 0
        self.stall_timeout = 60.0  # seconds without any message before the run is declared stalled

    def _anchor_fill(self, stage_index: int, window: torch.Tensor) -> torch.Tensor | None:
        return self.workers[stage_index][0].link.anchor_fill(window[:, :-1])

    def stages(self, replica: int = 0) -> list[StageModule]:
        return [row[replica].stage for row in self.workers]

    def weights(self) -> list[dict[str, torch.Tensor]]:
        return [{n: p.detach() for n, p in st.named_parameters()} for st in self.stages()]

    # -- the event loop ---------------------------------------------------------------------
    def _group_step(self, s: int) -> int:
        """DP sync -> anchor refresh -> correction + AdamW for stage group s. Returns DP bytes."""
        group = self.workers[s]
        step = group[0].version
        grads = [w.gradients() for w in group]
        nbytes = self.dp[s].sync_grads(step, grads) if self.dp[s] else 0
        for prior in self._pending_priors[s]:
            masked = prior.masked[s] if prior.masked is not None else None
            for w in group:
                w.optimizer.observe_anchor(prior.step, prior.dense[s], masked)
        self._pending_priors[s].clear()
        for w in group:
            w.apply_step()
        if self.dp[s]:
            with torch.no_grad():
                nbytes += self.dp[s].sync_params(step, [list(w.stage.parameters()) for w in group])
        return nbytes

    def _tick(self, steps: int) -> bool:
        """One pass over every worker; each does at most one unit of work. False if nothing moved."""
        moved = False
        K = len(self.workers)
        for s in range(K):
            group = self.workers[s]
            if all(w.ready(w.version) for w in group) and group[0].version < steps:
                self.dp_bytes[s] += self._group_step(s)
                moved = True
            M, S = self.cfg.pipeline.micro_batches, self.cfg.pipeline.max_staleness
            for w in group:
                w.drain()
                if s == 0:  # keep the pipeline full: inject while the staleness bound allows
                    step, j = divmod(w.next_mb, M)
                    if step < steps and w.can_forward(step) and len(w.inflight) < M * (S + 1):
                        w.inject(self.batch_fn(step, w.replica, j), step, j)
                        w.next_mb += 1
                        moved = True
                        continue
                if w.backward_one() or (s > 0 and w.forward_one()):
                    moved = True
        return moved

    def run(self, steps: int | None = None, on_step: Callable[[StepReport], None] | None = None) -> list[StepReport]:
        """Train until every stage group has applied `steps` steps in total (default cfg.steps)."""
        steps = self.cfg.steps if steps is None else steps
        reports: list[StepReport] = []
        t0 = time.perf_counter()
        last_bytes = self.transport.total_bytes()
        last_dp = 0
        tokens_per_step = (
            self.cfg.dp.replicas
            * self.cfg.pipeline.micro_batches
            * self.cfg.pipeline.micro_batch_size
            * self.cfg.pipeline.seq_len
        )
        while self.step_count < steps:
            if not self._tick(steps) and not self.transport.wait(timeout=self.stall_timeout):
                raise RuntimeError(
                    f"pipeline stalled at step {self.step_count}: "
                    + ", ".join(f"{w.name} v{w.version} done={dict(w.done)}" for row in self.workers for w in row)
                )
            self._collect_anchor()
            done = min(w.version for row in self.workers for w in row)
            while self.step_count < done:
                step = self.step_count
                last = self.workers[-1]
                losses = [x for w in last for x in w.losses.pop(step, [])]
                total = self.transport.total_bytes()
                dp_total = sum(self.dp_bytes)
                now = time.perf_counter()
                report = StepReport(
                    step,
                    mean_loss(losses),
                    tokens_per_step,
                    total - last_bytes,
                    dp_total - last_dp,
                    self.newest_anchor,
                    now - t0,
                )
                last_bytes, last_dp, t0 = total, dp_total, now
                self.step_count += 1
                if self.anchor is not None:
                    self.anchor.on_step(self.step_count, self.weights)
                    self._collect_anchor()
                reports.append(report)
                if on_step:
                    on_step(report)
        return reports

    def _collect_anchor(self) -> None:
        if self.anchor is None:
            return
        for prior in self.anchor.poll():
            self.anchor_bytes += prior.pp_bytes
            self.anchor_seconds += prior.seconds
            self.newest_anchor = prior.step if self.newest_anchor is None else max(self.newest_anchor, prior.step)
            for pending in self._pending_priors:
                pending.append(prior)

    @torch.no_grad()
    def evaluate(self, batches: list[torch.Tensor], replica: int = 0) -> float:
        """Dense (unmasked) held-out loss of the stages of `replica`: what the exported model scores."""
        return evaluate_stages(self.stages(replica), batches)

    def close(self) -> None:
        if self.anchor is not None:
            self.anchor.close()
        self.transport.close()


@torch.no_grad()
def evaluate_stages(stages: list[StageModule], batches: list[torch.Tensor]) -> float:
    """Dense held-out loss of the stages' master weights, on the device they live on."""
    total, count = 0.0, 0
    for stage in stages:
        stage.eval()
    for window in batches:
        window = window.to(next(stages[0].parameters()).device)
        h = window[:, :-1]
        for stage in stages:
            h = stage(h.to(next(stage.parameters()).device))
        total += float(lm_loss(h, window[:, 1:].to(h.device))) * window[:, 1:].numel()
        count += window[:, 1:].numel()
    for stage in stages:
        stage.train()
    return total / count
