"""The peer's small rpcs on real gRPC servers: Ping (with the daemon's answer, and as a liveness probe
without a run id) and GetShard (the stage's weights, whole and consistent)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import grpc
import pytest
import torch
from swarmkit import admit

from peer.config import ModelConfig
from peer.daemon.main import PeerDaemon
from peer.model.loading import load_causal_lm
from peer.model.stages import split_model
from peer.pipeline.grpc_transport import GrpcTransport
from peer.pipeline.stage_server import SERVICE
from peer.security import auth
from peer.store.shard import ShardError, read_shard, shard_chunks, snapshot
from peer.wire import anchormesh_pb2 as pb

MODEL = ModelConfig(name="tiny-llama", num_stages=2, hidden_size=32, num_layers=2, num_heads=2, max_seq_len=32)


def ping(target: str, run_id: str) -> pb.PingReply:
    with grpc.insecure_channel(target) as ch:
        call = ch.unary_unary(
            f"/{SERVICE}/Ping",
            request_serializer=pb.PingRequest.SerializeToString,
            response_deserializer=pb.PingReply.FromString,
        )
        return call(pb.PingRequest(run_id=run_id, sender="test"), timeout=5)


def get_shard(target: str, run_id: str = "", creds: auth.Credentials | None = None) -> list[pb.ShardChunk]:
    with auth.open_channel(target, creds) as ch:
        call = ch.unary_stream(
            f"/{SERVICE}/GetShard",
            request_serializer=pb.ShardRequest.SerializeToString,
            response_deserializer=pb.ShardChunk.FromString,
        )
        return list(call(pb.ShardRequest(run_id=run_id, sender="test"), timeout=10))


@pytest.fixture
def daemon():
    d = PeerDaemon("127.0.0.1:1")  # no tracker call happens before run()
    d.transport.run_id = "run-a"
    d.member = admit(d, "run-a")
    d.transport.start()
    yield d
    d.transport.close()


def test_the_daemon_answers_ping_with_its_id_stage_step_and_state(daemon: PeerDaemon) -> None:
    target = daemon.transport.endpoints[daemon.peer_id]
    r = ping(target, "run-a")  # was: UNKNOWN "'str' object cannot be interpreted as an integer"
    assert (r.peer_id, r.stage, r.version, r.state, r.run_id) == (daemon.peer_id, 0, 0, "joining", "run-a")
    daemon.worker = SimpleNamespace(stage=SimpleNamespace(index=1), version=7)
    daemon.state = "active"
    r = ping(target, "run-a")
    assert (r.peer_id, r.stage, r.version, r.state) == (daemon.peer_id, 1, 7, "active")
    with pytest.raises(grpc.RpcError) as exc:
        ping(target, "run-b")
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "run-a" in exc.value.details()


def test_an_empty_run_id_is_a_liveness_probe_not_a_refusal(caplog: pytest.LogCaptureFixture) -> None:
    t = GrpcTransport("run-a")
    try:
        local, peer = t.attach((1, 0)), t.attach("peer-xyz")
        with caplog.at_level(logging.WARNING, logger="peer.pipeline.grpc_transport"):
            r = ping(local, "")
            assert (r.peer_id, r.stage, r.run_id) == ("stage1.r0", 1, "run-a")
            # the default answer for a swarm address (a peer-id string) no longer indexes it as a tuple
            assert ping(peer, "").peer_id == "peer-xyz" and ping(peer, "run-a").peer_id == "peer-xyz"
        assert not t.rejected and not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        t.close()


def test_get_shard_sends_the_stage_weights_under_full_model_names(daemon: PeerDaemon) -> None:
    target = daemon.transport.endpoints[daemon.peer_id]
    with pytest.raises(grpc.RpcError) as exc:  # without credentials: nobody reads a run's weights
        get_shard(target)
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED and "--token" in exc.value.details()
    with pytest.raises(grpc.RpcError) as exc:  # before it serves a stage
        get_shard(target, creds=daemon.member)
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    stage = split_model(load_causal_lm(MODEL, seed=0), 2)[1]
    daemon.worker = SimpleNamespace(stage=stage, version=5)
    daemon.state = "active"
    chunks = get_shard(
        target, "run-a", auth.Credentials(token="test-run-token-0123456789")
    )  # export holds the token only
    shard = read_shard(chunks)
    assert (shard.run_id, shard.peer_id, shard.stage, shard.num_stages, shard.step) == (
        "run-a",
        daemon.peer_id,
        1,
        2,
        5,
    )
    want = {stage.hf_names[n]: p for n, p in stage.named_parameters()}
    assert set(shard.tensors) == set(want) and "lm_head.weight" in want and "model.layers.1.mlp.up_proj.weight" in want
    assert all(torch.equal(shard.tensors[k], want[k]) for k in want)
    with pytest.raises(grpc.RpcError) as exc:
        get_shard(target, "run-b", daemon.member)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_get_shard_without_a_source_is_unimplemented() -> None:
    t = GrpcTransport("run-a")
    try:
        with pytest.raises(grpc.RpcError) as exc:
            get_shard(t.attach((0, 0)))
        assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        t.close()


def test_a_broken_shard_stream_is_refused() -> None:
    stage = split_model(load_causal_lm(MODEL, seed=0), 2)[0]
    chunks = list(
        shard_chunks(snapshot(stage), run_id="r", peer_id="p", stage=0, num_stages=2, step=1, chunk_bytes=4096)
    )
    assert len(chunks) > 2 and all(len(c.data) <= 4096 for c in chunks)
    assert set(read_shard(chunks).tensors) == {stage.hf_names[n] for n, _ in stage.named_parameters()}
    with pytest.raises(ShardError, match="expected offset"):
        read_shard(chunks[:1] + chunks[2:])
    with pytest.raises(ShardError, match="of the announced"):
        read_shard(chunks[:-1])
    other = pb.ShardChunk()
    other.CopyFrom(chunks[1])
    other.step = 2
    with pytest.raises(ShardError, match="header differs"):
        read_shard([chunks[0], other, *chunks[2:]])
    with pytest.raises(ShardError, match="no chunk"):
        read_shard([])


def test_a_flood_of_bad_pings_is_bounded_and_compressed_calls_are_refused() -> None:
    """2,000 Pings for another run: each refused, the record of refusals stays bounded and the
    log gets a few lines, not 2,000; a gzip-compressed call is refused before it is inflated."""
    import logging

    import grpc

    from peer.pipeline.grpc_transport import RECENT, GrpcTransport
    from peer.wire import anchormesh_pb2 as pb

    t = GrpcTransport(run_id="run-a")
    addr = t.attach((0, 0))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("peer.pipeline.grpc_transport").addHandler(handler)
    try:
        with grpc.insecure_channel(addr) as channel:
            ping = channel.unary_unary(
                "/anchormesh.v1.Stage/Ping", request_serializer=None, response_deserializer=pb.PingReply.FromString
            )
            bad = pb.PingRequest(run_id="other-run").SerializeToString()
            for _ in range(2000):
                with pytest.raises(grpc.RpcError) as exc:
                    ping(bad, timeout=5)
                assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as exc:
                ping(b"\0" * (8 * 2**20), timeout=10, compression=grpc.Compression.Gzip)
            assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED and "gzip" in exc.value.details()
            assert ping(pb.PingRequest().SerializeToString(), timeout=5).run_id == "run-a"  # still serving
    finally:
        logging.getLogger("peer.pipeline.grpc_transport").removeHandler(handler)
        t.close()
    assert t.rejected_count == 2000 and len(t.rejected) == RECENT
    assert len([r for r in records if "refused" in r.getMessage()]) <= 40


def test_get_shard_hands_a_stage_s_training_state_its_own_or_the_replica_it_keeps(daemon: PeerDaemon) -> None:
    """What a replica pull and a restore read (peer/daemon/replicas.py): the state of the stage the
    peer serves, the copy of another stage it keeps, NOT_FOUND for any other, and a copy larger
    than the puller allows is refused before it is read."""
    from peer.daemon.replicas import Replicas
    from peer.store.shard import state_from_tensors

    target = daemon.transport.endpoints[daemon.peer_id]
    stage = split_model(load_causal_lm(MODEL, seed=0), 2)[1]
    names = [n for n, _ in stage.named_parameters()]
    params = [p.detach().clone() for _, p in stage.named_parameters()]
    state = params + [torch.full_like(p, 0.1) for p in params] + [torch.full_like(p, 0.04) for p in params]
    daemon.worker = SimpleNamespace(stage=stage, version=5)
    daemon.state = "active"
    daemon.state_sync.stage_state = lambda: ({"version": 5, "adam_step": 5.0}, state)
    puller = Replicas(SimpleNamespace(channel=lambda address: auth.open_channel(address, daemon.member)), "puller")
    puller.configure("run-a", every_s=1.0, state_dir=None, own_state_bytes=10**6)
    holder = pb.PeerInfo(peer_id=daemon.peer_id, stage=1, address=target, step=5)
    meta, tensors = state_from_tensors(puller.fetch(holder).tensors, names)
    assert meta == {"version": 5, "adam_step": 5.0} and all(torch.equal(a, b) for a, b in zip(state, tensors))
    with pytest.raises(grpc.RpcError) as exc:  # stage 0: neither served nor kept
        puller.fetch(holder, stage=0)
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND and "no replica of stage 0" in exc.value.details()
    daemon.replicas.configure("run-a", every_s=1.0, state_dir=None, own_state_bytes=10**6)
    assert puller.pull(holder) and (puller.stage, puller.step) == (1, 5)  # the puller now keeps stage 1's copy
    daemon.replicas._keep(0, 4, puller.fetch(holder).tensors)  # and the daemon one of "stage 0"
    assert puller.fetch(holder, stage=0).step == 4
    puller.max_bytes = 1000
    with pytest.raises(ShardError, match="more than the 1000"):
        puller.fetch(holder)
