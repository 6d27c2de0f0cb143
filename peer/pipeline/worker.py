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
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.func import functional_call

from peer.codec.basis import BasisLearner, BasisState
from peer.codec.fill import USES_PRIOR, reconstruct
from peer.codec.mask import MaskCodec, as_f32
from peer.codec.prior import TokenPrior
from peer.config import MaskConfig, TrainConfig
from peer.errors import WireError
from peer.model.placement import CPU_FP32, Placement
from peer.model.stages import StageModule, lm_loss
from peer.optim.stage_optimizer import StageOptimizer
from peer.pipeline.linktune import ComputeClock, coefficients, keep_fraction
from peer.pipeline.transport import Address, Transport
from peer.wire import anchormesh_pb2 as pb
from peer.wire.tensors import (
    parse_message,
    proto_to_tensor,
    tensor_to_proto,
    token_dtype,
)

MAX_MESSAGE_BYTES = 256 * 2**20
# what every link tensor declares as its logical dtype, whatever its peers compute in: values
# travel as `mask.values`, so a bf16 peer and an fp32 peer of one run talk to each other
LINK_DTYPE = torch.float32



def check_token_window(payload: pb.TensorPayload, vocab_size: int, shape: tuple[int, int] | None = None) -> torch.Tensor:
    """An inbound token window [B, T+1] (inputs and targets), vetted: integer, 2-D with T >= 1,
    of `shape` when given, every id in [0, vocab_size). Raises WireError naming the problem."""
    window = proto_to_tensor(payload)
    want = f"[{shape[0]}, {shape[1]}] (the run's micro-batch)" if shape else "[B, T+1]"
    if window.is_floating_point() or window.ndim != 2 or window.shape[1] < 2 or (shape and tuple(window.shape) != shape):
        raise WireError(f"token_ids: expected integer {want}, got {window.dtype} {tuple(window.shape)}")
    if int(window.min()) < 0 or int(window.max()) >= vocab_size:
        raise WireError(f"token_ids: values must be in [0, {vocab_size})")
    return window


@dataclass
class _InFlight:
    step: int
    x: torch.Tensor | None  # received input (leaf, requires grad, on the device) for stages > 0
    out: torch.Tensor
    stash: dict[str, torch.Tensor] | None  # weights the forward ran on when not the live ones (ran ahead, or the low-precision working copy)
    window: torch.Tensor  # token windows [B, T+1], on the host
    basis: BasisState | None = None  # low-rank codec: the (prior, basis) the output was encoded with
    sender: str = ""  # who sent the input (the gradient goes back there)
    coefs: int = 0  # low-rank codec: coefficients per token the output was sent with
    codec_in: MaskCodec | None = None  # mask scheme: the codec (drop) the input came with; None = the config's
    codec_out: MaskCodec | None = None  # mask scheme: the codec (drop) the output was sent with; None = the config's


KEEP_GRID = 256  # mask scheme, adapting: keep fractions are multiples of 1/256 (exact in float32)


