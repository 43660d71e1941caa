"""The torch.distributed data plane: versions sent bucket by bucket on groups of our own.

The sender plane holds private slots, a :class:`~._dist_buckets.Packer` that packs a version
into its slot while it is sent, and the :class:`~._dist_groups.SenderGroups` it sends on (a
TCP store and a cache of process groups, one per set of receivers). A receiver receives into
whichever of its two slots the model does not run, and the scheme switches the model to it
only once every bucket arrived.

Every blocking call here runs in a worker thread and has a deadline.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from ._copy import CopyPolicy
from ._dist_buckets import Buckets, Image, Packer
from ._dist_delivery import DistDelivery, TransferChain
from ._dist_groups import (
    FORM_TIMEOUT,
    Backend,
    Group,
    Member,
    ReceiverGroups,
    SenderGroups,
    finish,
    host_of,
    local_ip_towards,
    seconds_left,
)
from ._double import DoubleBuffer
from ._exceptions import ProtocolError, TransportError, WeightSyncError
from ._layout import Layout
from ._plane import Delivery, Params, ReceiverPlane, SenderPlane, Staged, WeightSource
from ._protocol import ParamValue
from ._shield import to_the_end
from ._slot_table import Slot, SlotTable
from ._text import first_line

__all__ = [
    "Backend",
    "DistReceiverPlane",
    "DistSenderPlane",
    "Member",
    "host_of",
    "local_ip_towards",
]


@dataclass(slots=True)
class _Image:
    image: Image
    readers: int = 0
    """Routes handed out for the slot's version whose transfer has not ended."""


