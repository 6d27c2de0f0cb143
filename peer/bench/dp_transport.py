"""Which transport should carry data-parallel averaging inside a stage group: hivemind or gRPC?

The project's issue asks to "measure and pick one transport, not both" for DP inside a stage
group. The swarm uses hivemind's DecentralizedAverager (peer/dp/group.py, GroupAverager); the
pipeline itself already speaks gRPC. This benchmark measures, between 2 peers on loopback, one
averaging round of the parameters of one pipeline stage done two ways:

* hivemind: DecentralizedAverager all-reduce configured as GroupAverager configures it
  (Float16Compression, min_group_size=2, target_group_size=None, request_timeout=1.0,
  min_matchmaking_time=2.0), then with a shorter min_matchmaking_time (0.5, request_timeout 0.4)
  to show what matchmaking costs, and with target_group_size=2 (the group size known in advance,
  so the leader may start the all-reduce as soon as the group is full). Each peer is its own
  process with its own hivemind.DHT; the second DHT bootstraps from the first's visible
  multiaddrs. Every case gets fresh peer processes and DHTs (a second averager on a DHT whose
  first averager was shut down hung in hivemind 1.1.12 here). Matchmaking and all-reduce time
  are split by polling the round's StepControl stage (LOOKING_FOR_GROUP -> RUNNING_ALLREDUCE).
* grpc / grpc-stream: the least any gRPC all-reduce of 2 peers has to do. Each peer runs a
  server with a generic raw-bytes handler; per round each peer sends its whole parameter vector
  as fp16 bytes to the other (one unary call, or one client-streaming call of 1 MiB chunks),
  waits for the other's bytes, and averages the two fp16 copies. Timed: flattening, fp32->fp16
  serialization, the exchange, deserialization and the mean. No group protocol, no failures.

Both rounds start together: the parent sends "round i" to both peer processes over their stdin
and waits for both replies (the round's wall time is the slower peer's). Warm-up rounds are
dropped. Bytes per round per peer are given twice: the fp16 payload computed from the tensor
sizes (2 bytes/float in both transports; for 2 peers hivemind sends half to reduce and half of
averaged deltas back, the same 2*N bytes), and what the peer's processes' loopback TCP sockets
acknowledged (`ss -tin` bytes_acked summed over the peer's process tree: payload plus protobuf,
HTTP/2 or libp2p framing and encryption, and for hivemind the DHT traffic of matchmaking; no
TCP/IP headers). Every round checks the result against the true fp32 mean of both peers' inputs
and counts rounds reported done whose result is not that mean (hivemind keeps a peer's local
values for parts whose reducer failed and still returns success, logging "received N% results").

Run: `python -m peer.bench.dp_transport --json OUT [--rounds N]`. Every process the benchmark
starts (peer processes, their hivemind DHT/averager children and p2pd daemons) is tracked by pid
and ended at exit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

SERVICE = "anchormesh.bench.DPExchange"
STREAM_CHUNK_BYTES = 1 << 20
# (min_matchmaking_time, target_group_size): GroupAverager's settings when this was measured (it
# uses 1.0 / 0.8 s since its rounds start at shared slots), a shorter matchmaking, and
# GroupAverager's settings with the group size known in advance (the leader may start once it is full)
HIVEMIND_CASES: tuple[tuple[float, int | None], ...] = ((2.0, None), (0.5, None), (2.0, 2))
GROUP_AVERAGER_REQUEST_TIMEOUT = 1.0
STEP_TIMEOUT_S = 60.0  # a round's bound, as GroupAverager's `timeout` (hivemind applies it to matchmaking)
HUNG_AFTER_S = 90.0  # the bench gives up on a round (and says so) after this
NOISE_STD = 0.05  # peer i's vector = base + NOISE_STD * noise_i: peers differ like after a few local steps
LARGE_FLOATS = 25_000_000
# fp16 rounding leaves < 1e-3 here; a part left un-averaged is off by |a - b| / 2 ~ NOISE_STD
INEXACT_ABOVE = 1e-2

Shapes = list[tuple[int, ...]]


# --------------------------------------------------------------------------------------------
# What is averaged
# --------------------------------------------------------------------------------------------

def stage_shapes_and_values(stage: int = 1) -> tuple[Shapes, torch.Tensor]:
    """Shapes and flattened fp32 values of one stage of the project's tiny default run."""
    from bootstrap.node import default_run
    from peer.model.loading import load_causal_lm
    from peer.model.stages import split_model

    cfg = default_run()
    stages = split_model(load_causal_lm(cfg.model, seed=0), cfg.model.num_stages)
    params = list(stages[stage].parameters())
    return [tuple(p.shape) for p in params], torch.cat([p.detach().reshape(-1).float() for p in params])


