"""Failures leave a vLLM server serving its previous version, never dead, never paused: a reload
that fails half-way, a worker that cannot take a version, a digest mismatch, a timeout, a
trainer killed mid-send. Each time the next send is served."""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from _vllm import (
    PROMPTS,
    Server,
    answers_within,
    attached_trainer,
    checksums,
    http_client,
    set_version,
)

import aiowsync
from aiowsync._planes.shm.sender import SharedMemSenderPlane
from aiowsync.vllm import VLLMServerError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = PROMPTS[0]
BACK_WITHIN_S = 10.0


async def _served(client: httpx.AsyncClient, url: str) -> tuple[list[int], str]:
    """The tokens of the prompt, with the one version that produced them."""
    _, tokens, spans = await answers_within(client, url, PROMPT, BACK_WITHIN_S)
    assert len(spans) == 1
    return tokens, str(spans[0]["version"])


async def _still_serves_the_previous_version(
    client: httpx.AsyncClient, server: Server, before: tuple[list[int], str], sums: dict[str, str]
) -> None:
    assert await _served(client, server.url) == before
    assert (await client.get(f"{server.url}/is_paused")).json() == {"is_paused": False}
    assert await checksums(client, server.url) == sums


@pytest.mark.parametrize("after", [0, 5])
async def test_a_reload_that_fails_half_way_is_undone_and_the_server_resumed(
    vllm_servers: list[Server], after: int
) -> None:
    server = vllm_servers[1]
    async with (
        http_client() as client,
        attached_trainer([server.url]) as (scheme, model, servers),
    ):
        set_version(model, 1)
        await scheme.send()
        before, sums = await _served(client, server.url), await checksums(client, server.url)
        assert before[1] == "1"
        server.fail_next({"fail": "reload", "after": after})
        set_version(model, 2)
        with pytest.raises(
            VLLMServerError, match=r"update_weights failed: .*injected fault"
        ) as info:
            await scheme.send()
        assert info.value.url == server.url and info.value.step == "update_weights"
        await _still_serves_the_previous_version(client, server, before, sums)
        assert await servers.weight_versions() == {server.url: "1"}
        result = await scheme.send()
        tokens, label = await _served(client, server.url)
        assert label == str(result.version) and tokens != before[0]


async def test_a_worker_that_cannot_take_a_version_fails_the_send_and_nothing_pauses(
    vllm_servers: list[Server],
) -> None:
    server = vllm_servers[1]
    async with (
        http_client() as client,
        attached_trainer([server.url]) as (scheme, model, servers),
    ):
        before, sums = await _served(client, server.url), await checksums(client, server.url)
        server.fail_next({"fail": "receive"})
        set_version(model, 2)
        with pytest.raises(aiowsync.RemoteApplyError, match="injected fault") as info:
            await scheme.send()
        assert list(info.value.errors) == [0]
        await _still_serves_the_previous_version(client, server, before, sums)
        result = await scheme.send()
        assert (await _served(client, server.url))[1] == str(result.version)


