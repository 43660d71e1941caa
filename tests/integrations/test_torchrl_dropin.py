"""``aiowsync.torchrl`` where TorchRL's collectors offer more than a policy: policy factories
(one, or one per worker with weights of its own), policy versions, a collector's saved state,
and the scheme's own set-up calls. Real TorchRL 0.14.1 collectors, real worker processes on
CartPole; run in .venv-bench by ``make test``, where they must not skip."""

from __future__ import annotations

import functools
import multiprocessing
import os
from typing import Any

import pytest
import torch

HAS_TORCHRL = all(__import__("importlib").util.find_spec(m) for m in ("torchrl", "gymnasium"))
pytestmark = [
    pytest.mark.skipif(
        not HAS_TORCHRL and not os.environ.get("AIOWSYNC_REQUIRE_TORCHRL"),
        reason="torchrl and gymnasium are not installed (`make test` runs this in .venv-bench)",
    ),
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

FRAMES = 32
"""Frames per batch: 16 per worker of two."""


def _scheme(kind: str, **options: Any) -> Any:
    import aiowsync.torchrl

    cls = {
        "shm": aiowsync.torchrl.SharedMemWeightSyncScheme,
        "dist": aiowsync.torchrl.DistributedWeightSyncScheme,
    }[kind]
    return cls(send_timeout=60, **options)


def _weights(marker: float) -> Any:
    from _torchrl_policy import marked_policy
    from tensordict import TensorDict

    return TensorDict.from_module(marked_policy(marker)).data.clone()


def _markers(batch: Any) -> list[set[float]]:
    """Each worker's markers in a stacked batch (``cat_results="stack"``)."""
    return [set(batch["marker"][w].unique().tolist()) for w in range(batch.shape[0])]


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"aiowsync-{os.getpid()}-")}


@pytest.mark.parametrize("kind", ["shm", "dist"])
def test_distinct_factories_give_each_worker_weights_of_its_own(kind: str) -> None:
    from _torchrl_policy import make_env, marked_policy
    from torchrl.collectors import MultiSyncCollector

    scheme = _scheme(kind)
    collector = MultiSyncCollector(
        [make_env, make_env],
        policy_factory=[functools.partial(marked_policy, float(w)) for w in range(2)],
        frames_per_batch=FRAMES,
        total_frames=-1,
        cat_results="stack",
        weight_sync_schemes={"policy": scheme},
    )
    try:
        it = iter(collector)
        assert _markers(next(it)) == [{0.0}, {1.0}]  # each worker starts on its factory's
        collector.update_policy_weights_({0: _weights(10.0)})
        assert _markers(next(it)) == [{10.0}, {1.0}]  # worker 1 kept its own
        collector.update_policy_weights_({0: _weights(100.0), 1: _weights(200.0)})
        assert _markers(next(it)) == [{100.0}, {200.0}]
        assert scheme.per_worker_weights
        # worker_ids and the map must name the same workers: nothing given is dropped,
        # no worker named is skipped, and a refused update sends nothing.
        for weights, ids in (
            ({0: _weights(1.5), 1: _weights(2.5)}, [1]),
            ({0: _weights(1.5)}, [0, 1]),
        ):
            with pytest.raises(ValueError, match="give the same workers"):
                collector.update_policy_weights_(weights, worker_ids=ids)
        collector.update_policy_weights_({1: _weights(300.0)}, worker_ids=1)
        assert _markers(next(it)) == [{100.0}, {300.0}]
    finally:
        collector.shutdown()
        scheme.shutdown()
    assert multiprocessing.active_children() == []
    assert _segments() == set()


def test_one_factory_gives_every_worker_the_weights_sent() -> None:
    from _torchrl_policy import make_env, marked_policy
    from torchrl.collectors import MultiAsyncCollector

    scheme = _scheme("shm")
    collector = MultiAsyncCollector(
        [make_env, make_env],
        policy_factory=functools.partial(marked_policy, 3.0),
        frames_per_batch=16,
        total_frames=-1,
        weight_sync_schemes={"policy": scheme},
    )
    try:
        it = iter(collector)
        assert set(next(it)["marker"].unique().tolist()) == {3.0}
        collector.update_policy_weights_(_weights(7.0))
        # Batches already in flight were collected before the update; from then on, 7.
        seen = [set(next(it)["marker"].unique().tolist()) for _ in range(6)]
        assert seen[-2:] == [{7.0}, {7.0}], seen
        assert not scheme.per_worker_weights
    finally:
        collector.shutdown()
        scheme.shutdown()


