"""Wire protocol: every message kind round-trips; everything else is a ProtocolError with a reason."""

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from sglang_mori import protocol
from sglang_mori.protocol import (
    MAGIC,
    PROTOCOL_VERSION,
    REJECT_FOREIGN,
    REJECT_MALFORMED,
    REJECT_VERSION,
    Abort,
    AbortAck,
    ProtocolError,
    Register,
    RoomMetadata,
    RoomStatus,
    TransferStarted,
    decode,
    encode,
)

MESSAGE_TYPES = (Register, RoomMetadata, TransferStarted, RoomStatus, Abort, AbortAck)

# msgpack carries integers in [-2**63, 2**64 - 1]; room ids must be non-negative.
ints = st.integers(-(2**63), 2**64 - 1)
rooms = st.integers(0, 2**64 - 1)
opt_ints = st.none() | ints
blobs = st.binary(max_size=64)
texts = st.text(max_size=32)

registers = st.builds(
    Register,
    engine_desc=blobs,
    kv_descs=st.lists(blobs, max_size=4),
    aux_descs=st.lists(blobs, max_size=3),
    state_descs=st.lists(st.lists(st.none() | blobs, max_size=3), max_size=3),
    decode_ip=texts,
    decode_port=ints,
    attn_tp_size=ints,
    attn_tp_rank=ints,
    layout=blobs,
)
metadatas = st.builds(
    RoomMetadata,
    room=rooms,
    attempt=ints,
    engine_key=texts,
    decode_ip=texts,
    decode_port=ints,
    kv_indices=blobs,
    aux_index=opt_ints,
    state_indices=st.none() | st.lists(st.none() | st.lists(ints, max_size=4), max_size=3),
    required_dst_info_num=ints,
    decode_prefix_len=opt_ints,
    is_dummy=st.booleans(),
)
starteds = st.builds(TransferStarted, room=rooms, attempt=ints, prefill_rank=ints)
statuses_without_aux = st.builds(
    RoomStatus, room=rooms, attempt=ints, status=ints, prefill_rank=ints, reason=st.none() | texts, aux=st.none()
)
statuses_with_aux = st.builds(
    RoomStatus, room=rooms, attempt=ints, status=ints, prefill_rank=ints, reason=st.none() | texts,
    aux=st.lists(blobs, max_size=4),
)
aborts = st.builds(Abort, room=rooms, attempt=ints, decode_ip=texts, decode_port=ints, generation=opt_ints)
abort_acks = st.builds(AbortAck, room=rooms, prefill_rank=ints, generation=opt_ints)
any_message = st.one_of(
    registers, metadatas, starteds, statuses_without_aux, statuses_with_aux, aborts, abort_acks
)

KIND_STRATEGIES = {
    "register": registers,
    "metadata": metadatas,
    "started": starteds,
    "status_no_aux": statuses_without_aux,
    "status_aux": statuses_with_aux,
    "abort": aborts,
    "abort_ack": abort_acks,
}


def samples():
    """One fixed, fully populated message of every kind."""
    return [
        Register(engine_desc=b"\x01engine", kv_descs=[b"k0", b"k1"], aux_descs=[b"a0"],
                 state_descs=[[b"s0", None], []], decode_ip="127.0.0.1", decode_port=17001,
                 attn_tp_size=2, attn_tp_rank=1, layout=b"layout-bytes"),
        RoomMetadata(room=42, attempt=77, engine_key="sglang-mori-decode-x", decode_ip="127.0.0.1",
                     decode_port=17002, kv_indices=b"\x01\x00\x00\x00\x02\x00\x00\x00",
                     aux_index=3, state_indices=[[1, 2], None], required_dst_info_num=2,
                     decode_prefix_len=16, is_dummy=True),
        TransferStarted(room=7, attempt=5, prefill_rank=1),
        RoomStatus(room=8, attempt=1, status=2, prefill_rank=0, reason=None, aux=[b"aux0", b""]),
        RoomStatus(room=9, attempt=1, status=3, prefill_rank=1, reason="peer down"),
        Abort(room=10, attempt=77, decode_ip="127.0.0.1", decode_port=17003, generation=4),
        AbortAck(room=11, prefill_rank=0, generation=4),
    ]


