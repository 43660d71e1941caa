"""Two private copies of the weights on a receiver: the model runs one, the next version is
written into the other."""

from __future__ import annotations

import torch

from .._weights.layout import Layout
from .base import Staged

__all__ = ["DoubleBuffer"]


class DoubleBuffer:
    def __init__(self, layout: Layout, device: torch.device | str) -> None:
        self.halves: list[Staged] = []
        self.flats: list[torch.Tensor] = []
        """Each half as one flat byte tensor (its buffers are views of it)."""
        for index in range(2):
            # Zeroed: alignment gaps are never written, and must not show old memory.
            flat = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
            parts = layout.split(flat)
            self.flats.append(flat)
            self.halves.append(Staged(parts, layout.views(parts), str(index)))
        self._live = -1

    @property
    def live(self) -> int:
        """The index of the half the model runs (-1 before the first switch)."""
        return self._live

    def spare(self) -> tuple[int, Staged]:
        """The half the model does not run, and its index."""
        index = 1 if self._live == 0 else 0
        return index, self.halves[index]

    def made_live(self, index: int) -> None:
        """The model runs half ``index`` now (call only once the switch happened: until
        then the other half is still read)."""
        self._live = index

    def live_index(self, staged: Staged) -> int:
        """The index of ``staged`` if it is one of the halves, else -1."""
        for index, half in enumerate(self.halves):
            if half is staged:
                return index
        return -1
