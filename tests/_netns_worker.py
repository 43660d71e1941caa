"""A receiver process for tests/test_netns.py, run inside a network namespace.

    python _netns_worker.py receiver ADDRESS WORKER_IDX
    python _netns_worker.py intruder ADDRESS WORKER_IDX DEADLINE

Keys come from the environment, never argv (which any user can read): ``AIOWSYNC_NETNS_KEYS``
holds a JSON object with ``server_public`` and, for a receiver, ``client_public`` and
``client_secret``. Reports go to stdout, one JSON object a line; nothing is ever pickled.

A receiver reports ``ready`` (version and digest after connecting), ``version`` after each
switch, and ``done`` once stdin says ``stop`` or is closed. An intruder reports ``armed``,
waits for ``go`` on stdin, then tries to join with a fresh client key pair and with no CURVE at
all, at once, and reports one ``attempt`` each.
"""

from __future__ import annotations

import os

os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

import asyncio
import json
import sys
import threading
import time
from typing import Any

import torch

import aiowsync
from _workers import digest, make_model

BUCKET_BYTES = 8 << 10
_print_lock = threading.Lock()


def report(event: str, **fields: Any) -> None:
    with _print_lock:
        sys.stdout.write(json.dumps({"event": event, "pid": os.getpid(), **fields}) + "\n")
        sys.stdout.flush()


def watch_stdin(loop: asyncio.AbstractEventLoop, go: asyncio.Event, stop: asyncio.Event) -> None:
    """Sets ``go`` on a ``go`` line and ``stop`` on a ``stop`` line or end of input."""
    for line in sys.stdin:
        if line.strip() == "go":
            loop.call_soon_threadsafe(go.set)
        elif line.strip() == "stop":
            break
    loop.call_soon_threadsafe(stop.set)


def scheme_for(
    address: str, channels: aiowsync.ZmqChannelFactory
) -> aiowsync.DistributedWeightSyncScheme:
    return aiowsync.DistributedWeightSyncScheme(
        address=address, backend="gloo", bucket_bytes=BUCKET_BYTES, channels=channels
    )


async def receiver(address: str, worker_idx: int, keys: aiowsync.CurveKeys) -> None:
    loop = asyncio.get_running_loop()
    go, stop = asyncio.Event(), asyncio.Event()
    threading.Thread(target=watch_stdin, args=(loop, go, stop), daemon=True).start()
    model = make_model("small")
    scheme = scheme_for(address, aiowsync.ZmqChannelFactory(curve=keys))
    scheme.init_on_receiver(model=model, worker_idx=worker_idx)
    scheme.register_hook(
        lambda version: report("version", idx=worker_idx, version=version, digest=digest(model))
    )
    async with scheme:
        await scheme.connect(timeout=30)
        report("ready", idx=worker_idx, version=scheme.version, digest=digest(model))
        await stop.wait()
        connected, version = scheme.connected, scheme.version
    report("done", idx=worker_idx, version=version, connected=connected)


async def attempt(
    address: str, name: str, channels: aiowsync.ZmqChannelFactory, worker_idx: int, deadline: float
) -> None:
    model = make_model("small")
    before = digest(model)
    scheme = scheme_for(address, channels)
    scheme.init_on_receiver(model=model, worker_idx=worker_idx)
    started = time.monotonic()
    error, is_timeout = None, False
    async with scheme:
        try:
            await scheme.connect(timeout=deadline)
        except Exception as exc:
            error, is_timeout = type(exc).__name__, isinstance(exc, TimeoutError)
    report(
        "attempt",
        name=name,
        error=error,
        is_timeout=is_timeout,
        took=time.monotonic() - started,
        untouched=digest(model) == before,
        client_public=getattr(channels.curve, "client_public", None),
    )


async def intruder(address: str, worker_idx: int, server_public: str, deadline: float) -> None:
    loop = asyncio.get_running_loop()
    go, stop = asyncio.Event(), asyncio.Event()
    threading.Thread(target=watch_stdin, args=(loop, go, stop), daemon=True).start()
    public, secret = aiowsync.CurveKeys.keypair()
    wrong = aiowsync.CurveKeys(
        server_public=server_public, client_public=public, client_secret=secret
    )
    report("armed", idx=worker_idx)
    waits = {asyncio.ensure_future(go.wait()), asyncio.ensure_future(stop.wait())}
    _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    if not go.is_set():
        return
    args = (worker_idx, deadline)
    await asyncio.gather(
        attempt(address, "wrong client keys", aiowsync.ZmqChannelFactory(curve=wrong), *args),
        attempt(address, "no CURVE", aiowsync.ZmqChannelFactory(allow_insecure_bind=True), *args),
    )
    report("done", idx=worker_idx)


def main() -> None:
    torch.set_num_threads(1)
    mode, address, worker_idx = sys.argv[1], sys.argv[2], int(sys.argv[3])
    keys = json.loads(os.environ["AIOWSYNC_NETNS_KEYS"])
    try:
        if mode == "receiver":
            asyncio.run(receiver(address, worker_idx, aiowsync.CurveKeys(**keys)))
        elif mode == "intruder":
            deadline = float(sys.argv[4])
            asyncio.run(intruder(address, worker_idx, keys["server_public"], deadline))
        else:
            raise ValueError(f"unknown mode {mode!r}")
    except Exception as exc:
        # The test reads this at once instead of waiting out its deadline.
        report("error", idx=worker_idx, error=f"{type(exc).__name__}: {exc}")
        raise


if __name__ == "__main__":
    main()