def reject(frames) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    return info.value


def decode_or_protocol_error(frames):
    """decode() must return one of our messages or raise ProtocolError; anything else fails."""
    try:
        message = decode(frames)
    except ProtocolError as exc:
        assert exc.reason in (REJECT_FOREIGN, REJECT_MALFORMED, REJECT_VERSION)
        return None
    assert isinstance(message, MESSAGE_TYPES)
    assert message.version == PROTOCOL_VERSION
    room = getattr(message, "room", None)
    assert room is None or room >= 0
    return message


# --- round trips -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(KIND_STRATEGIES))
def test_round_trip_every_kind(kind):
    @settings(max_examples=60, deadline=None)
    @given(KIND_STRATEGIES[kind])
    def check(message):
        frames = encode(message)
        if kind == "register":  # two frames: a peer of another version still reads the version
            assert len(frames) == 2 and frames[0] == MAGIC and isinstance(frames[1], bytes)
        else:  # one frame per message sent on the request path
            assert len(frames) == 1 and frames[0].startswith(MAGIC) and len(frames[0]) > len(MAGIC)
        back = decode(frames)
        assert type(back) is type(message)
        assert back == message
        assert back.version == PROTOCOL_VERSION

    check()


@pytest.mark.parametrize("message", samples(), ids=lambda m: type(m).__name__)
def test_round_trip_fixed_samples(message):
    back = decode(encode(message))
    assert type(back) is type(message)
    assert back == message


def test_room_status_aux_distinguishes_none_from_empty():
    none = decode(encode(RoomStatus(room=1, attempt=1, status=2, prefill_rank=0)))
    empty = decode(encode(RoomStatus(room=1, attempt=1, status=2, prefill_rank=0, aux=[])))
    with_data = decode(encode(RoomStatus(room=1, attempt=1, status=2, prefill_rank=0, aux=[b"\x00" * 300, b"x"])))
    assert none.aux is None and none.reason is None
    assert empty.aux == []
    assert with_data.aux == [b"\x00" * 300, b"x"]


def test_defaults_filled_in_on_decode():
    payload = msgspec.msgpack.encode({"kind": "metadata", "room": 5, "attempt": 9, "engine_key": "k",
                                      "decode_ip": "127.0.0.1", "decode_port": 1, "kv_indices": b""})
    message = decode([MAGIC, payload])
    assert isinstance(message, RoomMetadata)
    assert message.version == PROTOCOL_VERSION
    assert (message.aux_index, message.state_indices, message.required_dst_info_num,
            message.decode_prefix_len, message.is_dummy) == (None, None, 1, None, False)


def test_metadata_and_abort_without_an_attempt_are_malformed():
    """A replay guard keyed by attempt needs one on every RoomMetadata and Abort."""
    for fields in ({"kind": "metadata", "room": 5, "engine_key": "k", "decode_ip": "h", "decode_port": 1,
                    "kv_indices": b""},
                   {"kind": "abort", "room": 5, "decode_ip": "h", "decode_port": 1}):
        exc = reject([MAGIC, msgspec.msgpack.encode(fields)])
        assert exc.reason == REJECT_MALFORMED and "attempt" in exc.detail


def test_kinds_have_distinct_tags():
    tags = [msgspec.msgpack.decode(msgspec.msgpack.encode(m))["kind"] for m in samples()]
    assert tags == ["register", "metadata", "started", "status", "status", "abort", "abort_ack"]


# --- rejections --------------------------------------------------------------------------------

PAYLOAD = msgspec.msgpack.encode(TransferStarted(room=7, attempt=3, prefill_rank=0))


