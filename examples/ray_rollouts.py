"""A trainer and rollout workers as Ray async actors, their weights kept in sync by aiowsync.

Ray places the processes and carries a few method calls; the weights, the versions and the
acks travel through aiowsync alone (shared memory or torch.distributed, with ZeroMQ for
control). The pattern:

1. The trainer actor builds the sender and enters ``async with scheme`` in a task of its own
   (an async actor runs every method on one event loop, and the scheme must be left by the
   task that entered it), which binds its address.
2. The driver asks the trainer for its scheme: Ray pickles it, and the pickle is a receiver's
   copy that knows the address. Each rollout actor gets it as a constructor argument and calls
   ``init_on_receiver`` on it.
3. Rollout actors connect in the background and run rollouts on their loop; the scheme's
   receiver task switches their policy between two awaits.
4. Each ``await scheme.send()`` on the trainer returns once every actor runs the new version.

The driver sends ``--sends`` versions on each transport, checks after each one that every
actor holds the trainer's exact bytes (a SHA-256 of the weights, taken under a lease), and
shuts everything down: the actors leave their schemes, are killed, and Ray stops. It prints a
JSON report.

Run it with the ``ray`` extra installed (``pip install 'aiowsync[ray]'``)::

    python examples/ray_rollouts.py
"""

from __future__ import annotations

import os

# Must happen before torch is imported (aiowsync imports it); Ray's workers inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Ray starts its workers at nice 15, as background work. Here they are the job: at that
# priority, beside any busy process, they start and answer many times slower.
os.environ.setdefault("RAY_worker_niceness", "0")

import argparse
import asyncio
import hashlib
import json
import time
from typing import Any

import ray
import torch
from torch import nn

import aiowsync

OBS_DIM, HIDDEN, ACT_DIM = 16, 64, 4
CONNECT_S = 120.0
"""How long the handshakes may take, once every actor is up."""
STARTUP_S = 300.0
"""How long the actors may take to start (a process each, importing torch): a bound of its
own, so that a busy host's slow start-up is not taken out of the handshakes' time."""


def make_policy(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(OBS_DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, ACT_DIM))


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor in key order: equal digests, equal bytes."""
    h = hashlib.sha256()
    for key in sorted(tensors):
        h.update(key.encode())
        h.update(tensors[key].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def make_scheme(transport: str) -> aiowsync.WeightSyncScheme:
    if transport == "shm":
        return aiowsync.SharedMemWeightSyncScheme()
    return aiowsync.DistributedWeightSyncScheme(backend="gloo")


class Hosted:
    """``async with scheme`` held open by a task of its own until :meth:`close`."""

    def __init__(self, scheme: aiowsync.WeightSyncScheme) -> None:
        self.scheme = scheme
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        entered = asyncio.Event()

        async def hold() -> None:
            async with self.scheme:
                entered.set()
                await self._stop.wait()

        self._task = asyncio.create_task(hold())
        waiter = asyncio.create_task(entered.wait())
        await asyncio.wait([waiter, self._task], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if self._task.done():
            self._task.result()  # entering failed: raise its error

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task


@ray.remote(num_cpus=0.5)
class Trainer:
    """Owns the policy and the sender."""

    def __init__(self, transport: str, num_workers: int) -> None:
        torch.set_num_threads(1)
        self.policy = make_policy(0)
        self.optimizer = torch.optim.SGD(self.policy.parameters(), lr=0.05)
        self.scheme = make_scheme(transport)
        self.scheme.init_on_sender(model=self.policy, num_workers=num_workers)
        self.host = Hosted(self.scheme)

    async def start(self) -> aiowsync.WeightSyncScheme:
        """Enter the scheme; its pickle is what rollout actors are built with."""
        await self.host.start()
        return self.scheme

    async def connect(self) -> None:
        await self.scheme.connect(timeout=CONNECT_S)

    async def train_and_send(self) -> tuple[int, str]:
        """One training step, then a send; the version and the digest of what was sent."""
        obs, target = torch.randn(64, OBS_DIM), torch.randn(64, ACT_DIM)
        loss = nn.functional.mse_loss(self.policy(obs), target)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        result = await self.scheme.send()
        return result.version, digest(dict(self.policy.state_dict()))

    async def close(self) -> None:
        await self.host.close()

    def ping(self) -> None:
        pass


@ray.remote(num_cpus=0.5)
class Rollout:
    """Runs rollouts with the latest policy; its weights arrive through ``scheme``."""

    def __init__(self, scheme: aiowsync.WeightSyncScheme, worker_idx: int) -> None:
        torch.set_num_threads(1)
        self.policy = make_policy(100 + worker_idx)  # any values: version 0 replaces them
        self.scheme = scheme
        self.scheme.init_on_receiver(model=self.policy, worker_idx=worker_idx)
        self.host = Hosted(scheme)
        self.steps = 0
        self._rollouts: asyncio.Task[None] | None = None

    async def connect(self) -> int:
        await self.host.start()
        await self.scheme.connect(timeout=CONNECT_S)
        self._rollouts = asyncio.create_task(self._run())
        return self.scheme.version

    async def _run(self) -> None:
        """Busy like a real rollout worker: short episodes, an await between steps."""
        while True:
            with torch.no_grad():
                obs = torch.randn(8, OBS_DIM)
                for _ in range(8):
                    obs = obs.roll(1, 1) + 0.1 * self.policy(obs).sum(1, keepdim=True)
            self.steps += 1
            await asyncio.sleep(0.002)

    async def holding(self) -> tuple[int, str, int]:
        """The version the policy runs, the digest of its bytes and the rollouts run."""
        async with self.scheme.lease() as held:
            return held.version, digest(held.params()), self.steps

    async def close(self) -> None:
        if self._rollouts is not None:
            self._rollouts.cancel()
        await self.host.close()

    def ping(self) -> None:
        pass


def is_dead(handle: Any, within: float = 30.0) -> bool:
    """Whether the actor behind ``handle`` is gone within ``within`` seconds of its kill
    (``ray.kill`` returns before the actor has stopped)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            ray.get(handle.ping.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.2)
    return False