@pytest.mark.parametrize("kind", ["shm", "dist"])
def test_policy_versions_count_each_update_once_and_survive_a_restore(kind: str) -> None:
    from _torchrl_policy import make_env, marked_policy
    from torchrl.collectors import MultiSyncCollector

    def build() -> tuple[Any, Any]:
        scheme = _scheme(kind)
        collector = MultiSyncCollector(
            [make_env, make_env],
            marked_policy(),
            frames_per_batch=FRAMES,
            total_frames=-1,
            cat_results="stack",
            track_policy_version=True,
            weight_sync_schemes={"policy": scheme},
        )
        return collector, scheme

    collector, scheme = build()
    try:
        it = iter(collector)
        first = next(it)["next", "policy_version"]
        v0 = int(first.flatten()[0])
        assert (first == v0).all()
        assert (next(it)["next", "policy_version"] == v0).all()  # no update, no bump
        collector.update_policy_weights_()
        assert (next(it)["next", "policy_version"] == v0 + 1).all()
        collector.update_policy_weights_()
        collector.update_policy_weights_()
        assert (next(it)["next", "policy_version"] == v0 + 3).all()
        assert (next(it)["next", "policy_version"] == v0 + 3).all()
        saved = collector.state_dict()
        versions = [saved[f"worker{w}"]["policy_version"] for w in range(2)]
        assert versions == [v0 + 3, v0 + 3]
    finally:
        collector.shutdown()
        scheme.shutdown()

    # A new collector takes the saved state (the policy's weights included) and goes on
    # counting from there.
    restored, scheme = build()
    try:
        restored.load_state_dict(saved)
        state = restored.state_dict()
        assert [state[f"worker{w}"]["policy_version"] for w in range(2)] == versions
        it = iter(restored)
        assert (next(it)["next", "policy_version"] == v0 + 3).all()
        restored.update_policy_weights_()
        assert (next(it)["next", "policy_version"] == v0 + 4).all()
    finally:
        restored.shutdown()
        scheme.shutdown()
    assert multiprocessing.active_children() == []


def test_a_scheme_set_up_by_hand_serves_a_factory_built_collector() -> None:
    from _torchrl_policy import make_env, marked_policy
    from tensordict import TensorDict
    from torchrl.collectors import MultiSyncCollector

    scheme = _scheme("shm")
    trainer_policy = marked_policy(4.0)
    scheme.init_on_sender(
        model_id="policy",
        weights=TensorDict.from_module(trainer_policy),
        devices=[torch.device("cpu")] * 2,
    )
    collector = MultiSyncCollector(
        [make_env, make_env],
        policy_factory=functools.partial(marked_policy, 0.0),
        frames_per_batch=FRAMES,
        total_frames=-1,
        cat_results="stack",
        weight_sync_schemes={"policy": scheme},
    )
    try:
        it = iter(collector)
        assert _markers(next(it)) == [{4.0}, {4.0}]  # the trainer's, not the factory's
        collector.update_policy_weights_(_weights(6.0))
        assert _markers(next(it)) == [{6.0}, {6.0}]
    finally:
        collector.shutdown()
        scheme.shutdown()
    assert _segments() == set()