class DistSenderPlane(SenderPlane):
    """Private sender slots, packed on the way out, sent on a cache of process groups."""

    def __init__(
        self,
        *,
        backend: Backend,
        bucket_bytes: int,
        host: str,
        device: torch.device,
        max_slots: int = 4,
        form_timeout: float = FORM_TIMEOUT,
        announce_host: bool = False,
        chain_wait: float,
    ) -> None:
        self.backend: Backend = backend
        self.form_timeout = form_timeout
        self.bucket_bytes = bucket_bytes
        self.host = host
        self.announce_host = announce_host
        """Tell receivers ``host`` (a ``data_host`` given): otherwise they reach the store on
        the host they reach the control socket on, which may differ from ours (NAT)."""
        self.device = device
        self.max_slots = max_slots
        self._slots = SlotTable(lambda _: _Image(self._packer.new_image()), max_slots=max_slots)
        self.chain = TransferChain(chain_wait)
        """Transfers of successive sends, one after another (a send waits ``chain_wait`` at
        most for the one before it)."""
        self._lock = threading.Lock()
        self._policy = CopyPolicy()
        """How packing copies (its threads are released at close)."""
        self._groups = SenderGroups(backend=backend, host=host, form_timeout=form_timeout)
        self._closed = False

    # -- set-up -------------------------------------------------------------------------------

    def setup(self, layout: Layout) -> None:
        self.layout = layout
        self._packer = Packer(layout, self.bucket_bytes, self.device, self._policy)
        self.buckets = self._packer.buckets
        for _ in range(2):
            self._slots.add()
        self._groups.open()

    def welcome_params(self) -> Params:
        return {
            **({"store_host": self.host} if self.announce_host else {}),
            "store_port": self._groups.port,
            "backend": self.backend,
            "bucket_bytes": self.bucket_bytes,
        }

    # -- slots --------------------------------------------------------------------------------

    def reserve(self, pinned: set[int]) -> int:
        # Receivers copy each version into memory of their own: only the latest version (the
        # one joining workers are brought up to) and slots still being sent must stay.
        if self._closed:
            raise WeightSyncError("the distributed plane is closed")
        latest = max(pinned) if pinned else None
        with self._lock:
            return self._slots.reserve(
                lambda s: s.value.readers == 0 and s.version != latest,
                lambda: (
                    f"all {len(self._slots)} sender slots are being transferred; "
                    "a stalled transfer holds them"
                ),
            )

    async def stage(self, slot: int, source: WeightSource) -> None:
        image = self._slots[slot].value.image
        snapshot = source.snapshot()
        if snapshot.carry or snapshot.cast:
            # Some models only, or a cast to the wire dtype: packed now, tensor by tensor (the
            # copy runs to its end even if the caller is cancelled).
            latest = self._latest_image()
            await to_the_end(anyio.to_thread.run_sync(self._packer.fill, image, snapshot, latest))
            return
        # Only checked here: packing happens during the transfer, bucket by bucket,
        # overlapping the wire.
        self._packer.start(image, snapshot)

    def _latest_image(self) -> list[torch.Tensor] | None:
        """The newest published version's bytes, as the layout's buffers (packed already:
        every send seals its version before the next one stages)."""
        published = [s for s in self._slots if s.version is not None and not s.busy]
        if not published:
            return None
        newest = max(published, key=lambda s: s.version or 0)
        return self.layout.split(newest.value.image.flat)

    def publish(self, slot: int, version: int) -> None:
        if self._closed:
            raise WeightSyncError("the distributed plane is closed")
        self._slots.publish(slot, version)

    def release(self, slot: int) -> None:
        self._slots.release(slot).value.image.source = None

    def deliver(
        self, version: int, members: Sequence[Member], deadline: float, *, purpose: str = ""
    ) -> Delivery:
        self._slot_of(version)
        if not members:
            return DistDelivery(self, version, None, deadline, {})
        route = self.route(members, version, purpose)
        left = max(0.001, deadline - time.monotonic())
        return DistDelivery(self, version, route, deadline, self.route_params(route, left))

    async def seal(self, version: int) -> None:
        await to_the_end(anyio.to_thread.run_sync(self.seal_now, version))

    def seal_now(self, version: int) -> None:
        """Pack whatever of ``version`` is not packed yet, now (blocking).

        Called when a send stops waiting (done, failed or cancelled), and for version 0 at
        start: after that the slot never reads the user's model again.
        """
        with self._lock:
            slots = [s for s in self._slots if s.version == version]
        for slot in slots:
            self._packer.seal(slot.value.image)

    def _slot_of(self, version: int) -> Slot[_Image]:
        return self._slots[self._slots.index_of(version)]

    # -- routes -------------------------------------------------------------------------------

    def route(self, members: Sequence[Member], version: int, purpose: str = "") -> Group:
        """The group for ``members`` (created on first use; ``purpose`` keeps e.g. the groups
        that bring joining workers up to date apart from the groups of ``send()``).

        Until the matching :meth:`transfer` ends, the group is not evicted and the slot of
        ``version`` is not reused."""
        with self._lock:
            self._slot_of(version).value.readers += 1
        return self._groups.route(members, purpose)

    def route_params(self, route: Group, timeout: float) -> Params:
        return self._groups.params(route, timeout)

    def forget(self, worker: int) -> None:
        """Drop every group that counts ``worker`` (lost, replaced or gone)."""
        self._groups.forget(worker)

    # -- transfer (in a worker thread) --------------------------------------------------------

    def transfer(
        self,
        version: int,
        route: Group,
        deadline: float,
        after: threading.Event | None = None,
    ) -> None:
        """Send ``version`` to ``route``'s members, packing it on the way if not yet packed.

        With ``after``, waits for that event first (the previous transfer's end). Any failure,
        even before the first collective, drops the group (which makes its other members fail
        fast, and keeps a later transfer from meeting receivers still waiting on this one) and
        raises :class:`TransportError`, so a retry forms a fresh group.
        """
        failure = None
        try:
            if after is not None and not after.wait(max(0.0, deadline - time.monotonic())):
                raise TransportError("an earlier transfer did not finish in time")
            image = self._slot_of(version).value.image
            self._groups.run(route, deadline, lambda pg: self._send_all(pg, image, route, deadline))
        except Exception as exc:  # every failure, whatever raised it, ends in a dropped group
            failure = first_line(exc)
        finally:
            self._groups.done(route, failed=failure is not None)
            with self._lock:
                for s in self._slots:
                    if s.version == version:
                        s.value.readers -= 1
        if failure is not None:
            # Raised outside the handler: the failed collective's traceback must not keep the
            # group alive, since dropping it is what releases the other members.
            self._groups.drop(route)
            raise TransportError(f"sending to workers {route.workers} failed: {failure}")

    def give_back(self, version: int, route: Group) -> None:
        """Give back a route whose transfer will never run: a transfer past its deadline
        returns at once, dropping the group (so receivers waiting on it fail instead of
        taking a later version's bytes for this one) and the route's hold on the slot."""
        with contextlib.suppress(WeightSyncError):
            self.transfer(version, route, 0.0)

    def _send_all(self, pg: Any, image: Image, group: Group, deadline: float) -> None:
        """Send every bucket to every member, point to point from rank 0.

        Not a broadcast: gloo relays a broadcast through a tree of receivers, so one dead
        receiver would hold up the others behind it until the deadline. Here each member
        depends on the sender alone; a member that fails is left out of the later buckets,
        the others get the whole version, and the failure is raised at the end.
        """
        alive = dict(enumerate(group.workers, start=1))  # rank -> worker index
        failed: dict[int, str] = {}

        def fail(rank: int, exc: BaseException) -> None:
            worker = alive.pop(rank, None)
            if worker is not None:
                failed[worker] = first_line(exc)

        def post(index: int) -> list[tuple[int, Any]]:
            lo, hi = self.buckets.ranges[index]
            works = []
            for rank in list(alive):
                try:
                    works.append((rank, pg.send([image.flat[lo:hi]], rank, index)))
                except RuntimeError as exc:
                    fail(rank, exc)
            return works

        def wait(works: list[tuple[int, Any]]) -> None:
            for rank, work in works:
                try:
                    finish(work, self.backend, seconds_left(deadline), self.device)
                except (RuntimeError, TransportError) as exc:
                    fail(rank, exc)

        # Bucket i+1 is packed and posted while bucket i is still on the wire.
        self._packer.pack(image, 0)
        in_flight = post(0)
        for index in range(1, len(self.buckets.ranges)):
            self._packer.pack(image, index)
            posted = post(index) if alive else []
            wait(in_flight)
            in_flight = posted
        wait(in_flight)
        if failed:
            detail = "; ".join(f"worker {w}: {text}" for w, text in sorted(failed.items()))
            raise TransportError(detail)

    def close(self) -> None:
        self._closed = True
        self._groups.close()
        self._policy.close(wait=False)