def scaled_shapes(shapes: Shapes, target_floats: int) -> Shapes:
    """The same tensors made wider (every dim times one factor s) to hold about `target_floats`:
    what one stage of a wider model of the same depth looks like."""
    def total(s: float) -> int:
        return sum(math.prod(max(1, round(d * s)) for d in shape) for shape in shapes)

    lo, hi = 1.0, 2.0
    while total(hi) < target_floats:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) < target_floats else (lo, mid)
    return [tuple(max(1, round(d * hi)) for d in shape) for shape in shapes]


def numel(shapes: Shapes) -> int:
    return sum(math.prod(s) for s in shapes)


def peer_vector(base: torch.Tensor, peer: int) -> torch.Tensor:
    """Peer `peer`'s flat fp32 parameters: the shared base plus seeded peer-specific noise."""
    g = torch.Generator().manual_seed(1000 + peer)
    return base + NOISE_STD * torch.randn(base.numel(), generator=g)


def true_mean(base: torch.Tensor, peers: int = 2) -> torch.Tensor:
    return torch.stack([peer_vector(base, i) for i in range(peers)]).mean(0)


def random_base(n: int, seed: int = 0) -> torch.Tensor:
    return 0.02 * torch.randn(n, generator=torch.Generator().manual_seed(seed))


def split_flat(flat: torch.Tensor, shapes: Shapes) -> list[torch.Tensor]:
    out, o = [], 0
    for s in shapes:
        n = math.prod(s)
        out.append(flat[o:o + n].reshape(s).clone())
        o += n
    return out


# --------------------------------------------------------------------------------------------
# Peer process (one per peer and transport): commands in on stdin, one JSON reply per line out
# --------------------------------------------------------------------------------------------

class _Reply:
    def __init__(self) -> None:
        self.out = sys.stdout
        sys.stdout = sys.stderr  # anything else printed goes to the log, not the protocol

    def send(self, obj: dict[str, Any]) -> None:
        self.out.write(json.dumps(obj) + "\n")
        self.out.flush()


@dataclass
class _Case:
    shapes: Shapes
    mine: torch.Tensor  # this peer's flat input
    mean: torch.Tensor  # the true fp32 mean of both peers' inputs
    params: list[torch.Tensor]  # `mine` as the stage's tensors


def _load_case(cmd: dict[str, Any], peer: int) -> _Case:
    base = torch.load(cmd["base_path"])
    shapes = [tuple(s) for s in cmd["shapes"]]
    inputs = [peer_vector(base, i) for i in range(2)]
    return _Case(shapes, inputs[peer], (inputs[0] + inputs[1]) / 2, split_flat(inputs[peer], shapes))


def _max_err(result: torch.Tensor | list[torch.Tensor], case: _Case) -> float:
    """Largest |result - true mean|; `result` flat or as the stage's tensors."""
    if isinstance(result, torch.Tensor):
        return float((result - case.mean).abs().max())
    err, o = 0.0, 0
    for t in result:
        err = max(err, float((t.reshape(-1) - case.mean[o:o + t.numel()]).abs().max()))
        o += t.numel()
    return err


