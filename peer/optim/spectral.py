"""Spectral correction of masked gradients with anchor priors (docs/design.md, "The spectral correction optimizer").

Per target matrix W (2-D decoder weights; the caller picks them), with G the masked gradient
after DP sync and G_a / G_am the dense / masked gradients of the latest anchor pass:

    M   <- beta * M   + (1 - beta) * G_a        (anchor EMA, from M = 0, as the paper writes it)
    M_m <- beta * M_m + (1 - beta) * G_am       (masked-anchor EMA; "ef" modes only)
    M_hat = M / (1 - beta^n)                    (Adam-style bias correction, n = anchors seen)
    M_hat = U S V^T                             (thin SVD, top-`rank` triplets if rank > 0;
                                                 refreshed when an anchor arrives, not per step)
    d_i = s_i / (s_i + tau)
    paper:    G <- alpha * G + (1 - alpha) * U diag(d) (U^T G V) diag(d) V^T
    ef:       G <- G + lam * (M_hat - M_m_hat)
    paper_ef: G <- paper(G) + lam * (M_hat - M_m_hat)
    off:      G unchanged

Why the bias correction: the filter uses M only through its singular vectors and the ratios
s / (s + tau); from M = 0 the paper's EMA shrinks every s by (1 - beta^n) (x0.05 after one
anchor at beta = 0.95), so tau would mean something different for the first ~50 anchors. With
the correction, tau is always compared with singular values on the gradient's own scale. The
paper-exact recursion stays available (`bias_correction=False`) and is tested against the
literal formula.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from peer.config import SpectralConfig
from peer.errors import ConfigError, TensorError, check_finite

_FILTER_MODES = ("paper", "paper_ef")
_EF_MODES = ("ef", "paper_ef")


def paper_filter(G: Tensor, U: Tensor, S: Tensor, Vh: Tensor, tau: float, alpha: float) -> Tensor:
    """alpha*G + (1-alpha) * U diag(d) (U^T G V) diag(d) V^T with d = S/(S+tau); the paper's filter.

    Computed in the dtype of the inputs (the caller casts); U is (m, k), S (k,), Vh (k, n). With
    k < min(m, n) the filtered part is the two-sided projection of G onto the top-k subspace.
    """
    d = S / (S + tau)
    core = U.transpose(-2, -1) @ G @ Vh.transpose(-2, -1)  # (k, k) coordinates of G in the basis
    core = d[:, None] * core * d[None, :]
    return alpha * G + (1.0 - alpha) * (U @ core @ Vh)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32 (bf16/fp16 grads are computed in float32); float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def _all_finite(tensors: list[Tensor]) -> bool:
    """Whether every tensor is free of NaN/Inf, with one device sync per device, not per tensor."""
    by_device: dict[torch.device, list[Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    return all(bool(torch.stack([torch.isfinite(t).all() for t in ts]).all()) for ts in by_device.values())


class SpectralCorrection:
    """Corrects masked gradients of 2-D weight matrices with an EMA of anchor (dense) gradients.

    Tuning guide:
      * mode: "paper" reproduces the paper (filter + blend). It only *reweights* the masked
        gradient inside the anchor's singular basis; it cannot restore what the mask removed or
        undo its bias (the mask shrinks a stage gradient towards keep * G). "ef" adds the anchor's
        own measurement of that damage, lam * (M_hat - M_m_hat), so it removes the bias;
        pick it (or "paper_ef", which also damps noise outside the top subspace) when the
        anchor runs with `anchor.with_masked` (it doubles the anchor's compute, never the fast
        step's). "off" is plain AdamW. In the synthetic test (tests/test_spectral.py), cosine
        to the true gradient: raw 0.31, paper(rank=4) 0.73, ef 0.95, paper_ef(rank=4) 0.99.
      * tau vs gradient scale: d_i = s_i / (s_i + tau) is ~1 for s_i >> tau and ~s_i/tau for
        s_i << tau, where s_i are singular values of the (bias-corrected) anchor EMA, i.e. on the
        scale of the gradient itself. With full rank (rank=0) the filter helps only when tau sits
        between the noise floor of M's spectrum and the signal's singular values; then d_i d_j
        acts as a soft truncation. If all s_i >> tau (the paper's 1e-3 against large gradients)
        the filter is just the two-sided projection onto M's row/column spaces, which for an
        m x n matrix removes only the |m - n| directions outside them; if all s_i << tau it
        shrinks G towards alpha*G, a rescaling AdamW normalises away. Measured in the synthetic
        test: cos to the true gradient 0.31 raw -> 0.65 / 0.48 / 0.35 for ||G|| = 0.01 / 1 / 100
        at tau=1e-3, against ~0.73 for rank=4 at every scale. Prefer rank > 0.
      * rank: rank > 0 keeps the top-`rank` triplets, so the filtered part is the two-sided
        projection onto the anchor's top subspace and the blend keeps only alpha of the rest:
        this is what actually suppresses mask noise. Choose rank around the effective rank of
        the anchor gradients (a few to a few tens for LLM weight gradients); too small drops
        signal that changed since the (stale) anchor, too large lets noise through.
      * alpha: weight of the raw masked gradient (paper 0.3); 1 disables the filter, 0 trusts
        the anchor subspace completely. Keep it > 0: anchors are K steps stale.
      * beta: anchor EMA momentum (paper 0.95); lower it when anchors are rare (K large) and the
        gradient's subspace drifts faster than 1/(1-beta) anchors.
      * ef_lambda: weight of the error-feedback term; 1 removes the measured bias fully. Lower it
        if anchors are very stale relative to how fast the gradient changes.

    State is kept in float32 (float64 if the anchor is float64), on the anchor's device. Not
    thread-safe: hand finished anchors to observe_anchor from the training thread, between steps.
    """

    def __init__(self, cfg: SpectralConfig, shapes: Mapping[str, torch.Size], *, bias_correction: bool = True) -> None:
        for name, shape in shapes.items():
            if len(shape) != 2:
                raise ConfigError(f"spectral target {name}", tuple(shape), "must be a 2-D weight matrix")
            if cfg.rank > min(shape):
                raise ConfigError("spectral.rank", cfg.rank, f"exceeds min{tuple(shape)}={min(shape)} of target {name}")
        self.cfg = cfg
        self.bias_correction = bias_correction
        self.shapes: dict[str, torch.Size] = {n: torch.Size(s) for n, s in shapes.items()}
        self._n = 0  # anchors folded into the EMA
        self._anchor_step: int | None = None
        self._M: dict[str, Tensor] = {}
        self._Mm: dict[str, Tensor] = {}
        # Derived caches, rebuilt from the EMAs on every anchor and on load.
        self._svd: dict[str, tuple[Tensor, Tensor, Tensor]] = {}
        self._ef: dict[str, Tensor] = {}

    # ------------------------------------------------------------------ queries
    @property
    def anchor_step(self) -> int | None:
        """Weights' step of the newest anchor folded in (None before the first)."""
        return self._anchor_step

    @property
    def active(self) -> bool:
        """Whether correct_ changes anything (a mode other than "off" and at least one anchor)."""
        return self.cfg.mode != "off" and self._n > 0

    @property
    def uses_filter(self) -> bool:
        return self.cfg.mode in _FILTER_MODES

    @property
    def uses_ef(self) -> bool:
        return self.cfg.mode in _EF_MODES

    # ------------------------------------------------------------------ validation
    def _check_set(self, what: str, tensors: Mapping[str, Tensor]) -> None:
        unknown = sorted(set(tensors) - set(self.shapes))
        if unknown:
            raise TensorError(f"{what}: unknown spectral target(s) {unknown}; known: {sorted(self.shapes)}")
        missing = sorted(set(self.shapes) - set(tensors))
        if missing:
            raise TensorError(f"{what}: missing spectral target(s) {missing}; an anchor must cover every target")
        for name, t in tensors.items():
            self._check_one(f"{what}[{name}]", name, t)
        if not _all_finite(list(tensors.values())):
            for name, t in tensors.items():
                check_finite(f"{what}[{name}]", t)

    def _check_one(self, label: str, name: str, t: Tensor) -> None:
        if not isinstance(t, Tensor):
            raise TensorError(f"{label}: expected a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TensorError(f"{label}: dtype {t.dtype} is not floating point")
        if t.shape != self.shapes[name]:
            raise TensorError(f"{label}: shape {tuple(t.shape)} != target shape {tuple(self.shapes[name])}")

    # ------------------------------------------------------------------ anchor side
    def observe_anchor(
        self, step: int, dense: Mapping[str, Tensor], masked: Mapping[str, Tensor] | None = None
    ) -> None:
        """Fold one anchor pass into the EMAs and refresh the SVD / EF caches.

        `step` is the weights' step the anchor ran on. Everything is validated before any state
        changes: a rejected anchor leaves the correction exactly as it was.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError("anchor step", step, "must be an int >= 0")
        if self._anchor_step is not None and step < self._anchor_step:
            raise ConfigError(
                "anchor step", step, f"is older than the newest anchor already folded in ({self._anchor_step})"
            )
        self._check_set("anchor dense", dense)
        if masked is not None:
            self._check_set("anchor masked", masked)
        elif self.uses_ef:
            raise ConfigError(
                "spectral.mode", self.cfg.mode, "needs the masked anchor gradient; observe_anchor got masked=None"
            )

        if self.cfg.mode != "off":
            # Build the new state aside and commit it only once the SVDs have succeeded.
            beta = self.cfg.beta
            with torch.no_grad():
                M = {name: self._ema(self._M.get(name), g, beta) for name, g in dense.items()}
                Mm = {}
                if self.uses_ef:
                    assert masked is not None
                    Mm = {name: self._ema(self._Mm.get(name), g, beta) for name, g in masked.items()}
                svd, ef = self._caches(M, Mm, self._n + 1)
            self._M, self._Mm, self._svd, self._ef = M, Mm, svd, ef
        self._n += 1
        self._anchor_step = step

    @staticmethod
    def _ema(prev: Tensor | None, g: Tensor, beta: float) -> Tensor:
        """beta*prev + (1-beta)*g from prev = 0, in the state dtype (a new tensor; prev untouched)."""
        if prev is None:
            return (1.0 - beta) * g.detach().to(_work_dtype(g.dtype))
        return prev * beta + (1.0 - beta) * g.detach().to(device=prev.device, dtype=prev.dtype)

    def _hat(self, m: Tensor, n: int) -> Tensor:
        """The EMA on the gradient's scale (divided by 1 - beta^n), or as is without bias correction."""
        if not self.bias_correction:
            return m
        return m / (1.0 - self.cfg.beta**n)

    def _caches(
        self, M: dict[str, Tensor], Mm: dict[str, Tensor], n: int
    ) -> tuple[dict[str, tuple[Tensor, Tensor, Tensor]], dict[str, Tensor]]:
        """SVD factors (filter modes) and the EF term lam*(M_hat - M_m_hat) (EF modes) of the EMAs."""
        svd: dict[str, tuple[Tensor, Tensor, Tensor]] = {}
        ef: dict[str, Tensor] = {}
        if n == 0:
            return svd, ef
        r = self.cfg.rank
        for name, m in M.items():
            m_hat = self._hat(m, n)
            if self.uses_filter:
                U, S, Vh = torch.linalg.svd(m_hat, full_matrices=False)
                if r > 0:
                    U, S, Vh = U[:, :r], S[:r], Vh[:r]
                svd[name] = (U.contiguous(), S.contiguous(), Vh.contiguous())
            if self.uses_ef:
                ef[name] = self.cfg.ef_lambda * (m_hat - self._hat(Mm[name], n))
        return svd, ef

    # ------------------------------------------------------------------ fast side
    def correct_(self, grads: Mapping[str, Tensor]) -> None:
        """Correct the targets among `grads` in place (others ignored); a no-op before any anchor.

        Validates shapes and finiteness first and writes only once every output is computed and
        finite, so on an error no gradient has changed.
        """
        mine = {n: g for n, g in grads.items() if n in self.shapes}
        for name, g in mine.items():
            self._check_one(f"grad[{name}]", name, g)
        if not _all_finite(list(mine.values())):
            for name, g in mine.items():
                check_finite(f"grad[{name}]", g)
        if not self.active:
            return
        out: dict[str, Tensor] = {}
        with torch.no_grad():
            for name, g in mine.items():
                out[name] = self._correct_one(name, g).to(g.dtype)
            if not _all_finite(list(out.values())):
                for name, t in out.items():
                    check_finite(f"corrected grad[{name}] (overflow in {grads[name].dtype})", t)
            for name, g in mine.items():
                g.copy_(out[name])

    def _correct_one(self, name: str, g: Tensor) -> Tensor:
        wd = torch.promote_types(_work_dtype(g.dtype), self._M[name].dtype)
        x = g.detach().to(wd)
        if self.uses_filter:
            U, S, Vh = (t.to(device=g.device, dtype=wd) for t in self._svd[name])
            x = paper_filter(x, U, S, Vh, self.cfg.tau, self.cfg.alpha)
        if self.uses_ef:
            x = x + self._ef[name].to(device=g.device, dtype=wd)
        return x

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """EMAs, anchor count and step; the SVD/EF caches are rebuilt on load."""
        return {
            "mode": self.cfg.mode,
            "bias_correction": self.bias_correction,
            "n": self._n,
            "anchor_step": self._anchor_step,
            "M": {n: t.clone() for n, t in self._M.items()},
            "M_masked": {n: t.clone() for n, t in self._Mm.items()},
        }

    def load_state_dict(self, d: Mapping) -> None:
        """Restore from `state_dict()`; validated completely before any state changes."""
        try:
            n, step, M, Mm = int(d["n"]), d["anchor_step"], dict(d["M"]), dict(d["M_masked"])
        except (KeyError, TypeError, ValueError) as e:
            raise TensorError(f"spectral state: malformed ({e!r})") from e
        if n < 0:
            raise TensorError(f"spectral state: n={n} < 0")
        if step is not None and (not isinstance(step, int) or step < 0):
            raise TensorError(f"spectral state: anchor_step={step!r} is not an int >= 0")
        if (n > 0) != (step is not None):
            raise TensorError(f"spectral state: n={n} but anchor_step={step!r}")
        if self.cfg.mode != "off" and n > 0:
            self._check_set("spectral state M", M)
            if self.uses_ef:
                if not Mm:
                    raise ConfigError(
                        "spectral.mode",
                        self.cfg.mode,
                        "checkpoint has no masked-anchor EMA (saved under a mode without EF)",
                    )
                self._check_set("spectral state M_masked", Mm)
        bias_correction = bool(d.get("bias_correction", self.bias_correction))
        if self.cfg.mode == "off" or n == 0:
            M, Mm = {}, {}
        else:
            M = {k: v.detach().clone().to(_work_dtype(v.dtype)) for k, v in M.items()}
            Mm = {k: v.detach().clone().to(_work_dtype(v.dtype)) for k, v in Mm.items()} if self.uses_ef else {}
        old_bc, self.bias_correction = self.bias_correction, bias_correction
        try:
            svd, ef = self._caches(M, Mm, n)
        except Exception:
            self.bias_correction = old_bc
            raise
        self._n, self._anchor_step = n, step
        self._M, self._Mm, self._svd, self._ef = M, Mm, svd, ef
