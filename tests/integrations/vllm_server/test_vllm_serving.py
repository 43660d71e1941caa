"""A real vLLM server takes its versions from an aiowsync trainer while a client keeps requests
in flight; every response's tokens are those its version gives on a quiet server."""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import httpx
import pytest
import torch
from _vllm import (
    BEATS,
    PROMPTS,
    Server,
    attached_trainer,
    checksums,
    generate,
    generating,
    http_client,
    set_version,
    trainer_model,
)

import aiowsync
from aiowsync.vllm import VLLMServerError, VLLMServers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


async def _quiet_tokens(
    scheme: aiowsync.WeightSyncScheme,
    model: torch.nn.Module,
    client: httpx.AsyncClient,
    url: str,
    seeds: set[int],
    max_tokens: int,
) -> dict[int, list[list[int]]]:
    """Each seed's greedy tokens for every prompt, sent again and asked with nothing else in
    flight."""
    out = {}
    for seed in sorted(seeds):
        set_version(model, seed)
        result = await scheme.send()
        answers = []
        for prompt in PROMPTS:
            tokens, spans = await generate(client, url, prompt, max_tokens)
            assert [s["version"] for s in spans] == [str(result.version)]
            answers.append(tokens)
        out[seed] = answers
    return out


async def _keep_asking(
    client: httpx.AsyncClient,
    url: str,
    stop: asyncio.Event,
    seen: list[tuple[int, list[int], list[dict[str, object]]]],
    failures: list[BaseException],
    max_tokens: int,
) -> None:
    """Ask again and again until ``stop`` is set."""
    for i in itertools.count():
        if stop.is_set():
            return
        p = i % len(PROMPTS)
        try:
            tokens, spans = await generate(client, url, PROMPTS[p], max_tokens)
        except Exception as exc:  # counted, not raised: the test asserts none happened
            failures.append(exc)
            continue
        seen.append((p, tokens, spans))


async def test_twenty_sends_under_load_each_response_is_its_versions_greedy_tokens(
    vllm_servers: list[Server],
) -> None:
    server = vllm_servers[0]
    seen: list[tuple[int, list[int], list[dict[str, object]]]] = []
    failures: list[BaseException] = []
    async with (
        http_client() as client,
        attached_trainer([server.url], pause="wait") as (scheme, model, servers),
    ):
        assert await servers.weight_versions() == {server.url: "0"}
        stop = asyncio.Event()
        askers = [
            asyncio.create_task(_keep_asking(client, server.url, stop, seen, failures, 8))
            for _ in range(4)
        ]
        try:
            for seed in range(1, 21):
                await asyncio.sleep(0.05)  # let requests run between versions
                set_version(model, seed)
                result = await scheme.send(timeout=60)
                assert result.version == seed
                assert await servers.weight_versions() == {server.url: str(seed)}
        finally:
            stop.set()
            await asyncio.gather(*askers)
        assert failures == []
        labels = {int(str(spans[0]["version"])) for _, _, spans in seen if spans}
        quiet = await _quiet_tokens(scheme, model, client, server.url, labels, 8)

        # The same weights sent twice: the server holds the same bytes.
        set_version(model, 3)
        await scheme.send()
        first = await checksums(client, server.url)
        set_version(model, 4)
        await scheme.send()
        other = await checksums(client, server.url)
        set_version(model, 3)
        await scheme.send()
        assert await checksums(client, server.url) == first != other

    assert len(seen) >= 40
    for p, tokens, spans in seen:
        assert len(spans) == 1, spans  # "wait": a request runs on one version
        version = int(str(spans[0]["version"]))
        assert (spans[0]["start"], spans[0]["end"]) == (0, len(tokens))
        assert 0 <= version <= 20
        assert tokens == quiet[version][p], (p, version)
    print(
        f"wait: {len(seen)} responses under 20 sends, {len(failures)} failed, versions "
        f"answered {sorted(labels)}, each equal to its version's quiet tokens"
    )
    assert len(labels) >= 5  # requests did run while versions changed
    assert len({tuple(q[0]) for q in quiet.values()}) >= 3  # versions answer differently


