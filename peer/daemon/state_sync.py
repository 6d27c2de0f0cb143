"""The stage state a peer hands its stage group and takes from it: parameters and AdamW moments.

A joiner of a trained run downloads the state of its group's most-trained member over gRPC
(`GetShard`, what = STATE: size-capped while it arrives, peer/daemon/replicas.py), the next
member after a refusal; a restarted peer reads its own checkpoint (peer/daemon/checkpointing.py).
A state from a donor must also be close to what the group's other members serve (or, with no
majority for it, to this peer's own weights): peer/daemon/state_witness.py; a refused donor is
logged, counted and reported to the tracker (`refused_donors`).
Both go through one validation path here, whole or not at all, because whatever a donor or a disk
hands over lands in the optimizer of every later step: a state no honest training can reach is
refused. A part of `PeerDaemon` (peer/daemon/main.py); it reads the daemon's worker and averager
when asked (neither exists before the join) through the narrow `StageHolder` view.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from peer.capacity import STEP_SLACK, step_ceiling
from peer.daemon.state_witness import REACH_MARGIN, Weights, Witnesses
from peer.dp.group import GroupAverager
from peer.pipeline.worker import StageWorker
from peer.wire import anchormesh_pb2 as pb

log = logging.getLogger("anchormesh.peer")


class StageHolder(Protocol):
    """What the state transfer reads and writes of the peer: its stage, its averager, the step
    of the state it holds and where that came from, and the reason it reports."""

    worker: StageWorker | None
    averager: GroupAverager | None
    state_step: int  # the step of the stage state taken from a checkpoint or the group; -1 = initial weights
    resumed_from: str
    reason: str

    def step_lock(self) -> threading.Lock: ...


class StateSync:
    """Stage state out (`stage_state`) and in (`load_group_state`, `apply_state`)."""

    def __init__(self, peer: StageHolder) -> None:
        self.peer = peer
        self.run_clock: tuple[float, int] | None = (
            None  # (when it joined, the run's step then): bounds a downloaded state's step
        )
        self._judge: Callable[[list[torch.Tensor], int], str] | None = (
            None  # the group check of the download under way (None: a checkpoint)
        )
        self._refusal = ""  # why the last state was refused
        self.refused: deque[str] = deque(maxlen=4)  # "PEER: why" of the donors refused, newest last (reported)
        self.refused_count = 0

    def stage_state(self) -> tuple[dict, list[torch.Tensor]]:
        """What a joiner of this stage group downloads and what a checkpoint holds: parameters and
        AdamW moments, in named_parameters order, plus the step counts (taken under the step's lock)."""
        w = self.peer.worker
        with self.peer.step_lock():  # host copies: hivemind and torch.save must never touch the device
            params = [p.detach().to("cpu", copy=True) for _, p in w.stage.named_parameters()]
            opt = w.optimizer.opt
            moments, adam_step = [], 0.0
            for key in ("exp_avg", "exp_avg_sq"):
                for _, p in w.stage.named_parameters():
                    st = opt.state.get(p, {})
                    moments.append(
                        st[key].detach().to("cpu", copy=True) if key in st else torch.zeros(p.shape, dtype=p.dtype)
                    )
                    adam_step = max(adam_step, float(st.get("step", 0.0)))
            return {"version": w.version, "adam_step": adam_step}, params + moments

    def _witnesses(self, donors: Sequence[pb.PeerInfo], weights: Weights | None) -> Witnesses:
        named, o = list(self.peer.worker.stage.named_parameters()), self.peer.worker.cfg.optim
        c = (1 - o.beta1) / ((1 - o.beta2) * (1 - o.beta1**2 / o.beta2)) ** 0.5 if o.beta1**2 < o.beta2 else 10.0
        return Witnesses(
            [n for n, _ in named], [p for _, p in named], donors, weights, REACH_MARGIN * o.lr * max(1.0, c)
        )

    def _reach_steps(self, version: int) -> int:
        """How many steps a state of `version` may be past this peer's own: at most the run's step
        when it joined (plus the slack) over the step it holds."""
        cap = self.run_clock[1] + STEP_SLACK if self.run_clock is not None else version
        return max(min(version, cap) - max(self.peer.state_step, 0), 0)

    def _ask(
        self, donor: pb.PeerInfo, witnesses: Witnesses, download: Callable[[pb.PeerInfo], bool], lone: bool = False
    ) -> bool:
        """`download(donor)` judged by `witnesses` (`lone`: by the single-donor policy); a refused
        donor is named in the log and in `refused`."""
        self._judge, self._refusal = (
            (lambda params, version: witnesses.judge(None if lone else donor, params, self._reach_steps(version))),
            "",
        )
        try:
            if download(donor):
                return True
        finally:
            self._judge = None
        if self._refusal:
            self.refused_count += 1
            self.refused.append(f"{donor.peer_id}: {self._refusal}")
            log.warning(
                "refused the stage state of %s (%d donors refused so far): %s",
                donor.peer_id,
                self.refused_count,
                self._refusal,
            )
        return False

    def load_single(self, holder: pb.PeerInfo, download: Callable[[pb.PeerInfo], bool]) -> bool:
        """Take a lone holder's state (the replica of a stage whose group died): nobody else holds
        it to compare with, so the single-donor policy judges it (peer/daemon/state_witness.py)."""
        return self._ask(holder, self._witnesses([], None), download, lone=True)

    def restore_from_replica(
        self, holder: pb.PeerInfo, start_step: int, stage: int, download: Callable[[pb.PeerInfo], bool]
    ) -> None:
        """Stage `stage` has no live peer: take the replica `holder` keeps when it is newer than
        this peer's own checkpoint; the reason says where the state came from and the log what was
        lost (the run is at `start_step`)."""
        peer = self.peer
        if holder.step > max(peer.state_step, 0):
            peer.reason = f"restoring its stage's state from the replica {holder.peer_id} holds (step {holder.step})"
            if self.load_single(holder, download):  # a lone holder: the single-donor policy judges it
                peer.resumed_from = f"replica step {peer.state_step} from {holder.peer_id}"
        lost = max(start_step - max(peer.state_step, 0), 0)
        log.warning(
            "stage %d had no live peer: resumed from %s (%d steps of its training lost)",
            stage,
            peer.resumed_from,
            lost,
        )

    def load_group_state(
        self, donors: Sequence[pb.PeerInfo], download: Callable[[pb.PeerInfo], bool], weights: Weights | None = None
    ) -> None:
        """A joiner takes the state of the first of `donors` (the tracker's list of its serving
        stage mates, most-trained first) newer than what this peer holds (a checkpoint may be),
        passing `apply_state`'s checks and close to what the other donors serve (`weights(donor)`:
        their weights, peer/daemon/state_witness.py); `download(donor)` fetches and applies one,
        False when it failed or was refused, and the next donor is asked."""
        peer = self.peer
        witnesses = self._witnesses(donors, weights)
        for donor in donors:
            if donor.step <= peer.state_step:  # its own checkpoint is as new: nothing to gain
                continue
            peer.reason = f"downloading its stage's state from {donor.peer_id} (step {donor.step})"
            if self._ask(donor, witnesses, download):
                peer.resumed_from = f"group step {peer.state_step}"
                return
        behind = f"the run is at step {peer.worker.version}"
        if peer.state_step >= 0:
            behind = (
                f"{behind}, {max(peer.worker.version - peer.state_step, 0)} steps of this stage's training are lost"
            )
        peer.reason = f"no stage-group member answered: resumed from {peer.resumed_from} ({behind})"
        log.warning(
            "no stage state to download (first peer of its group, a group that emptied, or no donor answered): resumed from %s (%s)",
            peer.resumed_from,
            behind,
        )

    def check_state(self, named: list, tensors: list, version: int) -> None:
        """What a donor (or a disk) hands over must be a state honest training can reach; raises
        ValueError saying why not. Its step is at most the run's step when this peer joined plus
        what the run can have done since. Each weight's norm is within 10x of this peer's own
        (initial or checkpointed) weight, plus a root-mean-square of 2: a state of 1e30 weights would
        wreck the group.
        AdamW's moments satisfy |m| <= c sqrt(v) elementwise, c = (1 - b1) / sqrt((1 - b2)(1 -
        b1^2 / b2)) (Cauchy-Schwarz on the two EMAs of one gradient sequence, when b1^2 < b2):
        a first moment larger than that would make the next step huge."""
        n = len(named)
        if self.run_clock is not None:
            start = self.run_clock[1]
            ceiling = step_ceiling(start, time.monotonic() - self.run_clock[0])
            if version > ceiling:
                raise ValueError(
                    f"step {version} is past the run's ({start} when this peer joined, at most {ceiling:.0f} now)"
                )
        for (name, p), t in zip(named, tensors[:n]):
            own, new = float(p.detach().float().norm()), float(t.float().norm())
            if new > 10 * own + 2 * t.numel() ** 0.5:  # 10x its own, plus a root-mean-square of 2 per value
                raise ValueError(f"weight {name}: norm {new:.3g}, over 10x this peer's {own:.3g} (+ 2 per value)")
        b1, b2 = self.peer.worker.cfg.optim.beta1, self.peer.worker.cfg.optim.beta2
        if b1 * b1 < b2:
            c = (1 - b1) / ((1 - b2) * (1 - b1 * b1 / b2)) ** 0.5
            for (name, _), m, v in zip(named, tensors[n : 2 * n], tensors[2 * n :]):
                if bool((m.float().abs() > 1.01 * c * v.float().sqrt() + 1e-12).any()):
                    raise ValueError(
                        f"AdamW moments of {name}: |exp_avg| exceeds {c:.3f} sqrt(exp_avg_sq), which no gradient sequence gives"
                    )

    def apply_state(self, metadata: object, tensors: list, source: str) -> bool:
        """Put a stage state (from the group or a checkpoint) into the stage, whole or not at all:
        one that does not fit (count, shape, dtype, non-finite values) or is not newer than the
        step this peer holds is ignored. Returns whether it was applied."""
        peer = self.peer
        w = peer.worker
        named = list(w.stage.named_parameters())
        n = len(named)
        try:
            if not isinstance(metadata, dict) or len(tensors) != 3 * n:
                raise ValueError(f"{len(tensors)} tensors, expected {3 * n}")
            for i, t in enumerate(tensors):
                name, p = named[i % n]
                if (
                    not isinstance(t, torch.Tensor)
                    or tuple(t.shape) != tuple(p.shape)
                    or not t.is_floating_point()
                    or not torch.isfinite(t).all()
                ):
                    raise ValueError(
                        f"tensor {i} ({name}): {getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))} does not fit {tuple(p.shape)} or is not finite"
                    )
                if i >= 2 * n and bool(
                    (t < 0).any()
                ):  # a second moment is a mean of squares: a negative one poisons AdamW
                    raise ValueError(f"tensor {i} (exp_avg_sq of {name}): {int((t < 0).sum())} negative values")
            version, adam_step = int(metadata["version"]), float(metadata["adam_step"])
            self.check_state(named, tensors, version)
            far = self._judge(tensors[:n], version) if self._judge is not None else ""
            if far:
                raise ValueError(far)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("stage state from %s ignored: %s", source, exc)
            self._refusal = str(exc)
            return False
        if version <= peer.state_step:
            log.info(
                "stage state from %s (step %d) is not newer than the state this peer holds (step %d): kept its own",
                source,
                version,
                peer.state_step,
            )
            return False
        with torch.no_grad(), peer.step_lock():
            for (name, p), t in zip(named, tensors[:n]):
                p.copy_(t.to(p.dtype))
            if adam_step > 0:
                fused = bool(w.optimizer.opt.defaults.get("fused"))  # fused AdamW keeps its step count on the device
                for (name, p), m, v in zip(named, tensors[n : 2 * n], tensors[2 * n :]):
                    step_t = torch.tensor(adam_step, dtype=torch.float32, device=p.device if fused else "cpu")
                    w.optimizer.opt.state[p] = {
                        "step": step_t,
                        "exp_avg": m.to(device=p.device, dtype=p.dtype, copy=True),
                        "exp_avg_sq": v.to(device=p.device, dtype=p.dtype, copy=True),
                    }
            if peer.averager is not None:
                peer.averager.rebase()
            w.version = max(w.version, version)
            peer.state_step = version
            if w.stage.is_first:
                w.next_mb = w.version * w.cfg.pipeline.micro_batches
        log.info("took the stage state of %s at step %d (AdamW step %d)", source, version, adam_step)
        return True
