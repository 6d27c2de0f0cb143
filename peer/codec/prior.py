"""The receiver-side token prior: fill masked-out boundary entries with E[h | token].

With drop 0.9 the receiver of a masked activation knows only 10% of h; zero-filling (the paper's
h * m) throws the rest away. But much of a boundary hidden state is predictable from the token
at that position, and the receiver sees the token ids anyway. So it keeps a per-(token, channel)
running mean of the values it *does* receive and puts that mean in the dropped entries. It
learns only from kept entries (and dense anchor passes), so it costs no extra bytes and needs no
agreement with the sender.

Memory: two [vocab_size, hidden_size] float32 tables (mean and count).
"""

from __future__ import annotations

from typing import Any

import torch

from peer.errors import ConfigError, TensorError, check_finite


class TokenPrior:
    """Per-(token, channel) running mean of the boundary activation, learned by the RECEIVER from
    the kept entries it receives (so it costs no extra bytes); fills dropped entries with E[h | token].

    The mean is a bias-corrected EMA: an entry seen c times so far takes a batch of n new
    observations with rate max(n / (c + n), 1 - momentum**n), i.e. a plain running average until
    c reaches about 1 / (1 - momentum), an EMA (tracking the drifting activations) after.
    (token, channel) entries never seen fall back to the channel mean over everything observed
    (kept with the same rule), or 0 before anything was observed.

    Args:
        vocab_size: token ids must lie in [0, vocab_size).
        hidden_size: H, the last dimension of the boundary hidden state.
        momentum: EMA momentum in [0, 1) (MaskConfig.prior_momentum).
        device: where the tables live; inputs are moved there, outputs returned on the inputs' device.
    """

    def __init__(
        self, vocab_size: int, hidden_size: int, momentum: float = 0.99, *, device: torch.device | str = "cpu"
    ) -> None:
        if vocab_size < 1:
            raise ConfigError("vocab_size", vocab_size, "must be >= 1")
        if hidden_size < 1:
            raise ConfigError("hidden_size", hidden_size, "must be >= 1")
        if not (0.0 <= momentum < 1.0):
            raise ConfigError("momentum", momentum, "must be in [0, 1)")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.momentum = momentum
        self.mean = torch.zeros(vocab_size, hidden_size, dtype=torch.float32, device=device)  # [V, H]
        self.count = torch.zeros(vocab_size, hidden_size, dtype=torch.float32, device=device)  # [V, H] observations
        self.channel_mean = torch.zeros(hidden_size, dtype=torch.float32, device=device)  # [H] fallback
        self.channel_count = torch.zeros(hidden_size, dtype=torch.float32, device=device)  # [H]

    @property
    def device(self) -> torch.device:
        return self.mean.device

    # ---- validation -----------------------------------------------------------------------
    def _check_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        if token_ids.dim() != 2:
            raise TensorError(f"TokenPrior: token_ids.shape={list(token_ids.shape)}: expected [B, T]")
        if token_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise TensorError(f"TokenPrior: token_ids.dtype={token_ids.dtype}: expected an integer dtype")
        if token_ids.numel():
            lo, hi = int(token_ids.min()), int(token_ids.max())
            if lo < 0 or hi >= self.vocab_size:
                bad = lo if lo < 0 else hi
                raise TensorError(f"TokenPrior: token id {bad} out of range [0, {self.vocab_size})")
        return token_ids.to(device=self.device, dtype=torch.int64)

    def _check_values(self, token_ids: torch.Tensor, values: torch.Tensor, name: str = "values") -> None:
        want = (*token_ids.shape, self.hidden_size)
        if tuple(values.shape) != want:
            raise TensorError(f"TokenPrior: {name}.shape={list(values.shape)}: expected {list(want)}")
        if name == "values":
            if not values.is_floating_point():
                raise TensorError(f"TokenPrior: values.dtype={values.dtype}: expected floating point")
            check_finite("TokenPrior: values", values.detach())
        elif values.dtype != torch.bool:
            raise TensorError(f"TokenPrior: {name}.dtype={values.dtype}: expected torch.bool")

    # ---- the prior ------------------------------------------------------------------------
    def fill(self, token_ids: torch.Tensor) -> torch.Tensor:
        """E[h | token] as float32 [B, T, H] on the prior's device (channel mean where unseen).
        Pass host ids: their range check then costs no device sync."""
        tok = self._check_tokens(token_ids).reshape(-1)  # [N]
        mean, count = self.mean[tok], self.count[tok]  # [N, H]
        out = torch.where(count > 0, mean, self.channel_mean.expand_as(mean))
        return out.reshape(*token_ids.shape, self.hidden_size)

    def observe(
        self, token_ids: torch.Tensor, values: torch.Tensor, keep: torch.Tensor | None, checked: bool = False
    ) -> None:
        """Update from the entries of `values` [B, T, H] where `keep` is True (None = all).
        `checked`: the caller decoded `values` from the wire and vetted them (finite), so the
        finiteness check, a device sync, is skipped."""
        tok = self._check_tokens(token_ids).reshape(-1)  # [N]
        if not checked:
            self._check_values(token_ids, values)
        elif tuple(values.shape) != (*token_ids.shape, self.hidden_size):
            raise TensorError(
                f"TokenPrior: values.shape={list(values.shape)}: expected {[*token_ids.shape, self.hidden_size]}"
            )
        if keep is not None:
            self._check_values(token_ids, keep, name="keep")
        vals = values.detach().to(device=self.device, dtype=torch.float32).reshape(-1, self.hidden_size)  # [N, H]
        if tok.numel() == 0:
            return
        if keep is None:
            k = torch.ones_like(vals)
        else:
            k = keep.to(self.device).reshape(-1, self.hidden_size).to(torch.float32)
        vals = vals * k  # dropped entries (0 or a fill on the receiver) contribute nothing

        uniq, inv = torch.unique(tok, return_inverse=True)  # touch only the rows of tokens present
        # index_put_(accumulate) rather than index_add_: the latter always opens an OpenMP region
        # on CPU and stalls for tens of ms when the other cores are busy (measured).
        sums = torch.zeros(uniq.numel(), self.hidden_size, device=self.device).index_put_(
            (inv,), vals, accumulate=True
        )  # [U, H]
        n = torch.zeros_like(sums).index_put_((inv,), k, accumulate=True)  # [U, H]
        self.mean[uniq], self.count[uniq] = self._update(self.mean[uniq], self.count[uniq], sums, n)

        ch_mean, ch_count = self._update(
            self.channel_mean[None], self.channel_count[None], sums.sum(0, keepdim=True), n.sum(0, keepdim=True)
        )
        self.channel_mean, self.channel_count = ch_mean[0], ch_count[0]

    def observe_dense(self, token_ids: torch.Tensor, values: torch.Tensor) -> None:
        """Update from every entry (dense anchor passes)."""
        self.observe(token_ids, values, None)

    def _update(
        self, mean: torch.Tensor, count: torch.Tensor, sums: torch.Tensor, n: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bias-corrected EMA step for a batch of n observations summing to `sums` (elementwise)."""
        seen = n > 0
        batch_mean = sums / n.clamp(min=1)
        rate = torch.maximum(n / (count + n).clamp(min=1), 1.0 - torch.pow(torch.full_like(n, self.momentum), n))
        new_mean = torch.where(seen, mean + rate * (batch_mean - mean), mean)
        return new_mean, count + n

    # ---- persistence ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "momentum": self.momentum,
            "mean": self.mean.clone(),
            "count": self.count.clone(),
            "channel_mean": self.channel_mean.clone(),
            "channel_count": self.channel_count.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict`; TensorError if sizes differ or a table holds NaN/Inf or negative counts."""
        for key in ("vocab_size", "hidden_size"):
            if state.get(key) != getattr(self, key):
                raise TensorError(
                    f"TokenPrior.load_state_dict: {key}={state.get(key)!r}: this prior has {getattr(self, key)}"
                )
        shapes = {
            "mean": (self.vocab_size, self.hidden_size),
            "count": (self.vocab_size, self.hidden_size),
            "channel_mean": (self.hidden_size,),
            "channel_count": (self.hidden_size,),
        }
        tables = {}
        for key, shape in shapes.items():
            t = state.get(key)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise TensorError(f"TokenPrior.load_state_dict: {key}={got}: expected a tensor of shape {list(shape)}")
            t = t.detach().to(device=self.device, dtype=torch.float32).clone()
            check_finite(f"TokenPrior.load_state_dict: {key}", t)
            if key.endswith("count") and bool((t < 0).any()):
                raise TensorError(f"TokenPrior.load_state_dict: {key}: {int((t < 0).sum())} negative counts")
            tables[key] = t
        momentum = float(state.get("momentum", self.momentum))
        if not (0.0 <= momentum < 1.0):
            raise TensorError(f"TokenPrior.load_state_dict: momentum={momentum!r}: must be in [0, 1)")
        self.momentum = momentum
        self.mean, self.count = tables["mean"], tables["count"]
        self.channel_mean, self.channel_count = tables["channel_mean"], tables["channel_count"]
