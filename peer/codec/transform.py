"""Transform coder for a stage boundary: precision spread over every direction.

What a real model's boundary needs (docs/benchmarks.md, "Boundary codecs"): not a few directions (a
rank-64 basis costs +60 % of the loss) but every direction at a few bits. Each tensor's producer
holds a coder

    mean     [H]     a mean row
    rotation [H, H]  an orthogonal rotation, as int8 with one float32 scale per column
    std      [H]     each rotated component's std after a per-row gain normalisation
    bits     [H]     bits per component

and sends, per row, one bf16 gain (the RMS of the centred row) and each component quantised with
the Gaussian-optimal uniform step for its bits (J. Max, 1960), bit-packed. The consumer rebuilds
mean + gain * (codes * std) @ rotation^T. An int8 rotation is plenty: its rounding error (~1 %
of the signal) is far below a few-bit quantiser's, and it halves the coder a producer ships.

Two coders, measured on SmolLM2-135M and the toy (docs/benchmarks.md, "Quality in-process"):
- Activations: the KLT of the producer's recent outputs (`act_coder.fit`: their mean, principal
  directions and stds, bits by reverse water-filling, at least one bit per direction: a
  direction that never crosses the link is one the next stage never learns to read, and meets
  first at evaluation), refitted every `refresh` steps; values round to the nearest level. The
  first `sink` positions of every sequence (the attention sink: massive activations, up to
  11,000x the median in SmolLM2) travel dense in bf16.
- Gradients: a fixed random rotation and the same bits everywhere (`grad_coder.random_coder`), values
  rounded stochastically with steps GRAD_STEP_SCALE times the Gaussian-optimal ones (so that
  few clip: a clipped value is a biased one). Why: a gradient's statistics move faster than the refits (a
  fitted coder went stale and clipped: +23 % on the toy), and a biased gradient costs far more
  than a noisy one (rows dropped to save bits: +3.7 % on SmolLM2); a random rotation makes every
  component of a row about Gaussian with the row's own gain, whatever the gradient does. With
  `mask.grad_rounding = "dither"` they round with subtractive dither instead (`dither`: an
  offset both ends draw from the message's key): uniform error, half the mean square; and
  dither needs no wide steps (its error does not grow where few values clip), so
  `mask.grad_step_scale` may narrow them (1: half the error again at 1 bit). The activations
  may dither too (`mask.act_rounding`): the same error's size as nearest rounding, but
  independent of the value.
The gradient crosses the activations' quantiser as if it were the identity (straight-through).

Payload of one tensor [B, T, H]: the sink rows (bf16, B * sink * H * 2 bytes), the gains (bf16,
2 bytes per other row), then the codes grouped by width b = 1..8 (components of that width, row
by row, b bits each, most significant bit first, the group padded to a byte).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from peer.codec import row_rates as rr
from peer.codec.bitpack import dither, dithered, pack_levels, packed_bytes, signed_permutation, undithered, unpack_codes
from peer.errors import ConfigError, WireError

# Uniform quantiser of a unit Gaussian with 2**b levels (mid-rise): MSE-optimal step and its MSE.
STEP = {1: 1.596, 2: 0.9957, 3: 0.5860, 4: 0.3352, 5: 0.1881, 6: 0.1041, 7: 0.0568, 8: 0.0307}
MSE = {0: 1.0, 1: 0.3634, 2: 0.1188, 3: 0.03744, 4: 0.01154, 5: 0.00349, 6: 0.001035, 7: 0.000306, 8: 0.0000876}
MAX_BITS = 8
BITS_GRID = 8  # an adapting sender's row budgets (mask.adapt): multiples of 1/8 bit per value
# The gradients' quantiser steps are this many times the Gaussian-optimal ones: stochastic rounding is unbiased only inside
# the quantiser's range, and at 1-2 bits the optimal step clips 14-42 % of the values. Toy, 2-bit activations, dense 1.678:
# 2-bit gradients 1.720 at 1x, 1.705 at 1.5x, 1.699 at 2x, 1.711 at 3x; 1-bit ones 1.730 at 2x, 1.727 at 3x, 1.765 at 4x.
GRAD_STEP_SCALE = (
    2.0  # the width for stochastic rounding (the tiny models' runs); dither takes mask.grad_step_scale = 1
)
DECODE_LIMIT = 1e38  # below float32's largest value (3.4e38): what a decoded value may reach
_MSE = torch.tensor([MSE[b] for b in range(MAX_BITS + 1)] + [MSE[MAX_BITS]], dtype=torch.float64)


def allocate(var: Tensor, budget: int, max_bits: int = MAX_BITS, min_bits: int = 0) -> Tensor:
    """Bits per component for variances `var`: reverse water-filling of `budget` bits (each bit
    goes where it removes the most expected squared error). The marginal gains of one component
    fall with every bit it has, so the greedy choice is the `budget` largest gains over all
    (component, next bit) pairs, taken at once. Deterministic given `var`. `min_bits`: every
    component gets at least that many (the first ones spent before the water-filling)."""
    v = var.double().cpu().clamp(min=0)
    drops = _MSE[:max_bits] - _MSE[1 : max_bits + 1]  # [max_bits], decreasing
    gains = (v[:, None] * drops[None]).clone()
    gains[:, :min_bits] = float("inf")
    gains = gains.reshape(-1)
    take = torch.sort(gains, descending=True, stable=True).indices[
        :budget
    ]  # ties by index: both ends of a link pick alike
    take = take[gains[take] > 0]
    return torch.bincount(take // max_bits, minlength=len(v))


def row_budget(bits_per_value: float, hidden_size: int) -> int:
    """Bits per coded row for `bits_per_value`: what a producer allocates, and the most a
    receiver lets a coder allocate. ConfigError outside [1, 8]: every component gets a bit."""
    if not 1 <= bits_per_value <= MAX_BITS:
        raise ConfigError("bits_per_value", bits_per_value, f"must be in [1, {MAX_BITS}]: every component gets a bit")
    return round(bits_per_value * hidden_size)


def grid_bits(row_bits: float, hidden_size: int, up: bool = False) -> int:
    """The largest row budget on the adapting grid (1/BITS_GRID bit per value) <= `row_bits` (`up`: smallest >=)."""
    steps = row_bits * BITS_GRID / hidden_size
    return round((math.ceil(steps - 1e-9) if up else math.floor(steps + 1e-9)) * hidden_size / BITS_GRID)


def fixed_bytes(hidden_size: int, batch: int, seq: int, sink: int, msg_stats: bool, row_rates: bool) -> int:
    """A [batch, seq, H] payload's bytes before the codes: sink rows, gains, message statistics, row classes."""
    head = min(sink, seq)
    rows = batch * (seq - head)
    stats = 4 * hidden_size if msg_stats and rows else 0
    classes = packed_bytes(rows, rr.CLASS_BITS) if row_rates else 0
    return batch * head * hidden_size * 2 + 2 * rows + stats + classes


