"""The room plan: which pages, aux slots and state slots each request uses on each side.

Every worker computes the same plan from the config's seed, so nothing but the config crosses the
process boundary. Page 0 is never used (SGLang reserves it as padding) and stays zero on decode.
Pages are handed out as runs of random length in random order, so a room's pages are partly
contiguous and partly scattered on both sides, and the two sides' runs do not line up: the
backend must cope with both merged and fragmented ranges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import numpy as np

from harness.pd.config import HarnessConfig

SPARE_PREFILL_PAGES = 8
SPARE_SLOTS = 4
MAX_RUN_PAGES = 8


@dataclass(frozen=True)
class RoomPlan:
    index: int
    room: int  # bootstrap_room
    tokens: int
    prefill_pages: np.ndarray  # int32, one per page of the request, in token order
    decode_pages: np.ndarray  # int32, same length
    # (first_page, end_page) into the arrays above, one per send(); the last carries aux/state.
    chunks: Tuple[Tuple[int, int], ...]
    prefill_aux: int
    decode_aux: int
    prefill_state: int
    decode_state: int
    # Leading pages decode already holds (prefix cache): never sent, never written on decode.
    prefix_pages: int = 0
    # DP attention: the prefill DP rank and the decode DP rank that serve this room.
    prefill_dp: int = 0
    decode_dp: int = 0
    # Decode context parallel size: decode_pages are virtual pages of decode_dcp prefill pages.
    decode_dcp: int = 1

    @property
    def num_pages(self) -> int:
        return len(self.prefill_pages)

    @property
    def decode_prefix_pages(self) -> int:
        """Leading entries of decode_pages that the cached prefix covers."""
        return self.prefix_pages // self.decode_dcp

    def chunk_tokens(self, chunk: int, page_size: int) -> int:
        """Tokens covered by one send() (the last page may be partial)."""
        start, end = self.chunks[chunk]
        return max(0, min(end * page_size, self.tokens) - start * page_size)


def rooms_of_instance(plan: "Plan", instance: int, instances: int) -> List[RoomPlan]:
    """The rooms decode instance `instance` serves (all of them with a single instance)."""
    return [r for r in plan.rooms if r.index % instances == instance]


def rooms_of_rank(plan: "Plan", cfg: HarnessConfig, side: str, dp_rank: int = 0, instance: int = 0) -> List[RoomPlan]:
    """The rooms one rank of `side` serves: its DP rank's rooms (and its decode instance's)."""
    if side == "prefill":
        return [r for r in plan.rooms if r.prefill_dp == dp_rank]
    mine = rooms_of_instance(plan, instance, cfg.decode_instances)
    return [r for r in mine if r.decode_dp == dp_rank]


def prefill_dp_of(cfg: HarnessConfig, index: int, room_id: int, rng: np.random.Generator) -> int:
    """The prefill DP rank of a room: bootstrap_room % dp when SGLang follows the room id, else a
    seeded draw independent of the id (the router's choice), so routing by id would be wrong."""
    if cfg.prefill_dp == 1:
        return 0
    if cfg.prefill_dp_routing == "follow_bootstrap_room":
        return room_id % cfg.prefill_dp
    return int(rng.integers(0, cfg.prefill_dp))


@dataclass(frozen=True)
class Plan:
    rooms: List[RoomPlan]
    prefill_pool_pages: int
    decode_pool_pages: int
    prefill_aux_slots: int
    decode_aux_slots: int
    prefill_state_slots: int
    decode_state_slots: int


def _runs_in_random_order(rng: np.random.Generator, num_pages: int) -> np.ndarray:
    """Pages 1..num_pages-1 cut into ascending runs of 1..MAX_RUN_PAGES, runs shuffled."""
    pages = np.arange(1, num_pages, dtype=np.int32)
    cuts, pos = [], 0
    while pos < len(pages):
        pos += int(rng.integers(1, MAX_RUN_PAGES + 1))
        cuts.append(min(pos, len(pages)))
    runs = np.split(pages, cuts[:-1])
    order = rng.permutation(len(runs))
    return np.concatenate([runs[i] for i in order]) if runs else pages


def _chunks(num_pages: int, chunks: int, first: int = 0) -> Tuple[Tuple[int, int], ...]:
    n = max(1, min(chunks, num_pages - first))
    bounds = np.linspace(first, num_pages, n + 1).round().astype(int)
    return tuple((int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]))


def build_plan(cfg: HarnessConfig) -> Plan:
    rng = np.random.Generator(np.random.PCG64(cfg.seed))
    ps = cfg.layout.page_size
    shape = cfg.shape
    tokens = rng.integers(shape.min_tokens, shape.max_tokens + 1, size=cfg.rooms)
    pages_per_room = [(int(t) + ps - 1) // ps for t in tokens]
    total = sum(pages_per_room)
    # Under decode context parallel decode pages are virtual: ps x dcp tokens each.
    dcp = cfg.decode_dcp
    decode_pages_per_room = [-(-int(t) // (ps * dcp)) for t in tokens]
    prefill_pool = 1 + total + SPARE_PREFILL_PAGES
    decode_pool = 1 + sum(decode_pages_per_room) + cfg.spare_decode_pages
    prefill_seq = _runs_in_random_order(rng, prefill_pool)
    decode_seq = _runs_in_random_order(rng, decode_pool)
    slots = cfg.rooms + SPARE_SLOTS
    p_aux, d_aux = rng.permutation(slots), rng.permutation(slots)
    p_state, d_state = rng.permutation(slots), rng.permutation(slots)
    # Distinct 63-bit room ids, as SGLang draws bootstrap_room at random.
    room_ids: List[int] = []
    while len(room_ids) < cfg.rooms:
        candidate = int(rng.integers(1, 2**63 - 1))
        if candidate not in room_ids:
            room_ids.append(candidate)
    for a, b in cfg.duplicate_rooms:  # a client reusing a bootstrap_room (reliability tests)
        room_ids[b] = room_ids[a]

    prefix = dict(cfg.decode_prefix)
    # A separate stream, so plans without DP are unchanged by it.
    dp_rng = np.random.Generator(np.random.PCG64(cfg.seed + 1))
    rooms, pos, dpos = [], 0, 0
    for i, n in enumerate(pages_per_room):
        # At least the last page is sent; under DCP the prefix is whole virtual pages.
        cached = min(prefix.get(i, 0), n - 1) // dcp * dcp
        dn = decode_pages_per_room[i]
        rooms.append(
            RoomPlan(
                index=i,
                room=room_ids[i],
                tokens=int(tokens[i]),
                prefill_pages=prefill_seq[pos : pos + n].copy(),
                decode_pages=decode_seq[dpos : dpos + dn].copy(),
                chunks=_chunks(n, shape.chunks, cached),
                prefill_aux=int(p_aux[i]),
                decode_aux=int(d_aux[i]),
                prefill_state=int(p_state[i]),
                decode_state=int(d_state[i]),
                prefix_pages=cached,
                prefill_dp=prefill_dp_of(cfg, i, room_ids[i], dp_rng),
                decode_dp=i % cfg.decode_dp,
                decode_dcp=dcp,
            )
        )
        pos += n
        dpos += dn
    return Plan(
        rooms=rooms,
        prefill_pool_pages=prefill_pool,
        decode_pool_pages=decode_pool,
        prefill_aux_slots=slots,
        decode_aux_slots=slots,
        prefill_state_slots=slots,
        decode_state_slots=slots,
    )
