"""Fuzzing every gRPC method (hypothesis): more than 2,000 generated messages against a live
peer's Stage service and a tracker's services.

Each message carries at least one defect (wrong run id or boundary, a bad shape, dtype or
payload size, NaN/Inf values, out-of-range token ids or prior rows, a huge declared size, an
unknown micro-batch or sender) or is random bytes. Oracles: a defective message is refused with
INVALID_ARGUMENT (RESOURCE_EXHAUSTED for an oversized one), never with UNKNOWN or INTERNAL (an
unhandled exception); nothing is queued for the stage loop; the stage's weights, optimizer
state and codec state are bit-identical afterwards; the services still answer.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from swarmkit import admit

from peer.codec.mask import MaskCodec
from peer.config import MaskConfig, ModelConfig, PipelineConfig, SecurityConfig, TrainConfig
from peer.daemon.main import PeerDaemon
from peer.model.loading import load_causal_lm
from peer.model.stages import split_model
from peer.pipeline.stage_server import SERVICE
from peer.pipeline.swarm_anchor import SwarmAnchor
from peer.pipeline.worker import StageWorker
from peer.security import auth
from peer.wire import anchormesh_pb2 as pb
from peer.wire.tensors import tensor_to_proto

RUN = "run-fuzz"
CFG = TrainConfig(
    model=ModelConfig(name="tiny-llama", num_stages=2, hidden_size=32, num_layers=2, num_heads=2, max_seq_len=16),
    mask=MaskConfig(scheme="lowrank", rank=4, values="fp16"),
    pipeline=PipelineConfig(micro_batch_size=2, micro_batches=2, seq_len=8, max_staleness=0),
)
B, T, H, R, V = CFG.pipeline.micro_batch_size, CFG.pipeline.seq_len, CFG.model.hidden_size, CFG.mask.rank, 256
FUZZ = settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
CRASH = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
# PERMISSION_DENIED: a message whose header.sender is not the authenticated caller
REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED)
SENT = {"n": 0}


def state_digest(d: PeerDaemon) -> str:
    """sha256 of every parameter, optimizer moment and codec table of the stage."""
    h = hashlib.sha256()
    for name, p in d.worker.stage.named_parameters():
        h.update(name.encode() + p.detach().numpy().tobytes())
        for k, v in sorted(d.worker.optimizer.opt.state.get(p, {}).items()):
            h.update(k.encode() + v.detach().numpy().tobytes())
    h.update(repr(sorted(d.worker.link.basis_in)).encode() + repr(sorted(d.worker.link.announced.items())).encode())
    return h.hexdigest()


@pytest.fixture(scope="module")
def peer():
    """A stage-1 (last-stage) peer, one real optimizer step behind it, serving its Stage service."""
    d = PeerDaemon("127.0.0.1:9")
    stage = split_model(load_causal_lm(CFG.model, seed=0), 2)[1]
    d.worker = StageWorker(stage, 0, CFG, d.transport, RUN, peer_id=d.peer_id, local_steps=True)
    d.anchor = SwarmAnchor(
        d.worker, CFG.anchor.micro_batches, d.router.siblings, eval_batches=CFG.pipeline.eval_batches
    )
    for p in stage.parameters():  # one optimizer step, so AdamW moments exist and are checked too
        p.grad = torch.randn_like(p) * 1e-3
    d.worker.optimizer.opt.step()
    d.transport.run_id, d.state = RUN, "active"
    d.transport.start()
    channel = auth.open_channel(d.address, admit(d, RUN, caller_id="fuzzer"))  # an admitted member sends the junk
    before = state_digest(d)
    yield d, channel
    try:
        assert SENT["n"] >= 2000, f"only {SENT['n']} messages were sent"
        ping = channel.unary_unary(
            f"/{SERVICE}/Ping",
            request_serializer=pb.PingRequest.SerializeToString,
            response_deserializer=pb.PingReply.FromString,
        )
        assert ping(pb.PingRequest(run_id=RUN), timeout=5).stage == 1  # still serving
        for ch in ("forward", "backward", "anchor_forward", "prior"):
            assert d.transport.poll(d.peer_id, ch) is None, f"a refused message reached the {ch} queue"
        assert state_digest(d) == before, "weights, optimizer or codec state changed"
    finally:
        channel.close()
        d.transport.close()


def send_stream(channel: grpc.Channel, method: str, data: bytes) -> grpc.StatusCode:
    SENT["n"] += 1
    call = channel.stream_stream(
        f"/{SERVICE}/{method}", request_serializer=None, response_deserializer=pb.Ack.FromString
    )
    try:
        list(call(iter([data]), timeout=10))
    except grpc.RpcError as exc:
        assert exc.code() not in CRASH, f"{method}: {exc.code().name}: {exc.details()}"
        return exc.code()
    return grpc.StatusCode.OK


# -- defective messages -----------------------------------------------------------------------------
def valid_forward() -> pb.ActivationChunk:
    codec = MaskCodec(CFG.mask)
    return pb.ActivationChunk(
        header=pb.MicroBatchHeader(run_id=RUN, micro_batch_id=3, step=0, sender="fuzzer", boundary=0),
        hidden=codec.encode(torch.randn(B, T, R), boundary=0, step=0, micro_batch=3),
        token_ids=tensor_to_proto(torch.randint(0, V, (B, T + 1)).to(torch.uint8)),
        basis_version=1,
        basis_prior=tensor_to_proto(torch.randn(V, H).half()),
        basis=tensor_to_proto(torch.randn(H, R).half()),
    )


def damage_tensor(t: pb.TensorPayload, how: str, draw) -> None:
    """One defect of a TensorPayload."""
    if how == "shape":
        dim = draw(st.integers(0, max(len(t.shape) - 1, 0)))
        if t.shape:
            t.shape[dim] = t.shape[dim] + draw(st.integers(1, 1000))
        else:
            t.shape.append(draw(st.integers(1, 1000)))
    elif how == "rank":
        t.shape.append(1) if draw(st.booleans()) else t.shape.insert(0, 2)
    elif how == "dtype":
        t.dtype = draw(st.integers(0, 40).filter(lambda x: x != t.dtype))
    elif how == "short":
        t.payload = t.payload[: max(len(t.payload) - draw(st.integers(1, 64)), 0)]
    elif how == "long":
        t.payload = t.payload + bytes(draw(st.integers(1, 64)))
    elif how == "huge":
        t.shape[:] = [draw(st.integers(1 << 20, 1 << 40)), draw(st.integers(1 << 10, 1 << 20))]
    elif how == "negative":
        t.shape[:] = [-draw(st.integers(1, 100)), *t.shape[1:]]
    else:  # "nan": one fp16 element NaN or +-Inf (dense fp16 payloads)
        raw = bytearray(t.payload)
        i = draw(st.integers(0, len(raw) // 2 - 1)) * 2
        raw[i : i + 2] = draw(st.sampled_from([b"\x00\x7e", b"\x00\x7c", b"\x00\xfc", b"\x01\x7c"]))
        t.payload = bytes(raw)


FORWARD_DEFECTS = [
    "run_id",
    "boundary",
    "tokens_range",
    "tokens_shape",
    "unknown_basis",
    "prior_ids",
    *(f"hidden:{h}" for h in ("shape", "rank", "dtype", "short", "long", "huge", "negative")),
    *(f"basis_prior:{h}" for h in ("shape", "dtype", "short", "nan", "huge")),
    *(f"basis:{h}" for h in ("shape", "long", "nan")),
]


@settings(FUZZ, max_examples=900)
@given(st.data())
def test_defective_forward_chunks_are_refused(peer, data) -> None:
    d, channel = peer
    msg, how = valid_forward(), data.draw(st.sampled_from(FORWARD_DEFECTS))
    if how == "run_id":
        msg.header.run_id = data.draw(st.text(max_size=40).filter(lambda s: s != RUN))
    elif how == "boundary":
        msg.header.boundary = data.draw(st.integers(1, (1 << 32) - 1))
    elif how == "tokens_range":
        ids = torch.randint(0, V, (B, T + 1), dtype=torch.int16)
        ids.view(-1)[data.draw(st.integers(0, B * (T + 1) - 1))] = data.draw(
            st.integers(V, 32767) | st.integers(-32768, -1)
        )
        msg.token_ids.CopyFrom(tensor_to_proto(ids))
    elif how == "tokens_shape":
        rows, cols = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 40).filter(lambda n: n != T + 1))
        msg.token_ids.CopyFrom(tensor_to_proto(torch.randint(0, V, (rows, cols)).to(torch.uint8)))
    elif how == "unknown_basis":  # coefficients for a basis this peer never received
        msg.ClearField("basis")
        msg.ClearField("basis_prior")
        msg.basis_version = data.draw(st.integers(0, 1 << 40))
    elif how == "prior_ids":
        n = data.draw(st.integers(1, 300))
        ids = torch.tensor(
            data.draw(st.lists(st.integers(-(1 << 31), (1 << 31) - 1), min_size=n, max_size=n)), dtype=torch.int32
        )
        if len(ids) < V and bool(((ids >= 0) & (ids < V)).all()):
            ids[0] = V  # at least one out of range
        msg.basis_prior_ids.CopyFrom(tensor_to_proto(ids))
        msg.basis_prior.CopyFrom(tensor_to_proto(torch.randn(n + 1, H).half()))
    else:
        field, kind = how.split(":")
        damage_tensor(getattr(msg, field), kind, data.draw)
    assert send_stream(channel, "Forward", msg.SerializeToString()) in REFUSED, how


@settings(FUZZ, max_examples=250)
@given(st.data())
def test_gradients_for_nothing_in_flight_are_refused(peer, data) -> None:
    """The last stage has no micro-batch in flight: every Backward is refused, whatever it holds."""
    _, channel = peer
    grad = torch.tensor(
        data.draw(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=16), min_size=1, max_size=64)),
        dtype=torch.float16,
    )
    msg = pb.GradientChunk(
        header=pb.MicroBatchHeader(
            run_id=data.draw(st.sampled_from([RUN, "", "x"])),
            micro_batch_id=data.draw(st.integers(0, 1 << 63)),
            step=data.draw(st.integers(0, 1 << 63)),
            boundary=data.draw(st.integers(0, 3)),
            sender=data.draw(st.sampled_from(["fuzzer", "other"]) | st.text(max_size=10)),
        ),
        grad=tensor_to_proto(grad),
    )
    assert send_stream(channel, "Backward", msg.SerializeToString()) in REFUSED


@settings(FUZZ, max_examples=300)
@given(st.data())
def test_defective_anchor_chunks_are_refused(peer, data) -> None:
    _, channel = peer
    msg = pb.ActivationChunk(
        header=pb.MicroBatchHeader(run_id=RUN, micro_batch_id=0, step=5, sender="fuzzer", boundary=0, dense=True),
        hidden=tensor_to_proto(torch.randn(B, T, H).half()),
        token_ids=tensor_to_proto(torch.randint(0, V, (B, T + 1)).to(torch.uint8)),
    )
    how = data.draw(
        st.sampled_from(["not_dense", "boundary", "micro_batch", "tokens", "shape", "dtype", "short", "nan", "huge"])
    )
    if how == "not_dense":
        msg.header.dense = False
    elif how == "boundary":
        msg.header.boundary = data.draw(st.integers(1, 1000))
    elif how == "micro_batch":
        msg.header.micro_batch_id = data.draw(st.integers(CFG.anchor.micro_batches, 1 << 63))
    elif how == "tokens":
        msg.token_ids.CopyFrom(tensor_to_proto(torch.randint(0, V, (B, T)).to(torch.uint8)))
    else:
        damage_tensor(msg.hidden, how, data.draw)
    assert send_stream(channel, "AnchorForward", msg.SerializeToString()) in REFUSED, how


@settings(FUZZ, max_examples=200)
@given(st.data())
def test_defective_anchor_gradients_and_priors_are_refused(peer, data) -> None:
    _, channel = peer
    if data.draw(st.booleans()):
        grad = pb.GradientChunk(
            header=pb.MicroBatchHeader(run_id=RUN, step=5, boundary=1, sender="fuzzer"),
            grad=tensor_to_proto(torch.randn(B, T, H).half()),
        )
        damage_tensor(
            grad.grad, data.draw(st.sampled_from(["dtype", "short", "long", "nan", "huge", "negative"])), data.draw
        )
        assert send_stream(channel, "AnchorBackward", grad.SerializeToString()) in REFUSED
    else:  # this peer has no stage mates: no sender is a live member of its group
        prior = pb.AnchorPrior(
            header=pb.MicroBatchHeader(
                run_id=RUN,
                sender=data.draw(st.sampled_from(["fuzzer", "other"]) | st.text(max_size=12)),
                micro_batch_id=1,
            ),
            stage=data.draw(st.integers(0, 5)),
            loss=data.draw(st.floats()),
        )
        for name in data.draw(st.lists(st.text(max_size=30), max_size=4)):
            prior.grads.add(name=name, tensor=tensor_to_proto(torch.randn(2, 2)))
        assert send_stream(channel, "Prior", prior.SerializeToString()) in REFUSED


METHODS = ["Forward", "Backward", "AnchorForward", "AnchorBackward", "Prior"]


@settings(FUZZ, max_examples=400)
@given(
    method=st.sampled_from(METHODS),
    raw=st.binary(max_size=2048)
    | st.builds(lambda b, n: valid_forward().SerializeToString()[:n] + b, st.binary(max_size=16), st.integers(0, 4000)),
)
def test_random_and_truncated_bytes_never_crash_a_handler(peer, method: str, raw: bytes) -> None:
    _, channel = peer
    send_stream(channel, method, raw)  # refused or (rarely) a well-formed message; never UNKNOWN/INTERNAL


@settings(FUZZ, max_examples=150)
@given(
    run_id=st.text(max_size=30),
    raw=st.binary(max_size=64),
    use_raw=st.booleans(),
    method=st.sampled_from(["Ping", "GetShard"]),
)
def test_ping_and_get_shard_answer_or_refuse(peer, run_id: str, raw: bytes, use_raw: bool, method: str) -> None:
    _, channel = peer
    SENT["n"] += 1
    req = (
        raw
        if use_raw
        else (
            pb.PingRequest(run_id=run_id) if method == "Ping" else pb.ShardRequest(run_id=run_id, sender="fuzzer")
        ).SerializeToString()
    )
    call = (channel.unary_unary if method == "Ping" else channel.unary_stream)(
        f"/{SERVICE}/{method}", request_serializer=None, response_deserializer=None
    )
    try:
        out = call(req, timeout=10)
        if method == "GetShard":
            list(out)
    except grpc.RpcError as exc:
        assert exc.code() in REFUSED, f"{method}: {exc.code().name}: {exc.details()}"
    else:
        assert use_raw or run_id in ("", RUN)


# -- the tracker --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tracker(tmp_path_factory: pytest.TempPathFactory):
    from bootstrap import keys
    from bootstrap.server import serve_tracker
    from bootstrap.tracker import Tracker
    from peer.security.identity import Identity, certificate_bytes

    t = Tracker(RUN, replace(CFG, security=SecurityConfig(calls_per_s=1e6)))
    secrets = keys.load_or_create(tmp_path_factory.mktemp("boot"))
    server, address = serve_tracker(t, "127.0.0.1", 0, secrets)
    me = Identity.generate()
    me.peer_id = "fuzzer"  # a member with the token: the junk passes the gate and reaches the handlers
    cert = secrets.tracker.sign(certificate_bytes(RUN, "fuzzer", me.public))
    channel = auth.open_channel(address, auth.Credentials(token=secrets.token, identity=me, certificate=cert))
    yield t, channel
    status = channel.unary_unary(
        "/anchormesh.v1.Status/GetStatus",
        request_serializer=pb.StatusRequest.SerializeToString,
        response_deserializer=pb.RunStatus.FromString,
    )
    assert status(pb.StatusRequest(), timeout=5).run_id == RUN  # still serving
    assert all(not p.peer_id or len(p.peer_id) < 1000 for p in t.peers.values())
    channel.close()
    server.stop(0)


TRACKER_METHODS = {
    "/anchormesh.v1.Tracker/Join": "unary",
    "/anchormesh.v1.Tracker/GetConfig": "unary",
    "/anchormesh.v1.Tracker/Leave": "unary",
    "/anchormesh.v1.Status/GetStatus": "unary",
    "/anchormesh.v1.Tracker/Heartbeat": "stream",
    "/anchormesh.v1.Status/WatchStatus": "server_stream",
}


def call_tracker(channel: grpc.Channel, method: str, data: bytes) -> grpc.StatusCode:
    SENT["n"] += 1
    kind = TRACKER_METHODS[method]
    try:
        if kind == "unary":
            channel.unary_unary(method, request_serializer=None, response_deserializer=None)(data, timeout=10)
        elif kind == "stream":
            next(
                iter(
                    channel.stream_stream(method, request_serializer=None, response_deserializer=None)(
                        iter([data]), timeout=10
                    )
                ),
                None,
            )
        else:
            stream = channel.unary_stream(method, request_serializer=None, response_deserializer=None)(data, timeout=10)
            next(iter(stream), None)
            stream.cancel()
    except grpc.RpcError as exc:
        assert exc.code() not in CRASH, f"{method}: {exc.code().name}: {exc.details()}"
        return exc.code()
    return grpc.StatusCode.OK


def reports(draw) -> pb.PeerReport:
    return pb.PeerReport(
        run_id=draw(st.sampled_from([RUN, "", "other"])),
        tokens=draw(st.integers(0, (1 << 64) - 1)),
        peer=pb.PeerInfo(
            peer_id=draw(st.just("fuzzer") | st.text(max_size=20)),
            stage=draw(st.integers(0, 1 << 31)),
            state=draw(st.sampled_from(["active", "idle", "dead", "left", "joining", "", "bogus"])),
            tokens_per_s=draw(st.floats()),
            loss=draw(st.floats()),
            step=draw(st.integers(0, (1 << 64) - 1)),
            capacity_tokens_per_s=draw(st.floats()),
            eval_loss=draw(st.floats()),
        ),
    )


@settings(FUZZ, max_examples=400)
@given(st.data())
def test_tracker_methods_refuse_or_answer_but_never_crash(tracker, data) -> None:
    t, channel = tracker
    method = data.draw(st.sampled_from(sorted(TRACKER_METHODS)))
    if data.draw(st.booleans()):
        raw = data.draw(st.binary(max_size=512))
    elif method.endswith("Join"):
        raw = pb.JoinRequest(
            run_id=data.draw(st.sampled_from([RUN, "", "x"])),
            peer_id=data.draw(st.just("fuzzer") | st.text(max_size=50)),
            grpc_address=data.draw(st.text(max_size=50)),
            code_version=data.draw(st.sampled_from(["", "0.0.0", __import__("peer").__version__])),
            dht_maddrs=data.draw(st.lists(st.text(max_size=200), max_size=50)),
        ).SerializeToString()
    elif method.endswith("Heartbeat"):
        raw = reports(data.draw).SerializeToString()
    elif method.endswith("Leave"):
        raw = pb.LeaveRequest(
            run_id=data.draw(st.sampled_from([RUN, "x"])),
            peer_id=data.draw(st.just("fuzzer") | st.text(max_size=20)),
            reason=data.draw(st.text(max_size=100)),
        ).SerializeToString()
    else:
        raw = b""
    code = call_tracker(channel, method, raw)
    assert code == grpc.StatusCode.OK or code in (
        *REFUSED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.PERMISSION_DENIED,
    ), code
    s = t.status()
    assert all(math.isfinite(x) for x in (s.tokens_per_s, s.pp_bytes_per_token, s.dp_bytes_per_token))
