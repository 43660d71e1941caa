"""The torch.distributed data plane: versions sent bucket by bucket on groups of our own.

The sender runs a TCP store (bound to the control socket's host only) and creates one process
group per set of receivers it sends to, with itself as rank 0. A group is named by a random
token and used as a prefix in the store, so groups never collide and the user's default group
is never touched. Groups are cached by their members (worker index and session, so a restarted
worker gets new groups); a group whose collective failed is dropped at once, which closes its
connections and makes every member's pending receive fail quickly instead of timing out.

Each version is packed into a private sender slot while it is sent: bucket i+1 is packed
while bucket i is on the wire. A receiver receives into whichever of its two slots the model
does not run, and the scheme switches the model to it only once every bucket arrived.

Every blocking call here runs in a worker thread and has a deadline.
"""

from __future__ import annotations

import bisect
import contextlib
import datetime
import logging
import math
import secrets
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from ._exceptions import ProtocolError, TransportError, WeightSyncError
from ._layout import (
    _PARALLEL_COPY_BYTES,
    Layout,
    _copy_share,
    _parallel_copy,
    byte_view,
    fused_copy,
)
from ._planes import Params, ReceiverPlane, SenderPlane, Source, Staged
from ._protocol import ParamValue

__all__ = ["Backend", "DistReceiverPlane", "DistSenderPlane", "Member"]

log = logging.getLogger("aiowsync.dist")

Backend: TypeAlias = Literal["gloo", "nccl"]
Member: TypeAlias = tuple[int, str]
"""A receiver as a group member: (worker index, session)."""

_MAX_GROUPS = 8


def host_of(address: str) -> str:
    """The host part of a ``tcp://host:port`` address."""
    host = (urlsplit(address).hostname or "").strip("[]")
    if not host:
        raise ValueError(f"no host in address {address!r}")
    return host


