"""Wire protocol between decode and prefill managers.

Every message is one `msgspec.Struct` with a protocol version and a `kind` tag, msgpack-encoded and
sent as one ZMQ frame `MAGIC + payload`; Register alone keeps the two frames `[MAGIC, payload]` of
earlier versions, so a peer of another version still reads its version and says so (the per-request
messages are one frame because each frame of a send costs the sending thread about 10 us more:
docs/design.md, issue 28). Decoding validates types; anything malformed, truncated,
of an unknown kind or of another version raises `ProtocolError`, which the caller counts, logs and
turns into (at most) the failure of the room the message names. Nothing here raises anything else.

Message flow (one decode rank D, one prefill rank P):
    D -> P  Register       once per (D, P): D's engine descriptor, memory descriptors and layout
    D -> P  RoomMetadata   per request: D's page indices, aux slot and state slots
    P -> D  TransferStarted a chunk was submitted (restarts D's transfer deadline; names the attempt);
                           a room's last chunk sends it only if not concluded within a grace
                           (SGLANG_MORI_ANNOUNCE_GRACE_MS), so D may get the RoomStatus alone
    P -> D  RoomStatus     terminal: Success carries the aux bytes, so "done" never precedes the data;
                           it names the RoomMetadata attempt it concludes, and D applies it to that
                           receiver only (a late status of a retracted attempt is stale, not news)
    D -> P  Abort          D gives up on a room; P stops sending and acks once writes have drained
    P -> D  AbortAck       every write P issued into the room is terminal: D may reuse its pages
"""

from __future__ import annotations

from typing import Optional, Union

import msgspec
import numpy as np

# 2: RoomMetadata and Abort carry decode's attempt id (retract-rebootstrap reuses a room id).
# 3: RoomStatus echoes that attempt id (a late status must not conclude the room id's next receiver).
# 4: TransferStarted names that attempt too (a late one must not restart the next receiver's deadline);
#    every message but Register is one frame (MAGIC + payload).
PROTOCOL_VERSION = 4
MAGIC = b"sglang-mori/1"

# Rejection reasons (bounded label set, also used for metrics).
REJECT_MALFORMED = "malformed"
REJECT_VERSION = "version"
REJECT_FOREIGN = "foreign"


class ProtocolError(ValueError):
    """A message that cannot be accepted; `reason` is one of the REJECT_* labels."""

    def __init__(self, reason: str, detail: str, room: Optional[int] = None):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.room = room


class _Message(msgspec.Struct, tag_field="kind", kw_only=True):
    version: int = PROTOCOL_VERSION


class Register(_Message, tag="register", kw_only=True):
    engine_desc: bytes
    kv_descs: list[bytes]
    aux_descs: list[bytes]
    # One list per state component; None keeps positions of zero-length (unregistered) buffers.
    state_descs: list[list[Optional[bytes]]] = []
    decode_ip: str
    decode_port: int
    attn_tp_size: int = 1
    attn_tp_rank: int = 0
    # Decode context parallel (--dcp-size): tokens are striped over the DCP ranks.
    dcp_size: int = 1
    dcp_rank: int = 0
    # Decode's SGLang enable_all_cp_ranks_for_transfer: with a prefill CP > 1 it waits for a
    # Success from every CP rank (else from CP rank 0 only); prefill refuses a mismatch.
    cp_all_ranks: bool = False
    # planning.KVLayout encoded with msgspec; kept opaque here so the protocol does not depend on
    # the planner's internals.
    layout: bytes


class RoomMetadata(_Message, tag="metadata", kw_only=True):
    room: int
    # One decode receiver's attempt at this room: a request that decode retracts and bootstraps
    # again reuses the room id with a new attempt, which prefill must tell from a replay.
    attempt: int
    engine_key: str
    decode_ip: str
    decode_port: int
    kv_indices: bytes  # little-endian int32 page indices: encode_page_indices / decode_page_indices
    aux_index: Optional[int] = None
    state_indices: Optional[list[Optional[list[int]]]] = None
    required_dst_info_num: int = 1
    decode_prefix_len: Optional[int] = None
    is_dummy: bool = False


class TransferStarted(_Message, tag="started", kw_only=True):
    room: int
    # The RoomMetadata attempt of the destination it goes to: decode restarts the deadline of that
    # receiver only, never of a later receiver of the same room id.
    attempt: int
    prefill_rank: int


# No receiver attempt is 0 (decode's attempt ids start at 1): a status naming it is stale everywhere.
NO_ATTEMPT = 0


class RoomStatus(_Message, tag="status", kw_only=True):
    room: int
    # The RoomMetadata attempt of the destination this status goes to (each decode rank's own).
    attempt: int
    status: int
    prefill_rank: int
    reason: Optional[str] = None
    # On Success: one bytes item per aux buffer, copied by decode before it records Success.
    aux: Optional[list[bytes]] = None


