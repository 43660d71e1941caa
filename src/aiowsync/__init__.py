"""aiowsync: versioned, tear-free async broadcast of PyTorch weights."""

from ._auth import CurveKeys
from ._blocking import BlockingScheme, blocking
from ._channel import ChannelFactory, MemoryChannelFactory, ZmqChannelFactory
from ._config import Heartbeats, Timeouts
from ._dist_plane import Backend
from ._distributed import DistributedPlane, DistributedWeightSyncScheme
from ._exceptions import (
    ConnectError,
    ExperimentalWarning,
    LayoutMismatchError,
    LostDuringSendError,
    NotConnectedError,
    ProtocolError,
    RefusedError,
    RemoteApplyError,
    SenderGoneError,
    TransportError,
    WeightSyncError,
    WeightSyncTimeout,
    WorkerLostError,
)
from ._guard import ReadGuard
from ._layout import Layout, TensorSpec
from ._lease import Lease
from ._memory_plane import MemoryPlane
from ._outcome import PendingSend, SendResult
from ._plane import DataPlane
from ._receiver import Hook
from ._scheme import SchemeOptions, WeightSyncScheme
from ._shared_mem import SharedMemWeightSyncScheme
from ._shm_plane import SharedMemPlane, SwitchMode
from ._strategy import StrategyName, WeightStrategy
from ._weights import WeightsLike
from ._workers import WorkerState, WorkerStatus, WorkerTable

__version__ = "0.1.0"

__all__ = [
    # schemes
    "DistributedWeightSyncScheme",
    "PendingSend",
    "SendResult",
    "SharedMemWeightSyncScheme",
    "WeightSyncScheme",
    "SchemeOptions",
    "ReadGuard",
    "Lease",
    # synchronous code
    "blocking",
    "BlockingScheme",
    # data planes
    "DataPlane",
    "DistributedPlane",
    "MemoryPlane",
    "SharedMemPlane",
    # control channels
    "ChannelFactory",
    "CurveKeys",
    "MemoryChannelFactory",
    "ZmqChannelFactory",
    # configuration
    "Heartbeats",
    "Timeouts",
    # weights
    "Backend",
    "Hook",
    "Layout",
    "StrategyName",
    "SwitchMode",
    "TensorSpec",
    "WeightStrategy",
    "WeightsLike",
    # status
    "WorkerState",
    "WorkerStatus",
    "WorkerTable",
    # errors
    "ConnectError",
    "ExperimentalWarning",
    "LayoutMismatchError",
    "LostDuringSendError",
    "NotConnectedError",
    "ProtocolError",
    "RefusedError",
    "RemoteApplyError",
    "SenderGoneError",
    "TransportError",
    "WeightSyncError",
    "WeightSyncTimeout",
    "WorkerLostError",
]
