"""The slow anchor circuit: unmasked forward-backward passes off the critical path.

Every K = `anchor.every` steps the scheduler launches one anchor pass on the full-weight
snapshot it took K steps earlier (so the prior is K-step stale, as in the paper) and stores the
current weights as the next snapshot. The pass runs on a separate anchor replica (its own copies
of the stages), takes no optimizer step, and yields per-stage dense gradients of the 2-D decoder
matrices, stamped with the snapshot's step. With `with_masked` it also yields the masked
gradient of the same batch from the same snapshot, which the error-feedback correction needs.

Fast steps never wait: `poll()` returns whatever has finished. With executor "thread" the pass
runs on a background thread; with "inline" it runs inside `on_step` (deterministic, for tests).
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from peer.codec.fill import reconstruct
from peer.codec.mask import MaskCodec
from peer.config import AnchorConfig
from peer.model.stages import StageModule, lm_loss

StageState = dict[str, torch.Tensor]
Grads = dict[str, torch.Tensor]


@dataclass
class AnchorPrior:
    """One finished anchor pass: per-stage gradients at the weights of `step`."""

    step: int
    dense: list[Grads]
    masked: list[Grads] | None
    loss: float
    tokens: int
    pp_bytes: int  # dense activations + gradients that crossed the stage links
    seconds: float
    launched_at: int = 0  # the fast circuit's step when the pass was launched


@dataclass
class AnchorReplica:
    """Copies of the stages that run anchor passes; never stepped.

    Args:
        stages: the stage modules to copy (their weights are replaced by each snapshot).
        codec: the fast circuit's mask codec, for the masked twin pass.
        batch_fn: (anchor_step, micro_batch) -> token windows [B, T+1]; deterministic.
        fill_fn: (boundary, token_ids) -> fill tensor or None, as the fast circuit's receiver
            would fill dropped entries.
        value_bytes: bytes per value of a dense activation on the wire (fp16: 2), for the byte count;
            the masked twin pass is counted at the mask codec's bytes per element.
    """

    stages: list[StageModule]
    codec: MaskCodec
    batch_fn: Callable[[int, int], torch.Tensor]
    micro_batches: int
    fill_fn: Callable[[int, torch.Tensor], torch.Tensor | None] = lambda b, ids: None
    value_bytes: int = 2
    _copies: list[StageModule] = field(init=False)

    def __post_init__(self) -> None:
        self._copies = [copy.deepcopy(s) for s in self.stages]
        for s in self._copies:
            s.requires_grad_(True)

    def _pass(self, step: int, masked: bool) -> tuple[list[Grads], float, int, int]:
        targets = [s.decoder_matrices() for s in self._copies]
        for s in self._copies:
            s.zero_grad(set_to_none=True)
        loss_sum, tokens, nbytes = 0.0, 0, 0
        device = next(self._copies[0].parameters()).device
        for j in range(self.micro_batches):
            window = self.batch_fn(step, j).to(device)
            ids, tgt = window[:, :-1], window[:, 1:]
            h = ids
            for b, stage in enumerate(self._copies):
                if b > 0:
                    per_value = self.codec.bytes_per_element() if masked else self.value_bytes
                    nbytes += round(2 * h.numel() * per_value)  # forward activation + backward gradient
                    if masked:
                        keep = self.codec.keep_mask(
                            tuple(h.shape), boundary=b - 1, step=step, micro_batch=1_000_000 + j, device=h.device
                        )
                        mask = self.codec.cfg
                        h = reconstruct(h, keep, mask.keep, mask.fill, self.fill_fn(b, window))
                h = stage(h)
            loss = lm_loss(h, tgt) / self.micro_batches
            loss.backward()
            loss_sum += float(loss.detach()) * self.micro_batches
            tokens += tgt.numel()
        grads = [
            {n: p.grad.detach().clone() for n, p in s.named_parameters() if n in t and p.grad is not None}
            for s, t in zip(self._copies, targets)
        ]
        return grads, loss_sum / self.micro_batches, tokens, nbytes

    def compute(self, step: int, snapshot: list[StageState], with_masked: bool) -> AnchorPrior:
        t0 = time.perf_counter()
        for s, state in zip(self._copies, snapshot):
            s.load_state_dict(state)
        dense, loss, tokens, nbytes = self._pass(step, masked=False)
        masked = None
        if with_masked and self.codec.cfg.enabled:
            masked, _, _, masked_bytes = self._pass(step, masked=True)
            nbytes += masked_bytes
        return AnchorPrior(step, dense, masked, loss, tokens, nbytes, time.perf_counter() - t0)


class AnchorScheduler:
    """Decides when anchor passes run and hands finished priors to the optimizer side."""

    def __init__(self, cfg: AnchorConfig, replica: AnchorReplica) -> None:
        self.cfg, self.replica = cfg, replica
        self._snapshot: tuple[int, list[StageState]] | None = None
        self._done: queue.Queue[AnchorPrior] = queue.Queue()
        self._jobs: queue.Queue[tuple[int, int, list[StageState]] | None] = queue.Queue(maxsize=1)
        self._thread: threading.Thread | None = None
        self.launched = 0
        self.dropped = 0  # launches skipped because the previous pass was still queued
        if cfg.enabled and cfg.executor == "thread":
            self._thread = threading.Thread(target=self._worker, name="anchor", daemon=True)
            self._thread.start()

    def on_step(self, step: int, weights: Callable[[], list[StageState]]) -> None:
        """Call after the fast circuit has applied `step` optimizer steps (weights at version `step`)."""
        if not self.cfg.enabled or step % self.cfg.every:
            return
        current = [{k: v.detach().clone() for k, v in sd.items()} for sd in weights()]
        if self._snapshot is not None:
            snap_step, snap = self._snapshot
            self.launched += 1
            if self._thread is None:
                self._finish(step, snap_step, snap)
            else:
                try:
                    self._jobs.put_nowait((step, snap_step, snap))
                except queue.Full:  # the anchor replica is still busy: skip, never block the fast circuit
                    self.dropped += 1
        self._snapshot = (step, current)

    def _finish(self, launched_at: int, snap_step: int, snap: list[StageState]) -> None:
        prior = self.replica.compute(snap_step, snap, self.cfg.with_masked)
        prior.launched_at = launched_at
        self._done.put(prior)

    def _worker(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._finish(*job)

    def poll(self) -> list[AnchorPrior]:
        """Finished priors, oldest first; never blocks."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        if self._thread is not None:
            try:
                self._jobs.put_nowait(None)
            except queue.Full:
                self._jobs.get_nowait()
                self._jobs.put_nowait(None)
            self._thread.join(timeout=60)
