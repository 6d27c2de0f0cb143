"""Low-rank boundary codec: what both ends compute, and that the learner finds the right subspace."""

from __future__ import annotations

import pytest
import torch

from peer.codec.basis import BasisLearner, BasisState
from peer.errors import ConfigError


def _synthetic(n_tokens: int, vocab: int = 16, hidden: int = 32, rank: int = 3, seed: int = 0):
    """h = table[token] + (context part in a fixed rank-`rank` subspace)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(vocab, hidden, generator=g)
    sub, _ = torch.linalg.qr(torch.randn(hidden, rank, generator=g))
    ids = torch.randint(0, vocab, (1, n_tokens), generator=g)
    h = table[ids] + torch.randn(1, n_tokens, rank, generator=g) @ sub.T
    return ids, h, table, sub


def test_learner_recovers_prior_and_subspace_and_lift_rebuilds_h() -> None:
    ids, h, table, sub = _synthetic(4000)
    learner = BasisLearner(16, 32, rank=3, refresh=5)
    learner.observe(h, ids)
    state = learner.maybe_refresh(0)
    assert state is not None and state.version == 1
    # the learned basis spans the true subspace: projecting the true basis onto it loses ~nothing
    resid = sub - state.basis @ (torch.linalg.pinv(state.basis) @ sub)
    assert resid.norm() / sub.norm() < 0.02
    rebuilt = state.lift(state.project(h, ids), ids)
    rel = (rebuilt - h).norm() / h.norm()
    assert rel < 0.02, rel
    # a rank-1 basis cannot: the test can fail
    small = BasisLearner(16, 32, rank=1)
    small.observe(h, ids)
    s1 = small.maybe_refresh(0)
    assert (s1.lift(s1.project(h, ids), ids) - h).norm() / h.norm() > 0.05


def test_refresh_cadence_and_versions() -> None:
    ids, h, *_ = _synthetic(500)
    learner = BasisLearner(16, 32, rank=2, refresh=4)
    learner.observe(h, ids)
    versions = [getattr(learner.maybe_refresh(step), "version", None) for step in range(10)]
    assert versions == [1, None, None, None, 2, None, None, None, 3, None]


def test_gradient_through_coefficients_equals_gradient_of_the_map() -> None:
    """Receiver sends dL/dc; sender's dL/dh = dL/dc B^T equals autograd through project+lift."""
    ids, h, *_ = _synthetic(64)
    learner = BasisLearner(16, 32, rank=4)
    learner.observe(h, ids)
    state = learner.maybe_refresh(0)
    h = h.clone().requires_grad_(True)
    w = torch.randn(32)
    (state.lift(state.project(h, ids), ids) @ w).sum().backward()
    c = state.project(h.detach(), ids).requires_grad_(True)
    (state.lift(c, ids) @ w).sum().backward()
    torch.testing.assert_close(h.grad, c.grad @ state.basis.T)


def test_state_tensors_are_exactly_representable_in_fp16() -> None:
    """Both ends must compute with identical tensors, and the pair travels as fp16."""
    ids, h, *_ = _synthetic(300)
    learner = BasisLearner(16, 32, rank=3)
    learner.observe(h, ids)
    s = learner.maybe_refresh(0)
    assert torch.equal(s.prior, s.prior.half().float()) and torch.equal(s.basis, s.basis.half().float())


def test_rank_out_of_range_is_refused() -> None:
    with pytest.raises(ConfigError, match="codec.lowrank.rank=40"):
        BasisLearner(16, 32, rank=40)
    assert isinstance(BasisState(1, torch.zeros(2, 2), torch.zeros(2, 1)).version, int)


def test_a_large_vocabulary_sends_only_its_frequent_rows() -> None:
    """Zipf-like token frequencies over 2,000 ids, at most 65 prior rows: the 64 most frequent
    tokens get their own row (ids sent along), the rest share the mean row; positions of frequent
    tokens rebuild as well as with the full table, and the shipped prior is 65 x H, not 2000 x H."""
    g = torch.Generator().manual_seed(1)
    vocab, hidden, rank = 2000, 32, 3
    table = torch.randn(vocab, hidden, generator=g)
    sub, _ = torch.linalg.qr(torch.randn(hidden, rank, generator=g))
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float32) ** 1.3
    ids = torch.multinomial(weights, 20_000, replacement=True, generator=g)[None]
    h = table[ids] + torch.randn(1, ids.shape[1], rank, generator=g) @ sub.T
    full, top = BasisLearner(vocab, hidden, rank), BasisLearner(vocab, hidden, rank, max_rows=65, buffer_tokens=20_000)
    full.max_rows = vocab
    for learner in (full, top):
        learner.observe(h, ids)
        learner.maybe_refresh(0)
    s_full, s_top = full.current, top.current
    assert s_full.row_ids is None and s_full.prior.shape == (vocab, hidden)
    assert s_top.prior.shape == (65, hidden) and s_top.row_ids.shape == (64,) and s_top.row_ids.dtype == torch.int32
    counts = torch.bincount(ids[0], minlength=vocab)
    assert set(s_top.row_ids.tolist()) == set(counts.topk(64).indices.tolist())
    frequent = torch.isin(ids, s_top.row_ids.long())
    assert frequent.float().mean() > 0.7  # heavy tail: 64 of 2000 ids cover most positions
    err = lambda s: (s.lift(s.project(h, ids), ids) - h).norm(dim=-1) / h.norm(dim=-1)  # noqa: E731
    assert err(s_top)[frequent].mean() < 2 * err(s_full)[frequent].mean() + 0.02
    # the receiver rebuilds the same state from what travels (prior rows, ids, basis)
    twin = BasisState(
        s_top.version, s_top.prior.half().float(), s_top.basis.half().float(), s_top.row_ids.clone(), vocab
    )
    assert torch.equal(twin.lift(s_top.project(h, ids), ids), s_top.lift(s_top.project(h, ids), ids))


def test_a_first_refresh_with_fewer_tokens_than_the_rank_still_ships_the_full_rank() -> None:
    """A window of 32 tokens and rank 64 (SmolLM2 with seq_len 32, one sequence per micro-batch):
    the SVD has only 32 directions; the basis is completed to 64 orthonormal columns, so the
    receiver's shape check [H, rank] passes."""
    torch.manual_seed(0)
    learner = BasisLearner(vocab_size=50, hidden_size=96, rank=64, refresh=1)
    learner.observe(torch.randn(1, 32, 96), torch.randint(0, 50, (1, 32)))
    b = learner.maybe_refresh(0).basis
    assert b.shape == (96, 64)
    assert torch.allclose(b.T @ b, torch.eye(64), atol=2e-3)  # orthonormal (fp16-rounded)