def run(transport: str, sends: int, workers: int) -> dict[str, Any]:
    trainer = Trainer.remote(transport, workers)  # type: ignore[attr-defined]
    actors: list[Any] = []
    try:
        scheme = ray.get(trainer.start.remote())
        actors = [Rollout.remote(scheme, i) for i in range(workers)]  # type: ignore[attr-defined]
        ray.get([a.ping.remote() for a in actors], timeout=STARTUP_S)  # every actor is up
        ray.get([trainer.connect.remote(), *(a.connect.remote() for a in actors)])
        checked, t0 = 0, time.perf_counter()
        for _ in range(sends):
            version, sent = ray.get(trainer.train_and_send.remote())
            for held_version, held, _ in ray.get([a.holding.remote() for a in actors]):
                if (held_version, held) != (version, sent):
                    raise AssertionError(f"an actor holds {held_version}, not version {version}")
                checked += 1
        seconds = time.perf_counter() - t0
        steps = [s for _, _, s in ray.get([a.holding.remote() for a in actors])]
        ray.get([a.close.remote() for a in actors])
        ray.get(trainer.close.remote())
    finally:
        for handle in [*actors, trainer]:
            ray.kill(handle)
    dead = sum(is_dead(handle) for handle in [*actors, trainer])
    return {
        "transport": transport,
        "sends": sends,
        "actors_checked_exact": checked,
        "seconds": round(seconds, 2),
        "rollouts_per_actor": steps,
        "actors_dead_after_kill": dead,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sends", type=int, default=10, help="versions per transport (10)")
    parser.add_argument("--workers", type=int, default=2, help="rollout actors (2)")
    parser.add_argument(
        "--transports", default="shm,dist", help="shm and/or dist, comma-separated (both)"
    )
    opts = parser.parse_args()
    # Every process of this cluster sets the same OpenMP policy (see above).
    ray.init(
        include_dashboard=False,
        runtime_env={"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}},
        log_to_driver=False,
    )
    try:
        reports = [run(t, opts.sends, opts.workers) for t in opts.transports.split(",")]
    finally:
        ray.shutdown()
    print(json.dumps(reports))
    for r in reports:
        print(
            f"OK: {r['transport']}: {r['sends']} sends, every one of {opts.workers} actors held "
            "each version's exact bytes"
        )


if __name__ == "__main__":
    main()
