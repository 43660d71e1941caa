"""Several models in one scheme, sends of some of them, a wire dtype, and models of many small
tensors: shared memory, 4 worker processes, each measured against a baseline of the same run.

Every worker is a spawned process whose event loop stays busy while versions arrive: a task
wakes every 2 ms, and another reads, under the read guard, one element of eight tensors
spread over the model (``--reader light``, the default) or of every tensor (``--reader all``)
every 5 ms. Sends and their baselines alternate sample by sample. Parts (``--parts``, all
by default):

* ``partial``: a 4 MiB model (``small``) beside a 256 MiB one (``big``) in one scheme. Full
  sends (``send()``), sends of the small model alone (``send(weights={"small": ...})``) and,
  as the floor, sends of a scheme holding only a 4 MiB model, to as many workers, take turns
  (the order rotating round by round); medians are compared. Afterwards every worker must
  hold the big model's bytes of the last full send, at the latest version.
* ``wire``: a 256 MiB fp32 model sent as fp32 (one scheme) and with ``wire_dtype=bfloat16``
  (another scheme, 2 workers holding bf16 models in swap mode, 2 holding fp32 models copying
  with a cast), against raw ``copy_`` of the same bytes (256 MiB for fp32, 128 MiB for the
  bf16 bytes) and a raw cast (one fp32 tensor of 256 MiB ``copy_``-ed into a bf16 one).
  Bytes staged (``SendResult.nbytes``) are compared, and every worker's values must equal the
  sender's cast to bf16 exactly.
* ``many``: a 500-layer MLP (1000 tensors; the 500 biases are 732 bytes each; 64 MiB in all)
  against raw ``copy_`` of its bytes; ``--runs`` sessions (default 2). (A model of 1000
  tensors of varied sizes is a cell of ``aiowsync bench``: ``--models 1000t-64MiB``.)

Usage::

    .venv/bin/python benchmarks/bench_models.py                  # every part, ~1.5 min here
    .venv/bin/python benchmarks/bench_models.py --parts partial --samples 12
    .venv/bin/python benchmarks/bench_models.py --parts partial --transport dist
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import hashlib
import json
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import aiowsync

MIB = 1 << 20
SPAWN = mp.get_context("spawn")
BEATS = aiowsync.Heartbeats(interval=0.5, missed=10)  # a busy 2-core host: slow beats are normal


# -- models (the same structure in every process; values come through the scheme) ------------


def _big(total: int, pieces: int) -> nn.Module:
    return nn.ParameterList(nn.Parameter(torch.zeros(total // 4 // pieces)) for _ in range(pieces))


def mlp(depth: int = 500, width: int = 183) -> nn.Module:
    """``depth`` Linear layers of ``width`` (weights of 131 KiB, biases of 732 bytes)."""
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))


def build(name: str, dtype: str = "float32") -> dict[str, nn.Module]:
    """The models of part ``name``, by model id."""
    if name == "partial":
        models = {"small": _big(4 * MIB, 8), "big": _big(256 * MIB, 4)}
    elif name == "small":
        models = {"model": _big(4 * MIB, 8)}
    elif name == "wire":
        models = {"model": _big(256 * MIB, 8)}
    elif name == "mlp":
        models = {"model": mlp()}
    else:
        raise ValueError(name)
    return {k: m.to(getattr(torch, dtype)) for k, m in models.items()}


def random_init(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.uniform_(-1.0, 1.0)
    else:
        t.random_(0, 1 << 20)


def make_scheme(transport: str, **options: Any) -> aiowsync.WeightSyncScheme:
    if transport == "dist":
        return aiowsync.DistributedWeightSyncScheme(backend="gloo", heartbeats=BEATS, **options)
    return aiowsync.SharedMemWeightSyncScheme(heartbeats=BEATS, **options)


def fill(m: nn.Module, value: float) -> None:
    with torch.no_grad():
        for t in m.parameters():
            t.fill_(value)


def digest(m: nn.Module, cast: list[torch.dtype] | None = None) -> str:
    """A hash of the module's bytes, after casting each tensor through ``cast`` if given."""
    h = hashlib.sha256()
    for key, t in sorted(m.state_dict().items()):
        for dtype in cast or []:
            t = t.to(dtype)
        h.update(key.encode())
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


