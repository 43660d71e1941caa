"""A TorchRL worker's side of the adapter: each forward of its policy under the receiver's
read guard, and versions passed on to the copy of the policy its collector runs."""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from .. import ReadGuard
from .._weights.flatten import flatten_weights

__all__ = ["guard_forwards", "is_meta", "pass_on"]


def guard_forwards(model: nn.Module, guard: ReadGuard) -> list[Any]:
    """Hold ``guard`` for each forward of ``model`` (a switch waits for it to end); the
    hooks' handles."""
    held = threading.local()  # a forward whose pre-hooks failed never took the guard

    def enter(module: nn.Module, args: Any) -> None:
        guard.acquire()
        held.depth = getattr(held, "depth", 0) + 1

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if getattr(held, "depth", 0) > 0:
            held.depth -= 1
            guard.release()

    return [
        model.register_forward_pre_hook(enter),
        model.register_forward_hook(leave, always_call=True),
    ]


def pass_on(bound: nn.Module, runs: nn.Module, guard: ReadGuard, limit: float) -> Any:
    """A hook that copies each version from ``bound`` (the model the receiver copies it
    into) into ``runs`` (the collector's copy of it, on its own device), at an instant when
    no forward of ``runs`` holds ``guard``, waiting at most ``limit`` seconds for one. The
    models hold the same version when this is called (nothing writes either)."""
    source, target = flatten_weights(bound), flatten_weights(runs)
    if source.keys() != target.keys():
        raise RuntimeError(
            "the collector runs a policy whose weights are not those of the policy the "
            "scheme was given"
        )

    def copy() -> None:
        with torch.no_grad():
            for key, tensor in target.items():
                tensor.copy_(source[key])

    async def hook(version: int) -> None:
        await guard.switch(copy, timeout=limit)

    copy()
    return hook


def is_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])