def _values_out(result: torch.Tensor, cmd: dict[str, Any]) -> dict[str, Any]:
    return {"values": result.tolist()} if cmd.get("keep_values") else {}


def _hivemind_peer(peer: int, initial_peers: list[str], reply: _Reply) -> None:
    import hivemind
    from hivemind.averaging import DecentralizedAverager
    from hivemind.averaging.control import AveragingStage
    from hivemind.compression import Float16Compression

    dht = hivemind.DHT(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    averager: DecentralizedAverager | None = None
    case: _Case | None = None
    try:
        reply.send({"event": "ready", "pid": os.getpid(), "maddrs": [str(m) for m in dht.get_visible_maddrs()]})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "setup":
                t_setup = time.perf_counter()
                case = _load_case(cmd, peer)
                averager = DecentralizedAverager(
                    [p.clone() for p in case.params], dht, start=True, prefix=cmd["prefix"], target_group_size=cmd["target_group_size"], min_group_size=2,
                    min_matchmaking_time=cmd["min_matchmaking_time"], request_timeout=cmd["request_timeout"], compression=Float16Compression(),
                )
                reply.send({"ok": True, "setup_s": time.perf_counter() - t_setup})
            elif cmd["cmd"] == "round":
                assert averager is not None and case is not None
                with averager.get_tensors() as tensors:  # reset to this peer's inputs (not timed, as in GroupAverager)
                    for t, v in zip(tensors, case.params):
                        t.copy_(v)
                t0 = time.perf_counter()
                control = averager.step(wait=False, timeout=STEP_TIMEOUT_S)
                t_running, retries, last, hung = None, 0, None, False
                while not control.done():
                    if time.perf_counter() - t0 > HUNG_AFTER_S:  # hivemind bounds matchmaking, not the all-reduce
                        control.cancel()
                        hung = True
                        break
                    stage = control.stage
                    if stage == AveragingStage.RUNNING_ALLREDUCE and last != stage:
                        t_running = time.perf_counter()
                    elif stage == AveragingStage.LOOKING_FOR_GROUP and last == AveragingStage.RUNNING_ALLREDUCE:
                        retries, t_running = retries + 1, None
                    last = stage
                    time.sleep(0.0005)
                t1 = time.perf_counter()
                try:
                    group = None if hung else control.result()
                    error = f"round still running after {HUNG_AFTER_S:.0f}s; cancelled" if hung else "" if group else "no group"
                except Exception as exc:  # hivemind reports a failed round as an exception
                    group, error = None, f"{type(exc).__name__}: {exc}"
                with averager.get_tensors() as tensors:
                    max_err = _max_err(list(tensors), case)
                    values = _values_out(torch.cat([t.reshape(-1) for t in tensors]), cmd) if cmd.get("keep_values") else {}
                out = {"ok": bool(group) and not error, "error": error, "wall_s": t1 - t0, "retries": retries,
                       "group_size": len(group) if group else 0, "max_abs_err": max_err, **values}
                if t_running is not None:
                    out.update(matchmaking_s=t_running - t0, allreduce_s=t1 - t_running)
                reply.send(out)
            elif cmd["cmd"] == "teardown":
                if averager is not None:
                    averager.shutdown()
                averager, case = None, None
                reply.send({"ok": True})
            elif cmd["cmd"] == "quit":
                break
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()
    reply.send({"event": "bye"})


def _grpc_peer(peer: int, reply: _Reply) -> None:
    """Two ways to move the bytes: `grpc` (one unary call with the whole fp16 vector) and
    `grpc-stream` (one client-streaming call of STREAM_CHUNK_BYTES chunks, so that fp16
    conversion, sending, receiving and fp32 conversion overlap)."""
    from concurrent import futures

    import grpc
    import numpy as np

    inbox: dict[int, torch.Tensor] = {}  # round -> the other peer's vector (fp16 values as fp32)
    cond = threading.Condition()
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]

    def deliver(context: grpc.ServicerContext, vec: torch.Tensor) -> bytes:
        rnd = int(dict(context.invocation_metadata())["round"])
        with cond:
            inbox[rnd] = vec
            cond.notify_all()
        return b""

    def exchange(request: bytes, context: grpc.ServicerContext) -> bytes:
        return deliver(context, torch.from_numpy(np.frombuffer(request, dtype=np.float16).astype(np.float32)))

    def exchange_stream(chunks: Any, context: grpc.ServicerContext) -> bytes:
        n = int(dict(context.invocation_metadata())["floats"])
        out = np.empty(n, dtype=np.float32)
        o = 0
        for chunk in chunks:
            k = len(chunk) // 2
            out[o:o + k] = np.frombuffer(chunk, dtype=np.float16)
            o += k
        if o != n:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"got {o} floats, expected {n}")
        return deliver(context, torch.from_numpy(out))

    handlers = {"Exchange": grpc.unary_unary_rpc_method_handler(exchange), "ExchangeStream": grpc.stream_unary_rpc_method_handler(exchange_stream)}
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=options)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))  # no (de)serializers: raw bytes
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel: grpc.Channel | None = None
    case: _Case | None = None
    rnd = 0
    try:
        reply.send({"event": "ready", "pid": os.getpid(), "address": f"127.0.0.1:{port}"})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "connect":
                channel = grpc.insecure_channel(cmd["peer"], options=options)
                grpc.channel_ready_future(channel).result(timeout=30)
                unary, stream = channel.unary_unary(f"/{SERVICE}/Exchange"), channel.stream_unary(f"/{SERVICE}/ExchangeStream")
                reply.send({"ok": True})
            elif cmd["cmd"] == "setup":
                case = _load_case(cmd, peer)
                reply.send({"ok": True})
            elif cmd["cmd"] == "round":
                assert channel is not None and case is not None
                rnd += 1
                t0 = time.perf_counter()
                mine16 = torch.cat([p.reshape(-1) for p in case.params]).half()  # from the stage's tensors, as the peer holds them
                meta = (("round", str(rnd)), ("floats", str(mine16.numel())))
                error = ""
                try:
                    if cmd["mode"] == "grpc":
                        unary(mine16.numpy().tobytes(), metadata=meta, timeout=STEP_TIMEOUT_S)
                    else:
                        step = STREAM_CHUNK_BYTES // 2
                        stream((mine16[i:i + step].numpy().tobytes() for i in range(0, mine16.numel(), step)), metadata=meta, timeout=STEP_TIMEOUT_S)
                    with cond:
                        if not cond.wait_for(lambda: rnd in inbox, timeout=STEP_TIMEOUT_S):
                            raise TimeoutError("the other peer's parameters did not arrive")
                        other = inbox.pop(rnd)
                    result = other.add_(mine16.float()).mul_(0.5)  # mean of the two fp16 copies: both peers get the same numbers
                except (grpc.RpcError, TimeoutError) as exc:
                    error, result = f"{type(exc).__name__}: {exc}", case.mine
                t1 = time.perf_counter()
                reply.send({"ok": not error, "error": error, "wall_s": t1 - t0, "max_abs_err": _max_err(result, case), **_values_out(result, cmd)})
            elif cmd["cmd"] == "teardown":
                case = None
                reply.send({"ok": True})
            elif cmd["cmd"] == "quit":
                break
    finally:
        if channel is not None:
            channel.close()
        server.stop(grace=None)
    reply.send({"event": "bye"})


