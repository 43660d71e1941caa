"""Control channels: the interface, the ZeroMQ implementation and the in-memory twin."""

from ._base import ChannelFactory, PeerId, ReceiverChannel, SenderChannel
from ._memory import MemoryChannelFactory
from ._zmq import LOCAL_BIND, ZmqChannelFactory, is_loopback_address, resolve_local

__all__ = [
    "LOCAL_BIND",
    "ChannelFactory",
    "MemoryChannelFactory",
    "PeerId",
    "ReceiverChannel",
    "SenderChannel",
    "ZmqChannelFactory",
    "is_loopback_address",
    "resolve_local",
]
