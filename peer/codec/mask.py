"""Activation masking on pipeline links (docs/design.md, "The fast circuit"): the paper's scheme.

At each stage boundary every element of the hidden state is kept with probability
keep = 1 - drop, independently, by a Bernoulli mask m. m is a pseudo-random function of the mask
key (seed, boundary, step, micro_batch) and the element's flat (row-major) index — never of the
activation values — so both link ends regenerate the identical mask from the key that travels in
`Compression` and only the kept values cross the link, in flat-index order. The backward pass
reuses the key: the receiver sends the gradient w.r.t. its input on exactly the entries the
forward kept, and the sender scatters it back (dropped entries get 0, as h * m in autograd would).

The PRF is a counter-based integer hash written in int64 torch ops (no torch.rand, no
Generator), so the mask is bit-identical on CPU and CUDA and across torch versions:

    key            = blake2b("anchormesh.mask.v1" | seed | boundary | step | micro_batch)   (64 bit)
    k0, k1         = low, high 32 bits of key
    x              = lowbias32(lowbias32((i mod 2**32) XOR k0) XOR k1 XOR mix(i div 2**32))
    m[i] (kept)    = x < round(keep * 2**32)

lowbias32 (C. Wellons' 32-bit integer hash, a bijection on 32-bit words) is applied twice, the
key entering before each round, so masks of neighbouring keys are independent. Every product is
kept below 2**63 and every value non-negative, so int64 never overflows and `>>` is logical.

Kept values travel as fp32, fp16, bf16 or int8; int8 is blockwise absmax over the flat vector of
kept values (`block_size` values per block, one float32 scale per block; float32 rather than fp16
scales because gradients are often below fp16's normal range). Payload layout for int8:
int8 values (n bytes) followed by the float32 scales (4 * ceil(n / block_size) bytes).
"""

from __future__ import annotations

import hashlib
import math
import struct

import torch

from peer.config import MaskConfig
from peer.errors import ConfigError, TensorError, WireError, check_finite
from peer.wire import anchormesh_pb2 as pb
from peer.wire.tensors import (
    MAX_NUMEL,
    check_expected,
    check_finite_wire,
    check_shape,
    dtype_name,
    from_le_bytes,
    to_le_bytes,
    torch_dtype,
    wire_dtype,
)

U32 = 0xFFFFFFFF
U64 = 0xFFFFFFFFFFFFFFFF
DEFAULT_BLOCK_SIZE = 256
# Mask elements hashed per pass: on CPU small enough that each op stays below torch's parallel grain
# (32768), so no OpenMP region can stall on a busy core, and cache-sized (measured fastest with 2**16);
# large on accelerators.
_CHUNK_CPU = 1 << 14
_CHUNK_ACCEL = 1 << 24
MAX_BLOCK_SIZE = 1 << 20
_KEY_DOMAIN = b"anchormesh.mask.v1"

# lowbias32 constants; the second one is >= 2**31, so it is multiplied in two 16-bit halves.
_C1 = 0x7FEB352D
_C2 = 0x846CA68B
_C2_LO, _C2_HI = _C2 & 0xFFFF, _C2 >> 16
_GOLDEN = 0x9E3779B1

VALUE_WIRE: dict[str, int] = {"fp32": pb.FLOAT32, "fp16": pb.FLOAT16, "bf16": pb.BFLOAT16, "int8": pb.INT8}
_VALUE_TORCH: dict[int, torch.dtype] = {
    pb.FLOAT32: torch.float32,
    pb.FLOAT16: torch.float16,
    pb.BFLOAT16: torch.bfloat16,
    pb.INT8: torch.int8,
}
_VALUE_BYTES: dict[int, int] = {pb.FLOAT32: 4, pb.FLOAT16: 2, pb.BFLOAT16: 2, pb.INT8: 1}
_SCALE_BYTES = 4  # int8 blocks carry one float32 scale each
_LOGICAL_FLOAT = (pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16)


