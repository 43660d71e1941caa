"""The per-role state machines, driven against each other with no sockets.

Every message that goes from one machine to the other is encoded and decoded on the way, so the
codec is exercised on the same paths.
"""

from __future__ import annotations

import pytest

import aiowsync
from aiowsync._protocol import (
    PROTOCOL_VERSION,
    SENDER_INDEX,
    TRANSITIONS,
    Ack,
    Bye,
    Connection,
    Heartbeat,
    Hello,
    Message,
    Nack,
    Refuse,
    Role,
    State,
    Update,
    Welcome,
    decode,
    encode,
)

FINGERPRINT = "ab" * 32
SESSION = "0f" * 16


def wire(message: Message) -> Message:
    decoded = decode(encode(message))
    assert decoded == message
    return decoded


def hello(worker_idx: int) -> Hello:
    return Hello(
        protocol=PROTOCOL_VERSION, model_id="m", worker_idx=worker_idx, fingerprint=FINGERPRINT
    )


def welcome(worker_idx: int, version: int = 0) -> Welcome:
    return Welcome(
        proof="0f" * 16, model_id="m", worker_idx=worker_idx, session=SESSION, version=version
    )


class Pair:
    """One sender-side machine and the receiver machine it talks to."""

    def __init__(self, worker_idx: int = 0, *, sender_knows_idx: bool = False) -> None:
        self.worker_idx = worker_idx
        self.sender = Connection(Role.SENDER, worker_idx if sender_knows_idx else None)
        self.receiver = Connection(Role.RECEIVER, worker_idx)

    def to_sender(self, message: Message) -> None:
        self.receiver.send(message)
        self.sender.receive(wire(message))

    def to_receiver(self, message: Message) -> None:
        self.sender.send(message)
        self.receiver.receive(wire(message))

    @property
    def states(self) -> tuple[State, State]:
        return self.sender.state, self.receiver.state

    def handshake(self, version: int = 0) -> Pair:
        self.to_sender(hello(self.worker_idx))
        self.to_receiver(welcome(self.worker_idx, version))
        self.to_sender(Ack(worker_idx=self.worker_idx, version=version))
        assert self.states == (State.LIVE, State.LIVE)
        return self

    def update(self, version: int) -> None:
        self.to_receiver(Update(version=version))
        self.to_sender(Ack(worker_idx=self.worker_idx, version=version))


# -- the table --------------------------------------------------------------------------------


def test_transitions_cover_every_role_and_state() -> None:
    assert set(TRANSITIONS) == {(role, state) for role in Role for state in State}
    for row in TRANSITIONS.values():
        assert row, "every state accepts at least Bye"
        assert all(isinstance(target, State) for target in row.values())


def test_bye_is_accepted_in_every_state_and_closes() -> None:
    for row in TRANSITIONS.values():
        assert row[Bye] is State.CLOSED


def test_error_state_accepts_only_bye() -> None:
    for role in Role:
        assert set(TRANSITIONS[(role, State.ERROR)]) == {Bye}


# -- handshake --------------------------------------------------------------------------------


def test_full_handshake_reaches_live_on_both_sides() -> None:
    pair = Pair(worker_idx=3)
    assert pair.states == (State.START, State.START)
    pair.to_sender(hello(3))
    assert pair.states == (State.HELLO, State.HELLO)
    assert pair.sender.worker_idx == 3  # learnt from the Hello
    pair.to_receiver(welcome(3, version=0))
    assert pair.states == (State.SYNCING, State.SYNCING)
    assert pair.sender.latest_update == pair.receiver.latest_update == 0
    assert pair.sender.acked_version == -1
    pair.to_sender(Ack(worker_idx=3, version=0))
    assert pair.states == (State.LIVE, State.LIVE)
    assert pair.sender.acked_version == pair.receiver.acked_version == 0
    assert pair.sender.error is None and pair.receiver.error is None


def test_handshake_at_a_later_version() -> None:
    pair = Pair().handshake(version=41)
    assert pair.sender.latest_update == 41
    pair.update(42)
    assert pair.sender.acked_version == 42


def test_refuse_closes_both_sides() -> None:
    pair = Pair(worker_idx=1)
    pair.to_sender(hello(1))
    pair.to_receiver(Refuse(reason="layout mismatch"))
    assert pair.states == (State.CLOSED, State.CLOSED)
    with pytest.raises(aiowsync.ProtocolError):
        pair.sender.send(Update(version=1))
    assert pair.sender.state is State.ERROR


