"""Swarm mode (local steps): a sender's retry of a micro-batch the receiver already took is not
computed twice, and the receiver sends the gradient again (the first one may have been lost);
the sender applies the micro-batch's gradient once, however many copies come back, so no
optimizer step takes it twice."""

from __future__ import annotations

import pytest
import torch

from peer.codec.mask import MaskCodec
from peer.config import ModelConfig, PipelineConfig, TrainConfig
from peer.errors import WireError
from peer.model.loading import load_causal_lm
from peer.model.stages import split_model
from peer.pipeline.transport import LocalTransport
from peer.pipeline.worker import StageWorker

CFG = TrainConfig(model=ModelConfig(name="tiny-llama", num_stages=2, hidden_size=32, num_layers=2, num_heads=2, max_seq_len=16), pipeline=PipelineConfig(micro_batch_size=2, micro_batches=2, seq_len=8))


def test_a_retried_micro_batch_gets_its_gradient_again_and_counts_once() -> None:
    stages = split_model(load_causal_lm(CFG.model, seed=0), 2)
    t = LocalTransport()
    a = StageWorker(stages[0], 0, CFG, MaskCodec(CFG.mask), t, "run", peer_id="a", next_hop=lambda: "b", resolve=lambda s: s, local_steps=True)
    b = StageWorker(stages[1], 0, CFG, MaskCodec(CFG.mask), t, "run", peer_id="b", next_hop=lambda: None, resolve=lambda s: s, local_steps=True)
    window = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    a.inject(window, 0, 0)
    sent = t._queues[("b", "forward")][0]
    b.drain()
    assert b.forward_one()
    first = t.poll("a", "backward")
    assert first is not None and sum(b.done.values()) == 1
    t.send("a", "b", "forward", sent)  # stage 0 lost the gradient and sends the micro-batch again
    b.drain()
    assert b.forward_one()
    again = t.poll("a", "backward")
    assert again == first and sum(b.done.values()) == 1 and len(b.losses[0]) == 1

    # both copies of the gradient reach stage 0: the first is applied, the second refused
    t.send("b", "a", "backward", first)
    t.send("b", "a", "backward", again)
    a.drain()
    assert a.backward_one() and sum(a.done.values()) == 1
    grads = [p.grad.clone() for p in a.stage.parameters() if p.grad is not None]
    with pytest.raises(WireError, match="gradient for unknown micro-batch"):
        a.backward_one()
    assert sum(a.done.values()) == 1 and not a.ready(0)  # one of M=2 micro-batches: no step yet
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, [p for p in a.stage.parameters() if p.grad is not None]))
