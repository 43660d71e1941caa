"""Digests of a version's bytes: the sender's, carried in the update; the receiver's check.

A version's bytes are the layout's flat buffers (alignment padding included, which every
plane keeps zeroed). Each buffer is cut into buckets of :func:`bucket_bytes` and each bucket
hashed with XXH3 (64 bits): about 20 GB/s on one core, so 256 MiB costs some 11 ms on each
side. A digest reads ``xxh3:<bucket bytes>:<16 hex digits per bucket>``; a receiver hashes
what it fetched before it switches, and a bucket that differs fails the apply (a nack that
names the worker and the bucket), so the model keeps its version.

Where it travels depends on the plane. On shared memory the sender hashes a version once it
is staged, and the update carries the digest. A plane that packs a version while it sends it
(torch.distributed) hashes each bucket once it is packed and sent, and its receivers hash
each one as it arrives (see :class:`Chunks`): the digest follows the bytes on the data plane,
sealed (:func:`seal`) with a key that only the update carries (``trailer:<key>``), so that
it is still the sender's word and not the network's.
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import math
from collections.abc import Mapping, Sequence

import anyio
import torch
import xxhash

from .._exceptions import WeightSyncError
from .._protocol import ParamValue
from .._util.shield import to_the_end
from .._weights.layout import Layout
from .base import Params, SenderPlane

__all__ = [
    "TRAILER",
    "Chunks",
    "DigestMismatch",
    "Digests",
    "bucket_bytes",
    "check_digest",
    "digest",
    "fits",
    "forwarded_by",
    "seal",
    "trailer_key",
    "trailer_size",
    "unseal",
]

_BUCKET = 8 << 20
"""Bytes per bucket for models up to 8 GiB; larger ones get larger buckets."""
_MAX_BUCKETS = 1024
"""At most this many buckets (16 KiB of digest in each update)."""
_SCHEME = "xxh3"
_INLINE_BYTES = 1 << 20
"""Models up to this size are digested on the event loop (some 50 us); larger ones in a
thread."""
_KEPT = 16
TRAILER = "trailer:"
"""How an update's ``digest`` begins when the digest follows the bytes on the data plane;
the rest is the key of its seal, in hex."""
_TAG_BYTES = 32


class DigestMismatch(WeightSyncError):
    """The bytes a receiver fetched are not those the sender digested."""


def bucket_bytes(layout: Layout) -> int:
    """Bytes per digest bucket for ``layout`` (the same on every side)."""
    size = max(_BUCKET, math.ceil(layout.total_bytes / _MAX_BUCKETS))
    return -(-size // layout.alignment) * layout.alignment


def _ranges(layout: Layout, size: int) -> list[tuple[int, int, int]]:
    """Each bucket as (buffer, start, end)."""
    return [
        (b, lo, min(lo + size, n))
        for b, n in enumerate(layout.buffer_sizes)
        for lo in range(0, n, size)
    ]


def _hashes(buffers: Sequence[torch.Tensor], ranges: list[tuple[int, int, int]]) -> list[int]:
    arrays = [buf.detach().cpu().numpy() for buf in buffers]  # no copy for host memory
    return [xxhash.xxh3_64_intdigest(arrays[b][lo:hi].data) for b, lo, hi in ranges]


def digest(layout: Layout, buffers: Sequence[torch.Tensor]) -> str:
    """The digest of ``buffers`` (the layout's flat byte buffers). Blocking."""
    size = bucket_bytes(layout)
    hashes = _hashes(buffers, _ranges(layout, size))
    return f"{_SCHEME}:{size}:" + "".join(f"{h:016x}" for h in hashes)


def check_digest(layout: Layout, buffers: Sequence[torch.Tensor], expected: str) -> None:
    """Raise :class:`DigestMismatch` naming the first bucket of ``buffers`` whose bytes are
    not those ``expected`` describes (or the digest itself, when malformed). Blocking."""
    ranges = _ranges(layout, bucket_bytes(layout))
    _fit_or_raise(layout, ranges, expected)
    if len(buffers) != len(layout.buffer_sizes):
        raise DigestMismatch(f"fetched {len(buffers)} buffers, not the layout's")
    _compare(layout, ranges, _hashes(buffers, ranges), expected)


def _fit_or_raise(layout: Layout, ranges: list[tuple[int, int, int]], expected: str) -> None:
    size = bucket_bytes(layout)
    scheme, _, rest = expected.partition(":")
    given_size, _, hexes = rest.partition(":")
    if scheme != _SCHEME or given_size != str(size) or len(hexes) != 16 * len(ranges):
        raise DigestMismatch(
            "the update's digest does not fit this model "
            f"({scheme or 'none'}, buckets of {given_size or '?'} bytes, {len(hexes) // 16} "
            f"buckets; expected {_SCHEME}, {size}, {len(ranges)})"
        )


def _compare(
    layout: Layout, ranges: list[tuple[int, int, int]], got: Sequence[int], expected: str
) -> None:
    """Raise :class:`DigestMismatch` at the first bucket whose hash in ``got`` is not the one
    ``expected`` (a digest that fits) gives."""
    hexes = expected.rsplit(":", 1)[1]
    for index, (value, (b, lo, hi)) in enumerate(zip(got, ranges, strict=True)):
        if f"{value:016x}" != hexes[16 * index : 16 * index + 16]:
            raise DigestMismatch(
                f"bucket {index} of {len(ranges)} ({_where(layout, b, lo, hi)}) "
                "does not hold the bytes the sender sent; the version was not applied"
            )


def _where(layout: Layout, buffer: int, lo: int, hi: int) -> str:
    """Bytes ``lo:hi`` of ``buffer``, and the keys whose data lies there."""
    keys = [
        s.key
        for s in layout.specs
        if s.buffer == buffer and s.offset < hi and s.offset + s.nbytes > lo
    ]
    named = "no tensor" if not keys else keys[0] if len(keys) == 1 else f"{keys[0]} ... {keys[-1]}"
    where = f"bytes {lo}-{hi} of buffer {buffer}"
    return f"{where}: {named}"


def forwarded_by(params: Mapping[str, ParamValue], worker: int) -> int | None:
    """In a chain delivery (``params`` of the update), the member that forwards ``worker``
    its bytes; None when they come from the sender."""
    members = params.get("members")
    if params.get("topology") != "chain" or not isinstance(members, str):
        return None
    order = members.split(",")
    at = order.index(str(worker)) if str(worker) in order else 0
    return int(order[at - 1]) if at > 0 else None


def trailer_key(value: ParamValue | None) -> bytes | None:
    """The key of the seal when an update's ``digest`` says the digest follows the bytes
    (None when it says anything else)."""
    if not isinstance(value, str) or not value.startswith(TRAILER):
        return None
    try:
        key = bytes.fromhex(value[len(TRAILER) :])
    except ValueError:
        return None
    return key if len(key) == 16 else None


def trailer_size(layout: Layout) -> int:
    """The bytes of a sealed digest of a version of ``layout`` (see :func:`seal`)."""
    size = bucket_bytes(layout)
    return len(f"{_SCHEME}:{size}:") + 16 * len(_ranges(layout, size)) + _TAG_BYTES


def seal(text: str, key: bytes) -> bytes:
    """``text`` (a digest) followed by its HMAC-SHA256 under ``key``: the bytes that follow a
    version on the data plane."""
    data = text.encode("ascii")
    return data + hmac.new(key, data, hashlib.sha256).digest()


def unseal(sealed: bytes, key: bytes) -> str:
    """The digest :func:`seal` made, or :class:`DigestMismatch` when its seal is not
    ``key``'s (the bytes that followed the version are not what the sender sent)."""
    data, tag = sealed[:-_TAG_BYTES], sealed[-_TAG_BYTES:]
    if not hmac.compare_digest(tag, hmac.new(key, data, hashlib.sha256).digest()):
        raise DigestMismatch(
            "the digest that came with the bytes is not the sender's (damaged on its way); "
            "the version was not applied"
        )
    return data.decode("ascii")


class Chunks:
    """A layout's digest buckets in its flat image (the layout's buffers end to end), for a
    plane that moves that image in transfer buckets of its own: which digest buckets each
    transfer bucket completes, so that each is hashed as soon as its bytes are there."""

    def __init__(self, layout: Layout, transfer: Sequence[tuple[int, int]]) -> None:
        """``transfer``: each transfer bucket's byte range of the image, in the order they
        are packed or arrive (each model's in order)."""
        self.layout = layout
        self._ranges = _ranges(layout, bucket_bytes(layout))
        starts = [0]
        for size in layout.buffer_sizes:
            starts.append(starts[-1] + size)
        self.spans = [(starts[b] + lo, starts[b] + hi) for b, lo, hi in self._ranges]
        """Each digest bucket's byte range of the image."""
        ends = [hi for _, hi in self.spans]
        self.completed_by = [
            list(range(bisect.bisect_right(ends, lo), bisect.bisect_right(ends, hi)))
            for lo, hi in transfer
        ]
        """By transfer bucket, the digest buckets whose last byte it brings."""

    def within(self, lo: int, hi: int) -> range:
        """The digest buckets inside bytes ``lo:hi`` of the image (a model's)."""
        starts = [a for a, _ in self.spans]
        return range(bisect.bisect_left(starts, lo), bisect.bisect_left(starts, hi))

    def hash(self, flat: torch.Tensor, chunk: int, base: int = 0) -> int:
        """The hash of digest bucket ``chunk``, read from ``flat`` (bytes ``base:`` of the
        image). Blocking."""
        lo, hi = self.spans[chunk]
        piece = flat[lo - base : hi - base].detach()
        return xxhash.xxh3_64_intdigest(piece.cpu().numpy().data)

    def text(self, hashes: Sequence[int]) -> str:
        """The digest of a version whose digest buckets hash to ``hashes``."""
        return f"{_SCHEME}:{bucket_bytes(self.layout)}:" + "".join(f"{h:016x}" for h in hashes)

    def check(self, hashes: Sequence[int], expected: str) -> None:
        """Raise :class:`DigestMismatch` as :func:`check_digest` does, for bytes whose digest
        buckets hash to ``hashes``."""
        _fit_or_raise(self.layout, self._ranges, expected)
        _compare(self.layout, self._ranges, hashes, expected)


def fits(layout: Layout, value: str) -> bool:
    """Whether ``value`` is a digest of this module's form for a version of ``layout``."""
    scheme, _, rest = value.partition(":")
    size, _, hexes = rest.partition(":")
    if scheme != _SCHEME or size != str(bucket_bytes(layout)):
        return False
    return len(hexes) == 16 * len(_ranges(layout, bucket_bytes(layout)))


class Digests:
    """The sender's digests of its latest versions (nothing when not ``enabled``, unless one
    was given)."""

    def __init__(self, layout: Layout, plane: SenderPlane, *, enabled: bool) -> None:
        self.layout = layout
        self.plane = plane
        self.enabled = enabled
        self._by_version: dict[int, str] = {}
        self._given: dict[int, str] = {}

    def give(self, version: int, value: str) -> bool:
        """Carry ``value`` as the digest of ``version`` (to be staged next) instead of one of
        this sender's own: a relay hands on the root's, so that its leaves check the bytes
        against what the root sent, not against the relay's copy. False (and nothing given)
        where ``value`` does not fit this sender's layout."""
        if not fits(self.layout, value):
            return False
        self._given = {version: value}
        return True

    async def take(self, slot: int, version: int) -> None:
        """Digest what ``slot`` holds, staged as ``version`` (or take the digest given for
        it). On a plane whose digests follow the bytes, only tell the plane which digest
        follows."""
        given = self._given.pop(version, None)
        if self.plane.digests_follow:
            self.plane.digest_after(version, given=given, hashed=self.enabled)
            return
        if given is not None:
            self._by_version[version] = given
            self._forget_old()
            return
        if not self.enabled:
            self._by_version.pop(version, None)
            return
        layout, plane = self.layout, self.plane

        def compute() -> str:
            return digest(layout, plane.staged_buffers(slot))

        if layout.total_bytes <= _INLINE_BYTES:
            self._by_version[version] = compute()
        else:
            self._by_version[version] = await to_the_end(anyio.to_thread.run_sync(compute))
        self._forget_old()

    def _forget_old(self) -> None:
        for old in sorted(self._by_version)[:-_KEPT]:
            del self._by_version[old]

    def add_to(self, version: int, params: Params) -> Params:
        """``params`` of an update of ``version``, with its digest (or, where it follows the
        bytes, what says so) when there is one."""
        if self.plane.digests_follow:
            value = self.plane.digest_param(version)
        else:
            value = self._by_version.get(version)
        return params if value is None else {**params, "digest": value}
