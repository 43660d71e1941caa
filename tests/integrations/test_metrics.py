"""aiowsync.metrics: a real sender of four worker processes scraped over HTTP, its figures
checked against the sends' results; the receivers' metrics, refusals, departures and failures
on the in-process twins."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from torch import nn

import aiowsync
from _workers import connect_all, make_model, workers
from helpers import CONNECT, Kind, System, bump, eventually, fill, model

MISSING = [m for m in ("prometheus_client", "httpx") if importlib.util.find_spec(m) is None]

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        bool(MISSING) and not os.environ.get("AIOWSYNC_REQUIRE_EXTRAS"),
        reason=f"not installed: {MISSING} (the metrics and dev extras)",
    ),
]

if not MISSING:
    import httpx
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from aiowsync.metrics import export, serve
    from aiowsync.metrics._tally import Histogram

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(page: str) -> Samples:
    """Every sample of an exposition page: (name, labels) to value."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: Any) -> float | None:
    return samples.get((name, frozenset((k, str(v)) for k, v in labels.items())))


def scrape(registry: CollectorRegistry) -> Samples:
    return parse(generate_latest(registry).decode())


def trimmed(page: str) -> str:
    """The page without its HELP lines and with the finite buckets of each histogram left
    out but one (what the report shows)."""
    keep = []
    for line in page.splitlines():
        bucket = "_bucket{" in line and not ('le="0.05"' in line or 'le="+Inf"' in line)
        if line.startswith("# HELP") or bucket:
            continue
        keep.append(line)
    return "\n".join(keep)


# -- a real sender, four worker processes, a real HTTP server -----------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_the_page_of_a_sender_of_four_workers_agrees_with_its_send_results() -> None:
    n, sends = 4, 20
    scheme = aiowsync.SharedMemWeightSyncScheme(model_id="policy")
    src = make_model("small")
    scheme.init_on_sender(model=src, num_workers=n)
    registry = CollectorRegistry()
    with workers() as w, export(scheme, registry), serve(0, registry=registry) as server:
        async with scheme:
            for i in range(n):
                w.start(i, "small", scheme=scheme, digests=False)
            await connect_all(scheme, w, n)
            results = []
            for step in range(1, sends + 1):
                fill(src, float(step))
                results.append(await scheme.send(timeout=30))
            async with httpx.AsyncClient() as client:
                response = await client.get(server.url, timeout=10)
    assert response.status_code == 200
    page = response.text
    print(f"\n{server.url} after {sends} sends to {n} workers:\n{trimmed(page)}")
    got = parse(page)
    m = {"model_id": "policy"}

    assert [r.version for r in results] == list(range(1, sends + 1))
    assert all(r.worker_ids == tuple(range(n)) for r in results)
    for name, of in (("send_seconds", "seconds"), ("send_stage_seconds", "stage_seconds")):
        durations = [getattr(r, of) for r in results]
        assert value(got, f"aiowsync_{name}_count", **m) == sends
        assert value(got, f"aiowsync_{name}_sum", **m) == pytest.approx(sum(durations))
        for bound in aiowsync.metrics.DEFAULT_BUCKETS:
            within = sum(d <= bound for d in durations)
            assert value(got, f"aiowsync_{name}_bucket", le=repr(bound), **m) == within
        assert value(got, f"aiowsync_{name}_bucket", le="+Inf", **m) == sends
    assert value(got, "aiowsync_sent_bytes_total", **m) == sum(r.nbytes for r in results)
    assert value(got, "aiowsync_send_retries_total", **m) == sum(r.retries for r in results) == 0
    assert value(got, "aiowsync_sender_version", **m) == results[-1].version == sends
    assert value(got, "aiowsync_sender_serving", **m) == 1
    assert value(got, "aiowsync_workers", state="ready", **m) == n
    assert not [s for s in got if s[0] == "aiowsync_send_failures_total"]
    for worker in range(n):
        at = {**m, "worker": worker}
        assert value(got, "aiowsync_worker_version", **at) == sends
        assert value(got, "aiowsync_worker_lag", **at) == 0
        assert value(got, "aiowsync_worker_state", aiowsync_worker_state="ready", **at) == 1
        assert value(got, "aiowsync_worker_refused", **at) == 0
        assert value(got, "aiowsync_worker_retries_total", **at) == 0
        assert value(got, "aiowsync_digest_failures_total", **at) == 0
    assert not registry.get_sample_value("aiowsync_sender_version", m)  # closed: gone


# -- in one process -----------------------------------------------------------------------


@pytest.fixture
def memory() -> Kind:
    return Kind("memory")


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    yield CollectorRegistry()


