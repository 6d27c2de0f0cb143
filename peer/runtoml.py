"""A run config from plain data: a run.toml file with `--set` overrides, or the JSON the tracker
hands to peers.

Apart from the dataclasses (peer/config.py) because this is the one place that reads untrusted,
nested data: it refuses unknown sections and settings (listing the known ones) and wrong types,
naming the field, before any dataclass sees a value.

A run's value for each setting comes from the first of these that gives it, last wins:
the dataclasses' defaults (the recommended run), the tiny models' profile (`TINY_RUN`, only for a
model built from a config), the run.toml, the `--set` overrides. `resolve_run` keeps where each
value came from, so `anchormesh config show` can say it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass

from peer.config import LOCAL_ONLY, ModelConfig, TrainConfig, is_tiny, run_profile
from peer.errors import ConfigError

SCALARS = ("steps", "seed", "token_budget")  # top-level keys of a run.toml that are not sections
DEFAULT, TINY, FILE, SET = "default", "tiny model", "run.toml", "--set"  # where a value came from


def _sections() -> dict[str, type]:
    """Section name -> its dataclass, in TrainConfig's order."""
    return {f.name: type(f.default_factory()) for f in dataclasses.fields(TrainConfig) if f.default_factory is not dataclasses.MISSING}


def _check_type(name: str, value: object, default: object) -> object:
    """A setting must have its default's type (an int is fine where a float is expected, and
    becomes one, so `bits = 2` and `bits = 2.0` are the same run), so a typo like `lr = "3e-4"`
    names the field instead of failing somewhere inside a component."""
    if isinstance(default, bool):
        ok, want = isinstance(value, bool), "true or false"
    elif isinstance(default, int):
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif isinstance(default, float):
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
        value = float(value) if ok else value
    elif isinstance(default, str):
        ok, want = isinstance(value, str), "a string"
    else:
        return value
    if not ok:
        raise ConfigError(name, value, f"must be {want}")
    return value


def config_from_dict(data: dict) -> TrainConfig:
    """A TrainConfig from nested plain data (run.toml, the tracker's JSON); unknown keys are errors.
    Missing settings take the dataclasses' defaults: `resolve_run` is what adds a model's profile."""
    sections = _sections()
    kwargs: dict = {}
    for key, value in data.items():
        if key in sections:
            if not isinstance(value, dict):
                raise ConfigError(key, value, "must be a table of settings")
            known = {f.name: f.default for f in dataclasses.fields(sections[key])}
            checked = {}
            for sub in value:
                if sub not in known:
                    raise ConfigError(f"{key}.{sub}", value[sub], f"unknown setting; known: {', '.join(sorted(known))}")
                checked[sub] = _check_type(f"{key}.{sub}", value[sub], known[sub])
            try:
                kwargs[key] = sections[key](**checked)
            except TypeError as exc:
                raise ConfigError(key, value, str(exc)) from None
        elif key in SCALARS:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(key, value, "must be an integer")
            kwargs[key] = value
        else:
            raise ConfigError(key, value, f"unknown section; known: {', '.join(sorted([*sections, *SCALARS]))}")
    return TrainConfig(**kwargs)


def parse_set(item: str) -> tuple[str, object]:
    """`section.key=value` (or `key=value` for a top-level setting) -> (name, value). The value
    is read as a TOML value (`2`, `1e-4`, `true`, `"text"`); anything that is not one is taken
    as a bare string, so `--set model.name=smollm2-135m` needs no quotes."""
    name, sep, text = item.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ConfigError("--set", item, "must be section.key=value, e.g. optim.lr=1e-4")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    return name, value


def _flatten(data: dict) -> dict[str, object]:
    """{"optim": {"lr": 1}, "seed": 3} -> {"optim.lr": 1, "seed": 3}; unknown names refused."""
    sections = _sections()
    flat: dict[str, object] = {}
    for key, value in data.items():
        if key in sections and isinstance(value, dict):
            known = {f.name for f in dataclasses.fields(sections[key])}
            for sub, v in value.items():
                if sub not in known:
                    raise ConfigError(f"{key}.{sub}", v, f"unknown setting; known: {', '.join(sorted(known))}")
                flat[f"{key}.{sub}"] = v
        elif key in SCALARS:
            flat[key] = value
        elif key in sections:
            raise ConfigError(key, value, "must be a table of settings")
        else:
            raise ConfigError(key, value, f"unknown section; known: {', '.join(sorted([*sections, *SCALARS]))}")
    return flat


