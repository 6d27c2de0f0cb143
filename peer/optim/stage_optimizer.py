"""The optimizer one pipeline stage steps with (docs/design.md, "The spectral correction optimizer").

Order per step: masked fwd/bwd -> DP sync -> anchor EMA/SVD refresh (`observe_anchor`, when an
anchor has arrived) -> spectral correction of the target gradients -> grad-norm clip -> AdamW.
Clipping comes after the correction so that the clip sees the gradient AdamW will use.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from peer.config import OptimConfig, SpectralConfig
from peer.errors import ConfigError, TensorError, check_finite
from peer.optim.schedule import lr_at
from peer.optim.spectral import SpectralCorrection, _all_finite


class StageOptimizer:
    """What one stage steps with: spectral correction of the (synced) gradients, grad-norm clip, then torch AdamW.

    Why: order per step is masked fwd/bwd -> DP sync -> anchor refresh -> correction -> AdamW
    (docs/design.md). Weight decay applies to >= 2-D parameters only (not norms and biases). A
    step with a non-finite gradient raises TensorError before anything changes, so the caller
    can skip the batch and keep training.
    """

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        targets: set[str],
        spectral: SpectralConfig,
        optim: OptimConfig,
    ) -> None:
        self.names = [n for n, _ in named_params]
        if len(set(self.names)) != len(self.names):
            dup = sorted({n for n in self.names if self.names.count(n) > 1})
            raise ConfigError("named_params", dup, "parameter names must be unique")
        self.params: dict[str, torch.nn.Parameter] = dict(named_params)
        unknown = sorted(set(targets) - set(self.params))
        if unknown:
            raise ConfigError("spectral targets", unknown, "are not parameters of this stage")
        self.targets = set(targets)
        self.optim_cfg = optim
        self.spectral = SpectralCorrection(spectral, {n: self.params[n].shape for n in sorted(self.targets)})
        decay = [p for _, p in named_params if p.ndim >= 2]
        no_decay = [p for _, p in named_params if p.ndim < 2]
        groups = [
            g
            for g in ({"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0})
            if g["params"]
        ]
        if not groups:
            raise ConfigError("named_params", [], "a stage needs at least one parameter")
        # fused AdamW on CUDA: one kernel for all parameters instead of a dozen per parameter
        fused = all(p.is_cuda and p.dtype == torch.float32 for _, p in named_params) or None
        self.opt = torch.optim.AdamW(
            groups,
            lr=optim.lr,
            betas=(optim.beta1, optim.beta2),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            fused=fused,
        )

    # ------------------------------------------------------------------ lr
    @property
    def lr(self) -> float:
        return float(self.opt.param_groups[0]["lr"])

    @lr.setter
    def lr(self, value: float) -> None:
        if not value > 0:
            raise ConfigError("optim.lr", value, "must be > 0")
        for g in self.opt.param_groups:
            g["lr"] = float(value)

    # ------------------------------------------------------------------ anchor
    def observe_anchor(
        self, step: int, dense: Mapping[str, Tensor], masked: Mapping[str, Tensor] | None = None
    ) -> None:
        """Hand an anchor's per-parameter gradients to the correction (only the targets are kept)."""
        for what, d in (("anchor dense", dense), ("anchor masked", masked or {})):
            unknown = sorted(set(d) - set(self.params))
            if unknown:
                raise TensorError(f"{what}: {unknown} are not parameters of this stage")
        # priors arrive on the host (from the wire) or in the anchor's dtype: onto the weights' device
        pick = lambda d: {n: t.to(self.params[n].device) for n, t in d.items() if n in self.targets}  # noqa: E731
        self.spectral.observe_anchor(step, pick(dense), None if masked is None else pick(masked))

    # ------------------------------------------------------------------ step
    def step(self, step: int | None = None) -> dict:
        """Correct, clip, AdamW; with `step` (this optimizer step's index), at the schedule's lr
        for it (`optim.schedule`); without, at the lr last set.

        Returns {"grad_norm": total norm after the correction, before the clip,
        "corrected": how many target gradients the correction changed (0 before any anchor)}.
        """
        live = [(n, p) for n, p in self.params.items() if p.grad is not None]
        grads = [p.grad for _, p in live]
        if not _all_finite(grads):
            for n, p in live:
                check_finite(f"grad of parameter {n}", p.grad)
        target_grads = {n: p.grad for n, p in live if n in self.targets}
        corrected = len(target_grads) if self.spectral.active else 0
        self.spectral.correct_(target_grads)
        params = [p for _, p in live]
        if not params:
            return {"grad_norm": 0.0, "corrected": 0}
        if self.optim_cfg.grad_clip > 0:
            total = torch.nn.utils.clip_grad_norm_(params, self.optim_cfg.grad_clip)
        else:
            total = torch.linalg.vector_norm(
                torch.stack(
                    [torch.linalg.vector_norm(g.detach(), 2, dtype=torch.float32).to(grads[0].device) for g in grads]
                )
            )
        if step is not None:
            self.lr = lr_at(self.optim_cfg, step)
        self.opt.step()
        return {"grad_norm": float(total), "corrected": corrected}

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        return {"names": list(self.names), "adamw": self.opt.state_dict(), "spectral": self.spectral.state_dict()}

    def load_state_dict(self, d: Mapping) -> None:
        """Restore from `state_dict()`; names and moment shapes are checked before anything is loaded."""
        if list(d.get("names", [])) != self.names:
            raise TensorError(f"optimizer state: parameter names {d.get('names')} != this stage's {self.names}")
        adam = d["adamw"]
        flat = [p for g in self.opt.param_groups for p in g["params"]]
        saved_ids = [i for g in adam["param_groups"] for i in g["params"]]
        saved_sizes = [len(g["params"]) for g in adam["param_groups"]]
        sizes = [len(g["params"]) for g in self.opt.param_groups]
        if saved_sizes != sizes:
            raise TensorError(f"optimizer state: param group sizes {saved_sizes} != this stage's {sizes}")
        for i, p in zip(saved_ids, flat):
            for key, t in adam["state"].get(i, {}).items():
                if key in ("exp_avg", "exp_avg_sq") and tuple(t.shape) != tuple(p.shape):
                    raise TensorError(
                        f"optimizer state: {key} of parameter #{i} has shape {tuple(t.shape)}, expected {tuple(p.shape)}"
                    )
        self.spectral.load_state_dict(d["spectral"])
        self.opt.load_state_dict(adam)
