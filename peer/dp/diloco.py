"""Streaming DiLoCo: local inner steps, a compressed outer Nesterov step per fragment every H steps."""

from __future__ import annotations

import logging

import torch

from peer.config import DPConfig
from peer.dp.base import DPSync, MeanSync, check_tensor_list, clone_nested, validate_replicas
from peer.dp.dense import DenseSync
from peer.dp.int8 import Int8Sync
from peer.dp.powersgd import PowerSGDSync
from peer.errors import ConfigError, TensorError, check_finite

logger = logging.getLogger(__name__)

OUTER_CODECS: dict[str, type[MeanSync]] = {"none": DenseSync, "int8": Int8Sync, "powersgd": PowerSGDSync}


def split_fragments(numels: list[int], fragments: int) -> list[list[int]]:
    """Contiguous runs of parameter indices with about equal total numel, none empty."""
    n = len(numels)
    if fragments == 1:
        return [list(range(n))]
    if fragments > n:
        raise ConfigError("dp.fragments", fragments, f"exceeds the number of parameters ({n}) to split")
    cum = [0]
    for k in numels:
        cum.append(cum[-1] + k)
    total = cum[-1]
    bounds = [0]
    for f in range(1, fragments):
        target = f * total / fragments
        candidates = range(bounds[-1] + 1, n - (fragments - f) + 1)
        bounds.append(min(candidates, key=lambda k: abs(cum[k] - target)))
    bounds.append(n)
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


