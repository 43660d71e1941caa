"""A scheme's configuration: its constructor's arguments, checked, and what it pickles to.

A scheme pickles to this configuration and its sender's address only (never sockets,
tensors or tasks), so that a trainer can hand it to a spawned worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypedDict

import torch

from .._channel import ChannelFactory, ZmqChannelFactory
from .._config import Heartbeats, Timeouts
from .._planes.base import DataPlane
from .._weights.strategy import StrategyName, WeightStrategy
from .base import SessionOptions

__all__ = ["SchemeConfig", "SchemeOptions", "refuse_both"]


class SchemeOptions(TypedDict, total=False):
    """The keyword arguments every scheme takes (see :class:`WeightSyncScheme`)."""

    strategy: StrategyName
    model_id: str
    bind: str
    timeouts: Timeouts | None
    heartbeats: Heartbeats | None
    channels: ChannelFactory | None
    apply_mode: Literal["auto", "swap", "copy"]
    background: bool
    wire_dtype: torch.dtype | None
    integrity: bool | None


class SchemeConfig:
    """The checked configuration of a scheme (the arguments of :class:`WeightSyncScheme`)."""

    _CONFIG: tuple[str, ...] = (
        "plane",
        "_address",
        "_strategy",
        "model_id",
        "bind",
        "timeouts",
        "heartbeats",
        "channels",
        "apply_mode",
        "background",
        "wire_dtype",
        "integrity",
    )
    """The attributes a scheme pickles to; subclasses add their own."""

    def __init__(
        self,
        address: str | None = None,
        *,
        plane: DataPlane,
        strategy: StrategyName = "tensordict",
        model_id: str = "policy",
        bind: str = "tcp://127.0.0.1:0",
        timeouts: Timeouts | None = None,
        heartbeats: Heartbeats | None = None,
        channels: ChannelFactory | None = None,
        apply_mode: Literal["auto", "swap", "copy"] = "auto",
        background: bool = True,
        wire_dtype: torch.dtype | None = None,
        integrity: bool | None = None,
    ) -> None:
        if wire_dtype is not None and (
            not isinstance(wire_dtype, torch.dtype) or not wire_dtype.is_floating_point
        ):
            raise ValueError(
                f"wire_dtype must be a floating torch dtype (torch.bfloat16, torch.float16, "
                f"...), got {wire_dtype!r}"
            )
        if integrity is not None and not isinstance(integrity, bool):
            raise TypeError(f"integrity must be True, False or None, got {integrity!r}")
        if apply_mode not in ("auto", "swap", "copy"):
            raise ValueError(f"apply_mode must be 'auto', 'swap' or 'copy', got {apply_mode!r}")
        if not isinstance(plane, DataPlane):
            raise TypeError(f"plane must be a DataPlane, got {type(plane).__name__}")
        if timeouts is not None and not isinstance(timeouts, Timeouts):
            raise TypeError(f"timeouts must be aiowsync.Timeouts(...), got {timeouts!r}")
        if heartbeats is not None and not isinstance(heartbeats, Heartbeats):
            raise TypeError(f"heartbeats must be aiowsync.Heartbeats(...), got {heartbeats!r}")
        if not isinstance(background, bool):
            raise TypeError(f"background must be True or False, got {background!r}")
        if channels is not None and not isinstance(channels, ChannelFactory):
            raise TypeError(f"channels must be a ChannelFactory, got {type(channels).__name__}")
        if not isinstance(model_id, str) or not model_id:
            raise ValueError(f"model_id must be a non-empty string, got {model_id!r}")
        channels = channels or ZmqChannelFactory()
        channels.check_address(bind, bind=True)
        if address is not None:
            channels.check_address(address, bind=False)
        self.plane = plane
        self._address = address
        self._strategy = WeightStrategy(strategy)
        self.model_id = model_id
        self.bind = bind
        self.timeouts = timeouts or Timeouts()
        self.heartbeats = heartbeats or Heartbeats()
        self.channels = channels
        self.apply_mode: Literal["auto", "swap", "copy"] = apply_mode
        self.background = background
        self.wire_dtype = wire_dtype
        self.integrity = integrity
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        """Forget everything but the configuration (a fresh object, or one just unpickled)."""

    def _session_options(self, model_id: str) -> SessionOptions:
        return SessionOptions(
            plane=self.plane,
            channels=self.channels,
            model_id=model_id,
            bind=self.bind,
            timeouts=self.timeouts,
            heartbeats=self.heartbeats,
            apply_mode=self.apply_mode,
            background=self.background,
            integrity=self.integrity,
        )

    def _pickled_address(self) -> str | None:
        """The address a pickled copy connects to."""
        return self._address

    def __getstate__(self) -> dict[str, Any]:
        state = {name: getattr(self, name) for name in self._CONFIG}
        state["_strategy"] = self._strategy.extract_as
        state["_address"] = self._pickled_address()
        return state

    _unpickled = False
    """Made by unpickling (a copy for a worker)."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        strategy = state.pop("_strategy")
        self.__dict__.update(state)
        self._unpickled = True
        self._strategy = WeightStrategy(strategy)
        self._reset_runtime()


def refuse_both(given: Mapping[str, object], built: str) -> None:
    """A scheme given ``plane=`` and also options of the plane it would have built: refused,
    since those options would configure nothing."""
    named = [name for name, value in given.items() if value is not None]
    if named:
        raise ValueError(
            f"give plane= or {', '.join(f'{n}=' for n in named)}, not both: those options "
            f"configure {built} that the scheme builds when no plane is given"
        )