def local_ip_towards(host: str) -> str:
    """The local address this machine uses to reach ``host`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return str(probe.getsockname()[0])


def _seconds_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransportError("the transfer ran out of time")
    return left


def _new_group(
    backend: Backend,
    store: Store,
    name: str,
    rank: int,
    size: int,
    hostname: str,
    timeout: float,
) -> dist.ProcessGroup:
    """A process group of ``size`` ranks under prefix ``name``: blocks until all have joined."""
    prefixed = PrefixStore(f"aiowsync/{name}/", store)
    span = datetime.timedelta(seconds=timeout)
    pg: Any
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = span
        # Two devices, so two I/O threads: consecutive buckets (tags) alternate between them.
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)] * 2
        pg = dist.ProcessGroupGloo(prefixed, rank, size, options)
    elif backend == "nccl":  # pragma: no cover - needs GPUs
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = span
        pg = dist.ProcessGroupNCCL(prefixed, rank, size, nccl_options)
    else:
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    # ``timeout`` bounded the rendezvous above; from here on each wait has its own deadline.
    set_default = getattr(pg, "_set_default_timeout", None)
    if set_default is not None:
        set_default(_OP_TIMEOUT)
    return pg  # type: ignore[no-any-return]


def _finish(work: Any, backend: Backend, timeout: float, device: torch.device) -> None:
    # c10d keeps whole milliseconds and reads 0 as "no limit" (the group's own, far longer).
    work.wait(datetime.timedelta(milliseconds=max(1, math.ceil(timeout * 1000))))
    if backend == "nccl":  # pragma: no cover - needs GPUs
        torch.cuda.synchronize(device)


_OP_TIMEOUT = datetime.timedelta(hours=1)
"""The groups' own limit on one send or receive. Deadlines are enforced by each wait instead:
a cached group outlives the deadline of the send that formed it."""


class Buckets:
    """Byte ranges of a version's flat image, and which piece of each source lands in each.

    A source is a list of segments ``(global offset, nbytes)`` (a tensor of the layout, or one
    of its flat buffers); a bucket's plan lists ``(segment, start, stop)`` byte ranges within
    segments, so that packing bucket i copies exactly bytes ``ranges[i]`` of the image.
    """

    def __init__(self, total: int, bucket_bytes: int) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.ranges = [(lo, min(lo + bucket_bytes, total)) for lo in range(0, total, bucket_bytes)]
        if len(self.ranges) > 1 and self.ranges[-1][1] - self.ranges[-1][0] < bucket_bytes // 8:
            # A sliver (often just alignment padding) rides with the bucket before it: one
            # collective fewer, for a bucket at most 1/8 larger.
            self.ranges[-2:] = [(self.ranges[-2][0], total)]

    def plan(self, segments: Sequence[tuple[int, int]]) -> list[list[tuple[int, int, int]]]:
        starts = [offset for offset, _ in segments]
        plans: list[list[tuple[int, int, int]]] = []
        for lo, hi in self.ranges:
            pieces = []
            index = max(0, bisect.bisect_right(starts, lo) - 1)
            while index < len(segments) and segments[index][0] < hi:
                offset, nbytes = segments[index]
                a, b = max(lo, offset), min(hi, offset + nbytes)
                if a < b:
                    pieces.append((index, a - offset, b - offset))
                index += 1
            plans.append(pieces)
        return plans


def _plain_pointers(tensors: Sequence[torch.Tensor], device: torch.device) -> list[int]:
    """The tensors' addresses when every one is a plain contiguous CPU tensor (and the slots
    are on the CPU too), else ``[]``: then packing goes through tensor views."""
    if device.type != "cpu":
        return []
    pointers = []
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
            return []
        pointers.append(t.data_ptr())
    return pointers


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return byte_view(t)


@dataclass(slots=True)
class _Group:
    name: str
    members: tuple[Member, ...]
    lock: threading.Lock = field(default_factory=threading.Lock)
    dropped: bool = False
    users: int = 0  # routes handed out whose transfer has not ended
    pg: Any = None
    last_used: float = 0.0


@dataclass(slots=True)
class _SenderSlot:
    flat: torch.Tensor
    version: int | None = None
    busy: bool = False
    readers: int = 0
    source: Source | None = None
    # The source's tensors (detached: they hold its storage while we read it) and addresses.
    source_refs: list[torch.Tensor] | None = None
    source_pointers: list[int] | None = None  # [] when not all plain CPU tensors
    packed: int = 0  # buckets packed so far for ``version``
    complete: threading.Event = field(default_factory=threading.Event)
    pack_lock: threading.Lock = field(default_factory=threading.Lock)


class DistSenderPlane(SenderPlane):
    """Private sender slots, a TCP store and a cache of process groups."""

    transfers = True
    pins_receivers = False

    def __init__(
        self,
        *,
        backend: Backend,
        bucket_bytes: int,
        host: str,
        device: torch.device,
        max_slots: int = 4,
        form_timeout: float = 10.0,
        announce_host: bool = False,
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
        self._slots: list[_SenderSlot] = []
        self._groups: dict[tuple[Member, ...], _Group] = {}
        self._lock = threading.Lock()
        self._store_port = 0
        self._store: TCPStore | None = None
        self._unkeyed: list[str] = []
        """Dropped groups whose rendezvous keys are still in the store."""
        self._keeper: ThreadPoolExecutor | None = None
        """One thread that deletes those keys, on a store connection of its own: the one
        that forms groups is held for as long as a rendezvous waits."""
        self._keeper_store: Store | None = None
        self._closed = False

    # -- set-up -------------------------------------------------------------------------------

    def setup(self, layout: Layout) -> None:
        self.layout = layout
        self.buckets = Buckets(layout.total_bytes, self.bucket_bytes)
        starts = [0]
        for size in layout.buffer_sizes[:-1]:
            starts.append(starts[-1] + size)
        self._buffer_starts = starts
        self._tensor_starts = [starts[s.buffer] + s.offset for s in layout.specs]
        self._tensor_plan = self.buckets.plan(
            [(start, s.nbytes) for start, s in zip(self._tensor_starts, layout.specs, strict=True)]
        )
        self._buffer_plan = self.buckets.plan(list(zip(starts, layout.buffer_sizes, strict=True)))
        for _ in range(2):
            self._add_slot()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind((self.host, 0))
            listener.listen(256)
            # The store serves on our own socket, so it listens on the control host only.
            self._store = TCPStore(
                self.host,
                listener.getsockname()[1],
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=60),
                master_listen_fd=listener.fileno(),
            )
        except BaseException:
            listener.close()
            raise
        # The store owns the listening socket from here on and closes it with itself.
        self._store_port = int(listener.getsockname()[1])
        listener.detach()

    def _add_slot(self) -> _SenderSlot:
        # Zeroed: the alignment gaps between tensors travel too, and must not carry whatever
        # this process's memory held before.
        flat = torch.zeros(self.layout.total_bytes, dtype=torch.uint8, device=self.device)
        slot = _SenderSlot(flat)
        self._slots.append(slot)
        return slot

    def welcome_params(self) -> Params:
        return {
            **({"store_host": self.host} if self.announce_host else {}),
            "store_port": self._store_port,
            "backend": self.backend,
            "bucket_bytes": self.bucket_bytes,
        }

    # -- slots --------------------------------------------------------------------------------

    def reserve(self, pinned: set[int]) -> int:
        if self._closed:
            raise WeightSyncError("the distributed plane is closed")
        latest = max(pinned) if pinned else None
        with self._lock:
            for index, slot in enumerate(self._slots):
                if not slot.busy and slot.readers == 0 and slot.version != latest:
                    slot.busy, slot.version = True, None
                    return index
            if len(self._slots) >= self.max_slots:
                raise WeightSyncError(
                    f"all {len(self._slots)} sender slots are being transferred; "
                    "a stalled transfer holds them"
                )
            slot = self._add_slot()
            slot.busy = True
            return len(self._slots) - 1

    def write(self, slot: int, source: Source) -> None:
        # Packing happens during the transfer, bucket by bucket, overlapping the wire.
        if source.buffers is None and source.tensors is None:
            raise ValueError("empty source")
        s = self._slots[slot]
        s.source, s.packed, s.source_pointers, s.source_refs = source, 0, None, None
        s.complete.clear()

    def publish(self, slot: int, version: int) -> Params:
        if self._closed:
            raise WeightSyncError("the distributed plane is closed")
        s = self._slots[slot]
        s.version, s.busy = version, False
        return {}

    def release(self, slot: int) -> None:
        s = self._slots[slot]
        s.busy, s.version, s.source = False, None, None

    def params_for(self, version: int) -> Params:
        self._slot_of(version)
        return {}

    def _slot_of(self, version: int) -> _SenderSlot:
        for s in self._slots:
            if s.version == version:
                return s
        raise KeyError(f"version {version} is in no slot")

    # -- groups -------------------------------------------------------------------------------

    def route(self, members: Sequence[Member], version: int, purpose: str = "") -> _Group:
        """The group for ``members`` (created on first use; ``purpose`` keeps e.g. the groups
        that bring joining workers up to date apart from the groups of ``send()``).

        Until the matching :meth:`transfer` ends, the group is not evicted and the slot of
        ``version`` is not reused."""
        key = (*sorted(members), (-1, purpose))
        with self._lock:
            self._slot_of(version).readers += 1
            group = self._groups.get(key)
            if group is None:
                group = _Group(secrets.token_hex(8), key)
                self._groups[key] = group
            group.last_used = time.monotonic()
            group.users += 1
            self._evict()
        return group

    def route_params(self, route: _Group, timeout: float) -> Params:
        return {
            "group": route.name,
            "members": ",".join(str(w) for w, _ in route.members if w >= 0),
            "timeout_ms": max(1, int(timeout * 1000)),
            "form_ms": max(1, int(min(timeout, self.form_timeout) * 1000)),
        }

    def _evict(self) -> None:
        idle = sorted((g for g in self._groups.values() if g.users == 0), key=lambda g: g.last_used)
        while len(self._groups) > _MAX_GROUPS and idle:
            group = idle.pop(0)
            self._groups.pop(group.members, None)
            self._retire(group)

    def _retire(self, group: _Group) -> None:
        """Mark ``group`` dropped and let its connections go (call with the lock held)."""
        if not group.dropped:
            self._unkeyed.append(group.name)
        group.dropped, group.pg = True, None

    def forget(self, worker: int) -> None:
        """Drop every group that counts ``worker`` (lost, replaced or gone)."""
        with self._lock:
            for key in [k for k in self._groups if any(w == worker for w, _ in k)]:
                self._retire(self._groups.pop(key))

    def _unlist(self, group: _Group) -> None:
        with self._lock:
            if self._groups.get(group.members) is group:
                self._groups.pop(group.members)

    def _drop(self, group: _Group) -> None:
        self._unlist(group)
        with self._lock:
            pg = group.pg
            self._retire(group)
        # The last reference, let go outside the lock: its connections close, members fail fast.
        del pg

    def _schedule_key_deletion(self) -> None:
        """Have the keeper thread delete the rendezvous keys of the groups dropped so far.

        Every group formed leaves its members' addresses in the store (a few hundred bytes
        each); a sender that forms groups without end (many distinct target sets, workers
        coming and going) would otherwise grow its store for good. A dropped group's name is
        never used again. Called after a successful transfer, so that the deletion does not
        race the members of a group still forming.
        """
        with self._lock:
            if not self._unkeyed or self._closed or self._store is None:
                return
            if self._keeper is None:
                self._keeper = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="aiowsync-store"
                )
            keeper = self._keeper
        with contextlib.suppress(RuntimeError):  # shut down meanwhile
            keeper.submit(self._delete_keys)

    def _delete_keys(self) -> None:
        """Keeper thread: delete the keys of :attr:`_unkeyed`. Needs ``list_keys`` and
        ``clone`` (recent torch); without them the keys stay."""
        with self._lock:
            names, self._unkeyed = self._unkeyed, []
            store = self._store
        if not names or store is None:
            return
        try:
            if self._keeper_store is None:
                clone = getattr(store, "clone", None)
                if clone is None:
                    return
                self._keeper_store = clone()
            client: Any = self._keeper_store
            prefixes = tuple(f"aiowsync/{name}/" for name in names)
            for key in client.list_keys():
                if key.startswith(prefixes):
                    client.delete_key(key)
        except Exception as exc:  # the store is a convenience here, never a failure
            log.debug("could not delete the keys of dropped groups: %s", exc)

    # -- transfer (in a worker thread) --------------------------------------------------------

    def transfer(
        self,
        version: int,
        route: _Group,
        deadline: float,
        after: threading.Event | None = None,
    ) -> None:
        """Send ``version`` to ``route``'s members, packing it on the way if not yet packed.

        With ``after``, waits for that event first (the previous transfer's end). Any failure,
        even before the first collective, drops the group (which makes its other members fail
        fast, and keeps a later transfer from meeting receivers still waiting on this one) and
        raises :class:`TransportError`, so a retry forms a fresh group.
        """
        workers = [w for w, _ in route.members if w >= 0]
        failure = None
        try:
            if after is not None and not after.wait(max(0.0, deadline - time.monotonic())):
                raise TransportError("an earlier transfer did not finish in time")
            self._transfer(self._slot_of(version), route, deadline)
        except Exception as exc:  # every failure, whatever raised it, ends in a dropped group
            failure = _short(exc)
        finally:
            if failure is not None:
                # Out of the table before it counts as unused: route() must not hand it out.
                self._unlist(route)
            with self._lock:
                route.users -= 1
                for s in self._slots:
                    if s.version == version:
                        s.readers -= 1
        if failure is not None:
            # Raised outside the handler: the failed collective's traceback must not keep the
            # group alive, since dropping it is what releases the other members.
            self._drop(route)
            raise TransportError(f"sending to workers {workers} failed: {failure}")

    def _transfer(self, slot: _SenderSlot, group: _Group, deadline: float) -> None:
        if not group.lock.acquire(timeout=_seconds_left(deadline)):
            raise TransportError("another transfer on the same group did not finish in time")
        try:
            with self._lock:
                if group.dropped:
                    raise TransportError("its group was torn down after an earlier failure")
                pg = group.pg
            if pg is None:
                size = sum(1 for w, _ in group.members if w >= 0) + 1
                form = min(_seconds_left(deadline), self.form_timeout)
                pg = _new_group(
                    self.backend, self._need_store(), group.name, 0, size, self.host, form
                )
                with self._lock:
                    if group.dropped:  # dropped while it formed: never reuse its name
                        raise TransportError("its group was torn down while it formed")
                    group.pg = pg
            self._send_all(pg, slot, deadline, group)
        finally:
            group.last_used = time.monotonic()
            group.lock.release()
        self._schedule_key_deletion()

    def seal(self, version: int) -> None:
        """Pack whatever of ``version`` is not packed yet, now (blocking).

        Called when a send stops waiting (done, failed or cancelled), and for version 0 at
        start: after that the slot never reads the user's model again.
        """
        with self._lock:
            slots = [s for s in self._slots if s.version == version]
        for slot in slots:
            while slot.source is not None and slot.packed < len(self.buckets.ranges):
                self._pack(slot, slot.packed)

    def _send_all(self, pg: Any, slot: _SenderSlot, deadline: float, group: _Group) -> None:
        """Send every bucket to every member, point to point from rank 0.

        Not a broadcast: gloo relays a broadcast through a tree of receivers, so one dead
        receiver would hold up the others behind it until the deadline. Here each member
        depends on the sender alone; a member that fails is left out of the later buckets,
        the others get the whole version, and the failure is raised at the end.
        """
        workers = [w for w, _ in group.members if w >= 0]
        alive = dict(enumerate(workers, start=1))  # rank -> worker index
        failed: dict[int, str] = {}

        def fail(rank: int, exc: BaseException) -> None:
            worker = alive.pop(rank, None)
            if worker is not None:
                failed[worker] = _short(exc)

        def post(index: int) -> list[tuple[int, Any]]:
            lo, hi = self.buckets.ranges[index]
            works = []
            for rank in list(alive):
                try:
                    works.append((rank, pg.send([slot.flat[lo:hi]], rank, index)))
                except RuntimeError as exc:
                    fail(rank, exc)
            return works

        def finish(works: list[tuple[int, Any]]) -> None:
            for rank, work in works:
                try:
                    _finish(work, self.backend, _seconds_left(deadline), self.device)
                except (RuntimeError, TransportError) as exc:
                    fail(rank, exc)

        # Bucket i+1 is packed and posted while bucket i is still on the wire.
        count = len(self.buckets.ranges)
        self._pack(slot, 0)
        in_flight = post(0)
        for index in range(1, count):
            self._pack(slot, index)
            posted = post(index) if alive else []
            finish(in_flight)
            in_flight = posted
        finish(in_flight)
        if failed:
            detail = "; ".join(f"worker {w}: {text}" for w, text in sorted(failed.items()))
            raise TransportError(detail)

    def _pack(self, slot: _SenderSlot, index: int) -> None:
        """Pack buckets up to ``index`` (a no-op for those already packed); thread-safe."""
        with slot.pack_lock:
            while slot.packed <= index and slot.source is not None:
                self._pack_one(slot, slot.packed, slot.source)

    def _pack_one(self, slot: _SenderSlot, index: int, source: Source) -> None:
        if source.buffers is not None:
            plan, starts = self._buffer_plan[index], self._buffer_starts
        else:
            plan, starts = self._tensor_plan[index], self._tensor_starts
        if slot.source_pointers is None:
            slot.source_refs = [t.detach() for t in self._segments(source)]
            slot.source_pointers = _plain_pointers(slot.source_refs, self.device)
        pointers = slot.source_pointers
        if pointers:
            # Plain memmoves between addresses: no tensor view is made per piece, which for a
            # 1000-tensor model cost more than the copy itself.
            base = slot.flat.data_ptr()
            moves = [(base + starts[seg] + a, pointers[seg] + a, b - a) for seg, a, b in plan]
            if sum(n for _, _, n in moves) >= _PARALLEL_COPY_BYTES:
                _parallel_copy(moves, sum(n for _, _, n in moves))
            else:
                _copy_share(moves)
        else:
            self._pack_views(slot, source, plan, starts)
        slot.packed = index + 1
        if slot.packed == len(self.buckets.ranges):
            slot.source = slot.source_refs = slot.source_pointers = None
            slot.complete.set()

    def _segments(self, source: Source) -> list[torch.Tensor]:
        if source.buffers is not None:
            return list(source.buffers)
        assert source.tensors is not None
        return [source.tensors[k] for k in self.layout.keys]

    def _pack_views(
        self,
        slot: _SenderSlot,
        source: Source,
        plan: list[tuple[int, int, int]],
        starts: list[int],
    ) -> None:
        pieces: Mapping[int, torch.Tensor]
        if source.buffers is not None:
            pieces = dict(enumerate(source.buffers))
        else:
            assert source.tensors is not None
            tensors, keys = source.tensors, self.layout.keys
            pieces = {seg: tensors[keys[seg]] for seg, _, _ in plan}
        dsts, srcs = [], []
        for seg, a, b in plan:
            start = starts[seg] + a
            srcs.append(_as_bytes(pieces[seg])[a:b])
            dsts.append(slot.flat[start : start + (b - a)])
        fused_copy(dsts, srcs)

    def _need_store(self) -> Store:
        if self._store is None or self._closed:
            raise TransportError("the distributed plane is closed")
        return self._store

    def close(self) -> None:
        self._closed = True
        with self._lock:
            groups = list(self._groups.values())
            self._groups.clear()
            keeper, self._keeper = self._keeper, None
        for group in groups:
            group.pg = None
        if keeper is not None:
            keeper.shutdown(wait=False, cancel_futures=True)
        self._store = None


class DistReceiverPlane(ReceiverPlane):
    """Two private slots on the model's device; each version is received into the idle one."""

    blocking_fetch = True
    shares_sender_memory = False

    def __init__(
        self, *, address: str, worker_idx: int, backend: Backend, device: torch.device
    ) -> None:
        self.sender_host = host_of(address)
        self._worker_idx = worker_idx
        self.backend: Backend = backend
        self.device = device
        self._store: Store | None = None
        self._groups: dict[str, tuple[Any, float]] = {}
        self._dead: dict[str, None] = {}  # names of groups that failed (oldest first)
        self._slots: list[Staged] = []
        self._flats: list[torch.Tensor] = []
        self._live = -1
        self._closed = False
        self._lock = threading.Lock()

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
        for _ in range(2):
            flat = torch.empty(layout.total_bytes, dtype=torch.uint8, device=self.device)
            parts = layout.split(flat)
            self._flats.append(flat)
            self._slots.append(Staged(parts, layout.views(parts), str(len(self._slots))))
        self._port = port

    def _need_store(self, timeout: float) -> Store:
        with self._lock:
            if self._closed:
                raise TransportError("the receiver is closed")
            if self._store is not None:
                return self._store
        # Connected outside the lock: close() takes it on the event loop, which must not
        # wait for a store that does not answer.
        store = TCPStore(
            self.sender_host,
            self._port,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout),
        )
        with self._lock:
            if self._closed:
                raise TransportError("the receiver is closed")
            if self._store is None:
                self._store = store
            return self._store

    def fetch(self, params: Mapping[str, ParamValue]) -> Staged:
        """Receive the announced version into the idle slot (blocking; run in a thread)."""
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
        if name in self._dead:
            raise TransportError(f"group {name} was torn down after an earlier failure")
        deadline = time.monotonic() + timeout_ms / 1000
        # The slot the model does not run; its bytes are garbage until every bucket arrived.
        index = 1 if self._live == 0 else 0
        staged, flat = self._slots[index], self._flats[index]
        if self._worker_idx not in workers:
            raise ProtocolError(f"worker {self._worker_idx} is not a member of {members!r}")
        with self._lock:
            cached = self._groups.get(name)
        failure = None
        try:
            self._receive(name, cached, workers, flat, deadline, form_ms / 1000)
        except (RuntimeError, ValueError, TransportError) as exc:
            failure = _short(exc)
        if failure is not None:
            # Outside the handler, so that no traceback keeps the failed group alive.
            with self._lock:
                self._discard(name)
            raise TransportError(f"receiving the version failed: {failure}")
        return staged

    def _receive(
        self,
        name: str,
        cached: tuple[Any, float] | None,
        workers: list[int],
        flat: torch.Tensor,
        deadline: float,
        form: float,
    ) -> None:
        if cached is None:
            pg = _new_group(
                self.backend,
                self._need_store(_seconds_left(deadline)),
                name,
                workers.index(self._worker_idx) + 1,
                len(workers) + 1,
                self._hostname,
                min(_seconds_left(deadline), form),
            )
        else:
            pg = cached[0]
        works = [pg.recv([flat[lo:hi]], 0, i) for i, (lo, hi) in enumerate(self.buckets.ranges)]
        for work in works:
            _finish(work, self.backend, _seconds_left(deadline), self.device)
        with self._lock:
            if self._closed:
                return  # closed meanwhile: the group goes with this call, not into a cache
            self._groups[name] = (pg, time.monotonic())
            self._evict()

    def _evict(self) -> None:
        while len(self._groups) > _MAX_GROUPS:
            self._discard(min(self._groups, key=lambda n: self._groups[n][1]))

    def _discard(self, name: str) -> None:
        """Forget group ``name`` for good (call with the lock held).

        Its connections close, and its name is remembered as dead: a group's rendezvous keys
        stay in the store, so joining a second group under the same name would hang. An
        update naming it fails at once instead, and the sender retries on a fresh group.
        """
        self._groups.pop(name, None)
        self._dead[name] = None
        while len(self._dead) > 256:
            self._dead.pop(next(iter(self._dead)))

    def show(self, staged: Staged) -> Staged:
        self._live = int(staged.source) if staged.source in ("0", "1") else -1
        return staged

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._groups.clear()
            self._store = None


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:500]
