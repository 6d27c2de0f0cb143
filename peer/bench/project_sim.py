"""The event simulation of the swarm's schedule for `bench project`: K stages x R peers, each a
serial worker, each host's upload and download a shaped FIFO link. Why a simulation and not the
perfect-overlap bound: see peer/bench/project.py's docstring."""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass


@dataclass
class Tasks:
    """Per stage, per micro-batch: busy seconds of each task and wire bytes of each message."""

    fwd: list[float]  # stage 0: inject; middle: forward; last: forward + loss + backward
    bwd: list[float]  # stages < K-1: backward (the last stage's is inside fwd)
    step: list[float]  # optimizer step
    act_wire: list[float]  # stage s -> s+1, per micro-batch (amortised basis included)
    grad_wire: list[float]  # stage s+1 -> s
    act_ack: list[float]  # ACK bytes the activation's receiver sends back
    grad_ack: list[float]

    def pp_wire_per_step(self, replicas: int, micro_batches: int) -> float:
        """Pipeline bytes on the wire per step, all links and peers: both directions and their ACKs."""
        return (
            micro_batches
            * replicas
            * len(self.act_wire)
            * (self.act_wire[0] + self.grad_wire[0] + self.act_ack[0] + self.grad_ack[0])
        )


@dataclass
class Schedule:
    step_s: float  # mean seconds between optimizer steps of a stage-0 peer
    tokens_per_s: float


class _Link:
    """One shaped direction of one host's access link (a tbf bucket of `burst` bytes)."""

    def __init__(self, burst: float) -> None:
        self.free_at = 0.0
        self.tokens = burst
        self.at = 0.0

    def credit(self, now: float, rate: float, burst: float) -> float:
        return min(burst, self.tokens + (now - self.at) * rate)


