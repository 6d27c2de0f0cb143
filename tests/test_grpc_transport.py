"""The runner over real gRPC streams on loopback: same results as in-process; bad chunks refused."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from peer.config import MaskConfig, ModelConfig, OptimConfig, PipelineConfig, TrainConfig
from peer.model.loading import load_causal_lm
from peer.model.stages import merged_state_dict
from peer.pipeline.grpc_transport import GrpcTransport
from peer.pipeline.local import LocalPipelineRunner
from peer.pipeline.stage_server import SERVICE
from peer.wire import anchormesh_pb2 as pb
from peer.wire.tensors import tensor_to_proto

MODEL = ModelConfig(name="tiny-llama", hidden_size=32, num_layers=2, num_heads=2, max_seq_len=32)
PIPE = PipelineConfig(micro_batch_size=2, micro_batches=2, seq_len=16, max_staleness=0)


def windows(step: int, replica: int, j: int) -> torch.Tensor:
    return torch.randint(
        0,
        256,
        (PIPE.micro_batch_size, PIPE.seq_len + 1),
        generator=torch.Generator().manual_seed(100 * step + 10 * replica + j),
    )


def _runner(mask: MaskConfig, transport=None) -> LocalPipelineRunner:
    cfg = TrainConfig(model=MODEL, mask=mask, pipeline=PIPE, optim=OptimConfig(lr=1e-3), steps=3)
    return LocalPipelineRunner(cfg, load_causal_lm(MODEL, seed=0), windows, transport=transport, run_id="run-a")


@pytest.mark.parametrize(
    "mask",
    # adapt off: the link tuning would read loopback round trips against millisecond micro-batches
    [
        MaskConfig(scheme="mask", drop=0.9, adapt=False),
        MaskConfig(scheme="lowrank", rank=4, values="int8", basis_refresh=2, adapt=False),
        MaskConfig(scheme="lowrank", rank=4, basis_refresh=2, prior_rows=16, adapt=False),
        MaskConfig(scheme="transform", bits=2.0, grad_bits=1.0, basis_refresh=1, adapt=False),
    ],
    ids=["mask", "lowrank", "lowrank_top_rows", "transform"],
)
def test_grpc_transport_gives_the_same_training_as_in_process(mask: MaskConfig) -> None:
    local = _runner(mask)
    remote = _runner(mask, GrpcTransport("run-a"))
    try:
        a, b = local.run(), remote.run()
        assert [r.loss for r in a] == [r.loss for r in b]
        assert local.transport.total_bytes() == remote.transport.total_bytes()
        sa, sb = merged_state_dict(local.stages()), merged_state_dict(remote.stages())
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        assert not remote.transport.rejected and not remote.transport.send_errors
    finally:
        local.close()
        remote.close()


@pytest.fixture
def served():
    transport = GrpcTransport("run-a", max_message_bytes=1 << 20)
    runner = _runner(MaskConfig(scheme="mask", drop=0.9), transport)
    yield runner, transport
    runner.close()


def _forward(target: str, *chunks: bytes) -> grpc.RpcError | None:
    with grpc.insecure_channel(target) as ch:
        call = ch.stream_stream(f"/{SERVICE}/Forward", request_serializer=None, response_deserializer=pb.Ack.FromString)
        try:
            list(call(iter(chunks), timeout=10))
        except grpc.RpcError as exc:
            return exc
    return None


def _chunk(runner: LocalPipelineRunner, **override) -> pb.ActivationChunk:
    codec = runner.codec
    h = torch.randn(PIPE.micro_batch_size, PIPE.seq_len, MODEL.hidden_size)
    msg = pb.ActivationChunk(
        header=pb.MicroBatchHeader(run_id="run-a", micro_batch_id=7, step=0, sender="test", boundary=0),
        hidden=codec.encode(h, boundary=0, step=0, micro_batch=7),
        token_ids=tensor_to_proto(windows(0, 0, 0).to(torch.uint8)),
    )
    for key, value in override.items():
        getattr(msg, key).CopyFrom(value) if not isinstance(value, (str, int)) else setattr(msg, key, value)
    return msg


def test_bad_chunks_get_invalid_argument_and_touch_nothing(served) -> None:
    runner, transport = served
    target = transport.endpoints[(1, 0)]
    before = {k: v.clone() for k, v in merged_state_dict(runner.stages()).items()}

    assert _forward(target, _chunk(runner).SerializeToString()) is None  # a good chunk is accepted
    transport.poll((1, 0), "forward")  # drop it again: this test drives the server by hand

    bad_run = _chunk(runner)
    bad_run.header.run_id = "other-run"
    nan = _chunk(runner)
    nan.hidden.CopyFrom(
        runner.codec.encode(
            torch.zeros(PIPE.micro_batch_size, PIPE.seq_len, MODEL.hidden_size), boundary=0, step=0, micro_batch=7
        )
    )
    nan.hidden.payload = bytes(len(nan.hidden.payload) - 2) + b"\x00\x7e"  # last fp16 value NaN
    wrong_shape = _chunk(runner)
    wrong_shape.hidden.shape[:] = [PIPE.micro_batch_size, PIPE.seq_len, MODEL.hidden_size + 1]
    wrong_boundary = _chunk(runner)
    wrong_boundary.header.boundary = 3
    bad_tokens = _chunk(runner, token_ids=tensor_to_proto(torch.full((2, 17), 300, dtype=torch.int16)))
    big_batch = _chunk(
        runner, token_ids=tensor_to_proto(torch.zeros(64, PIPE.seq_len + 1, dtype=torch.uint8))
    )  # more work than the run's micro-batch
    cases = {
        "batch shape": (big_batch.SerializeToString(), "the run's micro-batch"),
        "garbage": (b"\xff\x00not a protobuf", "ActivationChunk"),
        "run id": (bad_run.SerializeToString(), "run_id='other-run'"),
        "nan": (nan.SerializeToString(), "NaN"),
        "shape": (wrong_shape.SerializeToString(), "shape"),
        "boundary": (wrong_boundary.SerializeToString(), "header.boundary=3"),
        "tokens": (bad_tokens.SerializeToString(), "token_ids"),
    }
    for name, (data, words) in cases.items():
        err = _forward(target, data)
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, err)
        assert words in err.details(), (name, err.details())
    oversized = _forward(target, bytes(2 << 20))
    assert oversized is not None and oversized.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    assert transport.poll((1, 0), "forward") is None, "a rejected chunk reached the worker"
    with grpc.insecure_channel(target) as ch:
        ping = ch.unary_unary(
            f"/{SERVICE}/Ping",
            request_serializer=pb.PingRequest.SerializeToString,
            response_deserializer=pb.PingReply.FromString,
        )
        assert ping(pb.PingRequest(run_id="run-a"), timeout=5).stage == 1
        with pytest.raises(grpc.RpcError) as exc:
            ping(pb.PingRequest(run_id="nope"), timeout=5)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = merged_state_dict(runner.stages())
    assert all(torch.equal(before[k], after[k]) for k in before)
    reports = runner.run(1)  # and the pipeline still trains
    assert torch.isfinite(torch.tensor(reports[0].loss))


@pytest.mark.parametrize(
    ("ids", "rows", "match"),
    [
        (torch.tensor([3, 300], dtype=torch.int32), 3, r"basis_prior_ids: .*token ids in \[0, 256\)"),
        (torch.tensor([3, -1], dtype=torch.int32), 3, r"basis_prior_ids: .*token ids in \[0, 256\)"),
        (torch.tensor([3, 4], dtype=torch.int64), 3, r"dtype"),
        (torch.tensor([3, 4], dtype=torch.int32), 2, r"shape"),  # 2 ids need 3 prior rows
    ],
)
def test_a_bad_partial_prior_is_refused_before_it_is_queued(ids: torch.Tensor, rows: int, match: str) -> None:
    from peer.errors import AnchormeshError

    runner = _runner(MaskConfig(scheme="lowrank", rank=4, prior_rows=16))
    try:
        worker = runner.workers[1][0]
        msg = pb.ActivationChunk(
            header=pb.MicroBatchHeader(run_id="run-a", micro_batch_id=7, step=0, sender="test", boundary=0),
            hidden=worker.link.coef_codec.encode(
                torch.randn(PIPE.micro_batch_size, PIPE.seq_len, 4), boundary=0, step=0, micro_batch=7
            ),
            token_ids=tensor_to_proto(windows(0, 0, 0).to(torch.uint8)),
            basis_version=1,
            basis_prior=tensor_to_proto(torch.zeros(rows, MODEL.hidden_size, dtype=torch.float16)),
            basis=tensor_to_proto(torch.zeros(MODEL.hidden_size, 4, dtype=torch.float16)),
            basis_prior_ids=tensor_to_proto(ids),
        )
        with pytest.raises(AnchormeshError, match=match):
            worker.validate("forward", msg)
        assert "test" not in worker.link.announced
    finally:
        runner.close()


def test_a_peer_that_never_reads_is_excluded_and_its_queue_dropped() -> None:
    """A next-stage server that accepts a stream and never reads it: the sender's unacknowledged
    messages stop at a bound, the destination is excluded with the reason (the daemon routes
    around it), its queue is dropped, and nothing waits forever."""
    import threading
    from concurrent import futures

    import grpc

    from peer.errors import AnchormeshError
    from peer.pipeline import grpc_transport as gt

    block = threading.Event()

    def never_reads(requests, context):
        block.wait(30)  # holds the stream open and reads nothing
        return iter(())

    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE, {"Forward": grpc.stream_stream_rpc_method_handler(never_reads)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    t = gt.GrpcTransport(run_id="run-a")
    t.endpoints["slow"] = f"127.0.0.1:{port}"
    try:
        refused = None
        for i in range(gt.MAX_UNACKED + 5):
            try:
                t.send("me", "slow", "forward", b"x" * 2**20)
            except AnchormeshError as exc:
                refused = (i, str(exc))
                break
        assert refused is not None and refused[0] == gt.MAX_UNACKED, refused
        assert "without acknowledging" in refused[1] and not t.usable("slow")
        with pytest.raises(AnchormeshError, match="excluded for"):
            t.send("me", "slow", "forward", b"x")
        assert t._outgoing[("slow", "forward")].empty() and t.send_error_count >= 1
        [said] = t.excluding()  # what the heartbeat reports, and the status shows
        assert said.startswith(
            "slow: its forward stream took 64 messages without acknowledging them"
        ) and said.endswith(" s left)")
    finally:
        block.set()
        t.close()
        server.stop(0)


def test_stage_0_routes_around_an_excluded_next_hop_unless_it_is_the_only_one() -> None:
    """`Router.next_hop` (capacity-weighted choice of a next-stage peer) leaves out the peers
    the transport excludes; with every peer excluded it still picks one (sending to a peer that
    may have recovered beats not sending at all)."""
    from types import SimpleNamespace

    from peer.daemon.routing import Router

    excluded: set[str] = {"b"}
    worker = SimpleNamespace(stage=SimpleNamespace(index=0), inflight={})  # only what next_hop reads
    d = Router(SimpleNamespace(usable=lambda dst: dst not in excluded), "me", lambda: worker)
    d.neighbours = {1: [pb.PeerInfo(peer_id=x, capacity_tokens_per_s=100.0) for x in ("a", "b", "c")]}
    d.route_gen = torch.Generator().manual_seed(0)
    picks = {d.next_hop() for _ in range(200)}
    assert picks == {"a", "c"}
    excluded.update({"a", "c"})
    assert {d.next_hop() for _ in range(200)} == {"a", "b", "c"}


def test_a_message_for_a_peer_not_known_yet_waits_for_its_address(served) -> None:
    """A next-stage peer answers a stage-0 peer it has not heard of yet (it started serving after
    the last heartbeat): the gradient waits for the address instead of being dropped (which cost
    the sender a 20 s resend before its first step), and goes out once the address is known."""
    runner, transport = served
    target = transport.endpoints.pop((1, 0))  # as if its address had not reached the sender yet
    data = _chunk(runner).SerializeToString()
    sender = GrpcTransport("run-a")
    try:
        sender.send("me", (1, 0), "forward", data)  # no error: parked
        assert len(sender.parking) == 1 and sender.send_error_count == 0
        sender.flush_parked()  # still unknown: it keeps waiting
        assert len(sender.parking) == 1 and transport.poll((1, 0), "forward") is None
        sender.endpoints[(1, 0)] = target  # the next heartbeat brings it
        sender.flush_parked()
        assert len(sender.parking) == 0
        deadline = time.monotonic() + 10
        while (got := transport.poll((1, 0), "forward")) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert got == data
    finally:
        transport.endpoints[(1, 0)] = target
        sender.close()


def test_a_message_whose_address_never_comes_is_a_send_error() -> None:
    from peer.errors import AnchormeshError
    from peer.pipeline.parking import Parking

    now = [0.0]
    t = GrpcTransport("run-a")
    t.parking = Parking(limit=3, wait_s=10.0, clock=lambda: now[0])
    try:
        for _ in range(3):
            t.send("me", "ghost", "forward", b"x")
        with pytest.raises(
            AnchormeshError, match=r"no address known for ghost, and 3 messages already wait for theirs \(at most 3"
        ):
            t.send("me", "ghost", "forward", b"x")  # bounded: a forged sender costs three slots, no more
        now[0] = 9.0
        t.flush_parked()
        assert len(t.parking) == 3 and t.send_error_count == 0
        now[0] = 10.5
        t.flush_parked()
        assert len(t.parking) == 0 and t.parking.expired == 3
        assert t.send_error_count == 1 and list(t.send_errors) == [
            "ghost: its address never became known"
        ]  # the worker forgets what it sent
    finally:
        t.close()


def test_parked_bytes_are_bounded_too() -> None:
    from peer.errors import AnchormeshError
    from peer.pipeline.parking import Parking

    p = Parking(limit=64, limit_bytes=1000)
    p.park("a", "m1", 600)
    with pytest.raises(AnchormeshError, match="1000 bytes"):
        p.park("a", "m2", 500)  # one large activation more would pass the byte bound
    p.park("b", "m3", 400)
    assert p.take({"a"}) == ([("a", "m1")], []) and len(p) == 1
