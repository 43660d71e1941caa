"""Where a send's weights come from: the sender's own model, or weights given to one send.

The scheme builds the model's source once (its watch, its re-homed buffers) and one source
per explicit ``send(weights)``; the plane calls :meth:`snapshot` when it stages, which checks
the weights against the layout before a byte is written.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .._planes.base import Source, WeightSource
from .._weights.binding import rehome
from .._weights.flatten import WeightsLike, flatten_weights
from .._weights.layout import Layout, refuse_meta
from .watch import ModelWatch

__all__ = ["ModelSource", "PartialSource", "WeightsSource"]

log = logging.getLogger("aiowsync")


class ModelSource(WeightSource):
    """The sender's own module, watched for replaced tensors; optionally re-homed into one
    private flat buffer so that a snapshot is one copy per buffer."""

    def __init__(
        self, module: nn.Module, layout: Layout, *, rehome_it: bool = False, cast: bool = False
    ) -> None:
        self.layout = layout
        """The model's own layout (its dtypes), which snapshots are checked against."""
        self.cast = cast
        """The plane's layout has other dtypes (a wire dtype): no raw buffers then."""
        self._flat: list[torch.Tensor] | None = None
        if rehome_it and not cast:
            try:
                self._flat = rehome(module, layout)
            except (ValueError, RuntimeError) as exc:
                log.info("could not re-home the model (%s); snapshots use fused copies", exc)
        self._watch = ModelWatch(module)
        self._homed = self._watch.signature()
        """The model's tensors as re-homed (:meth:`ModelWatch.signature`)."""

    @property
    def key(self) -> object:
        return self

    def snapshot(self) -> Source:
        watch = self._watch
        if watch.dirty:
            self._recheck()
        if self._flat is not None:
            if watch.signature() == self._homed:
                return Source(buffers=tuple(self._flat))
            log.info("the model changed since it was re-homed; using fused copies")
            self._flat = None
        if not watch.same_specs():
            self._recheck()
        return Source(tensors=watch.tensors, model=True, cast=self.cast)

    def _recheck(self) -> None:
        watch = self._watch
        watch.refresh()
        try:
            self.layout.check(watch.tensors)
        except BaseException:
            # What the walk found does not fit: look again at the next send, not only once
            # something changes again.
            watch.dirty = True
            raise

    def close(self) -> None:
        self._watch.close()


class WeightsSource(WeightSource):
    """A module, TensorDict or state_dict, flattened and checked at each snapshot."""

    def __init__(self, weights: WeightsLike, layout: Layout, *, cast: bool = False) -> None:
        self.weights = weights
        self.layout = layout
        self.cast = cast

    @property
    def key(self) -> object:
        # The same weights object sent again: the plane may start copying what it copied last.
        return ("weights", id(self.weights))

    def snapshot(self) -> Source:
        # Not detached: the planes only read them, under no_grad, and a detached view per leaf
        # costs more than the check.
        flat = flatten_weights(self.weights, detach=False)
        self.layout.check(flat)
        refuse_meta(flat, "they hold no values to send")
        return Source(tensors=flat, cast=self.cast)


class PartialSource(WeightSource):
    """Some of the models of a scheme of several (``{model_id: weights}``); the plane keeps
    the others' bytes from the newest version."""

    def __init__(
        self, named: dict[str, WeightsLike], layout: Layout, *, cast: bool = False
    ) -> None:
        self.named = named
        self.layout = layout.subset(named)
        self.carry = frozenset(layout.sections) - frozenset(named)
        self.cast = cast

    @property
    def key(self) -> object:
        return ("partial", tuple((k, id(v)) for k, v in self.named.items()))

    def snapshot(self) -> Source:
        flat = flatten_weights(self.named, detach=False)
        self.layout.check(flat)
        refuse_meta(flat, "they hold no values to send")
        return Source(tensors=flat, carry=self.carry, cast=self.cast)
