"""A shaped-network test bed: N test hosts as Linux network namespaces on one bridge.

Each host is a namespace `am<tag>h<i>` with one interface `eth0` at 198.18.<subnet>.<i+1>/24,
joined by a veth pair to a bridge in a hub namespace `am<tag>hub` (the root namespace is never
touched). A host's link is shaped both ways with `tc qdisc ... tbf`: its upload on `eth0`, its
download on the hub-side end of its veth, so every host sees the bandwidth of its own access
link, as a volunteer at home does. netem is not available here, so there is no added delay.
`set_rate(..., dp_mbit=, dp_hosts=)` splits a link in two: traffic to and from the named hosts
(a peer's stage mates: its data-parallel traffic) at a rate of its own, the rest at the link's
(an htb root sorts packets by address with u32 filters; each class's own tbf shapes them).

Processes run inside a host with `ip netns exec`; each gets its own session so it can be killed
with everything it started. `close()` (also on exit and on SIGTERM/SIGINT through the context
manager) kills them by pid and deletes the namespaces by name, which removes their veths too.
Byte counts come from the kernel's interface counters (`ip -s -j link`), not from the app.

Needs root and iproute2; `available()` says why not otherwise.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_instances = 0


def available() -> str:
    """'' when namespaces can be made here, else the reason."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"amprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def _run(*argv: str) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


@dataclass
class Host:
    index: int
    ns: str
    address: str
    port: str  # the hub-side veth end (its egress is this host's download)
    rate_mbit: float | None
    dp_rate_mbit: float | None = None  # the rate of the traffic to and from `dp_hosts`, if split
    dp_hosts: tuple[int, ...] = ()


