"""The environment a command reads, checked before any heavy import.

A bad value (`ANCHORMESH_THREADS=abc`, `ANCHORMESH_LOG_FORMAT=xml`) is a ConfigError naming the
variable and what it may hold: the entry point answers it in one line with exit code 2, before
torch or hivemind load, instead of a traceback minutes into a start.
"""

from __future__ import annotations

import argparse
import os

from peer.errors import ConfigError

THREADS_ENV = "ANCHORMESH_THREADS"
LOGGING_COMMANDS = ("bootstrap", "peer", "export", "demo")  # the commands that set up logging (peer/logs.py)


def env_int(name: str, default: int, minimum: int) -> int:
    """An integer environment variable; unset or empty gives `default`."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(name, raw, f"must be a whole number >= {minimum}") from None
    if value < minimum:
        raise ConfigError(name, raw, f"must be a whole number >= {minimum}")
    return value


def apply_environment(args: argparse.Namespace) -> None:
    """Fill the defaults that come from parsed environment variables and check the logging ones."""
    if getattr(args, "command", None) == "peer" and args.threads is None:
        args.threads = env_int(THREADS_ENV, 1, 1)
    if getattr(args, "command", None) in LOGGING_COMMANDS:
        from peer.logs import log_settings

        log_settings()
