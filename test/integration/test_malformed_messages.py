"""Hostile input on the prefill manager's ZMQ socket (the port decode ranks push Register,
RoomMetadata and Abort to): garbage, truncated frames, unknown kinds, wrong types, wrong protocol
versions, messages meant for the other direction, SGLang's legacy positional frames, and replays of
a genuine decode registration. None of it names a room of the run, so every room must still
complete byte-exact and every process must still answer at the end.

The flood goes out twice: before "go" (queued in front of the real handshake) and on a thread
while the rooms transfer. Counts and sizes are bounded; so is the time spent. Through the harness
control channel the test then reads the prefill manager's rejection counters, to prove the flood
was actually read and rejected (not left unread in a socket), by kind.
"""

from __future__ import annotations

import os
import random
import time

import msgspec
import zmq

from integration_support import config
from sglang_mori import protocol
from harness.pd.run import KVLayout, ReadyInfo, RoomShape
from harness.pd.control import controls, wait_until
from harness.pd.plan import build_plan

FLOOD_ROUNDS = 4
DURING_S = 3.0


def _msgpack(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


def hostile_messages(rng: random.Random, rooms: list, registration) -> list:
    """One round of hostile multipart messages; `rooms` are ids that belong to no request."""
    r = lambda: rng.choice(rooms)  # noqa: E731
    meta = protocol.RoomMetadata(
        room=r(), attempt=rng.randrange(1, 2**62), engine_key="no-such-engine", decode_ip="127.0.0.1", decode_port=1,
        kv_indices=b"\x01\x00\x00\x00" * 4, aux_index=0,
    )  # fmt: skip
    meta_bytes = msgspec.msgpack.encode(meta)
    msgs = [
        [os.urandom(rng.randint(1, 64))],
        [os.urandom(8), os.urandom(8), os.urandom(8)],
        [protocol.MAGIC],
        [protocol.MAGIC, b""],
        [protocol.MAGIC, os.urandom(48)],
        [protocol.MAGIC, meta_bytes[: rng.randint(1, len(meta_bytes) - 1)]],  # truncated
        [protocol.MAGIC, meta_bytes, b"trailing frame"],
        [protocol.MAGIC + os.urandom(48)],  # one frame: magic and garbage
        [protocol.MAGIC + meta_bytes[: rng.randint(1, len(meta_bytes) - 1)]],  # one frame, truncated
        [protocol.MAGIC, _msgpack({"kind": "bogus", "version": 1, "room": r()})],  # unknown kind
        [protocol.MAGIC, _msgpack({"kind": "metadata", "version": 1, "room": "abc"})],  # wrong types
        [protocol.MAGIC, _msgpack({"kind": "register", "version": 1})],  # missing fields
        [protocol.MAGIC, _msgpack([1, 2, 3])],
        [protocol.MAGIC, b"\x91" * 5000 + b"\x01"],  # deeply nested arrays
        [protocol.MAGIC, _msgpack({"kind": "metadata", "version": 99, "room": r()})],  # other version
        protocol.encode(msgspec.structs.replace(meta, version=protocol.PROTOCOL_VERSION + 1)),  # newer protocol
        protocol.encode(msgspec.structs.replace(meta, room=-5)),  # negative room
        protocol.encode(msgspec.structs.replace(meta, kv_indices=b"\x01\x00\x00")),  # index bytes cut
        protocol.encode(meta),  # metadata from an engine that never registered
        protocol.encode(meta),  # ... and its replay
        protocol.encode(protocol.RoomStatus(room=r(), attempt=1, status=4, prefill_rank=0, aux=[b"x"])),  # decode-bound
        protocol.encode(protocol.TransferStarted(room=r(), attempt=1, prefill_rank=0)),
        protocol.encode(protocol.AbortAck(room=r(), prefill_rank=0, generation=1)),
        protocol.encode(protocol.Abort(room=r(), attempt=1, decode_ip="127.0.0.1", decode_port=1)),
        protocol.encode(
            protocol.Register(
                engine_desc=os.urandom(40), kv_descs=[os.urandom(16)], aux_descs=[], decode_ip="127.0.0.1",
                decode_port=9, layout=os.urandom(12),
            )
        ),  # fmt: skip
        # SGLang's own positional frames (CommonKVManager / Mooncake style), not our protocol.
        [b"ABORT", str(r()).encode()],
        [b"BOOTSTRAP", str(r()).encode(), b"127.0.0.1", b"1"],
        [str(r()).encode(), b"127.0.0.1", b"1", b"session", b"\x00" * 8, b"0", b"1"],
        [os.urandom(rng.randint(100_000, 300_000))],  # large junk frame
    ]
    if registration:
        msgs += [list(registration), list(registration)]  # a genuine registration, replayed twice
    return msgs


class Fuzzer:
    def __init__(self, cfg, seed: int):
        plan_rooms = {r.room for r in build_plan(cfg).rooms}
        self.rng = random.Random(seed)
        self.rooms = [x for x in (self.rng.randrange(1, 2**63) for _ in range(64)) if x not in plan_rooms]
        self.sent = 0

    def flood(self, info: ReadyInfo, rounds: int, until: float = float("inf")) -> None:
        ctx = zmq.Context()
        try:
            socks = []
            for ip, port in info.prefill_endpoints:
                s = ctx.socket(zmq.PUSH)
                s.setsockopt(zmq.LINGER, 2000)
                s.setsockopt(zmq.SNDTIMEO, 2000)
                s.connect(f"tcp://{ip}:{port}")
                socks.append(s)
            registration = next((f for f in info.decode_registrations if f), None)
            for _ in range(rounds):
                if time.monotonic() > until:
                    break
                for msg in hostile_messages(self.rng, self.rooms, registration):
                    for s in socks:
                        s.send_multipart(msg)
                        self.sent += 1
            for s in socks:
                s.close()
        finally:
            ctx.term()


def test_prefill_survives_hostile_control_messages(run_clean):
    cfg = config(
        control=True,
        rooms=96,
        max_inflight=24,  # a sliding window stretches the run so the second flood overlaps it
        layout=KVLayout(page_size=4, state_item_bytes=(32,)),
        shape=RoomShape(min_tokens=8, max_tokens=64, chunks=2),
    )
    fuzz = Fuzzer(cfg, seed=99)
    seen: dict = {}

    def during(info: ReadyInfo) -> None:
        fuzz.flood(info, FLOOD_ROUNDS, until=time.monotonic() + DURING_S)
        prefill = controls(info, ["prefill0"])["prefill0"]
        # Every message the flood could not have had accepted is counted as rejected once read:
        # at least the garbage, truncated, unknown-kind, wrong-type, wrong-version and wrong-
        # direction ones (17 per round), over both floods.
        wait_until(lambda: sum(prefill.protocol_rejections().values()) >= 2 * 17 * FLOOD_ROUNDS, 30.0,
                   "the prefill manager to read and reject the flood")  # fmt: skip
        seen.update(prefill.protocol_rejections())
        # Once every room is done, nothing of the real traffic may be left in flight. (Forged
        # metadata for rooms that never come leaves request_status/transfer_infos entries, as
        # SGLang's Common manager does for any metadata that arrives before its request; those
        # are reported, not judged.)
        assert info.wait_progress("prefill0", "done", cfg.rooms, 60.0), info.progress
        drained = ("tracker", "inflight", "queued_chunks")
        seen["leftovers"] = wait_until(
            lambda: (lambda t: t if not any(t.get(k) for k in drained) else None)(prefill.leftovers()),
            30.0, "the prefill's transfer tables to drain",
        )  # fmt: skip
        prefill.close()

    result = run_clean(cfg, on_ready=lambda info: fuzz.flood(info, FLOOD_ROUNDS), during=during)
    assert fuzz.sent >= 2 * FLOOD_ROUNDS * 25, fuzz.sent
    assert result.ready.decode_registrations[0], "mori decode exposes its registration for replay"
    assert {"malformed", "foreign", "version"} <= set(seen), seen
    print("prefill rejections and leftovers after the flood:", seen)
