"""The data-plane interface: how a version's bytes get from the sender to the receivers.

A :class:`DataPlane` is configuration (it pickles with the scheme) that makes one
:class:`SenderPlane` in the trainer and one :class:`ReceiverPlane` in each worker. The engines
drive them through these operations only; what a transport does inside them is its own
business.

Sender, per version:

1. :meth:`SenderPlane.reserve` on the loop: a slot holding none of the ``pinned`` versions;
2. :meth:`SenderPlane.stage`: check the source and copy it into the slot (in a thread when the
   copy is long); the slot goes back with :meth:`SenderPlane.release` if this fails;
3. :meth:`SenderPlane.publish` on the loop: the slot holds ``version`` from now on;
4. :meth:`SenderPlane.deliver`: a :class:`Delivery` whose ``params`` the update carries, whose
   :meth:`Delivery.run` moves the bytes to the members (nothing to do where receivers read
   the sender's memory) and whose :meth:`Delivery.finish` ends every read of the source.

Receiver, per version: :meth:`ReceiverPlane.fetch` (or :meth:`ReceiverPlane.fetch_nowait`
when that needs no wait) turns an update's parameters into a :class:`Staged` version that the
engine switches the model to.

Guarantees every plane keeps: a staged version is never visible to a receiver before its
update names it; a slot that holds a pinned version is never rewritten; ``Delivery.finish``
runs to its end even when its caller is cancelled, so the caller's tensors are never read
after ``send()`` returned.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .._config import Timeouts
from .._protocol import ParamValue
from .._weights.layout import Layout

__all__ = [
    "DataPlane",
    "Delivery",
    "InPlace",
    "Member",
    "Params",
    "ReceiverContext",
    "ReceiverPlane",
    "Retries",
    "SenderContext",
    "SenderPlane",
    "Source",
    "Staged",
    "WeightSource",
]

Params = dict[str, ParamValue]
Member = tuple[int, str]
"""A receiver as a plane knows it: (worker index, session)."""


@dataclass(frozen=True, slots=True)
class Source:
    """What to stage: flat buffers laid out like the layout (one copy each), or named tensors."""

    buffers: tuple[torch.Tensor, ...] | None = None
    tensors: Mapping[str, torch.Tensor] | None = None
    model: bool = False
    """The tensors are the sender's own model's: they come back on every send, so what is
    prepared to copy them is worth keeping from the first send on."""
    carry: frozenset[str] = frozenset()
    """Models (sections of the layout) this version takes unchanged from the latest one:
    ``tensors`` holds none of their keys, and the plane keeps their bytes as they were."""
    cast: bool = False
    """Some tensors are of another dtype than the layout's (a wire dtype): they must be
    copied tensor by tensor with a cast, never as raw bytes."""


class WeightSource(abc.ABC):
    """Where a send's weights come from; built once by the scheme and handed to the plane.

    :meth:`snapshot` is called by the plane, in its staging thread when the copy is long: it
    checks the weights against the layout and returns them, raising before a byte is written
    when they do not fit.
    """

    carry: frozenset[str] = frozenset()
    """Models it leaves out (a send of some models of several): their bytes stay those of
    the latest version (its snapshot's ``carry``)."""

    @property
    @abc.abstractmethod
    def key(self) -> object:
        """Names where the weights come from (the same model on every send, or one weights
        object): a plane may start copying what the last staging from the same key copied
        while :meth:`snapshot` checks, and keeps that copy only if it was right."""

    @abc.abstractmethod
    def snapshot(self) -> Source: ...


@dataclass(frozen=True, slots=True)
class Staged:
    """A staged version on a receiver: the layout's flat buffers and a typed view per key."""

    buffers: list[torch.Tensor]
    views: dict[str, torch.Tensor]
    source: str = ""
    """Where it lives (the slot path for shared memory)."""
    bind_once: bool = False
    """The model stays bound to these views across versions (a window): once bound, the views
    are dropped, since they would only cost memory (about a kilobyte per tensor)."""
    shared: bool = False
    """It lives in memory the sender may reuse once this receiver has said goodbye, so a
    model bound to it needs a private copy before then."""
    digest: str | None = None
    """The sender's digest of these bytes, when it followed them and the plane checked the
    bytes against it as they came (set by the fetch that returned this)."""


class Retries(Protocol):
    """What a :class:`Delivery` may ask of the engine while it moves a version: the members'
    answers, and a new announcement for those worth another attempt."""

    def waiting(self) -> set[int]:
        """Members that have not answered this attempt yet."""
        ...

    def retryable(self) -> list[Member]:
        """Members still connected under the same session whose answer says another attempt
        may succeed (a failed receive)."""
        ...

    def done(self) -> bool:
        """Every member answered (or was lost)."""
        ...

    async def changed(self, timeout: float) -> None:
        """Wait until an answer arrives, a member is lost, or ``timeout`` passes."""
        ...

    async def announce(self, members: Sequence[Member], attempt: int, params: Params) -> bool:
        """Announce the version again to ``members`` with ``params``; their earlier failures
        no longer count. Runs to its end once begun. False if the sender is shutting down
        (nothing was announced)."""
        ...


class Delivery:
    """One version on its way to a set of members (the base moves nothing)."""

    params: Params
    """What the announcement tells the members, beside the version."""

    async def run(self, retries: Retries | None) -> None:
        """Move the version to the members, by the deadline given to :meth:`SenderPlane.deliver`.

        With ``retries``, members whose transfer failed are given further attempts while the
        deadline allows; without, one attempt. Raises :class:`TransportError` when it failed.
        Nothing to do for a plane whose receivers read the sender's memory.
        """
        del retries

    async def finish(self) -> None:
        """After this returns, the plane never reads the source of this version again; it runs
        to its end even if the caller is cancelled."""

    def abandon(self) -> None:
        """This delivery will never run: give back what it holds."""


class InPlace(Delivery):
    """A delivery with nothing to move: the receivers read the staged bytes where they are."""

    def __init__(self, params: Params) -> None:
        self.params = params


class SenderPlane(abc.ABC):
    layout: Layout

    @abc.abstractmethod
    def setup(self, layout: Layout) -> None:
        """Create the first slots for ``layout`` (closed again if this fails)."""

    def welcome_params(self) -> Params:
        """Parameters every receiver needs once, sent in the welcome."""
        return {}

    @abc.abstractmethod
    def reserve(self, pinned: set[int]) -> int:
        """A slot that holds none of the ``pinned`` versions, now busy."""

    @abc.abstractmethod
    async def stage(self, slot: int, source: WeightSource) -> None:
        """Copy ``source.snapshot()`` into ``slot``. A copy once started runs to its end, even
        if the caller is cancelled: the slot must not be handed out while it is written."""

    @abc.abstractmethod
    def publish(self, slot: int, version: int) -> None:
        """``slot`` holds ``version`` from now on."""

    digests_follow: bool = False
    """The plane hashes a version while it moves it, and the digest follows the bytes (see
    :meth:`digest_after`). Otherwise a version is hashed once it is staged
    (:meth:`staged_buffers`), and the update carries its digest."""

    def staged_buffers(self, slot: int) -> list[torch.Tensor]:
        """The layout's flat buffers as the version staged in ``slot`` will hold them once
        published (models it carries taken from the latest version), for its digest.
        Blocking."""
        raise NotImplementedError(f"{type(self).__name__} cannot digest its versions")

    def digest_after(self, version: int, *, given: str | None, hashed: bool) -> None:
        """On a plane whose digests follow the bytes: make every transfer of ``version``
        (about to be published) end with its digest, ``given`` or else (with ``hashed``) one
        of the plane's own hashes, or with none (neither)."""
        raise NotImplementedError(f"{type(self).__name__} sends no digest after the bytes")

    def digest_param(self, version: int) -> str | None:
        """On a plane whose digests follow the bytes: the ``digest`` parameter of an update
        of ``version`` that says one follows them (None: none follows)."""
        raise NotImplementedError(f"{type(self).__name__} sends no digest after the bytes")

    @abc.abstractmethod
    def release(self, slot: int) -> None:
        """Give back a reserved slot whose version was never published."""

    @abc.abstractmethod
    def deliver(
        self,
        version: int,
        members: Sequence[Member],
        deadline: float,
        *,
        purpose: str = "",
        since: int | None = None,
    ) -> Delivery:
        """The delivery of the published ``version`` to ``members`` by ``deadline``
        (monotonic). ``purpose`` keeps apart deliveries that must not share resources (e.g.
        bringing a joining worker up to date, beside sends). ``since``: the oldest version
        the members hold (a plane that moves bytes may leave out the models unchanged since;
        None: move everything)."""

    async def seal(self, version: int) -> None:
        """Stop reading the source of ``version`` (at start, for version 0)."""
        del version

    def forget(self, worker: int) -> None:
        """``worker`` is lost or replaced: drop whatever state involves it."""
        del worker

    def receive_failed(self, worker: int) -> None:
        """``worker`` said its receive of a version failed (a retryable nack): a plane that
        keeps routes between sends stops handing out those that count it, as the worker let
        go of its side of them."""
        del worker

    def distrust(self, workers: set[int]) -> None:
        """``workers`` forwarded bytes that were not the sender's: a plane whose receivers
        forward to each other (a chain) keeps them from forwarding again."""
        del workers

    def process_gone(self, pid: int) -> bool | None:
        """Whether receiver process ``pid`` has ended, where the plane can see it: None for
        receivers on other hosts. A receiver that reads the sender's memory keeps its
        versions pinned until its process ends or it says goodbye."""
        del pid
        return None

    @abc.abstractmethod
    def close(self) -> None: ...


class ReceiverPlane(abc.ABC):
    @abc.abstractmethod
    def setup(
        self, layout: Layout, welcome: Mapping[str, ParamValue], *, swap: bool = True
    ) -> None:
        """Prepare for ``layout``; ``swap`` says the model will point into what is fetched."""

    def fetch_nowait(self, params: Mapping[str, ParamValue]) -> Staged | None:
        """The staged version named by ``params`` if it can be had without waiting (the bytes
        are already in place); None when :meth:`fetch` must be awaited."""
        del params
        return None

    @abc.abstractmethod
    async def fetch(self, params: Mapping[str, ParamValue]) -> Staged:
        """The staged version named by ``params``, as flat buffers and typed views."""

    def show(self, staged: Staged) -> Staged:
        """For swap mode: what the model should be bound to so that it runs ``staged``.

        Called inside the switch. The default is ``staged`` itself (re-bind every tensor);
        a plane may instead re-point a fixed window and return that window every time.
        """
        return staged

    def lease_buffers(self, staged: Staged) -> list[torch.Tensor] | None:
        """The flat buffers of ``staged`` (fetched, not shown) as memory that keeps its bytes
        while the sender keeps the version: a lease reads them. None where this plane's
        buffers are its own and later versions are written into them."""
        return staged.buffers if staged.shared and staged.buffers else None

    @abc.abstractmethod
    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class SenderContext:
    """What a sender plane is made from, beside its own configuration."""

    bind: str
    """The control address the sender binds (its host is where a network plane listens)."""
    tensors: Mapping[str, torch.Tensor]
    """The weights at init (their device is where a plane keeps its slots)."""
    timeouts: Timeouts
    num_workers: int = 1
    """The workers the sender expects."""


@dataclass(frozen=True, slots=True)
class ReceiverContext:
    """What a receiver plane is made from, beside its own configuration."""

    address: str
    """The sender's control address."""
    worker_idx: int
    tensors: Mapping[str, torch.Tensor]
    """The model's tensors (their device is where a plane receives)."""


class DataPlane(abc.ABC):
    """Configuration of a data plane: makes the sender's half and each receiver's half.

    Pass one to a scheme as ``plane=``; it pickles with the scheme, so receivers build their
    half from the same settings.
    """

    integrity_by_default: bool = False
    """Whether a scheme on this plane digests each version unless told (``integrity=``)."""

    @abc.abstractmethod
    def sender(self, context: SenderContext) -> SenderPlane:
        """The sender's half, made when the sender enters ``async with``."""

    @abc.abstractmethod
    def receiver(self, context: ReceiverContext) -> ReceiverPlane:
        """A receiver's half, made when the receiver connects."""

    def can_swap(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether swap mode may re-point ``tensors`` at this plane's buffers: they must
        live where those buffers do (host memory, for every plane but NCCL's)."""
        return all(t.device.type == "cpu" for t in tensors.values())
