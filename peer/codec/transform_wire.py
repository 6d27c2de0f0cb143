"""The transform coder on the wire: its state as a `TransformCoder` message, a tensor as a
`TensorPayload`, and the checks a receiver runs on both (bad input: WireError naming the field).

A producer with no coder yet (fewer rows seen than its first fit needs) sends the tensor dense in
bf16 (kind NONE): that is the warm-up, counted like any other bytes.
"""

from __future__ import annotations

import hashlib
import math

import torch

from peer.codec.transform import BITS_GRID, MAX_BITS, TransformState, grid_bits
from peer.errors import WireError
from peer.wire import anchormesh_pb2 as pb
from peer.wire.tensors import (
    check_expected,
    check_shape,
    dtype_name,
    from_le_bytes,
    proto_to_tensor,
    tensor_to_proto,
    to_le_bytes,
)

ROTATION_LIMIT = 1.01  # orthonormal columns have unit length; int8 rounding adds a little
STD_SLACK = 1.01  # rows normalised to unit RMS: a component's std is at most sqrt(H)


def coder_to_proto(state: TransformState, run_rotation: bool = False) -> pb.TransformCoder:
    """A coder as it travels; with `run_rotation` (the gradients' coder, whose rotation is the
    run's: grad_coder.run_rotation) without its rotation, which the receiver makes itself."""
    msg = pb.TransformCoder(
        version=state.version,
        mean=tensor_to_proto(state.mean.float().cpu()),
        std=tensor_to_proto(state.std.half().cpu()),
        bits=state.bits.to(torch.uint8).cpu().numpy().tobytes(),
        run_rotation=run_rotation,
    )
    if not run_rotation:
        msg.rotation.CopyFrom(tensor_to_proto(state.rotation_q.cpu()))
        msg.rotation_scale.CopyFrom(tensor_to_proto(state.rotation_scale.float().cpu()))
    return msg


