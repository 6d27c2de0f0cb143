"""The swarm's anchor circuit in one process: 3 stages over the in-process transport, one stage
with two peers. The prior each stage computes equals the dense gradient of the whole model on
the anchor batch; the sibling gets it too; no weight moves; bad anchor messages are refused."""

from __future__ import annotations

import copy

import pytest
import torch

from peer.config import AnchorConfig, MaskConfig, ModelConfig, PipelineConfig, SpectralConfig, TrainConfig
from peer.errors import AnchormeshError, WireError
from peer.model.loading import load_causal_lm
from peer.model.stages import lm_loss, split_model
from peer.pipeline.swarm_anchor import SwarmAnchor
from peer.pipeline.transport import LocalTransport
from peer.pipeline.worker import StageWorker
from peer.wire import anchormesh_pb2 as pb
from peer.wire.tensors import tensor_to_proto

M = 2  # anchor micro-batches
CFG = TrainConfig(
    model=ModelConfig(name="tiny-llama", num_stages=3, hidden_size=32, num_layers=3, num_heads=2, max_seq_len=16),
    mask=MaskConfig(scheme="mask", drop=0.9),
    anchor=AnchorConfig(every=5, micro_batches=M, with_masked=False),
    spectral=SpectralConfig(mode="paper"),
    pipeline=PipelineConfig(micro_batch_size=2, micro_batches=2, seq_len=8, max_staleness=0),
)


def build():
    torch.manual_seed(0)
    model = load_causal_lm(CFG.model, seed=0)
    stages = split_model(model, 3)
    transport = LocalTransport()
    names = ["p0", "p1", "p1b", "p2"]
    stage_of = {"p0": 0, "p1": 1, "p1b": 1, "p2": 2}
    workers = {
        n: StageWorker(copy.deepcopy(stages[stage_of[n]]), 0, CFG, transport, "run", peer_id=n, local_steps=True)
        for n in names
    }
    siblings = {"p0": [], "p1": ["p1b"], "p1b": ["p1"], "p2": []}
    anchors = {n: SwarmAnchor(w, M, lambda n=n: siblings[n]) for n, w in workers.items()}
    return model, transport, workers, anchors


def run_until_quiet(workers, anchors) -> None:
    hops = {"p0": "p1", "p1": "p2", "p1b": "p2", "p2": None}  # stage 0 routes to p1 only
    for _ in range(200):
        moved = False
        for n, a in anchors.items():
            a.drain()
            a.apply_priors()
            moved = a.tick(lambda n=n: hops[n], lambda sender: sender) or moved
        if not moved:
            return
    raise AssertionError("anchor work never finished")


def windows() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (2, 9), generator=g) for _ in range(M)]


def test_priors_equal_the_dense_gradient_and_reach_the_stage_group() -> None:
    model, transport, workers, anchors = build()
    before = {n: [p.detach().clone() for p in w.stage.parameters()] for n, w in workers.items()}
    for w in workers.values():
        w.version = 4  # the weights' step the priors are stamped with
    anchors["p0"].schedule(1, windows())
    run_until_quiet(workers, anchors)
    check_priors(model, workers, anchors)
    # anchor passes never touch weights
    for n, w in workers.items():
        assert all(torch.equal(a, b) for a, b in zip(before[n], w.stage.parameters())), n
    assert anchors["p1"].bytes_out > 0 and transport.total_bytes("prior") > 0


def test_a_duplicated_anchor_micro_batch_counts_once() -> None:
    model, transport, workers, anchors = build()
    anchors["p0"].schedule(1, windows())
    hops = lambda n: {"p0": "p1", "p1": "p2"}.get(n)  # noqa: E731
    anchors["p0"].tick(lambda: "p1", lambda s: s)  # micro-batch 0 leaves stage 0
    anchors["p1"].drain()
    anchors["p1"].tick(lambda: hops("p1"), lambda s: s)  # ... and stage 1
    q = transport._queues[("p2", "anchor_forward")]
    q.append(q[0])  # the last stage receives it twice (a sender's retry)
    run_until_quiet(workers, anchors)
    check_priors(model, workers, anchors)


