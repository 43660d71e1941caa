"""A sender's scheme described in JSON, for receivers that are handed it over HTTP.

A vLLM server's workers join the trainer's scheme from a JSON body (no pickle on any socket):
the scheme's kind, its sender's address, the options a receiver must share with the sender,
the CURVE keys a receiver presents (never the server secret; every tcp sender has keys unless
it opted out), and the names, dtypes and shapes of the tensors the trainer sends. The keys
make the description a secret: it travels in the body of one request and is never logged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from .._channel import ZmqChannelFactory, reachable
from .._channel._auth import CurveKeys
from .._config import Heartbeats, Timeouts
from .._exceptions import LayoutMismatchError
from .._scheme.distributed import DistributedWeightSyncScheme
from .._scheme.scheme import WeightSyncScheme
from .._scheme.sender import SenderSession
from .._scheme.shared_mem import SharedMemWeightSyncScheme
from .._weights.specs import dtype_from_name, dtype_name

__all__ = ["describe", "placeholders", "rebuild"]

FORMAT = 2
"""Raised whenever the description changes in a way an older engine cannot read (2: tcp
senders authenticate by default, and ``allow_insecure_bind`` says when one does not)."""


def _dtype(name: str) -> torch.dtype:
    # The table the handshake reads dtypes from: a name never reaches getattr(torch, ...).
    try:
        return dtype_from_name(name)
    except LayoutMismatchError:
        raise ValueError(f"unknown dtype {name[:40]!r} in the scheme's description") from None


def describe(scheme: WeightSyncScheme) -> dict[str, Any]:
    """The JSON-ready description of a sender's ``scheme`` (its address bound)."""
    sending = scheme._sending
    if not isinstance(sending, SenderSession):
        raise RuntimeError("only a sender's scheme (init_on_sender) can be described")
    if isinstance(scheme, SharedMemWeightSyncScheme) and scheme.num_slots is not None:
        kind, plane = "shared_mem", {}
    elif isinstance(scheme, DistributedWeightSyncScheme) and scheme.backend is not None:
        kind = "distributed"
        plane = {
            "backend": scheme.backend,
            "bucket_bytes": scheme.bucket_bytes,
            "data_host": scheme.data_host,
            "topology": scheme.topology,
        }
    else:
        raise TypeError(
            "vLLM servers join a SharedMemWeightSyncScheme or a DistributedWeightSyncScheme "
            f"(with its own plane), not a {type(scheme).__name__}"
        )
    channels = scheme.channels
    if not isinstance(channels, ZmqChannelFactory):
        raise TypeError("vLLM servers reach the trainer over ZeroMQ: keep the default channels")
    address = scheme.address  # bound first: a tcp bind makes the keys its receivers present
    curve = channels.receiver_keys(address)
    keys = None
    if curve is not None:
        if curve.client_public is None or curve.client_secret is None:
            raise ValueError(
                "the scheme's CurveKeys hold no client key pair for the servers' workers to "
                "present (CurveKeys.generate() makes one)"
            )
        keys = {
            "server_public": curve.server_public,
            "client_public": curve.client_public,
            "client_secret": curve.client_secret,
        }
    layout = sending.layout
    model = sending.model
    # A module's non-persistent buffers (rotary tables, masks) are no checkpoint's tensors: a
    # server computes its own, and its loader knows no such names.
    skip: list[str] = []
    if isinstance(model, nn.Module):
        kept = set(model.state_dict(keep_vars=True))
        skip = [s.key for s in layout.specs if s.key not in kept]
    return {
        "format": FORMAT,
        "kind": kind,
        "address": reachable(address, getattr(scheme, "data_host", None)),
        "model_id": scheme.model_id,
        "plane": plane,
        "integrity": scheme.integrity,
        "wire_dtype": None if scheme.wire_dtype is None else dtype_name(scheme.wire_dtype),
        "timeouts": dataclasses.asdict(scheme.timeouts),
        "heartbeats": dataclasses.asdict(scheme.heartbeats),
        "curve": keys,
        "allow_insecure_bind": channels.allow_insecure_bind,
        "allow_other_users": channels.allow_other_users,
        "tensors": [[s.key, dtype_name(s.dtype), list(s.shape)] for s in layout.specs],
        "skip": skip,
    }


def rebuild(description: dict[str, Any]) -> WeightSyncScheme:
    """A receiver's scheme (not yet initialised) from :func:`describe`'s output."""
    if description.get("format") != FORMAT:
        raise ValueError(
            f"this aiowsync reads scheme descriptions of format {FORMAT}, got "
            f"{description.get('format')!r}: install the same aiowsync on the trainer and in "
            "the vLLM server"
        )
    curve = description["curve"]
    channels = ZmqChannelFactory(
        curve=None if curve is None else CurveKeys(**curve),
        allow_insecure_bind=bool(description["allow_insecure_bind"]),
        allow_other_users=bool(description["allow_other_users"]),
    )
    wire = description["wire_dtype"]
    options: dict[str, Any] = {
        "model_id": description["model_id"],
        "integrity": description["integrity"],
        "wire_dtype": None if wire is None else _dtype(wire),
        "timeouts": Timeouts(**description["timeouts"]),
        "heartbeats": Heartbeats(**description["heartbeats"]),
        "channels": channels,
        # The engine reads versions through leases; the model it holds is only the layout.
        "apply_mode": "swap",
    }
    address = description["address"]
    if description["kind"] == "shared_mem":
        return SharedMemWeightSyncScheme(address, **options)
    if description["kind"] == "distributed":
        return DistributedWeightSyncScheme(address, **description["plane"], **options)
    raise ValueError(f"unknown scheme kind {description['kind']!r}")


def placeholders(description: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Unfilled tensors of the sent names, dtypes and shapes, for ``init_on_receiver``; they
    take no memory until written (swap mode never writes them)."""
    wire = description["wire_dtype"]
    out: dict[str, torch.Tensor] = {}
    for key, name, shape in description["tensors"]:
        dtype = _dtype(name)
        if wire is not None and dtype.is_floating_point:
            dtype = _dtype(wire)
        out[key] = torch.empty(tuple(shape), dtype=dtype)
    return out
