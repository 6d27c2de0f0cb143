"""The step of one stage replica: `StageWorker` (module, optimizer, codec ends, in-flight
micro-batches), shared by the swarm daemon and the in-process `LocalPipelineRunner` (local.py).

Workers talk only through a `Transport` (serialized ActivationChunk / GradientChunk protos),
so the bytes counted are the bytes a network would carry. There is no global barrier: a worker
acts on what is in its inbox (backward first, then forward).

Asynchrony is bounded: a worker runs the forward of step n only while n - version <=
`max_staleness` (version = optimizer steps it has applied). A forward that runs ahead is taken
on stashed weights (PipeDream-style weight stashing, so its backward is exact for the weights it
saw); with `staleness_correction="lookahead"` those weights are extrapolated by the last update
times the delay, so the stale gradient is taken near the point where it will be applied.

The worker holds its parts: the weights its forwards run on (weights.py), its ends of its links
(codecs/: one LinkCodec for the run's `mask.scheme`, which the worker never asks about), the checks
of inbound messages (inbound.py, bounds.py) and a sender's retries (retries.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from peer.config import TrainConfig
from peer.errors import TensorError, WireError
from peer.model.placement import CPU_FP32, Placement
from peer.model.stages import StageModule, lm_loss
from peer.optim.stage_optimizer import StageOptimizer
from peer.pipeline.bounds import LinkBounds
from peer.pipeline.codecs import LinkCodec, make_link
from peer.pipeline.inbound import check_activation, check_gradient, parse_inbound
from peer.pipeline.inflight import InFlight
from peer.pipeline.linktune import ComputeClock
from peer.pipeline.retries import Retries, retry_key
from peer.pipeline.transport import Address, Transport
from peer.pipeline.weights import ForwardWeights
from peer.wire import anchormesh_pb2 as pb
from peer.wire.tensors import proto_to_tensor, tensor_to_proto, token_dtype

log = logging.getLogger(__name__)


@dataclass
class StageWorker:
    """One replica of one stage: module, optimizer, codec ends and in-flight micro-batches.

    Args:
        stage: the stage's layers (peer/model/stages.py); moved to `placement`'s device in fp32
            master weights. The worker trains it in place.
        replica: which replica of the stage this is; it makes micro-batch ids (and so masks) of
            one sender its own. Locally 0..R-1; the swarm daemon draws a random 20-bit number.
        cfg: the run's config: the codec (`mask`), optimizer and correction (`optim`,
            `spectral`), micro-batching and staleness (`pipeline`), link bounds (`security`).
        transport: what carries its messages (peer/pipeline/transport.py): the in-process one of
            the local runner, or the daemon's gRPC transport, so bytes counted are bytes sent.
        run_id: carried in every message header; a message of another run is refused.
        version: optimizer steps already applied: 0 for a fresh run, the run's step for a peer
            that joins a trained run (its steps continue the run's numbering).
        next_mb: stage 0: the next micro-batch to inject, counted over all steps (start_step * M
            for a joiner).
        peer_id: the swarm: this peer's id, its address and its name in headers. None: the local
            layout, where replica r of stage s talks to replica r of s +- 1.
        next_hop: the swarm: picks the next-stage peer for a new activation (peer/daemon/routing.py).
        local_steps: the swarm: a step is any M micro-batches from any sender, and middle stages
            forward on a stashed copy of the weights so a step may land between forward and
            backward. False (local runner): a step is this replica's own M micro-batches.
        resolve: the swarm: a sender's name to its address, to send a gradient back.
        compute: the clock of compute seconds per micro-batch that link adaptation reads;
            the default starts a fresh one.
        placement: device and precision (peer/model/placement.py); the default is fp32 on CPU.

    The other fields are the worker's own state (queues, in-flight micro-batches, gradients,
    losses, retries); leave them to their defaults.
    """

    stage: StageModule
    replica: int
    cfg: TrainConfig
    transport: Transport
    run_id: str
    version: int = 0
    inbox_fwd: deque = field(default_factory=deque)
    inbox_bwd: deque = field(default_factory=deque)
    inflight: dict[tuple[int, int], InFlight] = field(default_factory=dict)
    done: Counter = field(default_factory=Counter)
    grad_buf: dict[int, dict[str, torch.Tensor]] = field(default_factory=lambda: defaultdict(dict))
    losses: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    next_mb: int = 0  # stage 0: next micro-batch to inject, counted over all steps
    optimizer: StageOptimizer = field(init=False)
    retries: Retries = field(default_factory=Retries)  # swarm: a sender's retries (peer/pipeline/retries.py)
    # swarm routing (None: the local layout, replica r of stage s talks to replica r of s +- 1)
    peer_id: str | None = None
    next_hop: Callable[[], Address] | None = None  # the next-stage peer for a new activation
    # swarm: a step is M micro-batches of any sender (local step count); middle stages run
    # forwards on a stashed copy of the weights so a step may land between forward and backward
    local_steps: bool = False
    resolve: Callable[[str], Address] | None = None  # sender name -> its address
    compute: ComputeClock = field(default_factory=ComputeClock)  # seconds of compute per micro-batch
    placement: Placement = CPU_FP32  # device and precision (peer/model/placement.py)
    link: LinkCodec = field(init=False)  # its ends of its links, for the run's codec (peer/pipeline/codecs/)
    weights: ForwardWeights = field(init=False)  # what the forwards run on (peer/pipeline/weights.py)
    bounds: LinkBounds = field(init=False)  # inbound values against each link's running RMS (peer/pipeline/bounds.py)
    senders: set[str] = field(
        default_factory=set
    )  # who sent this step's gradients and activations: named when it is dropped
    dropped_steps: int = 0  # steps dropped for a non-finite gradient

    def __post_init__(self) -> None:
        s, pl = self.stage, self.placement
        s.to(device=pl.device, dtype=pl.master_dtype)  # fp32 master weights where they compute
        s.checkpointing = pl.checkpointing
        self.optimizer = StageOptimizer(
            list(s.named_parameters()), s.decoder_matrices(), self.cfg.spectral, self.cfg.optim
        )
        self.link = make_link(self.cfg.mask, s, pl, self.transport, self.compute)
        self.weights = ForwardWeights(
            s,
            pl,
            self.local_steps,
            self.cfg.pipeline.staleness_correction == "lookahead",
            max_staleness=self.cfg.pipeline.max_staleness,
        )
        self.bounds = LinkBounds(
            self.cfg.security.link_rms_factor, self.cfg.security.max_link_value, self.cfg.security.max_activation_value
        )

    @property
    def compute_dtype(self) -> torch.dtype:
        """What the stage's layers compute in (the master weights are float32 regardless)."""
        return self.placement.compute_dtype

    # -- what its parts hold, read on the worker (the daemon's status, tests) -------------
    @property
    def keep_sent(self) -> dict[Address, float]:
        """Destination -> fraction of the configured payload last sent (mask.adapt)."""
        return self.link.keep_sent

    @property
    def state_bytes_sent(self) -> int:
        """Bytes of codec state (low-rank bases, transform coders) in the messages sent: amortised over a run."""
        return self.link.state_bytes_sent

    @property
    def forwards_ahead(self) -> int:
        """Forwards that ran on stashed weights (staleness > 0)."""
        return self.weights.forwards_ahead

    def forget_sent(self) -> None:
        """A message may have been lost with a basis or coder in it: ship them again."""
        self.link.forget_sent()

    @property
    def addr(self) -> Address:
        return self.peer_id or (self.stage.index, self.replica)

    @property
    def name(self) -> str:
        return self.peer_id or f"stage{self.stage.index}.r{self.replica}"

    # -- messages ---------------------------------------------------------------------------
    def _header(self, step: int, mb: int, boundary: int) -> pb.MicroBatchHeader:
        return pb.MicroBatchHeader(
            run_id=self.run_id, micro_batch_id=mb, step=step, sender=self.name, boundary=boundary
        )

    def drain(self) -> None:
        for channel, inbox in (("forward", self.inbox_fwd), ("backward", self.inbox_bwd)):
            while (data := self.transport.poll(self.addr, channel)) is not None:
                inbox.append(parse_inbound(channel, data, self.run_id, self.name))

    def validate(self, channel: str, msg: pb.ActivationChunk | pb.GradientChunk) -> None:
        """Vet an inbound message fully before it is queued (runs on the transport's threads;
        the checks: peer/pipeline/inbound.py). Raises WireError / TensorError naming the field."""
        if channel == "forward":
            check_activation(msg, self.stage, self.cfg.pipeline, self.link, self.bounds)
        else:
            check_gradient(msg, self.stage, self.inflight, self.link, self.bounds)

    def _mb_key(self, step: int, mb_in_step: int) -> int:
        return self.replica * self.cfg.pipeline.micro_batches + mb_in_step

    # -- forward ----------------------------------------------------------------------------
    def can_forward(self, step: int) -> bool:
        if self.local_steps and not self.stage.is_first:
            return True
        return step - self.version <= self.cfg.pipeline.max_staleness

    def inject(self, window: torch.Tensor, step: int, j: int) -> None:
        """Stage 0: start micro-batch j of `step` from token windows [B, T+1] (on the host)."""
        t0 = time.perf_counter()
        self.stage.check_input(window[:, :-1])  # ids checked on the host: no device sync
        stash = self.weights.for_step(step, self.version)
        ids = self.placement.to_device(window[:, :-1])
        out = self.weights.run(ids, stash)
        mb = self._mb_key(step, j)
        sent, dst = self._send_forward(out, window, ids, step, mb)
        self.inflight[(step, mb)] = InFlight(
            step, None, out, stash, window, sent=sent, dst=dst, sent_s=time.monotonic()
        )
        self.compute.add(time.perf_counter() - t0)

    def _send_forward(
        self, out: torch.Tensor, window: torch.Tensor, ids: torch.Tensor, step: int, mb: int
    ) -> tuple[object, Address]:
        """Encode and send this stage's output (`ids`: its tokens, on the device); returns the
        codec's note for the gradient that will come back, and where it went."""
        b = self.stage.index
        msg = pb.ActivationChunk(
            header=self._header(step, mb, b), token_ids=tensor_to_proto(window.to(token_dtype(self.stage.vocab_size)))
        )
        dst = self.next_hop() if self.next_hop else (b + 1, self.replica)
        sent = self.link.encode_activation(msg, out.detach(), ids, dst)
        self.transport.send(self.addr, dst, "forward", msg.SerializeToString())
        return sent, dst

    def forward_one(self) -> bool:
        """Process the oldest activation whose step is within the staleness bound."""
        if not self.inbox_fwd or not self.can_forward(self.inbox_fwd[0].header.step):
            return False
        msg = self.inbox_fwd.popleft()
        step, mb = msg.header.step, msg.header.micro_batch_id
        key = None
        if self.local_steps:  # a sender's retry may duplicate a micro-batch we already took
            key = retry_key(msg)
            if not self.retries.take(key):
                # a retry: the sender lost our gradient (or gave up waiting); send it again rather
                # than computing the micro-batch twice. Still in flight here: it will come.
                sent = self.retries.gradient(key)
                if sent is not None:
                    self.transport.send(self.addr, sent[0], "backward", sent[1])
                return True
        t0 = time.perf_counter()
        pl = self.placement
        window = proto_to_tensor(msg.token_ids).to(torch.long)
        ids = window[:, :-1]  # on the host
        x, h, received = self.link.decode_activation(msg, ids)  # x: the leaf whose gradient goes back
        stash = self.weights.for_step(step, self.version)
        out = self.weights.run(h, stash)
        if self.stage.is_last:
            loss = lm_loss(out, pl.to_device(window[:, 1:]))
            (loss / self.cfg.pipeline.micro_batches).backward()
            self.losses[step].append(loss.detach())  # a device tensor: read in batches, never per micro-batch
            self._finish_backward(
                InFlight(step, x, out, stash, window, sender=msg.header.sender, received=received, retry_key=key), mb
            )
        else:
            sent, dst = self._send_forward(out, window, pl.to_device(ids), step, mb)
            self.inflight[(step, mb)] = InFlight(
                step,
                x,
                out,
                stash,
                window,
                sender=msg.header.sender,
                sent=sent,
                received=received,
                retry_key=key,
                dst=dst,
                sent_s=time.monotonic(),
            )
        self.compute.add(time.perf_counter() - t0)
        return True

    # -- backward ---------------------------------------------------------------------------
    def backward_one(self) -> bool:
        if not self.inbox_bwd:
            return False
        msg = self.inbox_bwd.popleft()
        mb = msg.header.micro_batch_id
        job = self.inflight.pop((msg.header.step, mb), None)
        if job is None:
            raise WireError(
                f"{self.name}: gradient for unknown micro-batch (step={msg.header.step}, micro_batch_id={mb})"
            )
        t0 = time.perf_counter()
        grad = self.link.decode_gradient(msg, job.sent, tuple(job.out.shape))
        job.out.backward(grad.to(job.out.dtype))
        self.senders.add(msg.header.sender)
        self._finish_backward(job, mb)
        self.compute.add(time.perf_counter() - t0)
        return True

    def _finish_backward(self, job: InFlight, mb: int) -> None:
        self.compute.micro_batch_done()
        if job.sender:
            self.senders.add(job.sender)
        if job.stash is not None:  # ran on stashed weights: its gradient belongs to step job.step
            buf = self.grad_buf[-1 if self.local_steps else job.step]
            master = self.placement.master_dtype
            for name, w in job.stash.items():
                if w.grad is not None:  # summed in the master dtype: bf16 sums of many micro-batches lose bits
                    buf[name] = buf[name] + w.grad.to(master) if name in buf else w.grad.to(master, copy=True)
                    w.grad = None
        if job.x is not None:
            b = self.stage.index - 1
            dst = self.resolve(job.sender) if self.resolve else (b, self.replica)
            msg = pb.GradientChunk(header=self._header(job.step, mb, b))
            self.link.encode_gradient(msg, job.x, job.received, dst)
            data = msg.SerializeToString()
            if (
                self.local_steps
            ):  # cached before sending: a send that fails (sender not known yet) is redone on its retry
                self.retries.sent(job.retry_key, dst, data)
            self.done[job.step] += 1
            self.transport.send(self.addr, dst, "backward", data)
            return
        self.done[job.step] += 1

    # -- step -------------------------------------------------------------------------------
    def ready(self, step: int) -> bool:
        if self.local_steps:
            return sum(self.done.values()) >= self.cfg.pipeline.micro_batches
        return self.version == step and self.done[step] == self.cfg.pipeline.micro_batches

    def gradients(self) -> list[torch.Tensor]:
        """This step's gradient of every parameter (live .grad plus stashed-weight gradients)."""
        buf = self.grad_buf.pop(-1 if self.local_steps else self.version, {})
        out = []
        for name, p in self.stage.named_parameters():
            if name in buf:  # no zeros_like: one fp32 gradient per parameter at a time, not three
                p.grad = buf.pop(name) if p.grad is None else p.grad.add_(buf.pop(name))
            elif p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
        return out

    def apply_step(self) -> None:
        """The optimizer step; a non-finite gradient drops it instead (gradients, micro-batch count; weights and optimizer
        state untouched) and names who sent its messages: left in place, it failed every later step, and the peer stopped."""
        self.weights.before_step()
        try:
            self.optimizer.step(self.version)
        except TensorError as exc:  # raised before anything changed (StageOptimizer.step)
            self.dropped_steps += 1
            log.warning(
                "%s: step %d dropped (%d so far): %s; its messages came from %s",
                self.name,
                self.version,
                self.dropped_steps,
                exc,
                ", ".join(sorted(self.senders)) or "no other peer",
            )
        finally:  # the buffer holds the old weights until after_step makes them the update: never leave it so
            self.weights.after_step()
        self.senders.clear()
        self.optimizer.zero_grad()
        self.compute.step()
        if self.local_steps:
            self.done.clear()
        else:
            self.done.pop(self.version, None)
        self.version += 1


def mean_loss(losses: list[torch.Tensor | float]) -> float:
    """The mean of a step's micro-batch losses, read from the device once (one host sync per
    step, none per micro-batch)."""
    if not losses:
        return math.nan
    return float(torch.stack([torch.as_tensor(x, dtype=torch.float32) for x in losses]).mean())