async def test_a_receiver_reports_its_version_leases_and_its_sender_leaving(
    memory: Kind, registry: CollectorRegistry
) -> None:
    async with memory.system(2) as rig:
        sender, (r0, _), (r1, _) = rig.sender, rig[0], rig[1]
        export(sender, registry)
        export(r0, registry)
        export(r1, registry, count_applied=False)
        assert r1._hooks == []  # its fast path is kept
        for _ in range(3):
            bump(rig.src)
            await sender.send(timeout=CONNECT)
        got = scrape(registry)
        at = {"model_id": sender.model_id, "worker": 0}
        assert value(got, "aiowsync_receiver_version", **at) == 3
        assert value(got, "aiowsync_receiver_generation", **at) == 0
        assert value(got, "aiowsync_receiver_versions_applied_total", **at) == 3
        assert value(got, "aiowsync_receiver_connected", **at) == 1
        assert value(got, "aiowsync_receiver_ready", **at) == 1
        assert value(got, "aiowsync_receiver_leased_versions", **at) == 0
        assert value(got, "aiowsync_receiver_versions_applied_total", **{**at, "worker": 1}) is None
        assert value(got, "aiowsync_receiver_version", **{**at, "worker": 1}) == 3
        async with r0.lease() as held:
            assert held.version == 3
            bump(rig.src)
            await sender.send(timeout=CONNECT)  # reports the lease on its answer
            got = scrape(registry)
            assert value(got, "aiowsync_receiver_leased_versions", **at) == 1
            assert value(got, "aiowsync_worker_leased_versions", **at) == 1
            assert value(got, "aiowsync_receiver_versions_applied_total", **at) == 4
        await rig.stop_sender()
        assert await eventually(
            lambda: value(scrape(registry), "aiowsync_receiver_connected", **at) == 0,
            what="the receiver reports its sender gone",
        )
        got = scrape(registry)
        assert value(got, "aiowsync_receiver_ready", **at) == 0
        assert value(got, "aiowsync_receiver_version", **at) == 4  # it keeps its version
        assert value(got, "aiowsync_sender_serving", model_id=sender.model_id) == 0


async def test_refused_and_departed_workers_and_failed_sends_are_counted(
    memory: Kind, registry: CollectorRegistry
) -> None:
    src = model(0)
    sender = memory.scheme()
    sender.init_on_sender(model=src, num_workers=3)
    export(sender, registry)
    rig = System(sender, src)
    try:
        await rig.enter(sender)
        for i in (0, 1):
            m = model(100 + i)
            rig.receivers.append((await rig.add(memory, i, m), m))
        ready = [r for r, _ in rig.receivers]
        misfit = await rig.add(memory, 2, nn.Linear(3, 3))
        await asyncio.gather(*(r.connect(timeout=CONNECT) for r in ready))
        with pytest.raises(aiowsync.RefusedError):
            await misfit.connect(timeout=CONNECT)
        m = {"model_id": sender.model_id}
        got = scrape(registry)
        assert value(got, "aiowsync_worker_refused", worker=2, **m) == 1
        assert value(got, "aiowsync_worker_refused", worker=0, **m) == 0
        assert value(got, "aiowsync_workers", state="never connected", **m) == 1
        assert value(got, "aiowsync_workers", state="ready", **m) == 2
        assert value(got, "aiowsync_worker_version", worker=2, **m) is None
        with pytest.raises(aiowsync.WorkerLostError):
            await sender.send(timeout=CONNECT)  # worker 2 is refused
        bump(src)
        await sender.send(worker_ids=[0, 1], timeout=CONNECT)
        ready[0].register_hook(lambda version: 1 / 0)
        bump(src)
        with pytest.raises(aiowsync.RemoteApplyError):
            await sender.send(worker_ids=[0, 1], timeout=CONNECT)
        await rig.leave(1)
        assert await eventually(
            lambda: value(scrape(registry), "aiowsync_workers", state="gone", **m) == 1,
            what="worker 1 reads as gone",
        )
        with pytest.raises(ValueError):
            await sender.send(worker_ids=[7])  # a caller's mistake: not counted
        got = scrape(registry)
        assert value(got, "aiowsync_send_failures_total", error="WorkerLostError", **m) == 1
        assert value(got, "aiowsync_send_failures_total", error="RemoteApplyError", **m) == 1
        assert value(got, "aiowsync_send_failures_total", error="ValueError", **m) is None
        assert value(got, "aiowsync_worker_nacks_total", worker=0, **m) == 1
        assert value(got, "aiowsync_worker_nacks_total", worker=1, **m) == 0
        assert value(got, "aiowsync_send_seconds_count", **m) == 1
        assert value(got, "aiowsync_sender_version", **m) == 2
        # Worker 0 holds version 1 (its hook failed at 2), worker 1 left at 2.
        assert value(got, "aiowsync_worker_lag", worker=0, **m) == 1
        assert value(got, "aiowsync_worker_state", aiowsync_worker_state="gone", worker=1, **m) == 1
    finally:
        await rig.close()


