"""Turning the weight containers users hand us into flat ``{dotted key: tensor}`` mappings."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any, TypeAlias

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

__all__ = ["WeightsLike", "flatten_weights"]

WeightsLike: TypeAlias = nn.Module | TensorDictBase | Mapping[str, Any]
"""A module, a ``TensorDict`` or a state_dict (dotted keys; nested mappings are flattened)."""


def flatten_weights(weights: WeightsLike, *, detach: bool = True) -> dict[str, torch.Tensor]:
    """``{dotted key: tensor}`` for a module (parameters and buffers), TensorDict or mapping.

    Tensors that require grad come detached (to be read), unless ``detach`` is False: a
    receiver needs the very tensor objects it was given, to re-point them at each version.
    """
    out = _flatten(weights)
    if detach and any(map(_requires_grad, out.values())):
        out = {k: t.detach() if t.requires_grad else t for k, t in out.items()}
    return out


def _flatten(weights: WeightsLike) -> dict[str, torch.Tensor]:
    if isinstance(weights, nn.Module):
        flat: dict[str, torch.Tensor] = dict(weights.named_parameters())
        flat.update(weights.named_buffers())
        return flat
    if type(weights) is TensorDict:
        # A plain TensorDict of tensors and plain TensorDicts: its own key-to-value dicts are
        # walked directly, a few times quicker than ``to_dict``. That attribute is
        # tensordict's, not public: anything else found there (another kind of TensorDict,
        # non-tensor data), or no such attribute, takes the nested-dict form, itself quicker
        # to walk than ``items(include_nested=True)``. TensorDict keys are strings, so the
        # walk does nothing per leaf but name it.
        out: dict[str, Any] = {}
        leaves = [0]
        if _walk_plain(weights, "", out, leaves):
            if len(out) != leaves[0]:  # a dotted key named as a nested one ("a.b", ("a", "b"))
                out.clear()
                _flatten_plain(weights.to_dict(), "", out)
            return out
        out.clear()
        _flatten_plain(weights.to_dict(), "", out)
        if not all(map(_is_tensor, out.values())):
            name, bad = next((k, v) for k, v in out.items() if not _is_tensor(v))
            raise TypeError(f"weights entry {name!r} is a {type(bad).__name__}, not a tensor")
        return out
    if isinstance(weights, TensorDictBase):
        out = {}
        for key, value in weights.items(include_nested=True, leaves_only=True):
            name = ".".join(key) if isinstance(key, tuple) else str(key)
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"weights entry {name!r} is a {type(value).__name__}, not a tensor")
            if name in out:
                raise ValueError(f"weights key {name!r} appears twice after flattening")
            out[name] = value
        return out
    if isinstance(weights, Mapping):
        out = {}
        _flatten_mapping(weights, "", out)
        return out
    raise TypeError(
        "weights must be an nn.Module, a TensorDictBase or a state_dict mapping of str to "
        f"tensors, got {type(weights).__name__}"
    )


def _walk_plain(td: TensorDict, prefix: str, out: dict[str, Any], leaves: list[int]) -> bool:
    """Name every leaf of ``td`` into ``out``, counting them in ``leaves[0]`` (once per
    level, not per leaf); False, part done, if ``td`` holds anything but tensors and plain
    TensorDicts, or keeps its entries otherwise than tensordict 0.14-0.15."""
    entries = getattr(td, "_tensordict", None)
    if type(entries) is not dict:
        return False
    leaves[0] += len(entries)
    for key, value in entries.items():
        if isinstance(value, torch.Tensor):
            out[prefix + key] = value
        elif type(value) is TensorDict:
            leaves[0] -= 1
            if not _walk_plain(value, prefix + key + ".", out, leaves):
                return False
        else:
            return False
    return True


def _flatten_plain(m: dict[str, Any], prefix: str, out: dict[str, Any]) -> None:
    for key, value in m.items():
        if type(value) is dict:
            _flatten_plain(value, prefix + key + ".", out)
        elif prefix + key in out:
            raise ValueError(f"weights key {prefix + key!r} appears twice after flattening")
        else:
            out[prefix + key] = value


def _is_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor)


_requires_grad = operator.attrgetter("requires_grad")


def _flatten_mapping(m: Mapping[Any, Any], prefix: str, out: dict[str, torch.Tensor]) -> None:
    for key, value in m.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"state_dict keys must be non-empty strings, got {key!r}")
        name = prefix + key
        if isinstance(value, torch.Tensor):
            if name in out:
                raise ValueError(f"state_dict key {name!r} appears twice after flattening")
            out[name] = value
        elif isinstance(value, Mapping):
            _flatten_mapping(value, name + ".", out)
        elif isinstance(value, (nn.Module, TensorDictBase)):
            # Several models in one mapping ({"policy": module, "value": td}).
            for key_, tensor in _flatten(value).items():
                full = f"{name}.{key_}"
                if full in out:
                    raise ValueError(f"weights key {full!r} appears twice after flattening")
                out[full] = tensor
        else:
            raise TypeError(f"weights entry {name!r} is a {type(value).__name__}, not a tensor")