@dataclass
class StageWorker:
    """One replica of one stage: module, optimizer, codec ends and in-flight micro-batches."""

    stage: StageModule
    replica: int
    cfg: TrainConfig
    codec: MaskCodec
    transport: Transport
    run_id: str
    version: int = 0
    inbox_fwd: deque = field(default_factory=deque)
    inbox_bwd: deque = field(default_factory=deque)
    inflight: dict[tuple[int, int], _InFlight] = field(default_factory=dict)
    done: Counter = field(default_factory=Counter)
    grad_buf: dict[int, dict[str, torch.Tensor]] = field(default_factory=lambda: defaultdict(dict))
    losses: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    next_mb: int = 0  # stage 0: next micro-batch to inject, counted over all steps
    prior: TokenPrior | None = None
    optimizer: StageOptimizer = field(init=False)
    last_delta: dict[str, torch.Tensor] | None = None
    forwards_ahead: int = 0  # forwards that ran on stashed weights (staleness > 0)
    basis_out: BasisLearner | None = None  # low-rank codec, sending end
    basis_in: dict[str, BasisState] = field(default_factory=dict)  # low-rank codec, receiving end: per sender
    basis_sent: dict = field(default_factory=dict)  # low-rank codec: destination -> version it holds
    _stash: tuple[int, dict[str, torch.Tensor]] | None = None
    basis_announced: dict = field(default_factory=dict)  # low-rank codec: sender -> newest version it shipped us
    _seen: dict = field(default_factory=dict)  # swarm: (sender, step, micro-batch) taken recently, oldest first
    # swarm: the newest gradient messages sent back, by the same key, so a sender's retry gets its
    # gradient again (its retry window is a few steps of micro-batches; 64 covers it)
    _grad_cache: dict = field(default_factory=dict)
    coef_codec: MaskCodec | None = None
    # swarm routing (None: the local layout, replica r of stage s talks to replica r of s +- 1)
    peer_id: str | None = None
    next_hop: Callable[[], Address] | None = None  # the next-stage peer for a new activation
    # swarm: a step is M micro-batches of any sender (local step count); middle stages run
    # forwards on a stashed copy of the weights so a step may land between forward and backward
    local_steps: bool = False
    resolve: Callable[[str], Address] | None = None  # sender name -> its address
    compute: ComputeClock = field(default_factory=ComputeClock)  # seconds of compute per micro-batch
    keep_sent: dict = field(default_factory=dict)  # destination -> fraction of the configured payload last sent (mask.adapt)
    _mask_codecs: dict = field(default_factory=dict)  # mask scheme, adapting: drop -> its codec
    placement: Placement = CPU_FP32  # device and precision (peer/model/placement.py)
    _work: dict[str, torch.Tensor] | None = None  # mixed precision: the persistent low-precision working copy
    _work_of: tuple[int, ...] = ()  # the master weights' version counters the working copy was taken at

    def __post_init__(self) -> None:
        s, pl = self.stage, self.placement
        s.to(device=pl.device, dtype=pl.master_dtype)  # fp32 master weights where they compute
        s.checkpointing = pl.checkpointing
        self.optimizer = StageOptimizer(list(s.named_parameters()), s.decoder_matrices(), self.cfg.spectral, self.cfg.optim)
        if s.index > 0 and self.cfg.mask.enabled and self.cfg.mask.fill in USES_PRIOR:
            self.prior = TokenPrior(s.vocab_size, s.hidden_size, self.cfg.mask.prior_momentum, device=pl.device)
        m = self.cfg.mask
        if m.scheme == "lowrank":
            self.coef_codec = MaskCodec(MaskConfig(values=m.values, seed=m.seed))
            if not s.is_last:
                self.basis_out = BasisLearner(s.vocab_size, s.hidden_size, m.rank, m.basis_refresh, max_rows=m.prior_rows, device=pl.device)

    @property
    def compute_dtype(self) -> torch.dtype:
        """What the stage's layers compute in (the master weights are float32 regardless)."""
        return self.placement.compute_dtype

    @property
    def link_codec(self) -> MaskCodec:
        """What encodes tensors on this worker's links: coefficients (low-rank) or hidden states."""
        return self.coef_codec or self.codec

    @property
    def addr(self) -> Address:
        return self.peer_id or (self.stage.index, self.replica)

    @property
    def name(self) -> str:
        return self.peer_id or f"stage{self.stage.index}.r{self.replica}"

    # -- messages ---------------------------------------------------------------------------
    def _header(self, step: int, mb: int, boundary: int) -> pb.MicroBatchHeader:
        return pb.MicroBatchHeader(run_id=self.run_id, micro_batch_id=mb, step=step, sender=self.name, boundary=boundary)

    def drain(self) -> None:
        for channel, inbox in (("forward", self.inbox_fwd), ("backward", self.inbox_bwd)):
            while (data := self.transport.poll(self.addr, channel)) is not None:
                cls = pb.ActivationChunk if channel == "forward" else pb.GradientChunk
                msg = parse_message(cls, data, MAX_MESSAGE_BYTES)
                if msg.header.run_id != self.run_id:
                    raise WireError(f"{self.name}: message for run {msg.header.run_id!r}, expected {self.run_id!r}")
                inbox.append(msg)

    def validate(self, channel: str, msg: pb.ActivationChunk | pb.GradientChunk) -> None:
        """Vet an inbound message fully before it is queued (runs on the transport's threads).

        Raises WireError / TensorError naming the field: wrong boundary, token ids out of range,
        shapes or dtypes that do not fit this stage, NaN/Inf values. Decodes the tensors once
        here and again when the worker uses them (a cost accepted for now).
        """
        s, b = self.stage, msg.header.boundary
        if channel == "forward":
            if b != s.index - 1:
                raise WireError(f"header.boundary={b}: stage {s.index} receives activations on boundary {s.index - 1}")
            p = self.cfg.pipeline  # the run's micro-batch shape, pinned: a larger one would cost this stage more than its sender
            ids = check_token_window(msg.token_ids, s.vocab_size, (p.micro_batch_size, p.seq_len + 1))[:, :-1].long()
            key = dict(boundary=b, step=msg.header.step, micro_batch=msg.header.micro_batch_id)
            if self.coef_codec is not None:
                self.coef_codec.decode(msg.hidden, expect_shape=self._coef_shape(msg.hidden, ids), expect_dtype=LINK_DTYPE, **key)
                if msg.HasField("basis"):
                    self._decode_basis(msg)
                    self.basis_announced[msg.header.sender] = msg.basis_version
                elif self.basis_announced.get(msg.header.sender) != msg.basis_version:
                    raise WireError(f"basis_version={msg.basis_version}: this peer has no such basis from {msg.header.sender!r}; send it again")
            else:
                self._inbound_codec(msg.hidden).decode(msg.hidden, expect_shape=(*ids.shape, s.hidden_size), expect_dtype=LINK_DTYPE, **key)
            return
        if b != s.index:
            raise WireError(f"header.boundary={b}: stage {s.index} receives gradients on boundary {s.index}")
        job = self.inflight.get((msg.header.step, msg.header.micro_batch_id))
        if job is None:
            raise WireError(f"gradient for unknown micro-batch (step={msg.header.step}, micro_batch_id={msg.header.micro_batch_id})")
        last = job.coefs if job.basis is not None else s.hidden_size
        (job.codec_out or self.link_codec).decode(msg.grad, expect_shape=(*job.out.shape[:-1], last), expect_dtype=LINK_DTYPE, boundary=b, step=msg.header.step, micro_batch=msg.header.micro_batch_id)

    def _coef_shape(self, hidden: pb.TensorPayload, ids: torch.Tensor) -> tuple[int, ...]:
        """The coefficient shape a low-rank message may have: [*ids, k] with k between the
        adapting sender's floor (mask.min_keep of mask.rank) and mask.rank."""
        m = self.cfg.mask
        lo = coefficients(m.rank, 0.0, m.min_keep) if m.adapt else m.rank
        k = int(hidden.shape[-1]) if len(hidden.shape) == ids.dim() + 1 else -1
        if not lo <= k <= m.rank:
            raise WireError(f"hidden.shape={list(hidden.shape)}: expected [{', '.join(map(str, ids.shape))}, k] with k in [{lo}, {m.rank}] coefficients per token")
        return (*ids.shape, k)

    def coefs_for(self, dst: Address, tokens: int, fixed: int) -> int:
        """Low-rank codec: coefficients per token for `dst` (peer/pipeline/linktune.py): all
        `mask.rank` unless the link's measured bandwidth cannot carry them within
        `mask.link_target` of this stage's compute time per micro-batch. `fixed`: the message's
        bytes besides the coefficients (token ids, header)."""
        m = self.cfg.mask
        if not m.adapt:
            self.keep_sent[dst] = 1.0
            return m.rank
        per_coef = self.link_codec.bytes_per_element() * tokens
        f = keep_fraction(m.rank * per_coef, fixed, self.transport.link_bps(dst, "forward"), self.compute.per_micro_batch, m.link_target, m.min_keep)
        k = coefficients(m.rank, f, m.min_keep)
        self.keep_sent[dst] = k / m.rank
        return k

    def mask_codec_for(self, dst: Address, elements: int, fixed: int) -> MaskCodec:
        """Mask scheme: the codec for `dst`: the config's drop unless the link's measured
        bandwidth cannot carry its kept values within `mask.link_target` of this stage's compute
        time per micro-batch; then a higher drop on a grid of 1/256 (exact in float32, which the
        message carries), keep at least `mask.min_keep` of the configured keep. drop = 0 means
        dense: never masked."""
        m = self.cfg.mask
        if not (m.adapt and m.enabled):
            self.keep_sent[dst] = 1.0
            return self.codec
        f = keep_fraction(elements * self.codec.bytes_per_element(), fixed, self.transport.link_bps(dst, "forward"), self.compute.per_micro_batch, m.link_target, m.min_keep)
        j = max(self._keep_floor(), math.floor(f * m.keep * KEEP_GRID + 1e-9))
        if j >= m.keep * KEEP_GRID:
            self.keep_sent[dst] = 1.0
            return self.codec
        self.keep_sent[dst] = j / KEEP_GRID / m.keep
        return self._mask_codec((KEEP_GRID - j) / KEEP_GRID)

    def _keep_floor(self) -> int:
        """Mask scheme, adapting: the least keep, in 1/KEEP_GRID steps (min_keep of the configured keep, at least one step)."""
        return max(math.ceil(self.cfg.mask.min_keep * self.cfg.mask.keep * KEEP_GRID - 1e-9), 1)

    def _mask_codec(self, drop: float) -> MaskCodec:
        if drop not in self._mask_codecs:
            self._mask_codecs[drop] = MaskCodec(dataclasses.replace(self.cfg.mask, drop=drop))
        return self._mask_codecs[drop]

    def _inbound_codec(self, hidden: pb.TensorPayload) -> MaskCodec:
        """Mask scheme: the codec for an inbound tensor: the config's, or (an adapting sender)
        one of a higher drop on the 1/256 grid, keeping at least `mask.min_keep` of the
        configured keep. Anything else: WireError naming the drop."""
        m, c = self.cfg.mask, hidden.compression
        if c.kind != pb.Compression.BERNOULLI_MASK or c.drop == as_f32(m.drop):
            return self.codec
        keep = 1.0 - c.drop
        j = keep * KEEP_GRID
        floor = self._keep_floor()
        if not (m.adapt and m.enabled and j == int(j) and floor <= j < m.keep * KEEP_GRID):
            raise WireError(f"Compression.drop={c.drop:.7g}: this peer masks with drop={m.drop!r}" + (f" or, adapting, 1 - j/{KEEP_GRID} with j in [{floor}, {m.keep * KEEP_GRID:.4g})" if m.adapt and m.enabled else ""))
        return self._mask_codec(c.drop)

    def _mb_key(self, step: int, mb_in_step: int) -> int:
        return self.replica * self.cfg.pipeline.micro_batches + mb_in_step

    # -- forward ----------------------------------------------------------------------------
    def _weights_for(self, step: int) -> dict[str, torch.Tensor] | None:
        """None: run on the live weights. Else the low-precision working copy (mixed precision),
        or stashed (optionally look-ahead) weights, in the compute dtype, for a forward ahead of
        the optimizer."""
        dtype = self.compute_dtype
        if self.local_steps:
            if self.stage.is_first or self.stage.is_last:
                return self._working()  # stage 0 keeps its own step order; the last stage's backward is immediate
            if self._stash is None or self._stash[0] != self.version:
                self._stash = (self.version, {n: p.detach().to(dtype, copy=True).requires_grad_(True) for n, p in self.stage.named_parameters()})
            return self._stash[1]
        delay = step - self.version
        if delay == 0:
            return self._working()
        self.forwards_ahead += 1
        stash = {}
        for name, p in self.stage.named_parameters():
            w = p.detach()
            if self.cfg.pipeline.staleness_correction == "lookahead" and self.last_delta is not None:
                w = w + delay * self.last_delta[name]
            stash[name] = w.to(dtype, copy=True).requires_grad_(True)
        return stash

    def _working(self) -> dict[str, torch.Tensor] | None:
        """Mixed precision: one persistent low-precision copy of the master weights, refreshed in
        place whenever a master weight changed (an optimizer step, an averaging round, a loaded
        state: each bumps the tensor's version counter). None in full precision: the live weights."""
        if not self.placement.mixed:
            return None
        params = list(self.stage.named_parameters())
        versions = tuple(p._version for _, p in params)
        if self._work is None:
            self._work = {n: p.detach().to(self.compute_dtype, copy=True).requires_grad_(True) for n, p in params}
        elif versions != self._work_of:
            with torch.no_grad():
                for n, p in params:
                    self._work[n].copy_(p)
        self._work_of = versions
        return self._work

    def _run(self, x: torch.Tensor, stash: dict[str, torch.Tensor] | None) -> torch.Tensor:
        if stash is None:
            return self.stage(x)
        return functional_call(self.stage, stash, (x,), strict=False)

    def can_forward(self, step: int) -> bool:
        if self.local_steps and not self.stage.is_first:
            return True
        return step - self.version <= self.cfg.pipeline.max_staleness

    def inject(self, window: torch.Tensor, step: int, j: int) -> None:
        """Stage 0: start micro-batch j of `step` from token windows [B, T+1] (on the host)."""
        t0 = time.perf_counter()
        self.stage.check_input(window[:, :-1])  # ids checked on the host: no device sync
        stash = self._weights_for(step)
        out = self._run(self.placement.to_device(window[:, :-1]), stash)
        mb = self._mb_key(step, j)
        basis, k, codec = self._send_forward(out, window, step, mb)
        self.inflight[(step, mb)] = _InFlight(step, None, out, stash, window, basis, coefs=k, codec_out=codec)
        self.compute.add(time.perf_counter() - t0)

    def _send_forward(self, out: torch.Tensor, window: torch.Tensor, step: int, mb: int) -> tuple[BasisState | None, int, MaskCodec]:
        """Encode and send this stage's output; returns the low-rank basis used, if any, the
        coefficients per token sent and the codec that encoded them."""
        b = self.stage.index
        msg = pb.ActivationChunk(header=self._header(step, mb, b), token_ids=tensor_to_proto(window.to(token_dtype(self.stage.vocab_size))))
        dst = self.next_hop() if self.next_hop else (b + 1, self.replica)
        h, state, k, codec = out.detach(), None, 0, self.link_codec
        if self.basis_out is not None:
            ids = self.placement.to_device(window[:, :-1])
            self.basis_out.observe(h, ids)
            self.basis_out.maybe_refresh(step)
            state = self.basis_out.current
            if self.basis_sent.get(dst) != state.version:  # a receiver gets each version once (every basis_refresh steps)
                msg.basis_prior.CopyFrom(tensor_to_proto(state.prior.half().cpu()))
                msg.basis.CopyFrom(tensor_to_proto(state.basis.half().cpu()))
                if state.row_ids is not None:
                    msg.basis_prior_ids.CopyFrom(tensor_to_proto(state.row_ids.cpu()))
                self.basis_sent[dst] = state.version
            msg.basis_version = state.version
            k = self.coefs_for(dst, ids.numel(), msg.header.ByteSize() + msg.token_ids.ByteSize() + 16)
            h = state.project(h.float(), ids, k)
        else:
            codec = self.mask_codec_for(dst, h.numel(), msg.header.ByteSize() + msg.token_ids.ByteSize() + 16)
        msg.hidden.CopyFrom(codec.encode(self.placement.to_host(h), boundary=b, step=step, micro_batch=mb))
        self.transport.send(self.addr, dst, "forward", msg.SerializeToString())
        return state, k, codec

    def forward_one(self) -> bool:
        """Process the oldest activation whose step is within the staleness bound."""
        if not self.inbox_fwd or not self.can_forward(self.inbox_fwd[0].header.step):
            return False
        msg = self.inbox_fwd.popleft()
        step, mb, b = msg.header.step, msg.header.micro_batch_id, self.stage.index - 1
        if self.local_steps:  # a sender's retry may duplicate a micro-batch we already took
            key = (msg.header.sender, step, mb)
            if key in self._seen:
                # a retry: the sender lost our gradient (or gave up waiting); send it again rather
                # than computing the micro-batch twice. Still in flight here: it will come.
                sent = self._grad_cache.get(key)
                if sent is not None:
                    self.transport.send(self.addr, sent[0], "backward", sent[1])
                return True
            self._seen[key] = None
            while len(self._seen) > 4096:
                self._seen.pop(next(iter(self._seen)))
        t0 = time.perf_counter()
        pl = self.placement
        window = proto_to_tensor(msg.token_ids).to(torch.long)
        ids = window[:, :-1]  # on the host (the prior's checks); ids_dev for what runs on the device
        ids_dev = pl.to_device(ids)
        shape = (*ids.shape, self.stage.hidden_size)
        codec_in = self.coef_codec or self._inbound_codec(msg.hidden)
        if self.coef_codec is not None:
            x, h = self._lift(msg, ids_dev, b, step, mb)
        else:
            x = pl.to_device(codec_in.decode(msg.hidden, expect_shape=shape, boundary=b, step=step, micro_batch=mb), self.compute_dtype)
            x.requires_grad_(True)  # the leaf whose gradient goes back: kept entries only
            h = x
        if self.cfg.mask.enabled:
            keep = codec_in.keep_mask(shape, boundary=b, step=step, micro_batch=mb, device=pl.device)
            prior = self.prior.fill(ids) if self.prior is not None else None
            h = reconstruct(x, keep, codec_in.cfg.keep, self.cfg.mask.fill, prior)
            if self.prior is not None:
                self.prior.observe(ids, x.detach(), keep, checked=True)  # decoded values: already vetted as finite
        stash = self._weights_for(step)
        out = self._run(h, stash)
        if self.stage.is_last:
            loss = lm_loss(out, pl.to_device(window[:, 1:]))
            (loss / self.cfg.pipeline.micro_batches).backward()
            self.losses[step].append(loss.detach())  # a device tensor: read in batches, never per micro-batch
            self._finish_backward(_InFlight(step, x, out, stash, window, sender=msg.header.sender, codec_in=codec_in), mb)
        else:
            basis, k, codec = self._send_forward(out, window, step, mb)
            self.inflight[(step, mb)] = _InFlight(step, x, out, stash, window, basis, msg.header.sender, k, codec_in, codec)
        self.compute.add(time.perf_counter() - t0)
        return True

    def _decode_basis(self, msg: pb.ActivationChunk) -> BasisState:
        """The (prior, basis) pair a message carries, checked against this stage's sizes: the prior
        is [V, H], or [R, H] with R-1 distinct-enough token ids in range (`basis_prior_ids`)."""
        H, r, V = self.stage.hidden_size, self.cfg.mask.rank, self.stage.vocab_size
        row_ids = None
        if msg.HasField("basis_prior_ids"):
            row_ids = proto_to_tensor(msg.basis_prior_ids, expect_dtype=torch.int32)
            if row_ids.dim() != 1 or not 0 < len(row_ids) < V or int(row_ids.min()) < 0 or int(row_ids.max()) >= V:
                raise WireError(f"basis_prior_ids: must be 1-D with 1..{V - 1} token ids in [0, {V}); got shape {tuple(row_ids.shape)}")
        rows = V if row_ids is None else len(row_ids) + 1
        prior = proto_to_tensor(msg.basis_prior, expect_shape=(rows, H), expect_dtype=torch.float16).float()
        basis = proto_to_tensor(msg.basis, expect_shape=(H, r), expect_dtype=torch.float16).float()
        dev = self.placement.device
        return BasisState(msg.basis_version, prior.to(dev), basis.to(dev), None if row_ids is None else row_ids.to(dev), V)

    def _lift(self, msg: pb.ActivationChunk, ids: torch.Tensor, b: int, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Low-rank codec, receiving end: (coefficient leaf, rebuilt hidden state), on the device;
        `ids` on the device. The lift runs in float32 (the basis's precision), then the layers'
        dtype."""
        v, sender = msg.basis_version, msg.header.sender
        if msg.HasField("basis"):
            self.basis_in[sender] = self._decode_basis(msg)
        state = self.basis_in.get(sender)
        if state is None or state.version != v:
            have = state.version if state else None
            raise WireError(f"{self.name}: basis_version={v} from {sender!r} unknown (have {have})")
        c = self.placement.to_device(self.coef_codec.decode(msg.hidden, expect_shape=self._coef_shape(msg.hidden, ids), boundary=b, step=step, micro_batch=mb))
        c.requires_grad_(True)
        return c, state.lift(c, ids).to(self.compute_dtype)

    # -- backward ---------------------------------------------------------------------------
    def backward_one(self) -> bool:
        if not self.inbox_bwd:
            return False
        msg = self.inbox_bwd.popleft()
        mb = msg.header.micro_batch_id
        job = self.inflight.pop((msg.header.step, mb), None)
        if job is None:
            raise WireError(f"{self.name}: gradient for unknown micro-batch (step={msg.header.step}, micro_batch_id={mb})")
        t0 = time.perf_counter()
        pl = self.placement
        if job.basis is not None:  # dL/dh = dL/dc B^T
            g = pl.to_device(self.link_codec.decode(msg.grad, expect_shape=(*job.out.shape[:-1], job.coefs), boundary=self.stage.index, step=job.step, micro_batch=mb))
            grad = g @ job.basis.basis[:, : job.coefs].T
        else:
            grad = pl.to_device((job.codec_out or self.codec).decode(msg.grad, expect_shape=tuple(job.out.shape), boundary=self.stage.index, step=job.step, micro_batch=mb))
        job.out.backward(grad.to(job.out.dtype))
        self._finish_backward(job, mb)
        self.compute.add(time.perf_counter() - t0)
        return True

    def _finish_backward(self, job: _InFlight, mb: int) -> None:
        self.compute.micro_batch_done()
        if job.stash is not None:  # ran on stashed weights: its gradient belongs to step job.step
            buf = self.grad_buf[-1 if self.local_steps else job.step]
            master = self.placement.master_dtype
            for name, w in job.stash.items():
                if w.grad is not None:  # summed in the master dtype: bf16 sums of many micro-batches lose bits
                    buf[name] = buf[name] + w.grad.to(master) if name in buf else w.grad.to(master, copy=True)
                    w.grad = None
        if job.x is not None:
            b = self.stage.index - 1
            msg = pb.GradientChunk(
                header=self._header(job.step, mb, b),
                grad=(job.codec_in or self.link_codec).encode(self.placement.to_host(job.x.grad), boundary=b, step=job.step, micro_batch=mb),
            )
            dst = self.resolve(job.sender) if self.resolve else (b, self.replica)
            data = msg.SerializeToString()
            if self.local_steps:  # cached before sending: a send that fails (sender not known yet) is redone on its retry
                self._grad_cache[(job.sender, job.step, mb)] = (dst, data)
                while len(self._grad_cache) > 64:
                    self._grad_cache.pop(next(iter(self._grad_cache)))
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
        before = None
        if self.cfg.pipeline.max_staleness > 0:
            before = {n: p.detach().clone() for n, p in self.stage.named_parameters()}
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.compute.step()
        if before is not None:
            self.last_delta = {n: p.detach() - before[n] for n, p in self.stage.named_parameters()}
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
