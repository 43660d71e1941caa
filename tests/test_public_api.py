"""The public surface is what the docs (the API reference and the concept pages) promise."""

from __future__ import annotations

import inspect

import pytest

import aiowsync


def test_all_names_exist_and_are_exported() -> None:
    for name in aiowsync.__all__:
        assert hasattr(aiowsync, name), name
    public = {n for n in dir(aiowsync) if not n.startswith("_")}
    # The integrations are sub-packages, loaded on first use (aiowsync.vllm, aiowsync.torchrl).
    public -= {n for n in public if inspect.ismodule(getattr(aiowsync, n))}
    assert public - set(aiowsync.__all__) <= {"annotations"}
    assert inspect.ismodule(aiowsync.vllm) and aiowsync.vllm.VLLMServers.__name__ == "VLLMServers"


def test_contract_names() -> None:
    scheme = aiowsync.SharedMemWeightSyncScheme
    for method in (
        "init_on_sender",
        "init_on_receiver",
        "connect",
        "send",
        "wait_for_version",
        "receive",
        "register_hook",
        "read_guard",
        "__aenter__",
        "__aexit__",
    ):
        assert callable(getattr(scheme, method)), method
    for prop in ("address", "version", "ready", "connected"):
        assert isinstance(inspect.getattr_static(aiowsync.WeightSyncScheme, prop), property), prop
    params = inspect.signature(scheme.send).parameters
    assert list(params)[1:] == ["weights", "worker_ids", "timeout"]
    assert issubclass(aiowsync.WeightSyncTimeout, aiowsync.WeightSyncError)
    assert issubclass(aiowsync.WeightSyncTimeout, TimeoutError)
    assert issubclass(aiowsync.WorkerLostError, aiowsync.WeightSyncError)
    assert issubclass(aiowsync.RemoteApplyError, aiowsync.WeightSyncError)


def test_receiver_takes_the_same_constructor_arguments_as_the_sender() -> None:
    a = aiowsync.SharedMemWeightSyncScheme(num_slots=3, model_id="critic")
    b = aiowsync.SharedMemWeightSyncScheme(
        address="tcp://127.0.0.1:1", num_slots=3, model_id="critic"
    )
    assert (a.plane, a.model_id) == (b.plane, b.model_id)
    assert a.plane == aiowsync.SharedMemPlane(num_slots=3)


def test_a_plane_and_the_options_it_would_replace_are_refused_together() -> None:
    with pytest.raises(ValueError, match="give plane= or num_slots=, not both"):
        aiowsync.SharedMemWeightSyncScheme(num_slots=3, plane=aiowsync.MemoryPlane())
    with pytest.raises(ValueError, match="give plane= or backend=, topology=, not both"):
        aiowsync.DistributedWeightSyncScheme(
            backend="gloo", topology="chain", plane=aiowsync.MemoryPlane()
        )
    # A plane alone, or the options alone, are fine.
    assert isinstance(
        aiowsync.SharedMemWeightSyncScheme(plane=aiowsync.MemoryPlane()).plane, aiowsync.MemoryPlane
    )
    assert aiowsync.DistributedWeightSyncScheme(topology="chain").plane.topology == "chain"


def test_every_public_class_method_and_property_is_documented() -> None:
    missing = []
    for name in aiowsync.__all__:
        obj = getattr(aiowsync, name)
        if not inspect.isclass(obj):
            continue
        if not inspect.getdoc(obj):
            missing.append(name)
        for attr, member in vars(obj).items():
            if attr.startswith("_"):
                continue
            documentable = isinstance(
                member, property | staticmethod | classmethod
            ) or inspect.isfunction(member)
            if documentable and not inspect.getdoc(member):
                missing.append(f"{name}.{attr}")
    assert missing == []
