"""``aiowsync.torchrl``: real TorchRL 0.14.1 collectors with real worker processes on CartPole.

These run where torchrl and gymnasium are installed (``make test`` runs them in .venv-bench,
where they must not skip). Each policy writes its ``marker`` weight into every frame, so a
batch shows which version each of its forwards ran.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import pickle
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

import aiowsync

HAS_TORCHRL = all(importlib.util.find_spec(m) for m in ("torchrl", "gymnasium"))
needs_torchrl = pytest.mark.skipif(
    not HAS_TORCHRL and not os.environ.get("AIOWSYNC_REQUIRE_TORCHRL"),
    reason="torchrl and gymnasium are not installed (`make test` runs this in .venv-bench)",
)
pytestmark = [
    pytest.mark.timeout(300),
    # TorchRL and gymnasium warn about their own deprecations; those are not ours to fix.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

FRAMES = 32
"""Frames per batch: 16 per worker."""


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"aiowsync-{os.getpid()}-")}


def _policy() -> Any:
    from _torchrl_policy import Marked
    from tensordict.nn import TensorDictModule

    return TensorDictModule(Marked(), in_keys=["observation"], out_keys=["action", "marker"])


def _scheme(kind: str, **options: Any) -> Any:
    import torchrl.weight_update

    import aiowsync.torchrl

    if kind == "torchrl":
        return torchrl.weight_update.SharedMemWeightSyncScheme()
    if kind == "shm":
        return aiowsync.torchrl.SharedMemWeightSyncScheme(send_timeout=30, **options)
    return aiowsync.torchrl.DistributedWeightSyncScheme(send_timeout=30, **options)


def _collector(cls: Any, policy: Any, scheme: Any, total_frames: int = -1) -> Any:
    """A collector of ``cls`` over two CartPole workers, its weights moved by ``scheme``."""
    from _torchrl_policy import make_env

    return cls(
        [make_env, make_env],
        policy,
        frames_per_batch=FRAMES,
        total_frames=total_frames,
        weight_sync_schemes={"policy": scheme},
    )


def _mark(policy: Any, value: float) -> None:
    with torch.no_grad():
        policy.module.marker.fill_(value)


@needs_torchrl
@pytest.mark.parametrize("kind", ["shm", "dist", "torchrl"])
def test_every_frame_of_a_batch_ran_the_weights_sent_before_it(kind: str) -> None:
    from tensordict import TensorDict
    from torchrl.collectors import MultiSyncCollector
    from torchrl.weight_update import WeightSyncScheme

    policy, scheme = _policy(), _scheme(kind)
    assert isinstance(scheme, WeightSyncScheme)
    collector = _collector(MultiSyncCollector, policy, scheme, total_frames=FRAMES * 21)
    expected, seen, times = 0.0, [], []
    try:
        for batch, data in enumerate(collector):
            markers = set(data["marker"].unique().tolist())
            seen.append(markers)
            assert markers == {expected}, (batch, markers, expected)
            if batch == 20:
                break
            expected = float(batch + 1)
            if batch % 3 == 2:
                # Explicit weights, which differ from the trainer's live policy.
                weights = TensorDict.from_module(policy).clone()
                weights["module", "marker"] = torch.tensor(expected)
                started = time.perf_counter()
                collector.update_policy_weights_(weights)
            else:
                _mark(policy, expected)
                started = time.perf_counter()
                collector.update_policy_weights_()
            times.append(time.perf_counter() - started)
    finally:
        collector.shutdown()
        scheme.shutdown()
    assert len(seen) == 21
    print(f"{kind}: median update_policy_weights_() {statistics.median(times) * 1e3:.2f} ms")
    assert multiprocessing.active_children() == []
    assert _segments() == set()


@needs_torchrl
def test_an_async_collector_switches_its_workers_between_forwards() -> None:
    from torchrl.collectors import MultiAsyncCollector

    policy, scheme = _policy(), _scheme("shm")
    collector = _collector(MultiAsyncCollector, policy, scheme)
    sent = [0.0]
    try:
        for batch, data in enumerate(collector):
            markers = set(data["marker"].unique().tolist())
            assert markers <= set(sent), (markers, sent)
            if batch < 6:
                sent.append(float(batch + 1))
                _mark(policy, sent[-1])
                collector.update_policy_weights_()
            elif markers == {sent[-1]} or batch > 40:
                break
        assert markers == {sent[-1]}  # the workers run the last version sent
    finally:
        collector.shutdown()
        scheme.shutdown()
    assert multiprocessing.active_children() == []
    assert _segments() == set()


@needs_torchrl
def test_no_forward_of_a_worker_straddles_a_switch() -> None:
    from _torchrl_policy import TwiceMarked
    from tensordict.nn import TensorDictModule
    from torchrl.collectors import MultiAsyncCollector

    policy = TensorDictModule(TwiceMarked(), in_keys=["observation"], out_keys=["action", "both"])
    scheme = _scheme("shm")
    collector = _collector(MultiAsyncCollector, policy, scheme)
    frames = versions = 0
    try:
        for batch, data in enumerate(collector):
            both = data["both"].reshape(-1, 2)
            straddled = (both[:, 0] != both[:, 1]).sum().item()
            assert straddled == 0, f"batch {batch}: {straddled} forwards saw two versions"
            frames += both.shape[0]
            if batch == 30:
                break
            # The workers keep collecting while the trainer sends (the async collector).
            with torch.no_grad():
                policy.module.marker.fill_(float(batch + 1))
                policy.module.twin.fill_(float(batch + 1))
            collector.update_policy_weights_()
            versions += 1
    finally:
        collector.shutdown()
        scheme.shutdown()
    print(f"{frames} frames over {versions} versions: 0 forwards straddled a switch")


@needs_torchrl
def test_a_single_process_collector_takes_explicit_weights_into_its_policy() -> None:
    from _torchrl_policy import make_env
    from tensordict import TensorDict
    from torchrl.collectors import Collector

    policy, scheme = _policy(), _scheme("shm")
    collector = Collector(
        make_env, policy, frames_per_batch=16, total_frames=-1,
        weight_sync_schemes={"policy": scheme},
    )  # fmt: skip
    try:
        it = iter(collector)
        assert set(next(it)["marker"].unique().tolist()) == {0.0}
        weights = TensorDict.from_module(policy).clone()
        weights["module", "marker"] = torch.tensor(5.0)
        collector.update_policy_weights_(weights)
        assert set(next(it)["marker"].unique().tolist()) == {5.0}
    finally:
        collector.shutdown()
        scheme.shutdown()


@needs_torchrl
def test_a_single_process_collector_that_moved_the_policy_takes_every_kind_of_update() -> None:
    """The collector runs a copy of the trainer's policy (``policy_device``): an update
    without weights sends the trainer's policy, a module is taken as weights, and weights
    that do not fit are refused before any is copied."""
    from _torchrl_policy import make_env
    from tensordict import TensorDict
    from torchrl.collectors import Collector

    policy, scheme = _policy(), _scheme("shm")
    collector = Collector(
        make_env, policy, frames_per_batch=16, total_frames=-1,
        weight_sync_schemes={"policy": scheme}, policy_device="cpu:0",
    )  # fmt: skip
    try:
        it = iter(collector)
        assert collector.get_model("policy") is not policy  # the collector's own copy
        assert set(next(it)["marker"].unique().tolist()) == {0.0}
        _mark(policy, 7.0)
        collector.update_policy_weights_()
        assert set(next(it)["marker"].unique().tolist()) == {7.0}
        other = _policy()
        _mark(other, 8.0)
        collector.update_policy_weights_(other)
        assert set(next(it)["marker"].unique().tolist()) == {8.0}
        misfit = TensorDict.from_module(policy).clone()
        misfit["module", "marker"] = torch.tensor(9.0)
        misfit["module", "net", "weight"] = torch.zeros(3, 4)
        with pytest.raises(aiowsync.LayoutMismatchError, match=r"net\.weight"):
            collector.update_policy_weights_(misfit)
        assert set(next(it)["marker"].unique().tolist()) == {8.0}  # nothing was copied
    finally:
        collector.shutdown()
        scheme.shutdown()


@needs_torchrl
@pytest.mark.parametrize("kind", ["shm", "dist"])
def test_workers_whose_collector_moved_the_policy_run_every_version(kind: str) -> None:
    """Each worker's collector runs a copy of the policy the scheme was given, made after
    the worker connected (``policy_device``); every version reaches that copy."""
    from _torchrl_policy import make_env
    from torchrl.collectors import MultiSyncCollector

    policy, scheme = _policy(), _scheme(kind)
    collector = MultiSyncCollector(
        [make_env, make_env], policy, frames_per_batch=FRAMES, total_frames=-1,
        cat_results="stack", weight_sync_schemes={"policy": scheme}, policy_device="cpu:0",
    )  # fmt: skip
    try:
        it = iter(collector)
        assert set(next(it)["marker"].unique().tolist()) == {0.0}
        for value in (1.0, 2.0):
            _mark(policy, value)
            collector.update_policy_weights_()
            assert set(next(it)["marker"].unique().tolist()) == {value}
    finally:
        collector.shutdown()
        scheme.shutdown()
    assert _segments() == set()


@needs_torchrl
def test_a_policy_with_tied_weights_is_sent_as_the_trainer_holds_it() -> None:
    # Before, TorchRL's workers got the policy with its tied weights apart, and the
    # collector could not start ("module.b.weight: unexpected key"); a TensorDict of the
    # policy, which lists both names, was refused too.
    from _torchrl_policy import TiedMarked
    from tensordict import TensorDict
    from tensordict.nn import TensorDictModule
    from torchrl.collectors import MultiSyncCollector

    import aiowsync.torchrl

    policy = TensorDictModule(TiedMarked(), in_keys=["observation"], out_keys=["action", "marker"])
    scheme = aiowsync.torchrl.SharedMemWeightSyncScheme(send_timeout=60, connect_timeout=120)
    collector = _collector(MultiSyncCollector, policy, scheme)
    try:
        batches = iter(collector)
        next(batches)
        with torch.no_grad():
            policy.module.a.weight.fill_(7.0)
        collector.update_policy_weights_()
        assert set(next(batches)["marker"].flatten().tolist()) == {7.0}
        given = TensorDict.from_module(policy).clone()
        assert ("module", "b", "weight") in given.keys(True, True)
        given["module", "a", "weight"].fill_(9.0)
        collector.update_policy_weights_(given)
        assert set(next(batches)["marker"].flatten().tolist()) == {9.0}
        # Bad calls say so: no worker named, or a scheme shut down.
        with pytest.raises(ValueError, match="worker_ids is empty"):
            collector.update_policy_weights_(worker_ids=[])
    finally:
        collector.shutdown()
        scheme.shutdown()
    with pytest.raises(RuntimeError, match="this scheme is shut down"):
        scheme.send()
    assert _segments() == set()


@needs_torchrl
def test_weights_with_a_meta_tensor_leave_a_single_process_collectors_policy_untouched() -> None:
    # Before, the tensors before the meta one were copied into the policy the collector
    # runs, then torch's NotImplementedError came.
    from aiowsync.torchrl._trainer import apply_locally

    local = _policy()
    before = {k: v.clone() for k, v in local.state_dict().items()}
    given = {k: torch.full_like(v, 5.0) for k, v in local.state_dict().items()}
    given["module.net.bias"] = torch.empty(2, device="meta")
    with pytest.raises(ValueError, match="meta device"):
        apply_locally(local, given, None)
    assert all(torch.equal(v, before[k]) for k, v in local.state_dict().items())


@needs_torchrl
def test_a_worker_that_cannot_build_its_environment_fails_the_start_at_once() -> None:
    """Not at the connect deadline, as a worker that never came: the error names it."""
    from _torchrl_policy import failing_env, make_env
    from torchrl.collectors import MultiSyncCollector

    import aiowsync.torchrl

    scheme = aiowsync.torchrl.SharedMemWeightSyncScheme(connect_timeout=300)
    started = time.monotonic()
    with pytest.raises(aiowsync.WorkerLostError) as info:
        MultiSyncCollector(
            [make_env, failing_env], _policy(), frames_per_batch=FRAMES, total_frames=-1,
            weight_sync_schemes={"policy": scheme},
        )  # fmt: skip
    scheme.shutdown()
    assert info.value.worker_ids == (1,)
    assert "ended before they connected" in str(info.value)
    assert time.monotonic() - started < 150  # the deadline is 300 s (and a busy machine slow)
    assert _segments() == set()
    deadline = time.monotonic() + 30
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert multiprocessing.active_children() == []


@needs_torchrl
def test_a_failed_send_made_with_sync_false_is_raised_by_shutdown() -> None:
    from torchrl.collectors import MultiSyncCollector

    import aiowsync.torchrl

    policy = _policy()
    scheme = aiowsync.torchrl.SharedMemWeightSyncScheme(sync=False, send_timeout=20)
    collector = _collector(MultiSyncCollector, policy, scheme)
    try:
        next(iter(collector))
        # Stopped, worker 1 keeps its connection: the update is staged and sent, and only
        # then does the worker die under it (killed before, its loss could beat the call).
        os.kill(collector.procs[1].pid, signal.SIGSTOP)
        _mark(policy, 5.0)
        assert collector.update_policy_weights_() is None  # staged; the send goes on
        collector.procs[1].kill()
        collector.procs[1].join(10)
        deadline = time.monotonic() + 60
        while not all(f.done() for f, _ in scheme._unsettled) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        collector.shutdown()
        with pytest.raises(aiowsync.WeightSyncError) as info:
            scheme.shutdown()
    assert 1 in info.value.worker_ids  # type: ignore[attr-defined]
    scheme.shutdown()  # once raised, it is not raised again
    assert _segments() == set()


@needs_torchrl
@pytest.mark.parametrize("per_worker", [False, True], ids=["one scheme", "a scheme per worker"])
def test_a_dead_worker_and_wrong_weights_raise_from_the_update(per_worker: bool) -> None:
    """The error names the collector's worker, also where that worker has a scheme of its own
    (in which it is worker 0)."""
    from tensordict import TensorDict
    from torchrl.collectors import MultiSyncCollector

    policy, scheme = _policy(), _scheme("shm", per_worker_weights=per_worker)
    collector = _collector(MultiSyncCollector, policy, scheme)
    try:
        next(iter(collector))
        wrong = TensorDict({"module": {"net": {"weight": torch.zeros(3, 4)}}}, [])
        with pytest.raises(aiowsync.LayoutMismatchError):
            collector.update_policy_weights_(wrong)
        collector.procs[1].kill()
        collector.procs[1].join(10)
        _mark(policy, 9.0)
        with pytest.raises(aiowsync.WeightSyncError) as info:
            collector.update_policy_weights_()
        assert isinstance(info.value, (aiowsync.WorkerLostError, aiowsync.WeightSyncTimeout))
        assert info.value.worker_ids == (1,)  # type: ignore[attr-defined]
        # Both gone: each is told. Before, with a scheme per worker, the first failure was
        # raised and the other's dropped.
        collector.procs[0].kill()
        collector.procs[0].join(10)
        first = scheme._faces[0].scheme  # the collector's worker 0 is its worker 0
        deadline = time.monotonic() + 60
        while first.workers[0].state == "ready" and time.monotonic() < deadline:
            time.sleep(0.05)  # its loss seen by the trainer
        with pytest.raises(aiowsync.WeightSyncError) as both:
            collector.update_policy_weights_()
        named = set(both.value.worker_ids)  # type: ignore[attr-defined]
        notes = "\n".join(getattr(both.value, "__notes__", []))
        told = named == {0} and "the collector's workers [1]" in notes
        assert named == {0, 1} or told, (named, notes)
    finally:
        collector.shutdown()
        scheme.shutdown()
    assert _segments() == set()


@needs_torchrl
def test_the_schemes_pickle_before_and_after_init() -> None:
    import aiowsync.torchrl

    class Trainer:  # what a collector offers a scheme: its workers and its models
        num_workers = 1

        def get_model(self, model_id: str) -> Any:
            return policy

    policy, trainer = _policy(), Trainer()
    for cls in (aiowsync.torchrl.SharedMemWeightSyncScheme,
                aiowsync.torchrl.DistributedWeightSyncScheme):  # fmt: skip
        fresh = pickle.loads(pickle.dumps(cls()))
        assert isinstance(fresh, cls) and fresh.version == -1
        sender = cls()
        sender.init_on_sender(model_id="policy", context=trainer)
        try:
            copy = pickle.loads(pickle.dumps(sender))  # what each worker gets
            assert copy._inners[0].address == sender._inners[0].address
            assert copy._face is None and not copy.initialized_on_sender
        finally:
            sender.shutdown()
    assert _segments() == set()
    with pytest.raises(ValueError, match="name workers by index"):
        aiowsync.torchrl._trainer.worker_ids([torch.device("cpu")], 1)


def test_without_torchrl_the_module_says_what_to_install() -> None:
    code = "import sys; sys.modules['torchrl'] = None; import aiowsync.torchrl"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "aiowsync.torchrl needs TorchRL: pip install 'aiowsync[torchrl]'" in run.stderr


@needs_torchrl
def test_the_collector_example_runs(tmp_path: Any) -> None:
    example = os.path.join(
        os.path.dirname(__file__), "..", "..", "examples", "torchrl_collector.py"
    )
    run = subprocess.run(
        [sys.executable, example], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "OK: 10 batches; the workers ran version 10 at the end" in run.stdout


@needs_torchrl
def test_workers_that_never_connect_are_named_with_what_the_sender_knows() -> None:
    import aiowsync.torchrl

    scheme = aiowsync.torchrl.SharedMemWeightSyncScheme(connect_timeout=1.5)
    scheme.init_on_sender(model_id="policy", model=_policy(), num_workers=2)
    try:
        with pytest.raises(aiowsync.WeightSyncTimeout) as info:
            scheme.connect()
    finally:
        scheme.shutdown()
    assert info.value.worker_ids == (0, 1)
    assert str(info.value).startswith("workers did not connect within 1.5 s:\n")
    assert "worker 0: never connected\n  worker 1: never connected" in str(info.value)
    assert _segments() == set()
