"""TEMPORARY: old home of the plane interface, kept while the restructure moves its importers
to ``_plane`` and ``_shm_plane``; removed before the restructure lands."""

from ._plane import Params, ReceiverPlane, SenderPlane, Source, Staged
from ._shm_plane import SharedMemReceiverPlane, SharedMemSenderPlane, SwitchMode

__all__ = [
    "Params",
    "ReceiverPlane",
    "SenderPlane",
    "SharedMemReceiverPlane",
    "SharedMemSenderPlane",
    "Source",
    "Staged",
    "SwitchMode",
]
