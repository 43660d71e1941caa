"""Every tcp bind is authenticated by default: keys of the scheme's own, carried to its
workers, asked of a receiver built from an address alone, and the named opt-out. The last
test runs another user's process against the distributed scheme's default socket."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import subprocess
import sys

import pytest

import aiowsync
from aiowsync import CurveKeys, ZmqChannelFactory
from aiowsync.vllm._describe import describe, rebuild
from helpers import BEATS, bump, dist_model, keys_of, model, same

pytestmark = pytest.mark.timeout(90)

TCP = "tcp://127.0.0.1:0"
NOBODY = 65534


def keys_of_factory(scheme: aiowsync.WeightSyncScheme) -> CurveKeys | None:
    channels = scheme.channels
    assert isinstance(channels, ZmqChannelFactory)
    return channels.curve


async def test_a_tcp_sender_makes_keys_its_pickle_carries_without_the_server_secret() -> None:
    src, mirror = model(0), model(1)
    sender = aiowsync.SharedMemWeightSyncScheme(bind=TCP, heartbeats=BEATS)
    sender.init_on_sender(model=src, num_workers=1)
    assert keys_of_factory(sender) is None  # made with the socket
    async with sender:
        keys = keys_of_factory(sender)
        assert keys is not None and keys.server_secret is not None
        assert keys.client_secret is not None
        blob = pickle.dumps(sender)
        assert keys.server_secret.encode() not in blob
        assert keys.server_secret not in repr(keys) and keys.client_secret not in repr(keys)
        worker = pickle.loads(blob)
        assert keys_of_factory(worker) == keys.for_receiver()
        worker.init_on_receiver(model=mirror, worker_idx=0)
        async with worker:
            await asyncio.gather(sender.connect(timeout=10), worker.connect(timeout=10))
            bump(src)
            assert (await sender.send(timeout=10)).worker_ids == (0,)
            assert same(mirror, src)
        # A receiver without them does not get in: it cannot finish the handshake.
        plain = aiowsync.SharedMemWeightSyncScheme(
            address=sender.address,
            heartbeats=BEATS,
            channels=ZmqChannelFactory(allow_insecure_bind=True),
        )
        plain.init_on_receiver(model=model(2), worker_idx=0)
        async with plain:
            with pytest.raises(aiowsync.WeightSyncTimeout):
                await plain.connect(timeout=1.0)
    # A later session serves with the same keys: the workers' pickles stay good.
    async with sender:
        assert keys_of_factory(sender) is keys


def test_a_receiver_built_from_a_tcp_address_alone_is_told_what_it_must_be_given() -> None:
    r = aiowsync.DistributedWeightSyncScheme(address="tcp://127.0.0.1:5555", backend="gloo")
    with pytest.raises(ValueError) as info:
        r.init_on_receiver(model=dist_model(0), worker_idx=0)
    text = str(info.value)
    assert "tcp://127.0.0.1:5555" in text and "CURVE keys" in text
    assert "channels=ZmqChannelFactory(curve=keys)" in text
    assert "scheme.channels.curve.for_receiver()" in text
    assert "allow_insecure_bind=True" in text
    with pytest.raises(ValueError, match="CURVE keys"):  # the factory says the same
        ZmqChannelFactory().connect("tcp://127.0.0.1:5555", heartbeat_timeout=1.0)
    # Unix sockets are checked by the kernel instead: nothing to give.
    aiowsync.SharedMemWeightSyncScheme(address="ipc://@x").init_on_receiver(
        model=model(0), worker_idx=0
    )


async def test_a_receiver_given_the_senders_keys_joins_from_the_address() -> None:
    src, mirror = dist_model(0), dist_model(1)
    sender = aiowsync.DistributedWeightSyncScheme(bucket_bytes=4096, heartbeats=BEATS)
    sender.init_on_sender(model=src, num_workers=1)
    async with sender:
        r = aiowsync.DistributedWeightSyncScheme(address=sender.address, channels=keys_of(sender))
        r.init_on_receiver(model=mirror, worker_idx=0)
        async with r:
            await asyncio.gather(sender.connect(timeout=30), r.connect(timeout=30))
            assert same(mirror, src)


async def test_the_opt_out_binds_tcp_without_keys_on_both_sides() -> None:
    src, mirror = model(0), model(1)
    insecure = ZmqChannelFactory(allow_insecure_bind=True)
    sender = aiowsync.SharedMemWeightSyncScheme(bind=TCP, heartbeats=BEATS, channels=insecure)
    sender.init_on_sender(model=src, num_workers=1)
    async with sender:
        assert insecure.curve is None
        r = aiowsync.SharedMemWeightSyncScheme(
            address=sender.address,
            heartbeats=BEATS,
            channels=ZmqChannelFactory(allow_insecure_bind=True),
        )
        r.init_on_receiver(model=mirror, worker_idx=0)
        async with r:
            await asyncio.gather(sender.connect(timeout=10), r.connect(timeout=10))
            assert same(mirror, src)


def test_keys_of_its_own_are_for_tcp_and_given_keys_for_every_address() -> None:
    own = ZmqChannelFactory()
    assert own._sender_keys("ipc://@x") is None  # no keys made for a Unix socket
    made = own._sender_keys(TCP)
    assert made is not None and own.curve is made
    assert own._sender_keys("ipc://@x") is None and own.receiver_keys("ipc://@x") is None
    assert own.receiver_keys("tcp://127.0.0.1:1") is made
    given = CurveKeys.generate()
    theirs = ZmqChannelFactory(curve=given)
    assert theirs._sender_keys("ipc://@x") is given and theirs.receiver_keys("ipc://@x") is given
    # A factory unpickled in a worker lets it in, but cannot serve.
    worker = pickle.loads(pickle.dumps(own))
    assert worker.receiver_keys("tcp://127.0.0.1:1") == made.for_receiver()
    with pytest.raises(ValueError, match="came pickled from a sender"):
        worker.bind(TCP, heartbeat_timeout=1.0)


def test_the_vllm_description_carries_the_keys_a_worker_presents() -> None:
    sender = aiowsync.DistributedWeightSyncScheme(backend="gloo", heartbeats=BEATS)
    sender.init_on_sender(model=dist_model(0), num_workers=1)
    description = describe(sender)
    keys = keys_of_factory(sender)
    assert keys is not None and keys.server_secret is not None
    text = json.dumps(description)
    assert keys.server_secret not in text
    assert description["curve"] == {
        "server_public": keys.server_public,
        "client_public": keys.client_public,
        "client_secret": keys.client_secret,
    }
    worker = rebuild(json.loads(text))
    assert isinstance(worker.channels, ZmqChannelFactory)
    assert worker.channels.receiver_keys(sender.address) == keys.for_receiver()
    worker.init_on_receiver(model=dist_model(1), worker_idx=0)
    del sender  # its socket closes with it

    insecure = aiowsync.DistributedWeightSyncScheme(
        backend="gloo", channels=ZmqChannelFactory(allow_insecure_bind=True)
    )
    insecure.init_on_sender(model=dist_model(0), num_workers=1)
    opted_out = describe(insecure)
    assert opted_out["curve"] is None and opted_out["allow_insecure_bind"] is True
    rebuild(opted_out).init_on_receiver(model=dist_model(1), worker_idx=0)  # no keys asked


def test_the_vllm_description_names_the_data_host_of_a_sender_on_every_interface() -> None:
    # Before, it gave the servers' workers tcp://0.0.0.0:PORT, their own host.
    sender = aiowsync.DistributedWeightSyncScheme(
        backend="gloo", bind="tcp://0.0.0.0:0", data_host="192.0.2.2", heartbeats=BEATS
    )
    sender.init_on_sender(model=dist_model(0), num_workers=1)
    port = sender.address.rpartition(":")[2]
    description = describe(sender)
    assert description["address"] == f"tcp://192.0.2.2:{port}"
    worker = rebuild(json.loads(json.dumps(description)))
    assert isinstance(worker.channels, ZmqChannelFactory)
    assert worker.channels.receiver_keys(description["address"]) is not None


def test_the_vllm_engines_init_info_keeps_the_description_out_of_its_repr() -> None:
    pytest.importorskip("vllm")
    from aiowsync.vllm._engine import AiowsyncInitInfo

    info = AiowsyncInitInfo(scheme={"curve": {"client_secret": "s3cr3t"}})
    assert "s3cr3t" not in repr(info)


# -- another user ------------------------------------------------------------------------------

_JOINER = r"""
import asyncio, importlib, os, pkgutil, sys
address, uid, deadline, tests = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
sys.path.insert(0, tests)
import torch, torch.distributed
import aiowsync
from helpers import dist_model

