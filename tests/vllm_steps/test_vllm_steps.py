"""The trainer's step on vLLM servers and a worker's side of it, without vLLM: whatever ends
a send (an error, the deadline, a cancellation), each server is resumed generating with the
version it served, its first one included. The trainer's side runs against an HTTP twin of
the servers' routes (tests/vllm_steps/_routes.py), a worker's against a real sender with a
stand-in for vLLM's model; the same failures on real vLLM servers are in
tests/integrations/vllm_server/test_vllm_failures.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import torch
from _routes import VLLMRoutes
from torch import nn

import aiowsync
from aiowsync.vllm import VLLMServerError, VLLMServers, VLLMServerTimeout
from aiowsync.vllm._describe import describe
from aiowsync.vllm._worker import WorkerReceiver
from helpers import eventually

LOAD_S = 1.0
"""How long a load takes when a test cancels it or lets the deadline pass during it."""


@asynccontextmanager
async def attached(
    n: int = 1, *, twin: Callable[[], Any] = VLLMRoutes, **options: Any
) -> AsyncIterator[tuple[VLLMServers, list[Any]]]:
    """``n`` twins made by ``twin``, attached to a sender of their workers."""
    twins = [twin() for _ in range(n)]
    servers = VLLMServers([t.url for t in twins], **options)
    scheme = aiowsync.SharedMemWeightSyncScheme()
    scheme.init_on_sender(model=nn.Linear(2, 2), num_workers=sum(t.world_size for t in twins))
    try:
        async with scheme, servers.attach(scheme):
            yield servers, twins
    finally:
        for twin in twins:
            twin.close()


def state(twin: VLLMRoutes) -> tuple[int | None, str | None, bool]:
    """What the server generates with, its label, and whether it is paused."""
    return twin.serves, twin.label, twin.paused


@pytest.mark.parametrize("cancel", ["asyncio", "anyio"])
async def test_a_send_cancelled_while_a_server_loads_leaves_it_resumed_on_its_version(
    cancel: str,
) -> None:
    async with attached() as (servers, [twin]):
        await servers.finish(1, [0], None)
        assert state(twin) == (1, "1", False)
        twin.delays["update_weights"] = LOAD_S
        if cancel == "asyncio":  # Task.cancel(), as asyncio.timeout and wait_for do
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await servers.finish(2, [0], None)
        else:
            with anyio.move_on_after(0.2) as scope:
                await servers.finish(2, [0], None)
            assert scope.cancelled_caught
        # The cancelled call returned once the server was back on version 1 and resumed:
        # the load ended, was undone, and only then did the server resume.
        assert state(twin) == (1, "1", False)
        load, back = (
            twin.call("update_weights", version=2),
            twin.call("update_weights", take_back=True),
        )
        assert back[1] >= load[1] and twin.call("resume")[0] >= back[1]
        await servers.finish(3, [0], None)  # the next send works
        assert state(twin) == (3, "3", False)


async def test_a_first_version_past_the_deadline_is_taken_back_to_the_servers_own_weights() -> None:
    """As in ``scheme.connect()``: the server served no version of this trainer before."""
    async with attached() as (servers, [twin]):
        twin.delays["update_weights"] = LOAD_S
        started = time.monotonic()
        with pytest.raises(VLLMServerTimeout) as info:
            await servers.finish(0, [0], started + 0.2)
        assert (info.value.url, info.value.step, info.value.status) == (
            twin.url,
            "update_weights",
            None,
        )
        assert state(twin) == (None, None, False)
        assert twin.call("update_weights", take_back=True, version=-1)


async def test_a_load_the_server_answered_with_an_error_is_not_taken_back() -> None:
    """Its workers put back what they had before answering (a reload that failed)."""
    async with attached() as (servers, [twin]):
        await servers.finish(1, [0], None)
        twin.fail["update_weights"] = "the reload failed after 5 tensors"
        with pytest.raises(VLLMServerError) as info:
            await servers.finish(2, [0], None)
        assert (info.value.step, info.value.status) == ("update_weights", 500)
        assert "the reload failed after 5 tensors" in str(info.value)
        assert state(twin) == (1, "1", False)
        assert not any(body.get("update_info", {}).get("take_back") for *_, body in twin.calls)


async def test_together_labels_end_before_any_resume_and_an_unlabelled_server_goes_back() -> None:
    async with attached(2, together=True) as (servers, [a, b]):
        await servers.finish(1, [0, 1], None)
        a.delays["finish_weight_update"] = 0.5
        b.fail["finish_weight_update"] = "label refused"
        with pytest.raises(VLLMServerError) as info:
            await servers.finish(2, [0, 1], None)
        assert info.value.url == b.url and info.value.status == 500
        # No server resumed while another's label was under way (a's took 0.5 s).
        label_ended = a.call("finish_weight_update")[1]
        assert min(a.call("resume")[0], b.call("resume")[0]) >= label_ended
        # The server that could not label the version went back to the one it served; the
        # one that labelled it keeps it (a label is the point of no return).
        assert state(b) == (1, "1", False)
        assert state(a) == (2, "2", False)


# -- a worker's side ---------------------------------------------------------------------------


class ServedModel:
    """A stand-in for the model inside vLLM: the weights it generates with, and the reload,
    snapshot and restore the engine gives the worker."""

    OWN = -1.0
    """The value of every weight of the server's own checkpoint."""

    def __init__(self) -> None:
        self.weight = torch.full((2, 2), self.OWN)
        self.fail_next = False

    def reload(self, pairs: Any) -> None:
        for key, tensor in pairs:
            assert key == "weight"
            if self.fail_next:  # as vLLM's reload failing half-way: the engine restores
                self.fail_next = False
                raise RuntimeError("the reload failed")
            self.weight.copy_(tensor)

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight.clone()}

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        self.weight.copy_(saved["weight"])

    def value(self) -> set[float]:
        return set(self.weight.flatten().tolist())


