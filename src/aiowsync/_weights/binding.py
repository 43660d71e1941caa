"""Model binding: a module's tensors pointed at views of flat buffers, without copying.

Re-homing moves every parameter and buffer of a module into the flat buffers of its layout, so
that a snapshot of the whole model is one copy per buffer; binding points a receiver's module at
the views of a shared slot. Either way the tensor objects keep their identity, so optimizers and
hooks built earlier keep working; only their storage changes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from .._copy.engine import CopyPolicy

if TYPE_CHECKING:
    from .layout import Layout

__all__ = ["bind_views", "is_homed", "module_targets", "rehome"]


def bind_views(targets: Mapping[str, torch.Tensor], views: Mapping[str, torch.Tensor]) -> None:
    """Make every target tensor (a module's parameters and buffers) use the matching view.

    Nothing is copied. (Assigning ``.data`` is allowed in any grad mode.)
    """
    for key, t in targets.items():
        t.data = views[key]


def module_targets(module: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter and buffer of ``module`` under its dotted key.

    A tensor reachable under several names (tied weights) appears once, under its first name;
    rebinding that one tensor object rebinds every alias.
    """
    out: dict[str, torch.Tensor] = dict(module.named_parameters())
    out.update(module.named_buffers())
    return out


def rehome(
    module: nn.Module, layout: Layout, policy: CopyPolicy | None = None
) -> list[torch.Tensor]:
    """Move every parameter and buffer of ``module`` into fresh flat buffers of ``layout``
    (copied under ``policy``).

    Afterwards each tensor of the module is a view of the returned buffers, so a snapshot of the
    whole model is one ``copy_`` per buffer. Tensor objects keep their identity, so an optimizer
    built earlier keeps working. The buffers live on the module's device.
    """
    targets = module_targets(module)
    layout.check(targets)
    if _overlapping(targets.values()):
        # Two tensors sharing memory (a buffer viewing a parameter) would each get a slice of
        # their own, and an update to one would no longer show in the other.
        raise ValueError("some of the module's tensors share memory; they cannot be re-homed")
    devices = {t.device for t in targets.values()}
    if len(devices) > 1:
        raise ValueError(f"cannot re-home a module spread over several devices: {devices}")
    device = devices.pop() if devices else torch.device("cpu")
    buffers = layout.allocate(device)
    views = layout.views(buffers)
    layout.pack(targets, views, policy)
    bind_views(targets, views)
    return buffers


def is_homed(targets: Mapping[str, torch.Tensor], views: Mapping[str, torch.Tensor]) -> bool:
    """True while every target tensor still is exactly its view (same memory and shape)."""
    for key, t in targets.items():
        v = views.get(key)
        if v is None or t.data_ptr() != v.data_ptr() or t.shape != v.shape:
            return False
    return len(targets) == len(views)


def _overlapping(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether the memory of any two of ``tensors`` overlaps (views of one buffer that do not
    overlap, as a re-homed model's are, are fine)."""
    spans = []
    for t in tensors:
        if not t.nbytes:
            continue
        if t.is_contiguous():
            start = t.data_ptr()
            spans.append((start, start + t.nbytes))
        else:  # its exact extent takes more work than it is worth: the whole storage
            storage = t.untyped_storage()
            spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    spans.sort()
    # Sorted by start, any overlap shows between neighbours.
    return any(b[0] < a[1] for a, b in itertools.pairwise(spans))
