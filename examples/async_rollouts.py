"""An asyncio trainer broadcasting a policy to three rollout workers over shared memory.

The trainer owns a small MLP policy. Each round it runs a fake training step (one SGD step on a
random regression loss, in a worker thread so the event loop stays free) and then
``await scheme.send()``, which returns once every worker runs the new version. Three worker
processes, started with the ``spawn`` method and handed the pickled scheme, run rollouts
(forward passes on random observations) on their own event loop while a background task of the
scheme switches their policy to each new version between two of their awaits.

At the end every worker reports, over a ``multiprocessing`` queue, the version it runs, the
versions its switch hook saw and a SHA-256 digest of its weights; the trainer checks that each
worker is on the final version with weights bit-identical to its own.

Environment: ``OMP_WAIT_POLICY=PASSIVE`` is set (unless already set) before torch is imported,
and workers use one torch thread, so that several processes sharing a small machine do not
starve one another with spinning OpenMP threads.

Run it with::

    .venv/bin/python examples/async_rollouts.py
"""

from __future__ import annotations

import os

# Must happen before torch is imported (aiowsync imports it), in this process and, through the
# inherited environment, in the spawned workers.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import hashlib
import multiprocessing as mp
import queue
import sys
import time
from multiprocessing.context import SpawnContext, SpawnProcess
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import torch
from torch import nn

import aiowsync

NUM_WORKERS = 3
NUM_UPDATES = 8
OBS_DIM, HIDDEN, ACT_DIM = 16, 64, 4


def make_policy() -> nn.Module:
    return nn.Sequential(
        nn.Linear(OBS_DIM, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, ACT_DIM),
    )


