"""Knowing cheaply, at every send, whether a module still holds the tensors we last saw.

Walking a large module for its parameters costs about a microsecond per tensor, too much to do
on every send. Instead torch's global registration hooks tell us when any parameter, buffer
or submodule of *this* module is replaced; between such events the tensor objects are the
same, and only their data pointers, dtypes and shapes need a look.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _module

from .._weights.binding import module_targets

__all__ = ["ModelWatch"]

_size = torch.Tensor.size
_dtype = operator.attrgetter("dtype")
_stride = torch.Tensor.stride


class ModelWatch:
    """Watches ``module`` for replaced parameters, buffers or submodules until :meth:`close`."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.dirty = True
        self._members: set[int] = set()
        self._handles = [
            _module.register_module_parameter_registration_hook(self._on_register),
            _module.register_module_buffer_registration_hook(self._on_register),
            _module.register_module_module_registration_hook(self._on_register),
        ]
        self.refresh()

    def _on_register(self, owner: nn.Module, name: str, value: Any) -> None:
        if id(owner) in self._members:
            self.dirty = True

    def refresh(self) -> None:
        """Walk the module once more and remember what it holds now."""
        self._members = {id(m) for m in self.module.modules()}
        self.tensors: dict[str, torch.Tensor] = module_targets(self.module)
        self._values = list(self.tensors.values())
        self.pointers = self.current_pointers()
        self._sizes = list(map(_size, self._values))
        self._dtypes = list(map(_dtype, self._values))
        self.dirty = False

    def current_pointers(self) -> list[int]:
        return list(map(torch.Tensor.data_ptr, self._values))

    def same_specs(self) -> bool:
        # map() over the C methods: half the cost of a comprehension per tensor.
        values = self._values
        return list(map(_size, values)) == self._sizes and list(map(_dtype, values)) == self._dtypes

    def signature(self) -> tuple[list[int], list[Any], list[Any], list[Any]]:
        """Pointers, shapes, dtypes and strides of the tensors now (an in-place ``t_()`` or
        ``resize_()`` keeps a tensor's data pointer, so pointers alone prove little)."""
        values = self._values
        return (
            self.current_pointers(),
            list(map(_size, values)),
            list(map(_dtype, values)),
            list(map(_stride, values)),
        )

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
