"""A run config from plain data: a run.toml file, or the JSON the tracker hands to peers.

Apart from the dataclasses (peer/config.py) because this is the one place that reads untrusted,
nested data: it refuses unknown sections and settings (listing the known ones) and wrong types,
naming the field, before any dataclass sees a value.
"""

from __future__ import annotations

import dataclasses
import tomllib

from peer.config import TrainConfig
from peer.errors import ConfigError

SCALARS = ("steps", "seed", "token_budget")  # top-level keys of a run.toml that are not sections


def _check_type(name: str, value: object, default: object) -> None:
    """A setting must have its default's type (an int is fine where a float is expected), so a
    typo like `lr = "3e-4"` names the field instead of failing somewhere inside a component."""
    if isinstance(default, bool):
        ok, want = isinstance(value, bool), "true or false"
    elif isinstance(default, int):
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif isinstance(default, float):
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    elif isinstance(default, str):
        ok, want = isinstance(value, str), "a string"
    else:
        return
    if not ok:
        raise ConfigError(name, value, f"must be {want}")


def config_from_dict(data: dict) -> TrainConfig:
    """A TrainConfig from nested plain data (run.toml, the tracker's JSON); unknown keys are errors."""
    sections = {f.name: f.default_factory for f in dataclasses.fields(TrainConfig) if f.default_factory is not dataclasses.MISSING}
    kwargs: dict = {}
    for key, value in data.items():
        if key in sections:
            if not isinstance(value, dict):
                raise ConfigError(key, value, "must be a table of settings")
            cls = type(sections[key]())
            known = {f.name: f.default for f in dataclasses.fields(cls)}
            for sub in value:
                if sub not in known:
                    raise ConfigError(f"{key}.{sub}", value[sub], f"unknown setting; known: {', '.join(sorted(known))}")
                _check_type(f"{key}.{sub}", value[sub], known[sub])
            try:
                kwargs[key] = cls(**value)
            except TypeError as exc:
                raise ConfigError(key, value, str(exc)) from None
        elif key in SCALARS:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(key, value, "must be an integer")
            kwargs[key] = value
        else:
            raise ConfigError(key, value, f"unknown section; known: {', '.join(sorted([*sections, *SCALARS]))}")
    return TrainConfig(**kwargs)


def load_run_toml(path: str) -> TrainConfig:
    """Read a run.toml into a TrainConfig (errors name the field)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError("--config", path, f"cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("--config", path, f"not valid TOML: {exc}") from None
    return config_from_dict(data)
