"""The tracker's run state on disk, so a killed bootstrap comes back to the same run.

`STATE_DIR/tracker.json` holds the run id, its config, the roster (every peer record, with its
step and token counts), the anchor and evaluation cadences, the stage-move count, the run's
uptime, the ports it served on and the data order (bootstrap/data_order.py: epoch, position,
the work each stage-0 peer holds). The bootstrap rewrites it every `SAVE_EVERY_S` and when it
stops (temp file, fsync, rename: a kill mid-write leaves the previous copy), and before the
tracker answers a heartbeat that changed the data order: work handed out or released is on disk
before the peer can train it, so a restarted tracker never hands out a window twice. On restart the
tracker is rebuilt from it: the run keeps its id and step numbering, and each peer that was live
gets a fresh heartbeat deadline, so peers whose heartbeat streams reconnect carry on as if
nothing happened, and those that are gone expire as usual.

Times are stored as ages (seconds before the save) because the tracker's clock is monotonic,
which means nothing in another process.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, fields
from pathlib import Path

from bootstrap.data_order import DataOrder
from bootstrap.roster import LIVE, PeerRecord
from bootstrap.tracker import Tracker
from peer.atomic import write_atomic
from peer.build import build
from peer.errors import ConfigError
from peer.runtoml import config_from_dict

log = logging.getLogger("anchormesh.bootstrap")
FORMAT = 1
FILE = "tracker.json"
SAVE_EVERY_S = 2.0
# after a restart no peer is declared dead for this long: a peer's gRPC channel may be in its
# reconnect backoff (peers cap it with TRACKER_CHANNEL_OPTIONS, peer/daemon/membership.py)
RECONNECT_GRACE_S = 15.0
MAX_DOWN_S = 86400.0  # a wrong wall clock cannot open the report bounds wider than a day of training


def snapshot(tracker: Tracker, ports: dict[str, int]) -> dict:
    """What `restore` needs, taken under the tracker's lock (a consistent roster)."""
    with tracker._lock:
        now = tracker.clock()
        peers = []
        for p in tracker.peers.values():
            rec = asdict(p)
            rec["last_seen_age_s"], rec["joined_age_s"] = now - rec.pop("last_seen"), now - rec.pop("joined_at")
            accepted = rec.pop("accepted_at")
            rec["accepted_age_s"] = now - accepted if accepted else None
            rec["dht_maddrs"] = list(p.dht_maddrs)
            peers.append(rec)
        return {
            "format": FORMAT,
            "code_version": build(),
            "run_id": tracker.run_id,
            "config": asdict(tracker.config),
            "uptime_s": now - tracker.started,
            "saved_at_unix": time.time(),  # the wall clock: a restore counts the time the tracker was down
            "moves": tracker.moves,
            "anchors": {
                "next_at": tracker.anchors.next_at,
                "launched": tracker.anchors.launched,
                "launched_at": tracker.anchors.launched_at,
            },
            "evals": {
                "next_at": tracker.evals.next_at,
                "launched": tracker.evals.launched,
                "launched_at": tracker.evals.launched_at,
            },
            "ports": ports,
            "peers": peers,
            "banned": dict(tracker.banned),
            "data": tracker.data.to_dict() if tracker.data is not None else None,
        }


def save(state_dir: Path, data: dict) -> None:
    """Atomic write of `tracker.json` (temp file, fsync, rename)."""
    write_atomic(state_dir / FILE, json.dumps(data).encode())


def load(state_dir: Path) -> dict | None:
    """The saved state, or None when there is none; ConfigError naming the file when it is unreadable."""
    path = state_dir / FILE
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if (
            data.get("format") != FORMAT
            or not isinstance(data.get("run_id"), str)
            or not isinstance(data.get("peers"), list)
        ):
            raise ValueError(f"not a format-{FORMAT} tracker state")
    except (OSError, ValueError) as exc:
        raise ConfigError(
            "--state-dir",
            str(state_dir),
            f"{FILE} is unreadable ({exc}); move it away, or pass --new-run to start a new run there",
        ) from None
    return data


def restore(data: dict, **tracker_kwargs) -> Tracker:
    """A Tracker that continues the saved run. Live peers get a fresh heartbeat deadline (they
    reconnect within a heartbeat or two); dead and departed ones stay in the roster as they were."""
    try:
        config = config_from_dict(data["config"])
    except ConfigError as exc:
        raise ConfigError(
            "--state-dir", FILE, f"its run config no longer loads ({exc}); pass --new-run to start a new run"
        ) from None
    tracker = Tracker(data["run_id"], config, **tracker_kwargs)
    now = tracker.clock()
    tracker.started = now - float(data.get("uptime_s", 0.0))
    down_s = min(max(time.time() - float(data.get("saved_at_unix", time.time())), 0.0), MAX_DOWN_S)
    tracker.moves = int(data.get("moves", 0))
    tracker.banned.update({str(k): str(v) for k, v in (data.get("banned") or {}).items()})
    if data.get("data"):
        tracker.data = DataOrder.from_dict(data["data"])
    for name in ("anchors", "evals"):
        cad, saved = getattr(tracker, name), data.get(name) or {}
        cad.next_at, cad.launched = int(saved.get("next_at", cad.next_at)), int(saved.get("launched", 0))
        cad.launched_at = {int(k): int(v) for k, v in (saved.get("launched_at") or {}).items()}
    known = {f.name for f in fields(PeerRecord)}
    for rec in data["peers"]:
        rec = dict(rec)
        last_seen_age, joined_age = float(rec.pop("last_seen_age_s", 0.0)), float(rec.pop("joined_age_s", 0.0))
        p = PeerRecord(**{k: v for k, v in rec.items() if k in known})
        p.dht_maddrs = tuple(p.dht_maddrs)
        p.joined_at = now - joined_age
        p.last_seen = now if p.state in LIVE else now - last_seen_age
        # peers trained on while the tracker was down: their next step is bounded from their last
        # report taken as true, down time included (else it is refused as too far ahead)
        accepted_age = rec.get("accepted_age_s")
        p.accepted_at = now - (float(accepted_age) if accepted_age is not None else joined_age) - down_s
        tracker.peers[p.peer_id] = p
    tracker.expire_after = now + RECONNECT_GRACE_S
    live = sum(1 for p in tracker.peers.values() if p.state in LIVE)
    log.info(
        "resumed run %s at step %d: %d peers in the roster, %d were live (they have %.0fs to reconnect)",
        tracker.run_id,
        tracker._run_step(),
        len(tracker.peers),
        live,
        RECONNECT_GRACE_S + tracker.peer_timeout_s,
    )
    return tracker


class StateSaver:
    """Writes tracker.json. `commit` (before a heartbeat reply) writes only when the data order
    changed since the last write; concurrent callers wait for one write that covers them all."""

    def __init__(self, tracker: Tracker, state_dir: Path, ports: dict[str, int]) -> None:
        self.tracker, self.state_dir, self.ports = tracker, state_dir, ports
        self._lock = threading.Lock()
        self.saved = -1

    def save(self, only_if_changed: bool = False) -> None:
        with self._lock:
            data = self.tracker.data
            if only_if_changed and (data is None or data.version == self.saved):
                return  # another caller's write covered this change
            snap = snapshot(self.tracker, self.ports)
            save(self.state_dir, snap)
            self.saved = snap["data"]["version"] if snap["data"] else 0

    def commit(self) -> None:
        try:
            self.save(only_if_changed=True)
        except OSError as exc:
            log.error("cannot save the tracker state in %s: %s", self.state_dir, exc)