async def joined(scheme: aiowsync.WeightSyncScheme, served: ServedModel) -> WorkerReceiver:
    description = describe(scheme)
    worker, _ = await asyncio.gather(
        asyncio.to_thread(
            WorkerReceiver,
            description,
            0,
            reload=served.reload,
            snapshot=served.snapshot,
            restore=served.restore,
            server_url=None,
        ),
        scheme.connect(timeout=30),
    )
    return worker


def trainer() -> aiowsync.SharedMemWeightSyncScheme:
    model = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.fill_(7.0)
    scheme = aiowsync.SharedMemWeightSyncScheme(heartbeats=aiowsync.Heartbeats(0.1, 5))
    scheme.init_on_sender(model=model, num_workers=1)
    return scheme


async def test_a_worker_takes_a_first_version_back_to_the_servers_own_weights() -> None:
    served = ServedModel()
    async with trainer() as scheme:
        worker = await joined(scheme, served)
        try:
            await asyncio.to_thread(worker.apply, 0)
            assert served.value() == {7.0}
            await asyncio.to_thread(worker.apply, -1, take_back=True)
            assert served.value() == {ServedModel.OWN} and worker.applied is None
            await asyncio.to_thread(worker.apply, -1, take_back=True)  # nothing left to undo
            assert served.value() == {ServedModel.OWN}
            await asyncio.to_thread(worker.apply, 0)
            assert worker.finish() == 0 and served.value() == {7.0}
        finally:
            worker.close()


async def test_a_trainer_gone_before_labelling_a_first_version_leaves_the_servers_weights() -> None:
    served = ServedModel()
    async with trainer() as scheme:
        worker = await joined(scheme, served)
        await asyncio.to_thread(worker.apply, 0)  # loaded, never labelled
        assert served.value() == {7.0}
    try:
        # The worker sees its trainer gone and undoes the version.
        assert await eventually(lambda: served.value() == {ServedModel.OWN}, within=30)
        assert worker.applied is None
    finally:
        worker.close()


@pytest.mark.parametrize("labelled_first", [True, False])
async def test_a_version_left_unlabelled_is_replaced_by_the_next_and_a_failure_goes_back(
    labelled_first: bool,
) -> None:
    """A version was loaded and never labelled (its take-back failed): the next load
    replaces it, and a load that fails then goes back to what the server was labelled with,
    its own weights when no version was."""
    served = ServedModel()
    async with trainer() as scheme:
        worker = await joined(scheme, served)
        model = scheme.model
        try:
            await asyncio.to_thread(worker.apply, 0)
            if labelled_first:
                assert worker.finish() == 0
            labelled = {7.0} if labelled_first else {ServedModel.OWN}
            for value in (8.0, 9.0):  # loaded, never labelled, then the next one
                with torch.no_grad():
                    model.weight.fill_(value)
                result = await scheme.send()
                await asyncio.to_thread(worker.apply, result.version)
                assert served.value() == {value}
            with torch.no_grad():
                model.weight.fill_(10.0)
            result = await scheme.send()
            served.fail_next = True
            with pytest.raises(RuntimeError, match="the reload failed"):
                await asyncio.to_thread(worker.apply, result.version)
            assert served.value() == labelled
            assert worker.applied == (0 if labelled_first else None)
        finally:
            worker.close()