def coder_from_proto(
    msg: pb.TransformCoder,
    hidden_size: int,
    max_bits: int,
    run_rotation: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> TransformState:
    """A received coder, checked: sizes of this stage's boundary, finite values, rotation columns
    no longer than unit length (orthonormal up to rounding), std in (0, sqrt(H)], bits in [1, 8]
    summing to at most `max_bits` (the run's bits per row: bounds every payload's size).
    `run_rotation`: the run's rotation (int8 columns, scales) for a coder that says it uses it
    (the gradients'); None where no coder may (the activations')."""
    H = hidden_size
    if msg.version < 1:
        raise WireError(f"TransformCoder.version={msg.version}: must be >= 1")
    if len(msg.bits) != H:
        raise WireError(f"TransformCoder.bits: {len(msg.bits)} bytes, expected {H} (one per component)")
    bits = torch.frombuffer(bytearray(msg.bits), dtype=torch.uint8).to(torch.int64)
    if int(bits.min()) < 1 or int(bits.max()) > MAX_BITS or int(bits.sum()) > max_bits:
        raise WireError(
            f"TransformCoder.bits: each must be in [1, {MAX_BITS}] and they must sum to <= {max_bits} (the run's bits per row), got [{int(bits.min())}, {int(bits.max())}], sum {int(bits.sum())}"
        )
    mean = proto_to_tensor(msg.mean, expect_shape=(H,), expect_dtype=torch.float32)
    if msg.run_rotation:
        if run_rotation is None:
            raise WireError(
                "TransformCoder.run_rotation: only the gradients' coder uses the run's rotation; this one must carry its own"
            )
        if msg.HasField("rotation") or msg.HasField("rotation_scale"):
            raise WireError("TransformCoder.rotation: a coder on the run's rotation carries none")
        return _coder_checked(msg, mean, *run_rotation, bits, H)
    rotation_q = proto_to_tensor(msg.rotation, expect_shape=(H, H), expect_dtype=torch.int8)
    scale = proto_to_tensor(msg.rotation_scale, expect_shape=(H,), expect_dtype=torch.float32)
    return _coder_checked(msg, mean, rotation_q, scale, bits, H)


def _coder_checked(
    msg: pb.TransformCoder,
    mean: torch.Tensor,
    rotation_q: torch.Tensor,
    scale: torch.Tensor,
    bits: torch.Tensor,
    H: int,
) -> TransformState:
    """The rest of coder_from_proto's checks (std, finite values, unit-length columns)."""
    std = proto_to_tensor(msg.std, expect_shape=(H,), expect_dtype=torch.float16).float()
    for name, t in (("mean", mean), ("rotation_scale", scale), ("std", std)):
        if not bool(torch.isfinite(t).all()):
            raise WireError(f"TransformCoder.{name}: NaN/Inf values")
    if not (float(scale.min()) > 0 and float(scale.max()) <= ROTATION_LIMIT / 127):
        raise WireError(
            f"TransformCoder.rotation_scale: values must be in (0, {ROTATION_LIMIT / 127:.4g}] (unit-length columns)"
        )
    norms = (rotation_q.float() * scale).norm(dim=0)
    if float(norms.max()) > ROTATION_LIMIT:
        raise WireError(
            f"TransformCoder.rotation: a column of length {float(norms.max()):.4g} > {ROTATION_LIMIT}: columns must be orthonormal"
        )
    limit = STD_SLACK * math.sqrt(H)
    if not (float(std.min()) > 0 and float(std.max()) <= limit):
        raise WireError(
            f"TransformCoder.std: values must be in (0, {limit:.4g}], got [{float(std.min()):.4g}, {float(std.max()):.4g}]"
        )
    return TransformState(msg.version, mean, rotation_q, scale, std, bits)


def _rounding_seed(boundary: int, step: int, micro_batch: int, channel: str = "backward", run_seed: int = 0) -> int:
    """Seed of a message's random rounding (a gradient's stochastic rounding or dither, an
    activation's dither): reproducible runs, independent draws per message and direction, and
    other draws in a run of another `codec.seed` (so seeds replicate the codec's noise too)."""
    tail = "|forward" if channel == "forward" else ""  # the gradients' seeds as they always were
    run = f"|run{run_seed}" if run_seed else ""  # codec.seed 0: the keys as they always were
    digest = hashlib.blake2b(
        f"anchormesh.transform.v1|{boundary}|{step}|{micro_batch}{tail}{run}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFFFFFFFFFF


def _shuffled(shuffle: bool, channel: str, row_bits: int, hidden_size: int) -> bool:
    """Whether a message's rows are signed and permuted by its key before the rotation: with
    mask.grad_rotation "message", and always for a gradient below one bit per value (a slow
    link, mask.adapt): the components it leaves out are then other directions every message, not
    the same ones of the fixed rotation (which would bias every step alike)."""
    return shuffle or (channel == "backward" and 0 < row_bits < hidden_size)


def encode(
    state: TransformState | None,
    x: torch.Tensor,
    *,
    sink: int,
    stochastic: bool,
    boundary: int,
    step: int,
    micro_batch: int,
    dither: bool = False,
    channel: str = "backward",
    msg_stats: bool = False,
    row_rates: bool = False,
    dense_rows: torch.Tensor | None = None,
    shuffle: bool = False,
    row_bits: int | None = None,
    run_seed: int = 0,
) -> pb.TensorPayload:
    """`x` [B, T, H] as a payload: coded with `state`, or dense bf16 while there is none.
    `dither`: subtractive dither seeded by the message's key, `channel` and `run_seed` (the receiver's
    `decode` needs all three); `msg_stats`: the message carries its own component statistics
    (TransformState.encode); `row_rates`: each row its own rate (needs `dither`); `dense_rows`:
    ascending flat indices of non-sink rows also sent in bf16 (named in Compression.dense_rows);
    `shuffle`: the rows' coordinates signed and permuted by the message's key first; `row_bits`:
    fewer bits per row than the coder's (an adapting sender's slow link; Compression.row_bits;
    a gradient below a bit per value is shuffled whatever `shuffle` says: `_shuffled`)."""
    if state is None:
        return pb.TensorPayload(
            dtype=pb.BFLOAT16, shape=list(x.shape), payload=to_le_bytes(x.detach().to(torch.bfloat16).cpu())
        )
    adapted = row_bits is not None and row_bits < int(state.bits.sum())
    if adapted:
        state = state.at_budget(row_bits)
    shuffle = _shuffled(shuffle, channel, row_bits if adapted else 0, state.hidden_size)
    seed = _rounding_seed(boundary, step, micro_batch, channel, run_seed)
    gen = torch.Generator(device=x.device).manual_seed(seed) if stochastic and not dither else None
    msg = pb.TensorPayload(
        dtype=pb.FLOAT32,
        shape=list(x.shape),
        payload=state.encode(
            x,
            sink,
            generator=gen,
            stochastic=stochastic,
            dither_seed=seed if dither else None,
            msg_stats=msg_stats,
            row_rates=row_rates,
            dense_rows=dense_rows,
            shuffle_seed=seed if shuffle else None,
        ),
    )
    c = msg.compression
    c.kind, c.coder_version, c.sink = pb.Compression.TRANSFORM, state.version, sink
    c.boundary, c.step, c.micro_batch = boundary, step, micro_batch
    c.row_bits = row_bits if adapted else 0
    if dense_rows is not None:
        c.dense_rows.extend(dense_rows.tolist())
    return msg


def _checked(
    msg: pb.TensorPayload,
    state: TransformState | None,
    expect_shape: tuple[int, ...],
    sink: int,
    boundary: int,
    step: int,
    micro_batch: int,
    min_row_bits: int | None = None,
) -> tuple[tuple[int, ...], TransformState | None]:
    """(the payload's shape, the coder to decode it with), after every check of its header against
    the expected shape, the run's sink, the message's key and the coder it names (`state`: the
    producer's newest this end holds). `min_row_bits`: the fewest bits per row an adapting sender
    may send (Compression.row_bits, on the grid_bits grid, below the coder's); None: only the coder's."""
    if not isinstance(msg, pb.TensorPayload):
        raise WireError(f"expected a TensorPayload, got {type(msg).__name__}")
    shape = check_shape(msg.shape)
    c = msg.compression
    if c.kind == pb.Compression.NONE:  # warm-up: dense bf16
        if msg.dtype != pb.BFLOAT16:
            raise WireError(
                f"TensorPayload.dtype={dtype_name(msg.dtype)}: a dense tensor on a transform-coded link travels as BFLOAT16"
            )
        check_expected(shape, torch.bfloat16, expect_shape=expect_shape, expect_dtype=None)
        if len(msg.payload) != 2 * math.prod(shape):
            raise WireError(
                f"TensorPayload.payload: {len(msg.payload)} bytes, expected {2 * math.prod(shape)} (dense BFLOAT16, shape {list(shape)})"
            )
        return shape, None
    if c.kind != pb.Compression.TRANSFORM:
        raise WireError(
            f"TensorPayload.compression.kind={c.kind}: this link is transform-coded (TRANSFORM, or NONE while warming up)"
        )
    if msg.dtype != pb.FLOAT32:
        raise WireError(f"TensorPayload.dtype={dtype_name(msg.dtype)}: a transform-coded tensor declares FLOAT32")
    check_expected(shape, torch.float32, expect_shape=expect_shape, expect_dtype=None)
    if c.sink != sink:
        raise WireError(f"Compression.sink={c.sink}: this run sends {sink} leading positions dense")
    for name, want in (("boundary", boundary), ("step", step), ("micro_batch", micro_batch)):
        if getattr(c, name) != want:
            raise WireError(f"Compression.{name}={getattr(c, name)}: the header says {want}")
    if state is None or state.version != c.coder_version:
        have = state.version if state else None
        raise WireError(
            f"Compression.coder_version={c.coder_version}: unknown here (have {have}); send the coder again"
        )
    if shape[-1] != state.hidden_size:
        raise WireError(f"TensorPayload.shape={list(shape)}: the coder is for hidden size {state.hidden_size}")
    rows = shape[0] * (shape[1] - min(sink, shape[1]))
    dense = list(c.dense_rows)
    if dense and (dense[-1] >= rows or any(b <= a for a, b in zip(dense, dense[1:]))):
        raise WireError(
            f"Compression.dense_rows: must be ascending, without repeats, and below {rows} (the message's non-sink rows)"
        )
    return shape, _at_row_bits(c.row_bits, state, min_row_bits)


def _at_row_bits(row_bits: int, state: TransformState, floor: int | None) -> TransformState:
    """The coder at the message's bits per row (0: its own); WireError for a budget this end does
    not accept: not adapting, above the coder's, below the floor or off the grid."""
    full, H = int(state.bits.sum()), state.hidden_size
    if not row_bits or row_bits == full:
        return state
    if floor is None or not floor <= row_bits < full or grid_bits(row_bits, H) != row_bits:
        allowed = (
            "none (this run does not adapt: codec.adapt off, or bits at their floor)"
            if floor is None
            else f"multiples of {H}/{BITS_GRID} in [{floor}, {full})"
        )
        raise WireError(f"Compression.row_bits={row_bits}: bits per row an adapting sender may send here: {allowed}")
    return state.at_budget(row_bits)


def _dense_rows(msg: pb.TensorPayload) -> torch.Tensor | None:
    """The rows a payload also carries in bf16 (Compression.dense_rows), or None."""
    rows = msg.compression.dense_rows
    return torch.tensor(list(rows), dtype=torch.int64) if len(rows) else None


def _dense(msg: pb.TensorPayload, shape: tuple[int, ...]) -> torch.Tensor:
    out = from_le_bytes(msg.payload, torch.bfloat16).reshape(shape)
    if not bool(torch.isfinite(out).all()):
        raise WireError("TensorPayload.payload: NaN/Inf values")
    return out


def check(
    msg: pb.TensorPayload,
    state: TransformState | None,
    *,
    expect_shape: tuple[int, ...],
    sink: int,
    boundary: int,
    step: int,
    micro_batch: int,
    msg_stats: bool = False,
    row_rates: bool = False,
    min_row_bits: int | None = None,
) -> tuple[float, float]:
    """What `decode` refuses, found on the host without decoding (the receiver's inbound check);
    returns the payload's `magnitude`."""
    shape, state = _checked(msg, state, expect_shape, sink, boundary, step, micro_batch, min_row_bits)
    if msg.compression.kind == pb.Compression.NONE:
        dense = _dense(msg, shape).float()
        return (float(dense.pow(2).mean().sqrt()), float(dense.abs().max())) if dense.numel() else (0.0, 0.0)
    B, T, _ = shape
    sink_rows, gain, stats, _, _, dense_rows = state.check(
        msg.payload, B, T, sink, msg_stats, row_rates, len(msg.compression.dense_rows)
    )
    return magnitude(state, sink_rows, gain, stats, dense_rows, math.prod(shape))


def magnitude(
    state: TransformState,
    sink_rows: torch.Tensor,
    gain: torch.Tensor,
    stats: torch.Tensor | None,
    dense_rows: torch.Tensor,
    numel: int,
) -> tuple[float, float]:
    """(RMS, largest magnitude) of what a coded payload decodes to, estimated from its parts on
    the host (peer/pipeline/bounds.py): the bf16 rows exactly; a coded row as its gain times the
    RMS of its normalised components (the message's statistics, else the coder's stds) plus the
    coder's mean (the rotation keeps a row's norm). Honest payloads come within a few percent of
    the decoded RMS; what matters is that a scaled-up payload scales the estimate alike."""
    parts = [t.float().reshape(-1) for t in (sink_rows, dense_rows) if t.numel()]
    comp = stats.float().pow(2).sum(0) if stats is not None else state.std.float().cpu().pow(2)  # E[z^2] per component
    unit, mean = float(comp.mean().sqrt()), state.mean.float().cpu()
    g = gain.float().reshape(-1)
    sq = (
        sum(float(p.pow(2).sum()) for p in parts)
        + float((g.pow(2) * unit**2 + mean.pow(2).mean()).sum()) * state.hidden_size
    )
    peak = max(
        [float(p.abs().max()) for p in parts] + [float(g.max()) * unit + float(mean.abs().max()) if g.numel() else 0.0]
    )
    return math.sqrt(sq / max(numel, 1)), peak


def decode(
    msg: pb.TensorPayload,
    state: TransformState | None,
    *,
    expect_shape: tuple[int, ...],
    sink: int,
    boundary: int,
    step: int,
    micro_batch: int,
    device: torch.device | str = "cpu",
    dither: bool = False,
    channel: str = "backward",
    msg_stats: bool = False,
    row_rates: bool = False,
    shuffle: bool = False,
    min_row_bits: int | None = None,
    run_seed: int = 0,
) -> torch.Tensor:
    """The float32 tensor a payload carries, on `device`, after `check`'s checks (the coder's
    products run on `device`); `dither`: the sender dithered `channel`'s values (the run's
    mask.grad_rounding, mask.act_rounding); `shuffle`: the sender signed and permuted the rows
    by the message's key (mask.grad_rotation "message"); `min_row_bits`: as `_checked`."""
    shape, state = _checked(msg, state, expect_shape, sink, boundary, step, micro_batch, min_row_bits)
    if msg.compression.kind == pb.Compression.NONE:
        return _dense(msg, shape).to(device).float()
    B, T, _ = shape
    seed = _rounding_seed(boundary, step, micro_batch, channel, run_seed)
    shuffle = _shuffled(shuffle, channel, msg.compression.row_bits, state.hidden_size)
    return state.decode(
        msg.payload,
        B,
        T,
        sink,
        device=device,
        dither_seed=seed if dither else None,
        msg_stats=msg_stats,
        row_rates=row_rates,
        dense_rows=_dense_rows(msg),
        shuffle_seed=seed if shuffle else None,
    )