def _refuse_local_only(flat: dict[str, object], origin: str) -> None:
    """A swarm's run may not set what the swarm never reads (peer/config.py LOCAL_ONLY)."""
    sections = _sections()
    for name, value in flat.items():
        if name in LOCAL_ONLY:
            section = name.split(".")[0] if "." in name else None
            if section is None:
                read = [k for k in SCALARS if k not in LOCAL_ONLY]
                where = "top-level settings a swarm reads"
            else:
                read = [f.name for f in dataclasses.fields(sections[section]) if f"{section}.{f.name}" not in LOCAL_ONLY]
                where = f"[{section}] settings a swarm reads"
            raise ConfigError(name, value, f"({origin}) a swarm does not read this setting (only the local runner and the benchmarks do); {where}: {', '.join(read)}")


@dataclass
class ResolvedRun:
    """A run's config and, for every setting ("section.key" or a top-level key), where its value
    came from: DEFAULT, TINY, FILE or SET."""

    config: TrainConfig
    sources: dict[str, str]

    @property
    def digest(self) -> str:
        return config_digest(self.config)


def resolve_run(data: dict | None = None, sets: Sequence[str] = ()) -> ResolvedRun:
    """The run of a run.toml's data (None: no file) with `--set` overrides applied on top."""
    file_flat = _flatten(data or {})
    _refuse_local_only(file_flat, FILE)
    set_flat: dict[str, object] = {}
    for item in sets:
        name, value = parse_set(item)
        set_flat.update(_flatten({name.split(".", 1)[0]: {name.split(".", 1)[1]: value}} if "." in name else {name: value}))
    _refuse_local_only(set_flat, SET)
    model_name = set_flat.get("model.name", file_flat.get("model.name", ModelConfig().name))
    if not isinstance(model_name, str):
        raise ConfigError("model.name", model_name, "must be a string")
    profile = {f"{sec}.{k}": v for sec, values in run_profile(model_name).items() for k, v in values.items()}
    merged: dict[str, object] = {}
    sources: dict[str, str] = {}
    for origin, layer in ((TINY, profile), (FILE, file_flat), (SET, set_flat)):
        for name, value in layer.items():
            merged[name], sources[name] = value, origin
    nested: dict = {}
    for name, value in merged.items():
        section, _, key = name.partition(".")
        if key:
            nested.setdefault(section, {})[key] = value
        else:
            nested[name] = value
    config = config_from_dict(nested)
    every = {f"{sec}.{f.name}" for sec, cls in _sections().items() for f in dataclasses.fields(cls)} | set(SCALARS)
    return ResolvedRun(config, {name: sources.get(name, DEFAULT) for name in sorted(every)})


def read_toml(path: str) -> dict:
    """A run.toml's data (errors name the file)."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError("--config", path, f"cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("--config", path, f"not valid TOML: {exc}") from None


def load_run(path: str | None, sets: Sequence[str] = ()) -> ResolvedRun:
    """A run.toml (None: none) plus `--set` overrides, resolved."""
    return resolve_run(read_toml(path) if path else None, sets)


def load_run_toml(path: str) -> TrainConfig:
    """Read a run.toml into a TrainConfig (errors name the field)."""
    return load_run(path).config


MODEL_DIMS = ("num_layers", "hidden_size", "num_heads")  # a pretrained model's come from its config.json


def config_digest(cfg: TrainConfig) -> str:
    """12 hex digits of the run config's canonical JSON: two runs (or a tracker log line and a
    status) with the same digest run the same settings. A pretrained model's sizes are left out:
    they are read from the model when the bootstrap starts, so `config show` before and the
    tracker after agree."""
    data = dataclasses.asdict(cfg)
    if not is_tiny(cfg.model.name):
        data["model"] = {k: v for k, v in data["model"].items() if k not in MODEL_DIMS}
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]
