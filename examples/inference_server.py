"""A live-updated inference server: FastAPI under uvicorn, greedy generation from a small causal
language model, each request finishing on the weights version it started on.

Three kinds of process take part:

- ``serve``: one uvicorn server, one aiowsync receiver. The app's lifespan owns the scheme
  (``async with scheme`` around the app) and connects in the background, so the server answers
  at once: ``/ready`` says 503 until version 0 is applied, then 200. Each ``POST /generate``
  takes a lease when it starts and generates every token on that version, while the model
  itself goes on switching to newer ones; the response carries the version in a header
  (``x-weights-version``) and a field. The receiver follows its trainer across restarts
  (``reconnect=True``): when the trainer dies the server goes on serving its last version,
  and it joins the next trainer on the same address by itself.
- ``trainer``: the sender. It owns the same model and sends new versions when told to.
- the default command, a driver: it starts two servers and a trainer, checks readiness, sends
  requests from an httpx client first with no updates and then while the trainer sends
  versions, and checks every response offline: its tokens must equal greedy decoding with the
  weights of the version it reports. With ``--restart`` it then kills the trainer (SIGKILL)
  while it sends and starts a new one, and the requests go on meanwhile. It prints the
  figures and, with ``--json``, writes them.

The model is a GPT-2 built from a transformers config with a fixed seed: nothing is
downloaded. Version ``v`` of trainer ``g`` (the first trainer is 0, the one started after the
kill 1) is a pure function of ``(g, v)`` (:func:`weights_for`), so the driver can rebuild any
version to check a response; each response names both (``generation``, ``version``).

Run it with the ``server`` extra installed (``pip install 'aiowsync[server]'``)::

    python examples/inference_server.py              # --restart: kill and replace the trainer
"""

from __future__ import annotations

import os

# Must happen before torch is imported (aiowsync imports it), here and in the child processes.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import contextlib
import json
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import anyio.to_thread
import torch
from fastapi import FastAPI, HTTPException, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from torch import nn

import aiowsync

VOCAB = 512
PROMPT_LEN = 8
CONNECT_S = 120.0
"""How long a server's receiver waits for the trainer and version 0."""


# -- the model and its versions -------------------------------------------------------------


