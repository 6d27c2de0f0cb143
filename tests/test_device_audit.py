"""Device audit of the fast path, run on the CPU: during a worker's micro-batch work (inject,
forward, backward) no code outside the host-side wire modules may create a tensor without a
device, read a tensor's value on the host (`.item()`, `float(t)`, `bool(t)`, `.tolist()`,
`.numpy()`) or copy one to the host (`.cpu()`). On a GPU each of those is a host sync or a
tensor on the wrong device; here they are caught by a `TorchFunctionMode` that names the line.

The wire modules (decode, encode, token-window checks) work on host tensors by design: what
they read was never on the device. Everything else must stay where the weights live.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from peer.config import MaskConfig, ModelConfig, OptimConfig, PipelineConfig, TrainConfig
from peer.model.loading import load_causal_lm
from peer.model.placement import Placement
from peer.pipeline.local import LocalPipelineRunner
from peer.pipeline.worker import StageWorker

FACTORIES = {
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.tensor,
    torch.linspace,
}
SYNCS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
}
PEER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "peer")
# host-side by design: the wire's bytes, the codec's encode/decode and mask PRF, host token checks
# (the transform coder's modules turn tensors into bytes and back; where its decode's products run
# is tested in tests/test_transform_codec.py)
HOST_SIDE = {
    ("wire", "tensors.py"),
    ("codec", "mask.py"),
    ("codec", "transform.py"),
    ("codec", "transform_wire.py"),
    ("codec", "bitpack.py"),
    ("codec", "row_rates.py"),
}
HOST_FUNCS = {
    "check_token_window",
    "_check_tokens",
    "to_host",
    "coef_shape",
    "check_input",
}  # check_input reads only host ids
GENERIC = {("errors.py",)}  # helpers judged by who calls them


class DeviceAudit(TorchFunctionMode):
    """Records (what, where) for factories without `device=` and host reads, where = the first
    frame in peer/ that made the call."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = None
        if func in FACTORIES and "device" not in kwargs:
            what = f"{func.__name__}() without device="
        elif func in SYNCS:
            what = f"Tensor.{func.__name__}"
        if what is not None:
            where = self._caller()
            if where is not None:
                self.found.append((what, where))
        return func(*args, **kwargs)

    @staticmethod
    def _caller() -> str | None:
        for frame in reversed(traceback.extract_stack()[:-2]):
            if frame.filename.startswith(PEER):
                parts = tuple(os.path.relpath(frame.filename, PEER).split(os.sep))
                if parts in GENERIC:
                    continue
                if parts in HOST_SIDE or frame.name in HOST_FUNCS:
                    return None
                return f"peer/{'/'.join(parts)}:{frame.lineno} in {frame.name}"
        return None


MODEL = ModelConfig(name="tiny-llama", hidden_size=64, num_layers=6, num_heads=4, max_seq_len=64)
PIPE = PipelineConfig(micro_batch_size=2, micro_batches=2, seq_len=16, max_staleness=0)


def _windows(step: int, replica: int, j: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (PIPE.micro_batch_size, PIPE.seq_len + 1), generator=torch.Generator().manual_seed(100 * step + j)
    )


def _audited_run(mask: MaskConfig, steps: int = 3) -> list[tuple[str, str]]:
    cfg = TrainConfig(
        model=MODEL.__class__(**{**MODEL.__dict__, "num_stages": 3}),
        mask=mask,
        pipeline=PIPE,
        optim=OptimConfig(lr=1e-3),
        steps=steps,
    )
    runner = LocalPipelineRunner(
        cfg, load_causal_lm(cfg.model, seed=0), _windows, placement=Placement(compute_dtype=torch.bfloat16)
    )
    runner.run(1)  # warm-up: the first basis, the working copy
    audit = DeviceAudit()
    originals = {name: getattr(StageWorker, name) for name in ("inject", "forward_one", "backward_one")}

    def audited(fn):
        def wrapper(self, *a, **k):
            with audit:
                return fn(self, *a, **k)

        return wrapper

    try:
        for name, fn in originals.items():
            setattr(StageWorker, name, audited(fn))
        runner.run(steps)
    finally:
        for name, fn in originals.items():
            setattr(StageWorker, name, fn)
        runner.close()
    return audit.found


@pytest.mark.parametrize(
    "name,mask",
    [
        ("mask_prior", MaskConfig(scheme="mask", drop=0.9, fill="prior_rescale", values="int8")),
        ("lowrank", MaskConfig(scheme="lowrank", rank=8, values="int8", basis_refresh=100)),
        ("dense", MaskConfig(scheme="mask", values="fp16")),
        ("transform", MaskConfig(scheme="transform", basis_refresh=2)),  # refits inside the audited steps
        ("transform_rows", MaskConfig(scheme="transform", grad_rates="row")),  # a rate per gradient row
        (
            "transform_message_rotation",
            MaskConfig(scheme="transform", grad_rounding="nearest", grad_rotation="message"),
        ),  # a signed permutation per gradient message
    ],
)
def test_fast_path_makes_no_host_sync_and_no_deviceless_tensor(name: str, mask: MaskConfig) -> None:
    found = _audited_run(mask)
    assert not found, f"{name}: {len(found)} host syncs / device-less tensors in the fast path:\n" + "\n".join(
        sorted({f"{w} at {at}" for w, at in found})
    )


def test_the_audit_catches_what_it_looks_for() -> None:
    """The audit itself: a sync and a device-less factory called from peer/ code are reported."""
    from peer.pipeline import worker

    audit = DeviceAudit()
    with audit:
        worker.mean_loss([torch.tensor(1.0, device="cpu")])  # float(): one read, by design per step
    assert any(w == "Tensor.__float__" and "mean_loss" in at for w, at in audit.found), audit.found
