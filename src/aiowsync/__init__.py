"""aiowsync: versioned, tear-free async broadcast of PyTorch weights."""

from ._config import Heartbeats, Timeouts
from ._exceptions import (
    ConnectError,
    LayoutMismatchError,
    NotConnectedError,
    ProtocolError,
    RefusedError,
    RemoteApplyError,
    TransportError,
    WeightSyncError,
    WeightSyncTimeout,
    WorkerLostError,
)
from ._layout import Layout, TensorSpec
from ._strategy import StrategyName, WeightStrategy

__version__ = "0.1.0"

__all__ = [
    # configuration
    "Heartbeats",
    "Timeouts",
    # weights
    "Layout",
    "StrategyName",
    "TensorSpec",
    "WeightStrategy",
    # errors
    "ConnectError",
    "LayoutMismatchError",
    "NotConnectedError",
    "ProtocolError",
    "RefusedError",
    "RemoteApplyError",
    "TransportError",
    "WeightSyncError",
    "WeightSyncTimeout",
    "WorkerLostError",
]
