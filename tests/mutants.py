"""Plant known bugs into a scratch copy of the library and show which tests catch each one.

    .venv/bin/python tests/mutants.py                 # every mutant, the default tests
    .venv/bin/python tests/mutants.py --only pins     # one mutant
    .venv/bin/python tests/mutants.py --tests tests/scheme/test_scheme_lifecycle.py -k lag
    .venv-vllm/bin/python tests/mutants.py --vllm      # aiowsync.vllm's, on real vLLM servers

Each mutant is one exact replacement in one source file (the script stops if the original
text is gone, so it cannot silently test nothing). The copy of ``src/`` and ``tests/`` lives
in a temporary folder and goes first on ``PYTHONPATH``; the repository is never touched. The
report is a Markdown table: each mutant, how many tests failed, and their names. A mutant
that no test catches ("survived") makes the script exit with 1. tests/README.md says how to
run it and keeps the table of its latest run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What was tests/test_behaviour.py and tests/test_layout.py before the suite followed the packages,
# and the chain, the digests and the relays (issue 44).
DEFAULT_TESTS = [
    "tests/scheme/test_scheme_sends.py",
    "tests/scheme/test_scheme_failures.py",
    "tests/scheme/test_scheme_lifecycle.py",
    "tests/weights/test_layout.py",
    "tests/weights/test_rehome.py",
    "tests/copy/test_copy_jobs.py",
    "tests/copy/test_gather.py",
    "tests/receiving/test_leases.py",
    "tests/planes/distributed/test_dist_scheme.py",
    "tests/planes/distributed/test_dist_chain.py",
    "tests/planes/distributed/test_dist_links.py",
    "tests/planes/test_integrity.py",
    "tests/scheme/test_relays.py",
]
# Left out of the default run: it spawns seven processes, and the in-process relay tests cover
# the same code (name it with --tests to run it).
DESELECTED = [
    "tests/scheme/test_relays.py::test_a_root_sends_through_two_relays_to_four_shared_memory_leaves",
]
FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    path: str
    old: str
    new: str


MUTANTS = [
    Mutant(
        "pins",
        "the sender pins only its latest version, not the versions lagging workers still read",
        "src/aiowsync/_sending/peers.py",
        "                pinned.add(peer.deferred.version)\n        return pinned\n",
        "                pinned.add(peer.deferred.version)\n        return {current}\n",
    ),
    Mutant(
        "guard",
        "a switch does not wait for readers to leave the read guard",
        "src/aiowsync/_receiving/guard.py",
        "            if self._readers:\n                return False\n",
        "            if False:\n                return False\n",
    ),
    Mutant(
        "one-bucket",
        "a distributed receiver in a star switches once its first bucket arrived, not all",
        "src/aiowsync/_planes/dist/receiver.py",
        "            for (index, _), work in zip(targets, works, strict=True):\n",
        "            for (index, _), work in zip(targets[:1], works[:1], strict=True):\n",
    ),
    Mutant(
        "layout-check",
        "the handshake skips the layout check (any model is welcomed)",
        "src/aiowsync/_sending/handshake.py",
        "    if hello.fingerprint != layout.fingerprint:\n",
        "    if False:\n",
    ),
    Mutant(
        "no-hooks",
        "a receiver acks a version without running its hooks",
        "src/aiowsync/_receiving/updates.py",
        "            if self._applier.hooks:\n"
        "                await self._applier.run_hooks(version)\n"
        "            answer = Ack(",
        "            answer = Ack(",
    ),
    Mutant(
        "chain-last-bucket",
        "a chain member never forwards its last bucket (the sender's retry still delivers)",
        "src/aiowsync/_planes/dist/chain.py",
        "        if after is not None and not broken:\n",
        "        if after is not None and not broken and number < len(targets) - 1:\n",
    ),
    Mutant(
        "publish-unsealed",
        "publish() returns before the version's bytes are its own (packed later, on the wire)",
        "src/aiowsync/_sending/engine.py",
        "            await to_the_end(self.state.plane.seal(staged.version))\n        finally:",
        "            pass\n        finally:",
    ),
    Mutant(
        "one-lease-ends-all",
        "ending one of two leases of a version gives the version up",
        "src/aiowsync/_receiving/lease.py",
        "            if held.count > 0:\n                return\n",
        "            if False:\n                return\n",
    ),
    Mutant(
        "oldest-in-flight",
        "a worker's in_flight reports the oldest version in flight, not the newest",
        "src/aiowsync/_sending/workers.py",
        "    inflight = max(peer.inflight, default=None)\n",
        "    inflight = min(peer.inflight, default=None)\n",
    ),
    Mutant(
        "relay-acks-short",
        "a relay acknowledges a version though a leaf does not hold it",
        "src/aiowsync/_scheme/relay.py",
        "        if missing or failure:\n",
        "        if failure:\n",
    ),
    Mutant(
        "relay-renumbers",
        "a relay sends its leaves the version after its own last, not the root's number",
        "src/aiowsync/_scheme/relay.py",
        "                    version=version,\n",
        "                    version=core.version + 1,\n",
    ),
    Mutant(
        "digest-skips-last",
        "a receiver's digest check skips the last bucket",
        "src/aiowsync/_planes/digest.py",
        "enumerate(zip(got, ranges, strict=True))",
        "enumerate(zip(got[:-1], ranges[:-1], strict=True))",
    ),
    Mutant(
        "digest-half-buckets",
        "a digest covers the first half of each bucket only (sender and receiver alike)",
        "src/aiowsync/_planes/digest.py",
        "arrays[b][lo:hi].data",
        "arrays[b][lo : (lo + hi) // 2].data",
    ),
    Mutant(
        "digest-in-transfer-half-buckets",
        "a digest made while the bytes move covers the first half of each bucket only",
        "src/aiowsync/_planes/digest.py",
        "piece = flat[lo - base : hi - base].detach()",
        "piece = flat[lo - base : (lo + hi) // 2 - base].detach()",
    ),
    Mutant(
        "chain-receive-peer",
        "a chain member whose receive stalls names the member after it, not the one before",
        "src/aiowsync/_planes/dist/chain.py",
        "allowed=allowed, deadline=deadline, peer=before)",
        "allowed=allowed, deadline=deadline, peer=following)",
    ),
    Mutant(
        "chain-forward-peer",
        "a chain member whose forward stalls names the member before it, not the one after",
        "src/aiowsync/_planes/dist/chain.py",
        "allowed=stall, deadline=deadline, peer=following)",
        "allowed=stall, deadline=deadline, peer=before)",
    ),
    Mutant(
        "chain-first-hop",
        "a chain member's wait for its first bucket does not grow with the members before it",
        "src/aiowsync/_planes/dist/chain.py",
        "        return self.stall + before * self.hop\n",
        "        return self.stall + self.hop\n",
    ),
    Mutant(
        "chain-hop-units",
        "the chain's hop limit goes into the update in seconds, read back as milliseconds",
        "src/aiowsync/_planes/dist/chain.py",
        '"hop_ms": round(self.hop * 1000)',
        '"hop_ms": round(self.hop)',
    ),
    Mutant(
        "star-waits-unbounded",
        "the star's sender waits on a stopped member until the deadline (the others with it)",
        "src/aiowsync/_planes/dist/send.py",
        "allowed=stall, deadline=deadline, peer=peer)",
        'allowed=float("inf"), deadline=deadline, peer=peer)',
    ),
    # aiowsync.vllm: run with .venv-vllm's python and --tests tests/integrations/vllm_server
    # (VLLM_TESTS below); the default tests do not start vLLM.
    Mutant(
        "vllm-no-undo",
        "a vLLM reload that fails half-way is not undone (the model keeps a mix)",
        "src/aiowsync/vllm/_worker.py",
        "            elif self._applied is not None:\n"
        "                self._reload(self._applied.tensors.items())\n",
        "            elif False:\n                pass\n",
    ),
    Mutant(
        "no-defer",
        "a worker that lags is announced every version published (no newest-version deferral)",
        "src/aiowsync/_sending/staging.py",
        "            elif in_place and (peer.deferred is not None or len(peer.inflight) >= "
        "LAG_IN_FLIGHT):\n",
        "            elif False:\n",
    ),
    Mutant(
        "no-supersede",
        "sends a lagging worker skipped are never settled for it (they wait for its answer)",
        "src/aiowsync/_sending/control.py",
        "            if error is None:\n                pending.superseded.add(worker)\n",
        "            if error is None:\n                continue\n",
    ),
    Mutant(
        "connect-waits",
        "the trainer's connect() waits out its deadline for workers that were refused",
        "src/aiowsync/_sending/engine.py",
        "                    if settles is not None and settles <= 0:\n",
        "                    if False:\n",
    ),
    Mutant(
        "vllm-paused",
        "a vLLM server whose load failed is not resumed",
        "src/aiowsync/vllm/_servers.py",
        "        finally:\n"
        "            await to_the_end(self._steps.resume(server, started, quiet=failed))\n",
        "        except BaseException:\n            raise\n        if True:\n"
        "            await to_the_end(self._steps.resume(server, started, quiet=failed))\n",
    ),
    Mutant(
        "vllm-no-take-back",
        "together=True: servers that loaded a version the fleet could not keep keep it",
        "src/aiowsync/vllm/_servers.py",
        '                        if may_hold("load", e, s.size)\n',
        "                        if False\n",
    ),
]
VLLM_TESTS = ["tests/integrations/vllm_server/test_vllm_failures.py"]


def _is_vllm(mutant: Mutant) -> bool:
    return mutant.path.startswith("src/aiowsync/vllm/")


def _scratch() -> Path:
    where = Path(tempfile.mkdtemp(prefix="aiowsync-mutants-"))
    shutil.copytree(ROOT / "src", where / "src", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "tests", where / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", where / "pyproject.toml")
    return where


def _plant(where: Path, mutant: Mutant) -> None:
    path = where / mutant.path
    text = path.read_text()
    if text.count(mutant.old) != 1:
        raise SystemExit(f"mutant {mutant.name}: its original text is not in {mutant.path} once")
    path.write_text(text.replace(mutant.old, mutant.new))


def _run(where: Path, tests: list[str], extra: list[str]) -> tuple[list[str], float]:
    env = dict(os.environ, PYTHONPATH=str(where / "src"), OMP_WAIT_POLICY="PASSIVE")
    probe = subprocess.run(
        [sys.executable, "-c", "import aiowsync; print(aiowsync.__file__)"],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    if not probe.stdout.startswith(str(where)):
        raise SystemExit(f"the scratch copy is not the one imported: {probe.stdout.strip()}")
    started = time.monotonic()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rfE",
            "--timeout",
            "90",
            *tests,
            *extra,
        ],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
    )
    failed = sorted(set(FAILED.findall(run.stdout)))
    if run.returncode not in (0, 1):
        failed.append(f"(pytest exit {run.returncode})")
    return failed, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="a mutant's name (repeatable)")
    parser.add_argument("--tests", nargs="+", default=DEFAULT_TESTS, help="test paths to run")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="the aiowsync.vllm mutants against the vLLM tests (run with .venv-vllm's python)",
    )
    args = parser.parse_args(argv)
    if args.vllm:
        args.only = args.only or [m.name for m in MUTANTS if _is_vllm(m)]
        if args.tests == DEFAULT_TESTS:
            args.tests = VLLM_TESTS
    chosen = [m for m in MUTANTS if (m.name in args.only if args.only else not _is_vllm(m))]
    if not chosen:
        parser.error(f"no such mutant; known: {', '.join(m.name for m in MUTANTS)}")
    extra = ["-k", args.keyword] if args.keyword else []
    if args.tests == DEFAULT_TESTS:
        extra += [f"--deselect={test}" for test in DESELECTED]
    rows, survived = [], []
    for mutant in [None, *chosen]:
        where = _scratch()
        try:
            if mutant is not None:
                _plant(where, mutant)
            failed, seconds = _run(where, args.tests, extra)
        finally:
            shutil.rmtree(where, ignore_errors=True)
        name = "(none: the code as it is)" if mutant is None else mutant.name
        what = "every test must pass" if mutant is None else mutant.what
        if mutant is None and failed:
            print(f"the unmutated copy fails: {failed}", file=sys.stderr)
            return 2
        if mutant is not None and not failed:
            survived.append(mutant.name)
        shown = "<br>".join(f.split("::", 1)[-1] for f in failed[:12])
        more = f"<br>... and {len(failed) - 12} more" if len(failed) > 12 else ""
        rows.append(f"| {name} | {what} | {len(failed)} | {shown}{more} | {seconds:.0f} s |")
        print(rows[-1], file=sys.stderr, flush=True)
    print("| mutant | planted bug | tests failed | which | time |")
    print("|---|---|--:|---|--:|")
    print("\n".join(rows))
    if survived:
        print(f"\nsurvived: {', '.join(survived)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