def test_nack_of_the_initial_version_keeps_syncing_until_an_ack() -> None:
    pair = Pair()
    pair.to_sender(hello(0))
    pair.to_receiver(welcome(0))
    pair.to_sender(Nack(worker_idx=0, version=0, error="mmap failed"))
    assert pair.states == (State.SYNCING, State.SYNCING)
    pair.to_receiver(Update(version=1))  # the sender may push a newer version meanwhile
    pair.to_sender(Ack(worker_idx=0, version=1))
    assert pair.states == (State.LIVE, State.LIVE)
    assert pair.sender.acked_version == 1


# -- updates ----------------------------------------------------------------------------------


def test_updates_with_rising_versions() -> None:
    pair = Pair().handshake()
    for version in (1, 2, 3, 7, 100):
        pair.update(version)
        assert pair.sender.latest_update == pair.receiver.latest_update == version
        assert pair.sender.acked_version == pair.receiver.acked_version == version
        assert pair.states == (State.LIVE, State.LIVE)


def test_several_updates_may_be_outstanding() -> None:
    pair = Pair().handshake()
    pair.to_receiver(Update(version=1))
    pair.to_receiver(Update(version=2))
    pair.to_sender(Nack(worker_idx=0, version=1, error="superseded"))
    pair.to_sender(Ack(worker_idx=0, version=2))
    assert pair.sender.acked_version == 2
    assert pair.states == (State.LIVE, State.LIVE)


def test_nack_leaves_acked_version_and_state_alone() -> None:
    pair = Pair().handshake()
    pair.to_receiver(Update(version=1))
    pair.to_sender(Nack(worker_idx=0, version=1, error="boom"))
    assert pair.sender.acked_version == 0
    assert pair.states == (State.LIVE, State.LIVE)


def test_nacks_in_a_row_keep_no_record_of_older_versions() -> None:
    # Answers come in order: once version v is answered, nothing older can be. A receiver that
    # fails every update must not make either side remember every version it failed.
    pair = Pair().handshake()
    for version in range(1, 1001):
        pair.to_receiver(Update(version=version))
        pair.to_sender(Nack(worker_idx=0, version=version, error="hook failed", running=version))
    assert len(pair.sender._outstanding) <= 1 and len(pair.receiver._outstanding) <= 1
    pair.update(1001)
    assert pair.sender.acked_version == 1001
    with pytest.raises(aiowsync.ProtocolError, match="never sent"):
        pair.sender.receive(Nack(worker_idx=0, version=999, error="late"))


@pytest.mark.parametrize("version", [5, 2])
def test_ack_for_a_version_never_sent_is_a_protocol_error(version: int) -> None:
    pair = Pair().handshake()
    pair.update(1)
    pair.to_receiver(Update(version=3))  # version 2 was never sent on this pair
    with pytest.raises(aiowsync.ProtocolError, match="never sent"):
        pair.sender.receive(wire(Ack(worker_idx=0, version=version)))
    assert pair.sender.state is State.ERROR
    assert pair.sender.error is not None and "never sent" in pair.sender.error


def test_ack_below_the_welcome_version_is_a_protocol_error() -> None:
    pair = Pair()
    pair.to_sender(hello(0))
    pair.to_receiver(welcome(0, version=9))
    with pytest.raises(aiowsync.ProtocolError):
        pair.sender.receive(Ack(worker_idx=0, version=4))
    assert pair.sender.state is State.ERROR


def test_receiver_cannot_ack_what_it_never_received() -> None:
    pair = Pair().handshake()
    with pytest.raises(aiowsync.ProtocolError):
        pair.receiver.send(Ack(worker_idx=0, version=1))
    assert pair.receiver.state is State.ERROR


@pytest.mark.parametrize("version", [3, 2])
def test_non_increasing_update_is_rejected_by_the_sender(version: int) -> None:
    pair = Pair().handshake()
    pair.update(3)
    with pytest.raises(aiowsync.ProtocolError, match="does not follow"):
        pair.sender.send(Update(version=version))
    assert pair.sender.state is State.ERROR


def test_non_increasing_update_is_rejected_by_the_receiver() -> None:
    receiver = Connection(Role.RECEIVER, 0)
    receiver.send(hello(0))
    receiver.receive(welcome(0, version=4))
    with pytest.raises(aiowsync.ProtocolError):
        receiver.receive(Update(version=4))
    assert receiver.state is State.ERROR


def test_a_nacked_version_may_be_retried_with_a_higher_attempt() -> None:
    pair = Pair().handshake()
    pair.to_receiver(Update(version=3))
    pair.to_sender(Nack(worker_idx=0, version=3, error="receive failed", retryable=True))
    pair.to_receiver(Update(version=3, attempt=1))
    pair.to_receiver(Update(version=3, attempt=2))
    pair.to_sender(Ack(worker_idx=0, version=3))
    assert pair.sender.acked_version == 3 and pair.sender.state is State.LIVE
    # The welcome version can be retried too.
    fresh = Pair()
    fresh.to_sender(hello(0))
    fresh.to_receiver(welcome(0, version=5))
    fresh.to_receiver(Update(version=5, attempt=1))
    fresh.to_sender(Ack(worker_idx=0, version=5))
    assert fresh.sender.state is State.LIVE