def check_priors(model, workers, anchors) -> None:
    """Each stage's folded prior equals the whole model's dense gradient on the anchor batch."""
    # reference: the whole model, dense, mean loss over the anchor micro-batches
    model.zero_grad()
    for win in windows():
        (lm_loss(model(input_ids=win[:, :-1]).logits, win[:, 1:]) / M).backward()
    ref = dict(model.named_parameters())

    for n, a in anchors.items():
        assert a.priors_applied == 1 and a.newest_id == 1, n
        assert not a.jobs, f"{n} kept a finished job"
        spectral = workers[n].optimizer.spectral
        assert spectral._anchor_step == workers[n].version and spectral.active
    # each stage's EMA holds (1 - beta) * its prior; compare with the reference gradient
    beta = CFG.spectral.beta
    for n in ("p0", "p1", "p2"):
        stage = workers[n].stage
        full = {k: v for k, v in stage.named_parameters()}
        M_ema = workers[n].optimizer.spectral._M
        assert set(M_ema) == stage.decoder_matrices()
        for name, m in M_ema.items():
            idx = stage.start + int(name.split(".")[1])
            ref_g = ref[f"model.layers.{idx}." + name.split(".", 2)[2]].grad
            assert ref_g.shape == full[name].shape
            got = m / (1 - beta)
            err = (got - ref_g).norm() / ref_g.norm()
            assert err < 2e-2, (n, name, float(err))  # fp16 activations on the wire
    # the sibling of stage 1 folded in the same prior (sent in bf16)
    for name, m in workers["p1"].optimizer.spectral._M.items():
        other = workers["p1b"].optimizer.spectral._M[name]
        assert (other - m).norm() / m.norm() < 1e-2


def test_an_older_anchor_from_a_sibling_is_skipped() -> None:
    _, _, workers, anchors = build()
    for w in workers.values():
        w.version = 9
    anchors["p0"].schedule(2, windows())
    run_until_quiet(workers, anchors)
    a = anchors["p1b"]
    assert a.newest_id == 2
    old = pb.AnchorPrior(
        header=pb.MicroBatchHeader(run_id="run", step=30, micro_batch_id=1, sender="p1"),
        stage=1,
        grads=[
            pb.NamedTensor(name=n, tensor=tensor_to_proto(torch.zeros(s, dtype=torch.bfloat16)))
            for n, s in a.shapes.items()
        ],
    )
    a.validate("prior", old)
    a.inbox["prior"].append(old)
    a.apply_priors()
    assert a.stale_dropped == 1 and a.priors_applied == 1


def test_anchor_ids_above_what_the_tracker_issued_are_refused() -> None:
    """A forged prior or pass with a huge anchor id would be folded and then block every later
    prior (ids must increase); with the tracker's ceiling known, it is refused on the wire."""
    _, _, workers, anchors = build()
    a = anchors["p1b"]
    grads = [
        pb.NamedTensor(name=n, tensor=tensor_to_proto(torch.zeros(s, dtype=torch.bfloat16)))
        for n, s in a.shapes.items()
    ]
    forged = pb.AnchorPrior(
        header=pb.MicroBatchHeader(run_id="run", step=3, micro_batch_id=2**60, sender="p1"), stage=1, grads=grads
    )
    a.validate("prior", forged)  # no ceiling heard yet: as before
    a.issued = 5
    with pytest.raises(WireError, match="issued only up to 5"):
        a.validate("prior", forged)
    forged.header.micro_batch_id = 7  # within the slack: issued since this peer's last heartbeat
    a.validate("prior", forged)
    win = windows()[0]
    fwd = pb.ActivationChunk(
        header=pb.MicroBatchHeader(run_id="run", step=2**50, micro_batch_id=0, sender="p0", boundary=0, dense=True),
        hidden=tensor_to_proto(torch.zeros(2, 8, 32).half()),
        token_ids=tensor_to_proto(win),
    )
    anchors["p1"].issued = 5
    with pytest.raises(WireError, match="issued only up to 5"):
        anchors["p1"].validate("anchor_forward", fwd)