def test_the_set_up_calls_torchrl_accepts() -> None:
    from _torchrl_policy import marked_policy

    import aiowsync.torchrl

    policy = marked_policy()
    one, two = _weights(1.0), _weights(2.0)
    cases = {
        "params_map, shared": dict(params_map={0: one, 1: one}),
        "params_map, distinct": dict(params_map={0: one, 1: two}),
        "model and devices": dict(model=policy, devices=["cpu", "cpu", "cpu"]),
        "weights and num_workers": dict(weights=one, num_workers=2, device_map_fn=lambda i, w: w),
    }
    shapes = {}
    for name, kwargs in cases.items():
        scheme = aiowsync.torchrl.SharedMemWeightSyncScheme()
        scheme.init_on_sender(**kwargs)  # no model_id: "policy"
        try:
            shapes[name] = (len(scheme._inners), len(scheme._route), scheme.model_id)
        finally:
            scheme.shutdown()
    assert shapes == {
        "params_map, shared": (1, 2, "policy"),
        "params_map, distinct": (2, 2, "policy"),
        "model and devices": (1, 3, "policy"),
        "weights and num_workers": (1, 2, "policy"),
    }
    bad = {
        "params_map with a model": (dict(params_map={0: one}, model=policy), "goes alone"),
        "keys not 0..n-1": (dict(params_map={1: one}), "worker indices 0..n-1"),
        "no worker count": (dict(model=policy), "how many workers"),
        "nothing": ({}, "needs a context"),
    }
    for name, (kwargs, match) in bad.items():
        scheme = aiowsync.torchrl.SharedMemWeightSyncScheme()
        with pytest.raises(ValueError, match=match):
            scheme.init_on_sender(**kwargs)
        assert not scheme.initialized_on_sender, name
    assert _segments() == set()


def test_sync_false_returns_once_staged_and_updates_by_dict_and_model_id() -> None:
    from _torchrl_policy import make_env, marked_policy
    from tensordict import TensorDict
    from torchrl.collectors import MultiSyncCollector

    import aiowsync

    policy = marked_policy(0.0)
    scheme = _scheme("shm", sync=False)
    collector = MultiSyncCollector(
        [make_env, make_env],
        policy,
        frames_per_batch=FRAMES,
        total_frames=-1,
        cat_results="stack",
        weight_sync_schemes={"policy": scheme},
    )
    try:
        it = iter(collector)
        assert _markers(next(it)) == [{0.0}, {0.0}]
        assert collector.update_policy_weights_(weights_dict={"policy": _weights(5.0)}) is None
        # Returned once staged: the workers take it within the next batches.
        seen = [_markers(next(it)) for _ in range(3)]
        assert seen[-1] == [{5.0}, {5.0}], seen
        with torch.no_grad():
            policy.module.marker.fill_(8.0)
        collector.update_policy_weights_("policy")  # by model id: the trainer's policy
        seen = [_markers(next(it)) for _ in range(3)]
        assert seen[-1] == [{8.0}, {8.0}], seen
        wrong = TensorDict({"module": {"net": {"weight": torch.zeros(3, 4)}}}, [])
        with pytest.raises(aiowsync.LayoutMismatchError):
            collector.update_policy_weights_(wrong)
    finally:
        collector.shutdown()
        scheme.shutdown()
    assert _segments() == set()


def _net_weights(marker: float) -> Any:
    from _torchrl_policy import MarkerNet
    from tensordict import TensorDict

    return TensorDict.from_module(MarkerNet(marker)).data.clone()


def _env_markers(batch: Any) -> list[set[float]]:
    """Each worker's environment markers of the steps in a stacked batch (the observation a
    batch starts from was made before it, by the weights then)."""
    return [set(batch["next", "env_marker"][w].unique().tolist()) for w in range(batch.shape[0])]


ENV_NET = "env.transform.net"
"""Where each worker's second model lives: the net inside its environment's transform."""


