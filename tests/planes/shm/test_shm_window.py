"""The slot window on its own: real slot files in /dev/shm, shown one after the other in one
range of address space, as a swap-mode receiver's switches do."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import os
import resource
from collections.abc import Iterator

import pytest
import torch

from aiowsync._exceptions import TransportError
from aiowsync._planes.shm import homes as homes_module
from aiowsync._planes.shm import mapping
from aiowsync._planes.shm import window as window_module
from aiowsync._planes.shm.slots import SlotFile
from aiowsync._planes.shm.window import SlotWindow, windows_supported

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not windows_supported(), reason="slot windows need Linux"),
]

NBYTES = 8 << 20  # 2048 pages of 4 KiB


@contextlib.contextmanager
def slots(count: int) -> Iterator[list[SlotFile]]:
    files = [SlotFile.create(i, NBYTES) for i in range(count)]
    try:
        yield files
    finally:
        for f in files:
            f.unlink()


def fill(slot: SlotFile, value: float) -> None:
    slot.tensor.view(torch.float32).fill_(value)


def read(window: SlotWindow) -> torch.Tensor:
    """Every page of the window read once, as a policy's forward reads its weights."""
    return window.tensor.view(torch.float32).sum()


def page_faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


@contextlib.contextmanager
def window() -> Iterator[SlotWindow]:
    w = SlotWindow(NBYTES)
    try:
        yield w
    finally:
        w.release()


def test_a_version_read_before_is_not_faulted_in_again_and_shows_the_new_bytes() -> None:
    with slots(2) as (a, b), window() as w:
        fill(a, 1.0)
        w.show(a.path)
        read(w)
        fill(b, 2.0)
        w.show(b.path)
        read(w)
        fill(a, 3.0)  # the sender's next version, in the slot the window showed first
        w.show(a.path)
        before = page_faults()
        assert read(w).item() == 3.0 * NBYTES / 4
        faults = page_faults() - before
        if w._homes is not None:  # moves work here: a's pages came back with their tables
            assert faults < 16, faults
        else:  # mapped anew: 2048 pages faulted in, some 16 at a time
            assert faults >= 2048 // 16


def test_pages_a_worker_wrote_are_dropped_at_the_switch_away_from_them() -> None:
    with slots(2) as (a, b), window() as w:
        if w._homes is None:
            pytest.skip("no moves here: every switch maps anew")
        fill(a, 1.0)
        fill(b, 2.0)
        w.show(a.path)
        read(w)
        flat = w.tensor.view(torch.float32)
        flat[7] = -5.0  # the worker's own write: a private copy of one page
        flat[-1] = -5.0
        assert a.tensor.view(torch.float32)[7].item() == 1.0  # the sender's file is untouched
        w.show(b.path)
        assert torch.equal(flat, torch.full_like(flat, 2.0))
        fill(a, 3.0)
        w.show(a.path)
        # What the worker wrote into the version before must not come back with the file.
        assert torch.equal(flat, torch.full_like(flat, 3.0))
        # The mapping without written pages went home again, and comes back unfaulted.
        w.show(b.path)
        w.show(a.path)
        before = page_faults()
        read(w)
        assert page_faults() - before < 16


def test_the_same_file_shown_again_drops_only_written_pages() -> None:
    with slots(1) as (a,), window() as w:
        fill(a, 1.0)
        w.show(a.path)
        flat = w.tensor.view(torch.float32)
        read(w)
        w.show(a.path)  # nothing written: a no-op that keeps the pages
        flat[3] = 9.0
        w.show(a.path)
        assert torch.equal(flat, torch.full_like(flat, 1.0))