def test_bad_anchor_messages_are_refused_by_name() -> None:
    _, _, workers, anchors = build()
    a1 = anchors["p1"]
    win = windows()[0]
    good = pb.ActivationChunk(
        header=pb.MicroBatchHeader(run_id="run", step=1, micro_batch_id=0, sender="p0", boundary=0, dense=True),
        hidden=tensor_to_proto(torch.zeros(2, 8, 32).half()),
        token_ids=tensor_to_proto(win),
    )
    a1.validate("anchor_forward", good)
    cases = {
        "header.dense=false": dict(dense=False),
        "header.boundary=1": dict(boundary=1),
        "micro_batch_id=5": dict(micro_batch_id=5),
    }
    for why, change in cases.items():
        bad = pb.ActivationChunk()
        bad.CopyFrom(good)
        for k, v in change.items():
            setattr(bad.header, k, v)
        with pytest.raises(WireError, match=why.split("=")[0]):
            a1.validate("anchor_forward", bad)
    bad = pb.ActivationChunk()
    bad.CopyFrom(good)
    bad.hidden.CopyFrom(tensor_to_proto(torch.zeros(2, 8, 31).half()))
    with pytest.raises(WireError, match="shape"):
        a1.validate("anchor_forward", bad)
    bad.hidden.CopyFrom(tensor_to_proto(torch.full((2, 8, 32), float("nan")).half()))
    with pytest.raises(AnchormeshError, match="(?i)nan|finite"):
        a1.validate("anchor_forward", bad)
    bad.CopyFrom(good)
    bad.token_ids.CopyFrom(tensor_to_proto(torch.zeros(2, 4000, dtype=torch.uint8)))
    with pytest.raises(WireError, match="token_ids: expected integer \\[2, 9\\]"):
        a1.validate("anchor_forward", bad)
    # a gradient for a pass that is gone is not refused on the wire (that would end the sender's
    # stream); the loop drops it with a message
    late = pb.GradientChunk(
        header=pb.MicroBatchHeader(run_id="run", step=1, boundary=1), grad=tensor_to_proto(torch.zeros(2, 8, 32).half())
    )
    a1.validate("anchor_backward", late)
    a1.inbox["anchor_backward"].append(late)
    with pytest.raises(WireError, match="its pass is gone"):
        a1.tick(lambda: "p2", lambda s: s)
    prior = pb.AnchorPrior(header=pb.MicroBatchHeader(run_id="run", step=1, sender="p9"), stage=1)
    with pytest.raises(WireError, match="not a live peer of this stage group"):
        a1.validate("prior", prior)
    prior = pb.AnchorPrior(header=pb.MicroBatchHeader(run_id="run", step=1, sender="p1b"), stage=2)
    with pytest.raises(WireError, match="stage=2"):
        a1.validate("prior", prior)
    prior.stage = 1
    prior.grads.append(pb.NamedTensor(name="embed.weight", tensor=tensor_to_proto(torch.zeros(1))))
    with pytest.raises(WireError, match="decoder matrices"):
        a1.validate("prior", prior)
    name, shape = next(iter(a1.shapes.items()))
    del prior.grads[:]
    prior.grads.append(
        pb.NamedTensor(name=name, tensor=tensor_to_proto(torch.full(shape, float("inf"), dtype=torch.bfloat16)))
    )
    with pytest.raises(AnchormeshError, match="(?i)inf|finite"):
        a1.validate("prior", prior)


def test_an_evaluation_pass_reports_the_dense_held_out_loss_and_changes_nothing() -> None:
    model, transport, workers, anchors = build()
    for a in anchors.values():
        a.eval_batches = 2
    before = {n: [p.detach().clone() for p in w.stage.parameters()] for n, w in workers.items()}
    anchors["p0"].schedule_eval(3, windows())
    run_until_quiet(workers, anchors)
    with torch.no_grad():
        ref = sum(float(lm_loss(model(input_ids=w[:, :-1]).logits, w[:, 1:])) for w in windows()) / M
    eval_id, loss = anchors["p2"].eval_result
    assert eval_id == 3 and abs(loss - ref) < 1e-2 * ref, (loss, ref)
    assert anchors["p1"].eval_result[0] == 0  # only the last stage has a loss
    for n, w in workers.items():
        assert all(torch.equal(a, b) for a, b in zip(before[n], w.stage.parameters())), n
        assert anchors[n].priors_applied == 0 and not w.optimizer.opt.state


def test_at_most_max_jobs_passes_are_held_and_old_ones_are_refused() -> None:
    from peer.pipeline.swarm_anchor import MAX_JOBS

    _, _, workers, anchors = build()
    a = anchors["p1"]
    for anchor_id in range(1, MAX_JOBS + 3):
        assert a._job(anchor_id) is not None
    assert sorted(a.jobs) == list(range(3, MAX_JOBS + 3))  # the oldest were dropped
    assert a._job(1) is None  # older than every held pass
    a.newest_id = 10
    assert a._job(9) is None  # already superseded by a folded prior
