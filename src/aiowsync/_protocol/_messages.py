"""Control-plane message types.

Every message is a frozen, keyword-only :class:`msgspec.Struct`. Decoding enforces every
constraint (types, ranges, lengths, patterns); cross-field rules live in ``__post_init__``,
which msgspec runs both when code builds a message and when a frame is decoded.
"""

from __future__ import annotations

import re
from typing import Annotated, Final, TypeAlias

import msgspec

__all__ = [
    "PROTOCOL_VERSION",
    "SENDER_INDEX",
    "Ack",
    "Bye",
    "Heartbeat",
    "Hello",
    "Message",
    "Nack",
    "ParamValue",
    "Refuse",
    "TensorDesc",
    "Update",
    "Welcome",
]

PROTOCOL_VERSION: Final = 7
"""Raised whenever a message changes incompatibly (2: Hello lost transport and credential,
Welcome lost missed_beats; 3: Hello gained host and problem; 4: Ack, Nack and Heartbeat
gained leased; Welcome gained proof, which the sender's updates and beats carry; 5: the
distributed plane's welcome gained store_key, its store's secret; 7: Hello gained pid_ns)."""
SENDER_INDEX: Final = -1
"""The ``worker_idx`` the sender uses in messages it originates (heartbeats)."""

MAX_TEXT: Final = 64 * 1024
MAX_NAME: Final = 256
MAX_TENSORS: Final = 1_000_000
MAX_DIMS: Final = 32
MAX_MODELS: Final = 256
"""The most models one scheme holds (``models=``)."""
MAX_PARAMS: Final = 4 * MAX_MODELS
"""The most entries of an update's parameters: a plane may give each model a few of its own
(the shared-memory plane names each model's slot file and its size)."""
MAX_LEASED: Final = 64
"""The most versions one receiver's leases may hold in the sender's memory at once."""
MIN_BEAT_INTERVAL: Final = 0.01
"""Seconds; a faster beat would only burn a core."""

_FINGERPRINT = re.compile(r"^[0-9a-f]{64}$")
Proof = Annotated[str, msgspec.Meta(max_length=32)]
"""The sender's secret of :class:`Welcome`, carried by what it sends later."""

Version = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
WorkerIndex = Annotated[int, msgspec.Meta(ge=0, le=2**31)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
Dim = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
ParamValue: TypeAlias = str | int
Leased = Annotated[tuple[Version, ...], msgspec.Meta(max_length=MAX_LEASED)]
Params = Annotated[dict[Name, ParamValue], msgspec.Meta(max_length=MAX_PARAMS)]


class _Base(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag=True):
    pass


class TensorDesc(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One row of a layout as it travels: key, dtype name and shape."""

    key: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    dtype: Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9_]{1,32}$")]
    shape: Annotated[tuple[Dim, ...], msgspec.Meta(max_length=MAX_DIMS)]


class Hello(_Base, frozen=True, tag="hello"):
    """Receiver -> sender: first message of the handshake."""

    protocol: Annotated[int, msgspec.Meta(ge=0, le=2**16)]
    model_id: Name
    worker_idx: WorkerIndex
    fingerprint: str
    layout: Annotated[tuple[TensorDesc, ...], msgspec.Meta(max_length=MAX_TENSORS)] = ()
    pid: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)] = 0
    host: Name = ""
    """The receiver's host name, as the sender reports it in its worker table."""
    pid_ns: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = 0
    """The receiver's pid namespace (see :func:`aiowsync._util.pids.pid_namespace`; 0 when
    unknown): a sender that watches its receivers' processes refuses one whose ``pid`` it
    cannot read as its own."""
    problem: Text = ""
    """Not empty: the receiver cannot start, and says why (the sender refuses it and keeps
    the text for its worker table and its errors)."""

    def __post_init__(self) -> None:
        if not _FINGERPRINT.match(self.fingerprint):
            raise ValueError("fingerprint must be 64 lowercase hex digits")


class Welcome(_Base, frozen=True, tag="welcome"):
    """Sender -> receiver: handshake accepted; ``params`` describe the data plane."""

    model_id: Name
    worker_idx: WorkerIndex
    session: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{32}$")]
    version: Version
    proof: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{32}$")]
    """A secret of this sender, which its updates and beats carry and receivers never send:
    a process that takes the sender's address after it died cannot produce it."""
    params: Params = {}
    heartbeat_interval: Annotated[float, msgspec.Meta(ge=MIN_BEAT_INTERVAL, le=3600)] = 1.0


class Refuse(_Base, frozen=True, tag="refuse"):
    """Sender -> receiver: handshake refused, with a reason meant for humans."""

    reason: Text


class Update(_Base, frozen=True, tag="update"):
    """Sender -> receiver: ``version`` is staged; ``params`` say where.

    ``attempt`` counts retries of one version: a transport that moves the bytes after the
    announcement (a collective) may announce the same version again, with a higher attempt,
    to the receivers whose transfer failed.
    """

    version: Version
    params: Params = {}
    attempt: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 0
    proof: Proof = ""
    """The welcome's ``proof``: a receiver applies no update without it."""


class Ack(_Base, frozen=True, tag="ack"):
    """Receiver -> sender: ``version`` is now the receiver's live version."""

    worker_idx: WorkerIndex
    version: Version
    leased: Leased = ()
    """The versions the receiver's leases read in the sender's memory, as of this answer
    (the sender keeps them; see :class:`Heartbeat`)."""


class Nack(_Base, frozen=True, tag="nack"):
    """Receiver -> sender: ``version`` could not be applied; ``error`` says why."""

    worker_idx: WorkerIndex
    version: Version
    error: Text
    retryable: bool = False
    """The bytes did not arrive (a failed transfer); the live model is untouched."""
    running: Annotated[int, msgspec.Meta(ge=-1, le=2**62)] = -1
    """The version the receiver's model runs now (``version`` if the switch happened before
    the failure): of the versions this answer settles, the sender keeps only that one for
    this receiver. -1: not said, and the nacked version stays kept too."""
    leased: Leased = ()
    """As in :class:`Ack`."""
    forwarded_by: Annotated[int, msgspec.Meta(ge=-1, le=2**31)] = -1
    """In a chain, the member that forwarded this receiver the bytes that failed its digest
    check (-1: none, or the bytes came from the sender)."""


class Heartbeat(_Base, frozen=True, tag="beat"):
    """Either way: proof of life. ``version`` is the sender's latest or the receiver's live one."""

    worker_idx: Annotated[int, msgspec.Meta(ge=SENDER_INDEX, le=2**31)]
    session: Annotated[str, msgspec.Meta(max_length=32)] = ""
    version: Annotated[int, msgspec.Meta(ge=-1, le=2**62)] = -1
    proof: Proof = ""
    """From the sender: the welcome's ``proof`` (a beat without it confirms nothing)."""
    leased: Leased | None = None
    """From a receiver, on the connection its answers take (so in order with them): the
    versions its leases read in the sender's memory, all of them; the newest report wins.
    None: not said (the beats of the receiver's beat thread, which travel apart)."""
    doing: Annotated[str, msgspec.Meta(max_length=200)] = ""
    """From a receiver's beat thread: what holds it up, if anything (its event loop blocked,
    a version being applied, pull mode outside ``receive()``), for the sender's warnings."""


class Bye(_Base, frozen=True, tag="bye"):
    """Either way: orderly goodbye."""

    reason: Text = ""


Message: TypeAlias = Hello | Welcome | Refuse | Update | Ack | Nack | Heartbeat | Bye
