"""Leases: a reader keeps one version while the model moves on, on every plane (the in-process
twins, real shared memory, real gloo), in swap and copy mode, in this process."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch

import aiowsync
from helpers import (
    Kind,
    eventually,
    fill,
    frozen,
    model,
    policy_and_value,
    policy_net,
    same,
    sync_pair,
)

pytestmark = pytest.mark.timeout(90)

MODES = ["swap", "copy"]


def slots_by_version(sender: aiowsync.WeightSyncScheme) -> dict[int, int]:
    """The sender's slots that hold a version, by version (one model)."""
    plane: Any = sender._sender.plane  # type: ignore[attr-defined]
    table = plane._tables[""] if hasattr(plane, "_tables") else plane._slots
    return {s.version: i for i, s in enumerate(table) if s.version is not None}


@pytest.mark.parametrize("mode", MODES)
async def test_a_lease_keeps_its_version_across_five_sends_while_the_model_moves_on(
    kind: Kind, mode: str
) -> None:
    async with kind.system(2, apply_mode=mode) as rig_:
        r, m = rig_[0]
        fill(rig_.src, 1.0)
        await rig_.sender.send()
        leased_bytes = frozen(rig_.src)
        async with r.lease() as held:
            assert held.version == 1
            for v in range(2, 7):
                fill(rig_.src, float(v))
                result = await rig_.sender.send()
                assert result.version == v
                # The model runs the new version; the lease still reads version 1.
                assert same(m, frozen(rig_.src)) and r.version == v
                assert same(held.params(), leased_bytes), f"after version {v}"
            assert held.version == 1
            weights = held.weights
            assert weights.is_locked
            assert torch.equal(weights["0", "weight"], leased_bytes["0.weight"])
            # One call runs a forward on the leased version.
            x = torch.randn(3, 16)
            old = model(0)
            old.load_state_dict(leased_bytes)
            out = torch.func.functional_call(m, held.params(), (x,))
            assert torch.equal(out, old(x)) and not torch.equal(out, m(x))
            shared = kind.name != "dist" and mode == "swap"
            status = rig_.sender.workers[0]
            # Only a lease that reads the sender's memory pins anything there.
            assert status.leased == ((1,) if shared else ())
        with pytest.raises(RuntimeError, match="not held"):
            _ = held.version
        if kind.name == "dist":
            return  # its slots are the sender's private copies: no lease reads them
        await eventually(
            lambda: rig_.sender.workers[0].leased == (),
            what="the lease's end reported",
            within=10.0,
        )
        for v in range(7, 10):
            fill(rig_.src, float(v))
            await rig_.sender.send()
        # The slot that held version 1 took a newer version once the lease ended.
        assert 1 not in slots_by_version(rig_.sender)
        assert len(slots_by_version(rig_.sender)) <= 3


@pytest.mark.parametrize("name", ["memory", "shm"])
async def test_leases_that_exhaust_max_slots_are_refused_naming_the_worker(name: str) -> None:
    kind = Kind(name)
    plane = (
        aiowsync.MemoryPlane(num_slots=2, max_slots=3)
        if name == "memory"
        else aiowsync.SharedMemPlane(num_slots=2, max_slots=3)
    )
    async with kind.system(2, plane=plane) as rig_:
        r, _ = rig_[1]
        async with r.lease() as first:
            fill(rig_.src, 1.0)
            await rig_.sender.send()
            async with r.lease() as second:
                assert (first.version, second.version) == (0, 1)
                fill(rig_.src, 2.0)
                await rig_.sender.send()  # versions 0 and 1 leased, 2 live: three slots
                fill(rig_.src, 3.0)
                # A lease may end: the send waits for that until its stage deadline.
                with pytest.raises(aiowsync.SlotsFull) as info:
                    await rig_.sender.send(timeout=1.0)
                text = str(info.value)
                assert "all 3 " in text and "slots hold versions still in use" in text
                assert (
                    "worker 1 holds a lease on version 0 (its oldest; it leases versions "
                    "[0, 1]): a leased version keeps its slot until its last lease ends "
                    "(waited 1."
                ) in text
                assert info.value.version is None
                assert rig_.sender.workers[1].leased == (0, 1)
                assert rig_.versions() == [2, 2]  # nothing moved
        # Sent right after the leases ended, before the worker's report of it may have come:
        # the send waits for the report rather than failing.
        result = await rig_.sender.send()
        assert result.version == 3 and rig_.versions() == [3, 3]
        assert rig_.sender.workers[1].leased == ()


