"""Sans-IO wire protocol: message types, codec and per-role state machine.

This package imports neither zmq, torch nor anyio.

May import: aiowsync._exceptions.
"""

from ._codec import MAX_FRAME, decode, encode
from ._messages import (
    MAX_LEASED,
    MAX_MODELS,
    PROTOCOL_VERSION,
    SENDER_INDEX,
    Ack,
    Bye,
    Heartbeat,
    Hello,
    Message,
    Nack,
    ParamValue,
    Refuse,
    TensorDesc,
    Update,
    Welcome,
)
from ._state import TRANSITIONS, Connection, Role, State

__all__ = [
    "MAX_FRAME",
    "MAX_LEASED",
    "MAX_MODELS",
    "PROTOCOL_VERSION",
    "SENDER_INDEX",
    "TRANSITIONS",
    "Ack",
    "Bye",
    "Connection",
    "Heartbeat",
    "Hello",
    "Message",
    "Nack",
    "ParamValue",
    "Refuse",
    "Role",
    "State",
    "TensorDesc",
    "Update",
    "Welcome",
    "decode",
    "encode",
]
