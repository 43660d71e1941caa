"""What a TorchRL-facing sender sends, and to whom: one model for every worker, or one each.

TorchRL lets a scheme be set up in several ways (from a collector, from a model or weights with
their devices, from a map of each worker's weights), and a collector built from policy
factories has no policy on the trainer at all. :func:`plan_sender` turns any of these into a
:class:`Plan`: the models that aiowsync schemes will send, and which scheme each worker joins.
Workers whose weights are their own (distinct factories, or a map with distinct weights per
worker) get a scheme each, so that a version sent to one never reaches another.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tensordict import TensorDictBase
from torch import nn

from .._scheme.base import resolve_model

__all__ = ["Plan", "plan_sender"]

Source = nn.Module | TensorDictBase
"""What one aiowsync sender is built from."""


@dataclass
class Plan:
    """The senders to build and each worker's place among them.

    ``sources[k]`` is the model (or weights) of sender ``k``; worker ``i`` joins sender
    ``route[i][0]`` as its receiver ``route[i][1]``. ``local`` is set instead when the
    collector has no worker processes: its policy is the trainer's own.
    """

    sources: list[Source] = field(default_factory=list)
    route: list[tuple[int, int]] = field(default_factory=list)
    local: nn.Module | None = None

    @property
    def per_worker(self) -> bool:
        """Whether each worker has a sender of its own."""
        return len(self.sources) > 1

    def workers_of(self, sender: int) -> list[int]:
        """The workers that ``sender`` serves, in its own numbering's order."""
        return [w for w, (k, _) in enumerate(self.route) if k == sender]


def _shared(source: Source, workers: int) -> Plan:
    return Plan([source], [(0, i) for i in range(workers)])


def _each(sources: list[Source]) -> Plan:
    return Plan(list(sources), [(i, 0) for i in range(len(sources))])


def plan_sender(
    *,
    model_id: str,
    context: Any = None,
    model: nn.Module | None = None,
    weights: TensorDictBase | None = None,
    params_map: Mapping[int, TensorDictBase] | None = None,
    devices: list[Any] | None = None,
    num_workers: int | None = None,
    per_worker: bool = False,
) -> Plan:
    """The :class:`Plan` for one of the ways TorchRL sets a sender up (see the module)."""
    if params_map is not None:
        if any(x is not None for x in (context, model, weights, devices)):
            raise ValueError("params_map= goes alone (no context, model, weights or devices)")
        return _from_map(params_map, per_worker)
    given = model if model is not None else weights
    if given is not None:
        if context is not None:
            raise ValueError("give a context or a model (or weights), not both")
        workers = len(devices) if devices is not None else num_workers
        if not workers:
            raise ValueError(
                "how many workers? give devices= (one per worker) or num_workers= with the "
                "model or weights"
            )
        if per_worker:
            return _each([given] * workers)
        return _shared(given, workers)
    if context is None:
        raise ValueError(
            "init_on_sender() needs a context (a collector), a model, weights or a params_map"
        )
    return _from_context(context, model_id, num_workers, per_worker)


def _from_map(params_map: Mapping[int, TensorDictBase], per_worker: bool) -> Plan:
    if sorted(params_map) != list(range(len(params_map))) or not params_map:
        raise ValueError(
            f"params_map's keys must be the worker indices 0..n-1, got {sorted(params_map)}"
        )
    ordered = [params_map[i] for i in range(len(params_map))]
    if not per_worker and all(w is ordered[0] for w in ordered):
        return _shared(ordered[0], len(ordered))
    return _each(list(ordered))


def _from_context(context: Any, model_id: str, num_workers: int | None, per_worker: bool) -> Plan:
    workers = num_workers if num_workers is not None else getattr(context, "num_workers", None)
    model = _held(context, model_id)
    if model is None and model_id == "policy":
        factories = _factories(context)
        if factories:
            if not workers:
                return Plan(local=_module(factories[0](), model_id))
            if len(factories) != workers:
                raise ValueError(
                    f"{len(factories)} policy factories for {workers} workers: give one, or one "
                    "per worker"
                )
            if all(f is factories[0] for f in factories) and not per_worker:
                return _shared(_module(factories[0](), model_id), workers)
            return _each([_module(f(), model_id) for f in factories])
    if model is None:
        raise ValueError(
            f"no model for {model_id!r}: the collector holds none under that id and has no "
            "policy factory to build one from"
        )
    if not workers:
        # A collector without worker processes runs the trainer's own model.
        return Plan(local=_module(model, model_id))
    if per_worker:
        return _each([model] * int(workers))
    return _shared(model, int(workers))


def _held(context: Any, model_id: str) -> Any:
    """The model the collector holds under ``model_id``, or None (a factory-built collector
    holds no policy on the trainer; TorchRL's getter raises then)."""
    try:
        found = resolve_model(context, model_id)
    except (ValueError, KeyError, AttributeError, IndexError):
        found = None
    if found is None and model_id == "policy":
        found = getattr(context, "_fallback_policy", None)
    return found if isinstance(found, (nn.Module, TensorDictBase)) else None


def _factories(context: Any) -> list[Callable[[], Any]]:
    factories = getattr(context, "policy_factory", None)
    if factories is None:
        return []
    if callable(factories):
        return [factories]
    return [f for f in factories if f is not None] if any(factories) else []


def _module(found: Any, model_id: str) -> nn.Module:
    if not isinstance(found, nn.Module):
        raise TypeError(
            f"{model_id!r} is a {type(found).__name__}, not an nn.Module: a policy without "
            "weights needs no weight-sync scheme"
        )
    return found
