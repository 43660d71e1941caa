"""A TorchRL worker's side of the adapter: each forward of its policy under the receiver's
read guard, and versions passed on to the copy of the policy its collector runs."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import torch
from torch import nn

from .. import ReadGuard
from .._weights.flatten import flatten_weights

__all__ = ["guard_forwards", "is_meta", "pass_on", "retie", "ties_of", "without_aliases"]


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


def ties_of(model: Any) -> list[list[str]]:
    """The names under which ``model`` (a module) holds one tensor more than once (tied
    weights), each group in the module's order; [] for anything else."""
    if not isinstance(model, nn.Module):
        return []
    named = itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    )
    groups: dict[int, list[str]] = {}
    for name, tensor in named:
        groups.setdefault(id(tensor), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def retie(model: nn.Module, ties: list[list[str]]) -> None:
    """Tie ``model``'s tensors as the trainer's are (``ties``, see :func:`ties_of`): TorchRL
    hands its workers a policy without memory, whose tied weights came apart on the way."""
    # The worker's module may wrap the trainer's (TorchRL's TensorDictModule): the names
    # are looked up under each of its submodules, the module itself first.
    prefixes = [""] + [f"{name}." for name, _ in model.named_modules() if name]
    for first, *aliases in ties:
        for prefix in prefixes:
            try:
                holder, _, leaf = (prefix + first).rpartition(".")
                tensor = getattr(model.get_submodule(holder), leaf)
                for alias in aliases:
                    parent, _, name = (prefix + alias).rpartition(".")
                    setattr(model.get_submodule(parent), name, tensor)
            except AttributeError:
                continue
            break


def without_aliases(weights: Any, ties: list[list[str]]) -> Any:
    """``weights`` without the second and later names of tied tensors, which a TensorDict
    or a state_dict of the module lists (the scheme knows each tensor once)."""
    if not ties or weights is None or isinstance(weights, nn.Module):
        return weights
    aliases = tuple(alias for _, *rest in ties for alias in rest)
    flat = flatten_weights(weights, detach=False)

    def alias(key: str) -> bool:  # under a wrapper's prefix too
        return any(key == a or key.endswith(f".{a}") for a in aliases)

    if not any(map(alias, flat)):
        return weights
    return {k: v for k, v in flat.items() if not alias(k)}
