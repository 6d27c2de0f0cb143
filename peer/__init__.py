"""anchormesh peer: the daemon and the training core (stages, codec, DP sync, anchor, optimizer)."""

__version__ = "0.1.0"