@pytest.mark.parametrize("frames", [
    [],
    [b"sglang-mori/2", PAYLOAD],
    [b"", PAYLOAD],
    [MAGIC + b"x", PAYLOAD],
    [b"SGLANG-MORI/1", PAYLOAD],
    [PAYLOAD, MAGIC],
], ids=["empty", "other-magic", "blank-magic", "longer-magic", "case", "swapped"])
def test_foreign_magic(frames):
    exc = reject(frames)
    assert exc.reason == REJECT_FOREIGN
    assert exc.room is None
    assert str(exc).startswith("foreign: ")
    assert not (frames and frames[0] == MAGIC)


@pytest.mark.parametrize("extra", [0, 2, 3])
def test_wrong_frame_count(extra):
    frames = [MAGIC] + [PAYLOAD] * extra
    exc = reject(frames)
    assert exc.reason == REJECT_MALFORMED
    assert f"got {len(frames)}" in exc.detail
    assert frames[0] == MAGIC


def test_truncated_payload():
    exc = reject([MAGIC, PAYLOAD[:-1]])
    assert exc.reason == REJECT_MALFORMED
    assert "truncated" in exc.detail


@pytest.mark.parametrize("garbage", [b"", b"\xc1", b"\xff\xff\xff", b"not msgpack at all", b"\x93\x01\x02\x03",
                                     b"\xa3abc"])
def test_garbage_bytes(garbage):
    assert reject([MAGIC, garbage]).reason == REJECT_MALFORMED


def test_trailing_bytes_rejected():
    assert reject([MAGIC, PAYLOAD + b"\x00"]).reason == REJECT_MALFORMED


def test_unknown_kind():
    exc = reject([MAGIC, msgspec.msgpack.encode({"kind": "teleport", "room": 1, "prefill_rank": 0})])
    assert exc.reason == REJECT_MALFORMED
    assert "teleport" in exc.detail and "kind" in exc.detail


def test_missing_kind():
    exc = reject([MAGIC, msgspec.msgpack.encode({"room": 1, "prefill_rank": 0})])
    assert exc.reason == REJECT_MALFORMED
    assert "kind" in exc.detail


def test_missing_required_field():
    exc = reject([MAGIC, msgspec.msgpack.encode({"kind": "started", "prefill_rank": 0})])
    assert exc.reason == REJECT_MALFORMED
    assert "missing required field `room`" in exc.detail


@pytest.mark.parametrize("field,value", [
    ("room", "7"), ("room", 1.5), ("room", True), ("room", None), ("prefill_rank", b"0"),
])
def test_wrong_field_type(field, value):
    body = {"kind": "started", "room": 7, "prefill_rank": 0}
    body[field] = value
    exc = reject([MAGIC, msgspec.msgpack.encode(body)])
    assert exc.reason == REJECT_MALFORMED
    assert f"$.{field}" in exc.detail


def test_wrong_nested_type():
    body = {"kind": "register", "engine_desc": b"e", "kv_descs": [b"ok", 3], "aux_descs": [],
            "decode_ip": "127.0.0.1", "decode_port": 1, "layout": b""}
    exc = reject([MAGIC, msgspec.msgpack.encode(body)])
    assert exc.reason == REJECT_MALFORMED
    assert "$.kv_descs[1]" in exc.detail


# PAYLOAD is a fixmap; one more entry, key "junk", value appended by the caller.
STARTED_WITH_JUNK_KEY = bytes([PAYLOAD[0] + 1]) + PAYLOAD[1:] + msgspec.msgpack.encode("junk")


def test_unknown_extra_field_is_ignored():
    message = decode([MAGIC, STARTED_WITH_JUNK_KEY + msgspec.msgpack.encode([1, "x"])])
    assert message == TransferStarted(room=7, attempt=3, prefill_rank=0)


@pytest.mark.parametrize("payload", [
    b"\x81\xa4kind\xa3\xff\xfe\xfd",  # {"kind": <3 bytes that are not UTF-8>}
    b"\x81\xa2\xff\xfe\x01",  # a map key that is not UTF-8
], ids=["kind", "key"])
def test_invalid_utf8_is_malformed(payload):
    # msgspec raises UnicodeDecodeError (not a DecodeError) for these.
    assert reject([MAGIC, payload]).reason == REJECT_MALFORMED


