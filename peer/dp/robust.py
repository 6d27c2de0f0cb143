"""A robust reduction for hivemind's butterfly all-reduce: a coordinate-wise trimmed mean in
which every member weighs 1.

Why: hivemind's reducer averages the parts it receives weighted by the weight each sender
declares, so one member can scale or flip what the whole group agrees on, or claim a large
weight. With the trimmed mean, each reducer drops the largest and the smallest `trim_count(n)`
values of every coordinate before averaging, and ignores the declared weight: in a group of
three or more, one hostile member moves the result at most as far as the honest spread. A pair
cannot be protected this way (there is nothing to outvote): the plausibility and claim checks of
peer/dp/claims.py stay its only defence, and the status says so. A majority of colluders wins
any vote; that is a limit of the rule, not of this code.

Only hivemind's `TensorPartReducer` (what a member does with its slice) and the runner that
creates it are replaced; the wire protocol and matchmaking are hivemind's.
"""

from __future__ import annotations

import torch


def trim_count(n: int) -> int:
    """How many of the largest and of the smallest values a robust mean drops per coordinate:
    none in a pair, one in groups of 3 to 8, then an eighth (a median of 3 is the trimmed mean
    of 3 with one dropped each side)."""
    return 0 if n < 3 else max(1, n // 8)


def trimmed_mean(parts: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise trimmed mean over the first dimension of `parts` [n, ...]."""
    n, k = parts.shape[0], trim_count(parts.shape[0])
    if k == 0:
        return parts.mean(0)
    return parts.sort(dim=0).values[k : n - k].mean(0)


def reducer_class():
    """hivemind's TensorPartReducer with the trimmed mean (imported lazily: hivemind is heavy)."""
    from hivemind.averaging.partition import BannedException, TensorPartReducer

    class TrimmedPartReducer(TensorPartReducer):
        """Keeps each sender's part of the current slice and hands back their trimmed mean."""

        def reset_accumulators(self) -> None:
            self.parts: list[torch.Tensor] = []
            super().reset_accumulators()

        async def accumulate_part(
            self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
        ) -> torch.Tensor:
            # hivemind's logic, with the part kept and the sender's weight ignored (every member counts once)
            assert 0 <= sender_index < self.num_senders, "invalid sender index"
            assert 0 <= part_index < self.num_parts, "invalid part index"
            self.num_parts_received[sender_index] += 1
            import asyncio

            while part_index > self.current_part_index:
                await asyncio.wait(
                    {self.current_part_future, asyncio.create_task(self.finished.wait())},
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if self.finished.is_set():
                    from hivemind.averaging.partition import AllreduceException

                    raise AllreduceException(f"attempted to aggregate part in a finalized {self.__class__.__name__}")
            if self.sender_failed_after[sender_index] != float("inf"):
                raise BannedException(f"sender {sender_index} was banned in background")
            assert part_index == self.current_part_index
            current_part_future = self.current_part_future
            if part_index < self.sender_failed_after[sender_index]:
                self.parts.append(tensor_part.detach().to(torch.float32, copy=True))
                self.current_part_accumulated_from += 1
                self.check_current_part_finished()
            return await current_part_future

        def check_current_part_finished(self) -> None:
            assert self.current_part_accumulated_from <= self.num_current_senders
            if self.current_part_accumulated_from == self.num_current_senders:
                shape = self.part_shapes[self.current_part_index]
                result = trimmed_mean(torch.stack(self.parts)) if self.parts else torch.zeros(shape)
                self.current_part_future.set_result(result.reshape(shape))
                self.reset_accumulators()

    return TrimmedPartReducer


def runner_class():
    """hivemind's AllReduceRunner whose reducer is the trimmed mean."""
    from hivemind.averaging.allreduce import AllReduceRunner

    reducer = reducer_class()

    class RobustAllReduceRunner(AllReduceRunner):
        """Also records `lost`: the flat ranges (start, end) of the concatenated tensors whose
        results never came back (hivemind keeps this peer's own values there and only logs it)."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.tensor_part_reducer.finished.set()  # the replaced reducer, silenced: it would log "received 0.0%" when collected
            self.tensor_part_reducer = reducer(
                tuple(part.shape for part in self.parts_for_local_averaging), len(self.sender_peer_ids)
            )
            self.lost: list[tuple[int, int]] = []
            container = self.tensor_part_container
            starts, at = [], 0  # hivemind hands each peer a contiguous run of parts, in peer order
            for parts in container._input_parts_by_peer:
                starts.append([])
                for part, _info in parts:
                    starts[-1].append(at)
                    at += part.numel()
            ends = [
                s[0] + sum(p.numel() for p, _ in parts) if s else 0
                for s, parts in zip(starts, container._input_parts_by_peer)
            ]
            register_failed = container.register_failed_reducer

            def failed(peer_index: int) -> None:
                first = container._outputs_registered_by_peer[peer_index]
                if first < len(starts[peer_index]):
                    self.lost.append((starts[peer_index][first], ends[peer_index]))
                register_failed(peer_index)

            container.register_failed_reducer = failed

    return RobustAllReduceRunner