def _peer_main(argv: list[str]) -> None:
    spec = json.loads(argv[0])
    torch.set_num_threads(1)
    reply = _Reply()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # run the finally blocks: DHT/averager shutdown
    if spec["transport"] == "hivemind":
        _hivemind_peer(spec["peer"], spec.get("initial_peers", []), reply)
    else:
        _grpc_peer(spec["peer"], reply)


# --------------------------------------------------------------------------------------------
# Parent: starts peers, tracks and ends every process by pid, counts socket bytes
# --------------------------------------------------------------------------------------------

def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, start time in clock ticks) for every process visible in /proc."""
    table = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        table[int(d)] = (int(fields[1]), int(fields[19]))
    return table


def _descendants(root: int) -> dict[int, int]:
    """pid -> start time of `root` and all its descendants."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in table and pid not in out:
            out[pid] = table[pid][1]
            todo.extend(children.get(pid, []))
    return out


def _socket_bytes(pids: set[int]) -> dict[str, int] | None:
    """Bytes acknowledged per established loopback TCP socket owned by one of `pids`; None without ss."""
    try:
        text = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    out: dict[str, int] = {}
    head: str | None = None
    for line in text.splitlines() + [""]:
        if line[:1].isspace() and head is not None:  # the tcp_info line of the socket above
            cols = head.split()  # Recv-Q Send-Q Local Peer users:(...) (no State column with a state filter)
            owners = {int(p) for p in re.findall(r"pid=(\d+)", head)}
            if owners & pids and all(a.startswith(("127.", "[::1]", "[::ffff:127.")) for a in cols[2:4]):
                m = re.search(r"bytes_acked:(\d+)", line) or re.search(r"bytes_sent:(\d+)", line)
                out[f"{cols[2]}->{cols[3]}"] = int(m.group(1)) if m else 0
            head = None
        else:
            head = line or None
    return out


