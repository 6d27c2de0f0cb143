"""A run config from plain data: a run.toml file with `--set` overrides, or the JSON the tracker
hands to peers.

Apart from the dataclasses (peer/config/) because this is the one place that reads untrusted,
nested data: it refuses unknown sections and settings (listing the known ones) and wrong types,
naming the field, before any dataclass sees a value.

A run's value for each setting comes from the first of these that gives it, last wins:
the dataclasses' defaults (the recommended run), the tiny models' profile (`TINY_RUN`, only for a
model built from a config), the run.toml, the `--set` overrides. `resolve_run` keeps where each
value came from, so `anchormesh config show` can say it.

The codec's settings are `[codec]` (the shared ones: scheme, seed, adapt, min_keep, link_target)
and `[codec.SCHEME]` (each codec's own, peer/config/codec.py CODEC_SETTINGS) in a run.toml; inside,
they are one dataclass, `TrainConfig.mask` (MaskConfig), so they map onto its fields here. A
setting of a codec the run does not use is refused (it would be ignored), and so is the former
`[mask]` table, naming each key's new home.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass

from peer.config import (
    CODEC_SETTINGS,
    CODEC_SHARED,
    LOCAL_ONLY,
    MaskConfig,
    ModelConfig,
    TrainConfig,
    codec_key,
    is_tiny,
    run_profile,
)
from peer.errors import ConfigError

SCALARS = ("steps", "seed", "token_budget")  # top-level keys of a run.toml that are not sections
DEFAULT, TINY, FILE, SET = "default", "tiny model", "run.toml", "--set"  # where a value came from


def _sections() -> dict[str, type]:
    """Section name -> its dataclass, in TrainConfig's order."""
    return {
        f.name: type(f.default_factory())
        for f in dataclasses.fields(TrainConfig)
        if f.default_factory is not dataclasses.MISSING
    }


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


def _codec_flat(value: object) -> dict[str, object]:
    """A run.toml's `[codec]` table -> {"codec.scheme": ..., "codec.transform.bits": ...}."""
    if not isinstance(value, dict):
        raise ConfigError("codec", value, "must be a table of settings")
    flat: dict[str, object] = {}
    known = f"shared settings {', '.join(CODEC_SHARED)}; tables {', '.join(f'[codec.{c}]' for c in CODEC_SETTINGS)}"
    for sub, v in value.items():
        if sub in CODEC_SHARED:
            flat[f"codec.{sub}"] = v
        elif sub in CODEC_SETTINGS:
            if not isinstance(v, dict):
                raise ConfigError(
                    f"codec.{sub}",
                    v,
                    f"must be a table of the {sub} codec's settings: {', '.join(CODEC_SETTINGS[sub])}",
                )
            for k, vv in v.items():
                if k not in CODEC_SETTINGS[sub]:
                    raise ConfigError(
                        f"codec.{sub}.{k}",
                        vv,
                        f"not a setting of the {sub} codec; its settings: {', '.join(CODEC_SETTINGS[sub])}",
                    )
                flat[f"codec.{sub}.{k}"] = vv
        elif sub in {f.name for f in dataclasses.fields(MaskConfig)}:
            raise ConfigError(f"codec.{sub}", v, f"a setting of one codec: put it under {_homes(sub)}")
        else:
            raise ConfigError(f"codec.{sub}", v, f"unknown; [codec] takes {known}")
    return flat


def _homes(name: str) -> str:
    """Where a codec setting lives in a run.toml: `[codec]`, or the tables of the codecs that have it."""
    if name in CODEC_SHARED:
        return "[codec]"
    return (
        " or ".join(f"[codec.{c}]" for c, keys in CODEC_SETTINGS.items() if name in keys)
        or "no table (unknown setting)"
    )


def _flatten(data: dict) -> dict[str, object]:
    """{"optim": {"lr": 1}, "seed": 3, "codec": {"transform": {"bits": 2}}} -> {"optim.lr": 1,
    "seed": 3, "codec.transform.bits": 2}; unknown names refused, and the former [mask] table."""
    sections = _sections()
    flat: dict[str, object] = {}
    for key, value in data.items():
        if key == "codec":
            flat.update(_codec_flat(value))
        elif key == "mask":
            first = next(iter(value.items()), None) if isinstance(value, dict) else None
            if first is None:
                raise ConfigError(
                    "mask", value, "[mask] is now [codec] (the shared settings) and [codec.SCHEME] (each codec's own)"
                )
            raise ConfigError(
                f"mask.{first[0]}", first[1], f"[mask] is now [codec]: {first[0]} goes under {_homes(first[0])}"
            )
        elif key in sections and isinstance(value, dict):
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
            raise ConfigError(key, value, f"unknown section; known: {', '.join(sorted(_public_sections()))}")
    return flat


def codec_table(mask: dict) -> dict:
    """MaskConfig's fields as plain data ({"scheme": "lowrank", "rank": 8}) laid out as a
    run.toml's `[codec]` table: the shared settings, the scheme's own in its sub-table."""
    scheme = mask.get("scheme", MaskConfig().scheme)
    table = {k: v for k, v in mask.items() if k in CODEC_SHARED}
    own = {k: v for k, v in mask.items() if k not in CODEC_SHARED}
    if own:
        table[scheme] = own
    return table


