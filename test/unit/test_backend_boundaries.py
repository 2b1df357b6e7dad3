"""The boundaries the backend redesign drew, checked on the source so they cannot erode:

- only backend/sglang_compat.py names a private member of SGLang's common disaggregation classes;
- only engine/ (and softio, which is an engine) reads MORI's error strings or status codes;
- the wheel ships no test tooling.
"""

import ast
import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "python" / "sglang_mori"


def sglang_private_members() -> set:
    """`_names` SGLang's common conn.py defines or assigns on self (methods and tables)."""
    root = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    tree = ast.parse((root / "srt" / "disaggregation" / "common" / "conn.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("_") \
                and not node.name.startswith("__"):
            names.add(node.name)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            names.add(node.attr)
    return names


def attribute_names(path: Path) -> set:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)  # an override of a private hook counts too
    return out


def test_only_sglang_compat_names_sglang_private_members():
    private = sglang_private_members()
    assert {"_staging_outstanding", "_prefill_unique_rank", "_send_abort_notification"} <= private
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "sglang_compat.py" or "softio" in path.parts:
            continue
        used = attribute_names(path) & private
        # Our own classes may keep members under the same names (e.g. `_lock`); the rule is about
        # SGLang's, so names this module assigns itself are not counted. Methods it *defines* are:
        # overriding one of SGLang's private hooks is touching it.
        own = {n.attr for n in ast.walk(ast.parse(path.read_text()))
               if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
        used -= own
        if used:
            offenders[str(path.relative_to(REPO))] = sorted(used)
    assert offenders == {}, offenders


# MORI's error strings, its raw status and event API, and setting its environment variables.
MORI_STRINGS = re.compile(r"SQ full|ibv_post_send|pop_peer_failure\(|WaitFor\(|\.Code\(\)|\.Message\(\)"
                          r"|environ\[.MORI_[A-Z_]+.\]\s*=")


def test_only_engine_reads_mori_error_strings_and_codes():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in ("engine", "softio", "doctor") or rel == Path("cli/bench_engine.py"):
            continue  # the engine, the software engine and its benchmark, the host doctor
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if MORI_STRINGS.search(code) and not code.strip().startswith(('"', "'")):
                offenders.append(f"{rel}:{lineno}: {line.strip()}")
    assert offenders == [], "\n".join(offenders)


def test_the_wheel_ships_no_test_tooling():
    assert not (PACKAGE / "testing").exists()
    assert not list(PACKAGE.rglob("mori_shim"))
    assert not list(PACKAGE.rglob("fetch_reference_wheel.py"))
    setup = (REPO / "setup.py").read_text()
    assert "mori_shim" not in setup and "package_data" not in setup


def test_sglang_compat_names_what_an_sglang_build_lacks(monkeypatch):
    import pytest

    from sglang_mori.backend import sglang_compat as compat

    class Bare:
        pass

    from sglang_mori.backend import sglang_manifest as manifest

    monkeypatch.setitem(manifest.MEMBERS, "CommonKVManager", manifest.MEMBERS["CommonKVManager"] + ("_gone",))
    with pytest.raises(compat.SGLangIncompatible, match=r"supports SGLang 0\.5\.23; .*lacks 1 member\(s\) it uses: "
                       r"CommonKVManager\._gone"):
        compat._check_classes()
    monkeypatch.undo()
    compat._check_classes()  # the installed SGLang has everything
    with pytest.raises(compat.SGLangIncompatible, match=r"\(decode\).*Bare\._zmq_ctx"):
        compat.check_manager(Bare(), "decode")
