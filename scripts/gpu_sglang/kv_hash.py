"""Byte check of the KV a PD transfer moved: per room, per layer, K and V hashed on both sides.

An SGLang plugin (entry point `sglang.srt.plugins`, written by device_run.sh on the GPU machine; a
dist-info made by the CPU test elsewhere) that does nothing unless SGLANG_MORI_KV_HASH names a folder.
Then every server process appends one JSON line per (room, head range) to FOLDER/kv-PID.jsonl:

prefill  when its sender first polls Success (every write of the room landed; SGLang frees the
         room's pages only after it has seen that), the room's pages on this rank, all its KV heads;
decode   when its receiver first polls Success (before decode's first forward of the request; decode
         never rewrites the KV of prompt positions), the room's destination pages, sliced into the
         head ranges of the prefill ranks (SGLANG_MORI_KV_HASH_PREFILL_TP, default 1), so decode's
         heads [r*H/tp, (r+1)*H/tp) are compared with prefill rank r's pages.

Each line: {"side", "room", "heads": [lo, hi) global KV heads, "tokens", "layers": [[k, v] hex
digests per layer], "bytes"}. `compare(folder)` matches the two sides. Measurement only: the hooks
read the pool and change no argument or result; pages of size 1 (the Triton backend's default) and
KV heads not replicated across ranks (KV heads >= TP) only -- anything else is recorded as
unsupported, never guessed. MLA pools (one latent buffer per layer, [slots, 1, kv_lora_rank + rope dims],
the same on every rank) are hashed whole on both sides as "heads" [0, 1) with one digest per layer.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Dict, List, Optional

ENV = "SGLANG_MORI_KV_HASH"
PREFILL_TP_ENV = "SGLANG_MORI_KV_HASH_PREFILL_TP"
SUCCESS = 4  # KVPoll.Success

_lock = threading.Lock()
_file = None
_pools: list = []
_prefill_pages: Dict[int, list] = {}  # room -> [(first token, page indices)] in chunk order
_decode_pages: Dict[int, tuple] = {}  # room -> (page indices, decode_prefix_len)
_done: set = set()


def emit(record: Dict) -> None:
    global _file
    with _lock:
        if _file is None:
            _file = open(os.path.join(os.environ[ENV], f"kv-{os.getpid()}.jsonl"), "a", buffering=1)
        _file.write(json.dumps(record) + "\n")


def _tp_rank_size():
    from sglang.srt.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                       get_tensor_model_parallel_world_size)

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def is_mla(pool) -> bool:
    """SGLang's MLATokenToKVPool: `kv_buffer` per layer, no K / V split."""
    return not hasattr(pool, "k_buffer") and hasattr(pool, "kv_buffer")


def layer_buffers(pool, layer: int) -> tuple:
    return (pool.kv_buffer[layer],) if is_mla(pool) else (pool.k_buffer[layer], pool.v_buffer[layer])


def layer_hashes(pool, slots, head_lo: int, head_hi: int) -> tuple:
    """[[K digest, V digest] per layer] (MLA: [[latent digest]]) of the tokens at `slots`, local heads
    [head_lo, head_hi)."""
    import torch

    out, nbytes = [], 0
    for layer in range(len(pool.kv_buffer if is_mla(pool) else pool.k_buffer)):
        pair = []
        for buf in layer_buffers(pool, layer):
            idx = torch.as_tensor(slots, dtype=torch.int64).to(buf.device)
            part = buf.index_select(0, idx)[:, head_lo:head_hi].contiguous()
            raw = part.view(torch.uint8).cpu().numpy().tobytes()
            nbytes += len(raw)
            pair.append(hashlib.blake2b(raw, digest_size=16).hexdigest())
        out.append(pair)
    return out, nbytes


def _pool_problem(pool) -> Optional[str]:
    if pool is None:
        return "no KV pool seen in this process"
    if getattr(pool, "page_size", 1) != 1:
        return f"page_size {pool.page_size} (only 1 is hashed)"
    if is_mla(pool):
        shape = tuple(pool.kv_buffer[0].shape)
        return None if len(shape) == 3 and shape[1] == 1 else f"MLA buffer layout {shape} is not [slots, 1, dim]"
    if pool.k_buffer[0].dim() != 3 or pool.k_buffer[0].shape[1] != pool.head_num:
        return f"KV buffer layout {tuple(pool.k_buffer[0].shape)} is not [slots, heads, dim]"
    return None


