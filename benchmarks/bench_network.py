"""A network that behaves like one: hosts as network namespaces behind rate-limited links.

Every host (the sender's and each receiver host) is a network namespace joined to one bridge
by a veth pair whose two ends are limited with the token-bucket qdisc (``tc ... tbf``), in
both directions, like a NIC of that rate. For each model size and number of receiver hosts,
one run measures:

- ``raw``: one TCP transfer of the model's bytes from the sender's host to one other host;
- ``star``: ``DistributedWeightSyncScheme`` (gloo) sending to one receiver per host;
- ``chain``: the same with ``topology="chain"``;
- ``relay``: the chain to one relay per host, each relaying over shared memory to two local
  workers (``upstream.relay_to(local)``): the time until every worker of every host runs it.

Each ``send()`` is timed from the trainer, the scheme with its defaults (digests on;
``--no-digest`` turns them off); ratios are against the same run's ``raw``. Needs root,
iproute2 and tc. Everything it creates is removed at the end, also on error.

    sudo .venv/bin/python benchmarks/bench_network.py --hosts 1,2,4 --mib 64,256
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.abspath(__file__)


# -- the processes inside the namespaces (this file run with a role) ---------------------------


def _model(mib: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.ParameterList([nn.Parameter(torch.zeros(mib << 16)) for _ in range(4)])


def _say(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


def _role(argv: list[str]) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import asyncio

    import torch

    import aiowsync

    torch.set_num_threads(1)
    role, mib = argv[0], int(argv[1])

    def _open_channels() -> aiowsync.ZmqChannelFactory:
        # The namespaces are this benchmark's own, reachable by nothing else: no CURVE keys,
        # on the sender's side and on its workers'.
        return aiowsync.ZmqChannelFactory(allow_insecure_bind=True)

    timeouts = aiowsync.Timeouts(handshake=300, ack=300, transfer=300)

    async def sender(ip: str, n: int, topology: str, digests: str) -> None:
        model = _model(mib)
        scheme = aiowsync.DistributedWeightSyncScheme(
            bind=f"tcp://{ip}:0",
            topology=topology,  # type: ignore[arg-type]
            integrity=None if digests == "default" else False,
            bucket_bytes=4 << 20,
            timeouts=timeouts,
            channels=_open_channels(),
        )
        scheme.init_on_sender(model=model, num_workers=n)
        async with scheme:
            _say(address=scheme.address)
            await scheme.connect(timeout=300)
            _say(ready=True)
            for line in sys.stdin:
                if line.strip() != "send":
                    break
                with torch.no_grad():
                    for p in model:
                        p.add_(1)
                started = time.perf_counter()
                await scheme.send(timeout=300)
                _say(send=time.perf_counter() - started)

    async def receiver(address: str, idx: int) -> None:
        scheme = aiowsync.DistributedWeightSyncScheme(
            address=address, timeouts=timeouts, channels=_open_channels()
        )
        scheme.init_on_receiver(model=_model(mib), worker_idx=idx)
        async with scheme:
            await scheme.connect(timeout=300)
            await asyncio.to_thread(sys.stdin.read)

    async def relay(address: str, idx: int, leaves: int) -> None:
        model = _model(mib)
        upstream = aiowsync.DistributedWeightSyncScheme(
            address=address, timeouts=timeouts, channels=_open_channels()
        )
        upstream.init_on_receiver(model=model, worker_idx=idx)
        local = aiowsync.SharedMemWeightSyncScheme(timeouts=timeouts)
        local.init_on_sender(model=model, num_workers=leaves)
        upstream.relay_to(local)
        async with local:
            procs = [
                await asyncio.create_subprocess_exec(
                    sys.executable, HERE, "--role", "leaf", str(mib), local.address, str(i)
                )
                for i in range(leaves)
            ]
            try:
                async with upstream:
                    await upstream.connect(timeout=300)
                    await local.connect(timeout=300)
                    await asyncio.to_thread(sys.stdin.read)
            finally:
                for proc in procs:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    await proc.wait()

    async def leaf(address: str, idx: int) -> None:
        scheme = aiowsync.SharedMemWeightSyncScheme(address=address, timeouts=timeouts)
        scheme.init_on_receiver(model=_model(mib), worker_idx=idx)
        async with scheme:
            await scheme.connect(timeout=300)
            await asyncio.sleep(3600)

    if role == "sender":
        asyncio.run(sender(argv[2], int(argv[3]), argv[4], argv[5]))
    elif role == "receiver":
        asyncio.run(receiver(argv[2], int(argv[3])))
    elif role == "relay":
        asyncio.run(relay(argv[2], int(argv[3]), int(argv[4])))
    elif role == "leaf":
        asyncio.run(leaf(argv[2], int(argv[3])))
    elif role == "raw-server":
        with socket.socket() as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((argv[2], 5601))
            listener.listen(1)
            _say(listening=True)
            conn, _ = listener.accept()
            left, buf = mib << 20, bytearray(1 << 20)
            while left > 0:
                got = conn.recv_into(buf)
                if not got:
                    break
                left -= got
            conn.sendall(b"k")
            conn.close()
    elif role == "raw-client":
        data = bytes(mib << 20)
        with socket.create_connection((argv[2], 5601), timeout=300) as conn:
            started = time.perf_counter()
            conn.sendall(data)
            conn.recv(1)
            _say(raw=time.perf_counter() - started)


# -- the orchestrator -----------------------------------------------------------------------


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=30, check=check)


class Network:
    """A bridge and ``hosts + 1`` namespaces (host 0 is the sender's), every link limited."""

    def __init__(self, hosts: int, rate: str) -> None:
        token = secrets.token_hex(3)
        self.bridge = f"awb{token}"
        self.names = [f"aw{token}h{i}" for i in range(hosts + 1)]
        self.subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
        self.rate = rate
        atexit.register(self.remove)

    def ip_of(self, host: int) -> str:
        return f"{self.subnet}.{host + 1}"

    def build(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "up")
        limit = ["tbf", "rate", self.rate, "burst", "256kb", "latency", "100ms"]
        for host, ns in enumerate(self.names):
            outer, inner = f"{ns}a", f"{ns}b"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns)
            _run("ip", "link", "set", outer, "master", self.bridge)
            _run("ip", "link", "set", outer, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.ip_of(host)}/24", "dev", inner)
            _run("ip", "-n", ns, "link", "set", inner, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("tc", "qdisc", "add", "dev", outer, "root", *limit)  # into the host
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", inner, "root", *limit)

    def remove(self) -> None:
        for ns in self.names:
            _run("ip", "link", "del", f"{ns}a", check=False)
            _run("ip", "netns", "del", ns, check=False)
        _run("ip", "link", "del", self.bridge, check=False)

    def spawn(self, host: int, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            ["ip", "netns", "exec", self.names[host], sys.executable, HERE, "--role", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )


def _read(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"a benchmark process ended early (exit {proc.wait()})")
    return json.loads(line)  # type: ignore[no-any-return]


def _end(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        with contextlib.suppress(OSError, ValueError):
            assert proc.stdin is not None
            proc.stdin.close()
    for proc in procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _sends(
    net: Network, mib: int, hosts: int, mode: str, samples: int, digests: str
) -> list[float]:
    topology = "star" if mode == "star" else "chain"
    sender = net.spawn(0, "sender", str(mib), net.ip_of(0), str(hosts), topology, digests)
    procs = [sender]
    try:
        address = _read(sender)["address"]
        for host in range(1, hosts + 1):
            if mode == "relay":
                procs.append(net.spawn(host, "relay", str(mib), address, str(host - 1), "2"))
            else:
                procs.append(net.spawn(host, "receiver", str(mib), address, str(host - 1)))
        _read(sender)  # every receiver (or relay, with its workers) holds version 0
        times = []
        assert sender.stdin is not None
        for _ in range(samples):
            sender.stdin.write("send\n")
            sender.stdin.flush()
            times.append(_read(sender)["send"])
        return times
    finally:
        _end(procs)


def _raw(net: Network, mib: int) -> float:
    server = net.spawn(1, "raw-server", str(mib), net.ip_of(1))
    try:
        _read(server)
        client = net.spawn(0, "raw-client", str(mib), net.ip_of(1))
        try:
            return float(_read(client)["raw"])
        finally:
            _end([client])
    finally:
        _end([server])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", default="1,2,4", help="receiver host counts (default 1,2,4)")
    p.add_argument("--mib", default="64,256", help="model sizes in MiB (default 64,256)")
    p.add_argument("--rate", default="1gbit", help="every link's rate, as tc reads it")
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--modes", default="star,chain,relay")
    p.add_argument("--out", default="bench-network.json")
    p.add_argument(
        "--no-digest",
        action="store_true",
        help="senders without digests (integrity=False); default: the scheme's, on",
    )
    args = p.parse_args()
    digests = "off" if args.no_digest else "default"
    hosts = [int(h) for h in args.hosts.split(",")]
    modes = args.modes.split(",")
    net = Network(max(hosts), args.rate)
    rows = []
    try:
        net.build()
        for mib in (int(m) for m in args.mib.split(",")):
            for n in hosts:
                raw = _raw(net, mib)
                row: dict[str, Any] = {"mib": mib, "hosts": n, "raw_s": raw}
                line = f"{mib:>4} MiB x{n} hosts: raw {raw:.2f} s"
                for mode in modes:
                    times = _sends(net, mib, n, mode, args.samples, digests)
                    median = statistics.median(times)
                    row[f"{mode}_s"] = times
                    line += f" | {mode} {median:.2f} s ({median / raw:.2f}x)"
                rows.append(row)
                print(line, flush=True)
    finally:
        net.remove()
        atexit.unregister(net.remove)
    with open(args.out, "w") as f:
        json.dump({"rate": args.rate, "digests": digests, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--role":
        _role(sys.argv[2:])
    else:
        sys.exit(main())
