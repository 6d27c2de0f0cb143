"""The low-rank codec on a link (`mask.scheme = "lowrank"`, peer/codec/basis.py).

The sender learns a per-token prior and a rank-`mask.rank` basis of its outputs around it, ships
each new (prior, basis) version to each destination once, and sends `k` coefficients per token
(encoded by a dense mask codec in `mask.values`); the receiver lifts them back, h = prior[id] +
B c. The gradient travels in coefficients too: dL/dc = dL/dh B, and the sender maps it back
with B^T.

With `mask.adapt`, a sender whose link cannot carry all `mask.rank` coefficients within
`mask.link_target` of its compute time per micro-batch sends fewer (down to `mask.min_keep` of
them); the receiver accepts any count within those bounds.
"""

from __future__ import annotations

import torch

from peer.codec.basis import BasisLearner, BasisState
from peer.codec.mask import MaskCodec
from peer.config import MaskConfig
from peer.errors import WireError
from peer.pipeline.bounds import scale_of
from peer.pipeline.codecs.base import LINK_DTYPE, LinkCodec, Scale, fixed_bytes, key_of
from peer.pipeline.linktune import coefficients, keep_fraction
from peer.pipeline.transport import Address
from peer.wire import anchormesh_pb2 as pb
from peer.wire.tensors import proto_to_tensor, tensor_to_proto

BUFFER_TOKENS = 4096  # BasisLearner's default residual buffer


