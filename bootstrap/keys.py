"""The run's secrets, kept in the bootstrap's state dir so a restarted bootstrap keeps them.

`STATE_DIR/auth.json` (mode 0600) holds the run token (handed to volunteers), the operator key
(never leaves the operator's machine; `anchormesh ban` uses it) and the tracker's identity key
(it signs peers' certificates: a new key would invalidate every certificate of a running swarm).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from peer.atomic import write_atomic
from peer.errors import ConfigError
from peer.security.auth import new_secret
from peer.security.identity import Identity

FILE = "auth.json"
MIN_TOKEN_CHARS = 16


@dataclass
class RunSecrets:
    token: str
    operator: str
    tracker: Identity


def check_token(token: str, field: str = "--token") -> None:
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            field, "<hidden>", f"a run token needs at least {MIN_TOKEN_CHARS} characters (it is the run's password)"
        )
    if token.startswith("-") or token != token.strip():
        raise ConfigError(
            field,
            "<hidden>",
            "a run token must not start with '-' or with or end in spaces (peers pass it on the command line)",
        )


def load_or_create(state_dir: Path, token: str | None = None) -> RunSecrets:
    """The secrets in `state_dir`, made on first use. A given `token` replaces the stored one (how
    an operator rotates it: peers already in keep their certificates, new joiners need the new token)."""
    path = state_dir / FILE
    data: dict = {}
    if path.exists():
        try:
            data = json.loads(path.read_text())
            tracker = Identity.from_bytes(bytes.fromhex(data["tracker_key"]), str(path))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                "--state-dir", str(state_dir), f"{path} is damaged ({exc}); restore it, or pass --new-run"
            ) from None
    else:
        tracker = Identity.generate()
    if token is not None:
        check_token(token)
    secrets = RunSecrets(token or data.get("token") or new_secret(), data.get("operator") or new_secret(), tracker)
    new = {"token": secrets.token, "operator": secrets.operator, "tracker_key": tracker.private_bytes().hex()}
    if new != data:
        state_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(new).encode(), mode=0o600)
    return secrets


def forget(state_dir: Path) -> None:
    """--new-run: a new run gets new secrets (the old run's certificates must not admit anyone)."""
    (state_dir / FILE).unlink(missing_ok=True)
