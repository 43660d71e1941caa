"""Real CPU vLLM servers for the tests: a tiny random Llama, started with aiowsync's engine.

Each server is its own process group (the API server, its engine core and its worker), killed
whole when the tests are done. A server reads ``fault_file`` (see ``FAULT_FILE_ENV``) so that a
test can make its next apply fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import torch

import aiowsync
from aiowsync.vllm import VLLMServers
from aiowsync.vllm._worker import FAULT_FILE_ENV

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,  # head_dim 64: the CPU attention kernels need at least 32
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    # Wider than the usual 0.02, so that greedy decoding is far from ties between tokens.
    "initializer_range": 0.3,
}

START_LIMIT_S = float(os.environ.get("AIOWSYNC_VLLM_START_S", "600"))
"""How long a server may take to answer /health: about 30 s on an idle 2-core host, and
several times that beside other work."""

PROMPTS = [[1, 5, 7, 9], [1, 300, 12], [1, 42, 43, 44, 45], [1, 200]]

BEATS = aiowsync.Heartbeats(interval=0.5, missed=12)
"""Workers are lost after 6 s of silence, not 1.5 s: a vLLM worker's beats wait for a core
on a busy 2-core host (the test of a killed trainer keeps the default, which it measures)."""


def write_model(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA))
    return directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_env(fault_file: Path | None = None, tmp: str | None = None) -> dict[str, str]:
    venv_lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    env = dict(os.environ)
    if tmp is not None:
        # vLLM's processes talk over ipc:// sockets in the temporary directory; a killed
        # process leaves its socket files behind.
        env["TMPDIR"] = tmp
    env.update(
        VLLM_SERVER_DEV_MODE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        OMP_WAIT_POLICY="PASSIVE",
        PYTHONUNBUFFERED="1",
    )
    if venv_lib.exists():
        env["LD_PRELOAD"] = str(venv_lib)
    if fault_file is not None:
        env[FAULT_FILE_ENV] = str(fault_file)
    return env


class Server:
    """One vLLM API server process group."""

    def __init__(self, model: Path, log: Path, fault_file: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.fault_file = fault_file
        # Short (a socket's path must fit 107 bytes), and the server's own, so that stop()
        # removes every socket file its processes made.
        self.tmp = tempfile.mkdtemp(prefix="vllm-")
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--load-format", "dummy", "--skip-tokenizer-init",
            "--dtype", "float32", "--enforce-eager", "--port", str(self.port),
            "--enable-scale-out", "--max-model-len", "256", "--max-num-seqs", "8",
            "--weight-transfer-config", '{"backend": "aiowsync"}',
        ]  # fmt: skip
        try:
            with open(log, "wb") as out:
                self.proc = subprocess.Popen(
                    args,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=server_env(fault_file, self.tmp),
                    start_new_session=True,
                )
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise

    def wait_up(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM server not up within {START_LIMIT_S} s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        # Intel OpenMP registers each of vLLM's processes in /dev/shm, and the engine core's
        # message queues are /dev/shm segments too (psm_*); a process killed cannot remove
        # its own.
        # Note them all now, and remove what is left once the server is gone.
        pids = [self.proc.pid]
        try:
            import psutil

            pids += [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        except Exception:  # psutil missing, or the server gone already
            pass
        files = {path for pid in pids for path in _shm_mapped_by(pid)}
        for pid in pids:
            files |= set(glob.glob(f"/dev/shm/__KMP_REGISTERED_LIB_{pid}_*"))
        try:
            self._stop()
        finally:
            for path in files:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _stop(self) -> None:
        # The API server alone first: it shuts its engine core down, which removes its queues.
        # A signal to the whole group would end the engine core before it could.
        if self.proc.poll() is None:
            try:
                self.proc.terminate()
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def fail_next(self, fault: dict[str, Any]) -> None:
        assert self.fault_file is not None
        self.fault_file.write_text(json.dumps(fault))


def _shm_mapped_by(pid: int) -> set[str]:
    """The message-queue segments (Python's ``/dev/shm/psm_*``) that process ``pid`` maps;
    not aiowsync's slots, which the trainer that made them removes."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            paths = {line.split()[-1] for line in maps.read().splitlines() if line.strip()}
    except OSError:
        return set()
    return {path for path in paths if path.startswith("/dev/shm/psm_")}


def start_servers(tmp: Path, n: int) -> list[Server]:
    model = write_model(tmp / "tiny-llama")
    servers: list[Server] = []
    try:
        for i in range(n):
            servers.append(Server(model, tmp / f"server{i}.log", tmp / f"fault{i}.json"))
        deadline = time.monotonic() + START_LIMIT_S
        for server in servers:
            server.wait_up(deadline)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def trainer_model(seed: int = 0) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(**TINY_LLAMA)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).float().eval()