async def test_digest_failures_are_counted_by_worker(
    memory: Kind, registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with memory.system(2, sender_kw={"integrity": True}) as rig:
        sender = rig.sender
        export(sender, registry)
        plane = sender._sender.plane
        deliver = plane.deliver

        def corrupt(version: int, *args: Any, **kwargs: Any) -> Any:
            flat = plane.buffers_of(plane._slots.index_of(version))[0]
            flat[100] = flat[100] ^ 0x5A  # after the digest, before any receiver reads it
            return deliver(version, *args, **kwargs)

        monkeypatch.setattr(plane, "deliver", corrupt)
        bump(rig.src)
        with pytest.raises(aiowsync.RemoteApplyError, match="DigestMismatch"):
            await sender.send(timeout=CONNECT)
        monkeypatch.undo()
        bump(rig.src)
        await sender.send(timeout=CONNECT)
        got = scrape(registry)
        m = {"model_id": sender.model_id}
        for worker in (0, 1):
            assert value(got, "aiowsync_digest_failures_total", worker=worker, **m) == 1
            assert value(got, "aiowsync_worker_nacks_total", worker=worker, **m) == 1
            assert value(got, "aiowsync_worker_lag", worker=worker, **m) == 0
        assert value(got, "aiowsync_send_seconds_count", **m) == 1


async def test_published_versions_are_counted_once_known(
    memory: Kind, registry: CollectorRegistry
) -> None:
    async with memory.system(2) as rig:
        sender = rig.sender
        exporter = export(sender, registry)
        pending = []
        for _ in range(3):
            bump(rig.src)
            pending.append(await sender.publish(timeout=CONNECT))
        results = [await p for p in pending]
        m = {"model_id": sender.model_id}
        assert await eventually(
            lambda: value(scrape(registry), "aiowsync_send_seconds_count", **m) == 3,
            what="three published versions counted",
        )
        got = scrape(registry)
        assert value(got, "aiowsync_sent_bytes_total", **m) == sum(r.nbytes for r in results)
        exporter.close()
        exporter.close()
        assert scrape(registry) == {}
        bump(rig.src)
        await sender.send(timeout=CONNECT)
        assert sender._send_observers == []


async def test_export_refuses_what_it_cannot_tell_apart(
    memory: Kind, registry: CollectorRegistry
) -> None:
    with pytest.raises(RuntimeError, match="init_on_sender"):
        export(memory.scheme(), registry)
    async with memory.system(1) as rig:
        with export(rig.sender, registry), export(rig[0][0], registry):
            twin = memory.scheme(model_id=rig.sender.model_id)
            twin.init_on_sender(model=model(1), num_workers=1)
            with pytest.raises(ValueError, match="already exports"):
                export(twin, registry)
            with pytest.raises(ValueError, match="buckets"):
                export(twin, CollectorRegistry(), buckets=[1.0, 0.5])
            other = memory.scheme(model_id="critic")
            other.init_on_sender(model=model(1), num_workers=1)
            with export(other, registry):
                got = scrape(registry)
                assert value(got, "aiowsync_sender_version", model_id="critic") == -1  # not serving
                assert value(got, "aiowsync_sender_version", model_id=rig.sender.model_id) == 0
        assert rig[0][0]._hooks == []


def test_a_value_on_a_bound_counts_in_that_bucket() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.1, 0.5, 1.0, 3.0):
        h.observe(v)
    assert h.cumulative() == [("0.1", 1.0), ("1.0", 3.0), ("+Inf", 4.0)]
    assert h.count == 4 and h.total == pytest.approx(4.6)


def test_serve_listens_until_closed() -> None:
    registry = CollectorRegistry()
    with serve(0, registry=registry) as server:
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        assert httpx.get(server.url, timeout=10).status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url, timeout=2)


def test_import_aiowsync_loads_no_prometheus_client() -> None:
    code = (
        "import sys, aiowsync\n"
        "assert 'prometheus_client' not in sys.modules\n"
        "assert callable(aiowsync.metrics.export)\n"
        "assert 'prometheus_client' in sys.modules\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
