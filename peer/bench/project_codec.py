"""CPU cost of the wire path for `bench project`: the app's own encode, serialise, parse and
decode (and the low-rank basis refresh and shipping) timed here on one thread. See
peer/bench/project.py's docstring, "codec"."""

from __future__ import annotations

from dataclasses import dataclass

from peer.bench.project_bytes import SWARM_NAMES, Names, link_codec, mode_mask, prior_rows
from peer.bench.project_compute import OneThread, time_call
from peer.bench.project_model import ModelDims, Shape


@dataclass
class CodecCost:
    """CPU seconds per micro-batch of the wire path (and per refresh of a low-rank basis)."""

    send_fwd: float  # sender: encode (low-rank: observe + project) + serialize
    recv_fwd: float  # receiver: parse, validate-decode, parse again, decode (+ lift)
    send_bwd: float  # receiver: gradient through the lift + encode + serialize
    recv_bwd: float  # sender: parse, validate-decode, parse again, decode (+ back through the basis)
    refresh: float  # sender: BasisLearner.maybe_refresh (SVD + prior), once per version
    ship_basis: float  # one (prior, basis) pair: to proto on the sender, two parses + two decodes on the receiver
    scaled_by: float  # measured on 1/scaled_by of the micro-batch's sequences, then scaled


MEASURE_MAX_ELEMENTS = 1 << 21


def measure_codec(mode: str, dims: ModelDims, shape: Shape, names: Names = SWARM_NAMES) -> CodecCost:
    """Run the app's wire path for one micro-batch of `mode` here (one thread) and time it."""
    import torch

    from peer.codec.basis import BasisLearner
    from peer.pipeline.inbound import MAX_MESSAGE_BYTES, check_token_window
    from peer.wire import anchormesh_pb2 as pb
    from peer.wire.tensors import parse_message, proto_to_tensor, tensor_to_proto, token_dtype

    mask = mode_mask(mode)
    codec = link_codec(mask)
    H, V = dims.hidden, dims.vocab
    B, T = shape.micro_batch_size, shape.seq_len
    b = B
    while b > 1 and b * T * H > MEASURE_MAX_ELEMENTS:
        b //= 2
    scale = B / b
    lowrank = mask.scheme == "lowrank"
    width = mask.rank if lowrank else H
    key = dict(boundary=0, step=names.step, micro_batch=names.micro_batch_id)
    gen = torch.Generator().manual_seed(0)
    with OneThread():
        window = torch.randint(0, V, (b, T + 1), generator=gen)
        ids = window[:, :-1]
        out = torch.randn(b, T, H, generator=gen)
        rows, with_ids = prior_rows(mask, V)
        learner = BasisLearner(V, H, mask.rank, mask.basis_refresh, **({"max_rows": mask.prior_rows} if with_ids else {})) if lowrank else None
        if learner is not None:
            while sum(r.shape[0] for r in learner.rows) < learner.buffer_tokens:
                learner.observe(torch.randn(b, T, H, generator=gen), ids)
            refresh = time_call(lambda: learner.maybe_refresh(learner._last_refresh_step + mask.basis_refresh if learner._last_refresh_step is not None else 0), min_s=0.0, max_reps=3)
        state = learner.current if learner is not None else None
        header = pb.MicroBatchHeader(run_id=names.run_id, micro_batch_id=names.micro_batch_id, step=names.step, sender=names.sender, boundary=0)

        def send_fwd() -> bytes:
            msg = pb.ActivationChunk(header=header, token_ids=tensor_to_proto(window.to(token_dtype(V))))
            h = out
            if learner is not None:
                learner.observe(h, ids)
                msg.basis_version = state.version
                h = state.project(h, ids)
            msg.hidden.CopyFrom(codec.encode(h, **key))
            return msg.SerializeToString()

        data = send_fwd()
        leaf: list = []

        def recv_fwd():
            m = parse_message(pb.ActivationChunk, data, MAX_MESSAGE_BYTES)  # the gRPC handler
            got = check_token_window(m.token_ids, V)[:, :-1].long()
            codec.decode(m.hidden, expect_shape=(*got.shape, width), **key)  # validate
            m = parse_message(pb.ActivationChunk, data, MAX_MESSAGE_BYTES)  # drain
            w = proto_to_tensor(m.token_ids).to(torch.long)
            x = codec.decode(m.hidden, expect_shape=(*w[:, :-1].shape, width), **key)
            x.requires_grad_(True)
            h = state.lift(x, w[:, :-1]) if state is not None else x
            leaf[:] = [x, h]

        recv_fwd()
        g_out = torch.randn(b, T, H, generator=gen)

        def send_bwd() -> bytes:
            x, h = leaf
            x.grad = None
            if state is not None:
                h.backward(g_out, retain_graph=True)  # dL/dc = dL/dh~ B, inside the stage's backward
                g = x.grad
            else:
                g = g_out
            msg = pb.GradientChunk(header=header, grad=codec.encode(g, **key))
            return msg.SerializeToString()

        gdata = send_bwd()

        def recv_bwd():
            m = parse_message(pb.GradientChunk, gdata, MAX_MESSAGE_BYTES)
            codec.decode(m.grad, expect_shape=(b, T, width), **key)  # validate
            m = parse_message(pb.GradientChunk, gdata, MAX_MESSAGE_BYTES)
            g = codec.decode(m.grad, expect_shape=(b, T, width), **key)
            if state is not None:
                g = g @ state.basis.T
            return g.to(torch.float32)

        t_send_fwd, t_recv_fwd = time_call(send_fwd), time_call(recv_fwd)
        t_send_bwd, t_recv_bwd = time_call(send_bwd), time_call(recv_bwd)
        ship = 0.0
        if state is not None:
            def ship_pair():
                m = pb.ActivationChunk(basis_version=state.version)
                m.basis_prior.CopyFrom(tensor_to_proto(state.prior.half()))
                m.basis.CopyFrom(tensor_to_proto(state.basis.half()))
                if getattr(state, "row_ids", None) is not None:
                    m.basis_prior_ids.CopyFrom(tensor_to_proto(state.row_ids))
                raw = m.SerializeToString()
                for _ in range(2):  # validate, then _lift
                    m2 = parse_message(pb.ActivationChunk, raw, MAX_MESSAGE_BYTES)
                    proto_to_tensor(m2.basis, expect_shape=(H, mask.rank)).float()
                    proto_to_tensor(m2.basis_prior, expect_shape=tuple(state.prior.shape)).float()
                    if m2.HasField("basis_prior_ids"):
                        proto_to_tensor(m2.basis_prior_ids)

            ship = time_call(ship_pair, min_s=0.0, max_reps=3)
    return CodecCost(t_send_fwd * scale, t_recv_fwd * scale, t_send_bwd * scale, t_recv_bwd * scale, refresh if lowrank else 0.0, ship, scale)
