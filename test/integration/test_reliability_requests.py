"""Per-request failures and bad input in one session, next to requests that must not notice:

round 1 runs with every prefill lane held (so each transfer is on the wire when it is hit):
- decode aborts two rooms mid-transfer (after their TransferStarted) and prefill aborts two after
  its last send: the rooms fail with a reason on both sides, decode holds their pages until the
  held writes have landed and prefill has ACKed, and nothing lands after decode released them;
- one room's metadata names a decode page past the end of the pool: it fails fast with a reason
  naming the range, and no byte lands outside the rooms' pages;
- a genuine-looking RoomMetadata replayed for two transferring rooms, retargeted at pages no room
  owns: prefill rejects it (the live writes are never re-targeted), the rooms succeed byte-exact;
- two live requests share one bootstrap_room: decode fails both with a reason (it cannot tell
  their KV apart) instead of crashing, and prefill fails them by its bootstrap deadline;
then the lanes resume, round 2 (a follow-up batch) must succeed, and finished rooms get replays:
their RoomMetadata (prefill must not resurrect them) and their Success status (decode ignores it).
Last, registrations whose layout does not match (layer count, item size, dtype, page size, TP
layout) are refused at registration with a message naming both sides' values, and a round of the
hostile messages of test_malformed_messages.py (metadata, truncated metadata and aborts for rooms
no request will ever claim, among others) goes to prefill and decode.

At the end every manager table is empty (state that hostile or orphaned messages created is
dropped by the bootstrap deadline) and every worker still serves.
"""

from __future__ import annotations

import random

import msgspec
import numpy as np
import zmq
from reliability_support import SLACK_S, Session, check_end, outcomes, reliability_config
from test_malformed_messages import hostile_messages

from sglang_mori import protocol
from sglang_mori.backend.plans import decode_layout, encode_layout
from sglang_mori.softio.descriptors import EngineDesc
from harness.pd.run import KVLayout, RoomShape, run_transfer
from harness.pd.control import wait_until
from harness.pd.results import FAILED, SUCCESS

TIMEOUT_MS = 5000  # held lanes must not time the healthy rooms out on a loaded host
ROUNDS = (2, 16, 8)  # baseline, the cases, the follow-up batch
DECODE_ABORT = (3, 8)
PREFILL_ABORT = (5, 11)
BAD_PAGE = (7,)
REPLAYED = (12, 14)  # transferring rooms whose metadata is replayed, retargeted
DUPLICATE = (15, 16)  # room 16 reuses room 15's bootstrap_room while both are live
BOOTSTRAP_TIMEOUT_S = 6  # SGLang's bound on a prefill room that never hears from decode
LAYOUT = KVLayout(num_layers=2, total_kv_heads=4, head_dim=32, page_size=16)
TRANSFERRING = 3