def as_f32(x: float) -> float:
    """`x` rounded to float32, as the proto `float drop` field carries it."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _check_uint(name: str, value: int, bits: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not (0 <= value < (1 << bits)):
        raise ConfigError(name, value, f"must be an integer in [0, 2**{bits})")
    return value


def mask_key(seed: int, boundary: int, step: int, micro_batch: int) -> int:
    """64-bit key of the mask PRF for one (seed, boundary, step, micro_batch); seed is taken mod 2**64."""
    _check_uint("boundary", boundary, 32)
    _check_uint("step", step, 64)
    _check_uint("micro_batch", micro_batch, 64)
    packed = struct.pack("<QQQQ", int(seed) & U64, boundary, step, micro_batch)
    return int.from_bytes(hashlib.blake2b(_KEY_DOMAIN + packed, digest_size=8).digest(), "little")


def _lowbias32_(x: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32, in place, on an int64 tensor of values in [0, 2**32); returns x."""
    x ^= x >> 16
    x.mul_(_C1).bitwise_and_(U32)  # < 2**32 * 2**31: no int64 overflow
    x ^= x >> 15
    hi = (x * _C2_HI).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    x.mul_(_C2_LO).add_(hi).bitwise_and_(U32)  # x * _C2 mod 2**32 in two 16-bit halves
    x ^= x >> 16
    return x


def mask_hash(key: int, numel: int, device: torch.device | str | None = None, *, start: int = 0) -> torch.Tensor:
    """The PRF's 32-bit words (int64 in [0, 2**32)) for flat indices start..start+numel-1 under `key`."""
    return hash_words(
        key, torch.arange(start, start + numel, dtype=torch.int64, device=device), wide=start + numel > (1 << 32)
    )


def hash_words(key: int, index: torch.Tensor, *, wide: bool = True) -> torch.Tensor:
    """The PRF's 32-bit words for any int64 indices >= 0 (consumed: hashed in place). `wide`:
    some index may reach 2**32 (its high word then enters round two; without it, such an index
    would wrap)."""
    k0, k1 = key & U32, (key >> 32) & U32
    x = index
    hi = None
    if wide:
        hi = ((x >> 32) * _GOLDEN).bitwise_and_(U32)
        x.bitwise_and_(U32)
    x ^= k0
    _lowbias32_(x)
    x ^= k1
    if hi is not None:
        x ^= hi
    return _lowbias32_(x)


def keep_threshold(drop: float) -> int:
    """Element kept iff its hash word < this; round(keep * 2**32)."""
    return round((1.0 - drop) * 2**32)