@pytest.mark.parametrize("depth", [2000, 200_000])
def test_deep_nesting_is_malformed(depth):
    # msgspec raises RecursionError while skipping a deeply nested unknown field.
    payload = STARTED_WITH_JUNK_KEY + b"\x91" * depth + b"\xc0"
    assert reject([MAGIC, payload]).reason == REJECT_MALFORMED


@pytest.mark.parametrize("version", [0, 1, PROTOCOL_VERSION + 100, -1])
def test_other_version_carries_room(version):
    exc = reject(encode(RoomStatus(version=version, room=123, attempt=1, status=2, prefill_rank=0)))
    assert exc.reason == REJECT_VERSION
    assert exc.room == 123
    assert f"protocol version {version}" in exc.detail


def test_other_version_without_room():
    exc = reject(encode(Register(version=1, engine_desc=b"", kv_descs=[], aux_descs=[],
                                 decode_ip="127.0.0.1", decode_port=1, layout=b"")))
    assert exc.reason == REJECT_VERSION
    assert exc.room is None


def test_version_checked_before_room_sign():
    exc = reject(encode(Abort(version=9, room=-4, attempt=1, decode_ip="h", decode_port=1)))
    assert exc.reason == REJECT_VERSION
    assert exc.room == -4


@pytest.mark.parametrize("make", [
    lambda r: RoomMetadata(room=r, attempt=1, engine_key="k", decode_ip="h", decode_port=1, kv_indices=b""),
    lambda r: TransferStarted(room=r, attempt=1, prefill_rank=0),
    lambda r: RoomStatus(room=r, attempt=1, status=2, prefill_rank=0),
    lambda r: Abort(room=r, attempt=1, decode_ip="h", decode_port=1),
    lambda r: AbortAck(room=r, prefill_rank=0),
], ids=["metadata", "started", "status", "abort", "abort_ack"])
@pytest.mark.parametrize("room", [-1, -(2**63)])
def test_negative_room(make, room):
    exc = reject(encode(make(room)))
    assert exc.reason == REJECT_MALFORMED
    assert exc.room == room
    assert "negative" in exc.detail


def test_room_zero_is_valid():
    assert decode(encode(TransferStarted(room=0, attempt=1, prefill_rank=0))).room == 0


def test_protocol_error_is_value_error_with_fields():
    exc = ProtocolError(REJECT_VERSION, "detail text", room=3)
    assert isinstance(exc, ValueError)
    assert str(exc) == "version: detail text"
    assert (exc.reason, exc.detail, exc.room) == (REJECT_VERSION, "detail text", 3)


# --- fuzz ----------------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_fuzz_random_payload(payload):
    decode_or_protocol_error([MAGIC, payload])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=64), st.just(MAGIC)), max_size=5))
def test_fuzz_random_frames(frames):
    result = decode_or_protocol_error(frames)
    if result is not None:
        assert (len(frames) == 2 and frames[0] == MAGIC) or (len(frames) == 1 and frames[0].startswith(MAGIC))


def test_both_framings_decode_to_the_same_message():
    message = RoomStatus(room=5, attempt=2, status=3, prefill_rank=1, aux=[b"x"])
    payload = msgspec.msgpack.encode(message)
    assert decode([MAGIC, payload]) == decode([MAGIC + payload]) == decode(encode(message)) == message


@settings(max_examples=120, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | ints | st.floats() | texts | blobs,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(texts, children, max_size=4),
    max_leaves=20,
), st.sampled_from(["register", "metadata", "started", "status", "abort", "abort_ack", "x"]))
def test_fuzz_structured_msgpack(value, kind):
    """Well-formed msgpack of the wrong shape: a dict with a real kind tag and random fields."""
    decode_or_protocol_error([MAGIC, msgspec.msgpack.encode(value)])
    body = value if isinstance(value, dict) else {"room": value}
    decode_or_protocol_error([MAGIC, msgspec.msgpack.encode({**body, "kind": kind})])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_message, st.data())
