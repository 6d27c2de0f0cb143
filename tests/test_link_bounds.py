"""No message can stop a peer (peer/pipeline/bounds.py, StageWorker.apply_step): activations and
gradients that are finite but huge, or far above their link's running RMS, are refused over gRPC
with the reason and counted against the sender; a sender that shipped a transform coder may not
fall back to the dense warm-up format; a step whose gradient is non-finite anyway is dropped,
named, and the next step trains."""

from __future__ import annotations

import logging

import grpc
import pytest
import torch

from peer.config import MaskConfig, ModelConfig, OptimConfig, PipelineConfig, TrainConfig
from peer.errors import WireError
from peer.model.loading import load_causal_lm
from peer.pipeline.grpc_transport import GrpcTransport
from peer.pipeline.inflight import InFlight
from peer.pipeline.local import LocalPipelineRunner
from peer.pipeline.stage_server import SERVICE
from peer.wire import anchormesh_pb2 as pb
from peer.wire.tensors import tensor_to_proto, to_le_bytes

MODEL = ModelConfig(name="tiny-llama", hidden_size=32, num_layers=2, num_heads=2, max_seq_len=32)
PIPE = PipelineConfig(micro_batch_size=2, micro_batches=2, seq_len=16, max_staleness=0)
SHAPE = (PIPE.micro_batch_size, PIPE.seq_len, MODEL.hidden_size)


def windows(step: int, replica: int, j: int) -> torch.Tensor:
    return torch.randint(
        0,
        256,
        (PIPE.micro_batch_size, PIPE.seq_len + 1),
        generator=torch.Generator().manual_seed(100 * step + 10 * replica + j),
    )


def runner(mask: MaskConfig, transport=None) -> LocalPipelineRunner:
    cfg = TrainConfig(model=MODEL, mask=mask, pipeline=PIPE, optim=OptimConfig(lr=1e-3), steps=100)
    return LocalPipelineRunner(cfg, load_causal_lm(MODEL, seed=0), windows, transport=transport, run_id="run-a")


def dense(value: float) -> pb.TensorPayload:
    """The transform link's warm-up format (dense bf16), every value `value`."""
    return pb.TensorPayload(
        dtype=pb.BFLOAT16, shape=list(SHAPE), payload=to_le_bytes(torch.full(SHAPE, value, dtype=torch.bfloat16))
    )


def send(target: str, method: str, msg) -> grpc.RpcError | None:
    with grpc.insecure_channel(target) as ch:
        call = ch.stream_stream(
            f"/{SERVICE}/{method}", request_serializer=None, response_deserializer=pb.Ack.FromString
        )
        try:
            list(call(iter([msg.SerializeToString()]), timeout=10))
        except grpc.RpcError as exc:
            return exc
    return None


def test_huge_activations_and_gradients_are_refused_over_grpc_and_training_goes_on() -> None:
    transport = GrpcTransport("run-a")
    r = runner(MaskConfig(scheme="transform", bits=2.0, grad_bits=1.0, basis_refresh=1, adapt=False), transport)
    try:
        r.run(6)  # 12 messages a link: each link's running RMS is warm (bounds.WARMUP), the coders shipped
        stage0, stage1 = r.workers[0][0], r.workers[1][0]
        window = tensor_to_proto(windows(0, 0, 0).to(torch.uint8))

        def activation(sender: str, value: float) -> pb.ActivationChunk:
            return pb.ActivationChunk(
                header=pb.MicroBatchHeader(run_id="run-a", micro_batch_id=7, step=50, sender=sender, boundary=0),
                hidden=dense(value),
                token_ids=window,
            )

        stage0.inflight[(99, 5)] = InFlight(
            99, None, torch.zeros(SHAPE), None, windows(0, 0, 0)
        )  # a micro-batch waiting for its gradient

        def gradient(sender: str, value: float) -> pb.GradientChunk:
            return pb.GradientChunk(
                header=pb.MicroBatchHeader(run_id="run-a", micro_batch_id=5, step=99, sender=sender, boundary=0),
                grad=dense(value),
            )

        cases = {  # (target, method, message, words of the reason)
            "a 3e38 activation": ((1, 0), "Forward", activation("mallory", 3e38), "exceeds the cap"),
            "a loud activation": ((1, 0), "Forward", activation("mallory", 1e4), "times the running RMS"),
            "dense after a coder": ((1, 0), "Forward", activation(stage0.name, 0.5), "must be coded"),
            "a 3e38 gradient": ((0, 0), "Backward", gradient("mallory", 3e38), "exceeds the cap"),
            "a loud gradient": (
                (0, 0),
                "Backward",
                gradient("mallory", 10.0),
                "times the running RMS",
            ),  # honest ones here: RMS ~0.02
        }
        for name, (dst, method, msg, words) in cases.items():
            err = send(transport.endpoints[dst], method, msg)
            assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, err)
            assert words in err.details(), (name, err.details())
        assert stage1.bounds.refused["mallory"] == 2 and stage0.bounds.refused["mallory"] == 2
        assert transport.poll((1, 0), "forward") is None and transport.poll((0, 0), "backward") is None
        del stage0.inflight[(99, 5)]
        before = stage1.version
        reports = r.run(before + 2)  # the peers keep training (run() counts steps in total)
        assert stage1.version == before + 2 and all(torch.isfinite(torch.tensor(x.loss)) for x in reports)
    finally:
        r.close()