def hash_prefill(room: int, pages, pool, rank: int) -> None:
    problem = _pool_problem(pool)
    mla = pool is not None and is_mla(pool)
    heads = [0, 1] if mla else [rank * pool.head_num, (rank + 1) * pool.head_num] if pool is not None else None
    base = {"side": "prefill", "room": room, "heads": heads, "tokens": len(pages)}
    if problem:
        emit(dict(base, unsupported=problem))
        return
    layers, nbytes = layer_hashes(pool, pages, 0, 1 if mla else pool.head_num)
    emit(dict(base, layers=layers, bytes=nbytes))


def hash_decode(room: int, pages, prefix_len: int, pool, rank: int, prefill_tp: int) -> None:
    """One line per prefill rank whose heads lie in this decode rank's heads."""
    problem = _pool_problem(pool)
    if problem or prefix_len:
        emit({"side": "decode", "room": room, "heads": None, "tokens": len(pages),
              "unsupported": problem or f"decode_prefix_len {prefix_len} (decode's radix cache)"})
        return
    if is_mla(pool):  # every prefill rank holds the whole latent: one slice, all of it
        layers, nbytes = layer_hashes(pool, pages, 0, 1)
        emit({"side": "decode", "room": room, "heads": [0, 1], "tokens": len(pages), "layers": layers, "bytes": nbytes})
        return
    lo, hi = rank * pool.head_num, (rank + 1) * pool.head_num
    total = pool.head_num * _decode_tp()
    if total % prefill_tp:
        emit({"side": "decode", "room": room, "heads": None, "tokens": len(pages),
              "unsupported": f"{total} KV heads do not split over prefill TP {prefill_tp}"})
        return
    per = total // prefill_tp
    for r in range(prefill_tp):
        plo, phi = r * per, (r + 1) * per
        if lo <= plo and phi <= hi:
            layers, nbytes = layer_hashes(pool, pages, plo - lo, phi - lo)
            emit({"side": "decode", "room": room, "heads": [plo, phi], "tokens": len(pages),
                  "layers": layers, "bytes": nbytes})


def _decode_tp() -> int:
    return _tp_rank_size()[1]


# --- hooks (never raise into SGLang: see _quiet) -------------------------------------------------
def _after_pool_init(result, self, *args, **kwargs):
    """Keeps the pool, and records how this process does float32 matmuls (set by SGLang's model
    runner before the pool is made): TF32 or not, and whether batch-invariant ops replace aten::mm
    (their Triton kernels take TF32 for a float32 dot unless TRITON_F32_DEFAULT says otherwise)."""
    import torch

    _pools.append(self)
    try:
        from sglang.srt.batch_invariant_ops import is_batch_invariant_mode_enabled
        invariant = is_batch_invariant_mode_enabled()
    except ImportError:
        invariant = None
    try:
        import triton.knobs
        dot_f32 = triton.knobs.language.fp32_default
    except (ImportError, AttributeError):
        dot_f32 = "unknown"
    emit({"side": "process", "kv_dtype": str(self.dtype), "head_num": getattr(self, "head_num", None),
          "mla": is_mla(self),
          "triton_fp32_dot_default": dot_f32 or "tf32 (Triton's own default)",
          "float32_matmul_precision": torch.get_float32_matmul_precision(),
          "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
          "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32, "batch_invariant_ops": invariant,
          "TRITON_F32_DEFAULT": os.environ.get("TRITON_F32_DEFAULT")})


def _before_add_transfer(self, room_id, kv_indices, index_slice, is_last, *args, **kwargs):
    import numpy as np

    start = getattr(index_slice, "start", None) or 0
    with _lock:
        _prefill_pages.setdefault(int(room_id), []).append((start, np.asarray(kv_indices).copy()))


def _after_sender_poll(result, self, *args, **kwargs):
    import numpy as np

    room = self.bootstrap_room
    if int(result) != SUCCESS or ("p", room) in _done:
        return
    _done.add(("p", room))
    with _lock:
        chunks = sorted(_prefill_pages.pop(int(room), []), key=lambda c: c[0])
    pages = np.concatenate([c[1] for c in chunks]) if chunks else np.zeros(0, dtype=np.int64)
    hash_prefill(int(room), pages, _pools[0] if _pools else None, _tp_rank_size()[0])