class MaskCodec:
    """Encode a boundary tensor as its Bernoulli-kept values; decode by regenerating the mask.

    Both link ends build a MaskCodec from the same `MaskConfig`; the sender calls `encode`, the
    receiver `decode` (which checks that the message's drop and seed equal its own). Expected
    payload per original element is `bytes_per_element()`: keep * value bytes (+ int8 scales);
    e.g. drop 0.9 with fp16 values is 0.2 bytes/element, 20x less than dense fp32.

    Args:
        cfg: drop, value encoding and seed (fill is the runner's business: pass `fill=`).
        block_size: int8 absmax block, in kept values.
        max_numel: largest logical tensor `decode` accepts.
    """

    def __init__(self, cfg: MaskConfig, *, block_size: int = DEFAULT_BLOCK_SIZE, max_numel: int = MAX_NUMEL) -> None:
        if not (1 <= block_size <= MAX_BLOCK_SIZE):
            raise ConfigError("block_size", block_size, f"must be in [1, {MAX_BLOCK_SIZE}]")
        self.cfg = cfg
        self.block_size = block_size
        self.max_numel = max_numel

    @property
    def _values(self) -> int:
        """Wire DType of the kept values; read from cfg each time so nothing goes stale."""
        return VALUE_WIRE[self.cfg.values]

    # ---- the mask -------------------------------------------------------------------------
    def keep_mask(
        self,
        shape: tuple[int, ...],
        *,
        boundary: int,
        step: int,
        micro_batch: int,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Bool mask of `shape` (True = kept) for this key; all True when drop == 0."""
        shape = tuple(int(d) for d in shape)
        key = mask_key(self.cfg.seed, boundary, step, micro_batch)
        if self.cfg.drop == 0.0:
            return torch.ones(shape, dtype=torch.bool, device=device)
        numel = math.prod(shape)
        threshold = keep_threshold(self.cfg.drop)
        out = torch.empty(numel, dtype=torch.bool, device=device)
        chunk = _CHUNK_CPU if out.device.type == "cpu" else _CHUNK_ACCEL
        for start in range(0, numel, chunk):  # chunks also bound the int64 temporaries
            n = min(chunk, numel - start)
            torch.lt(mask_hash(key, n, device, start=start), threshold, out=out[start : start + n])
        return out.reshape(shape)

    def bytes_per_element(self) -> float:
        """Expected payload bytes per ORIGINAL element: keep * value bytes (+ int8 scale overhead)."""
        per_kept = _VALUE_BYTES[self._values] + (_SCALE_BYTES / self.block_size if self._values == pb.INT8 else 0.0)
        return self.cfg.keep * per_kept

    # ---- encode ---------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, *, boundary: int, step: int, micro_batch: int) -> pb.TensorPayload:
        """Kept values of `x` (flat-index order) in cfg.values, with the mask key in `compression`.

        Raises TensorError if `x` is not floating point, holds NaN/Inf, or a kept value does not
        fit the fp16 range.
        """
        if not x.is_floating_point():
            raise TensorError(f"MaskCodec.encode: x.dtype={x.dtype}: expected a floating-point tensor")
        check_finite("MaskCodec.encode: x", x.detach())  # all of x: NaN anywhere means upstream broke
        mask = self.keep_mask(tuple(x.shape), boundary=boundary, step=step, micro_batch=micro_batch, device=x.device)
        kept = x.detach().reshape(-1)[mask.reshape(-1)]  # [n] in flat-index order
        msg = pb.TensorPayload(dtype=wire_dtype(x.dtype), shape=list(x.shape))
        c = msg.compression
        c.kind = pb.Compression.BERNOULLI_MASK
        c.drop = self.cfg.drop
        c.mask_seed = int(self.cfg.seed) & U64
        c.boundary = boundary
        c.step = step
        c.micro_batch = micro_batch
        c.values = self._values
        if self._values == pb.INT8:
            c.block_size = self.block_size
            q, scales = _quantize_int8(kept.float(), self.block_size)
            msg.payload = to_le_bytes(q) + to_le_bytes(scales)
        else:
            vdtype = _VALUE_TORCH[self._values]
            if vdtype == torch.float16:
                over = int((kept.abs() > torch.finfo(torch.float16).max).sum())
                if over:
                    raise TensorError(
                        f"MaskCodec.encode: {over} kept values exceed the fp16 range (|v| > 65504); use values='bf16' or 'fp32'"
                    )
            msg.payload = to_le_bytes(kept.to(vdtype))
        return msg

    # ---- decode ---------------------------------------------------------------------------
    def decode(
        self,
        msg: pb.TensorPayload,
        *,
        expect_shape: tuple[int, ...] | None = None,
        expect_dtype: torch.dtype | None = None,
        fill: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        boundary: int | None = None,
        step: int | None = None,
        micro_batch: int | None = None,
    ) -> torch.Tensor:
        """Validate `msg`, regenerate its mask and scatter the kept values into a dense tensor.

        Dropped entries are 0, or `fill[dropped]` when `fill` (same shape) is given. A dense
        (kind NONE) payload is accepted as well and returned as sent (anchor passes). The
        optional `boundary`/`step`/`micro_batch` are checked against the message's key (pass the
        header's values). The result is a CPU tensor of `dtype`.

        Raises WireError naming the field for: unknown kind, non-float (or, with `expect_dtype`,
        other) logical dtype, bad or unexpected shape, drop or seed other than this codec's, unsupported value encoding, bad
        int8 block size, payload length other than the kept count's, NaN/Inf (or bad int8)
        values, or a key other than the expected one.
        """
        if not isinstance(msg, pb.TensorPayload):
            raise WireError(f"expected a TensorPayload, got {type(msg).__name__}")
        c = msg.compression
        if c.kind not in (pb.Compression.NONE, pb.Compression.BERNOULLI_MASK):
            raise WireError(f"TensorPayload.compression.kind={c.kind}: unknown compression")
        if msg.dtype not in _LOGICAL_FLOAT:
            raise WireError(
                f"TensorPayload.dtype={dtype_name(msg.dtype)}: a masked tensor must be FLOAT32, FLOAT16 or BFLOAT16"
            )
        logical = torch_dtype(msg.dtype)
        shape = check_shape(msg.shape, max_numel=self.max_numel)
        check_expected(shape, logical, expect_shape=expect_shape, expect_dtype=expect_dtype)
        if fill is not None and tuple(fill.shape) != shape:
            raise TensorError(f"MaskCodec.decode: fill.shape={list(fill.shape)}: expected {list(shape)}")
        numel = math.prod(shape)

        if c.kind == pb.Compression.NONE:  # dense: payload is every element in the logical dtype
            itemsize = _VALUE_BYTES[msg.dtype]
            if len(msg.payload) != numel * itemsize:
                raise WireError(
                    f"TensorPayload.payload: {len(msg.payload)} bytes, expected {numel * itemsize} (dense {dtype_name(msg.dtype)}, shape {list(shape)})"
                )
            out = from_le_bytes(msg.payload, logical).reshape(shape)
            check_finite_wire(out, field="TensorPayload.payload")
            return out.to(dtype)

        if c.drop != as_f32(self.cfg.drop):
            raise WireError(f"Compression.drop={c.drop:.7g}: this peer masks with drop={self.cfg.drop!r}")
        if c.mask_seed != int(self.cfg.seed) & U64:
            raise WireError(f"Compression.mask_seed={c.mask_seed}: this run's mask seed is {int(self.cfg.seed) & U64}")
        for name, want in (("boundary", boundary), ("step", step), ("micro_batch", micro_batch)):
            if want is not None and getattr(c, name) != want:
                raise WireError(f"Compression.{name}={getattr(c, name)}: the header says {want}")
        if c.values not in _VALUE_BYTES:
            raise WireError(
                f"Compression.values={dtype_name(c.values)}: kept values must be FLOAT32, FLOAT16, BFLOAT16 or INT8"
            )
        if c.values == pb.INT8 and not (1 <= c.block_size <= MAX_BLOCK_SIZE):
            raise WireError(f"Compression.block_size={c.block_size}: must be in [1, {MAX_BLOCK_SIZE}] for INT8 values")

        vbytes = _VALUE_BYTES[c.values]
        # Cheap plausibility bound before the mask is regenerated, so that the work a message
        # causes stays proportional to the bytes it carries: n ~ Binomial(numel, keep).
        keep = self.cfg.keep
        slack = 10 * math.sqrt(numel * keep * (1 - keep)) + 16
        lo, hi = max(0.0, numel * keep - slack), numel * keep + slack
        lo_bytes, hi_bytes = (
            lo * vbytes,
            hi * vbytes + (_SCALE_BYTES * (hi / c.block_size + 1) if c.values == pb.INT8 else 0),
        )
        if not (lo_bytes <= len(msg.payload) <= hi_bytes):
            raise WireError(
                f"TensorPayload.payload: {len(msg.payload)} bytes, expected about {numel * keep * vbytes:.0f} "
                f"({numel} elements at drop={self.cfg.drop}, {dtype_name(c.values)}, shape {list(shape)})"
            )

        mask = self.keep_mask(shape, boundary=c.boundary, step=c.step, micro_batch=c.micro_batch).reshape(-1)
        n = int(mask.sum())
        n_scales = -(-n // c.block_size) if c.values == pb.INT8 else 0
        expected = n * vbytes + n_scales * _SCALE_BYTES
        if len(msg.payload) != expected:
            detail = f"{n} kept of {numel} x {vbytes} bytes" + (f" + {n_scales} float32 scales" if n_scales else "")
            raise WireError(
                f"TensorPayload.payload: {len(msg.payload)} bytes, expected {expected} ({detail}, {dtype_name(c.values)}, shape {list(shape)})"
            )

        if c.values == pb.INT8:
            q = from_le_bytes(msg.payload[:n], torch.int8)
            scales = from_le_bytes(msg.payload[n:], torch.float32)
            check_finite_wire(scales, field="TensorPayload.payload (int8 scales)")
            if bool((scales < 0).any()):
                raise WireError(
                    f"TensorPayload.payload (int8 scales): {int((scales < 0).sum())} of {n_scales} scales are negative"
                )
            if bool((q == -128).any()):
                raise WireError(
                    f"TensorPayload.payload (int8 values): {int((q == -128).sum())} values are -128, outside the absmax range [-127, 127]"
                )
            vals = _dequantize_int8(q, scales, c.block_size)
        else:
            vals = from_le_bytes(msg.payload, _VALUE_TORCH[c.values])
            check_finite_wire(vals, field="TensorPayload.payload")

        if fill is None:
            out = torch.zeros(numel, dtype=dtype)
        else:
            check_finite("MaskCodec.decode: fill", fill.detach())
            out = fill.detach().to(device="cpu", dtype=dtype).reshape(-1).clone()
        out[mask] = vals.to(dtype)
        return out.reshape(shape)


def _quantize_int8(v: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax int8: v [n] -> (q int8 [n], float32 scales [ceil(n/block_size)])."""
    n = v.numel()
    blocks = -(-n // block_size)
    padded = torch.zeros(blocks * block_size, dtype=torch.float32, device=v.device)
    padded[:n] = v
    padded = padded.view(blocks, block_size)
    scales = padded.abs().amax(dim=1) / 127.0  # [blocks]
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(padded / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(-1)[:n], scales


def _dequantize_int8(q: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """Inverse of `_quantize_int8`: value = q * scale of its block."""
    n = q.numel()
    block_of = torch.arange(n, dtype=torch.int64) // block_size
    return q.to(torch.float32) * scales[block_of]
