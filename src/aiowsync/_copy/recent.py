"""What the last copies from each source were: the guess behind a copy started early.

A sender copies the same weights again and again: its model's tensors, its re-homed buffers,
one weights object given to every send. Checking those weights takes time, so the copy of
what the same source gave last time starts first and is kept only if the check finds the same
tensors. :class:`RecentCopies` is the one memory of what each source gave last.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from .gather import Pointers

__all__ = ["Copied", "RecentCopies"]

KEPT_SOURCES = 4
"""Sources whose last copy is remembered."""


@dataclass(frozen=True, slots=True)
class Copied:
    """What one copy took: whole buffers as they are, or tensors through a gather copy."""

    buffers: tuple[torch.Tensor, ...] | None = None
    """The buffers copied whole (a model re-homed into flat buffers)."""
    sources: Pointers | None = None
    """The tensors a gather copy copied, by their pointers (see ``GatherCopy.start``)."""


class RecentCopies:
    """By source (the last :data:`KEPT_SOURCES`), what the last copy from it took; and the
    tensors of the last copies, for a source not seen lately that holds the same tensors (a
    fresh ``state_dict()`` of the same model at every send)."""

    def __init__(self) -> None:
        self._by_source: collections.OrderedDict[Hashable, Copied] = collections.OrderedDict()
        self._gathered: Pointers | None = None
        """The tensors of the last copy that went through a gather copy."""
        self._repeated = False
        """That copy took the same tensors as the gather copy before it: a source not seen
        lately is guessed to hold them too (a sender alternating two source sets would
        otherwise start, and throw away, a copy of the wrong one every time)."""
        self._last_gathered = False
        """The last copy of all went through a gather copy."""

    def last(self, source: Hashable) -> Copied | None:
        """What the last copy from ``source`` took, if remembered."""
        return self._by_source.get(source)

    def guess(self, source: Hashable) -> Copied | None:
        """What a copy from ``source`` will likely take: what its last one took or, for a
        source not seen lately, the tensors of the last copy if the two copies before took
        the same ones."""
        found = self._by_source.get(source)
        if found is not None:
            return found
        if self._last_gathered and self._repeated and self._gathered is not None:
            return Copied(sources=self._gathered)
        return None

    def forget(self, source: Hashable) -> None:
        """A copy from ``source`` begins: what it took before no longer holds."""
        self._by_source.pop(source, None)
        self._last_gathered = False

    def copied(self, source: Hashable, copied: Copied) -> None:
        """Remember what a copy from ``source`` took."""
        table = self._by_source
        table[source] = copied
        table.move_to_end(source)
        if len(table) > KEPT_SOURCES:
            table.popitem(last=False)
        self._last_gathered = copied.sources is not None
        if copied.sources is not None:
            self._repeated = copied.sources == self._gathered
            self._gathered = copied.sources

    def clear(self) -> None:
        self._by_source.clear()
        self._gathered, self._repeated, self._last_gathered = None, False, False