class DiLoCoSync(DPSync):
    """Streaming DiLoCo (Douillard et al. 2023/2025): replicas train locally, fragments sync in turn.

    Grads are never synced (`sync_grads` returns 0). The parameters are split into
    `dp.fragments` contiguous fragments of about equal numel; fragment f syncs after the
    optimizer step of every `step` with (step + 1) % H == f * H // fragments (H = dp.inner_steps;
    with one fragment: after steps H-1, 2H-1, ...). A sync of fragment f:
      delta_r = theta_g - theta_r (each replica; compressed by dp.outer_compression with
                per-replica error feedback: "none" fp32, "int8", "powersgd" rank dp.rank)
      Delta   = mean_r delta_r
      v = mu * v + Delta;  theta_g -= outer_lr * (Delta + mu * v)    (Nesterov SGD)
      theta_r <- theta_g for every replica.
    theta_g is the global copy (fp32), taken from `init_params` (replicas must start identical)
    or, if that was never called, from replica 0 on the first `sync_params` call.

    Tuning: H >= 10 (paper; 20-100 on slow links); outer_lr 0.7, outer_momentum 0.9 are the
    DiLoCo defaults (outer_lr 1, momentum 0 is plain parameter averaging). More fragments
    spread the same bytes over the window (peak link load / fragments) at no cost in bytes.
    Cost: per H steps one replica uploads each fragment once: 4 * numel with "none",
    ~numel (+1032 per tensor) with "int8", the PowerSGD formula with "powersgd"; so amortised
    dense_bytes() / H per step (/ 4 with int8). Memory: theta_g and v (2 fp32 copies of the
    params) plus the codec's error buffers per replica.
    """

    scheme = "diloco"

    def __init__(self, cfg: DPConfig, shapes: list[torch.Size]) -> None:
        super().__init__(cfg, shapes)
        self.inner_steps = cfg.inner_steps
        self.fragments = split_fragments([s.numel() for s in self.shapes], cfg.fragments)
        self.offsets = [f * cfg.inner_steps // cfg.fragments for f in range(cfg.fragments)]
        codec = OUTER_CODECS[cfg.outer_compression]
        self.codecs: list[MeanSync] = [codec(cfg, [self.shapes[i] for i in frag]) for frag in self.fragments]
        self._global: list[torch.Tensor] | None = None
        self._momentum: list[torch.Tensor | None] = [None] * len(self.shapes)

    def due_fragments(self, step: int) -> list[int]:
        """Fragments whose outer step runs after optimizer step `step`."""
        phase = (step + 1) % self.inner_steps
        return [f for f, off in enumerate(self.offsets) if off == phase]

    def init_params(self, replica_params: list[list[torch.Tensor]]) -> None:
        """Snapshot theta_g from the initial params; they must be identical on every replica."""
        validate_replicas("params", replica_params, self.replicas, self.shapes)
        for r in range(1, self.replicas):
            for i, (a, b) in enumerate(zip(replica_params[0], replica_params[r])):
                if not torch.equal(a.detach().to(b.device), b.detach()):
                    raise TensorError(
                        f"params[replica {r}][param {i}]: differs from replica 0; DiLoCo replicas must start identical"
                    )
        self._global = [p.detach().to(torch.float32).clone() for p in replica_params[0]]
        self._momentum = [None] * len(self.shapes)

    def sync_grads(self, step: int, replica_grads: list[list[torch.Tensor]]) -> int:
        return 0

    def sync_params(self, step: int, replica_params: list[list[torch.Tensor]]) -> int:
        due = self.due_fragments(step) if self.replicas > 1 else []
        first = self._global is None and self.replicas > 1
        only = sorted({i for f in due for i in self.fragments[f]})
        validate_replicas("params", replica_params, self.replicas, self.shapes, only=only)
        if first:
            for i, p in enumerate(replica_params[0]):
                check_finite(f"params[replica 0][param {i}]", p)
        if not due and not first:
            return 0

        theta_g = self._global if not first else [p.detach().to(torch.float32).clone() for p in replica_params[0]]
        if first:
            logger.warning("DiLoCo: init_params() was not called; theta_g taken from replica 0 at step %d", step)
        new_global = list(theta_g)
        new_momentum = list(self._momentum)
        commits = []
        nbytes = 0
        mu, lr = self.cfg.outer_momentum, self.cfg.outer_lr
        for f in due:
            frag = self.fragments[f]
            deltas = [[theta_g[i] - rp[i].detach().to(theta_g[i]) for i in frag] for rp in replica_params]
            result = self.codecs[f].reduce(deltas)
            commits.append(result.commit)
            nbytes += result.bytes_per_replica
            for i, delta in zip(frag, result.mean):
                v = delta if new_momentum[i] is None else mu * new_momentum[i] + delta
                new_momentum[i] = v
                new_global[i] = theta_g[i] - lr * (delta + mu * v)

        for commit in commits:
            commit()
        self._global, self._momentum = new_global, new_momentum
        with torch.no_grad():
            for rp in replica_params:
                for f in due:
                    for i in self.fragments[f]:
                        rp[i].copy_(new_global[i])
        return nbytes

    def state_dict(self) -> dict:
        return {
            "scheme": self.scheme,
            "global": clone_nested(self._global),
            "momentum": clone_nested(self._momentum),
            "codecs": [c.state_dict() for c in self.codecs],
        }

    def load_state_dict(self, d: dict) -> None:
        self._check_scheme(d)
        g = d.get("global")
        theta = None if g is None else check_tensor_list("global", g, self.shapes)
        if theta is not None and any(t is None for t in theta):
            raise TensorError("state_dict[global]: missing entries")
        momentum = check_tensor_list("momentum", d.get("momentum"), self.shapes)
        codec_states = d.get("codecs")
        if not isinstance(codec_states, list) or len(codec_states) != len(self.codecs):
            raise TensorError(f"state_dict[codecs]: expected {len(self.codecs)} entries")
        backups = [c.state_dict() for c in self.codecs]
        try:
            for c, s in zip(self.codecs, codec_states):
                c.load_state_dict(s)
        except Exception:
            for c, s in zip(self.codecs, backups):
                c.load_state_dict(s)
            raise
        self._global, self._momentum = theta, momentum  # type: ignore[assignment]
