"""Non-temporal copies (``aiowsync._copy._stream``): every byte lands, nothing else is touched."""

from __future__ import annotations

import platform
import shutil
import threading

import pytest
import torch

from aiowsync._copy.engine import CopyPolicy, default_policy, fused_copy, pack_moves

stream = pytest.importorskip("aiowsync._copy._stream")

_X86 = platform.machine().lower() in {"x86_64", "amd64"}


def test_the_module_is_built_and_streams_where_a_compiler_and_x86_64_are() -> None:
    if not (_X86 and (shutil.which("cc") or shutil.which("gcc"))):
        pytest.skip("no x86-64 compiler here")
    assert stream.STREAMS is True
    assert CopyPolicy().streaming is True  # on by default


SIZES = [0, 1, 15, 16, 63, 64, 65, 4095, 4096, 4097, 4096 + 48, 65536 + 13, (1 << 20) + 7]


@pytest.mark.parametrize("dst_shift", [0, 1, 8, 15, 16, 33])
@pytest.mark.parametrize("src_shift", [0, 3, 16])
def test_every_length_and_alignment_is_copied_exactly_and_nothing_around_it(
    dst_shift: int, src_shift: int
) -> None:
    g = torch.Generator().manual_seed(dst_shift * 100 + src_shift)
    pad = 64
    moves = []
    checks = []
    keep = []
    for n in SIZES:
        src = torch.randint(0, 256, (n + src_shift + pad,), dtype=torch.uint8, generator=g)
        dst = torch.full((n + dst_shift + 2 * pad,), 0xAB, dtype=torch.uint8)
        keep += [src, dst]
        moves.append((dst.data_ptr() + pad + dst_shift, src.data_ptr() + src_shift, n))
        checks.append((dst, src, n))
    stream.copy_moves(pack_moves(moves))
    for dst, src, n in checks:
        start = pad + dst_shift
        assert torch.equal(dst[start : start + n], src[src_shift : src_shift + n]), n
        assert bool((dst[:start] == 0xAB).all()), f"{n}: bytes before the range changed"
        assert bool((dst[start + n :] == 0xAB).all()), f"{n}: bytes after the range changed"


def test_moves_copy_into_one_buffer_end_to_end_from_two_threads() -> None:
    g = torch.Generator().manual_seed(7)
    pieces = [
        torch.randint(0, 256, (int(n),), dtype=torch.uint8, generator=g)
        for n in torch.randint(1, 200_000, (300,), generator=g)
    ]
    total = sum(p.numel() for p in pieces)
    out = torch.zeros(total, dtype=torch.uint8)
    moves, at = [], out.data_ptr()
    for p in pieces:
        moves.append((at, p.data_ptr(), p.numel()))
        at += p.numel()
    half = len(moves) // 2
    other = threading.Thread(target=stream.copy_moves, args=(pack_moves(moves[half:]),))
    other.start()
    stream.copy_moves(pack_moves(moves[:half]))
    other.join(timeout=30)
    assert not other.is_alive()
    assert torch.equal(out, torch.cat(pieces))


def test_a_buffer_of_partial_triples_or_no_buffer_is_refused() -> None:
    with pytest.raises(ValueError, match="whole"):
        stream.copy_moves(b"\0" * 23)
    with pytest.raises(TypeError):
        stream.copy_moves("not a buffer")
    stream.copy_moves(b"")  # no moves: nothing to do


def test_a_policy_streams_or_not_as_created_and_reads_the_environment_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src = torch.randn(2_000_000)
    for on in (False, stream.STREAMS):
        dst = torch.zeros_like(src)
        policy = CopyPolicy(streaming=on)
        assert policy.streaming is on
        fused_copy([dst], [src], policy)
        policy.close()
        assert torch.equal(dst, src)
    default = default_policy()
    monkeypatch.setenv("AIOWSYNC_STREAM", "0")
    assert CopyPolicy().streaming is False
    assert default_policy() is default  # made once, not changed by a later environment


def test_without_the_module_copies_are_plain_and_cannot_be_turned_on() -> None:
    """An install that could not build ``_stream`` (no compiler) still copies, with plain
    stores, and says so."""
    import subprocess
    import sys

    code = """
import sys
sys.modules["aiowsync._copy._stream"] = None  # as if it had not been built
import torch
from aiowsync._copy import engine as _copy
assert _copy._stream is None and not _copy.default_policy().streaming
try:
    _copy.CopyPolicy(streaming=True)
except RuntimeError as e:
    assert "not built" in str(e)
else:
    raise AssertionError("turned on without the module")
src = [torch.randn(300_000) for _ in range(8)]
dst = [torch.zeros_like(t) for t in src]
_copy.fused_copy(dst, src)
assert all(torch.equal(d, s) for d, s in zip(dst, src))
print("plain ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "plain ok" in done.stdout