def _before_record_destination(self, *args, **kwargs):
    import numpy as np

    with _lock:
        _decode_pages[int(kwargs["bootstrap_room"])] = (np.asarray(kwargs["kv_indices"]).copy(),
                                                        int(kwargs.get("decode_prefix_len") or 0))


def _after_receiver_poll(result, self, *args, **kwargs):
    room = getattr(self, "bootstrap_room", None)
    if room is None or int(result) != SUCCESS or ("d", room) in _done:
        return
    _done.add(("d", room))
    with _lock:
        pages, prefix = _decode_pages.pop(int(room), (None, 0))
    if pages is None:
        emit({"side": "decode", "room": int(room), "heads": None, "unsupported": "no destination seen"})
        return
    prefill_tp = int(os.environ.get(PREFILL_TP_ENV, "1"))
    hash_decode(int(room), pages, prefix, _pools[0] if _pools else None, _tp_rank_size()[0], prefill_tp)


HOOKS = [
    ("sglang.srt.mem_cache.memory_pool.MHATokenToKVPool.__init__", _after_pool_init, "AFTER"),
    ("sglang.srt.mem_cache.memory_pool.MLATokenToKVPool.__init__", _after_pool_init, "AFTER"),
    ("sglang_mori.backend.manager.MoriKVManager.add_transfer_request", _before_add_transfer, "BEFORE"),
    ("sglang_mori.backend.sender.MoriKVSender.poll", _after_sender_poll, "AFTER"),
    ("sglang_mori.backend.decode.service.DecodeService.record_destination", _before_record_destination, "BEFORE"),
    ("sglang_mori.backend.receiver.MoriKVReceiver.poll", _after_receiver_poll, "AFTER"),
]


def _quiet(hook):
    """A hook that raises never changes the server's behaviour: it returns None (SGLang keeps the
    arguments and the result) and the error is recorded."""
    def safe(*args, **kwargs):
        try:
            hook(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - measurement only
            emit({"side": "error", "hook": hook.__name__, "error": repr(exc)})
        return None
    safe.__name__ = hook.__name__
    return safe


def register() -> None:
    if not os.environ.get(ENV):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook, kind in HOOKS:
        HookRegistry.register(target, _quiet(hook), getattr(HookType, kind))


# --- comparing the two sides (run anywhere, on the folder) ---------------------------------------
def read(folder) -> List[Dict]:
    records = []
    for path in sorted(Path(folder).glob("kv-*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return records


def compare(folder) -> Dict:
    """Every decode slice against the prefill rank that wrote it: rooms whose every slice matched,
    slices and bytes compared, and the first mismatches with the first layer that differs."""
    records = read(folder)
    prefill = {(r["room"], tuple(r["heads"])): r for r in records
               if r["side"] == "prefill" and "layers" in r}
    decode = [r for r in records if r["side"] == "decode" and "layers" in r]
    rooms: Dict[int, bool] = {}
    slices = matched = nbytes = 0
    mismatches, missing = [], 0
    for d in decode:
        p = prefill.get((d["room"], tuple(d["heads"])))
        if p is None:
            missing += 1
            rooms[d["room"]] = False
            continue
        slices += 1
        nbytes += d["bytes"]
        same = p["tokens"] == d["tokens"] and p["layers"] == d["layers"]
        matched += same
        rooms[d["room"]] = rooms.get(d["room"], True) and same
        if not same and len(mismatches) < 10:
            layer = next((i for i, (a, b) in enumerate(zip(p["layers"], d["layers"])) if a != b), None)
            mismatches.append({"room": d["room"], "heads": d["heads"], "tokens": [p["tokens"], d["tokens"]],
                               "first_layer": layer})
    decode_rooms = {r["room"] for r in decode}
    return {"rooms": len(rooms), "rooms_matched": sum(rooms.values()), "slices": slices,
            "slices_matched": matched, "bytes_compared": nbytes, "decode_slices_without_prefill": missing,
            "prefill_rooms_not_on_decode": len({k[0] for k in prefill} - decode_rooms),
            "unsupported": sorted({r["unsupported"] for r in records if "unsupported" in r})[:5],
            "errors": [r for r in records if r["side"] == "error"][:5], "mismatches": mismatches,
            "process_settings": sorted({json.dumps({k: v for k, v in r.items() if k != "side"}, sort_keys=True)
                                        for r in records if r["side"] == "process"})}


if __name__ == "__main__":
    import sys

    print(json.dumps(compare(sys.argv[1]), indent=1))
