"""The slot window on its own: real slot files in /dev/shm, shown one after the other in one
range of address space, as a swap-mode receiver's switches do."""

from __future__ import annotations

import asyncio
import contextlib
import resource
from collections.abc import Iterator

import pytest
import torch

from aiowsync._planes.shm import mapping
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
        if w._written is not None:  # moves work here: a's pages came back with their tables
            assert faults < 16, faults
        else:  # mapped anew: 2048 pages faulted in, some 16 at a time
            assert faults >= 2048 // 16


def test_pages_a_worker_wrote_are_dropped_at_the_switch_away_from_them() -> None:
    with slots(2) as (a, b), window() as w:
        if w._written is None:
            pytest.skip("no pagemap here: every switch maps anew")
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
        assert w._written is None and w._homes == {}  # gave up moving, and its homes
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
        homes = dict(w._homes)
        w.release()
        assert w._homes == {} and w.showing is None
        assert w.tensor.count_nonzero().item() == 0
        with open("/proc/self/maps") as maps:
            starts = {int(line.split("-", 1)[0], 16) for line in maps}
        assert not starts & set(homes.values())


async def test_on_an_event_loop_written_pages_are_found_after_the_switch_or_before_a_show() -> None:
    with slots(2) as (a, b), window() as w:
        if w._written is None:
            pytest.skip("no pagemap here: every switch maps anew")
        fill(a, 1.0)
        fill(b, 2.0)
        flat = w.tensor.view(torch.float32)
        w.show(a.path)
        flat[100] = -1.0
        w.show(b.path)  # the switch itself looks at nothing: a's home is checked afterwards
        assert w._unchecked == {a.path}
        await asyncio.sleep(0)
        assert w._unchecked == set()
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
    mapping came in, nothing in it can be the worker's, and its pagemap is not read."""
    from aiowsync._planes.shm import window as module

    count = [100]
    monkeypatch.setattr(module, "_faults", lambda: count[0])
    with slots(2) as (a, b), window() as w:
        if w._written is None:
            pytest.skip("no pagemap here: every switch maps anew")
        w.show(a.path)
        w.show(b.path)
        assert w._unchecked == set()  # no fault while a was shown: no look
        count[0] += 1  # a fault while b is shown (a read, a write: all alike)
        looked: list[int] = []
        monkeypatch.setattr(w._written, "any", lambda addr: looked.append(addr) or False)
        w.show(a.path)  # no event loop here: b's home is looked through at once
        assert looked == [w._homes[b.path]] and w._unchecked == set()
        w.show(a.path)  # the same file again, no fault since: no look
        assert looked == [w._homes[b.path]]