class Pusher:
    """PUSH sockets to the managers' ZMQ ports, for replayed and crafted messages."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.socks = {}

    def send(self, endpoint, frames) -> None:
        sock = self.socks.get(endpoint)
        if sock is None:
            sock = self.socks[endpoint] = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.setsockopt(zmq.SNDTIMEO, 2000)
            sock.connect(f"tcp://{endpoint[0]}:{endpoint[1]}")
        sock.send_multipart(frames)

    def close(self) -> None:
        for s in self.socks.values():
            s.close()
        self.ctx.term()


def _retargeted_metadata(s: Session, index: int, decode_key: str, decode_endpoint, attempt: int) -> list:
    """RoomMetadata for room `index` as decode sent it (same attempt: a replay), but naming pages
    no room owns."""
    room = s.plan.rooms[index]
    owned = set(np.concatenate([r.decode_pages for r in s.plan.rooms]).tolist())
    spare = [p for p in range(1, s.plan.decode_pool_pages) if p not in owned][: room.num_pages]
    assert len(spare) == room.num_pages, "not enough spare decode pages for the replay"
    return protocol.encode(
        protocol.RoomMetadata(
            room=room.room, attempt=attempt, engine_key=decode_key, decode_ip=decode_endpoint[0],
            decode_port=decode_endpoint[1],
            kv_indices=np.asarray(spare, dtype="<i4").tobytes(), aux_index=room.decode_aux,
        )
    )  # fmt: skip


def _mismatched_registrations(frames: list) -> dict:
    """Genuine decode Register frames, re-sent as from other engines with a wrong layout each."""
    reg = protocol.decode(frames)
    layout = decode_layout(reg.layout)
    desc = EngineDesc.unpack(reg.engine_desc)
    R = msgspec.structs.replace
    item, data = layout.kv_item_lens, layout.kv_data_lens
    bad = {
        "layers": R(layout, kv_item_lens=item[:2], kv_data_lens=data[:2]),
        "item_len": R(layout, kv_item_lens=tuple(i // 2 for i in item)),
        "dtype": R(layout, kv_cache_dtype="float16"),
        "page_size": R(layout, page_size=layout.page_size // 2),
        "tp_layout": R(layout, tp_size=2, tp_rank=1, kv_head_num=2),  # full pages for half the heads
    }
    out = {}
    for n, (name, lay) in enumerate(bad.items()):
        key = f"{desc.key}-fake-{name}"
        fake = EngineDesc(key, desc.node_id, desc.hostname, desc.host, desc.port, desc.pid)
        msg = R(reg, engine_desc=fake.pack(), layout=encode_layout(lay), decode_port=reg.decode_port + 1 + n)
        out[name] = (key, protocol.encode(msg))
    return out


def test_aborts_bad_input_and_replays_fail_only_their_rooms():
    cfg = reliability_config(
        rooms=sum(ROUNDS),
        rounds=ROUNDS,
        layout=LAYOUT,
        shape=RoomShape(min_tokens=32, max_tokens=128, chunks=2),
        decode_abort_inflight=DECODE_ABORT,
        prefill_abort=PREFILL_ABORT,
        bad_decode_pages=BAD_PAGE,
        duplicate_rooms=(DUPLICATE,),
        env={
            "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(BOOTSTRAP_TIMEOUT_S),
            "SGLANG_MORI_TRANSFER_TIMEOUT_MS": str(TIMEOUT_MS),
            "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "20",
            # The held writes land after the lanes resume, however long the host takes to get
            # there (MORI-IO's course: no fence; test/inprocess/test_drain_fence.py covers it).
            "SGLANG_MORI_SOFTIO_FENCE": "0",
        },
    )
    box: dict = {}

    def during(info) -> None:
        box["session"] = Session(info, cfg)
        box["session"].run(steps)

    def steps(s: Session) -> None:
        p, d = s.ctl["prefill0"], s.ctl["decode0"]
        decode_key = d.engine_key()
        decode_endpoint = tuple(s.info.decode_endpoints[0])
        pusher = box["pusher"] = Pusher()
        s.wait_done(0, 60)
        for lane in range(4):
            p.fault("stall_lane", lane=lane)
        s.open(1)
        # Wait for the rooms to be on the wire, then replay and abort.
        ids = {i: s.plan.rooms[i].room for i in range(cfg.rooms)}
        wait_until(
            lambda: all(p.room_states()["status"].get(ids[i]) == TRANSFERRING for i in REPLAYED),
            20, "replay targets transferring",
        )
        attempts = d.attempts()
        for i in REPLAYED:
            pusher.send(s.info.prefill_endpoints[0],
                        _retargeted_metadata(s, i, decode_key, decode_endpoint, attempts[ids[i]]))
        # Decode's aborts come after TransferStarted, so their writes are held on the wire: decode
        # must hold those pages. Prefill's abort may come before a chunk reached the engine.
        held, told = {ids[i] for i in DECODE_ABORT}, {ids[i] for i in PREFILL_ABORT}
        s.wait_decode(
            lambda st: held <= set(st["held"]) and not (told & set(st["status"])), 20, "aborted rooms failed on decode"
        )
        wait_until(lambda: p.protocol_rejections().get("replayed", 0) >= len(REPLAYED), 10, "replays rejected")
        s.mark("resumed")
        p.fault("resume_lane")
        s.wait_done(1, 60)
        s.open(2)
        s.wait_done(2, 60)
        # Replays of finished rooms: their metadata to prefill, their Success to decode.
        attempts = d.attempts()
        for i in range(cfg.rooms):
            if i not in BAD_PAGE + DUPLICATE:  # (those never had a sender finish with metadata)
                pusher.send(s.info.prefill_endpoints[0],
                            _retargeted_metadata(s, i, decode_key, decode_endpoint, attempts[ids[i]]))
            replayed = protocol.RoomStatus(room=ids[i], attempt=attempts.get(ids[i], 1), status=4, prefill_rank=0)
            pusher.send(decode_endpoint, protocol.encode(replayed))
        # Mismatched registrations, each from its own (fake) engine.
        box["fakes"] = _mismatched_registrations(s.info.decode_registrations[0])
        for _key, frames in box["fakes"].values():
            pusher.send(s.info.prefill_endpoints[0], frames)
        fakes = {key for key, _ in box["fakes"].values()}
        box["peers"] = wait_until(
            lambda: (lambda ps: ps if fakes <= {x["key"] for x in ps} else None)(p.peers()), 10, "fake peers"
        )
        # Hostile and orphaned messages for rooms no request claims, to both managers.
        rng = random.Random(5)
        strangers = [x for x in (rng.randrange(1, 2**63) for _ in range(32)) if x not in ids.values()]
        for msg in hostile_messages(rng, strangers, s.info.decode_registrations[0]):
            pusher.send(s.info.prefill_endpoints[0], msg)
            pusher.send(decode_endpoint, msg)
        box["rejections"] = p.protocol_rejections()
        box["decode_rejections"] = d.protocol_rejections()
        s.finish()
        pusher.close()

    result = run_transfer(cfg, during=during)
    session = box.get("session")
    assert session is not None and "peers" in box, result.summary()
    check_end(result, session, cfg)
    pre, dec = outcomes(result, "prefill"), outcomes(result, "decode")
    summary = result.summary()
    failing = set(DECODE_ABORT + PREFILL_ABORT + BAD_PAGE + DUPLICATE)
    for i in range(cfg.rooms):
        want = FAILED if i in failing else SUCCESS
        assert pre[i].status == want and dec[i].status == want, (i, pre[i].failure, dec[i].failure, summary)

    for i in DECODE_ABORT + PREFILL_ABORT:
        assert "abort" in pre[i].failure.lower() and "abort" in dec[i].failure.lower(), (pre[i].failure, dec[i].failure)
        assert dec[i].release == "acked", (i, dec[i].release)  # prefill proved the drain
    for i in DECODE_ABORT:  # held while their writes were held back on the wire
        assert dec[i].t_released >= session.marks["resumed"], (i, dec[i].t_released, session.marks)
    for i in BAD_PAGE:
        assert "out of range" in dec[i].failure and "out of range" in pre[i].failure, dec[i].failure
        assert dec[i].t_done - dec[i].t_sent <= SLACK_S, (dec[i].t_sent, dec[i].t_done)
    # the replays were rejected as such, and the retargeted pages stayed untouched (check_end:
    # no byte outside the rooms' pages), the replayed rooms succeeded byte-exact
    a, b = DUPLICATE
    # (whichever request reads the room's failure first gets the reason)
    assert any("Duplicate decode bootstrap room" in dec[i].failure for i in DUPLICATE), (dec[a].failure, dec[b].failure)
    for i in DUPLICATE:
        assert pre[i].t_done - pre[i].t_open <= BOOTSTRAP_TIMEOUT_S + SLACK_S, (i, pre[i].t_done, pre[i].failure)
    # (the in-flight replays were awaited before the lanes resumed; then one per finished room)
    replays = len(REPLAYED) + cfg.rooms - len(BAD_PAGE + DUPLICATE)
    assert box["rejections"].get("replayed", 0) >= replays, box["rejections"]

    rejected = {x["key"]: x["rejected"] for x in box["peers"]}
    expect = {
        "layers": ("KV layers", "prefill=[0, 2)", "decode=[0, 1)"),
        "item_len": ("item_len", "prefill=", "decode="),
        "dtype": ("kv_cache_dtype", "prefill=bfloat16", "decode=float16"),
        "page_size": ("page_size", "prefill=16", "decode=8"),
        "tp_layout": ("prefill=", "decode="),
    }
    for name, (key, _frames) in box["fakes"].items():
        text = rejected.get(key) or ""
        assert "refused at registration" in text and all(w in text for w in expect[name]), (name, text)