def make_model() -> nn.Module:
    """The small causal LM every process builds the same way (version 0's weights)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=128,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        initializer_range=0.2,  # wide: the greedy tokens follow small changes of the weights
    )
    return GPT2LMHeadModel(config).eval()


def weights_for(
    base: dict[str, torch.Tensor], version: int, trainer: int = 0
) -> dict[str, torch.Tensor]:
    """Version ``version``'s weights of trainer ``trainer``: ``base`` (the first trainer's
    version 0, by parameter name), each tensor moved by noise seeded with both. Every
    trainer's versions count from 0, and differ from every other trainer's. The trainers
    send these; the driver rebuilds them to check responses."""
    if version == 0 and trainer == 0:
        return {key: t.clone() for key, t in base.items()}
    gen = torch.Generator().manual_seed(trainer * 1_000_003 + version)
    return {key: t + 0.05 * torch.randn(t.shape, generator=gen) for key, t in base.items()}


def parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Version 0's weights: the model's own, by name (tied weights once)."""
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def greedy(
    model: nn.Module, params: dict[str, torch.Tensor], prompt: list[int], n: int
) -> list[int]:
    """``n`` tokens of greedy decoding after ``prompt``, running ``model`` on ``params``."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            out = torch.func.functional_call(model, params, (ids,), {"use_cache": False})
            ids = torch.cat([ids, out.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return [int(t) for t in ids[0, len(prompt) :]]


# -- the server -----------------------------------------------------------------------------


class Request(BaseModel):
    prompt: list[int] = Field(min_length=1, max_length=32)
    max_tokens: int = Field(default=32, ge=1, le=48)


def create_app(address: str, worker_idx: int) -> FastAPI:
    """The FastAPI app of one server process, receiver ``worker_idx`` of the trainer at
    ``address``."""
    model = make_model()
    scheme = aiowsync.SharedMemWeightSyncScheme(address)
    # A trainer that dies (or restarts) leaves the server serving its last version; the
    # server joins the next trainer on this address by itself.
    scheme.init_on_receiver(model=model, worker_idx=worker_idx, reconnect=True)

    async def connect() -> None:
        try:
            await scheme.connect(timeout=CONNECT_S)
        except aiowsync.WeightSyncError as exc:
            print(f"server {worker_idx}: no weights: {exc}", file=sys.stderr, flush=True)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The scheme lives exactly as long as the app; connecting (which waits for the
        # trainer and version 0) runs beside the serving, and /ready tells when it is done.
        async with scheme:
            task = asyncio.create_task(connect())
            app.state.compute = anyio.CapacityLimiter(1)
            try:
                yield
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    app = FastAPI(lifespan=lifespan)

    @app.get("/ready")
    async def ready() -> Any:
        # Ready while it holds weights, also while the trainer is away (it serves the last
        # version it got); "connected" says whether a trainer is there.
        if not scheme.ready:
            return JSONResponse({"ready": False, "version": None}, status_code=503)
        return {
            "ready": True,
            "version": scheme.version,
            "generation": scheme.generation,
            "connected": scheme.connected,
        }

    @app.post("/generate")
    async def generate(request: Request, response: Response) -> dict[str, Any]:
        if scheme.version < 0:
            raise HTTPException(503, "no weights yet")
        async with scheme.lease() as held:
            # functional_call re-points the module's tensors for the length of the call, so
            # one forward at a time runs on this module (in a thread: the loop stays free to
            # take new versions and requests).
            tokens = await anyio.to_thread.run_sync(
                greedy,
                model,
                held.params(),
                request.prompt,
                request.max_tokens,
                limiter=app.state.compute,
            )
            version, generation = held.version, held.generation
            latest, latest_generation = scheme.version, scheme.generation
        response.headers["x-weights-version"] = str(version)
        return {
            "version": version,
            "generation": generation,
            "latest_at_end": latest,
            "generation_at_end": latest_generation,
            "tokens": tokens,
        }

    return app


def serve(address: str, worker_idx: int, port: int) -> None:
    import uvicorn

    torch.set_num_threads(1)
    config = uvicorn.Config(
        create_app(address, worker_idx), host="127.0.0.1", port=port, log_level="warning"
    )
    uvicorn.Server(config).run()


# -- the trainer ----------------------------------------------------------------------------


async def train(address: str, workers: int, interval: float, generation: int) -> None:
    """Trainer ``generation`` (0 first, 1 for the one started after a kill): bind, say
    ``bound``; connect, say ``connected``; on ``go`` (a line on stdin) send a version every
    ``interval`` seconds, saying ``sent V`` after each, until ``stop``; then say
    ``stopped V`` and end."""
    torch.set_num_threads(1)
    model = make_model()
    params = dict(model.named_parameters())
    base = parameters(model)
    with torch.no_grad():  # this trainer's version 0
        for key, value in weights_for(base, 0, generation).items():
            params[key].copy_(value)
    scheme = aiowsync.SharedMemWeightSyncScheme(bind=address)
    scheme.init_on_sender(model=model, num_workers=workers)
    async with scheme:
        print("bound 0", flush=True)
        await scheme.connect(timeout=CONNECT_S)
        print("connected", flush=True)
        if (await anyio.to_thread.run_sync(sys.stdin.readline)).strip() != "go":
            return
        stop = anyio.Event()

        async def until_stop() -> None:
            await anyio.to_thread.run_sync(sys.stdin.readline)  # "stop", or the end of stdin
            stop.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(until_stop)
            while not stop.is_set():
                version = scheme.version + 1
                new = weights_for(base, version, generation)  # this example's training step
                with torch.no_grad():
                    for key, p in params.items():
                        p.copy_(new[key])
                result = await scheme.send()
                assert result.version == version, (result.version, version)
                print(f"sent {version}", flush=True)
                with anyio.move_on_after(interval):
                    await stop.wait()
        print(f"stopped {scheme.version}", flush=True)


# -- the driver -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def started(args: list[str], **kw: Any) -> Iterator[subprocess.Popen[str]]:
    """A child process running this script with ``args``; stopped however the block ends."""
    proc = subprocess.Popen([sys.executable, __file__, *args], text=True, **kw)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()  # uvicorn shuts down gracefully: the lifespan leaves the scheme
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


async def wait_ready(client: Any, url: str, *, want: int, timeout: float) -> int:
    """Poll ``url/ready`` until it answers ``want``; the number of 503s seen meanwhile."""
    import httpx

    deadline, not_ready = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        try:
            r = await client.get(f"{url}/ready")
        except httpx.TransportError:
            await asyncio.sleep(0.1)
            continue
        if r.status_code == want:
            return not_ready
        not_ready += r.status_code == 503
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{url}/ready did not answer {want} within {timeout} s")


async def load(
    client: Any,
    urls: list[str],
    *,
    requests: int,
    concurrency: int,
    tokens: int,
    seed: int,
    until: Callable[[], bool] | None = None,
) -> list[dict[str, Any]]:
    """``requests`` requests (more until ``until()`` is true), ``concurrency`` at a time,
    round-robin over ``urls``; each result with its prompt, latency and outcome."""
    rng = random.Random(seed)
    results: list[dict[str, Any]] = []
    counter = iter(range(10**9))

    async def one(i: int) -> None:
        prompt = [rng.randrange(1, VOCAB) for _ in range(PROMPT_LEN)]
        t0 = time.perf_counter()
        try:
            r = await client.post(
                f"{urls[i % len(urls)]}/generate", json={"prompt": prompt, "max_tokens": tokens}
            )
            body = r.json() if r.status_code == 200 else {}
            ok = r.status_code == 200 and r.headers.get("x-weights-version") == str(
                body.get("version")
            )
        except Exception as exc:  # counted as a failed request
            body, ok = {"error": repr(exc)}, False
        results.append({"prompt": prompt, "latency": time.perf_counter() - t0, "ok": ok, **body})

    async def client_task() -> None:
        while True:
            i = next(counter)
            if i >= requests and (until is None or until()):
                return
            await one(i)

    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(client_task)
    return results


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def said(trainer: subprocess.Popen[str], word: str) -> int:
    """Read the trainer's lines until one says ``word``; the number that comes with it."""
    assert trainer.stdout is not None
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, trainer.stdout.readline)
        if not line:
            raise RuntimeError(f"the trainer ended before it said {word!r}")
        parts = line.split()
        if parts and parts[0] == word:
            return int(parts[1]) if len(parts) > 1 else 0