# -- a worker -----------------------------------------------------------------------------------


def worker_main(scheme: Any, idx: int, name: str, dtype: str, conn: Any, reader: str) -> None:
    torch.set_num_threads(1)
    asyncio.run(_worker(scheme, idx, name, dtype, conn, reader))


async def _worker(scheme: Any, idx: int, name: str, dtype: str, conn: Any, reader: str) -> None:
    models = build(name, dtype)
    if len(models) > 1:
        scheme.init_on_receiver(models=models, worker_idx=idx)
    else:
        scheme.init_on_receiver(model=models["model"], worker_idx=idx)
    # The modules' own tensors, which a switch re-points (not state_dict()'s detached ones).
    tensors = [t for m in models.values() for t in (*m.parameters(), *m.buffers())]
    if reader == "light":  # eight tensors spread over the model(s)
        tensors = tensors[:: max(1, len(tensors) // 8)][:8]

    async def tick() -> None:
        while True:
            await asyncio.sleep(0.002)

    async def read() -> None:
        while True:
            async with scheme.read_guard():
                sum(float(t.view(-1)[0]) for t in tensors)
            await asyncio.sleep(0.005)

    async with scheme:
        await scheme.connect(timeout=300)
        busy = [asyncio.create_task(tick()), asyncio.create_task(read())]
        # What apply_mode="auto" picks on a CPU model: swap when it holds the wire dtype.
        wire = scheme.wire_dtype or torch.float32
        conn.send(("ready", idx, "swap" if wire == getattr(torch, dtype) else "copy"))
        while True:
            command = await asyncio.to_thread(conn.recv)
            if command == "stop":
                break
            conn.send((scheme.version, {k: digest(m) for k, m in models.items()}))
        for task in busy:
            task.cancel()


class Pool:
    """``n`` worker processes of one scheme, each building part ``name``'s models."""

    reader = "light"
    """What the workers' readers read (``--reader``)."""

    def __init__(self, scheme: Any, n: int, name: str, dtypes: list[str]) -> None:
        self.conns, self.procs = [], []
        for i in range(n):
            ours, theirs = SPAWN.Pipe()
            proc = SPAWN.Process(
                target=worker_main,
                args=(scheme, i, name, dtypes[i], theirs, self.reader),
                daemon=True,
            )
            proc.start()
            self.conns.append(ours)
            self.procs.append(proc)

    async def ready(self) -> list[str]:
        return [(await asyncio.to_thread(_recv, c, 300))[2] for c in self.conns]

    async def digests(self) -> list[tuple[int, dict[str, str]]]:
        for c in self.conns:
            c.send("digest")
        return [await asyncio.to_thread(_recv, c, 120) for c in self.conns]

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send("stop")
            except OSError:
                pass
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)


def _recv(conn: Any, timeout: float) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError("a worker did not answer")
    return conn.recv()


class RawCopy:
    """``dst.copy_(src)`` of ``nbytes`` as one flat tensor (pages touched up front)."""

    def __init__(self, nbytes: int) -> None:
        self.src = torch.ones(nbytes, dtype=torch.uint8)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)

    def __call__(self) -> float:
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        return time.perf_counter() - t0