@pytest.mark.parametrize("name", ["memory", "shm"])
async def test_a_send_with_every_slot_leased_waits_for_a_lease_to_end(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    kind = Kind(name)
    plane = (
        aiowsync.MemoryPlane(num_slots=2, max_slots=3)
        if name == "memory"
        else aiowsync.SharedMemPlane(num_slots=2, max_slots=3)
    )
    caplog.set_level("WARNING", logger="aiowsync.sender")
    async with kind.system(2, plane=plane) as rig_:
        r, _ = rig_[1]
        first = await r.lease().__aenter__()
        fill(rig_.src, 1.0)
        await rig_.sender.send()
        async with r.lease() as second:
            fill(rig_.src, 2.0)
            await rig_.sender.send()  # versions 0 and 1 leased, 2 live: three slots
            fill(rig_.src, 3.0)
            sending = asyncio.create_task(rig_.sender.send(timeout=60))
            await eventually(lambda: "no slot is free for version 3" in caplog.text, within=20)
            assert not sending.done()
            assert (first.version, second.version) == (0, 1)
            await first.__aexit__(None, None, None)  # version 0 is free once this is reported
            result = await asyncio.wait_for(sending, 30)
        assert result.version == 3 and rig_.versions() == [3, 3]
        warnings = [m for m in caplog.messages if m.startswith("no slot is free")]
        assert warnings == [
            "no slot is free for version 3: every slot holds a version still in use [0, 1, 2]; "
            + warnings[0].split("; ", 1)[1]
        ]
        assert "to be released (worker 1 holds a lease on it)" in warnings[0]


async def test_leases_of_one_version_share_one_copy_in_copy_mode(kind: Kind) -> None:
    async with kind.system(1, apply_mode="copy") as rig_:
        r, _ = rig_[0]
        async with r.lease() as a, r.lease() as b:
            assert a.version == b.version == 0
            pa, pb = a.params(), b.params()
            assert all(pa[k].data_ptr() == pb[k].data_ptr() for k in pa)
            # A copy of its own: not the model's memory, which the next switch rewrites.
            mine = dict(r._receiver.applier._targets)  # type: ignore[attr-defined]
            assert all(pa[k].data_ptr() != mine[k].data_ptr() for k in pa)
        async with r.lease() as c:
            assert c.version == 0
            assert c.params()["0.weight"].data_ptr() != pa["0.weight"].data_ptr()


@pytest.mark.parametrize("mode", MODES)
async def test_ending_one_of_two_leases_of_a_version_leaves_the_other_its_bytes(
    kind: Kind, mode: str
) -> None:
    # Two readers lease the same version; the first lets go, the model moves on twice (slots
    # are reused, copies made): the second still reads exactly the version it leased.
    async with kind.system(1, apply_mode=mode) as rig_:
        r, _ = rig_[0]
        fill(rig_.src, 1.0)
        await rig_.sender.send()
        leased = frozen(rig_.src)
        async with r.lease() as second:
            async with r.lease() as first:
                assert first.version == second.version == 1
            for v in (2, 3, 4):
                fill(rig_.src, float(v))
                assert (await rig_.sender.send()).version == v
                assert same(second.params(), leased), f"after version {v}"
            assert second.version == 1


async def test_a_lease_in_a_thread_reads_one_version_while_sends_go_on(kind: Kind) -> None:
    async with kind.system(1) as rig_:
        r, m = rig_[0]
        taken = threading.Event()
        finish = threading.Event()
        seen: list[tuple[int, set[float]]] = []

        def reader() -> None:
            with r.lease() as held:
                taken.set()
                while not finish.is_set():
                    flat = torch.cat([t.reshape(-1) for t in held.params().values()])
                    seen.append((held.version, set(flat.unique().tolist())))
                    time.sleep(0.001)

        fill(rig_.src, 7.0)
        await rig_.sender.send()
        thread = threading.Thread(target=reader)
        thread.start()
        try:
            await asyncio.get_running_loop().run_in_executor(None, taken.wait, 10)
            for v in range(2, 6):
                fill(rig_.src, float(10 * v))
                await rig_.sender.send()
                assert same(m, frozen(rig_.src))
        finally:
            finish.set()
            thread.join(10)
        assert seen and all(s == (1, {7.0}) for s in seen), seen[:3]


async def test_a_lease_covers_every_model_of_a_scheme() -> None:
    async with policy_and_value(Kind("shm"), 1) as (sender, models, receivers):
        r, mine = receivers[0]
        sent = {n: frozen(m) for n, m in models.items()}
        async with r.lease() as held:
            with torch.no_grad():
                for t in models["value"].parameters():
                    t.add_(1)
            await sender.send(weights={"value": models["value"]})
            assert held.version == 0 and r.version == 1
            assert same(held.params("policy"), sent["policy"])
            assert same(held.params("value"), sent["value"])
            assert torch.equal(held.weights["value", "0", "weight"], sent["value"]["0.weight"])
            x = torch.randn(2, 8)
            out = torch.func.functional_call(mine["policy"], held.params("policy"), (x,))
            reference = policy_net(0)
            assert torch.equal(out, reference(x))
            with pytest.raises(KeyError, match="critic"):
                held.params("critic")


async def test_a_lease_outlives_its_receiver_with_the_same_bytes() -> None:
    kind = Kind("shm")
    async with kind.system(2) as rig_:
        r, _ = rig_[0]
        fill(rig_.src, 3.0)
        await rig_.sender.send()
        leased_bytes = frozen(rig_.src)
        lease = r.lease()
        held = await lease.__aenter__()
        try:
            await rig_.leave(0)  # the receiver says goodbye with the lease still held
            for v in range(4, 9):  # two slots go round and round for worker 1
                fill(rig_.src, float(v))
                await rig_.sender.send(worker_ids=[1])
            assert same(held.params(), leased_bytes)
        finally:
            await lease.__aexit__(None, None, None)
        with pytest.raises(aiowsync.NotConnectedError, match="closed"):
            async with r.lease():
                pass


async def test_leases_are_refused_where_they_cannot_be() -> None:
    kind = Kind("memory")
    sender = kind.scheme()
    sender.init_on_sender(model=model(0), num_workers=1)
    with pytest.raises(RuntimeError, match="leases are taken on receivers"):
        sender.lease()
    receiver = kind.scheme("mem://999")
    receiver.init_on_receiver(model=model(1), worker_idx=0)
    with pytest.raises(RuntimeError, match="connected receiver"):
        receiver.lease()
    async with kind.system(1) as rig_:
        r, _ = rig_[0]
        lease = r.lease()
        async with lease:
            with pytest.raises(RuntimeError, match="already held"):
                async with lease:
                    pass


def test_a_blocking_receiver_takes_leases_with_a_plain_with() -> None:
    sender, src, r, _ = sync_pair()
    with aiowsync.blocking(sender) as s, aiowsync.blocking(r) as w:
        w.connect(timeout=30)
        s.connect(timeout=30)
        fill(src, 5.0)
        s.send(timeout=30)
        with w.lease() as held:
            fill(src, 6.0)
            s.send(timeout=30)
            assert held.version == 1 and w.version == 2
            assert {t.unique().item() for t in held.params().values()} == {5.0}


@pytest.mark.parametrize("mode", ["swap", "copy"])
async def test_a_worker_cannot_lease_more_versions_than_a_report_carries(mode: str) -> None:
    # In swap mode each leased version pins a slot of the sender's; in copy mode, a copy of
    # the whole model in the worker's memory: the same cap and the same error for both.
    from aiowsync._protocol import MAX_LEASED

    kind = Kind("memory")
    plane = aiowsync.MemoryPlane(num_slots=2, max_slots=MAX_LEASED + 4)
    async with kind.system(1, plane=plane, apply_mode=mode) as rig_:
        r, _ = rig_[0]
        leases = []
        try:
            for _ in range(MAX_LEASED):
                lease = r.lease()
                await lease.__aenter__()
                leases.append(lease)
                await rig_.sender.send()
            held = tuple(range(MAX_LEASED)) if mode == "swap" else ()  # copies pin nothing
            assert rig_.sender.workers[0].leased == held
            with pytest.raises(aiowsync.WeightSyncError, match=f"already hold {MAX_LEASED}"):
                async with r.lease():
                    pass
        finally:
            for lease in leases:
                await lease.__aexit__(None, None, None)
        async with r.lease() as held:
            assert held.version == MAX_LEASED