def simulate(
    tasks: Tasks,
    stages: int,
    replicas: int,
    micro_batches: int,
    tokens_per_mb: int,
    rate_bytes_s: float | None,
    burst_bytes: float = 0.0,
    shared_cores: float | None = None,
    queue_s: float = 0.0,
    steps: int | None = None,
    seed: int = 0,
    sync_s: list[float] | None = None,
    staleness: int = 0,
) -> Schedule:
    """Event simulation of the swarm's schedule (module docstring); tokens/s of all stage-0 peers.

    Each peer is a serial worker: a step when M micro-batches are done, else the oldest backward,
    else a forward (stage 0: inject while the micro-batch's step is at most `staleness` ahead of
    the steps it applied and it has fewer than M * (staleness + 1) in flight, as the app does).
    Messages go to a next-stage peer drawn uniformly (the app draws by capacity, equal here),
    gradients back to the sender. A transfer holds the sender's upload and the
    receiver's download. With `shared_cores`, the running tasks share that many cores equally
    (the bed: the cores this machine has, less what other processes took meanwhile).

    `queue_s` (a drop-tail queue of that many seconds at the link rate, e.g. tbf's latency +
    burst / rate): a message that has another one queued behind it on the same connection is
    delivered that much later (at most until the next one ends). Why: with more data to send,
    TCP fills the queue and loses segments, and their retransmissions wait behind the full
    queue, so the receiver gets the message's last bytes about one queue later; the last
    message of a burst finds the queue draining and is on time (a plain TCP probe on the bed
    shows this).

    `sync_s` (per stage, seconds): the synchronous baseline (`dense_sync`). A peer steps only
    once every replica of its stage has its step's gradients, and the step then takes
    `sync_s[s]` more (the gradient all-reduce, on links the flushed pipeline leaves idle); stage 0
    starts a step only when every peer of every stage has applied the previous one (GPipe's
    flush)."""
    K, R, M = stages, replicas, micro_batches
    steps = steps or (8 if R == 1 else 30)
    warm = 2 if R == 1 else 6
    rng = random.Random(seed)
    peers = [(s, i) for s in range(K) for i in range(R)]
    version = {p: 0 for p in peers}
    done = {p: 0 for p in peers}
    next_mb = {p: 0 for p in peers}
    inflight = {p: 0 for p in peers}
    fwd_q: dict = {p: deque() for p in peers}
    bwd_q: dict = {p: deque() for p in peers}
    running: dict = {}  # peer -> [remaining work, kind, payload]
    up = {p: _Link(burst_bytes) for p in peers}
    down = {p: _Link(burst_bytes) for p in peers}
    pending: deque = deque()  # transfers waiting for both ends: (src, dst, bytes, ack_bytes, kind, payload)
    events: list = []  # (time, seq, dst, kind, payload) arrivals
    on_link: dict = {}  # (src, dst) -> [end time, arrival event] of the transfer in progress
    cancelled: set = set()  # seq numbers of arrivals that were moved
    seq = 0
    now = 0.0
    step_times: dict = {i: [] for i in range(R)}

    def pick(p) -> tuple[float, str, object] | None:
        s, _ = p
        if done[p] >= M:
            if sync_s is None:
                return tasks.step[s], "step", None
            if all(
                done[(s, j)] >= M or version[(s, j)] > version[p] for j in range(R)
            ):  # the all-reduce waits for the whole group
                return tasks.step[s] + sync_s[s], "step", None
            return None
        if bwd_q[p]:
            return tasks.bwd[s], "bwd", bwd_q[p].popleft()
        if s > 0 and fwd_q[p]:
            return tasks.fwd[s], "fwd", fwd_q[p].popleft()
        if (
            s == 0
            and next_mb[p] // M - version[p] <= staleness
            and inflight[p] < M * (staleness + 1)
            and (sync_s is None or min(version.values()) >= version[p])
        ):
            return tasks.fwd[0], "inject", None
        return None

    def send(src, dst, nbytes: float, kind: str, payload) -> None:
        nonlocal seq
        if rate_bytes_s is None:
            heapq.heappush(events, (now, seq, dst, kind, payload))
            seq += 1
            return
        busy = on_link.get((src, dst))
        if (
            queue_s and busy is not None and busy[0] > now and not busy[2]
        ):  # queued behind a transfer in progress: it arrives late
            end, event, _ = busy
            cancelled.add(event[1])
            moved = (end + min(queue_s, nbytes / rate_bytes_s), seq, *event[2:])
            seq += 1
            heapq.heappush(events, moved)
            busy[2] = True
        pending.append((src, dst, nbytes, kind, payload))

    def start_transfers() -> None:
        nonlocal seq
        waiting = len(pending)
        for _ in range(waiting):
            src, dst, nbytes, kind, payload = pending.popleft()
            a, b = up[src], down[dst]
            if a.free_at > now or b.free_at > now:
                pending.append((src, dst, nbytes, kind, payload))
                continue
            ca, cb = a.credit(now, rate_bytes_s, burst_bytes), b.credit(now, rate_bytes_s, burst_bytes)
            d = max(nbytes - min(ca, cb), 0.0) / rate_bytes_s
            for link, c in ((a, ca), (b, cb)):
                link.tokens = max(min(burst_bytes, c + d * rate_bytes_s) - nbytes, 0.0)
                link.at = now + d
                link.free_at = now + d
            event = (now + d, seq, dst, kind, payload)
            heapq.heappush(events, event)
            on_link[(src, dst)] = [now + d, event, False]
            seq += 1

    def hop(i: int) -> int:
        """The next-stage replica: any (uniform) in the swarm; the same replica in the
        synchronous baseline, whose R pipelines are fixed chains (DP across them)."""
        return i if sync_s is not None else rng.randrange(R)

    def finish(p, kind: str, payload) -> None:
        s, i = p
        if kind == "step":
            version[p] += 1
            done[p] = 0
            if s == 0:
                step_times[i].append(now)
        elif kind == "inject":
            next_mb[p] += 1
            inflight[p] += 1
            send(p, (1, hop(i)), tasks.act_wire[0], "act", (p,))
        elif kind == "fwd" and s < K - 1:
            send(p, (s + 1, hop(i)), tasks.act_wire[s], "act", payload + (p,))
        elif kind == "fwd":  # last stage: forward + loss + backward
            done[p] += 1
            send(p, payload[-1], tasks.grad_wire[s - 1], "grad", payload[:-1])
        elif kind == "bwd":
            done[p] += 1
            if s == 0:
                inflight[p] -= 1
            else:
                send(p, payload[-1], tasks.grad_wire[s - 1], "grad", payload[:-1])

    while min(len(v) for v in step_times.values()) < warm + steps:
        for p in peers:
            if p not in running:
                task = pick(p)
                if task is not None:
                    running[p] = list(task)
        if rate_bytes_s is not None:
            start_transfers()
        speed = min(1.0, shared_cores / len(running)) if shared_cores and running else 1.0
        first = min(running, key=lambda q: running[q][0]) if running else None
        t_cpu = now + running[first][0] / speed if running else math.inf
        t_evt = events[0][0] if events else math.inf
        t_link = (
            min([l.free_at for l in (*up.values(), *down.values()) if l.free_at > now], default=math.inf)
            if pending
            else math.inf
        )
        t_next = min(t_cpu, t_evt, t_link)
        if t_next == math.inf:
            raise RuntimeError("the simulated pipeline stalled (a bug in the schedule model)")
        for r in running.values():
            r[0] -= (t_next - now) * speed
        if t_next == t_cpu:  # exactly done, whatever rounding `now + remaining` suffered at large times
            running[first][0] = 0.0
        now = t_next
        for p in [p for p, r in running.items() if r[0] <= 1e-12]:
            _, kind, payload = running.pop(p)
            finish(p, kind, payload)
        while events and events[0][0] <= now:
            _, n, dst, kind, payload = heapq.heappop(events)
            if n not in cancelled:
                (fwd_q if kind == "act" else bwd_q)[dst].append(payload)
    tokens_per_s = sum(steps * M * tokens_per_mb / (t[warm + steps - 1] - t[warm - 1]) for t in step_times.values())
    return Schedule(R * M * tokens_per_mb / tokens_per_s, tokens_per_s)
