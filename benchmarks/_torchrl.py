"""TorchRL's weight-sync schemes, driven through their public API only, for ``aiowsync bench``.

Needs a venv of its own with torchrl, torch kept at the project's pin (another torch would be a
multi-GB CUDA build): ``python3 -m venv .venv-torchrl && .venv-torchrl/bin/pip install
torch==2.13.0 torchrl==0.14.1`` (torchrl 0.14.1 pins tensordict 0.14.x, which aiowsync accepts).
Nothing here imports aiowsync. Usage::

    .venv-torchrl/bin/python benchmarks/_torchrl.py --model 64mib,many --workers 4 --samples 10

One *case* is one TorchRL scheme (``shared``: ``SharedMemWeightSyncScheme``, ``mp``:
``MultiProcessWeightSyncScheme``, ``distributed``: ``DistributedWeightSyncScheme`` on gloo,
no Ray), one send mode, one model and N worker processes. It runs in a sender process of its own
(spawned, leader of a new process group) that spawns the N workers: TorchRL's ``send()`` waits
for worker acks without any timeout, and the distributed scheme initialises the *default*
process group, so neither may touch the calling process. The caller waits for the result with a
deadline and kills the group when it is missed; in the sender, each TorchRL call runs under a
``faulthandler`` watchdog that dumps the stuck stack and exits.

The sender binds the model like a collector does (``bind="context"``): an object with the model
as ``.policy`` and one device per worker as ``.policy_device``, given as ``context=`` with
``model_id="policy"``. ``bind="model"`` passes ``model=`` instead; then ``send()`` carries no
data for ``mp`` (TorchRL's ``prepare_weights`` returns None without a context) and fails for
``distributed``.

Per case, the sender:

1. fills every tensor of its model with 0 and connects; each worker (model filled with -1)
   reports what it holds after ``connect()`` (``initial``);
2. *alias probe*: fills its model with 1 and sends nothing; a worker that now reads 1 shares
   the sender's memory (on CPU, ``shared`` and ``mp`` do: pickling a tensor moves its storage
   into shared memory in place, and ``connect()`` rebinds the worker's parameters to it);
3. *latency*: ``samples`` times, fills every tensor with the send index k (the model for
   ``send()``, a separate TensorDict of the same structure for ``send(weights)``), then times
   ``scheme.send()`` / ``scheme.send(weights)`` from call to return; workers idle. One untimed
   send comes first (``first_send_s``): ``mp`` moves explicit weights into shared memory then,
   gloo connects its pairs. Explicit weights must be a TensorDict: a flat ``state_dict`` fails
   in ``shared`` (TypeError in ``prepare_weights``) and in ``distributed`` (no ``.send``);
4. *tearing*: every worker's main thread reads its model in a loop (one pass over all tensors,
   like a forward pass: first and last element of each, or every element with ``probe="full"``)
   while TorchRL's background receiver thread applies updates; the sender does ``tear_sends``
   more fill+send rounds. A read that sees two values is *mixed*; each read is attributed to the
   sender's phase (``fill`` > ``send`` > ``idle``) seen at its start or end.

What TorchRL 0.14.1's ``send()`` waits for (sync=True, the default): ``shared`` copies the new
weights into the shared buffer (with a context or explicit weights; nothing without), puts
``"receive"`` in each worker's instruction queue, then blocks on each worker's ack queue in turn:
the worker's thread re-applies the shared buffer to its model and acks. ``mp`` puts the weights
(every tensor passed as a shared-memory file descriptor) and ``"receive"`` in each worker's
queues and blocks on the acks: the worker copies them into its model, then acks. With the model
aliased, copies from the buffer onto itself are skipped by ``copy_`` and cost nothing.
``distributed`` sets a TCPStore key and does a blocking gloo ``send`` of every tensor, worker
after worker (the worker's thread, blocked on that key, ``recv``s straight into its model's
tensors), then blocks on each worker's ack key. No ack wait has a timeout of its own (the
distributed store's aside): a dead worker hangs ``send()`` for good.
"""

from __future__ import annotations

import os