class Abort(_Message, tag="abort", kw_only=True):
    room: int
    attempt: int  # the RoomMetadata attempt this abort ends
    decode_ip: str
    decode_port: int
    generation: Optional[int] = None


class AbortAck(_Message, tag="abort_ack", kw_only=True):
    room: int
    prefill_rank: int
    generation: Optional[int] = None


AnyMessage = Union[Register, RoomMetadata, TransferStarted, RoomStatus, Abort, AbortAck]

class _Envelope(msgspec.Struct):
    """What every version of every message carries: read when a message does not validate, so that
    a peer of another version (whose messages lack or add fields) is told apart from garbage."""

    version: int = PROTOCOL_VERSION
    room: Optional[int] = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMessage)
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)


_MAGIC_LEN = len(MAGIC)


def encode(message: _Message) -> list[bytes]:
    if isinstance(message, Register):
        return [MAGIC, _encoder.encode(message)]
    return [MAGIC + _encoder.encode(message)]


def _payload(frames: list[bytes]):
    """The msgpack payload of `[MAGIC + payload]` or `[MAGIC, payload]`, or ProtocolError."""
    if len(frames) == 1 and frames[0][:_MAGIC_LEN] == MAGIC:
        if len(frames[0]) == _MAGIC_LEN:
            raise ProtocolError(REJECT_MALFORMED, "no payload after the magic: got 1 frame holding the magic alone")
        return memoryview(frames[0])[_MAGIC_LEN:]
    if not frames or frames[0] != MAGIC:
        raise ProtocolError(REJECT_FOREIGN, f"not an sglang-mori message ({len(frames)} frames)")
    if len(frames) != 2:
        raise ProtocolError(REJECT_MALFORMED, f"expected 1 or 2 frames, got {len(frames)}")
    return frames[1]


def decode(frames: list[bytes]) -> AnyMessage:
    """Frames -> message, or ProtocolError. Never raises anything else."""
    first = frames[0] if len(frames) == 1 else None
    if first is not None and len(first) > _MAGIC_LEN and first[:_MAGIC_LEN] == MAGIC:
        payload = memoryview(first)[_MAGIC_LEN:]  # every message but Register: _payload inline
    else:
        payload = _payload(frames)
    try:
        message = _decoder.decode(payload)
    except msgspec.ValidationError as exc:
        _raise_if_other_version(payload)
        raise ProtocolError(REJECT_MALFORMED, str(exc)) from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(REJECT_MALFORMED, str(exc)) from None
    except UnicodeDecodeError as exc:  # msgspec raises it as is for a str that is not UTF-8
        raise ProtocolError(REJECT_MALFORMED, f"invalid UTF-8 in a string: {exc}") from None
    except RecursionError:  # deeply nested arrays/maps in a field msgspec skips or walks
        raise ProtocolError(REJECT_MALFORMED, "nesting too deep") from None
    room = getattr(message, "room", None)
    if message.version != PROTOCOL_VERSION:
        raise ProtocolError(
            REJECT_VERSION,
            f"protocol version {message.version}, this build speaks {PROTOCOL_VERSION}",
            room,
        )
    if room is not None and room < 0:
        raise ProtocolError(REJECT_MALFORMED, f"room id {room} is negative", room)
    return message


def _raise_if_other_version(payload: bytes) -> None:
    """ProtocolError(REJECT_VERSION) when a message that did not validate is of another version."""
    try:
        envelope = _envelope_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
        return
    if envelope.version != PROTOCOL_VERSION:
        raise ProtocolError(
            REJECT_VERSION,
            f"protocol version {envelope.version}, this build speaks {PROTOCOL_VERSION}",
            envelope.room,
        )


# --- field codecs ---------------------------------------------------------------------------------

_PAGE_INDEX_DTYPE = np.dtype("<i4")


def encode_page_indices(indices) -> bytes:
    """Page indices (any integer array-like) -> RoomMetadata.kv_indices bytes."""
    return np.asarray(indices, dtype=_PAGE_INDEX_DTYPE).tobytes()


def decode_page_indices(blob: bytes, room: Optional[int] = None) -> np.ndarray:
    """RoomMetadata.kv_indices bytes -> int64 page indices; ProtocolError when truncated."""
    if len(blob) % _PAGE_INDEX_DTYPE.itemsize:
        raise ProtocolError(
            REJECT_MALFORMED, f"room {room}: page index list of {len(blob)} bytes is truncated", room
        )
    return np.frombuffer(blob, dtype=_PAGE_INDEX_DTYPE).astype(np.int64)


def encode_state_indices(state_indices) -> Optional[list]:
    """Per-component state slot indices (arrays or None) -> RoomMetadata.state_indices."""
    if state_indices is None:
        return None
    return [None if comp is None else np.asarray(comp).astype(np.int64).tolist() for comp in state_indices]