@dataclass
class TransformState:
    """What both ends hold for one version of a producer's coder (see the module docstring).
    Every field is as it travels (the std rounded to fp16), so both ends compute alike."""

    version: int
    mean: Tensor  # [H] float32
    rotation_q: Tensor  # [H, H] int8: the rotation's columns
    rotation_scale: Tensor  # [H] float32: column k is rotation_q[:, k] * rotation_scale[k]
    std: Tensor  # [H] > 0
    bits: Tensor  # [H] int64 in [1, MAX_BITS]

    def __post_init__(self) -> None:
        self.rotation = self.rotation_q.float() * self.rotation_scale  # [H, H]
        self._groups = [
            (b, (self.bits == b).nonzero().flatten()) for b in range(1, MAX_BITS + 1) if bool((self.bits == b).any())
        ]
        self._placed: dict[str, tuple[Tensor, Tensor, Tensor, list[Tensor]]] = {}
        # every decoded value is at most _reach + gain * _spread in size: the largest code per
        # component times its std, the rotation's longest row, and the mean (see _parse)
        self._top = torch.tensor(
            [2 ** (b - 1) * STEP[b] if b else 0.0 for b in self.bits.tolist()], dtype=torch.float64
        )  # the largest level per component
        self._rownorm = float(self.rotation.double().norm(dim=1).max())
        self._spread = float((self._top * self.std.double().cpu()).norm()) * self._rownorm
        self._reach = float(self.mean.abs().max()) if len(self.mean) else 0.0
        self._budgets: dict[int, TransformState] = {}

    def at_budget(self, row_bits: int) -> TransformState:
        """This coder at `row_bits` bits per row (a slow link, mask.adapt): the bits spread again by
        `allocate` over the stds as they travel, so the receiver derives the same split from the
        number alone and no coder ships again; below a bit per value the weakest get none. Kept per budget."""
        if row_bits == int(self.bits.sum()):
            return self
        if row_bits not in self._budgets:
            bits = allocate(self.std.double().pow(2), row_bits, min_bits=1 if row_bits >= self.hidden_size else 0)
            self._budgets[row_bits] = TransformState(
                self.version, self.mean, self.rotation_q, self.rotation_scale, self.std, bits
            )
        return self._budgets[row_bits]

    def _on(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
        """(mean, rotation, std, each width's columns) on `device`, copied there once (an H x H
        rotation per micro-batch would cross the host link every time)."""
        key = str(device)
        if key not in self._placed:
            self._placed[key] = (
                self.mean.to(device),
                self.rotation.to(device),
                self.std.to(device),
                [cols.to(device) for _, cols in self._groups],
            )
        return self._placed[key]

    @property
    def hidden_size(self) -> int:
        return len(self.mean)

    def payload_bytes(
        self, batch: int, seq: int, sink: int, msg_stats: bool = False, row_rates: bool = False, dense: int = 0
    ) -> int:
        """Exact payload bytes of a [batch, seq, H] tensor (`msg_stats`, `row_rates`, `dense` rows:
        see `encode`); with `row_rates` the most it may take (its classes decide its size)."""
        head = min(sink, seq)
        rows = batch * (seq - head)
        fixed = fixed_bytes(self.hidden_size, batch, seq, sink, msg_stats, row_rates) + 2 * self.hidden_size * dense
        if row_rates:
            return fixed + (rows * int(self.bits.sum()) + 7) // 8 + len(rr.CLASSES)  # each class pads to a byte
        return fixed + sum(packed_bytes(rows * len(cols), b) for b, cols in self._groups)

    def encode(
        self,
        x: Tensor,
        sink: int,
        stochastic: bool = False,
        generator: torch.Generator | None = None,
        dither_seed: int | None = None,
        msg_stats: bool = False,
        row_rates: bool = False,
        dense_rows: Tensor | None = None,
        shuffle_seed: int | None = None,
    ) -> bytes:
        """The payload of `x` [B, T, H] (any float dtype; coded in float32). `stochastic`: round
        to one of the two nearest levels at random (drawn from `generator`), unbiased inside the
        quantiser's range. `dither_seed`: subtractive dither instead (`dither`'s offset added
        before rounding down; `decode` with the same seed subtracts it): the error is uniform in
        half a step either way, whatever the value. `msg_stats`: each rotated component is
        centred and scaled by this message's own mean and std (sent in bf16, 4 H bytes), not the
        coder's: the coder's go stale between refits while the sender's weights move. `row_rates`:
        each row gets its own rate at the coder's bits per row on average (peer/codec/row_rates.py;
        with dither only: the components a row keeps come from the same seed). `dense_rows`: rows
        (flat indices over the non-sink rows) also sent in bf16 after the codes, which the
        receiver puts in place of their decoded values (with `row_rates` their codes take the
        fewest bits). `shuffle_seed`: the rows' coordinates are signed and permuted by the
        message's own `signed_permutation` before the rotation (`decode` undoes it)."""
        if row_rates and dither_seed is None:
            raise ValueError("row_rates: needs a dither_seed (the kept components are drawn from it)")
        x = x.detach().float()
        head = min(sink, x.shape[1])
        parts = [x[:, :head].to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy().tobytes()]
        rows = x[:, head:].reshape(-1, x.shape[-1])
        dev = rows.device
        mean, rotation, std, placed_cols = self._on(dev)
        resid = rows - mean
        if shuffle_seed is not None:
            signs, perm = signed_permutation(shuffle_seed, self.hidden_size, dev)
            resid = (resid * signs)[:, perm]
        gain = (
            resid.pow(2).mean(1, keepdim=True).sqrt().to(torch.bfloat16)
        )  # bf16: gradients' gains lie below fp16's range
        parts.append(gain.view(torch.int16).cpu().numpy().tobytes())
        gain = gain.float().clamp(min=1e-30)
        z = (resid / gain) @ rotation
        if msg_stats and len(z):
            m = z.mean(0).to(torch.bfloat16)
            s = z.std(0, correction=0).clamp(min=1e-6).to(torch.bfloat16)
            parts.append(torch.cat([m, s]).view(torch.int16).cpu().numpy().tobytes())
            z = (z - m.float()) / s.float()
        else:
            z = z / std
        tail = (
            b""
            if dense_rows is None
            else rows[dense_rows.to(dev)].to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy().tobytes()
        )
        if row_rates:
            energy = gain.squeeze(1).pow(2)
            if dense_rows is not None:
                energy = energy.index_fill(0, dense_rows.to(dev), 0.0)
            parts += rr.encode(z, energy, dither_seed, int(self.bits.sum()), STEP)
            return b"".join(parts) + tail
        for (b, _), cols in zip(self._groups, placed_cols):
            t = z[:, cols] / STEP[b]
            if dither_seed is not None:  # decoded as (q + 1 - u) * step: error 0.5 - frac(t - 0.5 + u)
                q = dithered(t, dither(dither_seed, t.shape[0], cols, self.hidden_size))
            elif stochastic:  # between the two nearest levels (q + 0.5) * step
                t = t - 0.5
                lo = torch.floor(t)
                q = lo + (torch.rand(t.shape, generator=generator, device=t.device) < (t - lo)).float()
            else:
                q = torch.floor(t)
            parts.append(pack_levels(q, b))
        return b"".join(parts) + tail

    def _parse(
        self,
        payload: bytes,
        batch: int,
        seq: int,
        sink: int,
        msg_stats: bool = False,
        row_rates: bool = False,
        dense: int = 0,
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor, Tensor]:
        """(sink rows [batch, head, H] bf16, gains [rows, 1] bf16, the message's (mean, std) [2, H]
        or None, the rows' rate classes or None, packed codes uint8, the `dense` rows [dense, H]
        bf16), host views of `payload`,
        checked without expanding a code: its length, finite sink rows, finite non-negative gains,
        finite stats with positive stds, classes within the coder's bits per row on average, and
        gains small enough that no decoded value can overflow (the largest code times the stds,
        plus the mean, through the rotation, times the gain, bounds every value)."""
        H = self.hidden_size
        head = min(sink, seq)
        n_head, rows = batch * head * H * 2, batch * (seq - head)
        fixed, classes, top_code = fixed_bytes(H, batch, seq, sink, msg_stats, row_rates), None, self._top
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.zeros(0, dtype=torch.uint8)
        tail = 2 * H * dense
        if row_rates and len(payload) >= fixed + tail:
            classes = rr.parse_classes(raw[fixed - packed_bytes(rows, rr.CLASS_BITS) :], rows)
            if rr.code_bits(classes, H) > rows * int(self.bits.sum()):
                raise WireError(
                    f"TensorPayload.payload: the rows' rate classes spend {rr.code_bits(classes, H)} bits, more than {int(self.bits.sum())} per row on average (coder v{self.version})"
                )
            top_code = torch.full((H,), rr.reach(H, STEP), dtype=torch.float64)
        if not row_rates:
            want = self.payload_bytes(batch, seq, sink, msg_stats, dense=dense)
        else:  # too short to hold the classes: it must at least reach past them
            want = fixed + tail + (rr.code_bytes(classes, H) if classes is not None else 0)
        if len(payload) != want:
            raise WireError(
                f"TensorPayload.payload: {len(payload)} bytes, expected {want} (transform coder v{self.version}, {int(self.bits.sum())} bits per row{', rates per row' if row_rates else ''}, shape [{batch}, {seq}, {H}])"
            )
        sink_rows = raw[:n_head].view(torch.bfloat16).reshape(batch, head, H)
        gain = raw[n_head : n_head + 2 * rows].view(torch.bfloat16).reshape(rows, 1)
        dense_rows = (
            raw[len(payload) - tail :].clone().view(torch.bfloat16).reshape(dense, H)
        )  # a copy: the codes may end at an odd offset
        if (
            not bool(torch.isfinite(sink_rows).all())
            or not bool(torch.isfinite(dense_rows).all())
            or not bool(torch.isfinite(gain).all())
            or bool((gain < 0).any())
        ):
            raise WireError(
                "TensorPayload.payload: NaN/Inf in the sink or dense rows or a gain that is not a finite non-negative number"
            )
        at, stats = n_head + 2 * rows, None
        spread = self._spread if classes is None else float((top_code * self.std.double().cpu()).norm()) * self._rownorm
        if msg_stats and rows:
            stats = raw[at : at + 4 * H].view(torch.bfloat16).reshape(2, H)
            at += 4 * H
            if not bool(torch.isfinite(stats).all()) or not bool((stats[1] > 0).all()):
                raise WireError(
                    "TensorPayload.payload: the message's component means and stds must be finite, the stds > 0"
                )
            spread = float((top_code * stats[1].double() + stats[0].double().abs()).norm()) * self._rownorm
        top = float(gain.max()) if rows else 0.0
        if top * spread + self._reach > DECODE_LIMIT:
            raise WireError(
                f"TensorPayload.payload: a gain of {top:.3g} would decode to values that are not finite (at most {(DECODE_LIMIT - self._reach) / spread:.3g} for coder v{self.version})"
            )
        return sink_rows, gain, stats, classes, raw[fixed : len(payload) - tail], dense_rows

    def check(
        self,
        payload: bytes,
        batch: int,
        seq: int,
        sink: int,
        msg_stats: bool = False,
        row_rates: bool = False,
        dense: int = 0,
    ) -> tuple:
        """What `decode` refuses, found without decoding (a receiver's inbound check, on the host:
        the rotation of every row is the costly part, and it runs once, in `decode`); `_parse`'s parts."""
        return self._parse(payload, batch, seq, sink, msg_stats, row_rates, dense)

    def decode(
        self,
        payload: bytes,
        batch: int,
        seq: int,
        sink: int,
        device: torch.device | str = "cpu",
        dither_seed: int | None = None,
        msg_stats: bool = False,
        row_rates: bool = False,
        dense_rows: Tensor | None = None,
        shuffle_seed: int | None = None,
    ) -> Tensor:
        """[batch, seq, H] float32 on `device` from a payload of exactly `payload_bytes`; WireError
        otherwise. The bytes are checked on the host; the codes cross to `device` still packed and
        are expanded and rotated there (an H x H product per row: a GPU's work, not the host's).
        `dither_seed`: the encoder's, whose offsets are subtracted; `shuffle_seed`: the
        encoder's, whose signed permutation is undone."""
        H = self.hidden_size
        if row_rates and dither_seed is None:
            raise ValueError("row_rates: needs the encoder's dither_seed")
        n_dense = 0 if dense_rows is None else len(dense_rows)
        sink_rows, gain, stats, classes, codes, dense_vals = self._parse(
            payload, batch, seq, sink, msg_stats, row_rates, n_dense
        )
        head, rows = sink_rows.shape[1], gain.shape[0]
        dev = torch.device(device)
        mean, rotation, std, placed_cols = self._on(dev)
        codes = codes.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else codes.to(dev)
        if classes is not None:
            z = rr.decode(codes, classes, H, dither_seed, STEP)
        else:
            z, at = torch.zeros(rows, H, device=dev), 0
            for (b, cols), dcols in zip(self._groups, placed_cols):
                n = rows * len(cols)
                size = packed_bytes(n, b)
                q = unpack_codes(codes[at : at + size], b, n).reshape(rows, len(cols))
                level = (
                    (q - 2 ** (b - 1)).float().add_(0.5)
                    if dither_seed is None
                    else undithered(q, b, dither(dither_seed, rows, dcols, H))
                )
                z[:, dcols] = level.mul_(STEP[b])
                at += size
        out = torch.empty(batch, seq, H, device=dev)
        out[:, :head] = sink_rows.to(dev).float()
        z = z * std if stats is None else z * stats[1].to(dev).float() + stats[0].to(dev).float()
        back = z @ rotation.T
        if shuffle_seed is not None:
            signs, perm = signed_permutation(shuffle_seed, H, dev)
            back = back[:, torch.argsort(perm)] * signs
        coded = mean + gain.to(dev).float() * back
        if n_dense:
            coded[dense_rows.to(dev)] = dense_vals.to(dev).float()
        out[:, head:] = coded.reshape(batch, seq - head, H)
        return out
