"""A member's commitment to what it sends in an averaging round: a Merkle root over its values.

Why: the checks of a round (peer/dp/claims.py) compare the result with what the members say they
sent at some coordinates. If those coordinates were known before the round (seeded by the group
key, as they once were), a member could send honest values there and poison everywhere else.
So a member commits to *all* its values before the round (the root travels in its signed claim),
and after the round each member asks every other for a few leaves it drew privately, with the
Merkle paths that prove them against the root (peer/dp/audit.py). Nobody knows in advance which
leaves anyone will ask for, and nobody can answer for values other than those it committed to.

The tree: leaves of `LEAF` fp32 values (the last may be shorter), leaf hash = SHA-256(0x00 ||
bytes), node hash = SHA-256(0x01 || left || right); a level of odd length repeats its last node.
The number of values is signed next to the root, so the shape of the tree is fixed.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

LEAF = 1024  # values per leaf (4 KiB): a revealed leaf is this many contiguous coordinates
HASH = 32  # bytes of a SHA-256 digest


def _leaf_hash(data: bytes | memoryview) -> bytes:
    h = hashlib.sha256(b"\0")
    h.update(data)  # no copy of the leaf (hashlib releases the GIL on large buffers)
    return h.digest()


def _node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\1" + left + right).digest()


def leaf_count(n: int) -> int:
    """How many leaves a vector of `n` values has."""
    return max(math.ceil(n / LEAF), 1)


@dataclass
class Commitment:
    """A vector of fp32 values (host, flat) and every level of its Merkle tree, leaves first."""

    values: torch.Tensor
    levels: list[list[bytes]]

    @property
    def root(self) -> bytes:
        return self.levels[-1][0]

    def reveal(self, leaves: list[int]) -> tuple[bytes, bytes]:
        """The values of `leaves` (fp32 bytes, concatenated in the given order) and their Merkle
        paths (per leaf, one sibling hash per level below the root, concatenated)."""
        flat = self.values.numpy()
        values, proof = [], []
        for leaf in leaves:
            values.append(flat[leaf * LEAF : (leaf + 1) * LEAF].tobytes())
            i = leaf
            for level in self.levels[:-1]:
                proof.append(level[i ^ 1])  # every level below the root has even length (`commit` pads it)
                i //= 2
        return b"".join(values), b"".join(proof)


def commit(tensors: list[torch.Tensor]) -> Commitment:
    """Commit to the concatenation of `tensors` (copied as host fp32: the round overwrites them)."""
    values = torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors]) if tensors else torch.zeros(0)
    raw = memoryview(values.numpy()).cast("B")
    step = LEAF * 4
    level = [_leaf_hash(raw[i : i + step]) for i in range(0, max(len(raw), 1), step)]
    levels = [level]
    while len(level) > 1:
        if len(level) % 2:
            level = level + [level[-1]]
            levels[-1] = level
        level = [_node_hash(level[i], level[i + 1]) for i in range(0, len(level), 2)]
        levels.append(level)
    return Commitment(values, levels)


def leaf_sizes(n: int, leaves: list[int]) -> list[int]:
    """How many values each of `leaves` holds in a vector of `n` values (the last leaf may be short)."""
    return [min(LEAF, n - leaf * LEAF) for leaf in leaves]


def verify(root: bytes, n: int, leaves: list[int], values: bytes, proof: bytes) -> str:
    """Why `values` and `proof` are not the committed values of `leaves` under `root` (a vector
    of `n` values); "" when they are."""
    count = leaf_count(n)
    if any(not 0 <= leaf < count for leaf in leaves):
        return f"a leaf index is outside the {count} leaves"
    depth = math.ceil(math.log2(count)) if count > 1 else 0
    sizes = leaf_sizes(n, leaves)
    if len(values) != 4 * sum(sizes):
        return f"{len(values)} bytes of values where {4 * sum(sizes)} were asked for"
    if len(proof) != HASH * depth * len(leaves):
        return f"a proof of {len(proof)} bytes where {HASH * depth * len(leaves)} were expected"
    at, path = 0, 0
    for leaf, size in zip(leaves, sizes):
        h, i = _leaf_hash(values[at : at + 4 * size]), leaf
        at += 4 * size
        for _ in range(depth):
            sibling = proof[path : path + HASH]
            path += HASH
            h = _node_hash(h, sibling) if i % 2 == 0 else _node_hash(sibling, h)
            i //= 2
        if h != root:
            return f"leaf {leaf} does not match the committed root"
    return ""
