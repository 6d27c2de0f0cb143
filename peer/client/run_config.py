"""`anchormesh config show`: what a run.toml (plus `--set`) will run, before anything starts.

It prints the effective settings as a run.toml, each with where its value came from (default,
tiny model, run.toml, --set), so an operator sees the run the bootstrap would serve (`config
check` validates it as the bootstrap does: bootstrap/prepare.py).
"""

from __future__ import annotations

import dataclasses
import json

from peer.config import CODEC_SETTINGS, CODEC_SHARED, LOCAL_ONLY, TrainConfig, is_tiny
from peer.runtoml import DEFAULT, MODEL_DIMS, SCALARS, ResolvedRun, config_digest


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def public_tables(cfg: TrainConfig) -> dict:
    """The run as a run.toml lays it out: top-level keys, sections, `[codec]` with the run's
    codec's own table `[codec.SCHEME]`. Settings a swarm does not read (LOCAL_ONLY) are left out."""
    data = dataclasses.asdict(cfg)
    out: dict = {k: data[k] for k in SCALARS if k not in LOCAL_ONLY}
    for section, values in data.items():
        if not isinstance(values, dict):
            continue
        if section == "mask":
            scheme = cfg.mask.scheme
            out["codec"] = {k: values[k] for k in CODEC_SHARED}
            own = CODEC_SETTINGS.get(scheme, ())
            if own:
                out["codec"][scheme] = {k: values[k] for k in own}
        else:
            out[section] = {k: v for k, v in values.items() if f"{section}.{k}" not in LOCAL_ONLY}
    return out


def render_toml(resolved: ResolvedRun) -> str:
    """The run as a run.toml with a `# source` comment on every line that is not a default."""
    cfg = resolved.config
    lines = [
        f"# run config {config_digest(cfg)}: model {cfg.model.name}, {cfg.model.num_stages} stages, codec {cfg.mask.scheme}",
        "# each value's source: default (the recommended run) unless its comment says otherwise",
    ]

    def line(name: str, key: str, value: object) -> str:
        text = f"{key} = {_toml_value(value)}"
        source = resolved.sources.get(name, DEFAULT)
        if name.startswith("model.") and key in MODEL_DIMS and not is_tiny(cfg.model.name):
            return f"# {text:<38} # not used: read from the model when the run starts"
        return text if source == DEFAULT else f"{text:<40} # {source}"

    def table(path: str, values: dict) -> None:
        lines.extend(["", f"[{path}]"])
        lines.extend(line(f"{path}.{k}", k, v) for k, v in values.items() if not isinstance(v, dict))
        for k, v in values.items():
            if isinstance(v, dict):
                table(f"{path}.{k}", v)

    tables = public_tables(cfg)
    lines += [line(k, k, v) for k, v in tables.items() if not isinstance(v, dict)]
    for section, values in tables.items():
        if isinstance(values, dict):
            table(section, values)
    return "\n".join(lines) + "\n"


def render_json(resolved: ResolvedRun) -> str:
    """The same as one JSON object: {"digest", "config" (as a run.toml lays it out), "sources"
    (of the values that are not defaults)}."""
    sources = {k: v for k, v in resolved.sources.items() if v != DEFAULT}
    return json.dumps(
        {"digest": config_digest(resolved.config), "config": public_tables(resolved.config), "sources": sources},
        indent=2,
    )
