"""Log setup for the long-running commands (bootstrap, peer, export).

Text by default (`TIME LEVEL LOGGER: message`); `ANCHORMESH_LOG_FORMAT=json` gives one JSON object
per line (`time`, `level`, `logger`, `message`, and `error` with the traceback), for log shippers
and `jq`. hivemind's lines go through the same handler, in the same format. `ANCHORMESH_LOG_LEVEL`
(DEBUG, INFO, WARNING, ERROR) sets the threshold. Environment variables rather than flags: they
reach every process the same way, Docker and the demo included.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from peer.errors import ConfigError

FORMAT_ENV, LEVEL_ENV = "ANCHORMESH_LOG_FORMAT", "ANCHORMESH_LOG_LEVEL"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# by number: hivemind renames WARNING to "WARN" process-wide (logging.addLevelName)
_NAMES = {
    logging.DEBUG: "DEBUG",
    logging.INFO: "INFO",
    logging.WARNING: "WARNING",
    logging.ERROR: "ERROR",
    logging.CRITICAL: "CRITICAL",
}


class JsonFormatter(logging.Formatter):
    """One JSON object per record; the UTC time in ISO 8601 with milliseconds."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": _NAMES.get(record.levelno, record.levelname),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out)


def log_settings() -> tuple[str, str]:
    """The log format and level from the environment; a bad value is a ConfigError naming it.
    Light: the entry point calls it before any heavy import."""
    fmt = os.environ.get(FORMAT_ENV, "text").lower()
    level = os.environ.get(LEVEL_ENV, "INFO").upper()
    if fmt not in ("text", "json"):
        raise ConfigError(FORMAT_ENV, fmt, "must be text or json")
    if level not in LEVELS:
        raise ConfigError(LEVEL_ENV, level, f"must be one of {', '.join(LEVELS)}")
    return fmt, level


def route_hivemind() -> None:
    """hivemind's loggers drop their own handler and format and reach the root logger, so their
    lines come out in ours (JSON with ANCHORMESH_LOG_FORMAT=json) at our level. Only where the
    process has imported hivemind: importing it here would cost a client seconds."""
    if "hivemind" in sys.modules:
        from hivemind.utils.logging import use_hivemind_log_handler

        use_hivemind_log_handler("nowhere")


def setup_logging() -> None:
    """Configure the root logger from the environment (hivemind's loggers included)."""
    fmt, level = log_settings()
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler._anchormesh = True  # type: ignore[attr-defined]
    root = logging.getLogger()
    for h in list(root.handlers):  # a second call replaces our handler; others (pytest's) stay
        if getattr(h, "_anchormesh", False):
            root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
    route_hivemind()