@pytest.mark.parametrize(
    ("version", "attempt", "why"),
    [(3, 0, "does not follow"), (3, 1, "does not follow"), (2, 5, "does not follow")],
)
def test_retries_must_raise_the_attempt_of_the_latest_version(
    version: int, attempt: int, why: str
) -> None:
    pair = Pair().handshake()
    pair.to_receiver(Update(version=3))
    pair.to_receiver(Update(version=3, attempt=1))
    with pytest.raises(aiowsync.ProtocolError, match=why):
        pair.sender.send(Update(version=version, attempt=attempt))
    assert pair.sender.state is State.ERROR


def test_an_acknowledged_version_cannot_be_retried() -> None:
    pair = Pair().handshake()
    pair.update(3)
    pair.to_sender(Ack(worker_idx=0, version=3))
    with pytest.raises(aiowsync.ProtocolError, match="already acknowledged"):
        pair.receiver.receive(Update(version=3, attempt=1))
    assert pair.receiver.state is State.ERROR


def test_messages_naming_another_worker_are_rejected() -> None:
    pair = Pair(worker_idx=2, sender_knows_idx=True)
    with pytest.raises(aiowsync.ProtocolError, match="expected 2"):
        pair.sender.receive(hello(5))
    assert pair.sender.state is State.ERROR

    pair = Pair(worker_idx=2).handshake()
    with pytest.raises(aiowsync.ProtocolError):
        pair.sender.receive(Ack(worker_idx=1, version=0))
    assert pair.sender.state is State.ERROR


# -- direction and order ----------------------------------------------------------------------

SENDER_ONLY = [welcome(0), Refuse(reason="no"), Update(version=1)]
RECEIVER_ONLY = [hello(0), Ack(worker_idx=0, version=0), Nack(worker_idx=0, version=0, error="x")]


def live_pair() -> Pair:
    return Pair().handshake()


@pytest.mark.parametrize("message", RECEIVER_ONLY, ids=lambda m: type(m).__name__)
def test_sender_cannot_send_receiver_messages(message: Message) -> None:
    pair = live_pair()
    with pytest.raises(aiowsync.ProtocolError, match="cannot travel"):
        pair.sender.send(message)
    assert pair.sender.state is State.ERROR


@pytest.mark.parametrize("message", RECEIVER_ONLY, ids=lambda m: type(m).__name__)
def test_receiver_cannot_receive_receiver_messages(message: Message) -> None:
    pair = live_pair()
    with pytest.raises(aiowsync.ProtocolError, match="cannot travel"):
        pair.receiver.receive(message)
    assert pair.receiver.state is State.ERROR


@pytest.mark.parametrize("message", SENDER_ONLY, ids=lambda m: type(m).__name__)
def test_receiver_cannot_send_sender_messages(message: Message) -> None:
    pair = live_pair()
    with pytest.raises(aiowsync.ProtocolError, match="cannot travel"):
        pair.receiver.send(message)
    assert pair.receiver.state is State.ERROR


@pytest.mark.parametrize("message", SENDER_ONLY, ids=lambda m: type(m).__name__)
def test_sender_cannot_receive_sender_messages(message: Message) -> None:
    pair = live_pair()
    with pytest.raises(aiowsync.ProtocolError, match="cannot travel"):
        pair.sender.receive(message)
    assert pair.sender.state is State.ERROR


def test_update_before_welcome_is_rejected() -> None:
    receiver = Connection(Role.RECEIVER, 0)
    with pytest.raises(aiowsync.ProtocolError, match="not allowed in state start"):
        receiver.receive(Update(version=1))
    assert receiver.state is State.ERROR

    receiver = Connection(Role.RECEIVER, 0)
    receiver.send(hello(0))
    with pytest.raises(aiowsync.ProtocolError, match="not allowed in state hello"):
        receiver.receive(Update(version=1))

    sender = Connection(Role.SENDER)
    sender.receive(hello(0))
    with pytest.raises(aiowsync.ProtocolError):
        sender.send(Update(version=1))
    assert sender.state is State.ERROR


