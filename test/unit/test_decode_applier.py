"""One writer of SGLang's room tables on decode: decode/effects.py, checked on the source.

The decode service and the receiver decide; `DecodeEffects` carries the decision out. So in
decode/ and receiver.py, no module but decode/effects.py may
- call a write of the SGLang adapter (every `SGLangAdapter` method but the reads named below) on
  `.sglang` or a name bound to it;
- call, on anything, a method of SGLang's manager that the adapter's writes call
  (`update_status`, `apply_prefill_status`, `note_abort_ack`, ...);
- assign into, delete from, or mutate one of SGLang's per-room tables (`request_status`, ...).
Reads (`sglang.status(room)`, `room in mgr.request_status`) are fine anywhere.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BACKEND = REPO / "python" / "sglang_mori" / "backend"
APPLIER = "decode/effects.py"
SCANNED = sorted(BACKEND.glob("decode/*.py")) + [BACKEND / "receiver.py"]

# Adapter methods that change nothing. A new adapter method counts as a write until named here.
ADAPTER_READS = {"status", "failure_reason", "ack_poisoned",
                 "check_peer_aux_buffer_count"}  # a registration check: no room table
SGLANG_ROOM_TABLES = {"request_status", "failure_records", "transfer_infos", "req_to_decode_prefix_len",
                      "required_prefill_response_num_table", "prefill_response_tracker", "prefill_info_table",
                      "addr_to_rooms_tracker"}
MUTATORS = {"pop", "popitem", "setdefault", "clear", "update", "add", "discard", "remove", "append",
            "__setitem__", "__delitem__"}


def adapter_methods():
    """(writes, manager calls made by the writes), from sglang_adapter.SGLangAdapter's source."""
    tree = ast.parse((BACKEND / "sglang_adapter.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SGLangAdapter")
    writes, mgr_calls = set(), set()
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("_"):
            continue
        if any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list):
            continue
        if fn.name in ADAPTER_READS:
            continue
        writes.add(fn.name)
        for node in ast.walk(fn):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "_mgr"):
                mgr_calls.add(node.func.attr)
    return writes, mgr_calls


def last_name(node) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def writes_in(source: str) -> list:
    """(line, what) for each write to SGLang's room tables in `source`."""
    adapter_writes, mgr_writes = adapter_methods()
    tree = ast.parse(source)
    # Names bound to the adapter: `sglang = self.p.sglang`, `s = p.sglang`.
    adapter_names = {"sglang"} | {
        t.id for node in ast.walk(tree) if isinstance(node, ast.Assign) and last_name(node.value) == "sglang"
        for t in node.targets if isinstance(t, ast.Name)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name, on = node.func.attr, last_name(node.func.value)
            if on in adapter_names and name in adapter_writes:
                out.append((node.lineno, f"adapter {name}"))
            elif name in mgr_writes:
                out.append((node.lineno, f"SGLang manager {name}"))
            elif on in SGLANG_ROOM_TABLES and name in MUTATORS:
                out.append((node.lineno, f"{on}.{name}"))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            if last_name(node.value) in SGLANG_ROOM_TABLES:
                out.append((node.lineno, f"{last_name(node.value)}[...] write"))
    return out


def test_the_check_knows_the_adapters_writes():
    writes, mgr_calls = adapter_methods()
    assert {"fail", "set_status", "apply_prefill_status", "drop_stale_failure", "note_abort_ack"} <= writes
    assert {"update_status", "apply_prefill_status", "note_abort_ack"} <= mgr_calls
    assert "status" not in writes


def test_only_the_decode_applier_writes_sglangs_room_tables():
    found = {}
    for path in SCANNED:
        rel = str(path.relative_to(BACKEND))
        if rel != APPLIER:
            for line, what in writes_in(path.read_text()):
                found.setdefault(rel, []).append(f"line {line}: {what}")
    assert not found, f"only {APPLIER} writes SGLang's room tables on decode: {found}"
    # ...and the applier is where the writes went (a rename would leave the rule checking nothing).
    assert writes_in((BACKEND / APPLIER).read_text())


def test_the_check_sees_each_way_of_writing():
    source = """
def f(self, p, mgr, room):
    p.sglang.note_abort_ack(room, 0, 1)
    s = self.p.sglang
    s.drop_stale_failure(room)
    mgr.update_status(room, 4)
    mgr.request_status[room] = 4
    del self.kv_mgr.failure_records[room]
    mgr.transfer_infos.pop(room, None)
    before = p.sglang.status(room)
    return room in mgr.request_status, mgr.request_status.get(room), before
"""
    assert [what for _, what in sorted(writes_in(source))] == [
        "adapter note_abort_ack", "adapter drop_stale_failure", "SGLang manager update_status",
        "request_status[...] write", "failure_records[...] write", "transfer_infos.pop"]
