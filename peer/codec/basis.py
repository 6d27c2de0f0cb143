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
message was encoded with; the bytes count towards the link). With a byte vocabulary P is tiny
and travels whole. A real vocabulary (Qwen2.5: 151,936 tokens) would make P hundreds of MB, so
only the `max_rows - 1` most frequent tokens of the sender's recent data get their own row, sent
with their ids; every other token shares one last row, the mean output. Why that suffices: token
frequencies are heavy-tailed, so a few thousand rows cover nearly every position, and a rare
token's residual is simply larger (the basis and the coefficients carry it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peer.errors import ConfigError


@dataclass
class BasisState:
    """What both ends hold for one version: prior P and orthonormal basis B [H, r].

    P is [V, H] (one row per token) when `row_ids` is None, else [len(row_ids) + 1, H]: row i
    belongs to token row_ids[i], and the last row to every other token."""

    version: int
    prior: torch.Tensor
    basis: torch.Tensor
    row_ids: torch.Tensor | None = None
    vocab_size: int = 0

    def __post_init__(self) -> None:
        self._row_of: torch.Tensor | None = None
        if self.row_ids is not None:
            dev = self.prior.device
            self._row_of = torch.full((self.vocab_size,), len(self.row_ids), dtype=torch.long, device=dev)
            self._row_of[self.row_ids.long().to(dev)] = torch.arange(len(self.row_ids), device=dev)

    def prior_of(self, ids: torch.Tensor) -> torch.Tensor:
        return self.prior[ids if self._row_of is None else self._row_of[ids]]

    def project(self, h: torch.Tensor, ids: torch.Tensor, k: int | None = None) -> torch.Tensor:
        """Coefficients [B, T, k] of h [B, T, H] on the first k basis vectors (sender side; all
        r by default). The columns come in singular-value order, so any prefix is the best rank-k
        part: a slow link sends fewer coefficients with the same basis."""
        return (h - self.prior_of(ids)) @ self.basis[:, : self.basis.shape[1] if k is None else k]

    def lift(self, c: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """h~ [B, T, H] from k coefficients (receiver side; k = c's last dim); autograd flows to c."""
        return self.prior_of(ids) + c @ self.basis[:, : c.shape[-1]].T


class BasisLearner:
    """Sender side: learns (P, B) from dense outputs and emits a new version every `refresh` steps.

    Args:
        vocab_size, hidden_size: sizes of P.
        rank: r, coefficients per token on the wire.
        refresh: steps between new versions (the first one comes from the first micro-batch).
        buffer_tokens: how many recent residual rows the SVD sees.
        max_rows: most rows of P that travel (mask.prior_rows); a larger vocabulary sends the
            most frequent tokens' rows plus one shared row.
        device: where the sums, the buffer and the SVD live: with the stage's outputs, so
            observing costs no host copy.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        rank: int,
        refresh: int = 20,
        buffer_tokens: int = 4096,
        max_rows: int = 8192,
        device: torch.device | str = "cpu",
    ) -> None:
        if not (1 <= rank <= hidden_size):
            raise ConfigError("codec.lowrank.rank", rank, f"must be in [1, hidden_size={hidden_size}]")
        self.rank, self.refresh, self.buffer_tokens, self.max_rows = rank, refresh, buffer_tokens, max_rows
        self.sums = torch.zeros(vocab_size, hidden_size, device=device)
        self.counts = torch.zeros(vocab_size, device=device)
        self.rows: list[torch.Tensor] = []
        self.current: BasisState | None = None
        self._last_refresh_step: int | None = None

    def observe(self, h: torch.Tensor, ids: torch.Tensor) -> None:
        h2, t = h.detach().reshape(-1, h.shape[-1]).float(), ids.reshape(-1).to(self.sums.device)
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
        version = 1 if self.current is None else self.current.version + 1
        vocab = len(self.counts)
        if vocab <= self.max_rows:  # the whole table
            prior = self.sums / self.counts.clamp(min=1)[:, None]
            prior[self.counts == 0] = h.mean(0)
            row_ids = None
        else:  # the most frequent tokens' rows (by id order), then one shared row
            seen = int((self.counts > 0).sum())
            row_ids = self.counts.topk(min(self.max_rows - 1, seen)).indices.sort().values
            prior = torch.cat([self.sums[row_ids] / self.counts[row_ids, None], h.mean(0, keepdim=True)])
            row_ids = row_ids.to(torch.int32)
        # rounded to the wire's fp16 here, so sender and receiver compute with identical tensors
        prior = prior.half().float()
        draft = BasisState(version, prior, torch.zeros(h.shape[1], 0, device=h.device), row_ids, vocab)
        resid = h - draft.prior_of(t)
        if row_ids is not None:  # fit the basis to context, not to rare tokens' offsets from the shared row
            own = torch.isin(t, row_ids.long())
            if int(own.sum()) >= 4 * self.rank:
                resid = resid[own]
        _, _, vh = torch.linalg.svd(resid, full_matrices=False)
        self.current = BasisState(
            version, prior, _complete(vh[: self.rank].T, self.rank).contiguous().half().float(), row_ids, vocab
        )
        self._last_refresh_step = step
        self.sums *= 0.5  # forget: the sender's weights move, so old outputs count less each refresh
        self.counts *= 0.5
        return self.current


def _complete(basis: torch.Tensor, rank: int) -> torch.Tensor:
    """`basis` [H, k] with orthonormal columns, completed to `rank` columns by orthonormal
    directions outside its span. Why: before the sender has seen `rank` tokens (the first
    micro-batch of a short window), the SVD yields fewer directions than the wire's fixed rank;
    the extra columns still carry part of the residual until the next refresh refits them."""
    k = basis.shape[1]
    if k >= rank:
        return basis
    g = torch.Generator(device="cpu").manual_seed(k)
    extra = torch.randn(basis.shape[0], rank - k, generator=g).to(basis.device, basis.dtype)
    q, _ = torch.linalg.qr(torch.cat([basis, extra], dim=1))
    return torch.cat([basis, q[:, k:rank]], dim=1)
