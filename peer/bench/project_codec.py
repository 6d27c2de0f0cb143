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
    # transform: the part of each of the four costs above that runs where the activations live
    # (rotate, quantise and pack; unpack, expand and rotate back), as measured here, and what it
    # is on a device: one [tokens, H] x [H, H] product and about DEVICE_PASSES passes over the
    # micro-batch's values (`on_device`)
    device_s: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    device_flops: float = 0.0
    device_values: int = 0
    device_passes: tuple[int, int, int, int] = (
        0,
        0,
        0,
        0,
    )  # per cost: DEVICE_PASSES, plus DITHER_PASSES where that direction dithers


DEVICE_PASSES = 24  # elementwise passes of 4 bytes per value in a transform encode or decode (quantise, round, clamp, pack's shifts; unpack's)
DITHER_PASSES = 48  # and a dithered direction's offsets: the index, two rounds of the integer hash, the fraction (int64: 8 bytes a pass)


MEASURE_MAX_ELEMENTS = 1 << 21


def measured_sequences(B: int, T: int, H: int) -> tuple[int, float]:
    """(sequences timed, the factor to the micro-batch's B): at most MEASURE_MAX_ELEMENTS values."""
    b = B
    while b > 1 and b * T * H > MEASURE_MAX_ELEMENTS:
        b //= 2
    return b, B / b


def measure_codec(mode: str, dims: ModelDims, shape: Shape, names: Names = SWARM_NAMES) -> CodecCost:
    """Run the app's wire path for one micro-batch of `mode` here (one thread) and time it."""
    import torch

    from peer.codec.basis import BasisLearner
    from peer.pipeline.inbound import MAX_MESSAGE_BYTES, check_token_window
    from peer.wire import anchormesh_pb2 as pb
    from peer.wire.tensors import parse_message, proto_to_tensor, tensor_to_proto, token_dtype

    mask = mode_mask(mode)
    if mask.scheme == "transform":
        return measure_transform_codec(mask, dims, shape, names)
    codec = link_codec(mask)
    H, V = dims.hidden, dims.vocab
    B, T = shape.micro_batch_size, shape.seq_len
    b, scale = measured_sequences(B, T, H)
    lowrank = mask.scheme == "lowrank"
    width = mask.rank if lowrank else H
    key = dict(boundary=0, step=names.step, micro_batch=names.micro_batch_id)
    gen = torch.Generator().manual_seed(0)
    with OneThread():
        window = torch.randint(0, V, (b, T + 1), generator=gen)
        ids = window[:, :-1]
        out = torch.randn(b, T, H, generator=gen)
        rows, with_ids = prior_rows(mask, V)
        learner = (
            BasisLearner(V, H, mask.rank, mask.basis_refresh, **({"max_rows": mask.prior_rows} if with_ids else {}))
            if lowrank
            else None
        )
        if learner is not None:
            while sum(r.shape[0] for r in learner.rows) < learner.buffer_tokens:
                learner.observe(torch.randn(b, T, H, generator=gen), ids)
            refresh = time_call(
                lambda: learner.maybe_refresh(
                    learner._last_refresh_step + mask.basis_refresh if learner._last_refresh_step is not None else 0
                ),
                min_s=0.0,
                max_reps=3,
            )
        state = learner.current if learner is not None else None
        header = pb.MicroBatchHeader(
            run_id=names.run_id, micro_batch_id=names.micro_batch_id, step=names.step, sender=names.sender, boundary=0
        )

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
    return CodecCost(
        t_send_fwd * scale,
        t_recv_fwd * scale,
        t_send_bwd * scale,
        t_recv_bwd * scale,
        refresh if lowrank else 0.0,
        ship,
        scale,
    )