def test_a_new_sender_is_held_to_its_link_and_the_bound_follows_slow_drift() -> None:
    from peer.pipeline.bounds import RECOVER, WARMUP, LinkBounds

    b = LinkBounds(factor=16.0, cap=1e6)
    for _ in range(WARMUP):
        b.check("forward", "alice", 1.0, 3.0)
    with pytest.raises(WireError, match="this link's forward messages"):
        b.check("forward", "newcomer", 20.0, 60.0)  # no history of its own: the link's
    for i in range(200):  # an honest drift of 2 % a message is followed
        b.check("forward", "alice", 1.02**i, 3.0)
    with pytest.raises(WireError, match="value of magnitude 2e\\+15"):
        b.check("forward", "alice", 1.0, 2e15)
    for _ in range(WARMUP):
        b.check("backward", "bob", 1e-5, 1.0)
    for _ in range(RECOVER):  # a level that jumped for good (gradients grow fast early in a run)
        with pytest.raises(WireError, match="times the running RMS"):
            b.check("backward", "bob", 1e-3, 1.0)
    b.check("backward", "bob", 1e-3, 1.0)  # taken after RECOVER refusals, not refused for good
    b.check("backward", "bob", 1.1e-3, 1.0)
    assert b.refused == {"newcomer": 1, "alice": 1, "bob": RECOVER}


def test_hidden_states_that_grow_for_good_pass_the_gradients_cap_but_not_the_activation_cap() -> None:
    """Nothing in the loss holds a stage output's scale: an honest run's hidden states grew past
    1e6 on the test bed, and a cap at the gradients' 1e6 refused that micro-batch for ever and
    stopped the run. Activations answer to their own cap, which only keeps float32 finite."""
    from peer.pipeline.bounds import WARMUP, LinkBounds

    b = LinkBounds(factor=64.0, cap=1e6, activation_cap=1e15)
    rms = 1.0
    for _ in range(WARMUP + 400):  # 5 % a message: from 1 to ~3e8
        b.check("forward", "alice", rms, 3 * rms)
        rms *= 1.05
    assert 3 * rms > 1e6 and b.refused == {}
    with pytest.raises(WireError, match="exceeds the cap 1e\\+15 \\(security.max_activation_value\\)"):
        b.check("forward", "alice", rms, 2e15)
    with pytest.raises(WireError, match="exceeds the cap 1e\\+06 \\(security.max_link_value\\)"):
        b.check("backward", "alice", 1.0, 2e6)
    assert b.refused == {"alice": 2}
    assert b.senders() == [
        "alice: 2 refused, newest: backward: a value of magnitude 2e+06 exceeds the cap 1e+06 (security.max_link_value)"
    ]  # the status's refused_senders


