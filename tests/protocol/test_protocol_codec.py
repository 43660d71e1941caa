"""The wire codec: every message survives a round trip, and nothing else gets through."""

from __future__ import annotations

import ast
import pathlib
import pickle

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiowsync
from aiowsync._protocol import (
    MAX_FRAME,
    PROTOCOL_VERSION,
    SENDER_INDEX,
    Ack,
    Bye,
    Heartbeat,
    Hello,
    Nack,
    Refuse,
    TensorDesc,
    Update,
    Welcome,
    decode,
    encode,
)
from aiowsync._protocol._codec import MAGIC

MESSAGE_TYPES = (Hello, Welcome, Refuse, Update, Ack, Nack, Heartbeat, Bye)
FINGERPRINT = "0123456789abcdef" * 4
SESSION = "fedcba9876543210" * 2
HEADER = MAGIC + bytes([PROTOCOL_VERSION])

SAMPLES = [
    Hello(protocol=PROTOCOL_VERSION, model_id="policy", worker_idx=0, fingerprint=FINGERPRINT),
    Hello(
        protocol=PROTOCOL_VERSION,
        model_id="critic",
        worker_idx=7,
        fingerprint=FINGERPRINT,
        layout=(
            TensorDesc("layer.weight", "float32", (4, 3)),
            TensorDesc("layer.bias", "bfloat16", (4,)),
            TensorDesc("bn.num_batches_tracked", "int64", ()),
            TensorDesc("empty", "float16", (0, 5)),
        ),
        pid=4242,
    ),
    Welcome(proof="0f" * 16, model_id="policy", worker_idx=3, session=SESSION, version=0),
    Welcome(
        proof="0f" * 16,
        model_id="policy",
        worker_idx=2**31,
        session=SESSION,
        version=2**62,
        params={"slot": 1, "prefix": "/dev/shm/aiowsync-x"},
        heartbeat_interval=0.25,
    ),
    Refuse(reason="layout mismatch: layer.weight expected float32[4, 3], got float32[3, 4]"),
    Refuse(reason=""),
    Update(version=1),
    Update(version=12, params={"slot": 0, "nbytes": 1 << 40}),
    Ack(worker_idx=0, version=0),
    Ack(worker_idx=5, version=99),
    Nack(worker_idx=1, version=3, error="RuntimeError: out of memory"),
    Heartbeat(worker_idx=SENDER_INDEX),
    Heartbeat(worker_idx=4, session=SESSION, version=17),
    Bye(),
    Bye(reason="sender shutting down"),
]
VALID_FRAMES = [encode(m) for m in SAMPLES]


def body(**fields: object) -> bytes:
    """A frame whose msgpack body is ``fields`` as written, valid or not."""
    return HEADER + msgspec.msgpack.encode(fields)


# -- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message: object) -> None:
    frame = encode(message)  # type: ignore[arg-type]
    assert frame.startswith(HEADER)
    decoded = decode(frame)
    assert type(decoded) is type(message)
    assert decoded == message
    # decoding also works from the buffer types a socket hands back
    assert decode(bytearray(frame)) == message
    assert decode(memoryview(frame)) == message


def test_samples_cover_every_message_type() -> None:
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES)


def test_nested_layout_survives_with_its_types() -> None:
    decoded = decode(VALID_FRAMES[1])
    assert isinstance(decoded, Hello)
    assert decoded.layout[3] == TensorDesc("empty", "float16", (0, 5))
    assert isinstance(decoded.layout[0].shape, tuple)


# -- rejection ------------------------------------------------------------------------------


def test_wrong_magic_is_rejected() -> None:
    frame = encode(Update(version=1))
    for bad in (b"XX" + frame[2:], b"aw" + frame[2:], frame[1:], b"", b"A", b"AW"):
        with pytest.raises(aiowsync.ProtocolError):
            decode(bad)


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1, 255])
def test_other_protocol_version_is_rejected(version: int) -> None:
    for message in (Ack(worker_idx=0, version=1), Bye(), Update(version=1)):
        frame = encode(message)
        with pytest.raises(aiowsync.ProtocolError, match="protocol version"):
            decode(frame[:2] + bytes([version]) + frame[3:])


@pytest.mark.parametrize("version", [0, 1, PROTOCOL_VERSION + 1, 255])
def test_a_hello_of_another_version_decodes_to_a_hello_that_only_names_it(version: int) -> None:
    # A hello of another release, with fields this one does not know: read for its index.
    body = msgspec.msgpack.encode(
        {"type": "hello", "protocol": version, "worker_idx": 3, "transport": "x", "new": [1]}
    )
    hello = decode(b"AW" + bytes([version]) + body)
    assert isinstance(hello, Hello)
    assert (hello.protocol, hello.worker_idx, hello.model_id, hello.layout) == (version, 3, "", ())
    # ... and a refusal goes back in that version, which any version reads.
    frame = encode(Refuse(reason="no"), protocol=version)
    assert frame[2] == version and decode(frame) == Refuse(reason="no")
    for bad in ({"type": "hello", "worker_idx": -1}, {"type": "refuse"}, {"type": "ack"}, [1]):
        with pytest.raises(aiowsync.ProtocolError, match="protocol version"):
            decode(b"AW" + bytes([version]) + msgspec.msgpack.encode(bad))


