"""The leader-worker wire protocol: newline-delimited JSON over a worker's stdin/stdout. No MLX here."""

from neuron.rpc.codec import ProtocolError, decode_reply, decode_request, encode
from neuron.rpc.messages import *  # noqa: F403
from neuron.rpc.messages import __all__ as _messages_all

__all__ = ["ProtocolError", "decode_reply", "decode_request", "encode", *_messages_all]