@pytest.mark.parametrize("kind", ["shm", "dist"])
def test_two_models_each_with_a_scheme_update_together_and_alone(kind: str) -> None:
    from _torchrl_policy import MarkerNet, make_marked_env, marked_policy
    from torchrl.collectors import MultiSyncCollector

    policy_scheme, env_scheme = _scheme(kind), _scheme(kind)
    # The trainer holds no environment: the second model's scheme is set up by hand, from the
    # trainer's copy of it, before the collector starts its workers.
    env_scheme.init_on_sender(model_id=ENV_NET, model=MarkerNet(0.5), num_workers=2)
    collector = MultiSyncCollector(
        [make_marked_env, make_marked_env],
        marked_policy(0.0),
        frames_per_batch=FRAMES,
        total_frames=-1,
        cat_results="stack",
        weight_sync_schemes={"policy": policy_scheme, ENV_NET: env_scheme},
    )
    try:
        it = iter(collector)
        first = next(it)
        # Each worker's environment started on the trainer's copy of the second model.
        assert (_markers(first), _env_markers(first)) == ([{0.0}] * 2, [{0.5}] * 2)
        collector.update_policy_weights_(_net_weights(2.0), model_id=ENV_NET)
        batch = next(it)
        assert (_markers(batch), _env_markers(batch)) == ([{0.0}] * 2, [{2.0}] * 2)
        collector.update_policy_weights_(
            weights_dict={"policy": _weights(3.0), ENV_NET: _net_weights(4.0)}
        )
        batch = next(it)
        assert (_markers(batch), _env_markers(batch)) == ([{3.0}] * 2, [{4.0}] * 2)
        collector.update_policy_weights_(_weights(5.0))  # the policy's alone
        batch = next(it)
        assert (_markers(batch), _env_markers(batch)) == ([{5.0}] * 2, [{4.0}] * 2)
        assert (policy_scheme.version, env_scheme.version) == (2, 2)
    finally:
        collector.shutdown()
        policy_scheme.shutdown()
        env_scheme.shutdown()
    assert multiprocessing.active_children() == []
    assert _segments() == set()


def _both(batch: Any) -> tuple[set[float], set[float]]:
    """The policy's and the environment's markers in a single collector's batch."""
    return set(batch["marker"].unique().tolist()), set(
        batch["next", "env_marker"].unique().tolist()
    )


def test_a_single_process_collector_takes_each_models_weights_into_its_own() -> None:
    from _torchrl_policy import make_marked_env, marked_policy
    from torchrl.collectors import Collector

    policy_scheme, env_scheme = _scheme("shm"), _scheme("shm")
    collector = Collector(
        make_marked_env,
        marked_policy(0.0),
        frames_per_batch=8,
        total_frames=-1,
        weight_sync_schemes={"policy": policy_scheme, ENV_NET: env_scheme},
    )
    try:
        it = iter(collector)
        next(it)
        collector.update_policy_weights_(
            weights_dict={"policy": _weights(3.0), ENV_NET: _net_weights(4.0)}
        )
        assert _both(next(it)) == ({3.0}, {4.0})
        collector.update_policy_weights_(_net_weights(6.0), model_id=ENV_NET)
        assert _both(next(it)) == ({3.0}, {6.0})
    finally:
        collector.shutdown()
        policy_scheme.shutdown()
        env_scheme.shutdown()
    assert _segments() == set()


def test_the_scheme_driven_by_hand_with_a_worker_process() -> None:
    import multiprocessing as mp

    from _torchrl_policy import low_level_worker, marked_policy

    import aiowsync.torchrl

    policy = marked_policy(1.0)
    scheme = aiowsync.torchrl.SharedMemWeightSyncScheme(send_timeout=60)
    scheme.init_on_sender(model=policy, num_workers=1)
    reader, writer = mp.get_context("spawn").Pipe(duplex=False)
    worker = mp.get_context("spawn").Process(target=low_level_worker, args=(scheme, writer, 3))
    worker.start()
    writer.close()
    try:
        scheme.connect()  # returns once the worker holds the trainer's weights

        def report() -> tuple[str, int, float]:
            assert reader.poll(120), "the worker reported nothing within 120 s"
            return reader.recv()  # type: ignore[no-any-return]

        assert report() == ("connected", 0, 1.0)
        with torch.no_grad():
            policy.module.marker.fill_(2.0)
        assert scheme.send().version == 1  # the trainer's model
        assert report() == ("running", 1, 2.0)
        assert scheme.send(marked_policy(3.0)).version == 2  # a module
        assert report() == ("running", 2, 3.0)
        assert scheme.send(_weights(4.0)).version == 3  # a TensorDict
        assert report() == ("running", 3, 4.0)
        worker.join(60)
        assert worker.exitcode == 0
    finally:
        if worker.is_alive():
            worker.kill()
            worker.join(10)
        scheme.shutdown()
    assert _segments() == set()