@pytest.mark.parametrize(
    ("setup", "role", "outgoing", "message"),
    [
        ("start", Role.SENDER, True, welcome(0)),  # welcome before hello
        ("start", Role.SENDER, False, Ack(worker_idx=0, version=0)),
        ("hello", Role.SENDER, False, hello(0)),  # second hello
        ("hello", Role.SENDER, False, Ack(worker_idx=0, version=0)),  # ack before welcome
        ("live", Role.SENDER, True, welcome(0)),  # welcome twice
        ("live", Role.RECEIVER, True, hello(0)),
        ("live", Role.RECEIVER, False, Refuse(reason="late")),
        ("start", Role.RECEIVER, True, Ack(worker_idx=0, version=0)),
    ],
)
def test_out_of_state_messages_are_rejected(
    setup: str, role: Role, outgoing: bool, message: Message
) -> None:
    pair = Pair()
    if setup == "hello":
        pair.to_sender(hello(0))
    elif setup == "live":
        pair.handshake()
    conn = pair.sender if role is Role.SENDER else pair.receiver
    with pytest.raises(aiowsync.ProtocolError):
        (conn.send if outgoing else conn.receive)(message)
    assert conn.state is State.ERROR


def test_error_state_rejects_everything_but_bye() -> None:
    pair = live_pair()
    with pytest.raises(aiowsync.ProtocolError):
        pair.sender.receive(Ack(worker_idx=0, version=10))
    for message in (Update(version=1), Heartbeat(worker_idx=SENDER_INDEX)):
        with pytest.raises(aiowsync.ProtocolError):
            pair.sender.send(message)
        assert pair.sender.state is State.ERROR
    pair.sender.send(Bye(reason="protocol error"))
    assert pair.sender.state is State.CLOSED


# -- heartbeats and goodbyes ------------------------------------------------------------------


def test_heartbeats_never_change_state() -> None:
    pair = Pair()
    pair.to_sender(hello(0))
    seen = []
    for step in ("hello", "syncing", "live", "closed"):
        if step == "syncing":
            pair.to_receiver(welcome(0))
        elif step == "live":
            pair.to_sender(Ack(worker_idx=0, version=0))
        elif step == "closed":
            pair.to_sender(Bye())
        before = pair.states
        for _ in range(3):
            pair.to_sender(Heartbeat(worker_idx=0, session=SESSION, version=0))
            pair.to_receiver(Heartbeat(worker_idx=SENDER_INDEX, version=0))
        assert pair.states == before
        seen.append(before[0])
    assert seen == [State.HELLO, State.SYNCING, State.LIVE, State.CLOSED]


def test_heartbeats_do_not_touch_versions() -> None:
    pair = live_pair()
    pair.to_receiver(Heartbeat(worker_idx=SENDER_INDEX, version=99))
    pair.to_sender(Heartbeat(worker_idx=0, version=99))
    assert pair.sender.latest_update == 0
    assert pair.sender.acked_version == 0
    pair.update(1)  # version 1 still follows 0: the beat announced nothing


@pytest.mark.parametrize("from_receiver", [True, False])
def test_bye_closes_the_pair(from_receiver: bool) -> None:
    pair = live_pair()
    (pair.to_sender if from_receiver else pair.to_receiver)(Bye(reason="done"))
    assert pair.states == (State.CLOSED, State.CLOSED)
    pair.to_sender(Bye())  # a second goodbye is harmless
    assert pair.states == (State.CLOSED, State.CLOSED)
    with pytest.raises(aiowsync.ProtocolError):
        pair.sender.send(Update(version=1))


def test_bye_during_the_handshake_closes() -> None:
    pair = Pair()
    pair.to_sender(hello(0))
    pair.to_sender(Bye(reason="changed my mind"))
    assert pair.states == (State.CLOSED, State.CLOSED)


# -- one sender, three receivers --------------------------------------------------------------


def test_sender_with_three_receivers_and_subset_updates() -> None:
    pairs = {w: Pair(worker_idx=w).handshake() for w in range(3)}
    sent: dict[int, list[int]] = {w: [0] for w in pairs}
    for version, targets in ((1, [0, 1]), (2, [1, 2]), (3, [0, 1, 2]), (4, [2])):
        for w in targets:
            pairs[w].update(version)
            sent[w].append(version)
    assert sent == {0: [0, 1, 3], 1: [0, 1, 2, 3], 2: [0, 2, 3, 4]}
    for w, pair in pairs.items():
        assert pair.states == (State.LIVE, State.LIVE)
        assert pair.sender.latest_update == sent[w][-1]
        assert pair.sender.acked_version == sent[w][-1]

    # worker 0 never got version 2 nor 4: answering for them is a protocol error on that pair only
    pairs[0].to_receiver(Update(version=5))
    with pytest.raises(aiowsync.ProtocolError):
        pairs[0].sender.receive(Ack(worker_idx=0, version=4))
    assert pairs[0].sender.state is State.ERROR
    assert [pairs[w].sender.state for w in (1, 2)] == [State.LIVE, State.LIVE]
    pairs[1].update(5)
    assert pairs[1].sender.acked_version == 5
