"""What a starting sender sweeps: the socket directories and shared-memory slots of senders
that died, and nothing of a live one, even where its pid looks dead (another pid namespace
sharing the temporary directory and /dev/shm). A socket removed from under a live sender is
bound again, and a worker that finds no socket is told which path is missing."""

from __future__ import annotations

import asyncio
import fcntl
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest

import aiowsync
from aiowsync._channel._socket_dir import remove_stale_socket_dirs
from aiowsync._planes.shm.slots import remove_stale_slots
from helpers import bump, eventually, model, same

pytestmark = pytest.mark.timeout(180)

DEAD = 99999999999999999999
"""A pid no process has."""


def _locked(path: Path, kind: int) -> int:
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, kind | fcntl.LOCK_NB)
    return fd


def test_a_sweep_keeps_what_a_live_owner_locks_whatever_its_pid_looks_like(
    tmp_path: Path,
) -> None:
    sockets, shm = tmp_path / "sockets", tmp_path / "shm"
    sockets.mkdir()
    shm.mkdir()
    directory = sockets / f"aiowsync-{DEAD}-0123456789abcdef"
    directory.mkdir(mode=0o700)
    (directory / "owner.lock").touch()
    slot = shm / f"aiowsync-{DEAD}-0123456789abcdef-0"
    slot.touch()
    # The owners' locks, as live senders hold them (here on descriptors of this process,
    # which the sweep's own descriptors conflict with like another process's).
    held = [_locked(directory / "owner.lock", fcntl.LOCK_EX), _locked(slot, fcntl.LOCK_SH)]
    try:
        assert remove_stale_socket_dirs(str(sockets)) == []
        assert remove_stale_slots(shm) == []
        assert directory.exists() and slot.exists()
    finally:
        for fd in held:
            os.close(fd)
    # Once the owner is gone, so is its lock: the next sweep removes both.
    assert remove_stale_socket_dirs(str(sockets)) == [str(directory)]
    assert remove_stale_slots(shm) == [slot.name]
    assert not directory.exists() and not slot.exists()


_OTHER_SENDER = """
import asyncio, sys, torch, aiowsync

async def main():
    scheme = aiowsync.SharedMemWeightSyncScheme()
    scheme.init_on_sender(model=torch.nn.Linear(2, 2), num_workers=1)
    async with scheme:
        print(scheme.address, flush=True)

asyncio.run(main())
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a pid namespace of its own needs root and unshare(1)",
)
async def test_a_sender_in_another_pid_namespace_leaves_a_live_sender_whole() -> None:
    src = model(0)
    sender = aiowsync.SharedMemWeightSyncScheme()
    sender.init_on_sender(model=src, num_workers=1)
    async with sender:
        bump(src)
        socket = sender.address[len("ipc://") :]
        mine = {n for n in os.listdir("/dev/shm") if n.startswith(f"aiowsync-{os.getpid()}-")}
        assert os.path.exists(socket) and mine
        # Another sender starts where this process's pid names nothing, sharing the
        # temporary directory and /dev/shm, and sweeps what it takes for dead senders' files.
        other = await asyncio.create_subprocess_exec(
            "unshare", "--pid", "--fork", sys.executable, "-c", _OTHER_SENDER,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(other.communicate(), 150)
        assert other.returncode == 0, err.decode()[-2000:]
        assert out.decode().startswith("ipc://")
        assert os.path.exists(socket)
        assert mine <= set(os.listdir("/dev/shm"))
        # And a worker still joins this sender, and runs its bytes.
        receiver = pickle.loads(pickle.dumps(sender))
        replica = model(1)
        receiver.init_on_receiver(model=replica, worker_idx=0)
        async with receiver:
            await asyncio.gather(sender.connect(timeout=60), receiver.connect(timeout=60))
            assert (await sender.send(timeout=60)).version == 1
            assert receiver.version == 1 and same(replica, src)


async def test_a_removed_socket_is_bound_again_and_a_joiner_told_of_a_missing_one() -> None:
    src = model(0)
    sender = aiowsync.SharedMemWeightSyncScheme(
        heartbeats=aiowsync.Heartbeats(interval=0.1, missed=50)
    )
    sender.init_on_sender(model=src, num_workers=1)
    async with sender:
        socket = sender.address[len("ipc://") :]
        shutil.rmtree(os.path.dirname(socket))  # a tidy-up of the temporary directory
        assert await eventually(lambda: os.path.exists(socket), within=30, what="bound again")
        receiver = pickle.loads(pickle.dumps(sender))
        replica = model(1)
        receiver.init_on_receiver(model=replica, worker_idx=0)
        async with receiver:
            await asyncio.gather(sender.connect(timeout=60), receiver.connect(timeout=60))
            assert receiver.version == 0 and same(replica, src)
    # A sender that is gone left no socket: a worker's error names the path it did not find.
    late = pickle.loads(pickle.dumps(sender))
    late.init_on_receiver(model=model(2), worker_idx=0)
    async with late:
        with pytest.raises(aiowsync.WeightSyncTimeout, match=f"its socket {socket} does not"):
            await late.connect(timeout=1)
