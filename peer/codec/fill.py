"""The receiver's estimate of a boundary hidden state from its kept entries.

Given the kept values (dropped entries 0), the keep-mask m, the keep fraction q and an optional
prior p (what the receiver expects at each entry, e.g. the token prior), the next stage runs on

    zero            h~ = h * m                        the paper: no rescaling; biased (E = q h)
    token_prior     h~ = h * m + p * (1 - m)          biased towards the prior where dropped
    rescale         h~ = h * m / q                    inverted dropout: unbiased, E[h~] = h
    prior_rescale   h~ = p + m * (h - p) / q          unbiased around the prior (control variate)

Training sees h~, evaluation (the exported model) sees h, so an unbiased h~ keeps the two
consistent the way dropout does; a good prior shrinks the variance the rescaling adds. The map is
built from autograd ops, so the gradient sent back for kept entries is exactly d(loss)/dh.
"""

from __future__ import annotations

import torch

FILLS = ("zero", "token_prior", "rescale", "prior_rescale")
USES_PRIOR = ("token_prior", "prior_rescale")


def reconstruct(
    h: torch.Tensor, keep: torch.Tensor, keep_frac: float, mode: str, prior: torch.Tensor | None
) -> torch.Tensor:
    """h~ from the kept values `h` [.., H] (dropped entries ignored), bool `keep` of the same shape."""
    m = keep.to(h.dtype)
    if mode == "zero":
        return h * m
    if mode == "rescale":
        return h * m / keep_frac
    if prior is None:
        raise ValueError(f"codec.mask.fill={mode!r} needs a prior tensor")
    p = prior.to(h.dtype)
    if mode == "token_prior":
        return h * m + p * (1 - m)
    if mode == "prior_rescale":
        return p + m * (h - p) / keep_frac
    raise ValueError(f"codec.mask.fill={mode!r}: must be one of {FILLS}")
