"""Parameter averaging inside one stage group over the network (hivemind averaging).

Every `every` local steps a peer offers its stage parameters to hivemind's
DecentralizedAverager (matchmaking over the run's DHT, keyed by run and stage; fp16 on the
wire). The round runs in the background while the peer keeps training; when it finishes, the
peer adds (group mean - what it offered) to its current weights, so the local steps taken
meanwhile are kept (DiLoCo's outer step with lr 1, applied late). No peer waits for the slowest:
a peer alone in its stage, or a round that finds no group in time, just trains on.

The same averager hands a stage's state to a peer that joins the group late (hivemind's
`load_state_from_peers`): each peer declares itself a donor with its step count as priority, so
a joiner downloads from the most-trained member; a peer that has not trained yet declares nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

log = logging.getLogger(__name__)


StateFn = Callable[[], tuple[dict, list[torch.Tensor]]]  # -> (small metadata, tensors): what a joiner downloads


def _averager_class():
    from hivemind.averaging import DecentralizedAverager

    class StageAverager(DecentralizedAverager):
        """hivemind's averager whose shared state is the live stage state (not its averaging buffer)."""

        def __init__(self, *args, state_fn: StateFn, **kwargs) -> None:
            self._state_fn = state_fn
            super().__init__(*args, **kwargs)

        def get_current_state(self):  # runs in this (host) process, on hivemind's background thread
            metadata, tensors = self._state_fn()
            return metadata, tensors, None

    return StageAverager


class GroupAverager:
    """Args:
        dht: a running hivemind DHT of the run.
        params: the stage's parameters (updated in place).
        prefix: matchmaking key, e.g. "<run_id>_stage1" (no dots: hivemind forbids them); only peers with the same prefix meet.
        every: local steps between rounds (DiLoCo H).
        timeout: seconds a round may take, matchmaking included.
        state_fn: the state a joiner downloads; default: the parameters alone. Called from
            hivemind's thread: hold `lock` while changing what it reads.
    """

    def __init__(self, dht, params: list[torch.nn.Parameter], prefix: str, every: int = 10, timeout: float = 30.0, state_fn: StateFn | None = None) -> None:
        from hivemind.compression import Float16Compression

        self.params, self.every, self.timeout = params, every, timeout
        self.lock = threading.Lock()  # the owner holds it while stepping; state_fn reads under it
        self._offered: list[torch.Tensor] | None = None
        self._pending: Future | None = None
        self.rounds = 0
        self.failures = 0
        self.numel = sum(p.numel() for p in params)
        self.bytes_out = 0  # estimated from tensor sizes: hivemind exposes no byte counter
        self.dense_bytes = 0  # a dense fp32 gradient all-reduce every step, over the same steps
        self._last_round_step: int | None = None  # set at the first step this averager sees (a joiner starts late)
        self._offered_at = 0
        self.last_error = ""
        self.averager = _averager_class()(
            [p.detach().clone() for p in params], dht, start=True, prefix=prefix, target_group_size=None, min_group_size=2,
            min_matchmaking_time=2.0, request_timeout=1.0, compression=Float16Compression(),
            state_fn=state_fn or self._params_state, allow_state_sharing=False,  # nothing worth sharing before training
        )

    def _params_state(self) -> tuple[dict, list[torch.Tensor]]:
        with self.lock:
            return {}, [p.detach().clone() for p in self.params]

    def share_state(self, priority: float) -> None:
        """Offer this peer's state to joiners; the highest priority (its step count) is asked first."""
        self.averager.state_sharing_priority = float(priority)
        self.averager.allow_state_sharing = True

    def load_state(self, timeout: float = 60.0) -> tuple[dict, list[torch.Tensor]] | None:
        """The state of the most-trained peer of the group, or None (nobody to ask, or it failed)."""
        try:
            return self.averager.load_state_from_peers(timeout=timeout)
        except Exception as exc:  # a donor that vanished mid-download, a timeout
            log.warning("could not download the stage state from the group: %s: %s", type(exc).__name__, exc)
            return None

    def after_step(self, local_step: int) -> None:
        """Call after every optimizer step; never blocks."""
        if self._last_round_step is None:
            self._last_round_step = local_step - 1
        if self._pending is not None and self._pending.done():
            self._finish()
        if self._pending is None and local_step % self.every == 0:
            self._offered = [p.detach().clone() for p in self.params]
            self._offered_at = local_step
            with self.averager.get_tensors() as tensors:
                for t, p in zip(tensors, self._offered):
                    t.copy_(p)
            self._pending = self.averager.step(wait=False, timeout=self.timeout)

    def _finish(self) -> None:
        pending, self._pending = self._pending, None
        try:
            group = pending.result()
        except Exception as exc:  # hivemind reports no-group / timeouts as exceptions
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.info("stage-group averaging found no group this round (%s)", self.last_error)
            return
        if not group:
            self.failures += 1
            return
        # butterfly all-reduce in a group of n: each peer sends (n-1)/n of its tensors to scatter
        # and its averaged 1/n part to the n-1 others: 2 (n-1)/n of the tensors, fp16 on the wire
        n = len(group)
        share = 2 * (n - 1) / n * self.numel
        self.bytes_out += int(share * 2)
        self.dense_bytes += int(share * 4 * max(self._offered_at - self._last_round_step, 1))
        self._last_round_step = self._offered_at
        with torch.no_grad(), self.averager.get_tensors() as tensors:
            for p, offered, mean in zip(self.params, self._offered, tensors):
                p.add_(mean.to(p.dtype) - offered)
        self.rounds += 1

    def shutdown(self) -> None:
        self.averager.shutdown()
