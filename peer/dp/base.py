"""The DP-sync contract every scheme implements, and the payload helpers the schemes share.

A `DPSync` syncs the R replicas of one stage group. Here it runs in *collective form*: the caller
hands over every replica's tensors at once (an in-process simulation of the group) and each
replica's result is written in place. Every scheme keeps two things apart so the same math can
later run over the network:

* per-replica compute (`_encode*` methods of a scheme): what replica r computes from its own
  tensors and its own state, producing hivemind `runtime_pb2.Tensor` payloads;
* the group reduction (`mean_of_payloads`): the element-wise mean of the replicas' decoded
  payloads - exactly what an all-reduce of those payloads delivers.

Byte counting (all schemes): the bytes one replica uploads in a call are the summed
``len(msg.buffer)`` of the `runtime_pb2.Tensor` payloads it produced, i.e. the raw data buffers.
Protobuf framing (shape, dtype name, compression enum: ~10-20 bytes per tensor) is not counted.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from peer.config import DPConfig
from peer.errors import TensorError, check_finite

logger = logging.getLogger(__name__)

FP32_BYTES = 4
Payload = list[runtime_pb2.Tensor]


def encode_fp32(tensor: torch.Tensor) -> runtime_pb2.Tensor:
    """Serialize `tensor` as raw fp32 (hivemind NoCompression): 4 bytes per element."""
    return serialize_torch_tensor(tensor.detach().to(device="cpu", dtype=torch.float32))


def payload_bytes(payload: Sequence[runtime_pb2.Tensor]) -> int:
    """Bytes a payload puts on the wire, counted as the sum of its raw data buffers."""
    return sum(len(msg.buffer) for msg in payload)


def mean_of_payloads(
    payloads: Sequence[Sequence[runtime_pb2.Tensor]],
    decode: Callable[[runtime_pb2.Tensor], torch.Tensor] = deserialize_torch_tensor,
    device: torch.device | Sequence[torch.device] | None = None,
) -> list[torch.Tensor]:
    """Group reduction: the element-wise fp32 mean over replicas of their decoded payloads.

    Summed in replica order so the result is bit-identical wherever it is computed.
    """
    count = len(payloads[0])
    devices = device if isinstance(device, Sequence) else [device] * count
    means: list[torch.Tensor] = []
    for k in range(count):
        acc = decode(payloads[0][k]).to(dtype=torch.float32).clone()
        for payload in payloads[1:]:
            acc.add_(decode(payload[k]).to(dtype=torch.float32))
        acc.div_(len(payloads))
        means.append(acc.to(devices[k]) if devices[k] is not None else acc)
    return means


def validate_replicas(
    what: str,
    replica_tensors: object,
    replicas: int,
    shapes: Sequence[torch.Size],
    *,
    finite: bool = True,
    only: Sequence[int] | None = None,
) -> None:
    """Check the collective input: R lists of len(shapes) float tensors of the given shapes.

    `finite` also rejects NaN/Inf (only in the parameters listed in `only`, if given). Raises
    `TensorError` naming the replica and parameter index; never touches any state.
    """
    if not isinstance(replica_tensors, (list, tuple)) or len(replica_tensors) != replicas:
        got = len(replica_tensors) if isinstance(replica_tensors, (list, tuple)) else type(replica_tensors).__name__
        raise TensorError(f"{what}: got {got} replicas, expected dp.replicas={replicas}")
    check = set(range(len(shapes)) if only is None else only)
    for r, tensors in enumerate(replica_tensors):
        if not isinstance(tensors, (list, tuple)) or len(tensors) != len(shapes):
            got = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
            raise TensorError(f"{what}[replica {r}]: got {got} tensors, expected {len(shapes)}")
        for i, (t, shape) in enumerate(zip(tensors, shapes)):
            name = f"{what}[replica {r}][param {i}]"
            if not isinstance(t, torch.Tensor):
                raise TensorError(f"{name}: expected a tensor, got {type(t).__name__}")
            if not t.is_floating_point():
                raise TensorError(f"{name}: dtype {t.dtype} is not floating point")
            if t.shape != shape:
                raise TensorError(f"{name}: shape {tuple(t.shape)} != expected {tuple(shape)}")
            if finite and i in check:
                check_finite(name, t)


class DPSync(ABC):
    """Syncs one stage group's R replicas (collective, in-process form; results written in place).

    Call order per step: backward -> `sync_grads` -> optimizer step -> `sync_params` (under
    `torch.no_grad()`). `init_params` once before the first step lets schemes that keep a global
    copy of the weights (DiLoCo) snapshot the common starting point. On any input error nothing
    in the object's state changes. With `dp.replicas == 1` sync is off: calls validate, leave
    the tensors alone and return 0.
    """

    scheme: str = ""

    def __init__(self, cfg: DPConfig, shapes: Sequence[torch.Size]) -> None:
        self.cfg = cfg
        self.replicas = cfg.replicas
        self.shapes = [torch.Size(s) for s in shapes]

    def init_params(self, replica_params: list[list[torch.Tensor]]) -> None:
        """Announce the initial parameters (identical on all replicas); no-op unless a scheme needs it."""
        validate_replicas("params", replica_params, self.replicas, self.shapes)

    @abstractmethod
    def sync_grads(self, step: int, replica_grads: list[list[torch.Tensor]]) -> int:
        """After backward: replace every replica's grads by the group's mean; bytes one replica sent."""

    @abstractmethod
    def sync_params(self, step: int, replica_params: list[list[torch.Tensor]]) -> int:
        """After the optimizer step: parameter-level sync (DiLoCo outer step); bytes one replica sent."""

    @abstractmethod
    def state_dict(self) -> dict:
        """Copies of every internal buffer (error feedback, warm starts, momenta)."""

    @abstractmethod
    def load_state_dict(self, d: dict) -> None:
        """Restore what `state_dict` returned; shapes are checked."""

    def dense_bytes(self) -> int:
        """Bytes one replica would send per full sync as uncompressed fp32 (4 * total numel)."""
        return FP32_BYTES * sum(s.numel() for s in self.shapes)

    def _check_scheme(self, d: dict) -> None:
        if d.get("scheme") != self.scheme:
            raise TensorError(f"state_dict is for scheme {d.get('scheme')!r}, this sync is {self.scheme!r}")


@dataclass
class Reduction:
    """Result of one group reduction, computed without touching state; `commit()` applies it."""

    mean: list[torch.Tensor]
    bytes_per_replica: int
    commit: Callable[[], None]


class MeanSync(DPSync):
    """Base of the schemes that average gradients every step (dense, powersgd, int8).

    Subclasses implement `reduce`; it is also the engine DiLoCo uses to average its outer deltas.
    """

    def sync_grads(self, step: int, replica_grads: list[list[torch.Tensor]]) -> int:
        validate_replicas("grads", replica_grads, self.replicas, self.shapes)
        if self.replicas == 1:
            return 0
        result = self.reduce(replica_grads)
        result.commit()
        with torch.no_grad():
            for grads in replica_grads:
                for g, m in zip(grads, result.mean):
                    g.copy_(m)
        return result.bytes_per_replica

    def sync_params(self, step: int, replica_params: list[list[torch.Tensor]]) -> int:
        return 0

    def expected_bytes(self) -> int:
        """Bytes one replica uploads per `sync_grads` by this scheme's formula (dense: 4 * numel)."""
        return self.dense_bytes()

    @abstractmethod
    def reduce(self, replica_tensors: list[list[torch.Tensor]]) -> Reduction:
        """Compress each replica's tensors, take the group mean of the payloads; pure until commit().

        Inputs are assumed validated (shapes, finiteness) by the caller.
        """


def clone_nested(x: object) -> object:
    """Deep copy of nested lists/dicts of tensors (None kept), for state_dict snapshots."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, list):
        return [clone_nested(v) for v in x]
    if isinstance(x, dict):
        return {k: clone_nested(v) for k, v in x.items()}
    return x


def check_tensor_list(name: str, got: object, shapes: Sequence[torch.Size | None]) -> list[torch.Tensor | None]:
    """Validate a loaded list of optional tensors against expected shapes (None = absent/zero)."""
    if not isinstance(got, list) or len(got) != len(shapes):
        raise TensorError(f"state_dict[{name}]: expected a list of {len(shapes)} entries")
    out: list[torch.Tensor | None] = []
    for i, (t, shape) in enumerate(zip(got, shapes)):
        if t is None:
            out.append(None)
            continue
        if not isinstance(t, torch.Tensor) or shape is None or t.shape != shape:
            raise TensorError(f"state_dict[{name}][{i}]: shape {getattr(t, 'shape', None)} != expected {shape}")
        check_finite(f"state_dict[{name}][{i}]", t)
        out.append(t.detach().to(torch.float32).clone())
    return out
