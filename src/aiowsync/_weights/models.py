"""Several models in one scheme: checking ``models=``, and the forms the two sides need.

A scheme of several models lays them out as one layout whose keys are ``model_id.key`` and
in which each model owns whole buffers of its own (``Layout(sectioned=True)``); a version
covers every model at once.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

from .._protocol import MAX_MODELS
from .binding import module_targets
from .flatten import WeightsLike, flatten_weights

__all__ = ["check_models", "models_id", "receiver_targets", "sender_weights", "split_send"]

_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_models(models: object) -> dict[str, WeightsLike]:
    """``models`` as a dict, or the error that says what is wrong with it."""
    if not isinstance(models, Mapping) or not models:
        raise ValueError(
            "models= takes a non-empty mapping of model id to an nn.Module, a TensorDict or a "
            "state_dict, e.g. models={'policy': policy, 'value': value}"
        )
    if len(models) > MAX_MODELS:
        raise ValueError(
            f"models= holds {len(models)} models; a scheme holds at most {MAX_MODELS} (give "
            "related tensors as one model: a TensorDict or a state_dict of many tensors)"
        )
    out: dict[str, WeightsLike] = {}
    for model_id, model in models.items():
        if not isinstance(model_id, str) or not _ID.match(model_id):
            raise ValueError(
                f"model id {model_id!r} must be 1-64 letters, digits, '_' or '-' (no dots: "
                "it prefixes the model's own keys)"
            )
        if not isinstance(model, (nn.Module, TensorDictBase, Mapping)):
            raise TypeError(
                f"models[{model_id!r}] is a {type(model).__name__}; give an nn.Module, a "
                "TensorDict or a state_dict"
            )
        out[model_id] = model
    return out


def models_id(models: Mapping[str, Any]) -> str:
    """The name a scheme of several models goes by in its handshake (both sides agree)."""
    return "+".join(sorted(models))[:256]


def sender_weights(models: Mapping[str, WeightsLike]) -> tuple[nn.Module | None, WeightsLike]:
    """What the sender sends by default: one module holding every model when all are modules
    (its tensors are watched and can be re-homed, as for one model), else the mapping.

    Models that share a tensor (an actor and a critic on one trunk) are sent as the mapping:
    one module holding them all would list the shared tensor under the first model only,
    where each receiver lists it under every model that holds it."""
    if all(isinstance(m, nn.Module) for m in models.values()) and not _share(models):
        try:
            holder = nn.ModuleDict(models)  # type: ignore[arg-type]
        except KeyError:  # an id that is an attribute of nn.Module ("training", ...)
            return None, dict(models)
        return holder, holder
    return None, dict(models)


def _share(models: Mapping[str, Any]) -> bool:
    """Whether two of ``models`` (modules) hold one parameter or buffer."""
    seen: set[int] = set()
    for model in models.values():
        own = {id(t) for t in (*model.parameters(), *model.buffers())}
        if own & seen:
            return True
        seen |= own
    return False


def receiver_targets(models: Mapping[str, WeightsLike]) -> dict[str, torch.Tensor]:
    """The tensors each version is bound or copied to, by ``model_id.key``: the modules' own
    parameters and buffers, the TensorDicts' and state_dicts' own tensor objects."""
    out: dict[str, torch.Tensor] = {}
    for model_id, model in models.items():
        flat = (
            module_targets(model)
            if isinstance(model, nn.Module)
            else flatten_weights(model, detach=False)
        )
        out.update({f"{model_id}.{key}": t for key, t in flat.items()})
    return out


def split_send(
    weights: object, models: Mapping[str, WeightsLike]
) -> tuple[dict[str, WeightsLike], bool]:
    """``send(weights=...)`` of a scheme of several models: the models named (a mapping or a
    TensorDict keyed by model id), and whether that is every model. Unknown ids are refused
    before anything is staged."""
    if isinstance(weights, TensorDictBase):
        named: dict[str, Any] = {str(k): weights[k] for k in weights.keys()}  # noqa: SIM118
    elif isinstance(weights, Mapping):
        named = dict(weights)
    else:
        raise TypeError(
            "a scheme of several models sends weights={model_id: weights, ...} (a mapping or "
            f"a TensorDict keyed by model id), not a {type(weights).__name__}"
        )
    if not named:
        raise ValueError("weights={} names no model: name at least one, or send() them all")
    unknown = sorted(str(k) for k in named if k not in models)
    if unknown:
        known = ", ".join(repr(k) for k in models)
        raise ValueError(f"unknown model id(s) {unknown}: this scheme holds {known}")
    every = set(named) == set(models)
    if not every:
        _refuse_split_sharing(named, models)
    return named, every


def _refuse_split_sharing(named: Mapping[str, Any], models: Mapping[str, WeightsLike]) -> None:
    """Refuse a send of some models that leaves out one sharing a tensor with them (an actor
    and a critic on one trunk): a worker holds the shared tensor once, so it could not keep
    the new trunk for one model and the old one for the other."""
    # By the bytes they hold, not the objects: a state_dict() gives new tensor objects over
    # the module's memory at each call. Models that merely live in one allocation (a flat
    # buffer of the trainer's) share no bytes.
    spans = sorted((lo, hi, name) for name, model in models.items() for lo, hi in _spans_of(model))
    reach, holder = 0, ""
    for lo, hi, name in spans:
        if lo < reach and name != holder and (name in named) != (holder in named):
            sent, kept = (name, holder) if name in named else (holder, name)
            raise ValueError(
                f"models {sent!r} and {kept!r} share tensors (one trunk, say), and a "
                f"worker holds them once: send {sent!r} together with {kept!r} "
                "(weights={...} naming both), or send() every model"
            )
        if hi > reach:
            reach, holder = hi, name


def _spans_of(model: WeightsLike) -> list[tuple[int, int]]:
    """The address range of each of ``model``'s tensors (empty and meta ones left out)."""
    if isinstance(model, nn.Module):
        tensors = [*model.parameters(), *model.buffers()]
    else:
        tensors = list(flatten_weights(model, detach=False).values())
    spans = []
    for t in tensors:
        if t.is_meta or t.numel() == 0:
            continue
        extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1
        spans.append((t.data_ptr(), t.data_ptr() + extent * t.element_size()))
    return spans
