"""A trainer that sends once per host: relays fan the weights out to the workers of each host.

The trainer sends its policy over torch.distributed (gloo) to one relay process per host.
Each relay is a receiver of the trainer and, through ``upstream.relay_to(local)``, the
shared-memory sender of that host's rollout workers (its leaves): every version it applies is
staged once into shared memory and sent to its leaves under the trainer's version number, and
the relay acknowledges the trainer only once its leaves hold it. So when the trainer's
``send()`` returns version v, every worker on every host runs v.

Here the "hosts" are processes on this machine: two relays with two workers each. Each worker
runs rollouts on its own event loop; at the end each reports its version and a SHA-256 of its
weights, which the trainer checks against its own.

Run it with::

    .venv/bin/python examples/relay_fanout.py
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: small machines

import argparse
import asyncio
import hashlib
import multiprocessing as mp
import sys
from typing import Any

import torch
from torch import nn

import aiowsync

RELAYS, LEAVES, UPDATES = 2, 2, 6


def make_policy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))


def sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for key, t in sorted(model.state_dict().items()):
        h.update(key.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def relay_main(
    trainer: aiowsync.DistributedWeightSyncScheme, host: int, events: Any, stop: Any
) -> None:
    """One host's relay: the trainer's worker ``host``, and the sender of this host's leaves."""
    torch.set_num_threads(1)

    async def main() -> None:
        policy = make_policy()
        trainer.init_on_receiver(model=policy, worker_idx=host)
        local = aiowsync.SharedMemWeightSyncScheme()
        local.init_on_sender(model=policy, num_workers=LEAVES)
        trainer.relay_to(local)
        async with local:
            events.put(("address", host, local.address))  # where this host's leaves connect
            async with trainer:
                await trainer.connect(timeout=120)
                await local.connect(timeout=120)
                while not stop.is_set():
                    await asyncio.sleep(0.05)

    asyncio.run(main())


def leaf_main(address: str, host: int, idx: int, events: Any, stop: Any) -> None:
    """A rollout worker of one host: runs rollouts while its relay switches its policy."""
    torch.set_num_threads(1)

    async def main() -> None:
        policy = make_policy()
        scheme = aiowsync.SharedMemWeightSyncScheme(address=address)
        scheme.init_on_receiver(model=policy, worker_idx=idx)
        async with scheme:
            await scheme.connect(timeout=120)
            rollouts = 0
            while not stop.is_set():
                async with scheme.read_guard():  # no switch in the middle of a rollout
                    with torch.no_grad():
                        policy(torch.randn(32, 16))
                rollouts += 1
                await asyncio.sleep(0.002)
            events.put(("done", host, idx, scheme.version, sha256(policy), rollouts))

    asyncio.run(main())


async def main() -> int:
    ctx = mp.get_context("spawn")
    events, stop = ctx.Queue(), ctx.Event()
    policy = make_policy()
    trainer = aiowsync.DistributedWeightSyncScheme(backend="gloo")
    trainer.init_on_sender(model=policy, num_workers=RELAYS)
    procs = []

    def start(target: Any, *args: Any) -> None:
        procs.append(ctx.Process(target=target, args=(*args, events, stop), daemon=True))
        procs[-1].start()

    try:
        async with trainer:
            for host in range(RELAYS):
                start(relay_main, trainer, host)
            for _ in range(RELAYS):
                _, host, address = await asyncio.to_thread(events.get, True, 120)
                for idx in range(LEAVES):
                    start(leaf_main, address, host, idx)
            await trainer.connect(timeout=120)
            print(f"trainer: {RELAYS} relays connected, {RELAYS * LEAVES} workers behind them")
            for _ in range(UPDATES):
                with torch.no_grad():
                    for p in policy.parameters():
                        p.add_(torch.randn_like(p) * 0.01)  # a stand-in for a training step
                result = await trainer.send(timeout=60)
                print(f"trainer: version {result.version} runs on every worker of every host")
            stop.set()
            reports = [
                await asyncio.to_thread(events.get, True, 60) for _ in range(RELAYS * LEAVES)
            ]
    finally:
        stop.set()
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    expected = sha256(policy)
    for _, host, idx, version, digest, rollouts in sorted(reports):
        same = "the trainer's exact weights" if digest == expected else "OTHER WEIGHTS"
        print(f"host {host} worker {idx}: version {version}, {same}, {rollouts} rollouts")
    ok = all(r[3] == UPDATES and r[4] == expected for r in reports)
    if ok:
        print(f"OK: every worker of every host runs version {UPDATES} with the trainer's weights")
    return 0 if ok else 1


if __name__ == "__main__":
    # No options: --help says what the example does, and anything else is refused.
    argparse.ArgumentParser(description=__doc__).parse_args()
    sys.exit(asyncio.run(main()))