def tell(trainer: subprocess.Popen[str], line: str) -> None:
    assert trainer.stdin is not None
    trainer.stdin.write(line + "\n")
    trainer.stdin.flush()


def count_sent(trainer: subprocess.Popen[str], sent: list[int]) -> str:
    """In a thread: the trainer's lines until it stops, ``sent[0]`` the latest version sent."""
    assert trainer.stdout is not None
    for line in trainer.stdout:
        word, version = line.split()
        sent[0] = int(version)
        if word == "stopped":
            return line
    return ""


def start_trainer(
    stack: contextlib.ExitStack, address: str, opts: argparse.Namespace, generation: int
) -> subprocess.Popen[str]:
    args = ["trainer", "--address", address, "--interval", str(opts.interval)]
    return stack.enter_context(
        started(
            [*args, "--generation", str(generation)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
    )


async def every_server_on(client: Any, urls: list[str], generation: int, timeout: float) -> None:
    """Poll every server's ``/ready`` until each serves a version of trainer ``generation``."""
    deadline, waiting = time.monotonic() + timeout, set(urls)
    while waiting:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{sorted(waiting)} did not take trainer {generation}'s weights")
        for url in list(waiting):
            r = await client.get(f"{url}/ready")
            if r.status_code == 200 and r.json()["generation"] == generation:
                waiting.discard(url)
        await asyncio.sleep(0.02)


async def restart(
    client: Any,
    urls: list[str],
    opts: argparse.Namespace,
    stack: contextlib.ExitStack,
    old: subprocess.Popen[str],
    address: str,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Kill the trainer while it sends and start another on its address, while requests go
    on; the responses of this phase and its figures."""
    figures: dict[str, Any] = {}
    done = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def replace() -> None:
        os.kill(old.pid, signal.SIGKILL)
        killed = time.monotonic()
        await loop.run_in_executor(None, old.wait, 30)
        new = start_trainer(stack, address, opts, generation=1)
        await said(new, "bound")  # its process is up and its socket bound
        bound = time.monotonic()
        await every_server_on(client, urls, generation=1, timeout=CONNECT_S)
        followed = time.monotonic()
        figures["restart_s_from_kill"] = followed - killed
        figures["restart_s_from_new_trainer_bound"] = followed - bound
        await said(new, "connected")  # its connect() saw every server on its version 0
        tell(new, "go")
        sent = [0]
        following = loop.run_in_executor(None, count_sent, new, sent)
        deadline = time.monotonic() + 120
        while sent[0] < opts.restart_versions and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        tell(new, "stop")
        await following
        figures["versions_sent_after_restart"] = sent[0]
        await loop.run_in_executor(None, new.wait, 60)
        figures["new_trainer_exit"] = new.returncode
        done.set()

    results, _ = await asyncio.gather(
        load(
            client, urls, requests=opts.requests, concurrency=opts.concurrency,
            tokens=opts.tokens, seed=3, until=done.is_set,
        ),
        replace(),
    )  # fmt: skip
    figures["restart_requests"] = len(results)
    figures["restart_failed"] = sum(not r["ok"] for r in results)
    for g in (0, 1):
        figures[f"restart_answered_by_trainer_{g}"] = sum(
            r["ok"] and r["generation"] == g for r in results
        )
    return results, figures


async def drive(opts: argparse.Namespace) -> dict[str, Any]:
    import httpx

    address = f"ipc://@aiowsync-serve-{os.getpid()}-{secrets.token_hex(4)}"
    ports = [free_port() for _ in range(2)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    report: dict[str, Any] = {}
    after: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        for i, port in enumerate(ports):
            stack.enter_context(
                started(
                    ["serve", "--address", address, "--worker-idx", str(i), "--port", str(port)]
                )
            )
        async with httpx.AsyncClient(timeout=60) as client:
            # The servers answer before any trainer exists, and say they are not ready.
            report["not_ready_answers"] = [
                await wait_ready(client, u, want=503, timeout=120) + 1 for u in urls
            ]
            early = await client.post(f"{urls[0]}/generate", json={"prompt": [1, 2]})
            report["generate_before_ready"] = early.status_code
            trainer = start_trainer(stack, address, opts, generation=0)
            for u in urls:
                await wait_ready(client, u, want=200, timeout=120)
            print("both servers ready (version 0); requests without updates ...", flush=True)
            for u in urls:  # the first forward of a process is slow: not part of the figures
                await client.post(f"{u}/generate", json={"prompt": [1], "max_tokens": 2})
            steady = await load(
                client, urls, requests=opts.requests, concurrency=opts.concurrency,
                tokens=opts.tokens, seed=1,
            )  # fmt: skip
            print("requests while the trainer sends versions ...", flush=True)
            await said(trainer, "connected")
            sent = [0]
            tell(trainer, "go")
            loop = asyncio.get_running_loop()
            following = loop.run_in_executor(None, count_sent, trainer, sent)
            # Every request of this phase runs while versions are being sent: at least
            # --requests of them, and until at least --versions versions were sent.
            updating = await load(
                client, urls, requests=opts.requests, concurrency=opts.concurrency,
                tokens=opts.tokens, seed=2, until=lambda: sent[0] >= opts.versions,
            )  # fmt: skip
            if opts.restart:
                print("trainer killed while it sends; a new one starts ...", flush=True)
                after, figures = await restart(client, urls, opts, stack, trainer, address)
                await following  # the killed trainer's output ended
                report["versions_sent"] = sent[0]
                report["trainer_exit"] = figures.pop("new_trainer_exit")
                report.update(figures)
            else:
                tell(trainer, "stop")
                await following
                report["versions_sent"] = sent[0]
                trainer.wait(60)
                report["trainer_exit"] = trainer.returncode
    report.update(check(steady, updating, after, opts.tokens))
    return report


def check(
    steady: list[dict[str, Any]],
    updating: list[dict[str, Any]],
    after: list[dict[str, Any]],
    tokens: int,
) -> dict[str, Any]:
    """Every response against greedy decoding with the weights of the version it reports
    (of the trainer it reports)."""
    torch.set_num_threads(1)
    model = make_model()
    base = parameters(model)
    by_version: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    mismatches = 0
    every = steady + updating + after
    answered = [r for r in every if r["ok"]]
    for r in answered:
        key = (r["generation"], r["version"])
        if key not in by_version:
            by_version[key] = weights_for(base, key[1], key[0])
        if greedy(model, by_version[key], r["prompt"], tokens) != r["tokens"]:
            mismatches += 1
    # Different versions give different tokens, or the check above would prove little.
    distinct_outputs = len(
        {tuple(greedy(model, w, [1, 2, 3, 4, 5, 6, 7, 8], tokens)) for w in by_version.values()}
    )
    spans = [
        r["latest_at_end"] - r["version"] + 1
        for r in updating
        if r["ok"] and r["generation_at_end"] == r["generation"]
    ]
    return {
        "requests": len(every),
        "failed": sum(not r["ok"] for r in every),
        "mismatches": mismatches,
        "versions_answered": [f"{g}:{v}" for g, v in sorted(by_version)],
        "distinct_outputs_of_one_prompt": distinct_outputs,
        "most_versions_within_one_request": max(spans, default=0),
        "p99_ms_without_updates": 1000 * p99([r["latency"] for r in steady]),
        "p99_ms_during_updates": 1000 * p99([r["latency"] for r in updating]),
        "median_ms_without_updates": 1000 * sorted(r["latency"] for r in steady)[len(steady) // 2],
        "median_ms_during_updates": 1000
        * sorted(r["latency"] for r in updating)[len(updating) // 2],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    s = sub.add_parser("serve", help="one server process (started by the driver)")
    s.add_argument("--address", required=True)
    s.add_argument("--worker-idx", type=int, required=True)
    s.add_argument("--port", type=int, required=True)
    t = sub.add_parser("trainer", help="the trainer process (started by the driver)")
    t.add_argument("--address", required=True)
    t.add_argument("--workers", type=int, default=2)
    t.add_argument("--interval", type=float, default=0.05)
    t.add_argument("--generation", type=int, default=0, help="which trainer: 0, 1 after a kill")
    parser.add_argument(
        "--requests",
        type=int,
        default=100,
        help="requests in each phase, at least (default 100)",
    )
    parser.add_argument(
        "--concurrency", type=int, default=4, help="requests in flight at once (default 4)"
    )
    parser.add_argument("--tokens", type=int, default=32, help="tokens per request (default 32)")
    parser.add_argument(
        "--versions",
        type=int,
        default=20,
        help="the second phase lasts until the trainer sent at least this many (default 20)",
    )
    parser.add_argument(
        "--interval", type=float, default=0.05, help="seconds between two sends (default 0.05)"
    )
    parser.add_argument(
        "--restart",
        action="store_true",
        help="then kill the trainer (SIGKILL) while it sends and start a new one; the "
        "servers follow it while the requests go on",
    )
    parser.add_argument(
        "--restart-versions",
        type=int,
        default=5,
        help="with --restart, the new trainer sends at least this many (default 5)",
    )
    parser.add_argument("--json", help="write the figures to this file")
    opts = parser.parse_args()
    if opts.command == "serve":
        serve(opts.address, opts.worker_idx, opts.port)
        return
    if opts.command == "trainer":
        anyio.run(train, opts.address, opts.workers, opts.interval, opts.generation)
        return
    report = asyncio.run(drive(opts))
    for key, value in report.items():
        shown = f"{value:.1f}" if isinstance(value, float) else value
        print(f"  {key}: {shown}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(report, f, indent=1)
    good = report["failed"] == 0 and report["mismatches"] == 0 and report["trainer_exit"] == 0
    print("OK: every response matches its version's greedy decoding" if good else "FAILED")
    sys.exit(0 if good else 1)


if __name__ == "__main__":
    main()