def _bytes_between(before: dict[str, int] | None, after: dict[str, int] | None) -> int | None:
    if before is None or after is None:
        return None
    return sum(v - before.get(k, 0) for k, v in after.items())


class PeerProc:
    """One peer process; every pid in its tree is remembered so that all of them can be ended."""

    def __init__(self, spec: dict[str, Any], log_path: Path, env: dict[str, str]) -> None:
        self.log = open(log_path, "w")
        self.log_path = log_path
        self.proc = subprocess.Popen([sys.executable, "-m", "peer.bench.dp_transport", "--peer-process", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.seen: dict[int, int] = {}
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def track(self) -> set[int]:
        self.seen.update(_descendants(self.proc.pid))
        return set(self.seen)

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = 180.0) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            tail = self.log_path.read_text()[-3000:]
            raise RuntimeError(f"peer process {self.proc.pid} gave no answer in {timeout:.0f}s; log tail:\n{tail}") from None
        if line is None:
            tail = self.log_path.read_text()[-3000:]
            raise RuntimeError(f"peer process {self.proc.pid} exited (rc={self.proc.poll()}); log tail:\n{tail}")
        return json.loads(line)

    def request_quit(self) -> None:
        """Ask it to shut down its DHT/averager and exit (close() waits for it)."""
        if self.proc.poll() is None:
            self.track()
            try:
                self.send({"cmd": "quit"})
            except OSError:
                pass

    def close(self) -> None:
        """Ask it to quit, then end by pid whatever of its tree is still alive."""
        self.request_quit()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [pid for pid, start in self.seen.items() if _proc_table().get(pid, (0, -1))[1] == start]
            for pid in alive:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + 5
            while alive and time.time() < deadline:
                table = _proc_table()
                alive = [pid for pid in alive if table.get(pid, (0, -1))[1] == self.seen[pid]]
                time.sleep(0.1)
            if not alive:
                break
        self.log.close()


def _close_all(procs: list[PeerProc]) -> None:
    for p in procs:  # all shut down at once, then each is waited for and its leftovers ended
        p.request_quit()
    for p in procs:
        p.close()


def _pair(a: PeerProc, b: PeerProc, cmd: dict[str, Any] | list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Send to both peers at once and wait for both answers (the barrier between rounds)."""
    ca, cb = (cmd, cmd) if isinstance(cmd, dict) else cmd
    a.send(ca)
    b.send(cb)
    ra, rb = a.recv(), b.recv()
    for r in (ra, rb):
        if r.get("ok") is False and "wall_s" not in r:
            raise RuntimeError(f"peer failed: {r}")
    return ra, rb


def _summary(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    p90 = statistics.quantiles(xs, n=10, method="inclusive")[-1] if len(xs) > 1 else xs[0]
    return {"median": round(statistics.median(xs), 4), "p90": round(p90, 4), "min": round(min(xs), 4), "max": round(max(xs), 4)}


@dataclass
class SizeSpec:
    name: str
    shapes: Shapes
    base_path: str
    floats: int = 0
    tensors: int = 0

    def __post_init__(self) -> None:
        self.floats, self.tensors = numel(self.shapes), len(self.shapes)


@dataclass
class CaseResult:
    transport: str
    size: str
    floats: int
    tensors: int
    rounds: int
    failed_rounds: int
    round_s: dict[str, float] | None
    bytes_per_round_per_peer: dict[str, Any]
    max_abs_err_vs_true_mean: float
    inexact_rounds: int  # rounds the transport reported done whose result is not the mean (beyond fp16 rounding)
    min_matchmaking_time: float | None = None
    request_timeout: float | None = None
    target_group_size: int | None = None
    matchmaking_s: dict[str, float] | None = None
    allreduce_s: dict[str, float] | None = None
    matchmaking_share_median: float | None = None
    retries: int = 0
    round_s_raw: list[float] = field(default_factory=list)
    max_abs_err_per_round: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    values: list[list[float]] | None = None


def _run_case(a: PeerProc, b: PeerProc, transport: str, size: SizeSpec, rounds: int, warmup: int, *, mm: float | None = None,
              request_timeout: float | None = None, target_group_size: int | None = None, keep_values: bool = False, progress: Callable[[str], None] = lambda s: None) -> CaseResult:
    tag = f"{transport}_{size.name}" + (f"_mm{str(mm).replace('.', 'p')}" if mm is not None else "")
    tag += f"_target{target_group_size}" if target_group_size else ""
    setup = {"cmd": "setup", "shapes": size.shapes, "base_path": size.base_path, "prefix": f"bench_{tag}",
             "min_matchmaking_time": mm, "request_timeout": request_timeout, "target_group_size": target_group_size}
    sa, sb = _pair(a, b, setup)
    progress(f"{tag}: set up in {max(sa.get('setup_s', 0), sb.get('setup_s', 0)):.1f}s")
    pids = a.track()
    b.track()
    walls, mms, ars, shares, errs, round_errs, retries, failed = [], [], [], [], [], [], 0, 0
    values = None
    before = None
    for i in range(warmup + rounds):
        if i == warmup:
            before = _socket_bytes(pids)
        last = i == warmup + rounds - 1
        ra, rb = _pair(a, b, {"cmd": "round", "mode": transport, "keep_values": keep_values and last})
        if i < warmup:
            progress(f"{tag}: warm-up round {max(ra['wall_s'], rb['wall_s']):.2f}s")
            continue
        ok = ra["ok"] and rb["ok"]
        if not ok:
            failed += 1
            errs.extend(r["error"] for r in (ra, rb) if r["error"])
            continue
        wall = max(ra["wall_s"], rb["wall_s"])
        walls.append(wall)
        round_errs.append(max(ra["max_abs_err"], rb["max_abs_err"]))
        if round_errs[-1] > INEXACT_ABOVE:
            errs.append(f"round {i - warmup}: reported done, but max |result - true mean| = {round_errs[-1]:.3g}")
        retries += ra.get("retries", 0) + rb.get("retries", 0)
        if "matchmaking_s" in ra and "matchmaking_s" in rb:
            mm_s = max(ra["matchmaking_s"], rb["matchmaking_s"])  # until both peers are in the all-reduce
            mms.append(mm_s)
            ars.append(wall - mm_s)
            shares.append(mm_s / wall)
        if last and keep_values:
            values = [ra["values"], rb["values"]]
    after = _socket_bytes(pids)
    a.track()
    b.track()
    _pair(a, b, {"cmd": "teardown"})
    measured = _bytes_between(before, after)
    res = CaseResult(
        transport=transport, size=size.name, floats=size.floats, tensors=size.tensors, rounds=len(walls), failed_rounds=failed,
        round_s=_summary(walls), max_abs_err_vs_true_mean=max(round_errs, default=0.0),
        inexact_rounds=sum(e > INEXACT_ABOVE for e in round_errs),
        min_matchmaking_time=mm, request_timeout=request_timeout, target_group_size=target_group_size,
        bytes_per_round_per_peer={
            "fp16_payload_computed": 2 * size.floats,
            "tcp_acked_measured": round(measured / rounds) if measured is not None and rounds else None,
        },
        matchmaking_s=_summary(mms), allreduce_s=_summary(ars),
        matchmaking_share_median=round(statistics.median(shares), 3) if shares else None,
        retries=retries, round_s_raw=[round(w, 4) for w in walls], max_abs_err_per_round=[float(f"{e:.3g}") for e in round_errs],
        errors=errs[:5], values=values,
    )
    progress(f"{tag}: median {res.round_s['median'] if res.round_s else None}s over {len(walls)} rounds, {failed} failed, {res.inexact_rounds} inexact")
    return res


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HIVEMIND_LOGLEVEL=os.environ.get("HIVEMIND_LOGLEVEL", "WARNING"))
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_benchmark(sizes: dict[str, tuple[Shapes, torch.Tensor]], *, rounds: int = 10, warmup: int = 1,
                  hivemind_cases: tuple[tuple[float, int | None], ...] = HIVEMIND_CASES, transports: tuple[str, ...] = ("grpc", "grpc-stream", "hivemind"),
                  keep_values: bool = False, log_dir: Path | None = None, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Measure every (transport, size) case, and for hivemind every (min_matchmaking_time,
    target_group_size) of `hivemind_cases`, between 2 peer processes.

    `sizes`: name -> (tensor shapes, flat fp32 base values); peer i averages base + noise_i.
    Returns the JSON-ready result; with keep_values each case also holds both peers' final
    averaged vectors (for tests, at tiny sizes). Peer logs go to `log_dir` (default: a temporary
    directory removed at the end)."""
    env = _env()
    start = time.perf_counter()
    say = lambda msg: progress(f"[{time.perf_counter() - start:6.1f}s] {msg}")  # noqa: E731
    load = os.getloadavg()  # other work on the machine skews wall times: reported with the results
    results: list[CaseResult] = []
    with tempfile.TemporaryDirectory(prefix="dp-transport-") as tmp:
        specs = []
        for name, (shapes, base) in sizes.items():
            assert base.numel() == numel(shapes), f"{name}: base has {base.numel()} values, shapes hold {numel(shapes)}"
            path = Path(tmp) / f"{name}.pt"
            torch.save(base.float().contiguous(), path)
            specs.append(SizeSpec(name, [tuple(s) for s in shapes], str(path)))
        logs = Path(tmp) if log_dir is None else log_dir
        logs.mkdir(parents=True, exist_ok=True)
        procs: list[PeerProc] = []
        try:
            if any(t.startswith("grpc") for t in transports):  # own processes: hivemind forks, which must not meet live gRPC
                a = PeerProc({"transport": "grpc", "peer": 0}, logs / "grpc0.log", env)
                procs.append(a)
                b = PeerProc({"transport": "grpc", "peer": 1}, logs / "grpc1.log", env)
                procs.append(b)
                ra, rb = a.recv(), b.recv()
                _pair(a, b, [{"cmd": "connect", "peer": rb["address"]}, {"cmd": "connect", "peer": ra["address"]}])
                say("grpc peers up")
                for s in specs:
                    for mode in [t for t in transports if t.startswith("grpc")]:
                        results.append(_run_case(a, b, mode, s, rounds, warmup, keep_values=keep_values, progress=say))
                _close_all([a, b])
                say("grpc peers closed")
            if "hivemind" in transports:
                for s in specs:
                    for mm, target in hivemind_cases:  # fresh peers and DHTs per case, as a daemon runs one averager per DHT
                        tag = f"{s.name}_mm{mm}_target{target}"
                        a = PeerProc({"transport": "hivemind", "peer": 0}, logs / f"hivemind0_{tag}.log", env)
                        procs.append(a)
                        ra = a.recv()
                        b = PeerProc({"transport": "hivemind", "peer": 1, "initial_peers": ra["maddrs"]}, logs / f"hivemind1_{tag}.log", env)
                        procs.append(b)
                        b.recv()
                        say(f"hivemind peers up for {tag}")
                        rt = min(GROUP_AVERAGER_REQUEST_TIMEOUT, 0.8 * mm)  # hivemind wants request_timeout < min_matchmaking_time
                        results.append(_run_case(a, b, "hivemind", s, rounds, warmup, mm=mm, request_timeout=rt, target_group_size=target,
                                                 keep_values=keep_values, progress=say))
                        _close_all([a, b])
                        say("hivemind peers closed")
        finally:
            _close_all(procs)
    import grpc
    import hivemind

    out = {
        "benchmark": "dp_transport",
        "setup": {
            "peers": 2, "network": "loopback (127.0.0.1), one process per peer", "rounds": rounds, "warmup_rounds": warmup,
            "cpus": os.cpu_count(), "load_avg_at_start": [round(x, 2) for x in load], "python": platform.python_version(),
            "versions": {"torch": torch.__version__, "hivemind": hivemind.__version__, "grpcio": grpc.__version__},
            "sizes": {s.name: {"floats": s.floats, "tensors": s.tensors} for s in specs},
            "round_s": "wall time until both peers hold the mean (slower peer), warm-up rounds dropped",
            "transports": {
                "hivemind": "DecentralizedAverager, Float16Compression, min_group_size=2, target_group_size None (as GroupAverager) or 2; own DHT per peer, fresh per case",
                "grpc": "one unary call per peer per round with the whole fp16 vector (generic handler, raw bytes); mean of both fp16 copies",
                "grpc-stream": f"one client-streaming call per peer per round, {STREAM_CHUNK_BYTES} B fp16 chunks converted on the fly; mean of both fp16 copies",
            },
            "bytes": "fp16_payload_computed = 2 bytes/float; tcp_acked_measured = ss bytes_acked of the peer's loopback TCP sockets / rounds",
        },
        "results": [{k: v for k, v in asdict(r).items() if v is not None or k not in ("values",)} for r in results],
    }
    out["setup"]["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return out


def default_sizes() -> dict[str, tuple[Shapes, torch.Tensor]]:
    shapes, values = stage_shapes_and_values(1)
    big = scaled_shapes(shapes, LARGE_FLOATS)
    return {"stage1": (shapes, values), "stage1x25M": (big, random_base(numel(big)))}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--peer-process"]:
        _peer_main(argv[1:])
        return
    ap = argparse.ArgumentParser(prog="python -m peer.bench.dp_transport", description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, required=True, help="write the result here (also printed to stdout)")
    ap.add_argument("--rounds", type=int, default=10, help="measured rounds per case (after warm-up)")
    ap.add_argument("--log-dir", type=Path, help="keep the peer processes' logs here")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up rounds per case, not measured")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: run_benchmark ends its peer processes
    t0 = time.time()
    out = run_benchmark(default_sizes(), rounds=args.rounds, warmup=args.warmup, log_dir=args.log_dir, progress=lambda s: print(s, file=sys.stderr, flush=True))
    out["setup"]["benchmark_wall_s"] = round(time.time() - t0, 1)
    text = json.dumps(out, indent=1)
    args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
