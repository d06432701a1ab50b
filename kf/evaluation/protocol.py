"""The grader ↔ runner wire format: msgpack maps over a socket, tensors as ``torch.save`` bytes.

Nothing a runner sends is unpickled by the grader: control data is plain msgpack and
tensor payloads are opened only with ``torch.load(weights_only=True)``, in a
candidate-free reference runner.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["decode", "encode"]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(dict[str, Any])


def encode(message: dict[str, Any]) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> dict[str, Any]:
    return _decoder.decode(data)