class DistReceiverPlane(ReceiverPlane):
    """Two private slots on the model's device; each version is received into the idle one."""

    def __init__(
        self, *, address: str, worker_idx: int, backend: Backend, device: torch.device
    ) -> None:
        self.sender_host = host_of(address)
        self._worker_idx = worker_idx
        self.backend: Backend = backend
        self.device = device
        self._groups = ReceiverGroups(backend)

    def setup(
        self, layout: Layout, welcome: Mapping[str, ParamValue], *, swap: bool = True
    ) -> None:
        self.layout = layout
        port, backend, bucket_bytes = (
            welcome.get("store_port"),
            welcome.get("backend"),
            welcome.get("bucket_bytes"),
        )
        if not isinstance(port, int) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ProtocolError(f"the welcome lacks the store port or bucket size: {welcome}")
        if backend != self.backend:
            raise ProtocolError(
                f"the sender uses backend {backend!r}, this receiver {self.backend!r}"
            )
        self.buckets = Buckets(layout.total_bytes, bucket_bytes)
        # The store and the groups listen on the sender's data host, which need not be the
        # host of the control address (another interface, or a control socket on 0.0.0.0).
        store_host = welcome.get("store_host")
        if isinstance(store_host, str) and store_host:
            self.sender_host = store_host
        self._hostname = local_ip_towards(self.sender_host)
        self._halves = DoubleBuffer(layout, self.device)
        self._port = port

    async def fetch(self, params: Mapping[str, ParamValue]) -> Staged:
        # On shutdown the wait is abandoned; the receive ends by its own deadline.
        return await anyio.to_thread.run_sync(self.fetch_blocking, params, abandon_on_cancel=True)

    def fetch_blocking(self, params: Mapping[str, ParamValue]) -> Staged:
        """Receive the announced version into the idle half (blocking)."""
        name, members, timeout_ms, form_ms = (
            params.get("group"),
            params.get("members"),
            params.get("timeout_ms"),
            params.get("form_ms", params.get("timeout_ms")),
        )
        if not isinstance(name, str) or not isinstance(members, str):
            raise ProtocolError(f"update parameters lack a group: {dict(params)}")
        if not isinstance(timeout_ms, int) or timeout_ms <= 0:
            raise ProtocolError(f"update parameters lack a positive timeout: {dict(params)}")
        if not isinstance(form_ms, int) or form_ms <= 0:
            raise ProtocolError(f"update parameters have a bad group timeout: {dict(params)}")
        try:
            workers = [int(w) for w in members.split(",")]
        except ValueError:
            raise ProtocolError(f"bad member list {members!r}") from None
        if self._groups.is_dead(name):
            raise TransportError(f"group {name} was torn down after an earlier failure")
        deadline = time.monotonic() + timeout_ms / 1000
        # The half the model does not run; its bytes are garbage until every bucket arrived.
        index, staged = self._halves.spare()
        flat = self._halves.flats[index]
        if self._worker_idx not in workers:
            raise ProtocolError(f"worker {self._worker_idx} is not a member of {members!r}")
        cached = self._groups.cached(name)
        failure = None
        try:
            self._receive(name, cached, workers, flat, deadline, form_ms / 1000)
        except (RuntimeError, ValueError, TransportError) as exc:
            failure = first_line(exc)
        if failure is not None:
            # Outside the handler, so that no traceback keeps the failed group alive.
            self._groups.discard(name)
            raise TransportError(f"receiving the version failed: {failure}")
        return staged

    def _receive(
        self,
        name: str,
        cached: Any,
        workers: list[int],
        flat: torch.Tensor,
        deadline: float,
        form: float,
    ) -> None:
        if cached is None:
            rank = workers.index(self._worker_idx) + 1
            store_at = (self.sender_host, self._port)
            pg = self._groups.join(
                store_at, name, rank, len(workers) + 1, self._hostname, deadline, form
            )
        else:
            pg = cached
        works = [pg.recv([flat[lo:hi]], 0, i) for i, (lo, hi) in enumerate(self.buckets.ranges)]
        for work in works:
            finish(work, self.backend, seconds_left(deadline), self.device)
        self._groups.keep(name, pg)

    def show(self, staged: Staged) -> Staged:
        self._halves.made_live(self._halves.live_index(staged))
        return staged

    def close(self) -> None:
        self._groups.close()
