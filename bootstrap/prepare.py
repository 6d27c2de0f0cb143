"""The checks a bootstrap makes on its run config before it starts anything (also `anchormesh
config check`, which starts nothing): the swarm's rules, the model's real sizes, the stage cut."""

from __future__ import annotations

from peer.config import TrainConfig, check_swarm


def prepare_run(config: TrainConfig) -> TrainConfig:
    """The checks a bootstrap makes before it starts anything; returns the config with the
    model's real sizes (a pretrained model's config.json is read). Raises ConfigError."""
    from peer.model.loading import resolve_dims
    from peer.model.stages import layer_ranges

    check_swarm(config)
    config.model = resolve_dims(config.model)
    config.check_model_dims()  # now against the pretrained model's real sizes
    layer_ranges(config.model.num_layers, config.model.num_stages)  # a bad stage count fails here
    return config
