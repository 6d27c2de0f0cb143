"""Exceptions a caller can act on; each message names the field and the value."""

from __future__ import annotations


class AnchormeshError(Exception):
    """Base class for every error anchormesh raises on purpose."""


class ConfigError(AnchormeshError, ValueError):
    """A configuration value is out of range or inconsistent (bad run.toml, bad flag, bad argument)."""

    def __init__(self, field: str, value: object, why: str) -> None:
        self.field = field
        self.value = value
        super().__init__(f"{field}={value!r}: {why}")


class TensorError(AnchormeshError, ValueError):
    """A tensor has the wrong shape, dtype or size, or holds NaN/Inf; rejected before it touches state."""


class WireError(AnchormeshError, ValueError):
    """A wire message (bytes or proto) is malformed, oversized or inconsistent with its header."""


def check_finite(name: str, tensor: "torch.Tensor") -> None:  # noqa: F821 - torch imported lazily by callers
    """Raise TensorError if `tensor` holds NaN or Inf; `name` goes into the message."""
    import torch

    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise TensorError(f"{name}: {bad} of {tensor.numel()} entries are NaN or Inf")
