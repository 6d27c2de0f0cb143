"""A real swarm inside a NetBed: the bootstrap on host 0, one peer per further host.

The controller (this process) stays in the root namespace and cannot reach 198.18.x directly,
so it reads the run's status from an `anchormesh status --watch --json` process running on host
0 (one JSON line a second), instead of starting a Python per query.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from peer.bench.netbed import NetBed

PEER_PREFIX = "bed-peer"  # a bed peer's id: the prefix and its host's index


def host_of(peer_id: str) -> int | None:
    """The bed host a peer runs on, from its id (`bed-peerN` on host N); None for another id."""
    return int(peer_id.removeprefix(PEER_PREFIX)) if peer_id.startswith(PEER_PREFIX) else None


def write_toml(data: dict, path: Path) -> None:
    """A run.toml from {section: {key: scalar or sub-table}} and top-level scalars; a "mask" entry
    (MaskConfig's fields, as the benches build them) becomes the run.toml's `[codec]` table."""
    from peer.runtoml import codec_table

    if "mask" in data:
        data = {**{k: v for k, v in data.items() if k != "mask"}, "codec": codec_table(data["mask"])}

    def val(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        return json.dumps(v)  # numbers and strings: the same spelling in TOML

    def table(name: str, values: dict) -> list[str]:
        out = [f"[{name}]", *(f"{k} = {val(v)}" for k, v in values.items() if not isinstance(v, dict)), ""]
        for k, v in values.items():
            if isinstance(v, dict):
                out += table(f"{name}.{k}", v)
        return out

    top = [f"{k} = {val(v)}" for k, v in data.items() if not isinstance(v, dict)]
    sections = [line for k, v in data.items() if isinstance(v, dict) for line in table(k, v)]
    path.write_text("\n".join(top) + "\n\n" + "\n".join(sections) + "\n")


class BedSwarm:
    """Args:
    bed: a NetBed that is up, with 1 + peers hosts.
    config: run.toml path (None: the default run).
    workdir: logs and state go here.
    threads: torch threads per peer (many peers share few cores).
    plaintext: every process with --insecure-plaintext (no TLS although the bed's addresses are
        off loopback): only to measure what TLS costs, never a run's setting.
    """

    def __init__(
        self, bed: NetBed, config: Path | None, workdir: Path, threads: int = 1, plaintext: bool = False
    ) -> None:
        self.bed, self.workdir = bed, workdir
        workdir.mkdir(parents=True, exist_ok=True)
        py = [sys.executable, "-m", "peer.cli"]
        env = {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        boot = bed.hosts[0]
        state = workdir / "bootstrap"
        args = (
            ["bootstrap", "--host", boot.address, "--state-dir", str(state)]
            + (["--config", str(config)] if config else [])
            + (["--insecure-plaintext"] if plaintext else [])
        )
        self.bootstrap = bed.popen(0, py + args, workdir / "bootstrap.log", env)
        info_path = state / "bootstrap.json"
        self._wait(
            lambda: info_path.exists(),
            60,
            "the bootstrap to write bootstrap.json",
            self.bootstrap,
            workdir / "bootstrap.log",
        )
        self.info = json.loads(info_path.read_text())
        self.peers = []
        for h in bed.hosts[1:]:
            log = workdir / f"peer{h.index}.log"
            argv = py + [
                "peer",
                "--initial-peers",
                self.info["dht_maddrs"][0],
                "--host",
                h.address,
                "--state-dir",
                str(workdir / f"peer{h.index}"),
            ]
            self.peers.append(
                bed.popen(
                    h.index,
                    argv,
                    log,
                    {
                        **env,
                        "ANCHORMESH_PEER_ID": f"{PEER_PREFIX}{h.index}",
                        "ANCHORMESH_TOKEN": self.info["token"],
                        "ANCHORMESH_TRACKER_KEY": self.info["tracker_key"],
                        **({"ANCHORMESH_INSECURE_PLAINTEXT": "1"} if plaintext else {}),
                    },
                )
            )
        self.latest: dict | None = None
        self._watch_log = workdir / "status.jsonl"
        self._watcher = bed.popen(
            0,
            py
            + ["status", "--tracker", self.info["tracker"], "--token", f"@{info_path}", "--json", "--watch"]
            + (["--insecure-plaintext"] if plaintext else []),
            self._watch_log,
            env,
        )
        self._reader = threading.Thread(target=self._follow, daemon=True)
        self._reader.start()

    def _follow(self) -> None:
        """Keep `latest` = the newest status line the watcher printed."""
        offset = 0
        while self._watcher.poll() is None or offset < self._watch_log.stat().st_size:
            with open(self._watch_log) as f:
                f.seek(offset)
                chunk = f.read()
            lines = chunk.split("\n")
            complete, rest = lines[:-1], lines[-1]
            offset += len(chunk) - len(rest)
            for line in complete:
                if line.startswith("{"):
                    self.latest = json.loads(line)
            time.sleep(0.2)

    @staticmethod
    def _wait(
        cond: Callable[[], bool],
        timeout_s: float,
        what: str,
        proc: subprocess.Popen | None = None,
        log: Path | None = None,
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(
                    f"waiting for {what}: the process exited ({proc.returncode}); its log:\n{log.read_text()[-3000:] if log else ''}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s:.0f}s for {what}; logs in {Path(log).parent if log else '?'}")
            time.sleep(0.2)

    def wait_status(self, cond: Callable[[dict], bool], timeout_s: float, what: str) -> dict:
        """The first status (newer than now) for which `cond` holds; TimeoutError naming `what`."""
        dead = [p for p in [self.bootstrap, *self.peers] if p.poll() is not None]
        if dead:
            raise RuntimeError(f"waiting for {what}: {len(dead)} swarm process(es) exited; logs in {self.workdir}")
        self._wait(
            lambda: self.latest is not None and cond(self.latest),
            timeout_s,
            what,
            self.bootstrap,
            self.workdir / "bootstrap.log",
        )
        return self.latest