def test_fuzz_bit_flips(message, data):
    payload = msgspec.msgpack.encode(message)
    flips = data.draw(st.lists(st.integers(0, len(payload) * 8 - 1), min_size=1, max_size=4))
    mutated = bytearray(payload)
    for bit in flips:
        mutated[bit // 8] ^= 1 << (bit % 8)
    decode_or_protocol_error([MAGIC, bytes(mutated)])


@pytest.mark.parametrize("message", samples(), ids=lambda m: type(m).__name__)
def test_every_single_bit_flip(message):
    payload = msgspec.msgpack.encode(message)
    for bit in range(len(payload) * 8):
        mutated = bytearray(payload)
        mutated[bit // 8] ^= 1 << (bit % 8)
        decode_or_protocol_error([MAGIC, bytes(mutated)])


@pytest.mark.parametrize("message", samples(), ids=lambda m: type(m).__name__)
def test_truncation_at_every_length(message):
    payload = msgspec.msgpack.encode(message)
    for n in range(len(payload)):
        exc = reject([MAGIC, payload[:n]])
        assert exc.reason == REJECT_MALFORMED, n


@settings(max_examples=100, deadline=None)
@given(any_message, st.data())
def test_fuzz_truncation_and_splice(message, data):
    payload = msgspec.msgpack.encode(message)
    n = data.draw(st.integers(0, len(payload) - 1))
    assert reject([MAGIC, payload[:n]]).reason == REJECT_MALFORMED
    junk = data.draw(st.binary(min_size=1, max_size=16))
    decode_or_protocol_error([MAGIC, payload[:n] + junk])
    assert reject([MAGIC, payload + junk]).reason == REJECT_MALFORMED


# --- field codecs --------------------------------------------------------------------------------

def test_page_indices_round_trip():
    from sglang_mori.protocol import decode_page_indices, encode_page_indices
    import numpy as np

    blob = encode_page_indices(np.array([0, 7, 2**31 - 1]))
    assert blob == b"\x00\x00\x00\x00\x07\x00\x00\x00\xff\xff\xff\x7f"
    back = decode_page_indices(blob, room=3)
    assert back.dtype == np.int64 and back.tolist() == [0, 7, 2**31 - 1]
    assert decode_page_indices(b"").size == 0


def test_truncated_page_indices_name_the_room():
    from sglang_mori.protocol import decode_page_indices

    exc = reject_with(lambda: decode_page_indices(b"\x01\x00\x00", room=12))
    assert exc.reason == REJECT_MALFORMED and exc.room == 12
    assert exc.detail == "room 12: page index list of 3 bytes is truncated"


def test_state_indices_encoding():
    from sglang_mori.protocol import encode_state_indices
    import numpy as np

    assert encode_state_indices(None) is None
    assert encode_state_indices([np.array([3, 4], dtype=np.int32), None]) == [[3, 4], None]


def reject_with(call) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        call()
    return info.value


def test_a_status_of_the_previous_protocol_is_told_apart_from_garbage():
    """Version 2's RoomStatus had no attempt: from an old prefill it is a version error naming its
    room (not "malformed"), and a current one without it is malformed, naming the field."""
    import msgspec

    old = msgspec.msgpack.encode({"kind": "status", "version": 2, "room": 5, "status": 4, "prefill_rank": 0})
    exc = reject([MAGIC, old])
    assert (exc.reason, exc.room) == (REJECT_VERSION, 5)
    assert f"protocol version 2, this build speaks {PROTOCOL_VERSION}" in exc.detail
    current = msgspec.msgpack.encode({"kind": "status", "version": PROTOCOL_VERSION, "room": 5, "status": 4,
                                      "prefill_rank": 0})
    exc = reject([MAGIC, current])
    assert exc.reason == REJECT_MALFORMED and "attempt" in exc.detail