class NetBed:
    """Args:
    rates_mbit: one entry per host: its link's bandwidth in Mbit/s each way, None = unshaped.
    subnet: third octet of the 198.18.<subnet>.0/24 segment (two beds at once need two).
    burst_kb: tbf bucket; small enough that the rate holds over a micro-batch.
    """

    latency_ms = 50  # tbf's queue bound: a full queue drains in this long at the rate

    def __init__(self, rates_mbit: list[float | None], subnet: int = 0, burst_kb: int = 32) -> None:
        global _instances
        _instances += 1
        self.tag = f"{os.getpid() % 100000}{_instances}"
        self.hub = f"am{self.tag}hub"
        self.burst_kb = burst_kb
        self.hosts = [
            Host(i, f"am{self.tag}h{i}", f"198.18.{subnet}.{i + 1}", f"am{self.tag}p{i}", r)
            for i, r in enumerate(rates_mbit)
        ]
        self.procs: list[subprocess.Popen] = []
        self._up = False

    # -- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> NetBed:
        self._old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        for s in self._old:
            signal.signal(s, self._on_signal)
        try:
            self.up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        for s, handler in self._old.items():
            signal.signal(s, handler)

    def _on_signal(self, signum: int, frame) -> None:
        self.close()
        raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)

    def up(self) -> None:
        """Create the hub, the hosts and their shaped links."""
        atexit.register(self.close)
        self._up = True
        _run("ip", "netns", "add", self.hub)
        self._ns(self.hub, "ip", "link", "add", "br0", "type", "bridge")
        self._ns(self.hub, "ip", "link", "set", "br0", "up")
        for h in self.hosts:
            _run("ip", "netns", "add", h.ns)
            inner = f"am{self.tag}v{h.index}"
            _run("ip", "link", "add", inner, "type", "veth", "peer", "name", h.port)
            _run("ip", "link", "set", inner, "netns", h.ns)
            _run("ip", "link", "set", h.port, "netns", self.hub)
            self._ns(h.ns, "ip", "link", "set", inner, "name", "eth0")
            self._ns(h.ns, "ip", "addr", "add", f"{h.address}/24", "dev", "eth0")
            self._ns(h.ns, "ip", "link", "set", "eth0", "up")
            self._ns(h.ns, "ip", "link", "set", "lo", "up")
            self._ns(self.hub, "ip", "link", "set", h.port, "master", "br0")
            self._ns(self.hub, "ip", "link", "set", h.port, "up")
            self.set_rate(h.index, h.rate_mbit)

    def close(self) -> None:
        """Kill every process started here (by pid, with its session) and delete the namespaces."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        self.procs.clear()
        if self._up:
            for ns in [h.ns for h in self.hosts] + [self.hub]:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            self._up = False
        atexit.unregister(self.close)

    # -- links --------------------------------------------------------------------------------
    def _ns(self, ns: str, *argv: str) -> str:
        return _run("ip", "netns", "exec", ns, *argv)

    def set_rate(
        self, index: int, rate_mbit: float | None, dp_mbit: float | None = None, dp_hosts: Sequence[int] = ()
    ) -> None:
        """(Re)shape host `index`'s link both ways; None removes the shaping. With `dp_mbit` and
        `dp_hosts`: the traffic to and from those hosts at `dp_mbit`, the rest at `rate_mbit`
        (`_split`); without, one tbf at `rate_mbit`."""
        h = self.hosts[index]
        others = tuple(i for i in dp_hosts if i != index) if dp_mbit is not None else ()
        if others and (rate_mbit is None or not dp_mbit > 0):
            raise ValueError(f"a DP class needs a link rate and a DP rate > 0 (got {rate_mbit}, {dp_mbit})")
        h.rate_mbit, h.dp_rate_mbit, h.dp_hosts = rate_mbit, dp_mbit if others else None, others
        # upload: packets to a mate (ip dst) on the host's eth0; download: packets from one (ip src) on its port
        for ns, dev, field in ((h.ns, "eth0", "dst"), (self.hub, h.port, "src")):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
            if rate_mbit is None:
                continue
            if others:
                self._split(ns, dev, rate_mbit, dp_mbit, field, [self.hosts[i].address for i in others])
            else:
                self._ns(ns, "tc", "qdisc", "add", "dev", dev, "root", *self._tbf(rate_mbit))

    def _tbf(self, rate_mbit: float) -> list[str]:
        """A tbf qdisc's arguments: latency bounds the queue (a full queue at the rate drains in
        latency_ms); tbf also splits a segmentation-offload packet larger than its bucket."""
        return ["tbf", "rate", f"{rate_mbit}mbit", "burst", f"{self.burst_kb}kb", "latency", f"{self.latency_ms}ms"]

    def _split(self, ns: str, dev: str, rate_mbit: float, dp_mbit: float, field: str, addresses: list[str]) -> None:
        """An htb root on `dev`: class 1:10 (the default) at `rate_mbit`, class 1:20 at `dp_mbit`,
        both root classes (neither borrows from the other), each with a tbf of its rate as its
        queue, so each class behaves as the bed's single tbf does (bucket, bounded queue); u32
        filters send IPv4 packets whose `field` (dst or src) is one of `addresses` to 1:20."""
        self._ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
        for minor, mbit in (("10", rate_mbit), ("20", dp_mbit)):
            bits = f"{round(mbit * 1e6)}bit"
            burst = f"{self.burst_kb}kb"
            self._ns(
                ns,
                *("tc", "class", "add", "dev", dev, "parent", "1:", "classid", f"1:{minor}", "htb"),
                *("rate", bits, "ceil", bits, "burst", burst, "cburst", burst, "quantum", "1514"),
            )
            self._ns(
                ns, "tc", "qdisc", "add", "dev", dev, "parent", f"1:{minor}", "handle", f"{minor}:", *self._tbf(mbit)
            )
        for address in addresses:
            self._ns(
                ns,
                *("tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1"),
                *("u32", "match", "ip", field, f"{address}/32", "flowid", "1:20"),
            )

    def counters(self) -> dict[int, tuple[int, int]]:
        """Per host: (bytes sent, bytes received) on its eth0 since the bed came up."""
        out = {}
        for h in self.hosts:
            link = json.loads(self._ns(h.ns, "ip", "-s", "-j", "link", "show", "eth0"))[0]["stats64"]
            out[h.index] = (int(link["tx"]["bytes"]), int(link["rx"]["bytes"]))
        return out

    # -- processes ----------------------------------------------------------------------------
    def popen(self, index: int, argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start `argv` inside host `index` (own session, output to `log`)."""
        full_env = {**os.environ, **(env or {})}
        p = subprocess.Popen(
            ["ip", "netns", "exec", self.hosts[index].ns, *argv],
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )
        self.procs.append(p)
        return p