def weights_digest(model: nn.Module) -> str:
    """SHA-256 over every parameter and buffer, in key order: equal digests, equal bytes."""
    h = hashlib.sha256()
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    for key in sorted(tensors):
        h.update(key.encode())
        h.update(tensors[key].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# -- worker process -----------------------------------------------------------------------------


def worker_main(
    scheme: aiowsync.SharedMemWeightSyncScheme,
    worker_idx: int,
    stop: Event,
    results: Queue[dict[str, Any]],
) -> None:
    torch.set_num_threads(1)
    try:
        report = asyncio.run(run_worker(scheme, worker_idx, stop))
    except BaseException as exc:
        results.put({"worker": worker_idx, "error": f"{type(exc).__name__}: {exc}"})
        raise
    results.put(report)


async def run_worker(
    scheme: aiowsync.SharedMemWeightSyncScheme, worker_idx: int, stop: Event
) -> dict[str, Any]:
    # Any initial values do: version 0 replaces them at connect. Only the layout must match.
    policy = make_policy()
    scheme.init_on_receiver(model=policy, worker_idx=worker_idx)

    seen: list[int] = []
    # Runs on this loop right after each switch, before the worker acknowledges the version:
    # the place to reset caches that depend on the weights.
    scheme.register_hook(seen.append)

    rollouts: dict[int, int] = {}
    async with scheme:
        await scheme.connect(timeout=60)
        while not stop.is_set():
            # Forward passes run on this loop, so a switch cannot happen in the middle of one:
            # switches are made by the scheme's background task, between two awaits. (A forward
            # running in a thread would hold `with scheme.read_guard():` instead.)
            version = scheme.version
            with torch.no_grad():
                obs = torch.randn(32, OBS_DIM)
                for _ in range(16):  # one short episode
                    actions = policy(obs).tanh()
                    obs = obs.roll(1, dims=1) + 0.1 * actions.sum(dim=1, keepdim=True)
            rollouts[version] = rollouts.get(version, 0) + 1
            await anyio.sleep(0.002)  # yield: lets the background task apply new weights
        return {
            "worker": worker_idx,
            "version": scheme.version,
            "seen": seen,
            "rollouts": rollouts,
            "digest": weights_digest(policy),
        }


# -- trainer ------------------------------------------------------------------------------------


def train_step(policy: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """A stand-in for real training: one SGD step towards a random target."""
    obs = torch.randn(256, OBS_DIM)
    target = torch.randn(256, ACT_DIM)
    loss = nn.functional.mse_loss(policy(obs), target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


async def run_trainer(
    ctx: SpawnContext,
    processes: list[SpawnProcess],
    stop: Event,
    results: Queue[dict[str, Any]],
) -> None:
    torch.manual_seed(0)
    policy = make_policy()
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)

    scheme = aiowsync.SharedMemWeightSyncScheme()
    # rehome=True: the policy's tensors become views of one flat buffer, so each snapshot is a
    # single memcpy; the tensor objects are kept, so the optimizer above keeps working.
    scheme.init_on_sender(model=policy, num_workers=NUM_WORKERS, rehome=True)
    async with scheme:
        # The scheme pickles to its configuration and its bound address only.
        for i in range(NUM_WORKERS):
            p = ctx.Process(target=worker_main, args=(scheme, i, stop, results), name=f"w{i}")
            p.start()
            processes.append(p)

        started = time.perf_counter()
        await scheme.connect(timeout=30)
        print(f"{NUM_WORKERS} workers hold version 0 ({time.perf_counter() - started:.1f} s)")

        for _ in range(NUM_UPDATES):
            loss = await anyio.to_thread.run_sync(train_step, policy, optimizer)
            result = await scheme.send(timeout=10)
            print(
                f"version {result.version}: loss {loss:.3f}, {result.nbytes} bytes to "
                f"workers {list(result.worker_ids)} in {result.seconds * 1e3:.1f} ms"
            )
            await anyio.sleep(0.05)  # let the workers roll out a little on this version

        final_version, final_digest = scheme.version, weights_digest(policy)
        stop.set()
        reports = [
            await anyio.to_thread.run_sync(results.get, True, 30) for _ in range(NUM_WORKERS)
        ]
        for p in processes:
            await anyio.to_thread.run_sync(p.join, 30)

    failures: list[str] = []
    for report in sorted(reports, key=lambda r: r["worker"]):
        w = report["worker"]
        if "error" in report:
            failures.append(f"worker {w} failed: {report['error']}")
            continue
        counts = ", ".join(f"v{v}: {n}" for v, n in sorted(report["rollouts"].items()))
        print(f"worker {w}: runs version {report['version']}; rollouts per version: {counts}")
        if report["version"] != final_version:
            failures.append(f"worker {w} runs version {report['version']}, not {final_version}")
        if report["seen"] != list(range(final_version + 1)):
            failures.append(f"worker {w} switched through {report['seen']}")
        if report["digest"] != final_digest:
            failures.append(f"worker {w}'s weights differ from the trainer's")
    for p in processes:
        if p.exitcode != 0:
            failures.append(f"process {p.name} exited with code {p.exitcode}")
    if failures:
        raise SystemExit("FAILED:\n  " + "\n  ".join(failures))
    print(f"OK: every worker runs version {final_version} with the trainer's exact weights")


def main() -> None:
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    results: Queue[dict[str, Any]] = ctx.Queue()
    processes: list[SpawnProcess] = []
    try:
        asyncio.run(run_trainer(ctx, processes, stop, results))
    finally:
        stop.set()  # also when the trainer failed: workers leave their rollout loop
        for p in processes:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        leftover = sorted(f.name for f in Path("/dev/shm").glob(f"aiowsync-{os.getpid()}-*"))
        if leftover:
            print(f"shared-memory files left behind: {leftover}", file=sys.stderr)


if __name__ == "__main__":
    # No options: --help says what the example does, and anything else is refused.
    argparse.ArgumentParser(description=__doc__).parse_args()
    try:
        main()
    except queue.Empty:
        raise SystemExit("FAILED: a worker did not report in time") from None