def test_one_loud_micro_batch_retried_between_quiet_ones_is_taken_after_recover_refusals() -> None:
    """A peer restarted from its checkpoint sends one micro-batch's gradient far over its old
    level, the others at it; its sender retries that one for ever. Counted in a row, each quiet
    message restarted the count and the run stood still; counted over the sender's latest
    messages, the loud one is taken after RECOVER refusals."""
    from peer.pipeline.bounds import RECOVER, WARMUP, WINDOW, LinkBounds

    b = LinkBounds(factor=64.0, cap=1e6)
    for _ in range(WARMUP):
        b.check("backward", "carol", 1.5e-4, 1e-3)
    for _ in range(RECOVER):
        with pytest.raises(WireError, match="times the running RMS"):
            b.check("backward", "carol", 2.7e-2, 0.1)  # the retried micro-batch
        b.check("backward", "carol", 2e-4, 1e-3)  # another one, at the old level
    b.check("backward", "carol", 2.7e-2, 0.1)
    assert b.refused == {"carol": RECOVER}
    b2 = LinkBounds(factor=64.0, cap=1e6)
    for _ in range(WARMUP):
        b2.check("backward", "dave", 1.5e-4, 1e-3)
    for _ in range(RECOVER - 1):  # spread wider than the window: never taken
        with pytest.raises(WireError, match="times the running RMS"):
            b2.check("backward", "dave", 2.7e-2, 0.1)
        for _ in range(WINDOW):
            b2.check("backward", "dave", 1.5e-4, 1e-3)
    with pytest.raises(WireError, match="times the running RMS"):
        b2.check("backward", "dave", 2.7e-2, 0.1)


def test_a_non_finite_gradient_drops_the_step_names_the_senders_and_the_next_step_trains(
    caplog: pytest.LogCaptureFixture,
) -> None:
    r = runner(MaskConfig(scheme="mask", drop=0.9, adapt=False))
    try:
        r.run(1)
        w = r.workers[1][0]
        honest = w.gradients

        def poisoned() -> list[torch.Tensor]:
            out = honest()
            out[0].view(-1)[0] = float("inf")  # what huge inbound values once made of a step
            return out

        w.gradients = poisoned

        def weights() -> dict[str, torch.Tensor]:
            return {n: p.detach().clone() for n, p in w.stage.named_parameters()}

        before, first = weights(), next(iter(w.stage.parameters()))
        moments = {k: v.clone() for k, v in w.optimizer.opt.state[first].items()}
        with caplog.at_level(logging.WARNING, logger="peer.pipeline.worker"):
            r.run(2)  # raised here before, and on every step after
        assert w.dropped_steps == 1 and w.version == 2
        assert "step 1 dropped" in caplog.text and "stage0.r0" in caplog.text  # who sent its activations
        after = weights()
        assert all(torch.equal(before[n], after[n]) for n in before)  # weights and moments untouched
        assert all(torch.equal(v, w.optimizer.opt.state[first][k]) for k, v in moments.items())
        w.gradients = honest
        reports = r.run(3)
        assert w.version == 3 and torch.isfinite(torch.tensor(reports[0].loss))
        assert not all(torch.equal(after[n], v) for n, v in weights().items())  # it trains again
    finally:
        r.close()


def test_pipeline_messages_come_only_from_the_peers_the_tracker_lists_for_the_adjacent_stage() -> None:
    """A member of another stage, or one the roster does not list, is refused after a grace that
    covers a new neighbour this peer's next heartbeat has not brought yet."""
    from peer.daemon.serving import GRACE_S, AdjacentSenders

    now = [0.0]
    senders = AdjacentSenders(clock=lambda: now[0])
    roster = {
        1: [pb.PeerInfo(peer_id="up", stage=1)],
        2: [pb.PeerInfo(peer_id="me", stage=2)],
        3: [pb.PeerInfo(peer_id="down", stage=3), pb.PeerInfo(peer_id="far", stage=3)],
    }
    senders.check("forward", "up", 2, roster)
    senders.check("backward", "down", 2, roster)
    senders.check("forward", "far", 2, roster)  # listed at stage 3, not 1: within its grace
    senders.check("anchor_forward", "new", 2, roster)  # not listed yet: within its grace
    now[0] = GRACE_S + 1
    with pytest.raises(
        WireError, match="takes forward messages from the peers of stage 1, and the tracker lists it at stage 3"
    ):
        senders.check("forward", "far", 2, roster)
    with pytest.raises(WireError, match="does not list it"):
        senders.check("anchor_forward", "new", 2, roster)
    roster[1].append(pb.PeerInfo(peer_id="new", stage=1))  # the next heartbeat lists it
    senders.check("anchor_forward", "new", 2, roster)
