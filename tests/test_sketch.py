"""Count sketches of a stage's weights (peer/store/sketch.py): what a joiner compares a donor's
state with. Distances and norms survive them, every machine hashes alike, and a peer serves
them (GetShard, what = SKETCH) at the size asked, refusing a size out of range."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from peer.config import ModelConfig
from peer.daemon.serving import Serving
from peer.daemon.state_witness import GROUP_REL, far
from peer.errors import WireError
from peer.model.loading import load_causal_lm
from peer.model.stages import split_model
from peer.store.shard import read_shard
from peer.store.sketch import SIZE, P, _coefficients, sketch, sketches
from peer.wire import anchormesh_pb2 as pb


def test_a_small_tensor_is_its_own_sketch_and_a_large_one_keeps_norms_and_distances() -> None:
    g = torch.Generator().manual_seed(0)
    small = torch.randn(3, 5, generator=g)
    assert torch.equal(sketch(small, 1, 0, 64), small.flatten())
    x = torch.randn(1_000_000, generator=g)
    y = x + 0.5 * torch.randn(1_000_000, generator=g)
    for seed in range(4):
        sx, sy = sketch(x, seed, 7, SIZE), sketch(y, seed, 7, SIZE)
        assert sx.shape == (SIZE,) and float(sx.norm() / x.norm()) == pytest.approx(1.0, abs=0.06)
        assert float((sx - sy).norm() / (x - y).norm()) == pytest.approx(1.0, abs=0.06)
        assert torch.allclose(sketch(-x, seed, 7, SIZE), -sx)  # linear: a negation is exactly one
    assert not torch.equal(sketch(x, 0, 7, SIZE), sketch(x, 1, 7, SIZE))  # each judgement its own hash
    assert not torch.equal(sketch(x, 0, 7, SIZE), sketch(x, 0, 8, SIZE))  # each tensor its own


def test_the_hash_is_the_integer_formula_on_every_machine() -> None:
    """Each value i lands in bucket ((a1 i + b1) mod p) mod k with sign +-1 from the low bit of
    (a2 i + b2) mod p, computed here in Python integers: no torch random generator is involved."""
    n, k, seed, index = 5000, 64, 12345, 3
    a1, b1, a2, b2 = _coefficients(seed, index)
    x = torch.arange(1, n + 1, dtype=torch.float32)
    want = [0.0] * k
    for i in range(n):
        want[(a1 * i + b1) % P % k] += (1 if (a2 * i + b2) % P % 2 else -1) * float(x[i])
    assert torch.allclose(sketch(x, seed, index, k), torch.tensor(want), rtol=1e-5)


def test_a_negated_state_is_far_and_an_honest_one_close_by_their_sketches() -> None:
    g = torch.Generator().manual_seed(1)
    w = [torch.randn(256, 512, generator=g), torch.randn(512, generator=g)]
    mate = [t + 0.05 * torch.randn(t.shape, generator=g) for t in w]
    sizes = [t.numel() for t in w]
    s_w, s_mate, s_neg = (sketches(ts, 99, SIZE) for ts in (w, mate, [-t for t in w]))
    names = ["a", "b"]
    assert far(names, s_mate, s_w, GROUP_REL, 0.0, "its", sizes) == ""
    assert "cosine -1.00" in far(names, s_neg, s_w, GROUP_REL, 0.0, "its", sizes)


def serving_peer(stage_index: int, version: int) -> tuple[torch.nn.Module, Serving]:
    """A tiny model's stage and the handlers of a peer that serves it at step `version`."""
    stage = split_model(
        load_causal_lm(ModelConfig(name="tiny-llama", hidden_size=64, num_layers=2, num_heads=2), seed=0), 2
    )[stage_index]
    peer = SimpleNamespace(
        peer_id="mate",
        state="active",
        worker=SimpleNamespace(stage=stage, version=version),
        transport=SimpleNamespace(run_id="run"),
        step_lock=threading.Lock,
    )
    return stage, Serving(peer)


def test_a_peer_serves_sketches_of_its_weights_at_the_size_asked() -> None:
    stage, serving = serving_peer(0, 5)
    req = pb.ShardRequest(run_id="run", what=pb.ShardRequest.SKETCH, sketch_seed=7, sketch_size=256)
    shard = read_shard(serving.shard(None, req))
    named = list(stage.named_parameters())
    assert sorted(shard.tensors) == sorted(stage.hf_names[n] for n, _ in named) and shard.step == 5
    for n, p in named:
        assert torch.equal(shard.tensors[stage.hf_names[n]], sketch(p, 7, [m for m, _ in named].index(n), 256))
    full = sum(p.numel() for _, p in named) * 4
    assert sum(t.numel() * 4 for t in shard.tensors.values()) < full / 10  # what the witness saves on the wire
    for size in (0, 63, 1 << 17):
        with pytest.raises(WireError, match=f"sketch_size={size}: must be in"):
            serving.shard(None, pb.ShardRequest(what=pb.ShardRequest.SKETCH, sketch_size=size))


def test_a_joiner_fetches_a_mates_sketches_over_grpc_and_refuses_a_wrong_size(monkeypatch) -> None:
    """Replicas.sketches against a real stage server: the sketches the joiner computes itself
    from the same weights; a witness whose sketches have the wrong length is refused."""
    from peer.daemon.replicas import Replicas
    from peer.pipeline.grpc_transport import GrpcTransport
    from peer.store.shard import ShardError

    stage, serving = serving_peer(1, 3)
    server = GrpcTransport("run", host="127.0.0.1", shard_source=serving.shard)
    client = GrpcTransport("run")
    try:
        target = server.attach((1, 0), validate=lambda channel, msg: None, port=0)
        replicas = Replicas(client, "joiner")
        replicas.run_id = "run"
        holder = pb.PeerInfo(peer_id="mate", address=target)
        got = replicas.sketches(holder, stage, seed=11, size=128)
        assert all(torch.equal(a, b) for a, b in zip(got, sketches(list(stage.parameters()), 11, 128)))
        wrong = sketches
        monkeypatch.setattr("peer.store.sketch.sketches", lambda ts, seed, size: wrong(ts, seed, size // 2))
        with pytest.raises(ShardError, match="sent a sketch of .* not \\(128,\\) float32"):
            replicas.sketches(holder, stage, seed=11, size=128)
    finally:
        server.close()
        client.close()
