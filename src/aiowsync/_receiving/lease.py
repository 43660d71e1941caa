"""Leases: a reader keeps one version readable while the model moves on to newer ones.

A lease is taken on the version the model runs at that instant. Where that version's bytes
lie in the sender's memory (shared memory, the in-process plane, in swap mode), the lease reads
them there, and the receiver reports the version to the sender, which rewrites no slot that a
reported version is in. Elsewhere (copy mode, or a plane whose buffers are the receiver's own)
the first lease of a version copies the model's tensors once; the other leases of that version
share the copy, which goes when the last of them ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

import anyio
import torch
from tensordict import TensorDict, TensorDictBase

from .._exceptions import NotConnectedError, WeightSyncError
from .._protocol import MAX_LEASED
from .._weights.binding import bind_views
from .apply import Applier, Superseded
from .guard import ReadGuard

__all__ = ["Lease", "LeaseTable"]

_RETAKES = 100
"""Tries at taking a lease while the receiver joins new senders (one is all it takes unless
a switch to a new sender falls between finding its lease table and taking the lease)."""


@dataclass(slots=True, eq=False)
class _Held:
    """One leased version: its tensors by layout key, and how many leases hold it."""

    version: int
    tensors: dict[str, torch.Tensor]
    shared: bool
    """The tensors view the sender's memory (the version is reported to the sender)."""
    generation: int = 0
    """Which sender ``version`` counts in (see :attr:`Applier.generation`)."""
    count: int = 0
    _weights: TensorDictBase | None = field(default=None, repr=False)

    def weights(self) -> TensorDictBase:
        if self._weights is None:  # built once per version, on first use
            td = TensorDict(self.tensors, batch_size=[]).unflatten_keys(".")
            self._weights = td.lock_()
        return self._weights


class LeaseTable:
    """The leased versions of one receiver.

    ``report()`` is called (from any thread) when a version in the sender's memory is no
    longer leased, so that the sender hears of it before the next answer.
    """

    def __init__(self, applier: Applier, guard: ReadGuard, report: Callable[[], None]) -> None:
        self._applier = applier
        self._guard = guard
        self._report = report
        self._lock = threading.Lock()
        self._copying = threading.Lock()
        self._held: dict[int, _Held] = {}
        self.closed = False
        self._copies_only = False
        """Leases copy the version, never view the sender's memory (see :meth:`detach`)."""

    def pinned(self) -> tuple[int, ...]:
        """The leased versions whose bytes the sender keeps for this receiver."""
        with self._lock:
            return tuple(sorted(v for v, h in self._held.items() if h.shared))

    # -- taking and ending --------------------------------------------------------------------

    def _take(self) -> _Held | None:
        """A lease on the version the model runs, if that needs no copy; None otherwise.
        Call where no switch can be under way (on the loop, or holding the guard)."""
        version = self._check_open()
        with self._lock:
            if self.closed:  # closed meanwhile: detach() may have copied the others already
                raise NotConnectedError("the receiver is closed: no lease can be taken")
            held = self._held.get(version)
            if held is None:
                tensors = None if self._copies_only else self._applier.lease_views()
                if tensors is None:
                    return None
                if sum(h.shared for h in self._held.values()) >= MAX_LEASED:
                    raise WeightSyncError(
                        f"this worker's leases already hold {MAX_LEASED} versions in the "
                        f"sender's memory (oldest {min(self._held)}); end some first"
                    )
                held = self._held[version] = _Held(
                    version, tensors, shared=True, generation=self._applier.generation
                )
            held.count += 1
            return held

    def _take_copy(self) -> _Held:
        """A lease on the version the model runs, copying it unless a lease already did.
        Call holding the guard."""
        with self._copying:  # one copy per version, even when leases come at once
            held = self._take()
            if held is not None:
                return held
            version = self._applier.version
            with self._lock:
                if len(self._held) >= MAX_LEASED:
                    # The same cap as leases in the sender's memory: each copy is a whole
                    # model's worth of this worker's memory.
                    raise WeightSyncError(
                        f"this worker's leases already hold {MAX_LEASED} versions (oldest "
                        f"{min(self._held)}), each in a copy of its own; end some first"
                    )
            tensors = self._applier.copy_live()
            with self._lock:
                held = self._held.setdefault(
                    version,
                    _Held(version, tensors, shared=False, generation=self._applier.generation),
                )
                held.count += 1
                return held

    def take_blocking(self) -> _Held:
        """From a thread (or the loop, where a copy then blocks it)."""
        with self._guard:
            return self._take() or self._take_copy()

    async def take(self) -> _Held:
        """On the receiver's loop: no switch is under way while this runs, since switches
        are made on the loop; a copy, if needed, runs in a thread under the guard."""
        held = self._take()
        if held is not None:
            return held
        # Shielded: a lease taken in the thread must reach the caller, whose exit ends it.
        with anyio.CancelScope(shield=True):
            copied = await anyio.to_thread.run_sync(self.take_blocking)
        return copied

    def end(self, held: _Held) -> None:
        with self._lock:
            held.count -= 1
            if held.count > 0:
                return
            if self._held.get(held.version) is held:
                del self._held[held.version]
        if held.shared and not self.closed:
            self._report()

    def _check_open(self) -> int:
        if self.closed:
            raise NotConnectedError("the receiver is closed: no lease can be taken")
        if self._applier.superseded:
            raise Superseded("the model follows a new sender now: take the lease there")
        version = self._applier.version
        if version < 0:
            raise NotConnectedError(
                "no version has been applied yet: connect() (or wait_for_version(0)) first"
            )
        return version

    # -- shutdown ------------------------------------------------------------------------------

    def detach(self, *, close: bool = True) -> None:
        """Before the receiver says goodbye: leases reading the sender's memory get a private
        copy of the same bytes (the sender may reuse its slots after the goodbye). Call
        holding the guard, or on the loop.

        Without ``close``, leases go on being taken, each a copy: the model runs on a
        version of its own after a failed ``connect()``, and an engine that follows a sender
        keeps driving it until the next try succeeds."""
        with self._lock:
            if close:
                self.closed = True
            self._copies_only = True
            shared = [h for h in self._held.values() if h.shared]
        for held in shared:
            own = {k: t.clone() for k, t in held.tensors.items()}
            bind_views(held.tensors, own)  # the same values: a reader sees no change
            held.shared = False


