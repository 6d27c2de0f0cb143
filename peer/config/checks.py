"""The two checks most config fields need: a value from a fixed set, a value above zero.

Apart so that every section's dataclass raises the same `ConfigError` wording for them.
"""

from __future__ import annotations

from peer.errors import ConfigError


def choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(name, value, f"must be one of {', '.join(allowed)}")


def positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(name, value, "must be > 0" if not allow_zero else "must be >= 0")
