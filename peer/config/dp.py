"""The `[dp]` section: data-parallel sync inside one stage group (peer/dp/)."""

from __future__ import annotations

from dataclasses import dataclass

from peer.config.checks import choice, positive
from peer.errors import ConfigError

DP_SCHEMES = ("dense", "powersgd", "int8", "diloco")
DILOCO_COMPRESSIONS = ("none", "powersgd", "int8")


@dataclass
class DPConfig:
    """Data-parallel sync inside one stage group.

    Args:
        replicas: peers per stage (R). 1 disables sync.
        scheme: "dense" (fp32 mean of gradients every step), "powersgd" (rank-`rank` gradients
            with error feedback every step), "int8" (8-bit gradients with error feedback every
            step), "diloco" (Streaming DiLoCo: local steps, outer Nesterov step on parameter
            deltas every `inner_steps`, deltas compressed by `outer_compression`).
        rank: PowerSGD rank (paper: 64); must not exceed min(rows, cols) of any synced matrix.
        error_feedback: keep the compression residual and add it to the next round.
        inner_steps: DiLoCo H (paper: >= 10).
        fragments: Streaming DiLoCo fragments; fragment f syncs after steps where (step+1) % H == f*H//fragments.
        outer_lr, outer_momentum: DiLoCo outer Nesterov SGD.
        outer_compression: how DiLoCo deltas travel: none (fp32), powersgd, int8.
        link_share: swarm only: the most of a peer's measured uplink time its stage-group rounds
            may take; rounds are spaced further apart than `inner_steps` when a round's bytes
            would take more (peer/dp/group.py). 0: `inner_steps` alone sets the spacing.
        min_period_s: swarm only: the shortest time between a stage group's rounds, whatever
            `inner_steps` and the link allow. Why: a hivemind round costs the same CPU however
            small it is (DHT lookups, each request and answer signed, p2pd traffic: about a
            quarter CPU-second per peer and round on the bench bed), so fast steps of a small
            model would spend a quarter of the machine on matchmaking. Rounded up to a power of two.

    In a networked swarm the stage group always averages parameters DiLoCo-style in the
    background (peer/dp/group.py): every `inner_steps` steps, `outer_compression` "none" (fp32
    parameters) or "int8" (8-bit deltas); `scheme` and the outer optimizer are local-runner only.
    """

    replicas: int = 1
    scheme: str = "dense"
    rank: int = 64
    error_feedback: bool = True
    inner_steps: int = 10
    fragments: int = 1
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_compression: str = "int8"
    link_share: float = 0.2
    min_period_s: float = 8.0

    def __post_init__(self) -> None:
        positive("dp.min_period_s", self.min_period_s)
        if not (0.0 <= self.link_share <= 1.0):
            raise ConfigError(
                "dp.link_share",
                self.link_share,
                "must be in [0, 1]: the share of the uplink's time averaging rounds may take (0 = no bound)",
            )
        if self.replicas < 1:
            raise ConfigError("dp.replicas", self.replicas, "must be >= 1")
        choice("dp.scheme", self.scheme, DP_SCHEMES)
        choice("dp.outer_compression", self.outer_compression, DILOCO_COMPRESSIONS)
        if self.rank < 1:
            raise ConfigError("dp.rank", self.rank, "must be >= 1")
        if self.inner_steps < 1:
            raise ConfigError("dp.inner_steps", self.inner_steps, "must be >= 1")
        if not (1 <= self.fragments <= self.inner_steps):
            raise ConfigError("dp.fragments", self.fragments, f"must be in [1, inner_steps={self.inner_steps}]")
        positive("dp.outer_lr", self.outer_lr)
        if not (0.0 <= self.outer_momentum < 1.0):
            raise ConfigError("dp.outer_momentum", self.outer_momentum, "must be in [0, 1)")