# Everything loaded now: that user may not read the interpreter's or the project's files.
for info in pkgutil.walk_packages(aiowsync.__path__, "aiowsync."):
    if not info.name.startswith(("aiowsync.vllm", "aiowsync.torchrl", "aiowsync._tools")):
        importlib.import_module(info.name)
"127.0.0.1".encode("idna")
mine = dist_model(7)
os.setgroups([])
os.setgid(uid)
os.setuid(uid)


async def main() -> None:
    # What a process finding the port would build: the scheme's own arguments, and no keys.
    scheme = aiowsync.DistributedWeightSyncScheme(
        address=address,
        backend="gloo",
        bucket_bytes=4096,
        channels=aiowsync.ZmqChannelFactory(allow_insecure_bind=True),
    )
    scheme.init_on_receiver(model=mine, worker_idx=1)
    async with scheme:
        try:
            await scheme.connect(timeout=deadline)
        except Exception as exc:
            print("refused", type(exc).__name__, os.getuid(), flush=True)
            return
        print("joined", scheme.version, os.getuid(), flush=True)


asyncio.run(main())
"""

needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0 or not sys.platform.startswith("linux"),
    reason="running a process as another user needs root on Linux",
)


@needs_root
async def test_another_user_cannot_join_a_default_gloo_sender_as_a_worker() -> None:
    # Before: the default socket (loopback tcp) took anyone who found the port; another
    # user's process joined as worker 1 and was welcomed with version 0 (the store's secret
    # came with the welcome), then got every version sent to it.
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src, mirror = dist_model(0), dist_model(1)
    sender = aiowsync.DistributedWeightSyncScheme(bucket_bytes=4096, heartbeats=BEATS)
    sender.init_on_sender(model=src, num_workers=2)
    async with sender:
        worker = pickle.loads(pickle.dumps(sender))
        worker.init_on_receiver(model=mirror, worker_idx=0)
        async with worker:
            await worker.connect(timeout=30)
            joiner = asyncio.create_task(
                asyncio.to_thread(
                    subprocess.run,
                    [sys.executable, "-c", _JOINER, sender.address, str(NOBODY), "5", tests],
                    capture_output=True,
                    text=True,
                    timeout=120,
                    check=True,
                )
            )
            sent = 0
            while not joiner.done():  # the trainer goes on sending to its worker meanwhile
                bump(src)
                assert (await sender.send(worker_ids=[0], timeout=30)).worker_ids == (0,)
                assert same(mirror, src)
                sent += 1
                await asyncio.sleep(0.2)
            done = await joiner
            assert done.stdout.split() == ["refused", "WeightSyncTimeout", str(NOBODY)], (
                done.stdout,
                done.stderr[-2000:],
            )
            assert sender.workers[1].state == "never connected"
            assert sent >= 1 and worker.version == sender.version == sent