def measure_transform_codec(mask, dims: ModelDims, shape: Shape, names: Names = SWARM_NAMES) -> CodecCost:
    """The transform scheme's wire path, timed here on one thread with the app's own code
    (peer/pipeline/transform_link.py): encode (with the learner's observe) and serialise; the
    receiver's parse, host check, second parse and decode; the same for gradients; a refit of the
    activations' coder; a coder's shipping (to proto, two parses, two checks on the receiver)."""
    import torch

    from peer.codec import transform_wire as tw
    from peer.pipeline.inbound import MAX_MESSAGE_BYTES
    from peer.pipeline.transform_link import TransformLinks
    from peer.wire import anchormesh_pb2 as pb
    from peer.wire.tensors import parse_message, tensor_to_proto, token_dtype

    H, V = dims.hidden, dims.vocab
    B, T = shape.micro_batch_size, shape.seq_len
    b, scale = measured_sequences(B, T, H)
    key = dict(boundary=0, step=names.step, micro_batch=names.micro_batch_id)
    gen = torch.Generator().manual_seed(0)
    with OneThread():
        sender = TransformLinks(mask, H, produces_forward=True, produces_backward=False)
        receiver = TransformLinks(mask, H, produces_forward=False, produces_backward=True)
        out = torch.randn(b, T, H, generator=gen)
        learner = sender.learners["forward"]
        while sum(len(r) for r in learner.rows) < learner.buffer_rows:
            learner.observe(torch.randn(b, T, H, generator=gen), mask.sink)
        refresh = time_call(
            lambda: learner.maybe_refresh(
                10**9 if learner._last_fit is None else learner._last_fit + mask.basis_refresh
            ),
            min_s=0.0,
            max_reps=3,
        )
        header = pb.MicroBatchHeader(
            run_id=names.run_id, micro_batch_id=names.micro_batch_id, step=names.step, sender=names.sender, boundary=0
        )
        window = torch.randint(0, V, (b, T + 1), generator=gen)
        first = pb.ActivationChunk(header=header)
        first.hidden.CopyFrom(sender.encode("forward", out, "next", **key)[0])
        first.coder.CopyFrom(tw.coder_to_proto(learner.current))
        receiver.decode(
            first, expect_shape=(b, T, H), **key
        )  # the receiver holds the coder, as after the first message

        def send_fwd() -> bytes:
            msg = pb.ActivationChunk(header=header, token_ids=tensor_to_proto(window.to(token_dtype(V))))
            payload, _ = sender.encode("forward", out, "next", **key)
            msg.hidden.CopyFrom(payload)
            return msg.SerializeToString()

        data = send_fwd()

        def recv_fwd() -> torch.Tensor:
            m = parse_message(pb.ActivationChunk, data, MAX_MESSAGE_BYTES)  # the gRPC handler
            receiver.check(m, expect_shape=(b, T, H), **key)  # validate
            m = parse_message(pb.ActivationChunk, data, MAX_MESSAGE_BYTES)  # drain
            return receiver.decode(m, expect_shape=(b, T, H), **key)

        g_out = torch.randn(b, T, H, generator=gen)
        gheader = pb.MicroBatchHeader(
            run_id=names.run_id, micro_batch_id=names.micro_batch_id, step=names.step, sender=names.sender, boundary=0
        )
        first = pb.GradientChunk(header=gheader)
        payload, coder = receiver.encode("backward", g_out, "prev", **key)
        first.grad.CopyFrom(payload)
        first.coder.CopyFrom(coder)
        sender_side = TransformLinks(mask, H, produces_forward=False, produces_backward=False)
        sender_side.decode(first, expect_shape=(b, T, H), **key)

        def send_bwd() -> bytes:
            msg = pb.GradientChunk(header=gheader)
            msg.grad.CopyFrom(receiver.encode("backward", g_out, "prev", **key)[0])
            return msg.SerializeToString()

        gdata = send_bwd()

        def recv_bwd() -> torch.Tensor:
            m = parse_message(pb.GradientChunk, gdata, MAX_MESSAGE_BYTES)
            sender_side.check(m, expect_shape=(b, T, H), **key)
            m = parse_message(pb.GradientChunk, gdata, MAX_MESSAGE_BYTES)
            return sender_side.decode(m, expect_shape=(b, T, H), **key)

        def ship() -> None:
            raw = pb.ActivationChunk(coder=tw.coder_to_proto(learner.current)).SerializeToString()
            for _ in range(2):  # validate, then decode: each takes the coder
                tw.coder_from_proto(
                    parse_message(pb.ActivationChunk, raw, MAX_MESSAGE_BYTES).coder, H, sender.max_bits("forward")
                )

        act_state, grad_state = learner.current, receiver.learners["backward"].current
        # the device's share rounds as the link does (a dither's offsets are device work too)
        act_seed = 1 if sender.dithers("forward") else None
        grad_seed = 1 if receiver.dithers("backward") else None
        stats, rates = sender.msg_stats("forward"), receiver.row_rates("backward")

        def act_encode() -> bytes:
            return act_state.encode(out, mask.sink, dither_seed=act_seed, msg_stats=stats)

        def grad_encode() -> bytes:
            return grad_state.encode(
                g_out,
                0,
                stochastic=True,
                generator=torch.Generator().manual_seed(0),
                dither_seed=grad_seed,
                row_rates=rates,
            )

        act_payload, grad_payload = act_encode(), grad_encode()

        def expand(
            state, payload, sink: int, seed: int | None, msg_stats: bool = False, row_rates: bool = False
        ) -> float:  # decode less its host parse: the device's share
            return max(
                0.0,
                time_call(
                    lambda: state.decode(
                        payload, b, T, sink, dither_seed=seed, msg_stats=msg_stats, row_rates=row_rates
                    )
                )
                - time_call(lambda: state.check(payload, b, T, sink, msg_stats, row_rates)),
            )

        device = (
            time_call(act_encode),
            expand(act_state, act_payload, mask.sink, act_seed, stats),
            time_call(grad_encode),
            expand(grad_state, grad_payload, 0, grad_seed, row_rates=rates),
        )
        costs = [time_call(f) for f in (send_fwd, recv_fwd, send_bwd, recv_bwd)]
        shipping = time_call(ship, min_s=0.0, max_reps=3)
    # each cost is its host part (messages, bytes, parses, checks) plus its device part; the host
    # part is the difference, floored at 0 (both are timed: at small shapes it is within noise)
    return CodecCost(
        *(c * scale for c in costs),
        refresh,
        shipping,
        scale,
        device_s=tuple(min(d, c) * scale for d, c in zip(device, costs)),
        device_flops=2.0 * B * T * H * H,
        device_values=B * T * H,
        device_passes=tuple(
            DEVICE_PASSES + (DITHER_PASSES if seed is not None else 0)
            for seed in (act_seed, act_seed, grad_seed, grad_seed)
        ),
    )


def on_device(cost: CodecCost, device) -> CodecCost:
    """`cost` with its device part (transform) at a GPU's rates instead of this CPU's: the coder
    rotates, quantises and packs where the activations live; parsing and bytes stay on the host.
    `device`: project_model.Device with `flops_per_s` set by the caller (None: the CPU itself)."""
    from dataclasses import replace

    if device is None or not cost.device_values:
        return cost
    on = [
        cost.device_flops / device.flops_per_s + passes * 4 * cost.device_values / (device.mem_gbps * 1e9)
        for passes in cost.device_passes
    ]
    four = [
        c - d + o for c, d, o in zip((cost.send_fwd, cost.recv_fwd, cost.send_bwd, cost.recv_bwd), cost.device_s, on)
    ]
    return replace(cost, send_fwd=four[0], recv_fwd=four[1], send_bwd=four[2], recv_bwd=four[3], device_s=tuple(on))
