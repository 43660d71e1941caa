"""The sender's side of the handshake: whether a hello is refused, and why."""

from __future__ import annotations

from ._channel import SenderChannel
from ._exceptions import TransportError, WeightSyncError
from ._layout import Layout
from ._peers import Peer, PeerTable
from ._protocol import PROTOCOL_VERSION, Heartbeat, Hello
from ._text import excerpt

__all__ = ["probe_gone", "refusal"]

_SHOWN = 50
"""Differences a refusal lists."""


def refusal(hello: Hello, layout: Layout, model_id: str, num_workers: int) -> str | None:
    """Why ``hello`` is refused, or None. Whatever a strange hello trips is a refusal too,
    never an error of the sender's."""
    try:
        return _refusal(hello, layout, model_id, num_workers)
    except Exception as exc:
        return f"the hello could not be checked: {excerpt(repr(exc))}"


def _refusal(hello: Hello, layout: Layout, model_id: str, num_workers: int) -> str | None:
    if hello.protocol != PROTOCOL_VERSION:
        return f"protocol {hello.protocol} is not supported (sender speaks {PROTOCOL_VERSION})"
    if hello.model_id != model_id:
        return f"this sender serves model {model_id!r}, not {hello.model_id!r}"
    if not 0 <= hello.worker_idx < num_workers:
        return f"worker index {hello.worker_idx} is out of range(0, {num_workers})"
    if hello.fingerprint != layout.fingerprint:
        ours, theirs_count = len(layout.specs), len(hello.layout)
        if theirs_count > 2 * ours + 64:
            # Not worth a layout of its own (and a hostile hello can name a million).
            return f"the receiver's model has {theirs_count} tensors, the sender's {ours}"
        try:
            theirs = Layout.from_descs(hello.layout, sectioned=layout.sectioned)
        except (WeightSyncError, ValueError, TypeError, OverflowError) as exc:
            return f"the receiver's model layout is invalid: {excerpt(str(exc))}"
        # Every difference is counted: the count of keys was bounded above.
        lines = layout.differences(theirs) or ["layouts differ (alignment or order)"]
        shown = "\n  ".join(lines[:_SHOWN])
        more = f"\n  ... and {len(lines) - _SHOWN} more" if len(lines) > _SHOWN else ""
        wire = ""
        if layout.wire_dtype is not None:
            name = str(layout.wire_dtype).removeprefix("torch.")
            wire = (
                f" (floating tensors travel as {name}, the sender's wire_dtype; a receiver "
                "built from an address must be given the same)"
            )
        return f"the receiver's model does not match the sender's{wire}:\n  {shown}{more}"
    return None


async def probe_gone(peers: PeerTable, channel: SenderChannel, peer: Peer, beat: Heartbeat) -> bool:
    """True when ``peer``, the holder of an index that a new hello claims, is demonstrably
    gone: its process ended, where the plane can see it; else its connection is gone (a
    ``beat`` to it is refused)."""
    if peers.sees_processes(peer):
        return peers.gone(peer)
    try:
        await channel.send(peer.routing, beat, timeout=0)
    except TransportError:
        return True
    except WeightSyncError:
        return False
    return False
