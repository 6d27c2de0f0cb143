"""Where and in what precision a peer computes its stage: one `Placement`, built at the entry
point and handed to the stage, the runner, the codec ends, the anchor jobs, the optimizer and the
averager, so that no component guesses a device or a dtype on its own.

The fast path crosses between host and device exactly twice per message: a decoded wire tensor
goes to the device (`to_device`: pinned, non-blocking), and an outgoing tensor comes back once,
as float32, before it is encoded (`to_host`). Everything else stays where the weights live.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peer.config import ComputeConfig
from peer.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Placement:
    """device: where the stage's weights, optimizer state, codec state and activations live.
    compute_dtype: what the layers run in (a persistent working copy when it differs from the
    master dtype). master_dtype: the weights the optimizer updates and the averager and
    checkpoints see (float32). checkpointing: recompute each layer's activations in the backward."""

    device: torch.device = torch.device("cpu")
    compute_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32
    checkpointing: bool = False

    @property
    def mixed(self) -> bool:
        """True when the layers run on a low-precision working copy of fp32 master weights."""
        return self.compute_dtype != self.master_dtype

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def to_device(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A host tensor (decoded from the wire) onto the device, in `dtype` if given. On CUDA it
        goes through pinned memory without waiting: the copy overlaps the work queued before it."""
        if self.cuda and t.device.type == "cpu":
            t = t.pin_memory().to(self.device, non_blocking=True)
        else:
            t = t.to(self.device)
        return t if dtype is None else t.to(dtype)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """An outgoing tensor back to the host as float32, once, right before it is encoded."""
        return t.detach().to(device="cpu", dtype=torch.float32)

    def describe(self) -> str:
        return (
            f"{self.device} {DTYPE_NAMES[self.compute_dtype]}"
            + (" (fp32 master)" if self.mixed else "")
            + (" + activation checkpointing" if self.checkpointing else "")
        )


CPU_FP32 = Placement()


def parse_device(value: str) -> torch.device:
    """`--device auto|cpu|cuda|cuda:N` into a device that exists here; raises ConfigError with
    the reason and the fix (never a CUDA traceback)."""
    value = value.strip().lower()
    if value == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if _cuda_count() else torch.device("cpu")
    if value == "cpu":
        return torch.device("cpu")
    if value == "cuda" or value.startswith("cuda:"):
        index_text = value.partition(":")[2] or "0"
        if not index_text.isdigit():
            raise ConfigError("--device", value, "expected cuda:N with N a device index, e.g. cuda:0")
        n = _cuda_count()
        if n == 0:
            raise ConfigError(
                "--device",
                value,
                "no CUDA device is visible to this process (no GPU, no driver, a CPU build of torch, or CUDA_VISIBLE_DEVICES hides it); use --device cpu, or check `nvidia-smi` and that torch was installed with CUDA",
            )
        index = int(index_text)
        if index >= n:
            raise ConfigError("--device", value, f"this machine has {n} CUDA device(s): use cuda:0 .. cuda:{n - 1}")
        return torch.device("cuda", index)
    raise ConfigError("--device", value, "must be auto, cpu, cuda or cuda:N")


def _cuda_count() -> int:
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver install: treat as no GPU, the caller says so
        return 0


def resolve_placement(device: torch.device | str, compute: ComputeConfig) -> Placement:
    """The placement for this peer: `compute.dtype` resolved for the device ("auto": bf16 on a
    CUDA device that supports it, else fp32). bf16 runs on CPUs too (CI trains it there)."""
    dev = parse_device(device) if isinstance(device, str) else device
    name = compute.dtype
    if name == "auto":
        name = "bf16" if dev.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if name == "bf16" and dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            "compute.dtype", "bf16", f"{torch.cuda.get_device_name(dev)} has no bf16 support; use fp32 or auto"
        )
    return Placement(device=dev, compute_dtype=DTYPES[name], checkpointing=compute.activation_checkpointing)