class LowRankLink(LinkCodec):
    """`mask.scheme = "lowrank"`: `mask.rank` coefficients per token in a basis the sender learns
    from its recent outputs and ships, around a per-token prior (peer/codec/basis.py); gradients
    travel in the same basis. The swarm's default before the transform codec.

    Choose "transform" instead for a new run: on SmolLM2 (40 steps) rank 64 ended +7.1 % over
    dense's eval loss, the transform codec +0.86 % (docs/benchmarks.md). Low rank remains for a
    run that must send the fewest bytes per token and can afford that loss.

    Args:
        cfg: the run's codec settings, read here: `rank` (coefficients per token, at most the
            hidden size; more is closer to dense and costs bytes in proportion: the quality bench
            uses 64 for a pretrained model), `basis_refresh` (steps between refits of the basis
            and prior: each refit ships them to every next-stage peer), `prior_rows` (rows of the
            token prior sent per refit: a large vocabulary sends its most frequent tokens'),
            `values` (the coefficients' encoding), and with `adapt` between `min_keep * rank` and
            `rank` coefficients per link.
        stage: the stage this worker serves; every stage but the last learns a basis for its output.
        placement: where the stage computes; the basis learner and decoded tensors live there.
        transport: the worker's transport; an adapting link reads its measured rate from it.
        compute: the worker's compute time per micro-batch, the budget an adapting link fits into.
    """

    scheme = "lowrank"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        m, s = self.cfg, self.stage
        self.coef_codec = MaskCodec(
            MaskConfig(scheme="mask", values=m.values, seed=m.seed)
        )  # dense: encodes the coefficients
        self.basis_out = (
            BasisLearner(
                s.vocab_size,
                s.hidden_size,
                m.rank,
                m.basis_refresh,
                max_rows=m.prior_rows,
                device=self.placement.device,
            )
            if not s.is_last
            else None
        )
        self.basis_in: dict[str, BasisState] = {}  # sender -> the newest (prior, basis) it shipped us, checked
        self.basis_sent: dict[Address, int] = {}  # destination -> version it holds
        self.announced: dict[str, int] = {}  # sender -> newest version it shipped us (the transport's checks)

    # -- adapting and checking ------------------------------------------------------------------
    def coefs_for(self, dst: Address, tokens: int, fixed: int) -> int:
        """Coefficients per token for `dst`: all `mask.rank` unless the link's measured bandwidth
        cannot carry them within `mask.link_target` of this stage's compute time per micro-batch.
        `fixed`: the message's bytes besides the coefficients (token ids, header)."""
        m = self.cfg
        if not m.adapt:
            self.keep_sent[dst] = 1.0
            return m.rank
        per_coef = self.coef_codec.bytes_per_element() * tokens
        f = keep_fraction(
            m.rank * per_coef,
            fixed,
            self.transport.link_bps(dst, "forward"),
            self.compute.per_micro_batch,
            m.link_target,
            m.min_keep,
        )
        k = coefficients(m.rank, f, m.min_keep)
        self.keep_sent[dst] = k / m.rank
        return k

    def coef_shape(self, hidden: pb.TensorPayload, ids: torch.Tensor) -> tuple[int, ...]:
        """The coefficient shape a message may have: [*ids, k] with k between the adapting
        sender's floor (mask.min_keep of mask.rank) and mask.rank."""
        m = self.cfg
        lo = coefficients(m.rank, 0.0, m.min_keep) if m.adapt else m.rank
        k = int(hidden.shape[-1]) if len(hidden.shape) == ids.dim() + 1 else -1
        if not lo <= k <= m.rank:
            raise WireError(
                f"hidden.shape={list(hidden.shape)}: expected [{', '.join(map(str, ids.shape))}, k] with k in [{lo}, {m.rank}] coefficients per token"
            )
        return (*ids.shape, k)

    def decode_basis(self, msg: pb.ActivationChunk) -> BasisState:
        """The (prior, basis) pair a message carries, checked against this stage's sizes: the prior
        is [V, H], or [R, H] with R-1 distinct-enough token ids in range (`basis_prior_ids`)."""
        H, r, V = self.stage.hidden_size, self.cfg.rank, self.stage.vocab_size
        row_ids = None
        if msg.HasField("basis_prior_ids"):
            row_ids = proto_to_tensor(msg.basis_prior_ids, expect_dtype=torch.int32)
            if row_ids.dim() != 1 or not 0 < len(row_ids) < V or int(row_ids.min()) < 0 or int(row_ids.max()) >= V:
                raise WireError(
                    f"basis_prior_ids: must be 1-D with 1..{V - 1} token ids in [0, {V}); got shape {tuple(row_ids.shape)}"
                )
        rows = V if row_ids is None else len(row_ids) + 1
        prior = proto_to_tensor(msg.basis_prior, expect_shape=(rows, H), expect_dtype=torch.float16).float()
        basis = proto_to_tensor(msg.basis, expect_shape=(H, r), expect_dtype=torch.float16).float()
        dev = self.placement.device
        return BasisState(
            msg.basis_version, prior.to(dev), basis.to(dev), None if row_ids is None else row_ids.to(dev), V
        )

    # -- the link ----------------------------------------------------------------------------
    def encode_activation(
        self, msg: pb.ActivationChunk, h: torch.Tensor, ids: torch.Tensor, dst: Address
    ) -> tuple[BasisState, int]:
        learner = self.basis_out
        learner.observe(h, ids)
        learner.maybe_refresh(msg.header.step)
        state = learner.current
        if self.basis_sent.get(dst) != state.version:  # a receiver gets each version once (every basis_refresh steps)
            msg.basis_prior.CopyFrom(tensor_to_proto(state.prior.half().cpu()))
            msg.basis.CopyFrom(tensor_to_proto(state.basis.half().cpu()))
            if state.row_ids is not None:
                msg.basis_prior_ids.CopyFrom(tensor_to_proto(state.row_ids.cpu()))
            self.basis_sent[dst] = state.version
            self.state_bytes_sent += msg.basis_prior.ByteSize() + msg.basis.ByteSize() + msg.basis_prior_ids.ByteSize()
        msg.basis_version = state.version
        k = self.coefs_for(dst, ids.numel(), fixed_bytes(msg))  # a shipped basis is amortised, not budgeted per message
        c = state.project(h.float(), ids, k)
        msg.hidden.CopyFrom(self.coef_codec.encode(self.placement.to_host(c), **key_of(msg)))
        return state, k

    def decode_gradient(self, msg: pb.GradientChunk, sent: object, out_shape: tuple[int, ...]) -> torch.Tensor:
        state, k = sent  # dL/dh = dL/dc B^T
        g = self.placement.to_device(self.coef_codec.decode(msg.grad, expect_shape=(*out_shape[:-1], k), **key_of(msg)))
        return g @ state.basis[:, :k].T

    def check_gradient(self, msg: pb.GradientChunk, sent: object, out_shape: tuple[int, ...]) -> Scale:
        _, k = sent
        return scale_of(
            self.coef_codec.decode(msg.grad, expect_shape=(*out_shape[:-1], k), expect_dtype=LINK_DTYPE, **key_of(msg))
        )

    def decode_activation(
        self, msg: pb.ActivationChunk, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, object]:
        """(coefficient leaf, rebuilt hidden state), on the device. The lift runs in float32 (the
        basis's precision), then the layers' dtype."""
        pl, v, sender = self.placement, msg.basis_version, msg.header.sender
        if msg.HasField("basis"):
            self.basis_in[sender] = self.decode_basis(msg)
        state = self.basis_in.get(sender)
        if state is None or state.version != v:
            have = state.version if state else None
            raise WireError(f"basis_version={v} from {sender!r} unknown (have {have})")
        c = pl.to_device(
            self.coef_codec.decode(msg.hidden, expect_shape=self.coef_shape(msg.hidden, ids), **key_of(msg))
        )
        c.requires_grad_(True)
        return c, state.lift(c, pl.to_device(ids)).to(pl.compute_dtype), None

    def encode_gradient(self, msg: pb.GradientChunk, x: torch.Tensor, received: object, dst: Address) -> None:
        msg.grad.CopyFrom(self.coef_codec.encode(self.placement.to_host(x.grad), **key_of(msg)))

    def check_activation(self, msg: pb.ActivationChunk, ids: torch.Tensor) -> Scale:
        """Coefficients that fit, and a basis carried along or one its sender shipped before."""
        scale = scale_of(
            self.coef_codec.decode(
                msg.hidden, expect_shape=self.coef_shape(msg.hidden, ids), expect_dtype=LINK_DTYPE, **key_of(msg)
            )
        )
        if msg.HasField("basis"):
            self.decode_basis(msg)
            self.announced[msg.header.sender] = msg.basis_version
        elif self.announced.get(msg.header.sender) != msg.basis_version:
            raise WireError(
                f"basis_version={msg.basis_version}: this peer has no such basis from {msg.header.sender!r}; send it again"
            )
        return scale

    def forget_sent(self) -> None:
        self.basis_sent.clear()

    @classmethod
    def state_bytes(cls, cfg: MaskConfig, vocab_size: int, hidden_size: int, sends: bool, receives: bool) -> int:
        """The sender's per-token sums, counts and residual buffer; both ends' (prior, basis)
        version with its token -> row table."""
        V, H = vocab_size, hidden_size
        version = (min(cfg.prior_rows, V) * H + H * cfg.rank) * 4 + V * 8
        return ((V * H + V + BUFFER_TOKENS * (H + 1)) * 4 + version if sends else 0) + (version if receives else 0)

    @classmethod
    def label(cls, cfg: MaskConfig) -> str:
        return f"low-rank r={cfg.rank} {cfg.values}"
