"""A vLLM worker maps a version's pages in before it acks, once per slot mapping: the slot
stays mapped from version to version, so asking the kernel again would only cost time (on a
610 MiB model, 50-100 ms of each send on a busy core)."""

from __future__ import annotations

import mmap
import os
import uuid
import warnings
from collections.abc import Iterator

import pytest
import torch

from aiowsync.vllm._worker import PagesIn

MIB = 1 << 20


def mapped_kib(address: int) -> int:
    """The resident KiB of this process's mapping that starts at ``address`` (smaps' Rss)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and ":" not in head:
                start = int(head.split("-")[0], 16)
                inside = start == address
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping starts at {address:#x}")


@pytest.fixture
def slot() -> Iterator[tuple[torch.Tensor, mmap.mmap]]:
    """8 MiB of a file in /dev/shm, mapped read-only as a receiver maps a slot."""
    path = f"/dev/shm/aiowsync-test-pages-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 8 * MIB)
        os.pwrite(fd, b"\x01" * (8 * MIB), 0)  # in the page cache, not yet in this process
        mm = mmap.mmap(fd, 8 * MIB, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
        os.unlink(path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        tensor = torch.frombuffer(mm, dtype=torch.uint8)
    yield tensor, mm  # unmapped once the tensor and the mmap object are gone


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps")
def test_a_slot_is_mapped_in_on_its_first_version_only(
    slot: tuple[torch.Tensor, mmap.mmap],
) -> None:
    file, mm = slot
    address = file.untyped_storage().data_ptr()
    tensors = [file[: 2 * MIB].view(torch.float32), file[2 * MIB :]]
    pages = PagesIn()
    assert mapped_kib(address) == 0
    assert pages.needed(tensors)
    assert pages.map_in(tensors) == {(address, 8 * MIB)}  # one storage under both views
    assert mapped_kib(address) == 8 * 1024
    # The next version in the same slot: nothing to ask the kernel. (To see that it does not,
    # the pages are dropped from this process first; they stay dropped.)
    mm.madvise(mmap.MADV_DONTNEED)
    assert mapped_kib(address) == 0
    assert not pages.needed(tensors)
    assert pages.map_in(tensors) == set()
    assert mapped_kib(address) == 0
    # A storage it has not seen is mapped in.
    other = torch.zeros(MIB // 4)
    assert pages.needed([other, *tensors])
    assert pages.map_in([other, *tensors]) == {(other.data_ptr(), MIB)}
