"""Which version each of a sender plane's slots holds, and which slot a new version may take.

Both transports keep a few full copies of the weights on the sender: the shared-memory plane
because receivers read them, the distributed plane because a transfer may still read one. The
table is the same; what makes a slot reusable is the plane's rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .._exceptions import SlotsFull, WeightSyncError
from .._util.pids import pid_alive
from .base import Delivery, InPlace, Member, Params, SenderPlane

__all__ = ["InPlaceSenderPlane", "Slot", "SlotTable", "check_slot_counts"]

T = TypeVar("T")


@dataclass(slots=True)
class Slot(Generic[T]):
    value: T
    """The plane's own record of the slot (its memory)."""
    version: int | None = None
    busy: bool = False
    """Reserved and being written; holds no version yet."""


def check_slot_counts(num_slots: int, max_slots: int) -> None:
    """Refuse slot counts a plane cannot work with (two are needed to stage beside the live
    version)."""
    if num_slots < 2:
        raise ValueError(f"num_slots must be at least 2, got {num_slots}")
    if max_slots < num_slots:
        raise ValueError(f"max_slots ({max_slots}) must be >= num_slots ({num_slots})")


class SlotTable(Generic[T]):
    """Slots made by ``make`` (given the new slot's index), at most ``max_slots`` of them."""

    def __init__(self, make: Callable[[int], T], *, max_slots: int) -> None:
        self._make = make
        self.max_slots = max_slots
        self.slots: list[Slot[T]] = []

    def __len__(self) -> int:
        return len(self.slots)

    def __iter__(self) -> Iterator[Slot[T]]:
        return iter(self.slots)

    def __getitem__(self, index: int) -> Slot[T]:
        return self.slots[index]

    def renew(self, index: int) -> Slot[T]:
        """Replace slot ``index`` by a new one (its old memory goes with its last user)."""
        slot = self.slots[index] = Slot(self._make(index))
        return slot

    def add(self) -> Slot[T]:
        slot = Slot(self._make(len(self.slots)))
        self.slots.append(slot)
        return slot

    def reserve(self, reusable: Callable[[Slot[T]], bool], full: Callable[[], str]) -> int:
        """The first idle slot that ``reusable`` accepts, or a new one while fewer than
        ``max_slots`` exist; else :class:`SlotsFull` with the text ``full()`` gives."""
        for index, slot in enumerate(self.slots):
            if not slot.busy and reusable(slot):
                slot.busy, slot.version = True, None
                return index
        if len(self.slots) >= self.max_slots:
            raise SlotsFull(full())
        self.add().busy = True
        return len(self.slots) - 1

    def reserve_unpinned(self, pinned: set[int], what: str) -> int:
        """A slot holding none of the ``pinned`` versions: the rule where receivers read the
        sender's slots. ``what`` names the slots in the error when none is left."""
        return self.reserve(
            lambda s: s.version is None or s.version not in pinned,
            lambda: (
                f"all {len(self.slots)} {what} slots hold versions still in use "
                f"({sorted(pinned)}), so none is left for a new version until a worker on "
                "one of them leaves; raise max_slots, or send to lagging workers before they "
                "fall that far behind"
            ),
        )

    def publish(self, index: int, version: int) -> Slot[T]:
        slot = self.slots[index]
        slot.version, slot.busy = version, False
        return slot

    def release(self, index: int) -> Slot[T]:
        slot = self.slots[index]
        slot.busy, slot.version = False, None
        return slot

    def index_of(self, version: int) -> int:
        for index, slot in enumerate(self.slots):
            if slot.version == version:
                return index
        raise KeyError(f"version {version} is in no slot")


class InPlaceSenderPlane(SenderPlane):
    """Base of the sender planes whose receivers read the sender's slots where they are (on
    this host): a slot is reused only once no receiver's process may still read its version,
    and receivers' processes are watched by pid."""

    _slots: SlotTable[Any]
    _closed: bool
    what: str = "sender"
    """Names the slots in errors."""

    def reserve(self, pinned: set[int]) -> int:
        if self._closed:
            raise WeightSyncError(f"the {self.what} plane is closed")
        return self._slots.reserve_unpinned(pinned, self.what)

    latest: int | None = None
    """The slot of the newest version published (what a partial send carries models from)."""

    def publish(self, slot: int, version: int) -> None:
        if self._closed:
            raise WeightSyncError(f"the {self.what} plane is closed")
        self._slots.publish(slot, version)
        self.latest = slot

    def release(self, slot: int) -> None:
        if not self._closed:
            self._slots.release(slot)

    def deliver(
        self,
        version: int,
        members: Sequence[Member],
        deadline: float,
        *,
        purpose: str = "",
        since: int | None = None,
    ) -> Delivery:
        index = self._slots.index_of(version)
        return InPlace(self.where(index))

    def where(self, index: int) -> Params:
        """What a receiver needs to find slot ``index``."""
        raise NotImplementedError

    def process_gone(self, pid: int) -> bool | None:
        return not pid_alive(pid)