def test_only_a_refusal_is_encoded_in_another_version() -> None:
    with pytest.raises(ValueError, match="only a refusal"):
        encode(Bye(), protocol=PROTOCOL_VERSION + 1)
    with pytest.raises(ValueError, match="only a refusal"):
        encode(Refuse(reason="x"), protocol=256)


def test_oversized_frame_is_rejected_before_parsing() -> None:
    frame = encode(Refuse(reason="x" * 100))
    assert decode(frame, max_size=len(frame)) == Refuse(reason="x" * 100)
    with pytest.raises(aiowsync.ProtocolError, match="exceeds"):
        decode(frame, max_size=len(frame) - 1)
    # the default limit applies even to a frame that would otherwise be valid
    huge = encode(Bye()) + b"\x00" * MAX_FRAME
    with pytest.raises(aiowsync.ProtocolError, match="exceeds"):
        decode(huge)


@pytest.mark.parametrize("tag", ["nope", "HELLO", "", "pickle"])
def test_unknown_tag_is_rejected(tag: str) -> None:
    with pytest.raises(aiowsync.ProtocolError):
        decode(body(type=tag, version=1))


def test_body_that_is_not_a_tagged_map_is_rejected() -> None:
    for payload in (1, "update", [1, 2], None, {"version": 1}):
        with pytest.raises(aiowsync.ProtocolError):
            decode(HEADER + msgspec.msgpack.encode(payload))
    with pytest.raises(aiowsync.ProtocolError):
        decode(HEADER)  # header and nothing else
    with pytest.raises(aiowsync.ProtocolError):
        decode(encode(Bye()) + b"\x00")  # trailing bytes after a valid message


@pytest.mark.parametrize(
    "fields",
    [
        {"type": "ack", "worker_idx": 0},  # no version
        {"type": "update"},
        {"type": "nack", "worker_idx": 0, "version": 1},  # no error
        {"type": "hello", "protocol": 1, "model_id": "m", "worker_idx": 0},  # no fingerprint
        {"type": "welcome", "model_id": "m", "worker_idx": 0, "version": 0},  # no session
    ],
)
def test_missing_field_is_rejected(fields: dict[str, object]) -> None:
    with pytest.raises(aiowsync.ProtocolError):
        decode(body(**fields))


@pytest.mark.parametrize(
    "fields",
    [
        {"type": "ack", "worker_idx": 0, "version": 1, "extra": 1},
        {"type": "bye", "reason": "", "__reduce__": "os.system"},
        {"type": "update", "version": 1, "params": {}, "callable": "builtins.eval"},
    ],
)
def test_extra_field_is_rejected(fields: dict[str, object]) -> None:
    with pytest.raises(aiowsync.ProtocolError):
        decode(body(**fields))


BAD_VALUES = [
    {"type": "update", "version": -1},
    {"type": "update", "version": 2**62 + 1},
    {"type": "update", "version": 1.5},
    {"type": "update", "version": "1"},
    {"type": "ack", "worker_idx": -1, "version": 0},
    {"type": "ack", "worker_idx": 2**31 + 1, "version": 0},
    {"type": "nack", "worker_idx": 0, "version": -3, "error": "x"},
    {"type": "nack", "worker_idx": 0, "version": 1, "error": "x" * (64 * 1024 + 1)},
    {"type": "beat", "worker_idx": -2},
    {"type": "beat", "worker_idx": 0, "version": -2},
    {"type": "beat", "worker_idx": 0, "session": "s" * 33},
    {"type": "hello", "protocol": 1, "model_id": "m", "worker_idx": 0, "fingerprint": "abc"},
    {"type": "hello", "protocol": 1, "model_id": "m", "worker_idx": 0, "fingerprint": "A" * 64},
    {"type": "hello", "protocol": 1, "model_id": "m", "worker_idx": 0, "fingerprint": "g" * 64},
    {"type": "hello", "protocol": 1, "model_id": "m", "worker_idx": 0, "fingerprint": "a" * 65},
    {"type": "hello", "protocol": -1, "model_id": "m", "worker_idx": 0, "fingerprint": "a" * 64},
    {
        "type": "hello",
        "protocol": 1,
        "model_id": "m" * 257,
        "worker_idx": 0,
        "fingerprint": "a" * 64,
    },
    {
        "type": "hello",
        "protocol": 1,
        "model_id": "m",
        "worker_idx": 0,
        "fingerprint": "a" * 64,
        "layout": [["w", "float32", [-1]]],
    },
    {
        "type": "hello",
        "protocol": 1,
        "model_id": "m",
        "worker_idx": 0,
        "fingerprint": "a" * 64,
        "layout": [["w", "torch.float32", [1]]],
    },
    {
        "type": "hello",
        "protocol": 1,
        "model_id": "m",
        "worker_idx": 0,
        "fingerprint": "a" * 64,
        "layout": [["", "float32", [1]]],
    },
    {
        "type": "hello",
        "protocol": 1,
        "model_id": "m",
        "worker_idx": 0,
        "fingerprint": "a" * 64,
        "layout": [["w", "float32", [1] * 33]],
    },
    {"type": "welcome", "model_id": "m", "worker_idx": 0, "session": "xyz", "version": 0},
    {
        "type": "welcome",
        "model_id": "m",
        "worker_idx": 0,
        "session": SESSION,
        "version": 0,
        "heartbeat_interval": 0.0,
    },
    {
        "type": "welcome",
        "model_id": "m",
        "worker_idx": 0,
        "session": SESSION,
        "version": 0,
        "params": {f"k{i}": i for i in range(65)},
    },
    {"type": "update", "version": 1, "params": {"slot": 1.5}},
    {"type": "update", "version": 1, "params": {"slot": [1]}},
    {"type": "refuse", "reason": None},
]