def test_a_kernel_that_cannot_move_mappings_maps_each_version_anew(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert mapping.calls is not None

    def refuse(source: int, target: int, size: int) -> None:
        raise OSError(22, "Invalid argument")  # a kernel before 5.13 for file mappings

    monkeypatch.setattr(mapping.calls, "move", refuse)
    with slots(2) as (a, b), window() as w:
        fill(a, 1.0)
        fill(b, 2.0)
        w.show(a.path)
        flat = w.tensor.view(torch.float32)
        assert torch.equal(flat, torch.full_like(flat, 1.0))
        assert w._homes is None  # gave up moving, and its homes
        flat[0] = 7.0
        w.show(b.path)
        fill(a, 3.0)
        w.show(a.path)
        assert torch.equal(flat, torch.full_like(flat, 3.0))


def test_release_gives_back_every_home_and_shows_zeros() -> None:
    with slots(3) as files, window() as w:
        for i, f in enumerate(files):
            fill(f, float(i + 1))
            w.show(f.path)
            read(w)
        assert w._homes is not None
        homes = [w._homes.at(f.path) for f in files[:-1]]
        w.release()
        assert w._homes is None and w.showing is None
        assert w.tensor.count_nonzero().item() == 0
        with open("/proc/self/maps") as maps:
            starts = {int(line.split("-", 1)[0], 16) for line in maps}
        assert not starts & set(homes)


async def test_on_an_event_loop_written_pages_are_found_after_the_switch_or_before_a_show() -> None:
    with slots(2) as (a, b), window() as w:
        if w._homes is None:
            pytest.skip("no moves here: every switch maps anew")
        fill(a, 1.0)
        fill(b, 2.0)
        flat = w.tensor.view(torch.float32)
        w.show(a.path)
        flat[100] = -1.0
        w.show(b.path)  # the switch itself looks at nothing: a's home is checked afterwards
        assert w._homes.unsure() == [a.path]
        await asyncio.sleep(0)
        assert w._homes.unsure() == []
        fill(a, 3.0)
        w.show(a.path)
        assert torch.equal(flat, torch.full_like(flat, 3.0))
        # Shown again before the loop ran the check: checked then.
        flat[-1] = -1.0
        w.show(b.path)
        fill(a, 4.0)
        w.show(a.path)
        assert torch.equal(flat, torch.full_like(flat, 4.0))


def test_a_mapping_shown_while_the_process_took_no_page_fault_is_not_looked_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A written page is made in a page fault: with the process's count unchanged since a
    mapping came in, nothing in it can be the worker's, and its pagemap is not read. A home
    at rest is looked through only once pages were locked (mlock fills homes), whatever other
    faults the worker took."""
    count, locked = [100], [7]
    monkeypatch.setattr(homes_module, "faults", lambda: count[0])
    monkeypatch.setattr(window_module, "faults", lambda: count[0])
    with slots(2) as (a, b), window() as w:
        homes = w._homes
        if homes is None:
            pytest.skip("no moves here: every switch maps anew")
        monkeypatch.setattr(homes, "mark", lambda: locked[0])
        w.show(a.path)
        w.show(b.path)
        assert homes.unsure() == []  # no fault while a was shown: no look
        count[0] += 1  # a fault while b is shown (a read, a write: all alike)
        looked: list[int] = []
        monkeypatch.setattr(homes._written, "any", lambda addr: looked.append(addr) or False)
        w.show(a.path)
        # b, shown during the fault, is looked through (at once: no event loop runs here);
        # a's home, at rest meanwhile, is not.
        assert looked == [homes.at(b.path)] and homes.unsure() == []
        w.show(a.path)  # no fault since: no look, for the same file or another
        w.show(b.path)
        w.show(a.path)
        assert len(looked) == 1
        locked[0] += 1  # pages were locked somewhere while b's home was at rest
        w.show(b.path)
        assert looked == [homes.at(b.path), homes.at(b.path)]
        # a, shown meanwhile, took no fault: nothing was locked into it.
        locked[0] += 1
        w.show(a.path)
        assert looked[2:] == [homes.at(a.path)]


def test_a_home_locked_and_unlocked_at_rest_is_looked_through_before_it_is_shown() -> None:
    """mlock fills a home at rest with copies of its file's bytes of that moment; the lock
    can be gone by the next switch, but the machine's count of locked pages has moved, so the
    home is looked through and the window shows the file's new bytes."""
    with slots(2) as (a, b), window() as w:
        homes = w._homes
        if homes is None or not homes.counts_locked_pages:
            pytest.skip("no moves here, or no count of locked pages")
        fill(a, 1.0)
        fill(b, 2.0)
        flat = w.tensor.view(torch.float32)
        w.show(a.path)
        read(w)
        w.show(b.path)  # a's mapping, its pages read, waits at its home
        home, before = homes.at(a.path), homes.mark()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mlock.argtypes = libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        if libc.mlock(home, NBYTES) != 0:
            pytest.skip(f"mlock refused: {os.strerror(ctypes.get_errno())}")
        libc.munlock(home, NBYTES)
        assert homes.mark() > before and homes.written(home)
        fill(a, 3.0)  # the sender's next version in a's file
        w.show(a.path)
        assert torch.equal(flat, torch.full_like(flat, 3.0))


def test_a_count_of_locked_pages_that_cannot_be_read_any_more_gives_way_to_the_fault_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with slots(2) as (a, b), window() as w:
        homes = w._homes
        if homes is None or not homes.counts_locked_pages:
            pytest.skip("no moves here, or no count of locked pages")
        w.show(a.path)
        w.show(b.path)
        looked: list[int] = []
        monkeypatch.setattr(homes._written, "any", lambda addr: looked.append(addr) or False)
        empty = os.open("/dev/null", os.O_RDONLY)
        os.close(homes._files["vmstat"])
        homes._files["vmstat"] = empty  # reads nothing: the count is gone
        # Even should the fault count stand where the lost count stood, what was known clean
        # by the lost count is looked at again.
        stood = homes._clean_at[a.path]
        monkeypatch.setattr(homes_module, "faults", lambda: stood)
        monkeypatch.setattr(window_module, "faults", lambda: stood)
        w.show(a.path)
        assert not homes.counts_locked_pages
        assert homes.at(a.path) in looked


_LOOKING_WORKER = """
import ctypes, resource, torch
# Buffers of 64 KiB and more come from fresh mappings, as they do in a process whose heap is
# fragmented: each one allocated costs page faults.
assert ctypes.CDLL(None).mallopt(-3, 64 * 1024) == 1  # M_MMAP_THRESHOLD
from aiowsync._planes.shm.slots import SlotFile
from aiowsync._planes.shm.window import SlotWindow
a, b = (SlotFile.create(i, 64 << 20) for i in range(2))  # 128 KiB of pagemap
try:
    w = SlotWindow(64 << 20)
    w.show(a.path); w.tensor.view(torch.float32).sum(); w.show(b.path)
    homes, fd = w._homes, w.open(a.path)
    for _ in range(3):  # first calls: torch's own first use of these ops
        homes.look(a.path, fd); homes.mark(); homes.locked()
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(5):
        homes.look(a.path, fd); homes.mark(); homes.locked()
    print(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    w.release()
finally:
    a.unlink(); b.unlink()
"""


def test_a_look_through_a_home_takes_no_page_fault_of_its_own() -> None:
    """A look that faulted (buffers it allocated afresh) would make the mapping shown
    meanwhile look written at the next switch, and its look would fault in turn: a look
    after every switch, for nothing."""
    import subprocess
    import sys

    with window() as w:
        if w._homes is None:
            pytest.skip("no moves here: every switch maps anew")
    out = subprocess.run(
        [sys.executable, "-c", _LOOKING_WORKER], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"


_LOCKED_WORKER = """
import ctypes, sys, torch
from aiowsync._planes.shm.slots import SlotFile
from aiowsync._planes.shm.window import SlotWindow
libc = ctypes.CDLL(None, use_errno=True)
def locked_kib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmLck:"))
a, b = (SlotFile.create(i, 1 << 20) for i in range(2))
try:
    w = SlotWindow(1 << 20)
    flat = w.tensor.view(torch.float32)
    seen = []
    def show(slot, value):
        slot.tensor.view(torch.float32).fill_(value)  # the sender's version
        w.show(slot.path)
        seen.append(torch.unique(flat).tolist())  # (a list of every float would be locked too)
    if sys.argv[1] == "future":
        assert libc.mlockall(2) == 0  # MCL_FUTURE: every mapping made from now on is filled
        show(a, 1.0); show(b, 2.0); show(a, 3.0); show(b, 4.0)
    else:
        show(a, 1.0); show(b, 2.0)
        assert libc.mlockall(1) == 0  # MCL_CURRENT, while a's mapping waits at its home
        show(a, 3.0); show(b, 4.0)
    # Moving a locked mapping would count its 1 MiB as locked again at each switch: 12 MiB
    # more over 12 switches. Other allocations come and go (locked too, under MCL_FUTURE).
    before = locked_kib()
    for value in range(5, 17):
        show(a if value % 2 else b, float(value))
    grown = locked_kib() - before
    libc.munlockall()
    w.release()
    assert seen[4:] == [[float(v)] for v in range(5, 17)], seen
    print(seen[:4], w._homes is None, grown < 6 * 1024)
finally:
    a.unlink(); b.unlink()
"""


@pytest.mark.parametrize("when", ["future", "current"])
def test_a_worker_that_locks_its_memory_sees_every_version(when: str) -> None:
    """mlock fills a private mapping with copies of the file as it is at that moment, which
    must not show at a later version; and moving a locked mapping would count it as locked
    once more at each switch. Such a worker maps each version anew, its locked memory
    steady."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _LOCKED_WORKER, when], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("[[1.0], [2.0], [3.0], [4.0]] True True"), out.stdout


async def test_a_home_that_cannot_be_mapped_anew_falls_back_and_shows_the_right_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with slots(2) as (a, b), window() as w:
        homes = w._homes
        if homes is None:
            pytest.skip("no moves here: every switch maps anew")
        fill(a, 1.0)
        fill(b, 2.0)
        flat = w.tensor.view(torch.float32)
        w.show(a.path)
        w.show(b.path)
        flat[5] = -1.0  # written: b's home must be mapped anew before it is shown again
        w.show(a.path)  # on a loop: the look at b's home waits for the switch to end
        assert homes.unsure() == [b.path]
        real, b_home = homes._calls.map, homes.at(b.path)

        def refuse(addr: int, size: int, prot: int, flags: int, fd: int) -> int:
            if addr == b_home:
                raise TransportError("mmap failed: Cannot allocate memory")
            return real(addr, size, prot, flags, fd)

        monkeypatch.setattr(homes._calls, "map", refuse)
        fill(b, 4.0)
        w.show(b.path)  # before the loop ran the look: b's home is looked at, and fails
        assert torch.equal(flat, torch.full_like(flat, 4.0))
        assert w._homes is None  # moves given up; the window maps each version anew
        await asyncio.sleep(0)  # the look scheduled before finds nothing left to do
        fill(a, 5.0)
        w.show(a.path)
        assert torch.equal(flat, torch.full_like(flat, 5.0))


def test_a_window_dropped_without_release_leaves_no_home_nor_descriptor() -> None:
    with slots(3) as files:
        gc.collect()  # windows of tests before
        held = open_files()
        w = SlotWindow(NBYTES)
        for f in files:
            w.show(f.path)
        assert w._homes is not None
        homes = [w._homes.at(f.path) for f in files[:-1]]
        del w
        gc.collect()
        with open("/proc/self/maps") as maps:
            starts = {int(line.split("-", 1)[0], 16) for line in maps}
        assert not starts & set(homes)
        assert open_files() == held  # the slot files' descriptors and the pagemap's


def open_files() -> list[str]:
    names = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sorted(n for n in names if "aiowsync-" in n or n.endswith("/pagemap"))