# Must happen before torch is imported (here and in spawned children): no spinning OpenMP threads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import contextlib
import dataclasses
import faulthandler
import json
import multiprocessing as mp
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any, TextIO

MIB = 1 << 20
SIZES = {"1mib": 1, "64mib": 64, "256mib": 256, "1gib": 1024}
MODELS = (*SIZES, "many")
SCHEMES = {
    "shared": "SharedMemWeightSyncScheme",
    "mp": "MultiProcessWeightSyncScheme",
    "distributed": "DistributedWeightSyncScheme",
}
MODES = ("send()", "send(weights)")
PHASES = ("idle", "send", "fill")  # codes 0, 1, 2: a read seeing two phases counts in the higher


@dataclasses.dataclass(frozen=True)
class Case:
    scheme: str
    mode: str
    model: str
    workers: int
    samples: int = 10
    tear_sends: int = 10
    bind: str = "context"
    probe: str = "edges"
    call_timeout: float = 120.0


def _helpers() -> Any:
    """``benchmarks/_workers.py`` (it imports torch, hence not at the top of this module)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    import _workers

    return _workers


def model_spec(name: str) -> list[Any]:
    """``_workers`` specs: four float32 matrices, or (``many``) 1000 tensors of exactly 64 MiB with
    int64 buffers, ten of whose scalars become bool here (so 64 MiB less 70 bytes)."""
    w = _helpers()
    if name in SIZES:
        return w.few_large_spec(SIZES[name] * MIB)
    if name != "many":
        raise ValueError(f"unknown model {name!r}; choose among {MODELS}")
    spec, n_bool = [], 0
    for key, shape, dtype, is_buffer in w.many_tensors_spec(64 * MIB):
        if dtype == "int64" and shape == () and n_bool < 10:
            dtype, n_bool = "bool", n_bool + 1
        spec.append((key, shape, dtype, is_buffer))
    return spec


def _fill(tensors: list[Any], k: int) -> None:
    import torch

    with torch.no_grad():
        for t in tensors:
            t.fill_(bool(k & 1) if t.dtype == torch.bool else k)


class _Context:
    """The least a TorchRL scheme needs from a collector: the model and one device per worker."""

    def __init__(self, policy: Any, n_workers: int) -> None:
        import torch

        self.policy = policy
        self.policy_device = [torch.device("cpu")] * n_workers


# -- worker process -----------------------------------------------------------------------------


class _Reader:
    """One read = one pass over the model's tensors (numpy views, resolved after connect)."""

    def __init__(self, model: Any, full: bool) -> None:
        self.tensors = list(model.state_dict().values())
        self.arrays = [t.detach().reshape(-1).numpy() for t in self.tensors]
        self.is_bool = [a.dtype.kind == "b" for a in self.arrays]
        self.full = full

    def values(self) -> tuple[set[float], set[bool]]:
        nums: set[float] = set()
        bits: set[bool] = set()
        for a, is_bool in zip(self.arrays, self.is_bool, strict=True):
            lo, hi = (a.min(), a.max()) if self.full else (a[0], a[-1])
            (bits if is_bool else nums).update((lo.item(), hi.item()))
        return nums, bits

    def mixed(self) -> bool:
        nums, bits = self.values()
        if len(nums) > 1 or len(bits) > 1:
            return True
        return bool(nums and bits) and bits != {bool(int(next(iter(nums))) & 1)}

    def stale(self, model: Any) -> bool:
        now = [t.data_ptr() for t in model.state_dict().values()]
        return now != [t.data_ptr() for t in self.tensors]


