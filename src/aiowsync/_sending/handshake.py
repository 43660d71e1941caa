"""The sender's side of the handshake: whether a hello is refused, and why."""

from __future__ import annotations

from .._channel import SenderChannel
from .._exceptions import TransportError, WeightSyncError
from .._protocol import MAX_FRAME, PROTOCOL_VERSION, Heartbeat, Hello, encode
from .._protocol._messages import MAX_TENSORS, MAX_TEXT
from .._util.text import excerpt
from .._weights.layout import Layout
from .peers import Peer, PeerTable

__all__ = ["hello_limit", "probe_gone", "refuse_oversized", "refusal"]

_SHOWN = 50
"""Differences a refusal lists."""


def _hello_bytes(layout: Layout) -> int:
    """The bytes of a hello that describes ``layout``."""
    return len(encode(Hello(
        protocol=PROTOCOL_VERSION, model_id="", worker_idx=0, fingerprint="0" * 64,
        layout=layout.descs(),
    )))  # fmt: skip


def hello_limit(layout: Layout) -> int:
    """The largest message a receiver of ``layout`` sends (its hello), with room for a
    receiver whose model differs somewhat (so that it is refused with the differences rather
    than cut off), in bytes."""
    return 2 * _hello_bytes(layout) + MAX_TEXT + 64 * 1024


def refuse_oversized(layout: Layout) -> None:
    """``ValueError`` if a hello that describes ``layout`` could not travel: the sender would
    never read it, and the worker would wait for an answer until its deadline."""
    size = _hello_bytes(layout) + MAX_TEXT
    if size > MAX_FRAME or len(layout.specs) > MAX_TENSORS:
        raise ValueError(
            f"a model of {len(layout.specs)} tensors is described in {size / 2**20:.1f} MiB, "
            f"more than a control message may hold ({MAX_FRAME >> 20} MiB, {MAX_TENSORS} "
            "tensors): join tensors "
            "into fewer (e.g. stack a model's experts), or shorten their names"
        )


def refusal(
    hello: Hello, layout: Layout, model_id: str, num_workers: int
) -> tuple[str, str] | None:
    """Why ``hello`` is refused, or None: the whole reason (for the trainer's log and worker
    table) and what the peer is told, which names no key of the sender's model that the
    peer did not name itself (any process that reaches the socket may say hello). Whatever
    a strange hello trips is a refusal too, never an error of the sender's."""
    try:
        reason = _refusal(hello, layout, model_id, num_workers)
    except Exception as exc:
        reason = f"the hello could not be checked: {excerpt(repr(exc))}"
    if reason is None or isinstance(reason, tuple):
        return reason
    return reason, reason


def _refusal(
    hello: Hello, layout: Layout, model_id: str, num_workers: int
) -> str | tuple[str, str] | None:
    if hello.protocol != PROTOCOL_VERSION:
        return f"protocol {hello.protocol} is not supported (sender speaks {PROTOCOL_VERSION})"
    if hello.model_id != model_id:
        return f"this sender serves model {model_id!r}, not {hello.model_id!r}"
    if not 0 <= hello.worker_idx < num_workers:
        return (
            f"worker index {hello.worker_idx} is out of range(0, {num_workers}): "
            "indices run from 0 to num_workers - 1"
        )
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
        named = {s.key for s in theirs.specs}
        missing = sum(s.key not in named for s in layout.specs)
        told = [line for line in lines if ": missing (expected " not in line]
        if missing:
            told.append(
                f"{missing} key(s) of the sender's model are missing from the receiver's "
                "(the trainer's log and worker table name them)"
            )
        wire = ""
        if layout.wire_dtype is not None:
            name = str(layout.wire_dtype).removeprefix("torch.")
            wire = (
                f" (floating tensors travel as {name}, the sender's wire_dtype; a receiver "
                "built from an address must be given the same)"
            )
        head = f"the receiver's model does not match the sender's{wire}:\n  "
        return head + _listed(lines), head + _listed(told)
    return None


def _listed(lines: list[str]) -> str:
    shown = "\n  ".join(lines[:_SHOWN])
    return shown + (f"\n  ... and {len(lines) - _SHOWN} more" if len(lines) > _SHOWN else "")


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
