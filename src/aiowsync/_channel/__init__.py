"""Control channels: the interface, the ZeroMQ implementation and the in-memory twin.

May import: aiowsync._exceptions, aiowsync._config, aiowsync._util, aiowsync._protocol.
"""

from ._address import LOCAL_BIND, is_loopback_address, reachable, resolve_local
from ._base import ChannelFactory, PeerId, ReceiverChannel, SenderChannel
from ._memory import MemoryChannelFactory
from ._socket_dir import missing_socket
from ._zmq import ZmqChannelFactory

__all__ = [
    "LOCAL_BIND",
    "ChannelFactory",
    "MemoryChannelFactory",
    "PeerId",
    "ReceiverChannel",
    "SenderChannel",
    "ZmqChannelFactory",
    "is_loopback_address",
    "missing_socket",
    "reachable",
    "resolve_local",
]
