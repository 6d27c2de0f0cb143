"""Parameter averaging inside one stage group over the network (hivemind averaging).

Every `every` local steps a peer offers its stage parameters to hivemind's
DecentralizedAverager (matchmaking over the run's DHT, keyed by run and stage; fp16 on the
wire). The round runs in the background while the peer keeps training; when it finishes, the
peer adds (group mean - what it offered) to its current weights, so the local steps taken
meanwhile are kept (DiLoCo's outer step with lr 1, applied late). No peer waits for the slowest:
a peer alone in its stage, or a round that finds no group in time, just trains on.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

import torch

log = logging.getLogger(__name__)


class GroupAverager:
    """Args:
        dht: a running hivemind DHT of the run.
        params: the stage's parameters (updated in place).
        prefix: matchmaking key, e.g. "<run_id>_stage1" (no dots: hivemind forbids them); only peers with the same prefix meet.
        every: local steps between rounds (DiLoCo H).
        timeout: seconds a round may take, matchmaking included.
    """

    def __init__(self, dht, params: list[torch.nn.Parameter], prefix: str, every: int = 10, timeout: float = 30.0) -> None:
        from hivemind.averaging import DecentralizedAverager
        from hivemind.compression import Float16Compression

        self.params, self.every, self.timeout = params, every, timeout
        self._offered: list[torch.Tensor] | None = None
        self._pending: Future | None = None
        self.rounds = 0
        self.failures = 0
        self.last_error = ""
        self.averager = DecentralizedAverager(
            [p.detach().clone() for p in params], dht, start=True, prefix=prefix, target_group_size=None, min_group_size=2,
            min_matchmaking_time=2.0, request_timeout=1.0, compression=Float16Compression(),
        )

    def after_step(self, local_step: int) -> None:
        """Call after every optimizer step; never blocks."""
        if self._pending is not None and self._pending.done():
            self._finish()
        if self._pending is None and local_step % self.every == 0:
            self._offered = [p.detach().clone() for p in self.params]
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
        with torch.no_grad(), self.averager.get_tensors() as tensors:
            for p, offered, mean in zip(self.params, self._offered, tensors):
                p.add_(mean.to(p.dtype) - offered)
        self.rounds += 1

    def shutdown(self) -> None:
        self.averager.shutdown()
