"""scripts/gpu_sglang/kv_hash.py: the byte check of a PD transfer's KV that docs/benchmarks.md's TP 2
rows rest on. Driven through its hooks with CPU pools: two prefill ranks of 2 KV heads each, one
decode of 4, the pages at different slots on each side. Equal bytes must match per room, one
flipped byte must be found in its layer, and nothing is recorded before Success."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "gpu_sglang"))
import kv_hash  # noqa: E402

LAYERS, HEADS, DIM, SLOTS = 3, 4, 8, 64
PREFILL_TP = 2


def pool(heads: int) -> SimpleNamespace:
    def buf():
        return torch.zeros(SLOTS, heads, DIM, dtype=torch.bfloat16)
    return SimpleNamespace(k_buffer=[buf() for _ in range(LAYERS)], v_buffer=[buf() for _ in range(LAYERS)],
                           head_num=heads, page_size=1, dtype=torch.bfloat16)


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """kv_hash writing under tmp_path, with fresh per-process state."""
    monkeypatch.setenv(kv_hash.ENV, str(tmp_path))
    monkeypatch.setenv(kv_hash.PREFILL_TP_ENV, str(PREFILL_TP))
    monkeypatch.setattr(kv_hash, "_file", None)
    for name in ("_prefill_pages", "_decode_pages"):
        monkeypatch.setattr(kv_hash, name, {})
    monkeypatch.setattr(kv_hash, "_done", set())
    yield tmp_path
    if kv_hash._file is not None:
        kv_hash._file.close()


def transfer(monkeypatch, room: int, tokens: int, flip=None):
    """One room's KV written on two prefill ranks and (copied by head slice) into decode's pages,
    then each side's hooks as SGLang and our backend call them."""
    gen = torch.Generator().manual_seed(room)
    p_pages = torch.randperm(SLOTS, generator=gen)[:tokens].numpy()
    d_pages = torch.randperm(SLOTS, generator=gen)[:tokens].numpy()
    decode = pool(HEADS)
    for r in range(PREFILL_TP):
        rank_pool = pool(HEADS // PREFILL_TP)
        for layer in range(LAYERS):
            for src, dst in ((rank_pool.k_buffer[layer], decode.k_buffer[layer]),
                             (rank_pool.v_buffer[layer], decode.v_buffer[layer])):
                src[p_pages] = torch.randn(tokens, HEADS // PREFILL_TP, DIM, generator=gen).to(torch.bfloat16)
                dst[d_pages, r * 2:(r + 1) * 2] = src[p_pages]
        monkeypatch.setattr(kv_hash, "_pools", [rank_pool])
        monkeypatch.setattr(kv_hash, "_tp_rank_size", lambda r=r: (r, PREFILL_TP))
        half = tokens // 2  # two chunks, handed over out of order
        kv_hash._before_add_transfer(None, room, p_pages[half:], slice(half, tokens), True)
        kv_hash._before_add_transfer(None, room, p_pages[:half], slice(0, half), False)
        sender = SimpleNamespace(bootstrap_room=room)
        kv_hash._after_sender_poll(3, sender)  # Transferring: nothing yet
        kv_hash._after_sender_poll(4, sender)
        kv_hash._done.discard(("p", room))  # the next rank is another process in SGLang
    if flip is not None:
        layer, slot_i = flip
        decode.v_buffer[layer].view(torch.uint8)[d_pages[slot_i], 3, 0] ^= 1  # rank 1's heads
    monkeypatch.setattr(kv_hash, "_pools", [decode])
    monkeypatch.setattr(kv_hash, "_tp_rank_size", lambda: (0, 1))
    kv_hash._before_record_destination(None, bootstrap_room=room, required_dst_info_num=PREFILL_TP,
                                       kv_indices=d_pages, aux_index=0, state_indices=None,
                                       decode_prefix_len=0, is_dummy=False)
    receiver = SimpleNamespace(bootstrap_room=room)
    kv_hash._after_receiver_poll(1, receiver)
    kv_hash._after_receiver_poll(4, receiver)
    kv_hash._after_receiver_poll(4, receiver)  # polled again after Success: hashed once


def test_equal_bytes_match_per_room_and_slice(probe, monkeypatch):
    transfer(monkeypatch, room=11, tokens=7)
    transfer(monkeypatch, room=12, tokens=20)
    got = kv_hash.compare(probe)
    per_slice = LAYERS * 2 * 2 * DIM * 2  # layers x (K, V) x heads x dim x bf16, per token
    assert got["rooms"] == got["rooms_matched"] == 2
    assert got["slices"] == got["slices_matched"] == 4
    assert got["bytes_compared"] == PREFILL_TP * (7 + 20) * per_slice
    assert (got["mismatches"], got["errors"], got["unsupported"]) == ([], [], [])


def test_one_flipped_byte_is_found_in_its_layer(probe, monkeypatch):
    transfer(monkeypatch, room=21, tokens=9)
    transfer(monkeypatch, room=22, tokens=9, flip=(2, 4))
    got = kv_hash.compare(probe)
    assert (got["rooms"], got["rooms_matched"], got["slices_matched"]) == (2, 1, 3)
    assert got["mismatches"] == [{"room": 22, "heads": [2, 4], "tokens": [9, 9], "first_layer": 2}]


def test_decode_without_prefill_record_is_not_a_match(probe, monkeypatch):
    transfer(monkeypatch, room=31, tokens=5)
    lines = [ln for ln in (probe / next(probe.glob("kv-*.jsonl")).name).read_text().splitlines()
             if '"side": "prefill"' not in ln or '"heads": [0, 2]' in ln]
    (probe / next(probe.glob("kv-*.jsonl")).name).write_text("\n".join(lines) + "\n")
    got = kv_hash.compare(probe)
    assert (got["rooms"], got["rooms_matched"], got["decode_slices_without_prefill"]) == (1, 0, 1)


def test_a_failing_hook_changes_nothing_and_is_recorded(probe, monkeypatch):
    monkeypatch.setattr(kv_hash, "_pools", [])
    safe = kv_hash._quiet(kv_hash._after_receiver_poll)
    assert safe(4, object()) is None  # no bootstrap_room: nothing to hash, no error
    bad = kv_hash._quiet(kv_hash._before_record_destination)
    assert bad(None, bootstrap_room=5) is None  # kv_indices missing: KeyError inside, swallowed
    assert kv_hash.compare(probe)["errors"][0]["hook"] == "_before_record_destination"


def mla_pool() -> SimpleNamespace:
    """SGLang's MLATokenToKVPool as the probe sees it: one latent buffer per layer, [slots, 1, dim]."""
    return SimpleNamespace(kv_buffer=[torch.zeros(SLOTS, 1, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)],
                           page_size=1, dtype=torch.bfloat16)


def mla_transfer(monkeypatch, room: int, tokens: int, flip_layer=None):
    """One MLA room: prefill's latent pages copied into decode's at other slots, then both sides' hooks."""
    gen = torch.Generator().manual_seed(room)
    p_pages = torch.randperm(SLOTS, generator=gen)[:tokens].numpy()
    d_pages = torch.randperm(SLOTS, generator=gen)[:tokens].numpy()
    prefill, decode = mla_pool(), mla_pool()
    for layer in range(LAYERS):
        prefill.kv_buffer[layer][p_pages] = torch.randn(tokens, 1, DIM, generator=gen).to(torch.bfloat16)
        decode.kv_buffer[layer][d_pages] = prefill.kv_buffer[layer][p_pages]
    if flip_layer is not None:
        decode.kv_buffer[flip_layer].view(torch.uint8)[d_pages[0], 0, 1] ^= 1
    monkeypatch.setenv(kv_hash.PREFILL_TP_ENV, "1")
    monkeypatch.setattr(kv_hash, "_pools", [prefill])
    monkeypatch.setattr(kv_hash, "_tp_rank_size", lambda: (0, 1))
    kv_hash._before_add_transfer(None, room, p_pages, slice(0, tokens), True)
    kv_hash._after_sender_poll(4, SimpleNamespace(bootstrap_room=room))
    monkeypatch.setattr(kv_hash, "_pools", [decode])
    kv_hash._before_record_destination(None, bootstrap_room=room, required_dst_info_num=1, kv_indices=d_pages,
                                       aux_index=0, state_indices=None, decode_prefix_len=0, is_dummy=False)
    kv_hash._after_receiver_poll(4, SimpleNamespace(bootstrap_room=room))


def test_mla_latent_pages_match_whole_and_a_flipped_byte_is_found(probe, monkeypatch):
    mla_transfer(monkeypatch, room=41, tokens=6)
    mla_transfer(monkeypatch, room=42, tokens=11, flip_layer=1)
    got = kv_hash.compare(probe)
    assert (got["rooms"], got["rooms_matched"], got["slices"], got["slices_matched"]) == (2, 1, 2, 1)
    assert got["bytes_compared"] == (6 + 11) * LAYERS * DIM * 2  # one latent per layer, bf16
    assert got["mismatches"] == [{"room": 42, "heads": [0, 1], "tokens": [11, 11], "first_layer": 1}]
    assert (got["errors"], got["unsupported"]) == ([], [])