async def timed(send: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    await send()
    return time.perf_counter() - t0


def med_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


# -- the parts ----------------------------------------------------------------------------------


async def part_partial(args: argparse.Namespace) -> dict[str, Any]:
    models = build("partial")
    for m in models.values():
        with torch.no_grad():
            for t in m.parameters():
                random_init(t)
    scheme = make_scheme(args.transport)
    scheme.init_on_sender(models=models, num_workers=args.workers)
    # The floor: the small model alone, in a scheme of its own, to as many workers.
    alone = make_scheme(args.transport)
    alone.init_on_sender(model=models["small"], num_workers=args.workers)
    full, some, some_stage, floor, floor_stage = [], [], [], [], []
    async with scheme, alone:
        pool = Pool(scheme, args.workers, "partial", ["float32"] * args.workers)
        lone = Pool(alone, args.workers, "small", ["float32"] * args.workers)
        try:
            await asyncio.gather(scheme.connect(timeout=300), alone.connect(timeout=300))
            await pool.ready()
            await lone.ready()
            await alone.send(timeout=60)
            await scheme.send(timeout=60)  # first-send costs (pages) are no sample
            await scheme.send(weights={"small": models["small"]}, timeout=60)
            last_full = 0.0

            async def send_all() -> None:
                nonlocal last_full
                last_full += 1.0
                for m in models.values():
                    fill(m, last_full)
                full.append((await scheme.send(timeout=60)).seconds)
                fill(models["big"], -1.0)  # changed on the trainer, never sent

            async def send_small() -> None:
                fill(models["small"], -last_full)
                r = await scheme.send(weights={"small": models["small"]}, timeout=60)
                some.append(r.seconds)
                some_stage.append(r.stage_seconds)

            async def send_alone() -> None:
                r = await alone.send(timeout=60)
                floor.append(r.seconds)
                floor_stage.append(r.stage_seconds)

            contenders = [send_all, send_small, send_alone]
            for k in range(args.samples):  # the order rotates round by round
                for send in contenders[k % 3 :] + contenders[: k % 3]:
                    await send()
            seen = await pool.digests()
        finally:
            pool.close()
            lone.close()
    version = scheme.version
    big = _big(256 * MIB, 4)
    fill(big, last_full)  # what the last full send carried
    exact = all(v == version and d["big"] == digest(big) for v, d in seen)
    small = digest(models["small"])
    return {
        "full_send_ms": med_ms(full),
        "small_only_ms": med_ms(some),
        "ratio": med_ms(some) / med_ms(full),
        "small_only_staging_ms": med_ms(some_stage),
        "small_model_alone_in_its_own_scheme_ms": med_ms(floor),
        "small_model_alone_staging_ms": med_ms(floor_stage),
        "samples": len(full),
        "big_model_exact_on_every_worker": exact,
        "small_model_exact": all(d["small"] == small for _, d in seen),
        "version": version,
    }


async def part_wire(args: argparse.Namespace) -> dict[str, Any]:
    model = build("wire")["model"]
    with torch.no_grad():
        for t in model.parameters():
            random_init(t)
    n = args.workers
    plain = aiowsync.SharedMemWeightSyncScheme(heartbeats=BEATS)
    plain.init_on_sender(model=model, num_workers=n)
    cast = aiowsync.SharedMemWeightSyncScheme(heartbeats=BEATS, wire_dtype=torch.bfloat16)
    cast.init_on_sender(model=model, num_workers=n)
    nbytes = sum(t.nbytes for t in model.parameters())
    raw_full, raw_half = RawCopy(nbytes), RawCopy(nbytes // 2)
    times: dict[str, list[float]] = {
        "fp32": [],
        "bf16": [],
        "bf16 staging": [],
        "raw 256": [],
        "raw 128": [],
        "raw cast": [],
    }
    cast_src = torch.ones(nbytes // 4)
    cast_dst = torch.zeros(nbytes // 4, dtype=torch.bfloat16)

    def raw_cast() -> float:
        t0 = time.perf_counter()
        cast_dst.copy_(cast_src)
        return time.perf_counter() - t0

    staged: dict[str, int] = {}
    dtypes = ["bfloat16"] * (n // 2) + ["float32"] * (n - n // 2)
    async with plain, cast:
        pools = [Pool(plain, n, "wire", ["float32"] * n), Pool(cast, n, "wire", dtypes)]
        try:
            await asyncio.gather(plain.connect(timeout=300), cast.connect(timeout=300))
            await pools[0].ready()
            modes = await pools[1].ready()
            for scheme in (plain, cast):
                await scheme.send(timeout=60)
            for _ in range(args.samples):
                with torch.no_grad():
                    for t in model.parameters():
                        t.mul_(-1.0)
                r = await plain.send(timeout=60)
                times["fp32"].append(r.seconds)
                staged["fp32"] = r.nbytes
                times["raw 256"].append(raw_full())
                r = await cast.send(timeout=60)
                times["bf16"].append(r.seconds)
                times["bf16 staging"].append(r.stage_seconds)
                staged["bf16"] = r.nbytes
                times["raw 128"].append(raw_half())
                times["raw cast"].append(raw_cast())
            seen = await pools[1].digests()
        finally:
            for pool in pools:
                pool.close()
    want_bf16 = digest(model, [torch.bfloat16])
    want_fp32 = digest(model, [torch.bfloat16, torch.float32])
    exact = [
        d["model"] == (want_bf16 if dt == "bfloat16" else want_fp32)
        for (_, d), dt in zip(seen, dtypes, strict=True)
    ]
    return {
        "median_ms": {k: med_ms(v) for k, v in times.items()},
        "bf16_send_vs_fp32_send": med_ms(times["bf16"]) / med_ms(times["fp32"]),
        "bf16_send_vs_raw_copy_of_its_bytes": med_ms(times["bf16"]) / med_ms(times["raw 128"]),
        "bytes_staged": staged,
        "bytes_ratio": staged["bf16"] / staged["fp32"],
        "workers": [f"{dt} ({mode})" for dt, mode in zip(dtypes, modes, strict=True)],
        "exact_cast_values": exact,
    }


async def part_many(args: argparse.Namespace, name: str) -> dict[str, Any]:
    model = build(name)["model"]
    with torch.no_grad():
        for t in model.state_dict().values():
            random_init(t)
    nbytes = sum(t.nbytes for t in model.state_dict().values())
    raw = RawCopy(nbytes)
    runs = []
    for _ in range(args.runs):
        scheme = aiowsync.SharedMemWeightSyncScheme(heartbeats=BEATS)
        scheme.init_on_sender(model=model, num_workers=args.workers)
        sends, raws, stages = [], [], []
        async with scheme:
            pool = Pool(scheme, args.workers, name, ["float32"] * args.workers)
            try:
                await scheme.connect(timeout=300)
                await pool.ready()
                for _ in range(3):  # first-send costs (pages, plans) are no sample
                    await scheme.send(timeout=60)
                    raw()
                for _ in range(args.samples):
                    with torch.no_grad():
                        for t in model.parameters():
                            t.add_(1.0)
                    r = await scheme.send(timeout=60)
                    sends.append(r.seconds)
                    stages.append(r.stage_seconds)
                    raws.append(raw())
                seen = await pool.digests()
            finally:
                pool.close()
        exact = all(d["model"] == digest(model) for _, d in seen)
        runs.append(
            {
                "send_ms": med_ms(sends),
                "staging_ms": med_ms(stages),
                "raw_copy_ms": med_ms(raws),
                "ratio": med_ms(sends) / med_ms(raws),
                "exact": exact,
            }
        )
    return {"tensors": len(model.state_dict()), "bytes": nbytes, "runs": runs}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {
        "workers": args.workers,
        "samples": args.samples,
        "transport": args.transport,
        "reader": args.reader,
    }
    parts = args.parts.split(",")
    if "partial" in parts:
        out["partial"] = await part_partial(args)
        print("partial:", json.dumps(out["partial"]), flush=True)
    if "wire" in parts:
        out["wire"] = await part_wire(args)
        print("wire:", json.dumps(out["wire"]), flush=True)
    if "many" in parts:
        out["mlp"] = await part_many(args, "mlp")
        print("mlp:", json.dumps(out["mlp"]), flush=True)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--parts", default="partial,wire,many", help="which parts to run")
    parser.add_argument("--workers", type=int, default=4, help="worker processes")
    parser.add_argument(
        "--transport",
        choices=["shm", "dist"],
        default="shm",
        help="the partial part's transport (the others use shared memory)",
    )
    parser.add_argument("--samples", type=int, default=8, help="samples per contender")
    parser.add_argument("--runs", type=int, default=2, help="sessions of the 'many' part")
    parser.add_argument(
        "--reader",
        choices=["light", "all"],
        default="light",
        help="what each worker's reader reads under the guard every 5 ms: one element of "
        "eight tensors, or of every tensor",
    )
    parser.add_argument("--out", default=None, help="write the results to this JSON file")
    args = parser.parse_args()
    Pool.reader = args.reader
    result = asyncio.run(main(args))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    sys.exit(0)
