"""Layouts: where each tensor of a model lives inside a few flat, aligned byte buffers.

A :class:`Layout` is the ordered table ``(key, dtype, shape, buffer, offset)``. Keys are sorted so
that a module, its ``state_dict`` and its ``TensorDict`` all give the same layout. Every tensor
starts on an ``alignment``-byte boundary, so a typed view of a byte buffer is always legal.
"""

from __future__ import annotations

import hashlib
import json
import operator
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property

import torch

from .._copy.engine import CopyPolicy, fused_copy
from .._copy.gather import Places
from .._exceptions import LayoutMismatchError
from .._protocol import TensorDesc
from .flatten import WeightsLike, flatten_weights
from .specs import TensorSpec, dtype_from_name, dtype_name, refuse_meta, section_of, wire_of

__all__ = ["DEFAULT_ALIGNMENT", "Layout", "TensorSpec", "refuse_meta", "section_of", "wire_of"]

DEFAULT_ALIGNMENT = 64


class Layout:
    """The packing table of a set of named tensors.

    Build one with :meth:`from_weights` (a module, a ``TensorDict`` or a state_dict) or
    :meth:`from_descs` (the form that travels in the handshake).
    """

    __slots__ = ("__dict__", "alignment", "buffer_sizes", "sectioned", "specs", "wire_dtype")

    def __init__(
        self,
        shapes: Iterable[tuple[str, torch.dtype, Sequence[int]]],
        *,
        alignment: int = DEFAULT_ALIGNMENT,
        bucket_bytes: int | None = None,
        sectioned: bool = False,
    ) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if bucket_bytes is not None and bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        rows = sorted(
            ((k, dt, tuple(int(d) for d in s)) for k, dt, s in shapes), key=lambda row: row[0]
        )
        specs: list[TensorSpec] = []
        sizes: list[int] = [0]
        seen: set[str] = set()
        section: str | None = None
        for key, dtype, shape in rows:
            if key in seen:
                raise ValueError(f"duplicate key {key!r}")
            seen.add(key)
            if any(d < 0 for d in shape):
                raise ValueError(f"negative dimension in {key!r}: {shape}")
            spec_bytes = TensorSpec(key, dtype, shape, 0, 0).nbytes
            offset = _round_up(sizes[-1], alignment)
            new_section = sectioned and section_of(key) != section
            if new_section:
                section = section_of(key)
            if specs and (
                new_section
                or (
                    bucket_bytes is not None
                    and sizes[-1] > 0
                    and offset + spec_bytes > bucket_bytes
                )
            ):
                sizes.append(0)
                offset = 0
            specs.append(TensorSpec(key, dtype, shape, len(sizes) - 1, offset))
            sizes[-1] = offset + spec_bytes
        self.specs: tuple[TensorSpec, ...] = tuple(specs)
        self.buffer_sizes: tuple[int, ...] = tuple(_round_up(s, alignment) for s in sizes)
        self.alignment = alignment
        self.sectioned = sectioned
        """Keys are ``model_id.key`` and each model owns whole buffers of its own (a scheme
        of several models)."""
        self.wire_dtype: torch.dtype | None = None
        """The dtype floating tensors were laid out in, when not their own (errors say so)."""

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_weights(
        cls,
        weights: WeightsLike,
        *,
        alignment: int = DEFAULT_ALIGNMENT,
        bucket_bytes: int | None = None,
        sectioned: bool = False,
        wire_dtype: torch.dtype | None = None,
    ) -> Layout:
        """The layout of a module, a ``TensorDict`` or a state_dict (dotted keys); with
        ``wire_dtype``, floating tensors are laid out in that dtype."""
        flat = flatten_weights(weights)
        sparse = [f"{k}: {why}" for k, t in flat.items() if (why := _not_dense(t)) is not None]
        if sparse:
            raise TypeError("weights must be dense tensors:\n  " + "\n  ".join(sparse))
        layout = cls(
            ((k, wire_of(t.dtype, wire_dtype), tuple(t.shape)) for k, t in flat.items()),
            alignment=alignment,
            bucket_bytes=bucket_bytes,
            sectioned=sectioned,
        )
        layout.wire_dtype = wire_dtype
        return layout

    @classmethod
    def from_descs(
        cls,
        descs: Iterable[TensorDesc],
        *,
        alignment: int = DEFAULT_ALIGNMENT,
        bucket_bytes: int | None = None,
        sectioned: bool = False,
    ) -> Layout:
        """The layout described by ``descs`` (as a receiver's hello carries them)."""
        return cls(
            ((d.key, dtype_from_name(d.dtype), d.shape) for d in descs),
            alignment=alignment,
            bucket_bytes=bucket_bytes,
            sectioned=sectioned,
        )

    def descs(self) -> tuple[TensorDesc, ...]:
        """The rows as they travel in a hello: key, dtype name, shape."""
        return tuple(TensorDesc(s.key, dtype_name(s.dtype), s.shape) for s in self.specs)

    # -- identity -----------------------------------------------------------------------------

    @cached_property
    def fingerprint(self) -> str:
        """SHA-256 over keys, dtypes and shapes (not offsets: those follow from them)."""
        rows: list[object] = [[s.key, dtype_name(s.dtype), list(s.shape)] for s in self.specs]
        if self.sectioned:
            rows.append("sectioned")  # the same keys, other buffers: another layout
        return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()

    @property
    def total_bytes(self) -> int:
        """Bytes of all flat buffers, alignment padding included."""
        return sum(self.buffer_sizes)

    @cached_property
    def places(self) -> Places:
        """Where each tensor's bytes go, in key order, as the copy engine's gather copy
        takes them."""
        return Places(
            spans=tuple((s.buffer, s.offset, s.nbytes) for s in self.specs),
            buffers=len(self.buffer_sizes),
            total_bytes=self.total_bytes,
            alignment=self.alignment,
            # Lazy conjugate and negated views exist only for complex tensors, so only complex
            # layouts pay for that check on every copy.
            lazy_views=any(s.dtype.is_complex for s in self.specs),
        )

    @property
    def payload_bytes(self) -> int:
        """Bytes of tensor data, without alignment padding."""
        return sum(s.nbytes for s in self.specs)

    @cached_property
    def keys(self) -> tuple[str, ...]:
        return tuple(s.key for s in self.specs)

    @cached_property
    def sections(self) -> dict[str, tuple[int, int]]:
        """Model id to the range ``[first, last)`` of the buffers it owns (one entry, ``""``,
        for a layout that is not sectioned)."""
        if not self.sectioned:
            return {"": (0, len(self.buffer_sizes))}
        out: dict[str, tuple[int, int]] = {}
        for spec in self.specs:
            name = section_of(spec.key)
            first, _ = out.get(name, (spec.buffer, spec.buffer))
            out[name] = (first, spec.buffer + 1)
        return out

    def bytes_without(self, carried: Iterable[str]) -> int:
        """Bytes of the buffers of every model but those of ``carried`` (a partial send's
        models taken unchanged from the latest version), padding included."""
        skip = frozenset(carried)
        return sum(
            sum(self.buffer_sizes[first:last])
            for name, (first, last) in self.sections.items()
            if name not in skip
        )

    def __len__(self) -> int:
        return len(self.specs)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return self.fingerprint == other.fingerprint and self.alignment == other.alignment

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        n, size, fp = len(self.specs), self.total_bytes, self.fingerprint[:12]
        return f"Layout({n} tensors, {size} bytes, {fp})"

    # -- checks -------------------------------------------------------------------------------

    def differences(self, other: Layout) -> list[str]:
        """One line per key whose presence, dtype or shape differs; empty when compatible.
        In a layout of several models, each line names the model and its key."""
        mine = {s.key: s for s in self.specs}
        theirs = {s.key: s for s in other.specs}
        out: list[str] = []
        name = self._name
        for key in sorted(mine.keys() | theirs.keys()):
            a, b = mine.get(key), theirs.get(key)
            if a is None:
                assert b is not None
                out.append(f"{name(key)}: unexpected key ({b.describe()})")
            elif b is None:
                out.append(f"{name(key)}: missing (expected {a.describe()})")
            elif a.shape != b.shape or a.dtype != b.dtype:
                out.append(f"{name(key)}: expected {a.describe()}, got {b.describe()}")
        if not out and self.sectioned != other.sectioned:
            several = "several models" if self.sectioned else "one model"
            out.append(f"the sender holds {several}, the receiver not")
        return out

    def subset(self, sections: Iterable[str]) -> Layout:
        """The layout of only the models ``sections`` of a sectioned layout (to check the
        weights of a send that names some of them)."""
        wanted = frozenset(sections)
        cache = self.__dict__.setdefault("_subsets", {})
        if wanted not in cache:
            cache[wanted] = Layout(
                ((s.key, s.dtype, s.shape) for s in self.specs if section_of(s.key) in wanted),
                alignment=self.alignment,
                sectioned=True,
            )
        result: Layout = cache[wanted]
        return result

    def section_keys(self, section: str) -> tuple[str, ...]:
        """The keys of one model of a sectioned layout."""
        return tuple(k for k in self.keys if section_of(k) == section)

    def _name(self, key: str) -> str:
        """``key`` as error messages name it: ``model 'value', key 0.weight`` when sectioned."""
        if not self.sectioned:
            return key
        model, _, rest = key.partition(".")
        return f"model {model!r}, key {rest}"

    def check_compatible(self, other: Layout, *, context: str = "model") -> None:
        """Raise :class:`LayoutMismatchError` naming every difference between the layouts."""
        if other.fingerprint != self.fingerprint:
            raise LayoutMismatchError(self.differences(other), context=context)

    @cached_property
    def _expected(self) -> tuple[list[torch.dtype], list[torch.Size]]:
        return [s.dtype for s in self.specs], [torch.Size(s.shape) for s in self.specs]

    def check(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Check flat named tensors against this layout before any byte is written."""
        if len(tensors) == len(self.specs):
            # The common case, all in order, in one pass of C calls instead of Python per key.
            try:
                values = [tensors[k] for k in self.keys]
                dtypes, sizes = self._expected
                if (
                    list(map(_get_dtype, values)) == dtypes
                    and list(map(_size, values)) == sizes
                    and set(map(_get_layout, values)) <= _DENSE
                ):
                    return
            except (KeyError, TypeError, AttributeError):
                pass
        problems: list[str] = []
        name = self._name
        for spec in self.specs:
            t = tensors.get(spec.key)
            if t is None:
                problems.append(f"{name(spec.key)}: missing (expected {spec.describe()})")
            elif (sparse := _not_dense(t)) is not None:
                problems.append(f"{name(spec.key)}: {sparse}")
            elif t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                problems.append(
                    f"{name(spec.key)}: expected {spec.describe()}, got "
                    f"{dtype_name(t.dtype)}{list(t.shape)}"
                )
        known = set(self.keys)
        problems.extend(f"{name(k)}: unexpected key" for k in sorted(tensors) if k not in known)
        if problems:
            raise LayoutMismatchError(problems)

    # -- buffers and views --------------------------------------------------------------------

    def allocate(self, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """Fresh zeroed byte buffers for this layout."""
        return [torch.zeros(n, dtype=torch.uint8, device=device) for n in self.buffer_sizes]

    def views(self, buffers: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Typed, shaped views of ``buffers`` (byte tensors), one per key, in layout order."""
        if len(buffers) != len(self.buffer_sizes):
            raise ValueError(f"expected {len(self.buffer_sizes)} buffers, got {len(buffers)}")
        for buf, size in zip(buffers, self.buffer_sizes, strict=True):
            if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < size:
                raise ValueError(f"buffers must be 1-D uint8 of at least {size} bytes")
        out: dict[str, torch.Tensor] = {}
        for s in self.specs:
            raw = buffers[s.buffer][s.offset : s.offset + s.nbytes]
            out[s.key] = raw.view(s.dtype).view(s.shape)
        return out

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Cut one flat byte tensor of ``total_bytes`` into this layout's buffers (views)."""
        out, start = [], 0
        for size in self.buffer_sizes:
            out.append(flat[start : start + size])
            start += size
        return out

    def pack(
        self,
        tensors: Mapping[str, torch.Tensor],
        dst: Mapping[str, torch.Tensor],
        policy: CopyPolicy | None = None,
    ) -> None:
        """Copy named tensors into views ``dst`` (from :meth:`views`) with fused copies."""
        fused_copy([dst[k] for k in self.keys], [tensors[k] for k in self.keys], policy)


_size = torch.Tensor.size
_get_dtype = operator.attrgetter("dtype")
_get_layout = operator.attrgetter("layout")
_DENSE = {torch.strided}


def _not_dense(tensor: torch.Tensor) -> str | None:
    """What is wrong with a tensor that is not plain dense memory (sparse, mkldnn, quantized),
    or None."""
    if tensor.layout != torch.strided:
        return f"a {str(tensor.layout).removeprefix('torch.')} tensor; give it dense (.to_dense())"
    if tensor.is_quantized:
        return (
            "a quantized tensor, whose scale and zero point would not travel; give its "
            ".int_repr() and its quantization apart, or .dequantize() it"
        )
    return None


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple
