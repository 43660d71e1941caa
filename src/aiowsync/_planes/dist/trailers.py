"""The digests that follow versions' bytes on the distributed plane (see
:mod:`~aiowsync._planes.digest`): which versions get one, and the sealed bytes a transfer
sends after its last bucket."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..digest import TRAILER, seal
from .buckets import Image, Packer, section_spans

__all__ = ["Trailer", "Trailers"]


@dataclass(slots=True)
class Trailer:
    """The digest that follows a version's bytes: ``given``, or one of the sender's hashes
    (``text`` once made), sealed with ``key``."""

    key: bytes
    given: str | None
    text: str | None = None

    @property
    def hashing(self) -> bool:
        """Whether a transfer must hash the buckets it sends (no digest known yet)."""
        return self.given is None and self.text is None


class Trailers:
    """By version, the digest its transfers end with; the one record of it, which updates ask
    too (:meth:`param`), so that a retry or a join agrees with its transfer."""

    def __init__(self, packer: Packer, device: torch.device, kept: int) -> None:
        self._packer = packer
        self._spans = section_spans(packer.layout)
        self._device = device
        self._kept = kept
        self._by_version: dict[int, Trailer] = {}

    def set(self, version: int, *, given: str | None, hashed: bool) -> None:
        """``version``'s transfers end with ``given``, or (``hashed``) a digest of the
        sender's own hashes, or (neither) with nothing."""
        if given is None and not hashed:
            self._by_version.pop(version, None)
            return
        self._by_version[version] = Trailer(os.urandom(16), given)
        for old in sorted(self._by_version)[: -self._kept]:
            del self._by_version[old]

    def get(self, version: int) -> Trailer | None:
        return self._by_version.get(version)

    def param(self, version: int) -> str | None:
        """The update's ``digest`` parameter for ``version`` (None: no digest follows)."""
        trailer = self._by_version.get(version)
        return None if trailer is None else TRAILER + trailer.key.hex()

    def sealed(self, trailer: Trailer, images: Sequence[Image]) -> torch.Tensor:
        """The digest that follows a version whose models' bytes are in ``images``, sealed,
        as a tensor to send (blocking: what is not hashed yet is hashed now)."""
        if trailer.text is None:
            text = trailer.given
            if text is None:
                chunks = self._packer.chunks
                hashes = []
                for image, (lo, hi) in zip(images, self._spans, strict=True):
                    hashes += self._packer.hashes(image, chunks.within(lo, hi))
                text = chunks.text(hashes)
            trailer.text = text
        data = seal(trailer.text, trailer.key)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self._device)
