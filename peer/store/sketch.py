"""Count sketches of a stage's weights: what a joiner compares a donor's state with, instead of
the weights of every witness (peer/daemon/state_witness.py).

Why: judging a donor needs the distance from its weights to each witness's, per tensor. Fetching
the witnesses' weights costs a third of a state's bytes each (SmolLM2-135M's first stage of two:
81 M values, 326 MB in fp32); a sketch of `size` values per tensor costs `size` x 4 bytes (4,096:
16 KB; that stage's 136 tensors 1.8 MB) and keeps distances and norms to about 2 % (below). The joiner draws the seed per judgement, so no member
can shape weights that are far in full and close in the sketch.

The sketch of x (n values) into k buckets: y[b] = sum over i with h(i) = b of s(i) x[i], with
h(i) = ((a1 i + b1) mod p) mod k, s(i) = +-1 from the low bit of (a2 i + b2) mod p, p = 2^31 - 1
and a1, b1, a2, b2 drawn from (seed, tensor index) by BLAKE2b: integer arithmetic only, the same
on every machine and torch build. It is linear (sketch(x - y) = sketch(x) - sketch(y)), and
E |y|^2 = |x|^2 with a relative spread of about sqrt(2 / k) (2.2 % at 4,096). A tensor of at most
k values is its own sketch (exact).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

P = 2**31 - 1  # a prime: (a i + b) mod P is a universal hash of i < P
CHUNK = 1 << 22  # values hashed at once (bounds the index tensors' memory)
SIZE = 4096  # values per tensor a joiner asks for
MIN_SIZE, MAX_SIZE = 64, 1 << 16  # what a peer computes on request


def _coefficients(seed: int, index: int) -> tuple[int, int, int, int]:
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=16).digest()
    a1, b1, a2, b2 = (int.from_bytes(digest[i : i + 4], "little") % P for i in (0, 4, 8, 12))
    return a1 or 1, b1, a2 or 1, b2


def sketch(t: torch.Tensor, seed: int, index: int, size: int) -> torch.Tensor:
    """The count sketch of `t` (flattened) into `size` float32 values; `index` (the tensor's
    place in the stage) draws its own hash from `seed`. A tensor of at most `size` values is
    returned whole."""
    x = t.detach().reshape(-1).to("cpu", torch.float32)
    n = x.numel()
    if n <= size:
        return x.clone()
    if n >= P:
        raise ValueError(f"a tensor of {n} values is too large to sketch (at most {P - 1})")
    a1, b1, a2, b2 = _coefficients(seed, index)
    out = torch.zeros(size, dtype=torch.float32)
    for lo in range(0, n, CHUNK):
        i = torch.arange(lo, min(n, lo + CHUNK), dtype=torch.int64)  # i * a < 2^62: no overflow
        sign = ((i * a2 + b2) % P % 2) * 2 - 1
        out.index_add_(0, (i * a1 + b1) % P % size, x[lo : lo + CHUNK] * sign)
    return out


def sketches(tensors: Sequence[torch.Tensor], seed: int, size: int) -> list[torch.Tensor]:
    """Each tensor's sketch, in order (the index is its place in the sequence)."""
    return [sketch(t, seed, i, size) for i, t in enumerate(tensors)]


def sketch_length(numel: int, size: int) -> int:
    """How many values a tensor of `numel` sketches to."""
    return min(numel, size)
