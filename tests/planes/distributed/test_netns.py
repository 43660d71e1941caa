"""Two hosts on one machine: receivers in a network namespace, joined to the sender by veth.

The sender stays in the test's own namespace and binds its control socket (and so its TCP store
and gloo groups) to its end of a veth pair; receivers run in a fresh namespace behind the other
end, so every byte crosses a real, non-loopback link. Needs root and iproute2.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import json
import logging
import os
import secrets
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest
import torch

import aiowsync
from _workers import digest, make_model, randomize
from aiowsync import CurveKeys, DistributedWeightSyncScheme, ZmqChannelFactory

pytestmark = pytest.mark.timeout(120)

WORKER = Path(__file__).resolve().parents[2] / "_netns_worker.py"
BUCKET_BYTES = 8 << 10  # as in _netns_worker.py: several buckets per version
IP_TIMEOUT = 10.0  # seconds for one `ip` command or the link probe
INTRUDER_DEADLINE = 3.0
EVENT_TIMEOUT = 30.0  # a worker's next report (its first includes importing torch)
EXIT_TIMEOUT = 3.0  # workers leave once their input ends; later ones are killed
REAP_TIMEOUT = 10.0  # a killed worker's exit, or a reader's end once the pipes closed
Event = dict[str, Any]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT, check=check
    )


@dataclass(frozen=True)
class Netns:
    name: str
    host_veth: str  # stays in the test's namespace, holds host_ip
    ns_veth: str  # moved into the namespace, holds ns_ip
    host_ip: str
    ns_ip: str

    def argv(self, *command: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *command]


def _free_subnet() -> tuple[str, str]:
    """Two addresses of a random 10.213.x.y/30 that no interface here uses yet."""
    used = _ip("-4", "-o", "addr", "show").stdout
    for _ in range(100):
        base = f"10.213.{secrets.randbelow(256)}.{secrets.randbelow(64) * 4}"
        prefix, last = base.rsplit(".", 1)
        pair = f"{prefix}.{int(last) + 1}", f"{prefix}.{int(last) + 2}"
        if not any(f" {ip}/" in used for ip in pair):
            return pair
    raise RuntimeError("found no free /30 in 10.213.0.0/16")


def _remove(ns: Netns) -> None:
    """Delete the pair and the namespace by name; idempotent, never raises."""
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        # Deleting one end deletes both, at once (a namespace's own teardown is deferred).
        _ip("link", "del", ns.host_veth, check=False)
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        _ip("netns", "del", ns.name, check=False)


def _probe(ns: Netns) -> None:
    """Fail unless a process in the namespace reaches ``host_ip`` over the pair."""
    with socket.socket() as listener:
        listener.bind((ns.host_ip, 0))
        listener.listen(1)
        listener.settimeout(IP_TIMEOUT)
        port = listener.getsockname()[1]
        code = f"import socket; socket.create_connection(({ns.host_ip!r}, {port}), {IP_TIMEOUT})"
        run = subprocess.run(
            ns.argv(sys.executable, "-c", code),
            capture_output=True,
            text=True,
            timeout=IP_TIMEOUT + 5,
        )
        assert run.returncode == 0, f"the namespace cannot reach {ns.host_ip}: {run.stderr}"
        listener.accept()[0].close()


@pytest.fixture(scope="module")
def netns() -> Iterator[Netns]:
    """A namespace ``aiowsync-test-<random>`` joined to this one by a veth pair on a /30."""
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed")
    token = secrets.token_hex(4)
    host_ip, ns_ip = _free_subnet()
    # Interface names are at most 15 characters.
    ns = Netns(f"aiowsync-test-{token}", f"awsh{token}", f"awsn{token}", host_ip, ns_ip)
    made = _ip("netns", "add", ns.name, check=False)
    if made.returncode != 0:
        pytest.skip(f"`ip netns add` failed (no CAP_SYS_ADMIN here?): {made.stderr.strip()}")
    # An interrupted session may skip fixture teardown; atexit still removes what we made.
    cleanup = functools.partial(_remove, ns)
    atexit.register(cleanup)
    try:
        veth = _ip(
            "link", "add", ns.host_veth, "type", "veth",
            "peer", "name", ns.ns_veth, "netns", ns.name,
            check=False,
        )  # fmt: skip
        if veth.returncode != 0:
            pytest.skip(f"cannot create a veth pair: {veth.stderr.strip()}")
        entered = subprocess.run(
            ns.argv("true"), capture_output=True, text=True, timeout=IP_TIMEOUT
        )
        if entered.returncode != 0:
            pytest.skip(f"`ip netns exec` cannot enter a namespace: {entered.stderr.strip()}")
        _ip("addr", "add", f"{host_ip}/30", "dev", ns.host_veth)
        _ip("link", "set", ns.host_veth, "up")
        _ip("-n", ns.name, "addr", "add", f"{ns_ip}/30", "dev", ns.ns_veth)
        _ip("-n", ns.name, "link", "set", ns.ns_veth, "up")
        _ip("-n", ns.name, "link", "set", "lo", "up")
        _probe(ns)
        yield ns
    finally:
        cleanup()
        atexit.unregister(cleanup)
    assert ns.name not in _ip("netns", "list").stdout.split(), "the namespace was not removed"
    assert _ip("link", "show", ns.host_veth, check=False).returncode != 0, "veth left behind"


def _listening_ports(ip: str) -> set[int]:
    """TCP ports this namespace listens on at ``ip`` (from /proc, so no tool is needed)."""
    ports = set()
    for line in Path("/proc/self/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        hex_ip, hex_port = local.split(":")
        if state == "0A" and socket.inet_ntoa(struct.pack("<I", int(hex_ip, 16))) == ip:
            ports.add(int(hex_port, 16))
    return ports


def _port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


class NsWorkers:
    """Worker processes inside the namespace, read line by line; close() kills and reaps all."""

    def __init__(self, ns: Netns, logs: Path) -> None:
        self.ns = ns
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.pids: set[int] = set()
        self._events: asyncio.Queue[tuple[str, Event]] = asyncio.Queue()
        self._backlog: list[tuple[str, Event]] = []
        self._readers: list[threading.Thread] = []
        self._files: list[IO[str]] = []
        self._loop = asyncio.get_running_loop()

    def start(self, name: str, keys: dict[str, str | None], *args: str) -> None:
        env = {**os.environ, "AIOWSYNC_NETNS_KEYS": json.dumps(keys), "OMP_WAIT_POLICY": "PASSIVE"}
        stderr = open(self.logs / f"{name}.stderr", "w")  # noqa: SIM115 - closed by close()
        self._files.append(stderr)
        proc = subprocess.Popen(
            self.ns.argv(sys.executable, str(WORKER), *args),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
        self.procs[name] = proc
        reader = threading.Thread(target=self._read, args=(name, proc), daemon=True)
        reader.start()
        self._readers.append(reader)

    def _read(self, name: str, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # not ours (a library printing to stdout)
            self._put(name, event)
        self._put(name, {"event": "exit"})

    def _put(self, name: str, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the test's loop is already closed
            self._loop.call_soon_threadsafe(self._events.put_nowait, (name, event))

    def tell(self, name: str, line: str) -> None:
        stdin = self.procs[name].stdin
        assert stdin is not None
        stdin.write(line + "\n")
        stdin.flush()

    def _stderr(self, name: str) -> str:
        with contextlib.suppress(OSError):
            return (self.logs / f"{name}.stderr").read_text()[-3000:]
        return ""

    async def collect(
        self, kind: str, names: Sequence[str], timeout: float = EVENT_TIMEOUT
    ) -> list[tuple[str, Event]]:
        """The next event of ``kind`` from each of ``names`` (a name may appear twice)."""
        wanted = list(names)
        got: list[tuple[str, Event]] = []
        deadline = time.monotonic() + timeout
        for item in list(self._backlog):
            if item[1]["event"] == kind and item[0] in wanted:
                self._backlog.remove(item)
                wanted.remove(item[0])
                got.append(item)
        while wanted:
            left = deadline - time.monotonic()
            try:
                name, event = await asyncio.wait_for(self._events.get(), max(left, 0.0))
            except asyncio.TimeoutError:
                raise AssertionError(
                    f"no {kind!r} from {wanted} within {timeout} s; stderr: "
                    + "".join(f"\n--- {n}:\n{self._stderr(n)}" for n in sorted(set(wanted)))
                ) from None
            if "pid" in event:
                self.pids.add(event["pid"])
            if event["event"] == kind and name in wanted:
                wanted.remove(name)
                got.append((name, event))
            elif event["event"] in ("error", "exit") and name in wanted:
                raise AssertionError(
                    f"{name} failed while we waited for {kind!r}: {event}\n" + self._stderr(name)
                )
            else:
                self._backlog.append((name, event))
        return got

    async def stop(self, names: Sequence[str]) -> dict[str, Event]:
        """Ask ``names`` to leave; their ``done`` reports."""
        for name in names:
            self.tell(name, "stop")
        return dict(await self.collect("done", names))

    async def exited(self, names: Sequence[str]) -> dict[str, int | None]:
        """Exit codes, once each process closed its output (tearing torch down takes seconds)."""
        await self.collect("exit", names)
        return {name: self.procs[name].wait(IP_TIMEOUT) for name in names}

    def close(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(OSError):
                assert proc.stdin is not None
                proc.stdin.close()  # end of input: a worker's cue to leave
        deadline = time.monotonic() + EXIT_TIMEOUT
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(REAP_TIMEOUT)
        for reader in self._readers:
            reader.join(REAP_TIMEOUT)
        for proc in self.procs.values():
            if proc.stdout is not None:
                proc.stdout.close()
        for f in self._files:
            f.close()


@contextlib.contextmanager
def ns_workers(ns: Netns, logs: Path) -> Iterator[NsWorkers]:
    w = NsWorkers(ns, logs)
    try:
        yield w
    finally:
        w.close()


def _scheme(bind: str, channels: ZmqChannelFactory | None = None) -> DistributedWeightSyncScheme:
    return DistributedWeightSyncScheme(
        backend="gloo", bucket_bytes=BUCKET_BYTES, bind=bind, channels=channels
    )


async def test_binding_the_veth_address_is_authenticated_unless_opted_out(netns: Netns) -> None:
    # Before, such a bind was refused without keys; now the scheme makes keys of its own.
    address = f"tcp://{netns.host_ip}:0"
    default = _scheme(address)
    default.init_on_sender(model=make_model("small"), num_workers=1)
    async with default:
        assert default.address.startswith(f"tcp://{netns.host_ip}:")
        assert _port_of(default.address) in _listening_ports(netns.host_ip)
        keys = default.channels.curve  # type: ignore[attr-defined]
        assert keys is not None and keys.server_secret is not None
    assert _listening_ports(netns.host_ip) == set(), "the sender left a port open"

    insecure = _scheme(address, ZmqChannelFactory(allow_insecure_bind=True))
    insecure.init_on_sender(model=make_model("small"), num_workers=1)
    async with insecure:
        assert insecure.address.startswith(f"tcp://{netns.host_ip}:")
        assert _port_of(insecure.address) in _listening_ports(netns.host_ip)
        assert insecure.channels.curve is None  # type: ignore[attr-defined]
    assert _listening_ports(netns.host_ip) == set()


async def test_receivers_in_another_namespace_get_each_version_and_intruders_stay_out(
    netns: Netns, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    keys = CurveKeys.generate()
    mine = keys.for_receiver()
    legit = {
        "server_public": mine.server_public,
        "client_public": mine.client_public,
        "client_secret": mine.client_secret,
    }
    model = make_model("small")
    scheme = _scheme(f"tcp://{netns.host_ip}:0", ZmqChannelFactory(curve=keys))
    scheme.init_on_sender(model=model, num_workers=2)
    receivers = ["r0", "r1"]
    caplog.set_level(logging.WARNING, logger="aiowsync.auth")

    async def send(w: NsWorkers, version: int) -> None:
        randomize(model, seed=version)
        result = await scheme.send(timeout=20)
        assert (result.version, result.worker_ids) == (version, (0, 1))
        seen = await w.collect("version", receivers)
        assert {name: (e["version"], e["digest"]) for name, e in seen} == dict.fromkeys(
            receivers, (version, digest(model))
        ), f"content differs at version {version}"

    with ns_workers(netns, tmp_path) as w:
        async with scheme:
            assert scheme.address.startswith("tcp://10.213.")
            assert scheme.address.startswith(f"tcp://{netns.host_ip}:")
            for idx, name in enumerate(receivers):
                w.start(name, legit, "receiver", scheme.address, str(idx))
            # The intruder knows the sender's public key only; it claims a live worker's index,
            # so a hello that got through would be refused rather than time out.
            w.start(
                "intruder",
                {"server_public": keys.server_public},
                "intruder", scheme.address, "0", str(INTRUDER_DEADLINE),
            )  # fmt: skip
            await asyncio.wait_for(scheme.connect(timeout=45), 60)
            ready = await w.collect("ready", receivers)
            assert {name: (e["version"], e["digest"]) for name, e in ready} == dict.fromkeys(
                receivers, (0, digest(model))
            )
            # The hooks saw version 0 applied too.
            first = await w.collect("version", receivers)
            assert {(e["version"], e["digest"]) for _, e in first} == {(0, digest(model))}
            await w.collect("armed", ["intruder"])

            await send(w, 1)
            dropped = scheme.dropped_messages
            w.tell("intruder", "go")
            await send(w, 2)  # while the intruders knock
            attempts = dict(
                (e["name"], e)
                for _, e in await w.collect(
                    "attempt", ["intruder", "intruder"], INTRUDER_DEADLINE + EVENT_TIMEOUT
                )
            )
            assert set(attempts) == {"wrong client keys", "no CURVE"}
            for name, attempt in attempts.items():
                assert attempt["error"] == aiowsync.WeightSyncTimeout.__name__, (name, attempt)
                assert attempt["is_timeout"], (name, attempt)
                assert attempt["took"] < INTRUDER_DEADLINE + 5.0, (name, attempt)
                assert attempt["untouched"], (name, attempt)
            await w.collect("done", ["intruder"])
            assert await w.exited(["intruder"]) == {"intruder": 0}
            assert scheme.dropped_messages == dropped
            wrong_key = attempts["wrong client keys"]["client_public"]
            assert any(wrong_key in r.getMessage() for r in caplog.records), "ZAP saw no wrong key"

            await send(w, 3)
            done = await w.stop(receivers)
            assert {name: (e["version"], e["connected"]) for name, e in done.items()} == (
                dict.fromkeys(receivers, (3, True))
            )
            assert await w.exited(receivers) == dict.fromkeys(receivers, 0)
        assert _listening_ports(netns.host_ip) == set(), "the closed sender left a port open"
    assert _ip("netns", "pids", netns.name).stdout.split() == [], "a process outlived the test"
    leftovers = [
        n for n in os.listdir("/dev/shm") if any(n.startswith(f"aiowsync-{p}-") for p in w.pids)
    ]
    assert leftovers == [], f"workers left shared memory behind: {leftovers}"
