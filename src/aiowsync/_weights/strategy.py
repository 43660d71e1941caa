"""Weight strategies: how weights are taken out of a model and put back into one.

Two formats, as TorchRL users know them: ``"tensordict"`` (the default) extracts a
``TensorDict``, ``"state_dict"`` extracts a flat ``{dotted key: tensor}`` dict. Application
accepts either format whatever the strategy, and works in place (values copied into the
destination's existing tensors) or out of place (the destination's tensors replaced).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, Literal, TypeAlias, cast

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from .._copy.engine import fused_copy
from .._exceptions import LayoutMismatchError
from .flatten import WeightsLike, flatten_weights

__all__ = ["StrategyName", "WeightStrategy"]

StrategyName: TypeAlias = Literal["tensordict", "state_dict"]


class WeightStrategy:
    """Extracts and applies weights in one of two formats.

    Args:
        extract_as: ``"tensordict"`` (default) or ``"state_dict"``.
    """

    __slots__ = ("extract_as",)

    def __init__(self, extract_as: StrategyName = "tensordict") -> None:
        if extract_as not in ("tensordict", "state_dict"):
            raise ValueError(f"extract_as must be 'tensordict' or 'state_dict', got {extract_as!r}")
        self.extract_as: StrategyName = extract_as

    def __repr__(self) -> str:
        return f"WeightStrategy(extract_as={self.extract_as!r})"

    def extract_weights(self, source: WeightsLike) -> TensorDictBase | dict[str, torch.Tensor]:
        """The weights of ``source`` (module, TensorDict or state_dict) in this strategy's format.

        The result shares storage with ``source``; nothing is copied.
        """
        if self.extract_as == "tensordict":
            if isinstance(source, TensorDictBase):
                return source
            if isinstance(source, nn.Module):
                return cast(TensorDictBase, TensorDict.from_module(source))
            flat = TensorDict(flatten_weights(source), batch_size=[])
            return cast(TensorDictBase, flat.unflatten_keys("."))
        return flatten_weights(source)

    def apply_weights(self, destination: Any, weights: WeightsLike, inplace: bool = True) -> None:
        """Put ``weights`` into ``destination`` (a module, a TensorDict or a state_dict).

        In place, every destination tensor keeps its identity and storage and receives the new
        values; keys, shapes and dtypes must match exactly. Out of place, the destination's
        entries are replaced by the given tensors (a state_dict cannot be updated out of place).
        Raises :class:`LayoutMismatchError` naming every differing key before anything is written.
        """
        src = flatten_weights(weights)
        if isinstance(destination, nn.Module):
            if inplace:
                _copy_checked(flatten_weights(destination), src)
            else:
                _check_same(flatten_weights(destination), src)
                TensorDict(src, batch_size=[]).unflatten_keys(".").to_module(destination)
        elif isinstance(destination, TensorDictBase):
            dst = flatten_weights(destination)
            if inplace:
                _copy_checked(dst, src)
            else:
                _check_same(dst, src)
                destination.update(TensorDict(src, batch_size=[]).unflatten_keys("."))
        elif isinstance(destination, MutableMapping):
            if not inplace:
                raise ValueError("a state_dict destination can only be updated in place")
            _copy_checked(flatten_weights(destination), src)
        else:
            raise TypeError(
                "destination must be an nn.Module, a TensorDictBase or a state_dict, "
                f"got {type(destination).__name__}"
            )


def _check_same(dst: Mapping[str, torch.Tensor], src: Mapping[str, torch.Tensor]) -> None:
    problems = [f"{k}: missing from the weights" for k in sorted(dst.keys() - src.keys())]
    problems += [f"{k}: unexpected key" for k in sorted(src.keys() - dst.keys())]
    for k in sorted(dst.keys() & src.keys()):
        a, b = dst[k], src[k]
        if a.shape != b.shape or a.dtype != b.dtype:
            problems.append(f"{k}: expected {a.dtype}{list(a.shape)}, got {b.dtype}{list(b.shape)}")
    if problems:
        raise LayoutMismatchError(problems)


def _copy_checked(dst: Mapping[str, torch.Tensor], src: Mapping[str, torch.Tensor]) -> None:
    _check_same(dst, src)
    keys = sorted(dst)
    fused_copy([dst[k] for k in keys], [src[k] for k in keys])
