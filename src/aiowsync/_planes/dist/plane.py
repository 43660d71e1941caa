"""The torch.distributed data plane: versions sent bucket by bucket on groups of our own.

The sender plane holds private slots, a :class:`~aiowsync._planes.dist.buckets.Packer` that
packs a version into its slot while it is sent, and the
:class:`~aiowsync._planes.dist.groups.SenderGroups` it sends on (a TCP store and a cache of
process groups, one per set of receivers). A receiver receives into
whichever of its two slots the model does not run, and the scheme switches the model to it
only once every bucket arrived.

Every blocking call here runs in a worker thread and has a deadline.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from aiowsync._copy.engine import CopyPolicy
from aiowsync._exceptions import TransportError, WeightSyncError
from aiowsync._util.shield import to_the_end
from aiowsync._util.text import first_line
from aiowsync._weights.layout import Layout

from ..base import Delivery, Member, Params, SenderPlane, WeightSource
from ..slot_table import Slot, SlotTable
from .buckets import Image, Packer, choose_bucket_bytes
from .chain import ChainLimits
from .collectives import Backend
from .delivery import DistDelivery, TransferChain
from .groups import (
    FORM_TIMEOUT,
    Group,
    SenderGroups,
    Topology,
    host_of,
    local_ip_towards,
)
from .links import LinkPace, stall_limit
from .send import send_buckets
from .trailers import Trailers

__all__ = [
    "Backend",
    "DistSenderPlane",
    "host_of",
    "local_ip_towards",
]


HELD_VERSIONS = 64
"""Published versions whose models' slots the plane remembers (to move only what members
lack); a member holding an older one gets every model."""


def sections_param(moved: Sequence[int]) -> str:
    """The models a delivery moves, as its update says them: their numbers, comma-separated."""
    return ",".join(map(str, moved))


@dataclass(slots=True)
class _Image:
    image: Image
    readers: int = 0
    """Routes handed out for the slot's version whose transfer has not ended."""


