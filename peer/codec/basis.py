"""Low-rank stage-boundary codec: token prior plus the top-r principal directions of the rest.

The hidden state at a stage boundary is largely predictable from the token alone (a per-token
mean explains most of its variance in our measurements), and what the context adds is
concentrated in few directions. So the sender keeps

    P [vocab, H]  a running mean of its output per token          (the "token prior")
    B [H, r]      the top-r right singular vectors of h - P[token] (an orthonormal basis)

and sends only the coefficients c = (h - P[tok]) B, r values per token. The receiver rebuilds
h~ = P[tok] + c B^T. The backward sends dL/dc = (dL/dh~) B, r values per token, and the sender
applies dL/dh = (dL/dc) B^T: exactly the gradient of the map both ends computed.

Both ends must hold the same (P, B): the sender refreshes them from its own dense outputs every
`refresh` steps and ships them in the next ActivationChunk (`basis_version` says which pair a
message was encoded with; the bytes count towards the link). With a byte vocabulary P is tiny;
for large vocabularies it should become low-rank as well (not done yet).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peer.errors import ConfigError


@dataclass
class BasisState:
    """What both ends hold for one version: prior P [V, H] and orthonormal basis B [H, r]."""

    version: int
    prior: torch.Tensor
    basis: torch.Tensor

    def project(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Coefficients [B, T, r] of h [B, T, H] (sender side)."""
        return (h - self.prior[ids]) @ self.basis

    def lift(self, c: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """h~ [B, T, H] from coefficients (receiver side); autograd flows to c."""
        return self.prior[ids] + c @ self.basis.T


class BasisLearner:
    """Sender side: learns (P, B) from dense outputs and emits a new version every `refresh` steps.

    Args:
        vocab_size, hidden_size: sizes of P.
        rank: r, coefficients per token on the wire.
        refresh: steps between new versions (the first one comes from the first micro-batch).
        buffer_tokens: how many recent residual rows the SVD sees.
    """

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, refresh: int = 20, buffer_tokens: int = 4096) -> None:
        if not (1 <= rank <= hidden_size):
            raise ConfigError("mask.rank", rank, f"must be in [1, hidden_size={hidden_size}]")
        self.rank, self.refresh, self.buffer_tokens = rank, refresh, buffer_tokens
        self.sums = torch.zeros(vocab_size, hidden_size)
        self.counts = torch.zeros(vocab_size)
        self.rows: list[torch.Tensor] = []
        self.current: BasisState | None = None
        self._last_refresh_step: int | None = None

    def observe(self, h: torch.Tensor, ids: torch.Tensor) -> None:
        h2, t = h.detach().reshape(-1, h.shape[-1]).float(), ids.reshape(-1)
        self.sums.index_put_((t,), h2, accumulate=True)
        self.counts.index_put_((t,), torch.ones_like(t, dtype=torch.float32), accumulate=True)
        self.rows.append(torch.cat([h2, t[:, None].float()], dim=1))
        total = sum(r.shape[0] for r in self.rows)
        while self.rows and total - self.rows[0].shape[0] >= self.buffer_tokens:
            total -= self.rows.pop(0).shape[0]

    def maybe_refresh(self, step: int) -> BasisState | None:
        """A new version when due (returned so the caller ships it), else None."""
        if self._last_refresh_step is not None and step - self._last_refresh_step < self.refresh:
            return None
        data = torch.cat(self.rows)
        h, t = data[:, :-1], data[:, -1].long()
        prior = self.sums / self.counts.clamp(min=1)[:, None]
        unseen = self.counts == 0
        prior[unseen] = h.mean(0)
        resid = h - prior[t]
        _, _, vh = torch.linalg.svd(resid, full_matrices=False)
        version = 1 if self.current is None else self.current.version + 1
        # rounded to the wire's fp16 here, so sender and receiver compute with identical tensors
        self.current = BasisState(version, prior.half().float(), vh[: self.rank].T.contiguous().half().float())
        self._last_refresh_step = step
        self.sums *= 0.5  # forget: the sender's weights move, so old outputs count less each refresh
        self.counts *= 0.5
        return self.current
