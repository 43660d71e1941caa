"""The pieces a layout is made of: dtype names as they travel, one tensor's place, and the
rules on keys and dtypes that senders and receivers share."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .._exceptions import LayoutMismatchError

__all__ = ["TensorSpec", "dtype_from_name", "dtype_name", "refuse_meta", "section_of", "wire_of"]


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype named ``name`` (``float32``); :class:`LayoutMismatchError` if none is."""
    # A fixed table, never getattr(torch, name): names come from the wire, and some torch
    # attributes import whole subsystems or warn when touched.
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise LayoutMismatchError([f"unknown dtype {name[:40]!r}"], context="layout")
    return dtype


_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    """How ``dtype`` is named on the wire and in messages (``float32``)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Where one tensor lives: ``nbytes`` bytes at ``offset`` in buffer number ``buffer``."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    buffer: int
    offset: int

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of data (no padding)."""
        return self.numel * self.dtype.itemsize

    def describe(self) -> str:
        """dtype and shape, as in error messages (``float32[4, 16]``)."""
        return f"{dtype_name(self.dtype)}{list(self.shape)}"


def section_of(key: str) -> str:
    """The model id of a key of a layout of several models (``policy.0.weight``)."""
    return key.partition(".")[0]


def wire_of(dtype: torch.dtype, wire_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor of ``dtype`` travels in: ``wire_dtype`` for floating tensors when
    one is set, its own otherwise (integers and bools travel as they are)."""
    if wire_dtype is not None and dtype.is_floating_point:
        return wire_dtype
    return dtype


def refuse_meta(tensors: Mapping[str, torch.Tensor], why: str) -> None:
    """Raise ``ValueError`` if any tensor is on the meta device (``why``: what it cannot do)."""
    if not any(map(_is_meta, tensors.values())):
        return
    meta = [k for k, t in tensors.items() if t.is_meta]
    raise ValueError(
        f"the model has tensors on the meta device ({', '.join(meta[:5])}"
        f"{', ...' if len(meta) > 5 else ''}): {why}; "
        "materialise the model first (e.g. model.to_empty(device='cpu'))"
    )


_is_meta = operator.attrgetter("is_meta")
