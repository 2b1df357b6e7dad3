"""One failure door per role, and one writer of SGLang's prefill room tables, checked on the source.

- Prefill: only prefill/failures.py concludes a room as failed (`conclude(False, ...)`) or records
  a failure effect (`Failure(...)`; rooms.py too, where `claim` hands SGLang a failure the door
  decided before the request arrived); only the applier (prefill/effects.py) carries the effects
  out: SGLang's failure, its statuses and outstanding counts, the abort ACK tables, the budget and
  the failure metric.
- Decode: only decode/effects.py fails a room in SGLang, closes a decode room as failed, or
  counts a failed request.
- Nobody but the adapter itself marks a room Failed through another SGLang call.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BACKEND = REPO / "python" / "sglang_mori" / "backend"

# The adapter's writes to SGLang's per-room tables (sglang_adapter.SGLangAdapter).
SGLANG_ROOM_WRITES = {"set_status", "fail", "drop_stale_failure", "publish_destinations", "set_outstanding",
                      "drop_outstanding", "poison", "hold_ack", "release_acks"}


def calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            yield node


def receiver_name(call: ast.Call) -> str:
    """The last name of what a method is called on: `p.sglang.fail(...)` -> "sglang"."""
    value = call.func.value
    if isinstance(value, ast.Attribute):
        return value.attr
    if isinstance(value, ast.Name):
        return value.id
    return ""


def mentions_failed(call: ast.Call) -> bool:
    args = list(call.args) + [k.value for k in call.keywords]
    return any(isinstance(n, (ast.Attribute, ast.Name)) and getattr(n, "attr", getattr(n, "id", "")) in ("FAILED", "Failed")
               for a in args for n in ast.walk(a))


def false_first(call: ast.Call) -> bool:
    first = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "ok"), None)
    return isinstance(first, ast.Constant) and first.value is False


def findings() -> dict:
    """rule -> set of backend-relative files where it is broken."""
    out: dict = {}
    for path in sorted(BACKEND.rglob("*.py")):
        rel = str(path.relative_to(BACKEND))
        tree = ast.parse(path.read_text())
        for call in calls(tree):
            name = call.func.attr
            rules = []
            if name == "conclude" and false_first(call):
                rules.append("conclude failed")
            if name == "finish" and any(k.arg == "ok" and isinstance(k.value, ast.Constant) and k.value.value is False
                                        for k in call.keywords):
                rules.append("close a decode room failed")
            if name == "request_finished" and not any(k.arg == "ok" and isinstance(k.value, ast.Constant)
                                                      and k.value.value is True for k in call.keywords):
                rules.append("count a failed request")
            if receiver_name(call) == "sglang" and name in SGLANG_ROOM_WRITES:
                rules.append(f"write SGLang's room tables ({name})")
            if name in ("set_status", "update_status", "apply_prefill_status") and mentions_failed(call):
                rules.append("mark Failed in SGLang")
            if receiver_name(call) == "budget" and name in ("acquire", "release"):
                rules.append("take or return budget")
            for rule in rules:
                out.setdefault(rule, set()).add(rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Failure":
                out.setdefault("record a failure", set()).add(rel)
    return out


def test_prefill_rooms_fail_only_through_failures_py():
    found = findings()
    assert found.get("conclude failed", set()) == {"prefill/failures.py"}
    assert found.get("record a failure", set()) <= {"prefill/failures.py", "prefill/rooms.py"}


def test_only_the_applier_writes_sglangs_prefill_tables_and_the_budget():
    found = findings()
    writers = set().union(*(files for rule, files in found.items() if rule.startswith("write SGLang")))
    prefill_writers = {f for f in writers if f.startswith("prefill/")}
    assert prefill_writers == {"prefill/effects.py"}, prefill_writers
    assert found.get("take or return budget", set()) == {"prefill/effects.py"}


def test_decode_rooms_fail_only_through_decode_effects_py():
    found = findings()
    assert found.get("close a decode room failed", set()) == {"decode/effects.py"}
    assert found.get("write SGLang's room tables (fail)", set()) == {"prefill/effects.py", "decode/effects.py"}
    assert found.get("count a failed request", set()) == {"prefill/effects.py", "decode/effects.py"}
    # The adapter's fail() is the one call that marks Failed; SGLang's own prefill status path
    # for Failed is the decode door's.
    assert found.get("mark Failed in SGLang", set()) <= {"sglang_adapter.py", "decode/effects.py"}
