"""Per-row rates for the gradients (mask.grad_rates = "row"): each row's bits where its error costs most.

Why: a boundary gradient's rows (one per token) carry very different energies (SmolLM2: the top
tenth of the rows holds 35-38 % of the squared norm, the median row 0.6 times the mean), yet
the even coder spends the same bits on each. Here the producer gives each row one of eight rate
classes, at the same bits per message on average (the run's `mask.grad_bits`), choosing them to
minimise the expected squared error of the whole message (a Lagrangian over the rows: a row of
energy e in class c costs e * distortion[c] + lambda * bits[c]). Every class is unbiased inside
its quantiser's range, as the even coder is (a value beyond it is clipped):

    classes 0-2: a random eighth, quarter or half of the row's rotated components at 1 bit,
                 scaled by H / kept (random sparsification: the rest read as 0)
    classes 3-7: every component at 1, 2, 3, 4 or 5 bits

The components kept and the dither offsets come from the message's key (the mask's PRF), so
the receiver needs nothing but one 3-bit class per row. Payload after the gains (and any
message statistics): the classes, 3 bits per row, then each class's codes, rows in order, kept
components in ascending order, at the class's width (peer/codec/bitpack.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from peer.codec.bitpack import dither_at, dithered, pack, pack_levels, packed_bytes, undithered, unpack_codes
from peer.codec.mask import hash_words

CLASS_BITS = 3
CLASSES = ((8, 1), (4, 1), (2, 1), (1, 1), (1, 2), (1, 3), (1, 4), (1, 5))  # (1 / share kept, bits)
# relative squared error of one unit-variance component coded with dither at the Gaussian-optimal
# step (transform.STEP, mask.grad_step_scale 1), measured with the coder (1 bit 0.445 ... 5 bits 0.0036)
DITHER_MSE = {1: 0.445, 2: 0.129, 3: 0.0385, 4: 0.0117, 5: 0.0036}
SUBSET_SALT = 0x2545F4914F6CDD1D  # the kept components' PRF key = the message's seed ^ this


def kept(hidden: int, cls: int) -> int:
    """Components a row of class `cls` sends."""
    return max(1, hidden // CLASSES[cls][0])


def class_bits(hidden: int) -> Tensor:
    """Bits of one row in each class [8]."""
    return torch.tensor([kept(hidden, c) * b for c, (_, b) in enumerate(CLASSES)], dtype=torch.float64)


def distortion(hidden: int) -> Tensor:
    """Expected squared error of one row in each class per unit of its energy [8]: sparsifying
    to k of H components adds (H / k - 1), and their quantisation error grows by H / k."""
    share = torch.tensor([hidden / kept(hidden, c) for c in range(len(CLASSES))], dtype=torch.float64)
    return (share - 1) + torch.tensor([DITHER_MSE[b] for _, b in CLASSES], dtype=torch.float64) * share


def allocate_rows(energy: Tensor, hidden: int, row_budget: int) -> Tensor:
    """A class per row [rows] (int64, on the CPU) with at most `row_budget` bits per row on
    average, minimising sum(energy * distortion): bisection on the Lagrange multiplier (the
    classes' (bits, distortion) points are convex, so each multiplier's per-row choice is optimal
    for the bits it spends). `row_budget` of at least H / 8 bits (mask.grad_bits >= 1 gives H)."""
    e = energy.detach().double().cpu().clamp(min=0).reshape(-1, 1)
    if not len(e):
        return torch.zeros(0, dtype=torch.int64)
    bits, dist = class_bits(hidden), distortion(hidden)
    total = row_budget * len(e)

    def choose(lam: float) -> Tensor:
        return (e * dist + lam * bits).argmin(1)

    scale = float(e.mean()) + 1e-300
    lo, hi = -40.0, 10.0  # log10(lambda / mean energy): lo spends everything on 5 bits, hi nothing above class 0
    if float(bits[choose(scale * 10.0**lo)].sum()) <= total:
        return choose(scale * 10.0**lo)
    for _ in range(60):
        mid = (lo + hi) / 2
        if float(bits[choose(scale * 10.0**mid)].sum()) <= total:
            hi = mid
        else:
            lo = mid
    return choose(scale * 10.0**hi)


def _columns(seed: int, rows: Tensor, hidden: int, k: int, wide: bool = False) -> Tensor:
    """The `k` components each of `rows` keeps [n, k], ascending: the k smallest PRF words of
    (row, column), the column breaking ties (the same set and order on every device). `wide`:
    as for bitpack.dither_at."""
    cols = torch.arange(hidden, device=rows.device, dtype=torch.int64)
    index = rows.unsqueeze(1) * hidden + cols.unsqueeze(0)
    key = (hash_words(seed ^ SUBSET_SALT, index, wide=wide) << 16) | cols  # hidden < 2**16
    return key.topk(k, dim=1, largest=False).indices.sort(dim=1).values


def code_bits(classes: Tensor, hidden: int) -> int:
    """Bits of the codes of rows in `classes` (not counting the classes themselves)."""
    counts = torch.bincount(classes.cpu(), minlength=len(CLASSES))
    return int((counts.double() * class_bits(hidden)).sum())


def code_bytes(classes: Tensor, hidden: int) -> int:
    """Bytes of the codes of rows in `classes` (each class packed apart, padded to a byte)."""
    counts = torch.bincount(classes.cpu(), minlength=len(CLASSES)).tolist()
    return sum(packed_bytes(n * kept(hidden, c), CLASSES[c][1]) for c, n in enumerate(counts) if n)


def encode(z: Tensor, energy: Tensor, seed: int, row_budget: int, step: dict[int, float]) -> list[bytes]:
    """The classes and codes of `z` [rows, H] (rotated components of unit scale): each class's
    values in steps `step[bits]`, rounded with subtractive dither (the offsets of
    bitpack.dither_at for the message's `seed`), clipped to the class's levels."""
    rows, H = z.shape
    wide = rows * H >= 1 << 32
    classes = allocate_rows(energy, H, row_budget)
    parts = [pack(classes, CLASS_BITS)]
    on = classes.to(z.device)
    for c, (_, b) in enumerate(CLASSES):
        idx = (on == c).nonzero().flatten()
        if not len(idx):
            continue
        k = kept(H, c)
        cols = torch.arange(H, device=z.device).expand(len(idx), H) if k == H else _columns(seed, idx, H, k, wide)
        t = z[idx.unsqueeze(1), cols] / step[b]
        parts.append(pack_levels(dithered(t, dither_at(seed, idx.unsqueeze(1), cols, H, wide=wide)), b))
    return parts


def parse_classes(raw: Tensor, rows: int) -> Tensor:
    """The classes [rows] at the head of `raw` (uint8); every 3-bit value is a class."""
    return unpack_codes(raw[: packed_bytes(rows, CLASS_BITS)], CLASS_BITS, rows)


def decode(codes: Tensor, classes: Tensor, hidden: int, seed: int, step: dict[int, float]) -> Tensor:
    """Inverse of `encode`: z [rows, H] on `codes`' device (components a row did not keep are 0,
    the kept ones scaled by H / kept: unbiased)."""
    dev = codes.device
    rows = len(classes)
    wide = rows * hidden >= 1 << 32
    z = torch.zeros(rows, hidden, device=dev)
    on = classes.to(dev)
    at = 0
    for c, (_, b) in enumerate(CLASSES):
        idx = (on == c).nonzero().flatten()
        if not len(idx):
            continue
        k = kept(hidden, c)
        n = len(idx) * k
        size = packed_bytes(n, b)
        q = unpack_codes(codes[at : at + size], b, n).reshape(len(idx), k)
        at += size
        cols = (
            torch.arange(hidden, device=dev).expand(len(idx), hidden)
            if k == hidden
            else _columns(seed, idx, hidden, k, wide)
        )
        z[idx.unsqueeze(1), cols] = undithered(q, b, dither_at(seed, idx.unsqueeze(1), cols, hidden, wide=wide)).mul_(
            step[b] * hidden / k
        )
    return z


def reach(hidden: int, step: dict[int, float]) -> float:
    """The largest decoded component of a unit-scale row in any class (before the coder's std)."""
    return max(2 ** (b - 1) * step[b] * hidden / kept(hidden, c) for c, (_, b) in enumerate(CLASSES))