async def test_a_digest_mismatch_leaves_the_server_on_its_version(
    vllm_servers: list[Server], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = vllm_servers[1]
    async with (
        http_client() as client,
        attached_trainer([server.url], integrity=True) as (scheme, model, servers),
    ):
        before, sums = await _served(client, server.url), await checksums(client, server.url)
        plane = scheme._sender.plane  # type: ignore[union-attr]
        assert isinstance(plane, SharedMemSenderPlane)
        deliver = plane.deliver

        def corrupt(version: int, *args: Any, **kwargs: Any) -> Any:
            table = plane._tables[""]
            flat = table[table.index_of(version)].value.parts[0]
            flat[7] = flat[7] ^ 0x5A
            return deliver(version, *args, **kwargs)

        monkeypatch.setattr(plane, "deliver", corrupt)
        set_version(model, 2)
        with pytest.raises(aiowsync.RemoteApplyError, match="bucket 0") as info:
            await scheme.send()
        assert list(info.value.errors) == [0]
        await _still_serves_the_previous_version(client, server, before, sums)
        monkeypatch.undo()
        result = await scheme.send()
        assert (await _served(client, server.url))[1] == str(result.version)
        assert await servers.weight_versions() == {server.url: str(result.version)}


async def test_a_worker_that_answers_too_late_times_the_send_out(
    vllm_servers: list[Server],
) -> None:
    server = vllm_servers[1]
    async with (
        http_client() as client,
        attached_trainer([server.url]) as (scheme, model, servers),
    ):
        before, sums = await _served(client, server.url), await checksums(client, server.url)
        server.fail_next({"fail": "receive", "delay": 4.0})
        set_version(model, 2)
        with pytest.raises(aiowsync.WeightSyncTimeout):
            await scheme.send(timeout=1.5)
        await _still_serves_the_previous_version(client, server, before, sums)
        await asyncio.sleep(4.0)  # the late answer arrives
        result = await scheme.send(timeout=60)
        assert (await _served(client, server.url))[1] == str(result.version)


async def test_a_trainer_killed_mid_send_leaves_the_server_serving_and_a_new_one_attaches(
    vllm_servers: list[Server],
) -> None:
    server = vllm_servers[1]
    here = Path(__file__).parent
    trainer = subprocess.Popen(
        [sys.executable, str(here / "_trainer.py"), server.url],
        cwd=here,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"),
        start_new_session=True,
    )
    try:
        assert trainer.stdout is not None
        lines = []
        # The trainer imports torch and transformers, attaches and connects first.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = trainer.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
            if line.startswith("sent 3"):
                break
        # Kill it while the server is paused: a version on its way in.
        async with http_client() as client:
            deadline = time.monotonic() + 60
            while not (await client.get(f"{server.url}/is_paused")).json()["is_paused"]:
                assert time.monotonic() < deadline, "the server never paused"
            os.killpg(trainer.pid, signal.SIGKILL)
            killed = time.monotonic()
            trainer.wait(timeout=30)
            tokens, label = await _served(client, server.url)
            back = time.monotonic() - killed
            print(f"killed while paused: the server answered {back:.2f} s later")
            assert back < BACK_WITHIN_S
            held = (await client.get(f"{server.url}/weight_info")).json()["weight_version"]
            assert label == held and int(label) >= 3

            # A new trainer attaches; the version the old one left is the one it served.
            async with attached_trainer([server.url]) as (scheme, model, servers):
                set_version(model, int(label))
                await scheme.send()
                again, new_label = await _served(client, server.url)
                assert new_label == "1" and again == tokens
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait(timeout=30)
        if trainer.stdout is not None:
            trainer.stdout.close()
        # A killed sender cannot remove its shared memory: the test does.
        for path in glob.glob(f"/dev/shm/aiowsync-{trainer.pid}-*"):
            os.unlink(path)


async def test_together_a_fleet_that_cannot_take_a_version_keeps_the_one_it_had(
    vllm_servers: list[Server],
) -> None:
    urls = [s.url for s in vllm_servers]
    async with (
        http_client() as client,
        attached_trainer(urls, together=True) as (scheme, model, servers),
    ):
        set_version(model, 1)
        await scheme.send()
        before = [await _served(client, u) for u in urls]
        assert [label for _, label in before] == ["1", "1"]
        assert before[0][0] == before[1][0]  # same weights, same tokens
        vllm_servers[1].fail_next({"fail": "reload", "after": 5})
        set_version(model, 2)
        with pytest.raises(VLLMServerError) as info:
            await scheme.send()
        assert info.value.url == urls[1]
        # The server that had loaded the version took the old one back.
        assert [await _served(client, u) for u in urls] == before
        assert await servers.weight_versions() == dict.fromkeys(urls, "1")
        result = await scheme.send()
        after = [await _served(client, u) for u in urls]
        assert [label for _, label in after] == [str(result.version)] * 2
        assert after[0][0] == after[1][0] != before[0][0]


@pytest.mark.parametrize("ended_by", ["deadline", "cancellation"])
async def test_a_send_ended_while_the_server_loads_leaves_it_on_its_version(
    vllm_servers: list[Server], ended_by: str
) -> None:
    """The send's deadline passes, or ``asyncio.timeout`` cancels the send, while the server
    loads the version: the call ends once the server took the version it served back and
    was resumed (a deadline's error names the server); the next send is served."""
    server = vllm_servers[1]
    async with (
        http_client() as client,
        attached_trainer([server.url]) as (scheme, model, servers),
    ):
        before, sums = await _served(client, server.url), await checksums(client, server.url)
        server.fail_next({"fail": "reload", "after": 10**9, "delay": 3.0})
        set_version(model, 2)
        if ended_by == "deadline":
            with pytest.raises(aiowsync.WeightSyncTimeout) as info:
                await scheme.send(timeout=1.5)
            assert isinstance(info.value, aiowsync.vllm.VLLMServerTimeout)
            assert info.value.url == server.url
        else:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(1.0):
                    await scheme.send()
        await _still_serves_the_previous_version(client, server, before, sums)
        result = await scheme.send(timeout=60)
        assert (await _served(client, server.url))[1] == str(result.version)
