"""Bits on the wire for the transform coder (peer/codec/transform.py): codes packed at any
width from 1 to 8 bits, and what both ends of a message derive from its key: the dither offsets
and the signed permutation of a gradient's coordinates (mask.grad_rotation "message")."""

from __future__ import annotations

import torch
from torch import Tensor

from peer.codec.mask import hash_words


def pack(codes: Tensor, width: int) -> bytes:
    """Unsigned `codes` (< 2**width), `width` bits each, MSB first, padded to a byte. Eight codes
    make one 8*width-bit word (at most 56 bits below width 8), cut into `width` bytes."""
    codes = codes.reshape(-1).to(torch.int64)
    if width == 8:
        return codes.to(torch.uint8).cpu().numpy().tobytes()
    n = len(codes)
    pad = (-n) % 8
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    words = (codes.reshape(-1, 8) << (width * torch.arange(7, -1, -1, device=codes.device))).sum(1)
    out = ((words[:, None] >> (8 * torch.arange(width - 1, -1, -1, device=codes.device))) & 255).to(torch.uint8)
    return out.reshape(-1)[: packed_bytes(n, width)].cpu().numpy().tobytes()


def unpack(data: bytes, width: int, count: int) -> Tensor:
    """Inverse of `pack`: `count` codes of `width` bits (int64)."""
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    return unpack_codes(raw, width, count)


def unpack_codes(raw: Tensor, width: int, count: int) -> Tensor:
    """`unpack` of packed bytes already in a uint8 tensor, on that tensor's device (int64)."""
    dev = raw.device
    raw = raw.to(torch.int64)
    if width == 8:
        return raw[:count]
    words_n = -(-count // 8)
    full = torch.zeros(words_n * width, dtype=torch.int64, device=dev)
    full[: len(raw)] = raw
    words = (full.reshape(-1, width) << (8 * torch.arange(width - 1, -1, -1, device=dev))).sum(1)
    codes = (words[:, None] >> (width * torch.arange(7, -1, -1, device=dev))) & ((1 << width) - 1)
    return codes.reshape(-1)[:count]


def packed_bytes(count: int, width: int) -> int:
    return (count * width + 7) // 8


def dither(seed: int, rows: int, cols: Tensor, hidden: int) -> Tensor:
    """Offsets in [0, 1) for rows x `cols` of a message, the same on every device: the mask's
    integer PRF (peer/codec/mask.py: hash_words) of (seed, row * hidden + column), its top 24
    bits as a float32 fraction (exact). Why not torch's generator: its streams differ between
    CPU and CUDA, and sender and receiver of a gradient may sit on either."""
    return dither_at(
        seed,
        torch.arange(rows, device=cols.device, dtype=torch.int64).unsqueeze(1),
        cols.to(torch.int64).unsqueeze(0),
        hidden,
        wide=rows * hidden >= 1 << 32,
    )


def dither_at(seed: int, rows: Tensor, cols: Tensor, hidden: int, *, wide: bool) -> Tensor:
    """`dither`'s offsets at any (row, column) pairs: `rows` and `cols` broadcast together.
    `wide`: the message has rows * hidden >= 2**32 (the caller knows its size: reading the
    largest index here would wait for the device)."""
    return (hash_words(seed, rows * hidden + cols, wide=wide) >> 8).to(torch.float32) / float(1 << 24)


SHUFFLE_SALT = 0x5EED_5A17  # the signed permutation's key differs from the dither's


def signed_permutation(seed: int, hidden: int, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """(signs [H] of +-1.0, perm [H]) for a message's key, the same on every device (the mask's
    PRF, on the host). A row r enters the fixed rotation as (r * signs)[perm]. Why: with one
    fixed rotation a coding error that depends on the value (clipping, nearest rounding) is the
    same in every message and adds up over steps into a bias; a fresh signed permutation per
    message turns it into noise that averages out."""
    h = hash_words(seed ^ SHUFFLE_SALT, torch.arange(hidden, dtype=torch.int64), wide=False)
    signs = (h & 1).to(torch.float32).mul_(2.0).sub_(1.0)
    perm = torch.argsort(h >> 1, stable=True)
    return signs.to(device), perm.to(device)


def pack_levels(q: Tensor, width: int) -> bytes:
    """Signed levels `q` (steps below / above zero, clipped to the `width`-bit range
    [-2**(width-1), 2**(width-1) - 1]) packed as unsigned codes."""
    half = 2 ** (width - 1)
    return pack(q.clamp_(-half, half - 1).to(torch.int64) + half, width)


def dithered(t: Tensor, offsets: Tensor) -> Tensor:
    """The level of `t` (values in steps) with subtractive dither: `t - 0.5 + offset` rounded
    down; `undithered` with the same offsets gives back t within half a step."""
    return torch.floor(t - 0.5 + offsets)


def undithered(codes: Tensor, width: int, offsets: Tensor) -> Tensor:
    """Values in steps of unsigned `codes` that `dithered` and `pack_levels` made: the level,
    plus 1, less the offset the sender added (error uniform in half a step)."""
    return (codes - 2 ** (width - 1)).float().add_(1.0).sub_(offsets)
