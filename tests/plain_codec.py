"""A trivial PP codec added through the LinkCodec interface alone: every value in bf16, both ways.

Importing this module registers it (`mask.scheme = "plain"`). Run as a script it is `anchormesh`
with the codec registered first (`python tests/plain_codec.py bootstrap|peer ...`), which is how
tests/test_codec_interface.py starts a swarm that trains with it: no other module knows it.
"""

from __future__ import annotations

import torch

from peer.pipeline.bounds import scale_of
from peer.pipeline.codecs import LinkCodec, register
from peer.wire.tensors import proto_to_tensor, tensor_to_proto


@register
class PlainLink(LinkCodec):
    scheme = "plain"

    def _read(self, payload, shape: tuple[int, ...]) -> torch.Tensor:
        return proto_to_tensor(payload, expect_shape=shape, expect_dtype=torch.bfloat16)

    def encode_activation(self, msg, h, ids, dst):
        msg.hidden.CopyFrom(tensor_to_proto(self.placement.to_host(h).to(torch.bfloat16)))

    def decode_gradient(self, msg, sent, out_shape):
        return self.placement.to_device(self._read(msg.grad, out_shape).float())

    def check_gradient(self, msg, sent, out_shape):
        return scale_of(self._read(msg.grad, out_shape))

    def decode_activation(self, msg, ids):
        pl = self.placement
        x = pl.to_device(self._read(msg.hidden, (*ids.shape, self.stage.hidden_size)).float(), pl.compute_dtype)
        x.requires_grad_(True)
        return x, x, None

    def encode_gradient(self, msg, x, received, dst):
        msg.grad.CopyFrom(tensor_to_proto(self.placement.to_host(x.grad).to(torch.bfloat16)))

    def check_activation(self, msg, ids):
        return scale_of(self._read(msg.hidden, (*ids.shape, self.stage.hidden_size)))


if __name__ == "__main__":
    from peer.cli import main

    main()
