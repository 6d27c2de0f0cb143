"""The slow anchor circuit in the swarm: unmasked passes on idle peers, priors to every stage group.

The tracker hands anchor jobs to a stage-0 peer (`Directive.anchor_id`). When that peer's fast
work is idle it injects the job's micro-batches *dense* (`header.dense`, fp16 hidden states, no
mask, no basis) on the `AnchorForward` rpc. Every stage runs them on a snapshot of its weights
taken at the job's first micro-batch (one set of weights for the whole pass, so a fast step in
between changes nothing), sends the output to one next-stage peer (the same one for every
micro-batch of a job, so each stage's sum lands on one peer) and the input gradient back on
`AnchorBackward`. The stage peer that has finished all backward passes of a job holds that
stage's dense gradient of the 2-D decoder matrices: it hands it to its own optimizer and sends it
to the rest of its stage group on the `Prior` rpc, so every optimizer of the stage sees it.

The same path carries held-out *evaluation* passes (`header.eval`): forward only, on the live
weights under no_grad, all micro-batches of a pass through the same peers (as for anchors); the
last stage averages the loss of the pass's micro-batches and reports it (`eval_result`). They
give the run's eval loss without a separate service and without touching any weight or optimizer.

Nothing in the fast circuit waits: a peer does anchor work only when its fast queues are empty
(`tick` is called only then), priors are folded in between steps, and a job with no progress
for `timeout_s` (a peer on its path left) is dropped. At most `max_jobs` passes are held at once
(each holds a copy of the stage's weights in the compute dtype; the daemon sizes the count to
its memory, peer/daemon/memory.py `anchor_snapshot_slots`); a message for a pass that is gone is dropped in the
loop, not refused on the wire (a refusal would end the sender's stream and lose what it held).
What each anchor channel accepts is checked before it is queued: peer/pipeline/anchor_checks.py.
Only the dense prior is computed here; the spectral modes that need the masked twin of the anchor batch ("ef", "paper_ef") are refused by the tracker for
swarm runs (peer/config/run.py: `check_swarm`).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.func import functional_call

from peer.errors import WireError
from peer.model.stages import lm_loss
from peer.pipeline.anchor_checks import AnchorChecks
from peer.pipeline.inbound import MAX_MESSAGE_BYTES
from peer.pipeline.transport import Address
from peer.pipeline.worker import StageWorker
from peer.wire import anchormesh_pb2 as pb
from peer.wire.tensors import parse_message, proto_to_tensor, tensor_to_proto, token_dtype

log = logging.getLogger(__name__)

ANCHOR_CHANNELS = ("anchor_forward", "anchor_backward", "prior")
MAX_JOBS = 4  # anchor passes held at once by one stage, unless the daemon sizes it to its memory


@dataclass
class _Pending:
    """One anchor micro-batch this stage ran forward and still owes a backward for."""

    x: torch.Tensor | None  # received hidden state (leaf), None at stage 0
    out: torch.Tensor
    sender: str


@dataclass
class _Job:
    """One anchor pass as this stage sees it."""

    anchor_id: int
    weights_step: int
    snapshot: dict[str, torch.Tensor]  # every parameter; the decoder matrices require grad
    touched: float  # last progress (monotonic seconds)
    dst: Address | None = None  # next-stage peer for every micro-batch of this job
    seen: set[int] = field(default_factory=set)  # micro-batches taken (a duplicate counts once)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    pending: dict[int, _Pending] = field(default_factory=dict)
    done: int = 0
    loss: float = math.nan


class SwarmAnchor(AnchorChecks):
    """Anchor work of one peer's stage.

    Args:
        worker: the peer's fast-circuit worker (its stage, optimizer, transport, run id, name).
        micro_batches: micro-batches per anchor pass (the run's `anchor.micro_batches`).
        siblings: the other live peers of this stage group (where a finished prior goes).
        timeout_s: a job with no progress for this long is dropped (a peer on its path left).
    """

    def __init__(
        self,
        worker: StageWorker,
        micro_batches: int,
        siblings: Callable[[], list[Address]],
        timeout_s: float = 120.0,
        eval_batches: int = 4,
        max_jobs: int = MAX_JOBS,
    ) -> None:
        self.w, self.micro_batches, self.siblings, self.timeout_s = worker, micro_batches, siblings, timeout_s
        self.max_jobs = max_jobs
        self.eval_batches = eval_batches
        self.eval_todo: deque[tuple[int, int, torch.Tensor]] = deque()  # stage 0: (eval id, j, window)
        self._eval_sums: dict[int, tuple[float, int]] = {}  # last stage: eval id -> (loss sum, micro-batches)
        self.eval_result: tuple[int, float] = (0, math.nan)  # last stage: (newest eval id finished, its loss)
        self._eval_dst: dict[int, Address] = {}  # eval id -> next-stage peer for all its micro-batches
        self.targets = worker.stage.decoder_matrices()
        self.shapes = {n: tuple(p.shape) for n, p in worker.stage.named_parameters() if n in self.targets}
        self.jobs: dict[int, _Job] = {}
        self.todo: deque[tuple[int, int, torch.Tensor]] = deque()  # stage 0: (anchor_id, j, window)
        self.inbox: dict[str, deque] = {ch: deque() for ch in ANCHOR_CHANNELS}
        self.newest_id = 0  # newest anchor pass folded into the optimizer (the tracker numbers them in time order)
        # the newest anchor id the tracker has issued (from the heartbeat; None: not heard yet):
        # an id above it (plus ISSUE_SLACK) is forged, and folding it would block every later prior
        self.issued: int | None = None
        self.priors_applied = 0
        self.stale_dropped = 0

    # -- bookkeeping --------------------------------------------------------------------------
    @property
    def bytes_out(self) -> int:
        return sum(self.w.transport.total_bytes(ch) for ch in ANCHOR_CHANNELS)

    def schedule_eval(self, eval_id: int, windows: list[torch.Tensor]) -> None:
        """Stage 0: queue held-out evaluation pass `eval_id` over these windows [B, T+1]."""
        for j, window in enumerate(windows[: self.eval_batches]):
            self.eval_todo.append((eval_id, j, window))

    def schedule(self, anchor_id: int, windows: list[torch.Tensor]) -> None:
        """Stage 0: queue anchor pass `anchor_id` over these token windows [B, T+1]."""
        if anchor_id in self.jobs or any(a == anchor_id for a, _, _ in self.todo):
            return
        for j, window in enumerate(windows):
            self.todo.append((anchor_id, j, window))

    def drain(self) -> None:
        for ch in ANCHOR_CHANNELS:
            cls = (
                pb.AnchorPrior if ch == "prior" else pb.ActivationChunk if ch == "anchor_forward" else pb.GradientChunk
            )
            while (data := self.w.transport.poll(self.w.addr, ch)) is not None:
                self.inbox[ch].append(parse_message(cls, data, MAX_MESSAGE_BYTES))

    # -- priors (between steps, cheap) --------------------------------------------------------
    def apply_priors(self) -> None:
        """Fold the priors that arrived from the stage group into this peer's optimizer."""
        while self.inbox["prior"]:
            msg = self.inbox["prior"].popleft()
            grads = {g.name: proto_to_tensor(g.tensor, expect_shape=self.shapes[g.name]).float() for g in msg.grads}
            self._fold(msg.header.micro_batch_id, grads, f"from {msg.header.sender}")

    def _fold(self, anchor_id: int, grads: dict[str, torch.Tensor], origin: str) -> bool:
        """Hand a prior to the optimizer. Priors are ordered by anchor id, not by the step they ran
        at: peers of one group count their own local steps, so their step numbers drift apart."""
        if anchor_id <= self.newest_id:
            self.stale_dropped += 1
            log.info(
                "anchor %d %s is not newer than the newest one folded in (%d): skipped",
                anchor_id,
                origin,
                self.newest_id,
            )
            return False
        # stamped with this peer's own step: monotonic here, and at most a few steps off the weights it ran on
        self.w.optimizer.observe_anchor(max(self.w.version, self.w.optimizer.spectral.anchor_step or 0), grads, None)
        self.newest_id = anchor_id
        self.priors_applied += 1
        log.info(
            "anchor %d %s folded in at step %d (%d so far)", anchor_id, origin, self.w.version, self.priors_applied
        )
        return True

    # -- work (only when the fast circuit is idle) --------------------------------------------
    def tick(self, next_hop: Callable[[], Address], resolve: Callable[[str], Address]) -> bool:
        """One unit of anchor work: a backward, else a forward, else (stage 0) an injection."""
        self._expire()
        if self.inbox["anchor_backward"]:
            self._backward(self.inbox["anchor_backward"].popleft(), resolve)
            return True
        if self.inbox["anchor_forward"]:
            msg = self.inbox["anchor_forward"].popleft()
            if msg.header.eval:
                self._eval_forward(msg, next_hop)
            else:
                self._forward(msg, next_hop, resolve)
            return True
        if self.eval_todo:
            eval_id, j, window = self.eval_todo.popleft()
            with torch.no_grad():
                out = self.w.stage(self.w.placement.to_device(window[:, :-1]))
            self._send(eval_id, j, out, window, self._eval_hop(eval_id, next_hop), evaluation=True)
            return True
        if self.todo:
            anchor_id, j, window = self.todo.popleft()
            job = self._job(anchor_id)
            if job is None:
                return True
            if job.dst is None:
                job.dst = next_hop()
            out = functional_call(self.w.stage, job.snapshot, (self.w.placement.to_device(window[:, :-1]),))
            job.pending[j] = _Pending(None, out, "")
            self._send(job.anchor_id, j, out, window, job.dst)
            return True
        return False

    def _eval_hop(self, eval_id: int, next_hop: Callable[[], Address]) -> Address:
        if eval_id not in self._eval_dst:
            self._eval_dst[eval_id] = next_hop()
            for old in [k for k in self._eval_dst if k < eval_id - 4]:
                del self._eval_dst[old]
        return self._eval_dst[eval_id]

    def _send(
        self, pass_id: int, j: int, out: torch.Tensor, window: torch.Tensor, dst: Address, evaluation: bool = False
    ) -> None:
        """Micro-batch j of anchor or evaluation pass `pass_id`, dense fp16, to the next stage."""
        header = pb.MicroBatchHeader(
            run_id=self.w.run_id,
            micro_batch_id=j,
            step=pass_id,
            sender=self.w.name,
            boundary=self.w.stage.index,
            dense=True,
            eval=evaluation,
        )
        msg = pb.ActivationChunk(
            header=header,
            hidden=tensor_to_proto(out.detach().to("cpu", torch.float16)),
            token_ids=tensor_to_proto(window.to(token_dtype(self.w.stage.vocab_size))),
        )
        self.w.transport.send(self.w.addr, dst, "anchor_forward", msg.SerializeToString())

    def _eval_forward(self, msg: pb.ActivationChunk, next_hop: Callable[[], Address]) -> None:
        """Forward only, live weights: the next stage, or (last stage) the loss of the pass."""
        window = proto_to_tensor(msg.token_ids).long()
        pl = self.w.placement
        with torch.no_grad():  # the master weights: what an export scores
            out = self.w.stage(pl.to_device(proto_to_tensor(msg.hidden), pl.master_dtype))
            if not self.w.stage.is_last:
                self._send(
                    msg.header.step,
                    msg.header.micro_batch_id,
                    out,
                    window,
                    self._eval_hop(msg.header.step, next_hop),
                    evaluation=True,
                )
                return
            loss = float(lm_loss(out, pl.to_device(window[:, 1:])))
        eval_id = msg.header.step
        total, n = self._eval_sums.get(eval_id, (0.0, 0))
        self._eval_sums[eval_id] = (total + loss, n + 1)
        if n + 1 == self.eval_batches:
            del self._eval_sums[eval_id]
            if eval_id > self.eval_result[0]:
                self.eval_result = (eval_id, (total + loss) / (n + 1))
                log.info("evaluation %d: held-out loss %.4f", eval_id, self.eval_result[1])
        for stale in [k for k in self._eval_sums if k < eval_id - 4]:  # passes that lost a micro-batch
            del self._eval_sums[stale]

    def _job(self, anchor_id: int) -> _Job | None:
        """The pass `anchor_id` at this stage (created at its first micro-batch); None for a pass
        already folded in, or when `max_jobs` newer passes are held."""
        job = self.jobs.get(anchor_id)
        if job is None:
            if anchor_id <= self.newest_id:
                return None
            if len(self.jobs) >= self.max_jobs:
                oldest = min(self.jobs)
                if anchor_id < oldest:
                    return None
                del self.jobs[oldest]
                log.warning("anchor %d: dropped, %d newer passes are held", oldest, self.max_jobs)
            # in the compute dtype (bf16 under mixed precision): a snapshot costs half the fp32 weights
            snapshot = {
                n: p.detach().to(self.w.compute_dtype, copy=True).requires_grad_(n in self.targets)
                for n, p in self.w.stage.named_parameters()
            }
            job = self.jobs[anchor_id] = _Job(anchor_id, self.w.version, snapshot, time.monotonic())
        job.touched = time.monotonic()
        return job

    def _forward(
        self, msg: pb.ActivationChunk, next_hop: Callable[[], Address], resolve: Callable[[str], Address]
    ) -> None:
        job = self._job(msg.header.step)
        j = msg.header.micro_batch_id
        if job is None or j in job.seen:
            return  # a pass that is gone, or a duplicate
        job.seen.add(j)
        window = proto_to_tensor(msg.token_ids).long()
        pl = self.w.placement
        x = pl.to_device(proto_to_tensor(msg.hidden), self.w.compute_dtype).requires_grad_(True)
        out = functional_call(self.w.stage, job.snapshot, (x,))
        if not self.w.stage.is_last:
            if job.dst is None:
                job.dst = next_hop()
            job.pending[j] = _Pending(x, out, msg.header.sender)
            self._send(job.anchor_id, j, out, window, job.dst)
            return
        loss = lm_loss(out, pl.to_device(window[:, 1:]))
        job.loss = (0.0 if math.isnan(job.loss) else job.loss) + float(
            loss.detach()
        ) / self.micro_batches  # anchor work: off the fast path
        self._backward_through(job, _Pending(x, loss / self.micro_batches, msg.header.sender), None, j, resolve)

    def _backward(self, msg: pb.GradientChunk, resolve: Callable[[str], Address]) -> None:
        job = self.jobs.get(msg.header.step)
        pending = job.pending.pop(msg.header.micro_batch_id, None) if job else None
        if pending is None:
            raise WireError(
                f"anchor gradient for unknown micro-batch (anchor {msg.header.step}, micro_batch_id={msg.header.micro_batch_id}): its pass is gone"
            )
        job.touched = time.monotonic()
        g = self.w.placement.to_device(
            proto_to_tensor(msg.grad, expect_shape=tuple(pending.out.shape)), pending.out.dtype
        )
        self._backward_through(job, pending, g, msg.header.micro_batch_id, resolve)

    def _backward_through(
        self, job: _Job, p: _Pending, g: torch.Tensor | None, j: int, resolve: Callable[[str], Address]
    ) -> None:
        """Gradients of the decoder matrices (accumulated) and of the input (sent back)."""
        names = sorted(self.targets)
        inputs = [job.snapshot[n] for n in names] + ([p.x] if p.x is not None else [])
        grads = torch.autograd.grad(p.out, inputs, grad_outputs=g, allow_unused=True)
        for n, gr in zip(names, grads):
            if gr is not None:
                job.grads[n] = job.grads[n] + gr if n in job.grads else gr.detach().clone()
        if p.x is not None:
            b = self.w.stage.index - 1
            header = pb.MicroBatchHeader(
                run_id=self.w.run_id, micro_batch_id=j, step=job.anchor_id, sender=self.w.name, boundary=b, dense=True
            )
            back = pb.GradientChunk(header=header, grad=tensor_to_proto(grads[-1].detach().to("cpu", torch.float16)))
            self.w.transport.send(self.w.addr, resolve(p.sender), "anchor_backward", back.SerializeToString())
        job.done += 1
        if job.done == self.micro_batches:
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        del self.jobs[job.anchor_id]
        if len(job.grads) != len(self.targets):
            log.warning(
                "anchor %d: gradients of %d of %d decoder matrices; skipped",
                job.anchor_id,
                len(job.grads),
                len(self.targets),
            )
            return
        if not self._fold(job.anchor_id, job.grads, "(computed here)"):
            return
        prior = pb.AnchorPrior(
            header=pb.MicroBatchHeader(
                run_id=self.w.run_id,
                micro_batch_id=job.anchor_id,
                step=job.weights_step,
                sender=self.w.name,
                boundary=self.w.stage.index,
                dense=True,
            ),
            stage=self.w.stage.index,
            grads=[
                pb.NamedTensor(name=n, tensor=tensor_to_proto(g.to("cpu", torch.bfloat16)))
                for n, g in sorted(job.grads.items())
            ],
            loss=job.loss,
        )
        data = prior.SerializeToString()
        for dst in self.siblings():
            self.w.transport.send(self.w.addr, dst, "prior", data)

    def _expire(self) -> None:
        now = time.monotonic()
        for anchor_id, job in list(self.jobs.items()):
            if now - job.touched > self.timeout_s:
                del self.jobs[anchor_id]
                self.todo = deque(t for t in self.todo if t[0] != anchor_id)
                log.warning(
                    "anchor %d: no progress for %.0fs (a peer on its path left?); dropped", anchor_id, now - job.touched
                )