class DistSenderPlane(SenderPlane):
    """Private sender slots, packed on the way out, sent on a cache of process groups.

    With digests, each bucket is hashed once it is packed and sent, while it is on the wire;
    the digest follows the version's last bucket, sealed with a key that the update carries
    (see :mod:`~aiowsync._planes.digest`).
    """

    digests_follow = True

    def __init__(
        self,
        *,
        backend: Backend,
        bucket_bytes: int | None,
        members: int = 1,
        host: str,
        device: torch.device,
        max_slots: int = 4,
        form_timeout: float = FORM_TIMEOUT,
        announce_host: bool = False,
        chain_wait: float,
        topology: Topology = "star",
    ) -> None:
        self.backend: Backend = backend
        self.topology: Topology = topology
        self.form_timeout = form_timeout
        self._bucket_choice = bucket_bytes
        self._members = members
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
        self._held: dict[int, dict[str, int]] = {}
        """By published version (the latest few), the version that last wrote each model:
        itself for the models it wrote, an earlier one for those it carried."""
        self._homes: dict[int, dict[str, int]] = {}
        """By published version, the version whose slot holds each model's bytes: as
        :attr:`_held`, but itself for the carried models it took a copy of."""
        self._latest: int | None = None
        self._writes: dict[int, frozenset[str]] = {}
        """By slot being staged, the models it writes."""
        self._copied: dict[int, frozenset[str]] = {}
        """By slot being staged, the carried models it holds a copy of."""

    # -- set-up -------------------------------------------------------------------------------

    def setup(self, layout: Layout) -> None:
        self.layout = layout
        self.bucket_bytes = self._bucket_choice or choose_bucket_bytes(
            layout.total_bytes, self.topology, self._members
        )
        self._packer = Packer(layout, self.bucket_bytes, self.device, self._policy)
        self.buckets = self._packer.buckets
        self._pace = LinkPace(self.buckets.ranges)
        self._trailers = Trailers(self._packer, self.device, HELD_VERSIONS)
        """By version, the digest its transfers end with."""
        for _ in range(2):
            self._slots.add()
        self._groups.open()

    def welcome_params(self) -> Params:
        return {
            **({"store_host": self.host} if self.announce_host else {}),
            "store_port": self._groups.port,
            "store_key": self._groups.secret.hex(),
            "backend": self.backend,
            "bucket_bytes": self.bucket_bytes,
        }

    # -- slots --------------------------------------------------------------------------------

    def reserve(self, pinned: set[int]) -> int:
        # Receivers copy each version into memory of their own: only the slots holding the
        # latest version's models (what joining workers are brought up to) and slots still
        # being sent must stay.
        if self._closed:
            raise WeightSyncError("the distributed plane is closed")
        keep = self._holders(self._latest) if self._latest is not None else set()
        with self._lock:
            return self._slots.reserve(
                lambda s: s.value.readers == 0 and s.version not in keep,
                lambda: (
                    f"all {len(self._slots)} sender slots are being transferred; "
                    "a stalled transfer holds them"
                ),
            )

    async def stage(self, slot: int, source: WeightSource) -> None:
        image = self._slots[slot].value.image
        snapshot = source.snapshot()
        everything = frozenset(self.layout.sections)
        self._writes[slot] = everything - snapshot.carry
        carried = self._carried_copies(snapshot.carry)
        self._copied[slot] = snapshot.carry if carried else frozenset()
        if snapshot.carry or snapshot.cast:
            # Some models (the others stay in the slots that hold them, and travel from
            # there), or a cast to the wire dtype: packed now, tensor by tensor (the copy runs
            # to its end even if cancelled).
            def fill() -> None:
                self._packer.copy_models(image, carried)
                self._packer.fill(image, snapshot)

            await to_the_end(anyio.to_thread.run_sync(fill))
        else:
            # Only checked here: packing happens during the transfer, bucket by bucket,
            # overlapping the wire.
            self._packer.start(image, snapshot)

    def _carried_copies(self, carry: frozenset[str]) -> dict[int, Image]:
        """The carried models a version staged now takes a copy of (by number, each with the
        image it is copied from): none while the latest version's bytes lie in few slots,
        all where carrying them from where they lie would leave the next send no slot (each
        model sent alone spreads a version over a slot per model)."""
        if not carry or self._latest is None:
            return {}
        homes = self._homes[self._latest]
        if len({homes[name] for name in carry}) + 1 <= max(0, self.max_slots - 2):
            return {}
        return {
            number: self._slot_of(homes[name]).value.image
            for number, name in enumerate(self.layout.sections)
            if name in carry
        }

    def _holders(self, version: int) -> set[int]:
        """The versions whose slots hold ``version``'s models."""
        return set(self._homes[version].values())

    def moved(self, version: int, since: int | None) -> list[int]:
        """The models (by their number in the layout) a delivery of ``version`` moves to
        members that hold ``since``: those whose bytes differ (all, when ``since`` is None
        or forgotten)."""
        held = self._held[version]
        before = self._held.get(since) if since is not None else None
        return [
            number
            for number, name in enumerate(self.layout.sections)
            if before is None or before.get(name) != held[name]
        ]

    def publish(self, slot: int, version: int) -> None:
        if self._closed:
            raise WeightSyncError("the distributed plane is closed")
        written = self._writes.pop(slot, frozenset(self.layout.sections))
        copied = self._copied.pop(slot, frozenset())
        latest = self._latest
        held, homes = {}, {}
        for name in self.layout.sections:
            if name in written:
                held[name] = homes[name] = version
            else:
                assert latest is not None, "a version of some models needs one before it"
                held[name] = self._held[latest][name]
                homes[name] = version if name in copied else self._homes[latest][name]
        with self._lock:
            self._slots.publish(slot, version)
            self._held[version], self._homes[version] = held, homes
            self._latest = version
            for old in sorted(self._held)[:-HELD_VERSIONS]:
                del self._held[old], self._homes[old]

    def digest_after(self, version: int, *, given: str | None, hashed: bool) -> None:
        self._trailers.set(version, given=given, hashed=hashed)

    def digest_param(self, version: int) -> str | None:
        return self._trailers.param(version)

    def release(self, slot: int) -> None:
        self._writes.pop(slot, None)
        self._copied.pop(slot, None)
        self._slots.release(slot).value.image.source = None

    def deliver(
        self,
        version: int,
        members: Sequence[Member],
        deadline: float,
        *,
        purpose: str = "",
        since: int | None = None,
    ) -> Delivery:
        self._slot_of(version)
        moved = self.moved(version, None if purpose == "join" else since)
        if not members:
            return self._delivery(version, None, deadline, {}, moved)
        route = self.route(members, version, purpose)
        left = max(0.001, deadline - time.monotonic())
        params = {**self.route_params(route, left), "sections": sections_param(moved)}
        return self._delivery(version, route, deadline, params, moved)

    def _delivery(
        self, version: int, route: Group | None, deadline: float, params: Params, moved: list[int]
    ) -> DistDelivery:
        star = self.topology == "star"
        return DistDelivery(self, self.chain, star, version, route, deadline, params, moved)

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
            holders = self._holders(version)
            for slot in self._slots:
                if slot.version in holders:
                    slot.value.readers += 1
        return self._groups.route(members, purpose)

    def route_params(self, route: Group, timeout: float) -> Params:
        params = self._groups.params(route, timeout)
        limits = self.chain_limits()
        if limits is not None:
            params["topology"] = "chain"  # each member forwards to the next
            params.update(limits.params())
        return params

    def chain_limits(self) -> ChainLimits | None:
        """How long a chain's links may stall now (None for a star: its members wait on the
        sender alone, for the deadline)."""
        if self.topology != "chain":
            return None
        return ChainLimits.for_pace(self._pace.bucket_seconds)

    def _peers(self, route: Group) -> dict[int, int]:
        """The ranks the sender sends a version on ``route`` to, each with its worker index:
        every member of a star, the first member of a chain."""
        workers = route.workers if self.topology == "star" else route.workers[:1]
        return dict(enumerate(workers, start=1))

    def forget(self, worker: int) -> None:
        """Drop every group that counts ``worker`` (lost, replaced or gone)."""
        self._groups.forget(worker)
        self._groups.last.discard(worker)  # a new process under that index starts trusted

    def receive_failed(self, worker: int) -> None:
        """Drop every group that counts ``worker``: it let go of its side of the one it
        failed on (a send that found the group dead would fail and retry)."""
        self._groups.forget(worker)

    def distrust(self, workers: set[int]) -> None:
        """Later chains put ``workers`` last, where they forward to nobody."""
        self._groups.last |= workers

    # -- transfer (in a worker thread) --------------------------------------------------------

    def transfer(
        self,
        version: int,
        route: Group,
        deadline: float,
        after: threading.Event | None = None,
        moved: Sequence[int] | None = None,
    ) -> None:
        """Send ``version`` to ``route``'s members, packing it on the way if not yet packed.

        With ``after``, waits for that event first (the previous transfer's end). Any failure,
        even before the first collective, drops the group (which makes its other members fail
        fast, and keeps a later transfer from meeting receivers still waiting on this one) and
        raises :class:`TransportError`, so a retry forms a fresh group.
        """
        failure = None
        holders = self._holders(version)
        try:
            if after is not None and not after.wait(max(0.0, deadline - time.monotonic())):
                raise TransportError("an earlier transfer did not finish in time")
            images = [
                self._slot_of(self._homes[version][name]).value.image
                for name in self.layout.sections
            ]
            numbers = range(len(images)) if moved is None else moved
            wanted = set(numbers)
            indices = [i for i, span in enumerate(self.buckets.span_of) if span in wanted]
            peers = self._peers(route)
            trailer = self._trailers.get(version)
            hashing = trailer is not None and trailer.hashing

            def follow() -> torch.Tensor | None:
                return None if trailer is None else self._trailers.sealed(trailer, images)

            # The sender's links share its bandwidth: a bucket to each peer takes that many
            # bucket times.
            stall = stall_limit(self._pace.bucket_seconds * len(peers))

            def send(pg: Any) -> None:
                started = time.monotonic()
                send_buckets(
                    pg,
                    self._packer,
                    images,
                    indices,
                    peers,
                    deadline,
                    stall=stall,
                    backend=self.backend,
                    device=self.device,
                    hashing=hashing,
                    follow=follow,
                )
                # The links' pace, for the limits of the next transfers.
                self._pace.observe(time.monotonic() - started, indices, len(peers))

            self._groups.run(route, deadline, send)
        except Exception as exc:  # every failure, whatever raised it, ends in a dropped group
            failure = first_line(exc)
        finally:
            self._groups.done(route, failed=failure is not None)
            with self._lock:
                for s in self._slots:
                    if s.version in holders:
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

    def close(self) -> None:
        self._closed = True
        self._groups.close()
        self._policy.close(wait=False)