def _worker_main(conn: Connection, idx: int, scheme: Any, case: Case, phase: Any) -> None:
    import torch

    torch.set_num_threads(1)
    model = _helpers().build_model(model_spec(case.model), lambda t: _fill([t], -1))
    holder = _Context(model, case.workers)
    if case.scheme == "distributed":  # ranks are 1-based there; the sender is rank 0
        scheme.init_on_receiver(model_id="policy", context=holder, worker_idx=idx + 1)
    else:
        scheme.init_on_receiver(model_id="policy", model=model, worker_idx=idx)
    t0 = time.perf_counter()
    scheme.connect()
    reader = _Reader(model, case.probe == "full")
    conn.send(("ready", time.perf_counter() - t0, sorted(reader.values()[0])))
    reads, mixed, reading, until = [0, 0, 0], [0, 0, 0], False, 0.0
    try:
        while True:
            if reading:
                p0 = phase.value
                bad = reader.mixed()
                p = max(p0, phase.value)
                reads[p] += 1
                mixed[p] += bad
                time.sleep(0)  # let TorchRL's receiver thread take the GIL between reads
                reading = time.monotonic() < until
                if not conn.poll():
                    continue
            elif not conn.poll(1.0):
                continue
            msg = conn.recv()
            if msg[0] == "read":
                reads, mixed, reading = [0, 0, 0], [0, 0, 0], True
                until = time.monotonic() + msg[1]
                conn.send(("ok",))
            elif msg[0] == "stop":
                reading = False
                conn.send(("reads", reads, mixed, reader.stale(model)))
            elif msg[0] == "peek":
                conn.send(("peek", sorted(reader.values()[0]), reader.mixed()))
            elif msg[0] == "exit":
                break
    except (EOFError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            scheme.shutdown()


# -- sender process -----------------------------------------------------------------------------


def _ask(conns: list[Connection], msg: tuple[Any, ...], timeout: float) -> list[tuple[Any, ...]]:
    for c in conns:
        c.send(msg)
    return [_recv(c, timeout) for c in conns]


def _recv(conn: Connection, timeout: float) -> tuple[Any, ...]:
    if not conn.poll(timeout):
        raise TimeoutError(f"no answer from a worker within {timeout} s")
    return conn.recv()  # type: ignore[no-any-return]


@contextlib.contextmanager
def _watchdog(fault: TextIO, what: str, seconds: float) -> Iterator[None]:
    """Dump every thread's stack to ``fault`` and exit if the block outlives ``seconds``."""
    fault.seek(0)
    fault.truncate()
    fault.write(f"deadline of {seconds} s missed in: {what}\n")
    fault.flush()
    faulthandler.dump_traceback_later(seconds, exit=True, file=fault)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _make_scheme(case: Case, model: Any, holder: _Context, ctx: Any) -> Any:
    import torch
    from torchrl.weight_update import (
        DistributedWeightSyncScheme,
        MultiProcessWeightSyncScheme,
        SharedMemWeightSyncScheme,
    )

    n = case.workers
    if case.scheme == "distributed":
        scheme = DistributedWeightSyncScheme(backend="gloo", timeout=case.call_timeout)
        if case.bind == "context":
            scheme.init_on_sender(model_id="policy", context=holder, num_workers=n)
        else:
            scheme.init_on_sender(model_id="policy", model=model, num_workers=n)
        return scheme
    cls = SharedMemWeightSyncScheme if case.scheme == "shared" else MultiProcessWeightSyncScheme
    scheme = cls()
    if case.bind == "context":
        scheme.init_on_sender(model_id="policy", context=holder, ctx=ctx)
    else:
        scheme.init_on_sender(model=model, devices=[torch.device("cpu")] * n, ctx=ctx)
    return scheme


def _loopback_env() -> None:
    """The distributed scheme's store binds to the host name's address and its default group
    uses MASTER_ADDR: both must stay on loopback (spawned workers inherit the environment)."""
    import ipaddress
    import socket

    addr = socket.gethostbyname(socket.gethostname())
    if not ipaddress.ip_address(addr).is_loopback:
        raise RuntimeError(f"host name resolves to {addr}, not loopback; TorchRL's store uses it")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")


def _sender_main(conn: Connection, case: Case, fault_path: str) -> None:
    os.setpgrp()  # the caller kills this group (us and our workers) if we miss its deadline
    with open(fault_path, "w") as fault:
        try:
            conn.send(("ok", _session(case, fault)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def _session(case: Case, fault: TextIO) -> dict[str, Any]:
    import torch
    from tensordict import TensorDict

    w = _helpers()
    spec = model_spec(case.model)
    model = w.build_model(spec, lambda t: _fill([t], 0))
    holder = _Context(model, case.workers)
    if case.scheme == "distributed":
        _loopback_env()
    ctx = mp.get_context("spawn")
    phase = ctx.RawValue("i", 0)
    out: dict[str, Any] = {
        **dataclasses.asdict(case),
        "scheme_class": SCHEMES[case.scheme],
        "model_bytes": w.spec_bytes(spec),
        "n_tensors": len(spec),
        "sender_threads": torch.get_num_threads(),
    }
    limit = case.call_timeout
    with _watchdog(fault, "init_on_sender", limit):
        scheme = _make_scheme(case, model, holder, ctx)
    conns: list[Connection] = []
    procs: list[Any] = []
    try:
        for i in range(case.workers):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(theirs, i, scheme, case, phase), daemon=True)
            p.start()
            theirs.close()
            conns.append(mine)
            procs.append(p)
        t0 = time.perf_counter()
        with _watchdog(fault, "connect", limit):
            scheme.connect()
            ready = [_recv(c, limit) for c in conns]
        out["connect_s"] = time.perf_counter() - t0
        out["worker_connect_s"] = [r[1] for r in ready]
        out["initial_values"] = [r[2] for r in ready]

        _fill(list(model.state_dict().values()), 1)
        time.sleep(0.05)
        peeks = _ask(conns, ("peek",), limit)
        out["aliases_sender_model"] = [p[1] == [1.0] for p in peeks]

        weights = None
        if case.mode == "send(weights)":
            weights = TensorDict.from_module(model).data.clone()
            targets = list(weights.values(True, True))
        else:
            targets = list(model.state_dict().values())

        def one_send(k: int, what: str) -> tuple[float, float]:
            phase.value = 2
            t0 = time.perf_counter()
            _fill(targets, k)
            t1 = time.perf_counter()
            phase.value = 1
            with _watchdog(fault, f"{what} send {k}", limit):
                if weights is None:
                    t2 = time.perf_counter()
                    scheme.send()
                else:
                    t2 = time.perf_counter()
                    scheme.send(weights)
                t3 = time.perf_counter()
            phase.value = 0
            return t1 - t0, t3 - t2

        out["first_send_s"] = one_send(2, "first")[1]  # one-time costs: not a sample
        k = 3
        fills, sends = [], []
        for _ in range(case.samples):
            f, s = one_send(k, "latency")
            fills.append(f)
            sends.append(s)
            k += 1
        out["fill_s"], out["send_s"] = fills, sends
        peeks = _ask(conns, ("peek",), limit)
        out["after_latency"] = [{"values": p[1], "mixed": p[2]} for p in peeks]
        out["latency_ok"] = all(p[1] == [float(k - 1)] for p in peeks)

        read_for = limit * (1 + case.tear_sends)
        _ask(conns, ("read", read_for), limit)
        time.sleep(0.2)
        sends = []
        for _ in range(case.tear_sends):
            sends.append(one_send(k, "tearing")[1])
            k += 1
            time.sleep(0.02)
        time.sleep(0.2)
        stats = _ask(conns, ("stop",), limit)
        out["send_s_while_reading"] = sends
        out["reads"] = [dict(zip(PHASES, s[1], strict=True)) for s in stats]
        out["mixed"] = [dict(zip(PHASES, s[2], strict=True)) for s in stats]
        out["reader_views_stale"] = [s[3] for s in stats]
        peeks = _ask(conns, ("peek",), limit)
        out["tearing_ok"] = all(p[1] == [float(k - 1)] for p in peeks)
    finally:
        for c in conns:
            with contextlib.suppress(OSError):
                c.send(("exit",))
        for p in procs:
            p.join(10)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        with _watchdog(fault, "shutdown", limit):
            scheme.shutdown()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    return out


# -- caller side --------------------------------------------------------------------------------


def run_case(case: Case, timeout: float | None = None) -> dict[str, Any]:
    """Run one case in a sender process of its own; a JSON-able dict, with ``error`` on failure."""
    if case.scheme not in SCHEMES or case.mode not in MODES or case.model not in MODELS:
        raise ValueError(f"bad case {case}")
    if timeout is None:
        timeout = case.call_timeout * (4 + case.samples + case.tear_sends)
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    fd, fault_path = tempfile.mkstemp(prefix="torchrl-bench-", suffix=".txt")
    os.close(fd)
    shm_before = set(os.listdir("/dev/shm"))
    proc = ctx.Process(target=_sender_main, args=(theirs, case, fault_path))
    result: dict[str, Any] = {**dataclasses.asdict(case), "error": "sender did not start"}
    clean = False
    try:
        proc.start()
        theirs.close()
        if not mine.poll(timeout):
            result["error"] = f"no result within {timeout} s"
        else:
            kind, payload = mine.recv()
            clean = kind == "ok"
            result = payload if clean else {**result, "error": payload}
            if clean:
                result["error"] = None
        proc.join(30)
    except EOFError:
        result["error"] = "the sender process died"
    finally:
        if not clean and proc.pid is not None and proc.is_alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        if proc.is_alive():
            proc.kill()
        proc.join(10)
        mine.close()
        with open(fault_path) as f:
            fault_text = f.read()
        os.unlink(fault_path)
    if not clean and "Timeout (" in fault_text:  # the watchdog fired: its label and stacks
        result["error"] = f"{result['error']}\n{fault_text}"
    # Machine-wide, so other programs' files show too; transient ones (semaphores) are dropped.
    new = set(os.listdir("/dev/shm")) - shm_before
    time.sleep(0.5)
    result["shm_new"] = sorted(new & set(os.listdir("/dev/shm")))
    return result


def _summary(r: dict[str, Any]) -> dict[str, Any]:
    def ms(xs: list[float]) -> float | None:
        return round(statistics.median(xs) * 1e3, 3) if xs else None

    return {
        "case": f"{r['scheme']} {r['mode']} {r['model']} x{r['workers']}",
        "error": (r["error"] or "").splitlines()[-1:] or None,
        "send_ms_p50": ms(r.get("send_s", [])),
        "send_ms_min": round(min(r["send_s"]) * 1e3, 3) if r.get("send_s") else None,
        "fill_ms_p50": ms(r.get("fill_s", [])),
        "send_ms_p50_while_reading": ms(r.get("send_s_while_reading", [])),
        "mixed_reads": [sum(m.values()) for m in r.get("mixed", [])],
        "mixed_by_phase": {p: sum(m[p] for m in r.get("mixed", [])) for p in PHASES},
        "reads": [sum(m.values()) for m in r.get("reads", [])],
        "aliases_sender_model": r.get("aliases_sender_model"),
        "ok": r.get("latency_ok") and r.get("tearing_ok"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="64mib", help=f"comma-separated, among {','.join(MODELS)}")
    p.add_argument("--workers", default="4", help="comma-separated worker counts")
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--modes", default=";".join(MODES), help="';'-separated")
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--tear-sends", type=int, default=None, help="default: --samples")
    p.add_argument("--bind", choices=("context", "model"), default="context")
    p.add_argument("--probe", choices=("edges", "full"), default="edges")
    p.add_argument("--call-timeout", type=float, default=120.0)
    p.add_argument("--out", help="also write the full results here")
    args = p.parse_args(argv)
    from importlib.metadata import version

    env = {pkg: version(pkg) for pkg in ("torch", "torchrl", "tensordict")} | {
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "load_start": os.getloadavg(),
    }
    results = []
    for model in args.model.split(","):
        for n in (int(x) for x in args.workers.split(",")):
            for scheme in args.schemes.split(","):
                for mode in args.modes.split(";"):
                    case = Case(
                        scheme, mode, model, n, args.samples,
                        args.samples if args.tear_sends is None else args.tear_sends,
                        args.bind, args.probe, args.call_timeout,
                    )  # fmt: skip
                    results.append(run_case(case))
                    print(json.dumps(_summary(results[-1])), file=sys.stderr, flush=True)
    env["load_end"] = os.getloadavg()
    report = {"env": env, "summary": [_summary(r) for r in results], "cases": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))
    return 0 if all(r["error"] is None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
