"""Transform coder for a stage boundary: precision spread over every direction (issue 15).

What a real model's boundary needs (docs/benchmarks.md, SmolLM2 probes): not a few directions (a
rank-64 basis costs +60 % of the loss) but every direction at a few bits. So the producer of a
tensor (the sender of activations, the receiver of them for gradients) keeps

    mean     [H]     the mean row of its recent outputs
    bits     [K]     bits per component, by reverse water-filling of `bits_per_value * H` bits
                     over the H principal directions of those rows; the K that get any bits are kept
    rotation [H, K]  those principal directions (the KLT), as int8 with one float32 scale per column
    std      [K]     each component's std after a per-row gain normalisation

and sends, per row, one bf16 gain (the RMS of the centred row) and each component quantised with
the Gaussian-optimal uniform step for its bits (J. Max, 1960), bit-packed. The first `sink`
positions of every sequence (the attention sink: massive activations, up to 11,000x the median
in SmolLM2) travel dense in bf16. The consumer rebuilds mean + gain * (codes * std) @ rotation^T.
An int8 rotation is plenty: its rounding error (~0.3 % per entry) is far below a few-bit
quantiser's, and it halves the coder a producer ships after each refit (H K bytes).

Forward values round to the nearest level; gradients round stochastically (unbiased: the
sender's weight gradient stays an unbiased estimate). The gradient crosses the quantiser as if
it were the identity (straight-through): the stage after the link trains on what it receives.

Payload of one tensor [B, T, H]: the sink rows (bf16, B * sink * H * 2 bytes), the gains (bf16,
2 bytes per other row), then the codes grouped by width b = 1..8 (components of that width, row
by row, b bits each, most significant bit first, the group padded to a byte).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from peer.errors import ConfigError, WireError

# Uniform quantiser of a unit Gaussian with 2**b levels (mid-rise): MSE-optimal step and its MSE.
STEP = {1: 1.596, 2: 0.9957, 3: 0.5860, 4: 0.3352, 5: 0.1881, 6: 0.1041, 7: 0.0568, 8: 0.0307}
MSE = {0: 1.0, 1: 0.3634, 2: 0.1188, 3: 0.03744, 4: 0.01154, 5: 0.00349, 6: 0.001035, 7: 0.000306, 8: 0.0000876}
MAX_BITS = 8
ROW_CLASSES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # bits per value of the rate classes a row of a gradient may take
BUFFER_ROWS_PER_H = 4  # a learner keeps its newest 4 H rows: a covariance of H dimensions wants several times H samples
_MSE = torch.tensor([MSE[b] for b in range(MAX_BITS + 1)] + [MSE[MAX_BITS]], dtype=torch.float64)
_STEP = torch.tensor([0.0] + [STEP[b] for b in range(1, MAX_BITS + 1)])


def allocate(var: Tensor, budget: int, max_bits: int = MAX_BITS) -> Tensor:
    """Bits per component for variances `var`: reverse water-filling of `budget` bits (each bit
    goes where it removes the most expected squared error). The marginal gains of one component
    fall with every bit it has, so the greedy choice is the `budget` largest gains over all
    (component, next bit) pairs, taken at once. Deterministic given `var`."""
    v = var.double().cpu().clamp(min=0)
    drops = _MSE[:max_bits] - _MSE[1 : max_bits + 1]  # [max_bits], decreasing
    gains = (v[:, None] * drops[None]).reshape(-1)
    take = gains.topk(min(budget, len(gains))).indices
    take = take[gains[take] > 0]
    return torch.bincount(take // max_bits, minlength=len(v))


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
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64) if data else torch.zeros(0, dtype=torch.int64)
    if width == 8:
        return raw[:count]
    words_n = -(-count // 8)
    full = torch.zeros(words_n * width, dtype=torch.int64)
    full[: len(raw)] = raw
    words = (full.reshape(-1, width) << (8 * torch.arange(width - 1, -1, -1))).sum(1)
    codes = (words[:, None] >> (width * torch.arange(7, -1, -1))) & ((1 << width) - 1)
    return codes.reshape(-1)[:count]


def packed_bytes(count: int, width: int) -> int:
    return (count * width + 7) // 8


@dataclass
class TransformState:
    """What both ends hold for one version of a producer's coder (see the module docstring).
    Every field is as it travels (the std rounded to fp16), so both ends compute alike.

    `bits` has one row per rate class. One class: every row is coded alike (activations: the
    next layer normalises each row, so each row's relative error is what counts). Several
    (gradients: the stage before sums them into its weight gradient, so absolute error counts):
    the encoder gives each row the class that minimises the message's squared error within the
    budget (rows with large gradients get more bits, near-zero rows may get none) and sends the
    class of each row in one byte."""

    version: int
    mean: Tensor  # [H] float32
    rotation_q: Tensor  # [H, K] int8: the kept principal directions as columns
    rotation_scale: Tensor  # [K] float32: column k is rotation_q[:, k] * rotation_scale[k]
    std: Tensor  # [K] > 0
    bits: Tensor  # [C, K] int64 in [0, MAX_BITS]: bits per component of each rate class
    distortion: Tensor | None = None  # [C]: a row's expected relative squared error in each class (the producer's; chooses classes)

    def __post_init__(self) -> None:
        self.rotation = self.rotation_q.float() * self.rotation_scale  # [H, K]
        self.class_bits = self.bits.sum(1)  # [C] bits per row of each class

    @property
    def hidden_size(self) -> int:
        return len(self.mean)

    @property
    def classes(self) -> int:
        return self.bits.shape[0]

    def _groups(self, c: int) -> list[tuple[int, Tensor]]:
        """(width, components) of rate class `c`, widths ascending."""
        return [(b, (self.bits[c] == b).nonzero().flatten()) for b in range(1, MAX_BITS + 1) if bool((self.bits[c] == b).any())]

    def _body_bytes(self, rows_per_class: Tensor) -> int:
        return sum(packed_bytes(int(n) * len(cols), b) for c, n in enumerate(rows_per_class.tolist()) if n for b, cols in self._groups(c))

    def payload_bytes(self, batch: int, seq: int, sink: int, row_class: Tensor | None = None) -> int:
        """Exact payload bytes of a [batch, seq, H] tensor (several classes: given each row's)."""
        head = min(sink, seq)
        rows = batch * (seq - head)
        if self.classes == 1:
            per_class = torch.tensor([rows])
        else:
            per_class = torch.bincount(row_class, minlength=self.classes) if row_class is not None else torch.zeros(self.classes, dtype=torch.long)
        return batch * head * self.hidden_size * 2 + 2 * rows + (rows if self.classes > 1 else 0) + self._body_bytes(per_class)

    def choose_classes(self, energy: Tensor, row_budget: int) -> Tensor:
        """Each row's class, minimising sum(energy * distortion[class]) with at most
        `row_budget` bits per row on average (a Lagrangian bisection over the bit price)."""
        if self.distortion is None:
            raise ValueError("choosing rate classes needs the producer's distortion table")
        d, cost = self.distortion.double().to(energy.device), self.class_bits.double().to(energy.device)
        e = energy.double()[:, None]
        lo, hi = 0.0, float(e.max()) * float(d.max()) + 1.0  # at hi every row takes the cheapest class
        pick = (e * d + hi * cost).argmin(1)
        for _ in range(50):
            mid = (lo + hi) / 2
            trial = (e * d + mid * cost).argmin(1)
            if float(cost[trial].mean()) > row_budget:
                lo = mid
            else:
                hi, pick = mid, trial
        return pick

    def encode(self, x: Tensor, sink: int, stochastic: bool = False, generator: torch.Generator | None = None, row_budget: int | None = None) -> bytes:
        """The payload of `x` [B, T, H] (any float dtype; coded in float32). `stochastic`: round
        to one of the two nearest levels at random (drawn from `generator`), unbiased inside the
        range. Several classes: `row_budget` bits per row on average."""
        x = x.detach().float()
        head = min(sink, x.shape[1])
        parts = [x[:, :head].to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy().tobytes()]
        rows = x[:, head:].reshape(-1, x.shape[-1])
        dev = rows.device
        resid = rows - self.mean.to(dev)
        gain = resid.pow(2).mean(1, keepdim=True).sqrt().to(torch.bfloat16)  # bf16: gradients' gains lie below fp16's range
        parts.append(gain.view(torch.int16).cpu().numpy().tobytes())
        gain = gain.float().clamp(min=1e-30)
        if self.classes == 1:
            row_class = torch.zeros(len(rows), dtype=torch.long, device=dev)
        else:
            row_class = self.choose_classes(gain[:, 0].pow(2), int(self.class_bits.max()) if row_budget is None else row_budget)
            parts.append(row_class.to(torch.uint8).cpu().numpy().tobytes())
        z = (resid / gain) @ self.rotation.to(dev) / self.std.to(dev)
        for c in range(self.classes):
            members = (row_class == c).nonzero().flatten()
            if not len(members):
                continue
            for b, cols in self._groups(c):
                half = 2 ** (b - 1)
                t = z[members][:, cols.to(dev)] / STEP[b]
                if stochastic:  # between the two nearest levels (q + 0.5) * step
                    t = t - 0.5
                    lo = torch.floor(t)
                    q = lo + (torch.rand(t.shape, generator=generator, device=t.device) < (t - lo)).float()
                else:
                    q = torch.floor(t)
                parts.append(pack(q.clamp_(-half, half - 1).to(torch.int64) + half, b))
        return b"".join(parts)

    def decode(self, payload: bytes, batch: int, seq: int, sink: int, device: torch.device | str = "cpu", max_row_bits: int | None = None) -> Tensor:
        """[batch, seq, H] float32 from a payload of exactly `payload_bytes`; WireError otherwise
        (also for row classes out of range or, with `max_row_bits`, more bits per row on average)."""
        H = self.hidden_size
        head = min(sink, seq)
        n_head = batch * head * H * 2
        rows = batch * (seq - head)
        at = n_head + 2 * rows
        row_class = torch.zeros(rows, dtype=torch.long)
        if self.classes > 1:
            if len(payload) < at + rows:
                raise WireError(f"TensorPayload.payload: {len(payload)} bytes: too short for {rows} gains and row classes (transform coder v{self.version})")
            row_class = torch.frombuffer(bytearray(payload[at : at + rows]), dtype=torch.uint8).to(torch.long) if rows else row_class
            if rows and int(row_class.max()) >= self.classes:
                raise WireError(f"TensorPayload.payload: row class {int(row_class.max())}: the coder has {self.classes}")
            if max_row_bits is not None and rows and float(self.class_bits[row_class].float().mean()) > max_row_bits:
                raise WireError(f"TensorPayload.payload: {float(self.class_bits[row_class].float().mean()):.1f} bits per row on average: this run allows {max_row_bits}")
            at += rows
        want = self.payload_bytes(batch, seq, sink, row_class)
        if len(payload) != want:
            raise WireError(f"TensorPayload.payload: {len(payload)} bytes, expected {want} (transform coder v{self.version}, shape [{batch}, {seq}, {H}])")
        out = torch.empty(batch, seq, H)
        out[:, :head] = torch.frombuffer(bytearray(payload[:n_head]), dtype=torch.int16).view(torch.bfloat16).float().reshape(batch, head, H) if n_head else 0
        gain = torch.frombuffer(bytearray(payload[n_head : n_head + 2 * rows]), dtype=torch.int16).view(torch.bfloat16).float().reshape(rows, 1) if rows else torch.zeros(0, 1)
        if not bool(torch.isfinite(out[:, :head]).all()) or not bool(torch.isfinite(gain).all()) or bool((gain < 0).any()):
            raise WireError("TensorPayload.payload: NaN/Inf in the sink rows or a gain that is not a finite non-negative number")
        z = torch.zeros(rows, self.bits.shape[1])
        for c in range(self.classes):
            members = (row_class == c).nonzero().flatten()
            if not len(members):
                continue
            for b, cols in self._groups(c):
                n = len(members) * len(cols)
                size = packed_bytes(n, b)
                q = unpack(payload[at : at + size], b, n).reshape(len(members), len(cols))
                z[members[:, None], cols[None]] = (q - 2 ** (b - 1)).float().add_(0.5).mul_(STEP[b])
                at += size
        out[:, head:] = (self.mean + gain * ((z * self.std) @ self.rotation.T)).reshape(batch, seq - head, H)
        return out.to(device)


class TransformLearner:
    """The producer's side: keeps its recent rows (sink positions excluded) and fits a new
    `TransformState` every `refresh` steps. The first fit comes as soon as `min_rows` rows were
    seen (H / 4: usually the first micro-batch; until then the tensor travels dense), a second
    one when the buffer first holds `2 H` rows (the first saw too few rows to span every
    direction), then one per `refresh` steps."""

    def __init__(self, hidden_size: int, bits_per_value: float, refresh: int, *, row_classes: bool = False, buffer_rows: int | None = None, min_rows: int | None = None) -> None:
        if not 0 < bits_per_value <= MAX_BITS:
            raise ConfigError("bits_per_value", bits_per_value, f"must be in (0, {MAX_BITS}]")
        self.hidden_size = hidden_size
        self.budget = max(1, round(bits_per_value * hidden_size))
        self.row_classes = row_classes
        self.refresh = refresh
        self.min_rows = min_rows or max(1, hidden_size // 4)
        self.full_rows = 2 * hidden_size
        self._fitted_full = False
        self.buffer_rows = buffer_rows or BUFFER_ROWS_PER_H * hidden_size
        self.rows: list[Tensor] = []
        self.current: TransformState | None = None
        self._last_fit: int | None = None

    def observe(self, x: Tensor, sink: int) -> None:
        rows = x.detach()[:, min(sink, x.shape[1]) :].reshape(-1, x.shape[-1]).float()
        self.rows.append(rows)
        total = sum(len(r) for r in self.rows)
        while len(self.rows) > 1 and total - len(self.rows[0]) >= self.buffer_rows:
            total -= len(self.rows.pop(0))

    def maybe_refresh(self, step: int) -> TransformState | None:
        """A new state when due and enough rows were seen (returned: the caller ships it)."""
        rows = sum(len(r) for r in self.rows)
        early = self.current is not None and not self._fitted_full and rows >= self.full_rows
        if not early and self._last_fit is not None and step - self._last_fit < self.refresh:
            return None
        if rows < self.min_rows:
            return None
        self.current = fit(torch.cat(self.rows), self.budget, 1 if self.current is None else self.current.version + 1, self.row_classes)
        self._fitted_full = self._fitted_full or rows >= self.full_rows
        self._last_fit = step
        return self.current


def fit(rows: Tensor, budget: int, version: int, row_classes: bool = False) -> TransformState:
    """A coder for `rows` [N, H]: centre, per-row gain normalisation, PCA, bit allocation (one
    class of `budget` bits per row, or with `row_classes` one per entry of ROW_CLASSES)."""
    H = rows.shape[1]
    rows = rows.double()
    mean = rows.mean(0)
    resid = rows - mean
    z = resid / resid.pow(2).mean(1, keepdim=True).sqrt().clamp(min=1e-30)
    cov = z.T @ z / len(z)
    var, vecs = torch.linalg.eigh(cov)
    var, vecs = var.flip(0).clamp(min=0), vecs.flip(1)
    budgets = [round(c * H) for c in ROW_CLASSES] if row_classes else [budget]
    bits = torch.stack([allocate(var, b) if b else torch.zeros(H, dtype=torch.long) for b in budgets])
    kept = bits.amax(0) > 0
    rotation = vecs[:, kept].float()
    scale = (rotation.abs().amax(0) / 127).clamp(min=1e-12)
    rotation_q = torch.round(rotation / scale).clamp_(-127, 127).to(torch.int8)
    std = var[kept].sqrt().clamp(min=1e-6).half().float()
    total = float(var.sum()) or 1.0
    lost = float(var[~kept].sum())
    distortion = torch.tensor([(float((var[kept] * _MSE[b[kept]]).sum()) + lost) / total for b in bits])
    return TransformState(version, mean.float(), rotation_q, scale, std, bits[:, kept], distortion)