class Lease:
    """A version kept readable: ``async with scheme.lease() as held`` (``with`` in threads).

    On entry the lease takes the version the model runs; until it ends, :attr:`weights`
    holds that version's exact bytes, while the model itself goes on switching to newer
    versions. Read the weights inside the block only: after it ends their memory may be
    rewritten with a later version.
    """

    __slots__ = ("_held", "_table", "_tables")

    def __init__(self, tables: LeaseTable | Callable[[], LeaseTable]) -> None:
        """``tables``: the receiver's lease table, or a function giving the table of the
        sender its model follows when the lease is entered (a receiver that follows its
        sender across restarts has one per sender)."""
        self._tables = tables
        self._table: LeaseTable | None = None
        self._held: _Held | None = None

    def _need(self) -> _Held:
        if self._held is None:
            raise RuntimeError("this lease is not held: use it inside `with` / `async with`")
        return self._held

    @property
    def version(self) -> int:
        """The leased version."""
        return self._need().version

    @property
    def generation(self) -> int:
        """Which sender the leased version came from: 0 for the first this receiver joined,
        one more for each new sender it followed (``reconnect=``); a restarted trainer
        numbers its versions from 0 again, so ``(generation, version)`` names the bytes."""
        return self._need().generation

    @property
    def weights(self) -> TensorDictBase:
        """The leased version's tensors, read-only (locked), nested under the model's own
        keys as ``TensorDict.from_module`` gives them; with ``models=``, under each model
        id first (``held.weights["policy"]``)."""
        return self._need().weights()

    def params(self, model_id: str | None = None) -> dict[str, torch.Tensor]:
        """The leased tensors under flat dotted keys, for
        ``torch.func.functional_call(model, held.params(), args)``; with ``models=``, those
        of model ``model_id`` (keys without the id)."""
        tensors = self._need().tensors
        if model_id is None:
            return dict(tensors)
        prefix = f"{model_id}."
        out = {k[len(prefix) :]: t for k, t in tensors.items() if k.startswith(prefix)}
        if not out:
            raise KeyError(f"no model {model_id!r} in this lease")
        return out

    def _table_now(self) -> LeaseTable:
        tables = self._tables
        return tables if isinstance(tables, LeaseTable) else tables()

    def _exit(self) -> None:
        held, self._held = self._held, None
        table, self._table = self._table, None
        if held is not None and table is not None:
            table.end(held)

    def __enter__(self) -> Lease:
        if self._held is not None:
            raise RuntimeError("this lease is already held; take another with scheme.lease()")
        for _ in range(_RETAKES):
            table = self._table_now()
            try:
                self._held = table.take_blocking()
            except Superseded:
                continue  # the receiver joined a new sender meanwhile: its table, then
            self._table = table
            return self
        raise NotConnectedError("the receiver kept changing senders: no lease was taken")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._exit()

    async def __aenter__(self) -> Lease:
        if self._held is not None:
            raise RuntimeError("this lease is already held; take another with scheme.lease()")
        for _ in range(_RETAKES):
            table = self._table_now()
            try:
                self._held = await table.take()
            except Superseded:
                continue
            self._table = table
            return self
        raise NotConnectedError("the receiver kept changing senders: no lease was taken")

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._exit()
