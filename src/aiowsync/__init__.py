"""aiowsync: versioned, tear-free async broadcast of PyTorch weights.

The public names, re-exported from the private packages (see docs/architecture.md).

May import: anything of aiowsync.
"""

from ._channel import ChannelFactory, MemoryChannelFactory, ZmqChannelFactory
from ._channel._auth import CurveKeys
from ._config import Heartbeats, Timeouts
from ._exceptions import (
    ConnectError,
    ConnectFailedError,
    ExperimentalWarning,
    LayoutMismatchError,
    LostDuringSendError,
    NotConnectedError,
    ProtocolError,
    RefusedError,
    RemoteApplyError,
    SenderGoneError,
    SlotsFull,
    TransportError,
    WeightSyncError,
    WeightSyncTimeout,
    WorkerLostError,
)
from ._planes.base import DataPlane
from ._planes.dist.config import DistributedPlane
from ._planes.dist.plane import Backend
from ._planes.memory import MemoryPlane
from ._planes.shm.plane import SharedMemPlane, SwitchMode
from ._receiving.engine import Hook
from ._receiving.guard import ReadGuard
from ._receiving.lease import Lease
from ._scheme.blocking import BlockingScheme, blocking
from ._scheme.distributed import DistributedWeightSyncScheme
from ._scheme.scheme import SchemeOptions, WeightSyncScheme
from ._scheme.shared_mem import SharedMemWeightSyncScheme
from ._sending.outcome import PendingSend, SendResult
from ._sending.workers import WorkerState, WorkerStatus, WorkerTable
from ._weights.flatten import WeightsLike
from ._weights.layout import Layout, TensorSpec
from ._weights.strategy import StrategyName, WeightStrategy

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
    "ConnectFailedError",
    "ExperimentalWarning",
    "LayoutMismatchError",
    "LostDuringSendError",
    "NotConnectedError",
    "ProtocolError",
    "RefusedError",
    "RemoteApplyError",
    "SenderGoneError",
    "SlotsFull",
    "TransportError",
    "WeightSyncError",
    "WeightSyncTimeout",
    "WorkerLostError",
]


def __getattr__(name: str) -> object:
    # The integrations load on first use: `aiowsync.vllm` needs httpx, `aiowsync.torchrl`
    # torchrl, `aiowsync.metrics` prometheus_client; `import aiowsync` needs none of them.
    if name in ("vllm", "torchrl", "metrics"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
