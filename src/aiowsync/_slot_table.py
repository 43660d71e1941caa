"""Which version each of a sender plane's slots holds, and which slot a new version may take.

Both transports keep a few full copies of the weights on the sender: the shared-memory plane
because receivers read them, the distributed plane because a transfer may still read one. The
table is the same; what makes a slot reusable is the plane's rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from ._exceptions import WeightSyncError

__all__ = ["Slot", "SlotTable"]

T = TypeVar("T")


@dataclass(slots=True)
class Slot(Generic[T]):
    value: T
    """The plane's own record of the slot (its memory)."""
    version: int | None = None
    busy: bool = False
    """Reserved and being written; holds no version yet."""


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

    def add(self) -> Slot[T]:
        slot = Slot(self._make(len(self.slots)))
        self.slots.append(slot)
        return slot

    def reserve(self, reusable: Callable[[Slot[T]], bool], full: Callable[[], str]) -> int:
        """The first idle slot that ``reusable`` accepts, or a new one while fewer than
        ``max_slots`` exist; else :class:`WeightSyncError` with the text ``full()`` gives."""
        for index, slot in enumerate(self.slots):
            if not slot.busy and reusable(slot):
                slot.busy, slot.version = True, None
                return index
        if len(self.slots) >= self.max_slots:
            raise WeightSyncError(full())
        self.add().busy = True
        return len(self.slots) - 1

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
