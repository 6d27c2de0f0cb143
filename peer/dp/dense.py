"""Dense fp32 gradient averaging: the uncompressed baseline."""

from __future__ import annotations

import torch

from peer.dp.base import MeanSync, Reduction, encode_fp32, mean_of_payloads, payload_bytes


class DenseSync(MeanSync):
    """fp32 mean of every gradient, every step.

    Tuning: nothing to tune. Cost: 4 bytes per parameter per step per replica (`dense_bytes()`),
    one all-reduce round, no extra memory. Use it as the correctness baseline and on fast links;
    on 200 Mbit/s links prefer powersgd / diloco.
    """

    scheme = "dense"

    def encode(self, tensors: list[torch.Tensor]) -> list:
        """Per-replica compute: raw fp32 payload of each tensor."""
        return [encode_fp32(t) for t in tensors]

    def reduce(self, replica_tensors: list[list[torch.Tensor]]) -> Reduction:
        payloads = [self.encode(ts) for ts in replica_tensors]
        mean = mean_of_payloads(payloads, device=[t.device for t in replica_tensors[0]])
        return Reduction(mean, max(payload_bytes(p) for p in payloads), lambda: None)

    def state_dict(self) -> dict:
        return {"scheme": self.scheme}

    def load_state_dict(self, d: dict) -> None:
        self._check_scheme(d)