async def test_keep_continues_requests_on_the_new_version_and_their_spans_say_where(
    vllm_servers: list[Server],
) -> None:
    server = vllm_servers[0]
    seen: list[tuple[int, list[int], list[dict[str, object]]]] = []
    failures: list[BaseException] = []
    long = 128
    async with (
        http_client() as client,
        attached_trainer([server.url], pause="keep") as (scheme, model, servers),
    ):
        stop = asyncio.Event()
        askers = [
            asyncio.create_task(_keep_asking(client, server.url, stop, seen, failures, long))
            for _ in range(4)
        ]
        try:
            # At least 10 sends, and on until a response ran across a change (40 at most).
            for seed in range(1, 41):
                if seed > 10 and any(len(spans) > 1 for _, _, spans in seen):
                    break
                # Each send comes while the server is generating for a request: the pause finds
                # it part-way, however slow the host, and it continues on the new version.
                # (Should the server be seen generating at no look for a minute, the send goes
                # all the same: what is asserted is that some response spanned a change.)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(generating(client, server.url), 60)
                set_version(model, seed)
                await scheme.send(timeout=60)
        finally:
            stop.set()
            await asyncio.gather(*askers)
        assert failures == []
        firsts = {int(str(spans[0]["version"])) for _, _, spans in seen}
        quiet = await _quiet_tokens(scheme, model, client, server.url, firsts, long)

    changed = 0
    for p, tokens, spans in seen:
        versions = [int(str(s["version"])) for s in spans]
        assert all(0 <= v <= 40 for v in versions)
        assert versions == sorted(versions) and len(set(versions)) == len(versions)
        assert spans[0]["start"] == 0 and spans[-1]["end"] == len(tokens)
        assert all(a["end"] == b["start"] for a, b in itertools.pairwise(spans))
        # The tokens before the change are the old version's.
        end = int(str(spans[0]["end"]))
        assert tokens[:end] == quiet[versions[0]][p][:end], (p, versions)
        changed += len(spans) > 1
    most = max(len(spans) for _, _, spans in seen)
    print(f"keep: {len(seen)} responses, {changed} spanned a change, up to {most} versions in one")
    assert changed >= 1  # requests did continue across a change


async def test_the_servers_must_number_the_schemes_workers(vllm_servers: list[Server]) -> None:
    scheme = aiowsync.SharedMemWeightSyncScheme(heartbeats=BEATS)
    scheme.init_on_sender(model=trainer_model(), num_workers=3)
    servers = VLLMServers([s.url for s in vllm_servers])
    async with scheme:
        with pytest.raises(ValueError, match="2 workers in all") as info:
            async with servers.attach(scheme):
                pass
        assert all(f"{s.url}: 1" in str(info.value) for s in vllm_servers)


async def test_a_server_that_does_not_answer_is_named() -> None:
    scheme = aiowsync.SharedMemWeightSyncScheme(heartbeats=BEATS)
    scheme.init_on_sender(model={"w": torch.zeros(3)}, num_workers=1)
    url = "http://127.0.0.1:9"  # discard: nothing listens
    async with scheme:
        with pytest.raises(VLLMServerError, match=r"127\.0\.0\.1:9: get_world_size"):
            async with VLLMServers([url], timeout=5).attach(scheme):
                pass


@pytest.mark.parametrize("topology", ["star", "chain"])
async def test_over_torch_distributed_the_server_serves_the_same_tokens(
    vllm_servers: list[Server], topology: str
) -> None:
    """The bytes travel over gloo instead of shared memory: the same weights give the same
    tokens and the same checksums as over shared memory; both servers take part."""
    urls = [s.url for s in vllm_servers]
    model = trainer_model()
    set_version(model, 7)
    expected = {}
    shm = aiowsync.SharedMemWeightSyncScheme(heartbeats=BEATS)
    shm.init_on_sender(model=model, num_workers=2)
    async with http_client() as client:
        async with shm, VLLMServers(urls).attach(shm):
            await shm.connect(timeout=120)
            for url in urls:
                expected[url] = (
                    (await generate(client, url, PROMPTS[0]))[0],
                    await checksums(client, url),
                )
        set_version(model, 0)
        dist = aiowsync.DistributedWeightSyncScheme(
            backend="gloo", topology=topology, heartbeats=BEATS
        )
        dist.init_on_sender(model=model, num_workers=2)
        async with dist, VLLMServers(urls).attach(dist) as servers:
            await dist.connect(timeout=120)
            set_version(model, 7)
            result = await dist.send(timeout=60)
            assert result.retries == 0
            assert await servers.weight_versions() == dict.fromkeys(urls, str(result.version))
            for url in urls:
                tokens, spans = await generate(client, url, PROMPTS[0])
                assert [s["version"] for s in spans] == [str(result.version)]
                assert (tokens, await checksums(client, url)) == expected[url]
