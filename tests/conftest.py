"""One torch thread in the test process. Why: the suite runs on 2 cores beside the peer, tracker
and hivemind processes it starts; torch's OpenMP threads spin while they wait, and with a
second busy process on the box a tiny model's step took 80x longer with 2 threads than with 1
(0.42 s against 33.6 s for 12 runner steps). Tests that need more set it themselves and restore it."""

import torch

torch.set_num_threads(1)