def _public_sections() -> list[str]:
    return [("codec" if name == "mask" else name) for name in _sections()] + list(SCALARS)


def _internal(name: str) -> str:
    """ "codec.scheme" / "codec.transform.bits" -> "mask.scheme" / "mask.bits" (MaskConfig's fields)."""
    return f"mask.{name.rsplit('.', 1)[1]}" if name.startswith("codec.") else name


def _refuse_local_only(flat: dict[str, object], origin: str) -> None:
    """A swarm's run may not set what the swarm never reads (peer/config/run.py LOCAL_ONLY)."""
    sections = _sections()
    for name, value in flat.items():
        if name in LOCAL_ONLY:
            section = name.split(".")[0] if "." in name else None
            if section is None:
                read = [k for k in SCALARS if k not in LOCAL_ONLY]
                where = "top-level settings a swarm reads"
            else:
                read = [
                    f.name for f in dataclasses.fields(sections[section]) if f"{section}.{f.name}" not in LOCAL_ONLY
                ]
                where = f"[{section}] settings a swarm reads"
            raise ConfigError(
                name,
                value,
                f"({origin}) a swarm does not read this setting (only the local runner and the benchmarks do); {where}: {', '.join(read)}",
            )


@dataclass
class ResolvedRun:
    """A run's config and, for every setting ("section.key" or a top-level key), where its value
    came from: DEFAULT, TINY, FILE or SET."""

    config: TrainConfig
    sources: dict[str, str]

    @property
    def digest(self) -> str:
        return config_digest(self.config)


def _nest(name: str, value: object) -> dict:
    """ "a.b.c" = v -> {"a": {"b": {"c": v}}}."""
    out: object = value
    for part in reversed(name.split(".")):
        out = {part: out}
    return out  # type: ignore[return-value]


def _merge(into: dict, more: dict) -> dict:
    for k, v in more.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v
    return into


def resolve_run(data: dict | None = None, sets: Sequence[str] = ()) -> ResolvedRun:
    """The run of a run.toml's data (None: no file) with `--set` overrides applied on top."""
    file_flat = _flatten(data or {})
    _refuse_local_only(file_flat, FILE)
    set_data: dict = {}
    for item in sets:
        _merge(set_data, _nest(*parse_set(item)))
    set_flat = _flatten(set_data)
    _refuse_local_only(set_flat, SET)
    model_name = set_flat.get("model.name", file_flat.get("model.name", ModelConfig().name))
    if not isinstance(model_name, str):
        raise ConfigError("model.name", model_name, "must be a string")
    scheme = set_flat.get("codec.scheme", file_flat.get("codec.scheme", MaskConfig().scheme))
    for origin, layer in ((FILE, file_flat), (SET, set_flat)):  # a setting of another codec would be ignored: say so
        for name, value in layer.items():
            parts = name.split(".")
            if parts[0] == "codec" and len(parts) == 3 and parts[1] != scheme:
                raise ConfigError(
                    name,
                    value,
                    f"({origin}) a setting of the {parts[1]} codec, but codec.scheme = {scheme!r}: remove it, or set codec.scheme",
                )
    profile: dict[str, object] = {}
    for section, values in run_profile(model_name).items():
        for k, v in values.items():
            if section != "mask":
                profile[f"{section}.{k}"] = v
            elif k in CODEC_SHARED or k in CODEC_SETTINGS.get(
                scheme, ()
            ):  # the profile's settings of another codec do not apply
                profile[codec_key(k, scheme)] = v
    merged: dict[str, object] = {}
    sources: dict[str, str] = {}
    for origin, layer in ((TINY, profile), (FILE, file_flat), (SET, set_flat)):
        for name, value in layer.items():
            merged[name], sources[name] = value, origin
    nested: dict = {}
    for name, value in merged.items():
        section, _, key = _internal(name).partition(".")
        if key:
            nested.setdefault(section, {})[key] = value
        else:
            nested[name] = value
    try:
        config = config_from_dict(nested)
    except ConfigError as exc:  # a type error on a codec setting names the field as written
        if exc.field.startswith("mask."):
            raise ConfigError(
                codec_key(exc.field.split(".", 1)[1], scheme if isinstance(scheme, str) else ""),
                exc.value,
                str(exc).split(": ", 1)[1],
            ) from None
        raise
    return ResolvedRun(config, {name: sources.get(name, DEFAULT) for name in public_names(config)})


def public_names(cfg: TrainConfig) -> list[str]:
    """Every setting of a run as a run.toml names it (the codec's: [codec] and its own table)."""
    names = list(SCALARS)
    for section, cls in _sections().items():
        if section == "mask":
            scheme = cfg.mask.scheme
            names += [f"codec.{k}" for k in CODEC_SHARED] + [
                f"codec.{scheme}.{k}" for k in CODEC_SETTINGS.get(scheme, ())
            ]
        else:
            names += [f"{section}.{f.name}" for f in dataclasses.fields(cls)]
    return names


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
