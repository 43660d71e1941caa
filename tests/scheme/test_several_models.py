"""Several models in one scheme, sends of some of them, and a wire dtype: on every plane (the
in-process twins, real shared memory, real gloo), in this process."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import aiowsync
from helpers import (
    CONNECT,
    Kind,
    fill,
    frozen,
    policy_and_value,
    policy_net,
    same,
    serving,
    value_net,
)

pytestmark = pytest.mark.timeout(90)


async def test_one_version_covers_every_model_and_hooks_run_once_per_switch(kind: Kind) -> None:
    async with policy_and_value(kind) as (sender, models, receivers):
        assert (
            set(sender.models) == {"policy", "value"} and sender.models["value"] is models["value"]
        )
        switches: list[int] = []
        receivers[0][0].register_hook(switches.append)
        for r, mine in receivers:
            assert set(r.models) == {"policy", "value"} and r.models["policy"] is mine["policy"]
            assert same(mine["policy"], frozen(models["policy"]))
            assert same(mine["value"], frozen(models["value"]))
        fill(models["policy"], 1.0)
        fill(models["value"], 2.0)
        result = await sender.send()
        assert result.version == 1 and result.worker_ids == (0, 1)
        for _, mine in receivers:
            assert same(mine["policy"], frozen(models["policy"]))
            assert same(mine["value"], frozen(models["value"]))
        assert switches == [1]  # once per switch, not once per model
        # Every model given, as weights: a full send of those weights.
        given = {
            k: {n: torch.full_like(t, 3.0) for n, t in m.state_dict().items()}
            for k, m in models.items()
        }
        assert (await sender.send(weights=given)).version == 2
        assert all(same(mine[k], given[k]) for _, mine in receivers for k in given)


async def test_a_send_of_some_models_moves_those_and_the_others_keep_their_bytes(
    kind: Kind,
) -> None:
    async with policy_and_value(kind) as (sender, models, receivers):
        fill(models["policy"], 1.0)
        fill(models["value"], 1.0)
        every = (await sender.send()).nbytes
        sent_policy = frozen(models["policy"])
        # The trainer changes both, but sends the value net alone (as a TensorDict).
        fill(models["policy"], 5.0)
        new_value = TensorDict.from_module(value_net(7)).apply(lambda t: t.detach().clone())
        result = await sender.send(weights={"value": new_value})
        assert result.version == 2
        # It counts the value net's bytes (padding included), not the policy's it left alone.
        payload = {n: sum(t.nbytes for t in m.state_dict().values()) for n, m in models.items()}
        assert payload["value"] <= result.nbytes <= every - payload["policy"]
        for r, mine in receivers:
            assert r.version == 2
            assert same(mine["policy"], sent_policy)  # v1's bytes, not the trainer's 5.0
            assert same(mine["value"], frozen(value_net(7)))
        # Again, a few times: slots are reused, and still only the value net changes.
        for step in range(3, 7):
            new_value = {
                k: torch.full_like(t, float(step)) for k, t in value_net(0).state_dict().items()
            }
            assert (await sender.send(weights={"value": new_value})).version == step
            for _, mine in receivers:
                assert same(mine["policy"], sent_policy) and same(mine["value"], new_value)
        # A full send brings the trainer's policy again.
        await sender.send()
        assert all(same(mine["policy"], frozen(models["policy"])) for _, mine in receivers)


async def test_digests_cover_every_model_of_a_version_those_carried_too(kind: Kind) -> None:
    # The sender digests the version as receivers will hold it: the models a partial send
    # carries come from the slots of earlier versions, and a digest that missed them (or
    # took another version's) would make every receiver refuse the send.
    async with policy_and_value(kind, integrity=True) as (sender, models, receivers):
        fill(models["value"], 1.0)
        await sender.send()
        for step in range(2, 6):
            fill(models["policy"], float(step))
            result = await sender.send(weights={"policy": models["policy"].state_dict()})
            assert result.version == step and result.worker_ids == (0, 1)
            for _, mine in receivers:
                assert same(mine["policy"], frozen(models["policy"]))
                assert same(mine["value"], frozen(models["value"]))


async def test_sends_that_do_not_fit_are_refused_before_a_byte_moves(kind: Kind) -> None:
    async with policy_and_value(kind) as (sender, models, receivers):
        before = [(frozen(m["policy"]), frozen(m["value"])) for _, m in receivers]
        with pytest.raises(ValueError) as unknown:
            await sender.send(weights={"value": models["value"], "critic": models["value"]})
        assert str(unknown.value) == (
            "unknown model id(s) ['critic']: this scheme holds 'policy', 'value'"
        )
        with pytest.raises(aiowsync.LayoutMismatchError) as wrong:
            await sender.send(weights={"value": value_net(3, width=17)})
        assert str(wrong.value) == (
            "weights do not match the layout:\n"
            "  model 'value', key 0.bias: expected float32[16], got float32[17]\n"
            "  model 'value', key 0.weight: expected float32[16, 8], got float32[17, 8]\n"
            "  model 'value', key 2.weight: expected float32[1, 16], got float32[1, 17]"
        )
        with pytest.raises(TypeError, match="keyed by model id"):
            await sender.send(weights=[1, 2])  # type: ignore[arg-type]
        assert sender.version == 0
        for (r, m), (p, v) in zip(receivers, before, strict=True):
            assert r.version == 0 and same(m["policy"], p) and same(m["value"], v)


async def test_a_receiver_whose_value_net_differs_is_refused_naming_the_model(
    kind: Kind,
) -> None:
    models = {"policy": policy_net(0), "value": value_net(1)}
    sender = kind.scheme()
    sender.init_on_sender(models=models, num_workers=1)
    async with serving(sender):
        r = kind.scheme(sender.address, plane=sender.plane)
        r.init_on_receiver(
            models={"policy": policy_net(2), "value": value_net(3, width=17)}, worker_idx=0
        )
        async with r:
            with pytest.raises(aiowsync.RefusedError) as info:
                await r.connect(timeout=CONNECT)
        assert info.value.reason == (
            "the receiver's model does not match the sender's:\n"
            "  model 'value', key 0.bias: expected float32[16], got float32[17]\n"
            "  model 'value', key 0.weight: expected float32[16, 8], got float32[17, 8]\n"
            "  model 'value', key 2.weight: expected float32[1, 16], got float32[1, 17]"
        )
        one = kind.scheme(sender.address, plane=sender.plane)
        one.init_on_receiver(model=policy_net(4), worker_idx=0)
        async with one:
            with pytest.raises(aiowsync.RefusedError) as single:
                await one.connect(timeout=CONNECT)
        assert single.value.reason == "this sender serves model 'policy+value', not 'policy'"


async def test_a_wire_dtype_halves_the_bytes_and_each_worker_holds_the_cast_values(
    kind: Kind,
) -> None:
    def halves(i: int) -> dict[str, nn.Module]:
        # Worker 0 runs bf16 (swap onto the bf16 slots); worker 1 fp32 (copies with a cast).
        mine = {"policy": policy_net(100 + i), "value": value_net(200 + i)}
        return {k: m.to(torch.bfloat16) for k, m in mine.items()} if i == 0 else mine

    each = {0: {"models_of": halves}, 1: {"models_of": halves}}
    async with policy_and_value(kind, each=each, wire_dtype=torch.bfloat16) as (
        sender,
        models,
        receivers,
    ):
        with torch.no_grad():
            for m in models.values():
                for t in m.parameters():
                    t.copy_(torch.randn_like(t))
        result = await sender.send()
        # What travels: floats in 2 bytes instead of 4, integers as they are.
        wire = aiowsync.Layout.from_weights(models, sectioned=True, wire_dtype=torch.bfloat16)
        own = aiowsync.Layout.from_weights(models, sectioned=True)
        assert result.nbytes == wire.total_bytes
        ints = sum(t.nbytes for m in models.values() for t in m.buffers())
        assert wire.payload_bytes - ints == (own.payload_bytes - ints) // 2
        for i, (r, mine) in enumerate(receivers):
            assert r._receiver.apply_mode == ("swap" if i == 0 else "copy")
            for name, m in models.items():
                for key, t in m.state_dict().items():
                    got = mine[name].state_dict()[key]
                    if t.is_floating_point():
                        want = t.to(torch.bfloat16).to(got.dtype)
                        assert got.dtype == (torch.bfloat16 if i == 0 else torch.float32)
                    else:
                        want = t  # integers travel as they are
                    assert torch.equal(got, want), (i, name, key)


def test_bad_wire_dtypes_and_swaps_that_cannot_be_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError) as info:
        aiowsync.SharedMemWeightSyncScheme(wire_dtype=torch.int8)
    assert str(info.value) == (
        "wire_dtype must be a floating torch dtype (torch.bfloat16, torch.float16, ...), "
        "got torch.int8"
    )
    r = aiowsync.SharedMemWeightSyncScheme(
        address="ipc://@x", wire_dtype=torch.bfloat16, apply_mode="swap"
    )
    with pytest.raises(ValueError) as swap:
        r.init_on_receiver(models={"policy": policy_net(0)}, worker_idx=0)
    assert str(swap.value) == (
        "apply_mode='swap' needs the model to hold the wire dtype torch.bfloat16, and "
        "policy.0.bias is torch.float32; use apply_mode='copy' (or 'auto', which picks it) "
        "to copy each version with a cast"
    )
    # A window maps one slot file: several models would be re-bound read only, silently.
    remap = aiowsync.SharedMemWeightSyncScheme(address="ipc://@x", switch="remap")
    with pytest.raises(ValueError, match="switch='remap' maps one model's slot file"):
        remap.init_on_receiver(models={"policy": policy_net(0)}, worker_idx=0)
    copying = aiowsync.SharedMemWeightSyncScheme(
        address="ipc://@x", switch="remap", apply_mode="copy"
    )
    copying.init_on_receiver(models={"policy": policy_net(0)}, worker_idx=0)  # no window needed
    s = aiowsync.SharedMemWeightSyncScheme()
    with pytest.raises(ValueError, match=r"model id 'a\.b' must be"):
        s.init_on_sender(models={"a.b": policy_net(0)}, num_workers=1)
    with pytest.raises(ValueError, match="give models= alone"):
        s.init_on_sender(model=policy_net(0), models={"a": policy_net(0)}, num_workers=1)
    with pytest.raises(ValueError, match=r"give models= without model_id=.*'a'"):
        s.init_on_sender(models={"a": policy_net(0)}, model_id="mine", num_workers=1)
    s.register_hook(lambda version: None)  # hooks run on receivers: a sender refuses them
    with pytest.raises(RuntimeError, match="hooks run on receivers"):
        s.init_on_sender(models={"a": policy_net(0)}, num_workers=1)


@pytest.mark.parametrize("name", ["shm", "dist"])
async def test_a_model_not_sent_stays_where_it_is(name: str) -> None:
    """A send of some models writes (shared memory) or receives (torch.distributed) those
    only: in swap mode, the other models' tensors keep pointing at the very bytes they
    pointed at (nothing was copied), also when the models are sent in turn."""
    async with policy_and_value(Kind(name)) as (sender, models, receivers):
        r, mine = receivers[0]
        assert r._receiver.apply_mode == "swap"

        def where(name: str) -> list[int]:
            return [t.data_ptr() for t in mine[name].parameters()]

        fill(models["policy"], 1.0)
        await sender.send()
        for step in range(2, 8):
            name = "policy" if step % 2 else "value"
            other = "value" if name == "policy" else "policy"
            kept, moved = where(other), where(name)
            fill(models[name], float(step))
            await sender.send(weights={name: models[name]})
            assert where(other) == kept, f"step {step}: {other} was rewritten"
            assert where(name) != moved
            assert same(mine[name], frozen(models[name]))


async def test_a_receiver_without_the_senders_wire_dtype_is_told_so() -> None:
    kind = Kind("memory")
    sender = kind.scheme(wire_dtype=torch.bfloat16)
    sender.init_on_sender(model=policy_net(0), num_workers=1)
    async with serving(sender):
        r = kind.scheme(sender.address, plane=sender.plane)  # built from the address alone
        r.init_on_receiver(model=policy_net(1), worker_idx=0)
        async with r:
            with pytest.raises(aiowsync.RefusedError) as info:
                await r.connect(timeout=CONNECT)
        assert info.value.reason == (
            "the receiver's model does not match the sender's (floating tensors travel as "
            "bfloat16, the sender's wire_dtype; a receiver built from an address must be given "
            "the same):\n"
            "  0.bias: expected bfloat16[16], got float32[16]\n"
            "  0.weight: expected bfloat16[16, 8], got float32[16, 8]\n"
            "  2.bias: expected bfloat16[4], got float32[4]\n"
            "  2.weight: expected bfloat16[4, 16], got float32[4, 16]"
        )


@pytest.mark.parametrize("mode", ["swap", "copy"])
async def test_no_reader_sees_one_model_at_one_version_and_another_at_the_next(
    kind: Kind, mode: str
) -> None:
    """Readers on the loop (across an await, under the guard) and in threads (under the
    guard) read both models; every value they see must be the version's number, in both."""
    sends = 20
    async with policy_and_value(kind, apply_mode=mode) as (sender, models, receivers):
        assert all(r._receiver.apply_mode == mode for r, _ in receivers)
        stop = threading.Event()
        mixed: list[str] = []
        seen: list[set[float]] = [set(), set()]

        def check(r: aiowsync.WeightSyncScheme, parts: list[torch.Tensor], who: str) -> float:
            found = set(torch.cat([t.reshape(-1).float() for t in parts]).unique().tolist())
            if found != {float(r.version)}:
                mixed.append(f"{who}: values {sorted(found)} at version {r.version}")
            return min(found)

        def params(mine: dict[str, nn.Module]) -> list[torch.Tensor]:
            return [t for name in ("policy", "value") for t in mine[name].parameters()]

        async def loop_reader(i: int) -> None:
            r, mine = receivers[i]
            while not stop.is_set():
                async with r.read_guard():
                    first = [t.clone() for t in mine["policy"].parameters()]
                    await asyncio.sleep(0)  # the value net is read after a pause
                    rest = [t.clone() for t in mine["value"].parameters()]
                    seen[i].add(check(r, first + rest, "loop"))
                await asyncio.sleep(0.001)

        def thread_reader(i: int) -> None:
            r, mine = receivers[i]
            while not stop.is_set():
                with r.read_guard():
                    seen[i].add(check(r, params(mine), "thread"))
                time.sleep(0.001)

        for m in models.values():
            fill(m, 1.0)
        await sender.send()
        readers = [asyncio.create_task(loop_reader(i)) for i in range(2)]
        threads = [threading.Thread(target=thread_reader, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        try:
            for version in range(2, sends + 2):
                for m in models.values():
                    fill(m, float(version))
                result = await sender.send()
                assert result.version == version and result.worker_ids == (0, 1)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=10)
            await asyncio.gather(*readers)
        assert not mixed, mixed[:5]
        assert all(len(s) > 1 for s in seen), "the readers saw only one version"


@pytest.mark.parametrize("mode", ["swap", "copy"])
async def test_a_worker_left_out_of_a_send_gets_what_it_lacks_with_the_next_partial_one(
    kind: Kind, mode: str
) -> None:
    async with policy_and_value(kind, apply_mode=mode) as (sender, models, receivers):
        for m in models.values():
            fill(m, 1.0)
        await sender.send()
        for m in models.values():
            fill(m, 2.0)
        await sender.send(worker_ids=[0])  # worker 1 stays on version 1
        policy_v2 = frozen(models["policy"])
        fill(models["value"], 3.0)
        result = await sender.send(weights={"value": models["value"]})
        assert result.version == 3 and result.worker_ids == (0, 1)
        for _, mine in receivers:
            # Worker 1 never got version 2: its policy comes with version 3 all the same.
            assert same(mine["policy"], policy_v2)
            assert same(mine["value"], frozen(models["value"]))
        # More sends of one model or the other, in turn, to everyone.
        for step in range(4, 8):
            name = "policy" if step % 2 else "value"
            fill(models[name], float(step))
            assert (await sender.send(weights={name: models[name]})).version == step
            for _, mine in receivers:
                assert same(mine[name], frozen(models[name]))


async def test_model_ids_that_are_module_attributes_work_too() -> None:
    kind = Kind("memory")
    models = {"training": policy_net(0), "eval": value_net(1)}
    sender = kind.scheme()
    sender.init_on_sender(models=models, num_workers=1)
    async with serving(sender):
        mine = {"training": policy_net(2), "eval": value_net(3)}
        r = kind.scheme(sender.address, plane=sender.plane)
        r.init_on_receiver(models=mine, worker_idx=0)
        async with r:
            await asyncio.gather(sender.connect(timeout=CONNECT), r.connect(timeout=CONNECT))
            fill(models["eval"], 4.0)
            await sender.send(weights={"eval": models["eval"]})
            assert same(mine["eval"], frozen(models["eval"]))
            assert same(mine["training"], frozen(models["training"]))


@pytest.mark.parametrize("name", ["shm", "dist"])
async def test_models_that_share_a_trunk_connect_and_follow_every_version(name: str) -> None:
    """An actor and a critic on one trunk: each side lists the trunk under both models."""

    def actor_critic(seed: int) -> dict[str, nn.Module]:
        torch.manual_seed(seed)
        trunk = nn.Linear(4, 8)
        return {
            "policy": nn.Sequential(trunk, nn.Linear(8, 2)),
            "value": nn.Sequential(trunk, nn.Linear(8, 1)),
        }

    kind = Kind(name)
    models = actor_critic(0)
    sender = kind.scheme()
    sender.init_on_sender(models=models, num_workers=1)
    async with serving(sender):
        mine = actor_critic(1)
        r = kind.scheme(sender.address, plane=sender.plane)
        r.init_on_receiver(models=mine, worker_idx=0)
        async with r:
            await asyncio.gather(sender.connect(timeout=CONNECT), r.connect(timeout=CONNECT))
            for step in (1, 2):
                fill(models["policy"], float(step))  # the trunk too
                assert (await sender.send(timeout=CONNECT)).version == step
                for model_id in models:
                    assert same(mine[model_id], frozen(models[model_id]))
            assert mine["policy"][0].weight is mine["value"][0].weight
            # A send of one of them would leave the other's trunk behind, and the worker
            # holds one trunk. Before, it ran the new head on the old trunk, without a word.
            fill(models["policy"], 3.0)
            with pytest.raises(ValueError, match="'policy' and 'value' share tensors"):
                await sender.send(weights={"policy": models["policy"]}, timeout=CONNECT)
            assert sender.version == 2
            both = {k: m.state_dict() for k, m in models.items()}
            assert (await sender.send(weights=both, timeout=CONNECT)).version == 3
            assert all(same(mine[k], frozen(models[k])) for k in models)


@pytest.mark.parametrize("max_slots", [None, 2])
async def test_models_sent_one_at_a_time_round_and_round_never_use_up_the_slots(
    kind: Kind, max_slots: int | None
) -> None:
    """Four models, each sent alone in turn (then all): every worker holds each model's latest
    bytes, and a send never finds the slots full."""
    # Before, on torch.distributed: a version's models stayed in the slots of the sends that
    # wrote them, so after a send of each model alone the latest version lay in four slots,
    # all there are by default (two with max_slots=2 and two models), and every send after
    # that, full ones too, raised SlotsFull.

    def four(seed: int) -> dict[str, nn.Module]:
        torch.manual_seed(seed)
        return {f"m{i}": nn.Linear(3, 3) for i in range(4 if max_slots is None else 2)}

    extra = {} if max_slots is None else {"max_slots": max_slots}
    models = four(0)
    sender = kind.scheme(integrity=True, plane=kind.plane(**extra))
    sender.init_on_sender(models=models, num_workers=1)
    async with serving(sender):
        mine = four(1)
        r = kind.scheme(sender.address, plane=sender.plane, integrity=True)
        r.init_on_receiver(models=mine, worker_idx=0)
        async with r:
            await asyncio.gather(sender.connect(timeout=CONNECT), r.connect(timeout=CONNECT))
            step = 0
            for _ in range(3):
                for name in models:
                    step += 1
                    fill(models[name], float(step))
                    result = await sender.send(weights={name: models[name]}, timeout=CONNECT)
                    assert result.version == step
                    assert all(same(mine[k], frozen(models[k])) for k in models), step
            for k in models:
                fill(models[k], -1.0)
            assert (await sender.send(timeout=CONNECT)).version == step + 1
            assert all(same(mine[k], frozen(models[k])) for k in models)
            # Pairs in turn: a distributed receiver keeps a few of the combinations of its
            # halves built, not every one it ever ran (up to 2**models of them).
            names = list(models)
            for first, second in itertools.combinations(names, 2):
                fill(models[first], 7.0)
                pair = {first: models[first], second: models[second]}
                await sender.send(weights=pair, timeout=CONNECT)
                assert all(same(mine[k], frozen(models[k])) for k in models)
            combined = getattr(r._receiver._plane, "_combined", {})
            assert len(combined) <= 4


def test_sharing_is_judged_by_the_bytes_models_hold_not_their_tensor_objects() -> None:
    from aiowsync._weights.models import split_send

    trunk = nn.Linear(4, 8)
    policy, value = nn.Sequential(trunk, nn.Linear(8, 2)), nn.Sequential(trunk, nn.Linear(8, 1))
    # state_dict() gives new tensor objects over the modules' memory at every call.
    given = {"policy": policy.state_dict(), "value": value.state_dict()}
    with pytest.raises(ValueError, match="'policy' and 'value' share tensors"):
        split_send({"policy": policy.state_dict()}, given)
    # Models whose tensors lie side by side in one allocation share no bytes.
    flat = torch.zeros(20)
    apart = {"a": {"w": flat[:10]}, "b": {"w": flat[10:]}}
    named, every = split_send({"a": {"w": torch.ones(10)}}, apart)
    assert list(named) == ["a"] and not every


async def test_a_scheme_of_many_models_connects_and_more_than_it_holds_are_refused() -> None:
    """Each model has a slot file of its own, named in every update: 40 models, more than
    the 64 entries an update's parameters once held, connect and follow a send."""

    def many(seed: int, n: int = 40) -> dict[str, nn.Module]:
        torch.manual_seed(seed)
        return {f"m{i}": nn.Linear(2, 2) for i in range(n)}

    kind = Kind("shm")
    models = many(0)
    sender = kind.scheme()
    sender.init_on_sender(models=models, num_workers=1)
    async with serving(sender):
        mine = many(1)
        r = kind.scheme(sender.address)
        r.init_on_receiver(models=mine, worker_idx=0)
        async with r:
            await asyncio.gather(sender.connect(timeout=CONNECT), r.connect(timeout=CONNECT))
            fill(models["m39"], 3.0)
            assert (await sender.send(timeout=CONNECT)).version == 1
            assert all(same(mine[k], frozen(models[k])) for k in models)
    with pytest.raises(ValueError, match="holds 257 models; a scheme holds at most 256"):
        kind.scheme().init_on_sender(models=many(0, 257), num_workers=1)
