"""``aiowsync doctor`` and ``aiowsync clean``: checking a host before a run, and removing a
crashed trainer's leftover slots."""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .._channel._socket_dir import remove_stale_socket_dirs
from .._planes.shm.slots import SHM_DIR, remove_stale_slots

__all__ = ["Finding", "clean_main", "doctor_main", "findings", "parse_size"]

Level = Literal["ok", "warn", "fail", "info"]

_UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6}
_UNITS.update({"GB": 10**9, "K": 2**10, "M": 2**20, "G": 2**30})
FD_ADVISED = 4096
"""Open files a trainer should be allowed: each worker costs the sender a few descriptors
(sockets, the monitor, slot mappings), and ZeroMQ aborts the process when it runs out."""


def parse_size(text: str) -> int:
    """Bytes in ``256MiB``, ``1GiB``, ``64M``, ``1000000``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 256MiB, 1GiB, 64M)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True, slots=True)
class Finding:
    level: Level
    what: str
    detail: str
    fix: str = ""


def findings(model_bytes: int, workers: int, slots: int = 2, shm: Path = SHM_DIR) -> list[Finding]:
    """Every check of this host, for a model of ``model_bytes`` sent to ``workers``."""
    return [
        _shared_memory(model_bytes, slots, shm),
        _open_files(workers),
        _copy_extension(),
        _openmp(),
        _namespaces(),
    ]


def _shared_memory(model_bytes: int, slots: int, shm: Path) -> Finding:
    what = f"shared memory ({shm})"
    try:
        st = os.statvfs(shm)
    except OSError as exc:
        return Finding(
            "fail",
            what,
            f"cannot be read: {exc.strerror}",
            "SharedMemWeightSyncScheme needs a tmpfs at /dev/shm; use DistributedWeightSyncScheme",
        )
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    need = model_bytes * slots
    room = need * 2  # slots are added while workers lag
    detail = (
        f"{_size(total)} in all, {_size(free)} free; a sender of a {_size(model_bytes)} model "
        f"needs {_size(need)} for its {slots} slots, and {_size(room)} leaves room for the "
        "slots added while workers lag"
    )
    if free >= room:
        return Finding("ok", what, detail)
    fix = (
        f"give /dev/shm at least {_size(room)}: in docker, "
        f"`docker run --shm-size={max(1, -(-room // 2**30))}g ...`; in Kubernetes, an "
        "emptyDir with medium: Memory mounted at /dev/shm; on a host, "
        f"`mount -o remount,size={max(1, -(-room // 2**30))}G /dev/shm`"
    )
    return Finding("fail" if free < need else "warn", what, detail, fix)


def _open_files(workers: int) -> Finding:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    shown = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
    detail = f"this shell may open {shown} files (hard limit {hard})"
    advised = max(FD_ADVISED, 64 * workers)
    if soft == resource.RLIM_INFINITY or soft >= advised:
        return Finding("ok", "open files", detail)
    wanted = max(advised, 65536)
    if hard != resource.RLIM_INFINITY and hard < advised:
        # The soft limit cannot rise past the hard one: that one must be raised first.
        fix = (
            f"raise the hard limit to {wanted} (as root `ulimit -Hn {wanted}`, "
            f"`docker run --ulimit nofile={wanted}:{wanted}`, or LimitNOFILE={wanted} in the "
            f"trainer's systemd unit), then `ulimit -n {wanted}`"
        )
    else:
        limit = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
        fix = (
            f"`ulimit -n {limit}` before starting the trainer, or LimitNOFILE= in its systemd unit"
        )
    return Finding(
        "warn", "open files", f"{detail}; {advised} or more is advised for {workers} workers", fix
    )


def _copy_extension() -> Finding:
    from .._copy.engine import streams_available

    try:
        from .._copy import _stream  # noqa: F401
    except ImportError:
        return Finding(
            "warn",
            "copy extension",
            "aiowsync._copy._stream is not built (no C compiler at install): large copies use "
            "torch's own copies instead of non-temporal stores, and read the destination "
            "into the cache first",
            "install a C compiler (e.g. `apt install gcc python3-dev`) and reinstall aiowsync",
        )
    if not streams_available():
        return Finding(
            "info",
            "copy extension",
            "built, but this CPU has no non-temporal stores it uses: plain copies",
        )
    return Finding("ok", "copy extension", "built; large copies use non-temporal stores")


def _openmp() -> Finding:
    policy = os.environ.get("OMP_WAIT_POLICY")
    cores = os.cpu_count() or 1
    detail = f"OMP_WAIT_POLICY={policy or '(unset)'}, {cores} CPUs"
    if policy is None or policy.upper() != "PASSIVE":
        if cores <= 8:
            return Finding(
                "warn",
                "OpenMP",
                f"{detail}: torch's OpenMP threads spin after each op, and with several torch "
                "processes on few cores they take the CPU from the workers' event loops",
                "`export OMP_WAIT_POLICY=PASSIVE` in the trainer's and the workers' "
                "environment (before torch is imported)",
            )
        return Finding("info", "OpenMP", detail)
    return Finding("ok", "OpenMP", detail)


def _namespaces() -> Finding:
    what = "network namespaces (the cross-host tests)"
    ip = shutil.which("ip")
    if ip is None:
        return Finding("info", what, "no `ip` command: those tests skip", "install iproute2")
    if os.geteuid() != 0:
        return Finding("info", what, "not root: those tests skip", "run them as root")
    try:
        done = subprocess.run(
            ["unshare", "--net", "true"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return Finding("info", what, f"cannot try one: {exc}: those tests skip")
    if done.returncode != 0:
        return Finding(
            "info",
            what,
            f"a new network namespace is refused ({done.stderr.strip()[:100]}): those tests skip",
            "run in a container with CAP_SYS_ADMIN and CAP_NET_ADMIN",
        )
    return Finding("ok", what, "root, `ip` present, new namespaces allowed")


def doctor_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="aiowsync doctor",
        description="Check this host for a run and print what to change.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model-bytes",
        type=parse_size,
        default=parse_size("256MiB"),
        help="size of the weights to send (e.g. 64MiB, 2GiB)",
    )
    parser.add_argument("--workers", type=int, default=4, help="workers the trainer will serve")
    parser.add_argument(
        "--slots", type=int, default=2, help="shared-memory slots (num_slots of the plane)"
    )
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    if args.slots < 2:
        parser.error(f"--slots must be at least 2 (a scheme needs two), got {args.slots}")
    worst = 0
    marks = {"ok": "ok  ", "info": "info", "warn": "WARN", "fail": "FAIL"}
    for f in findings(args.model_bytes, args.workers, args.slots):
        print(f"[{marks[f.level]}] {f.what}: {f.detail}")
        if f.fix:
            print(f"       fix: {f.fix}")
        worst = max(worst, {"ok": 0, "info": 0, "warn": 0, "fail": 1}[f.level])
    return worst


def clean_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="aiowsync clean",
        description=(
            "Remove this user's shared-memory slots and control-socket directories left by "
            "senders whose process is gone (a crashed trainer). Those of running senders and "
            "of other users are kept. A new sender does this by itself when it starts."
        ),
    )
    parser.parse_args(argv)
    removed = remove_stale_slots()
    for name in removed:
        print(f"removed {SHM_DIR / name}")
    print(f"{len(removed)} leftover slot(s) removed")
    dirs = remove_stale_socket_dirs()
    for directory in dirs:
        print(f"removed {directory}")
    print(f"{len(dirs)} leftover socket director(y/ies) removed")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(doctor_main(sys.argv[1:]))
