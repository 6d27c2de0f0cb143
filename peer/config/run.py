"""The whole run: `TrainConfig` (every section) and the rules that span sections.

Apart from the sections because these rules read several of them at once (the spectral mode
against the anchor and the codec, the sequence length against the model) and because
`LOCAL_ONLY` and `check_swarm` say what a networked swarm refuses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from peer.config.anchor import AnchorConfig
from peer.config.checkpoint import CheckpointConfig
from peer.config.checks import positive
from peer.config.codec import MaskConfig
from peer.config.compute import ComputeConfig
from peer.config.data import DataConfig
from peer.config.dp import DPConfig
from peer.config.model import TINY_MODEL_PREFIX, ModelConfig
from peer.config.optim import OptimConfig
from peer.config.pipeline import PipelineConfig
from peer.config.security import SecurityConfig
from peer.config.spectral import SpectralConfig
from peer.errors import ConfigError


@dataclass
class TrainConfig:
    """Everything one training run needs; each part goes to the component that owns it.

    Args:
        steps: optimizer steps of a local run (runner, benchmarks); a swarm runs until stopped
            or until `token_budget`.
        seed: seeds the model's initial weights, the masks and the data order.
        token_budget: swarm only: the tracker ends the run once stage 0 has fed this many tokens
            (status "done"; peers write a final checkpoint and leave); 0 = until stopped.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    mask: MaskConfig = field(default_factory=MaskConfig)
    dp: DPConfig = field(default_factory=DPConfig)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    spectral: SpectralConfig = field(default_factory=SpectralConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    steps: int = 100
    seed: int = 0
    token_budget: int = 0

    def __post_init__(self) -> None:
        positive("steps", self.steps)
        positive("token_budget", self.token_budget, allow_zero=True)
        if self.pipeline.seq_len > self.model.max_seq_len:
            raise ConfigError(
                "pipeline.seq_len", self.pipeline.seq_len, f"exceeds model.max_seq_len={self.model.max_seq_len}"
            )
        if (
            self.spectral.mode in ("ef", "paper_ef") and self.anchor.enabled
        ):  # error feedback: the anchor batch's masked twin pass
            if not self.anchor.with_masked:
                raise ConfigError(
                    "anchor.with_masked",
                    False,
                    f"spectral.mode={self.spectral.mode!r} needs the masked anchor gradient",
                )
            if self.mask.scheme != "mask":
                raise ConfigError(
                    "spectral.mode",
                    self.spectral.mode,
                    f'needs the anchor batch\'s masked twin pass, which only the element mask has (codec.scheme="{self.mask.scheme}"); use "paper" or "off"',
                )
        if self.data.tokenizer == "auto":
            self.data.tokenizer = "bytes" if self.model.name.startswith(TINY_MODEL_PREFIX) else "model"
        self.check_model_dims()

    def check_model_dims(self) -> None:
        """Settings bounded by the model's sizes. Run again once a pretrained model's real sizes
        are known (bootstrap/node.py), since `model.hidden_size` is only a placeholder until then."""
        if self.mask.scheme == "lowrank" and self.mask.rank > self.model.hidden_size:
            raise ConfigError(
                "codec.lowrank.rank",
                self.mask.rank,
                f"exceeds the model's hidden size {self.model.hidden_size} (a rank-r code of an {self.model.hidden_size}-wide activation needs r <= {self.model.hidden_size})",
            )


# Settings that only the local runner and the benchmarks read. A run.toml is a swarm's run, so
# setting one there is refused (peer/runtoml.py), naming what the swarm reads instead: a value
# accepted and then ignored would be a run that is not the one its operator wrote down.
LOCAL_ONLY = frozenset(
    {
        "steps",
        "dp.replicas",
        "dp.scheme",
        "dp.rank",
        "dp.error_feedback",
        "dp.fragments",
        "dp.outer_lr",
        "dp.outer_momentum",
        "anchor.executor",
        "anchor.with_masked",
    }
)


def check_swarm(cfg: TrainConfig) -> None:
    """What a networked swarm (bootstrap + peers) cannot run yet; raises ConfigError naming the field.

    Why: the swarm's anchor circuit (peer/pipeline/swarm_anchor.py) computes the dense prior
    only; the error-feedback modes also need the masked twin of the anchor batch, which only
    the local runner computes so far.
    """
    if cfg.dp.outer_compression == "powersgd":
        raise ConfigError(
            "dp.outer_compression",
            "powersgd",
            "a swarm's stage groups average through hivemind with 'none' (fp32) or 'int8'; PowerSGD runs in the local runner",
        )
    if cfg.anchor.enabled and cfg.spectral.mode in ("ef", "paper_ef"):
        raise ConfigError(
            "spectral.mode",
            cfg.spectral.mode,
            "a swarm's anchor passes give dense priors only; use 'paper' or 'off' (the EF modes run in the local runner)",
        )