def set_version(model: torch.nn.Module, seed: int) -> None:
    """The trainer's weights for ``seed``: the same bytes every time."""
    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def http_client() -> httpx.AsyncClient:
    """A client for the test's vLLM servers. Their uvicorn closes a connection idle for 5 s
    (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``); a request sent on one just as it closes fails with
    ``ReadError``. So the client lets its idle connections go sooner."""
    return httpx.AsyncClient(limits=httpx.Limits(keepalive_expiry=2.0))


async def generate(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int = 8
) -> tuple[list[int], list[dict[str, Any]]]:
    reply = await client.post(
        f"{url}/inference/v1/generate",
        json={"token_ids": prompt, "sampling_params": {"max_tokens": max_tokens, "temperature": 0}},
        timeout=60,
    )
    reply.raise_for_status()
    choice = reply.json()["choices"][0]
    return list(choice["token_ids"]), list(choice["weight_versions"])


async def checksums(client: httpx.AsyncClient, url: str) -> dict[str, str]:
    reply = await client.post(f"{url}/weight_checker", json={"action": "checksum"}, timeout=60)
    reply.raise_for_status()
    return dict(reply.json()["checksums"])


async def _counters(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The server's Prometheus samples, summed over their labels."""
    reply = await client.get(f"{url}/metrics", timeout=60)
    reply.raise_for_status()
    out: dict[str, float] = {}
    for line in reply.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


async def generating(client: httpx.AsyncClient, url: str) -> None:
    """Return once the server is generating: a request is running, and tokens were generated
    since the look before. (On a busy host one look at /metrics can take seconds, and the
    server may be between requests at many of them: one look that sees both is enough.)"""
    before = None
    while True:
        now = await _counters(client, url)
        tokens = now.get("vllm:generation_tokens_total", 0.0)
        running = now.get("vllm:num_requests_running", 0.0) >= 1
        if running and before is not None and tokens > before:
            return
        before = tokens
        await asyncio.sleep(0.02)


async def answers_within(
    client: httpx.AsyncClient, url: str, prompt: list[int], limit: float
) -> tuple[float, list[int], list[dict[str, Any]]]:
    """The first answer to ``prompt`` within ``limit`` seconds, and how long it took."""
    start = time.monotonic()
    tokens, spans = await asyncio.wait_for(generate(client, url, prompt), limit)
    return time.monotonic() - start, tokens, spans


@contextlib.asynccontextmanager
async def attached_trainer(
    urls: list[str], *, pause: str = "wait", together: bool = False, **options: Any
) -> AsyncIterator[tuple[aiowsync.WeightSyncScheme, torch.nn.Module, VLLMServers]]:
    """A trainer at version 0 (a shared-memory scheme with ``options``) attached to the
    servers at ``urls`` (one worker each) and connected."""
    model = trainer_model()
    set_version(model, 0)
    scheme = aiowsync.SharedMemWeightSyncScheme(heartbeats=BEATS, **options)
    scheme.init_on_sender(model=model, num_workers=len(urls))
    servers = VLLMServers(urls, pause=pause, together=together)  # type: ignore[arg-type]
    async with scheme, servers.attach(scheme):
        await scheme.connect(timeout=120)
        yield scheme, model, servers