class TwoWorkers(VLLMRoutes):
    """A server of two tensor-parallel workers, each with its own weights and update state,
    as vLLM runs them: each route runs on both, and answers with the first one's error."""

    def __init__(self) -> None:
        super().__init__()
        self.world_size = 2
        self.workers: list[dict[str, Any]] = [
            {"serves": None, "before": None, "pending": False, "active": False} for _ in range(2)
        ]
        self.failing: int | None = None
        """The worker whose next load fails (it then puts its own weights back)."""

    def _engine_call(self, route: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        errors = []
        for i, w in enumerate(self.workers):
            if route == "start_weight_update":
                if w["active"]:
                    errors.append("a weight update is already active")
                w["active"] = True
            elif not w["active"]:
                errors.append(f"worker {i}: {route} without a matching start")
            elif route == "update_weights":
                info = body["update_info"]
                if info.get("take_back"):
                    if w["pending"]:
                        w["serves"], w["pending"] = w["before"], False
                elif self.failing == i:
                    self.failing, w["active"] = None, False
                    errors.append(f"worker {i}: the reload failed")
                elif not w["pending"]:
                    w["before"], w["serves"], w["pending"] = w["serves"], info["version"], True
            else:  # finish_weight_update
                w["active"] = w["pending"] = False
                if "weight_version" in body:
                    self.label = body["weight_version"]
        if errors:
            return 500, {"error": {"message": errors[0]}}
        return 200, {}


async def test_a_load_that_fails_on_one_of_a_servers_workers_is_taken_back_on_the_others() -> None:
    """vLLM answers with the failing worker's error while the others hold the version: they
    must go back too, or the server generates with two versions at once."""
    async with attached(twin=TwoWorkers) as (servers, [twin]):
        await servers.finish(1, [0, 1], None)
        twin.failing = 1
        with pytest.raises(VLLMServerError, match="worker 1: the reload failed"):
            await servers.finish(2, [0, 1], None)
        assert [w["serves"] for w in twin.workers] == [1, 1] and twin.label == "1"
        assert not any(w["active"] for w in twin.workers) and not twin.paused
        await servers.finish(3, [0, 1], None)  # the next send starts cleanly
        assert [w["serves"] for w in twin.workers] == [3, 3] and twin.label == "3"


class LosesTakeBacks(VLLMRoutes):
    """A server behind a proxy that loses the next take-back (503; it never reached vLLM)."""

    lose = 0

    def _engine_call(self, route: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if route == "update_weights" and body["update_info"].get("take_back") and self.lose:
            self.lose -= 1
            return 503, {"error": {"message": "the proxy lost it"}}
        return super()._engine_call(route, body)


async def test_an_update_left_open_is_taken_back_not_kept_by_the_next_send() -> None:
    """A take-back that never reached the server leaves version 2 loaded, unlabelled, its
    update open: the next send must undo it before it starts, not end the update (which
    keeps version 2 as the one a failed load goes back to)."""
    async with attached(twin=LosesTakeBacks) as (servers, [twin]):
        await servers.finish(1, [0], None)
        twin.delays["update_weights"], twin.lose = LOAD_S, 1
        with pytest.raises(VLLMServerTimeout):
            await servers.finish(2, [0], time.monotonic() + 0.2)
        assert state(twin) == (2, "1", False) and twin.active  # left open
        await servers.finish(3, [0], None)
        assert state(twin) == (3, "3", False)
        assert twin.before == 1  # what version 3 replaced: 1, never the unlabelled 2


async def test_a_resume_that_fails_once_is_tried_again() -> None:
    async with attached() as (servers, [twin]):
        twin.fail["resume"] = "the proxy is restarting"
        await servers.finish(1, [0], None)
        assert state(twin) == (1, "1", False)
        assert twin.routes().count("resume") == 2


async def test_leaving_attach_under_an_anyio_cancellation_still_detaches_the_servers() -> None:
    twin = VLLMRoutes()
    servers = VLLMServers([twin.url])
    scheme = aiowsync.SharedMemWeightSyncScheme()
    scheme.init_on_sender(model=nn.Linear(2, 2), num_workers=1)
    try:
        async with scheme:
            with anyio.move_on_after(0.3) as scope:
                async with servers.attach(scheme):
                    await anyio.sleep(10)
            assert scope.cancelled_caught
        assert "shutdown_weight_transfer_engine" in twin.routes()
    finally:
        twin.close()


async def test_the_labels_can_be_read_attached_or_not() -> None:
    twin = VLLMRoutes()
    servers = VLLMServers([twin.url])
    try:
        assert await servers.weight_versions() == {twin.url: None}  # its own weights: no label
        scheme = aiowsync.SharedMemWeightSyncScheme()
        scheme.init_on_sender(model=nn.Linear(2, 2), num_workers=1)
        async with scheme, servers.attach(scheme):
            await servers.finish(4, [0], None)
            assert await servers.weight_versions() == {twin.url: "4"}
        assert await servers.weight_versions() == {twin.url: "4"}
    finally:
        twin.close()
