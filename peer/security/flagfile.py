"""Reading a flag's `@FILE` or file value (`--token`, `--tracker-key`, `--tls-ca`): every way it
can fail is a ConfigError naming the flag, so the command line answers with one line and exit 2,
never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

from peer.errors import ConfigError
from peer.security.identity import KEY_BYTES


def read_text(path: str, flag: str, value: str) -> str:
    """The text of the file a flag names; unreadable or not text: ConfigError naming the flag."""
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ConfigError(flag, value, f"cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(flag, value, "not a text file") from None


def json_object(text: str, flag: str, value: str) -> dict:
    """The JSON object (a bootstrap.json) a flag's file holds; anything else: ConfigError."""
    try:
        obj = json.loads(text)
    except ValueError as exc:
        where = f" ({exc.msg}, line {exc.lineno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise ConfigError(flag, value, f"not valid JSON{where}: give a bootstrap.json or a plain file") from None
    if not isinstance(obj, dict):
        raise ConfigError(flag, value, "that JSON is not an object: give a bootstrap.json")
    return obj


def read_tracker_key(value: str | None, token_arg: str | None = None) -> bytes | None:
    """--tracker-key's value (hex, or @bootstrap.json), else the "tracker_key" of the bootstrap.json
    that `--token @FILE` names; None when neither gives one."""
    where = "--tracker-key"
    if not value and token_arg and token_arg.startswith("@"):
        value, where = token_arg, "--token"
    if not value:
        return None
    text = value
    if value.startswith("@"):
        text = read_text(value[1:], where, value).strip()
        if not text.startswith("{"):
            return None if where == "--token" else _hex_key(text, where, value)
        key = json_object(text, where, value).get("tracker_key")
        if not key:
            if where == "--token":
                return None
            raise ConfigError(where, value, 'that JSON has no "tracker_key" (a bootstrap.json of an older version?)')
        text = key
    return _hex_key(text, where, value)


def _hex_key(text: str, where: str, value: str) -> bytes:
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise ConfigError(
            where, value, f'a tracker key is {KEY_BYTES} bytes in hex (the "tracker_key" of bootstrap.json)'
        )
    return key