@pytest.mark.parametrize("fields", BAD_VALUES)
def test_out_of_range_value_is_rejected(fields: dict[str, object]) -> None:
    with pytest.raises(aiowsync.ProtocolError):
        decode(body(**fields))


def test_building_a_hello_checks_the_fingerprint() -> None:
    with pytest.raises(ValueError, match="fingerprint"):
        Hello(protocol=1, model_id="m", worker_idx=0, fingerprint="not-hex")


def test_pickle_payload_is_rejected_even_behind_a_valid_header() -> None:
    payload = pickle.dumps({"type": "update", "version": 1})
    with pytest.raises(aiowsync.ProtocolError):
        decode(payload)
    with pytest.raises(aiowsync.ProtocolError):
        decode(HEADER + payload)


def test_protocol_error_is_a_weight_sync_error() -> None:
    with pytest.raises(aiowsync.WeightSyncError):
        decode(b"garbage")


# -- property: every input decodes to a message or raises ProtocolError ---------------------
# 3000 examples a run each, drawn afresh every run (no example database): CI runs add up to
# far more than any one run could afford.


def check_strict(frame: bytes) -> None:
    try:
        message = decode(frame)
    except aiowsync.ProtocolError:
        return
    assert isinstance(message, MESSAGE_TYPES)
    # Whatever got through is a valid message: it survives its own round trip unchanged.
    assert decode(encode(message)) == message


random_frames = st.one_of(
    st.binary(max_size=256),
    st.binary(max_size=256).map(lambda b: HEADER + b),
    st.binary(max_size=64).map(lambda b: MAGIC + b),
)


@settings(
    max_examples=3000,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(random_frames)
def test_random_bytes_decode_or_raise_protocol_error(frame: bytes) -> None:
    check_strict(frame)


@st.composite
def mutated_frames(draw: st.DrawFn) -> bytes:
    frame = bytearray(draw(st.sampled_from(VALID_FRAMES)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "splice", "set"]))
        pos = draw(st.integers(0, len(frame)))
        if op == "flip" and frame:
            i = min(pos, len(frame) - 1)
            frame[i] ^= draw(st.integers(1, 255))
        elif op == "set" and frame:
            i = min(pos, len(frame) - 1)
            frame[i] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xDC, 0xDE, 0xFF]))
        elif op == "truncate":
            del frame[pos:]
        elif op == "insert":
            frame[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "splice":
            other = draw(st.sampled_from(VALID_FRAMES))
            cut = draw(st.integers(0, len(other)))
            frame = frame[:pos] + other[cut:]
    return bytes(frame)


@settings(
    max_examples=3000,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(mutated_frames())
def test_mutated_frames_decode_or_raise_protocol_error(frame: bytes) -> None:
    check_strict(frame)


# -- no pickle anywhere in the package ------------------------------------------------------

PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "pickletools", "shelve"}
PICKLE_NAMES = PICKLE_MODULES | {"ForkingPickler", "Pickler", "Unpickler"}


def pickle_uses(tree: ast.AST) -> list[str]:
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[0] in PICKLE_MODULES:
                found.append(module)
            found += [a.name for a in node.names if a.name in PICKLE_NAMES]
        elif isinstance(node, ast.Name) and node.id in PICKLE_NAMES:
            found.append(node.id)
        elif isinstance(node, ast.Attribute) and node.attr in PICKLE_NAMES:
            found.append(node.attr)
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "load"
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
        ):
            found.append("torch.load")  # unpickles under the hood
    return found


def test_the_scanner_sees_pickle() -> None:
    sample = "import pickle\nfrom multiprocessing.reduction import ForkingPickler\ntorch.load(f)\n"
    assert pickle_uses(ast.parse(sample)) == ["pickle", "ForkingPickler", "torch.load"]


def test_package_source_never_uses_pickle() -> None:
    root = pathlib.Path(aiowsync.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) >= 10
    offenders = {
        str(path.relative_to(root)): uses
        for path in files
        if (uses := pickle_uses(ast.parse(path.read_text(), filename=str(path))))
    }
    assert offenders == {}
