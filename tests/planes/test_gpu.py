"""CUDA paths: swap refused for a GPU model, copy mode into GPU memory, a CUDA sender, and
NCCL (experimental). Marked ``gpu``; each skips on a host without the GPUs it needs. The rule
that keeps swap mode off GPU models is also checked here without a GPU."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Mapping

import pytest
import torch

import aiowsync
from helpers import bump, keys_of, model, pair, same

pytestmark = pytest.mark.timeout(180)

FAST = aiowsync.Heartbeats(interval=0.1, missed=50)
ONE_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL ranks need a GPU each")


# -- the rule, without a GPU ------------------------------------------------------------------


def test_swap_mode_is_for_tensors_where_the_planes_buffers_are() -> None:
    cpu = {"w": torch.zeros(2)}
    elsewhere = {"w": torch.zeros(2, device="meta")}  # any device but the CPU
    for plane in (aiowsync.SharedMemPlane(), aiowsync.MemoryPlane()):
        assert plane.can_swap(cpu) and not plane.can_swap(elsewhere)
    gloo = aiowsync.DistributedPlane(backend="gloo")
    assert gloo.can_swap(cpu) and not gloo.can_swap(elsewhere)
    with pytest.warns(aiowsync.ExperimentalWarning, match="nccl"):
        nccl = aiowsync.DistributedPlane(backend="nccl")
    assert not nccl.can_swap(cpu)


class _RemotePlane(aiowsync.MemoryPlane):
    """An in-process plane whose buffers a CPU model cannot alias, as a GPU model cannot
    alias shared memory."""

    def can_swap(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        return False


def test_an_explicit_swap_that_cannot_alias_the_planes_buffers_is_refused() -> None:
    r = aiowsync.WeightSyncScheme("ipc://@x", plane=_RemotePlane(), apply_mode="swap")
    with pytest.raises(ValueError, match=r"apply_mode='copy'"):
        r.init_on_receiver(model=model(1), worker_idx=0)
    copy = aiowsync.WeightSyncScheme("ipc://@x", plane=_RemotePlane(), apply_mode="copy")
    copy.init_on_receiver(model=model(1), worker_idx=0)  # copy mode is always possible


# -- one GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@ONE_GPU
@pytest.mark.parametrize("scheme", ["shm", "gloo"])
async def test_a_cuda_receiver_gets_each_version_in_copy_mode(scheme: str) -> None:
    src = model(0)
    make = (
        aiowsync.SharedMemWeightSyncScheme
        if scheme == "shm"
        else lambda **kw: aiowsync.DistributedWeightSyncScheme(backend="gloo", **kw)
    )
    sender = (
        make(heartbeats=FAST)
        if scheme == "shm"
        else make(heartbeats=FAST, bind="tcp://127.0.0.1:0")
    )
    sender.init_on_sender(model=src, num_workers=1)
    async with sender:
        # On tcp (gloo), a receiver built from the address is given the sender's keys.
        keys = {} if scheme == "shm" else {"channels": keys_of(sender)}
        with pytest.raises(ValueError, match="apply_mode='copy'"):
            make(address=sender.address, apply_mode="swap", **keys).init_on_receiver(
                model=model(1).cuda(), worker_idx=0
            )
        r = make(address=sender.address, **keys)  # auto: copy mode for a GPU model
        m = model(1).cuda()
        r.init_on_receiver(model=m, worker_idx=0)
        async with r:
            await asyncio.gather(sender.connect(timeout=60), r.connect(timeout=60))
            for version in (1, 2):
                bump(src)
                await sender.send(timeout=30)
                assert r.version == version and same(m, src)
                assert all(t.is_cuda for t in m.state_dict().values())


@pytest.mark.gpu
@ONE_GPU
async def test_a_cuda_sender_model_reaches_a_cpu_receiver() -> None:
    src, m = model(0).cuda(), model(1)
    async with pair(src, m, heartbeats=FAST) as (sender, r):
        assert same(m, src)
        bump(src)
        await sender.send(timeout=30)
        assert r.version == 1 and same(m, src)


# -- NCCL: one GPU per rank, so the receiver runs in a process of its own ---------------------

_NCCL_RECEIVER = """
import asyncio, hashlib, sys, warnings
import torch
sys.path.insert(0, sys.argv[2])
import aiowsync
from helpers import model

warnings.simplefilter("ignore", aiowsync.ExperimentalWarning)

async def main() -> None:
    keys = aiowsync.CurveKeys(
        server_public=sys.argv[3], client_public=sys.argv[4], client_secret=sys.argv[5]
    )
    r = aiowsync.DistributedWeightSyncScheme(
        address=sys.argv[1], backend="nccl", channels=aiowsync.ZmqChannelFactory(curve=keys)
    )
    m = model(1).to("cuda:1")
    r.init_on_receiver(model=m, worker_idx=0)
    async with r:
        await r.connect(timeout=120)
        await r.wait_for_version(1, timeout=120)
        h = hashlib.sha256()
        for k, t in sorted(m.state_dict().items()):
            h.update(t.cpu().contiguous().view(torch.uint8).numpy().tobytes())
        print(r.version, h.hexdigest(), flush=True)

asyncio.run(main())
"""


@pytest.mark.gpu
@TWO_GPUS
async def test_nccl_sends_cuda_weights() -> None:
    import hashlib

    src = model(0).to("cuda:0")
    with pytest.warns(aiowsync.ExperimentalWarning):
        sender = aiowsync.DistributedWeightSyncScheme(
            backend="nccl", heartbeats=FAST, bind="tcp://127.0.0.1:0"
        )
    sender.init_on_sender(model=src, num_workers=1)
    async with sender:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: helpers.py
        keys = sender.channels.curve  # type: ignore[attr-defined]  # its tcp socket's keys
        assert keys is not None and keys.client_public and keys.client_secret
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _NCCL_RECEIVER,
            sender.address,
            here,
            keys.server_public,
            keys.client_public,
            keys.client_secret,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            await sender.connect(timeout=120)
            bump(src)
            result = await sender.send(timeout=120)
            out, err = await asyncio.wait_for(proc.communicate(), 120)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode == 0, err.decode()[-2000:]
        h = hashlib.sha256()
        for _, t in sorted(src.state_dict().items()):
            h.update(t.cpu().contiguous().view(torch.uint8).numpy().tobytes())
        assert result.version == 1
        assert out.decode().split() == ["1", h.hexdigest()]
