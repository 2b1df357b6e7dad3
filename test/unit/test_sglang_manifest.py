"""SGLang is read in one place: every member sglang-mori uses is declared in
backend/sglang_manifest.py and present in the installed SGLang; only the SGLang-facing modules
read SGLang objects, and they read only declared members.

The static rule (an AST scan of the package):
- `import sglang...` only in the SGLang-facing modules and plugin.py (the entry point);
- elsewhere, no attribute read, getattr or hasattr on a name that holds an SGLang object in this
  code base (`scheduler`, `req`, `mgr`, `server_args`, ... and, in hooks.py, `batch`/`backend`):
  those modules call sglang_fields / sglang_compat / the adapter instead;
- in the SGLang-facing modules and the subclass shells (manager, sender, receiver, bootstrap),
  every such read, every `self.<member>` a shell inherits from SGLang and every `super().<member>`
  names a member the manifest declares.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sglang_mori.backend import sglang_manifest as manifest

PKG = Path(__file__).resolve().parents[2] / "python" / "sglang_mori"
FACING = {"backend/sglang_compat.py", "backend/sglang_adapter.py", "backend/sglang_fields.py",
          "backend/sglang_manifest.py"}
SHELLS = {"backend/manager.py", "backend/sender.py", "backend/receiver.py", "backend/bootstrap.py"}
ENTRY = {"plugin.py"}
# Names that hold SGLang objects in this package; per module, names that do there only.
SGLANG_NAMES = {"scheduler", "req", "forward_batch", "layer", "server_args", "kv_args", "parallel", "mgr",
                "kv_mgr", "receiver", "sender", "allocator"}
MODULE_NAMES = {"backend/prefill/layerwise/hooks.py": {"batch", "backend"}, "backend/sglang_fields.py":
                {"batch", "backend", "pool", "forward_info", "mode", "spec"}}
DECLARED = {name for owner in manifest.MEMBERS for name in manifest.names_of(owner)}


def modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if not rel.startswith("softio/"):
            yield rel, ast.parse(path.read_text(), filename=str(path))


def ours() -> set:
    """Attribute names this package defines itself (assigned on self, methods, class attributes)."""
    out = set()
    for _, tree in modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                out.add(node.attr)
            elif isinstance(node, ast.ClassDef):
                pass
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for stmt in cls.body:
                for t in (stmt.targets if isinstance(stmt, ast.Assign) else
                          [stmt.target] if isinstance(stmt, ast.AnnAssign) else []):
                    if isinstance(t, ast.Name):
                        out.add(t.id)
    return out


def _holder(node, names) -> bool:
    """`node` is an expression naming an SGLang object: one of `names`, or `self._mgr`."""
    if isinstance(node, ast.Name):
        return node.id in names
    return isinstance(node, ast.Attribute) and node.attr in ("_mgr", "kv_mgr")


def reads(tree, names):
    """(line, member) of every attribute read / getattr / hasattr on an SGLang-object expression."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and _holder(node.value, names):
            yield node.lineno, node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and node.args and _holder(node.args[0], names)):
            member = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else "?"
            yield node.lineno, member


def test_installed_sglang_has_every_declared_member():
    assert manifest.missing_members() == []


def test_a_missing_member_is_named_with_the_supported_version(monkeypatch):
    monkeypatch.setitem(manifest.MEMBERS, "Req", manifest.MEMBERS["Req"] + ("renamed_field",))
    missing = manifest.missing_members({"Req": manifest.MEMBERS["Req"]}, with_functions=False)
    assert missing == ["Req.renamed_field"]
    text = manifest.incompatibility(missing, "9.9.9")
    assert "supports SGLang 0.5.23" in text and "9.9.9" in text and "Req.renamed_field" in text


def test_only_the_sglang_facing_modules_import_sglang():
    bad = []
    for rel, tree in modules():
        if rel in FACING | ENTRY:
            continue
        for node in ast.walk(tree):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{rel}:{node.lineno} imports {m}" for m in mods if m == "sglang" or m.startswith("sglang.")]
    assert bad == [], "import SGLang through backend/sglang_compat.py or sglang_fields.py:\n" + "\n".join(bad)


def test_no_other_module_touches_an_sglang_object():
    bad = []
    for rel, tree in modules():
        if rel in FACING | SHELLS:
            continue
        names = SGLANG_NAMES | MODULE_NAMES.get(rel, set())
        bad += [f"{rel}:{line} reads .{member}" for line, member in reads(tree, names)]
    assert bad == [], "read SGLang through sglang_fields / sglang_compat / the adapter:\n" + "\n".join(bad)


def test_sglang_facing_modules_and_shells_read_only_declared_members():
    own = ours()
    bad = []
    for rel, tree in modules():
        if rel not in FACING | SHELLS:
            continue
        names = SGLANG_NAMES | MODULE_NAMES.get(rel, set())
        found = list(reads(tree, names))
        if rel in SHELLS:
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    if isinstance(node.value, ast.Name) and node.value.id == "self":
                        found.append((node.lineno, node.attr))
                    elif (isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                          and node.value.func.id == "super"):
                        found.append((node.lineno, node.attr))
        # "?": a getattr with a computed name, which these modules use only over declared names.
        bad += [f"{rel}:{line} .{member}" for line, member in found
                if member not in DECLARED | {"?"} and member not in own and not member.startswith("__")]
    assert bad == [], "declare these SGLang members in backend/sglang_manifest.py:\n" + "\n".join(bad)


@pytest.mark.parametrize("target", manifest.HOOK_TARGETS)
def test_hook_targets_are_declared_once(target):
    from sglang_mori import plugin

    used = [plugin.GET_KV_CLASS_TARGET] + [t for t, _ in manifest.LAYERWISE_HOOKS]
    assert used.count(target) == 1


def test_every_layerwise_hook_names_a_function_of_the_hooks_module():
    from sglang_mori.backend.prefill.layerwise import hooks

    for _, name in manifest.LAYERWISE_HOOKS:
        assert callable(getattr(hooks, name, None)), name


def test_registering_the_layerwise_hooks_does_not_import_them(monkeypatch):
    # plugin._lazy_hook imports the hooks module on a hook's first call; register() must not import
    # it itself, or the lazy wrapper would buy nothing (issue 26).
    import sys

    from sglang.srt.plugins import hook_registry

    from sglang_mori import plugin

    hooks_module = "sglang_mori.backend.prefill.layerwise.hooks"
    monkeypatch.delitem(sys.modules, hooks_module, raising=False)
    registered = []
    monkeypatch.setattr(hook_registry.HookRegistry, "register",
                        staticmethod(lambda target, hook, kind: registered.append((target, hook))))
    monkeypatch.setenv("SGLANG_MORI_LAYERWISE", "auto")
    plugin.register()
    assert hooks_module not in sys.modules
    assert [t for t, _ in registered] == [plugin.GET_KV_CLASS_TARGET] + [t for t, _ in manifest.LAYERWISE_HOOKS]
    # The first call imports the module and runs its hook.
    _, around_checkpoint = registered[-1]
    calls = []
    monkeypatch.setitem(sys.modules, hooks_module, type(sys)("stub"))
    sys.modules[hooks_module].around_checkpoint = lambda original, *a: calls.append(a) or original(*a)
    monkeypatch.setattr(sys.modules["sglang_mori.backend.prefill.layerwise"], "hooks", sys.modules[hooks_module],
                        raising=False)
    assert around_checkpoint(lambda *a: "ran", 1, 2) == "ran" and calls == [(1, 2)]


def test_start_up_check_skips_modules_this_process_never_loaded(monkeypatch):
    """At start-up only loaded modules are checked (a scheduler has them all); an owner whose module
    is not imported is skipped, not imported."""
    import sys

    monkeypatch.setitem(manifest.OWNERS, "Ghost", "sglang_mori_no_such_module:Ghost")
    monkeypatch.setitem(manifest.MEMBERS, "Ghost", ("anything",))
    assert "sglang_mori_no_such_module" not in sys.modules
    assert not any(m.startswith("Ghost") for m in manifest.missing_members(loaded_only=True))
    assert "Ghost (sglang_mori_no_such_module:Ghost)" in manifest.missing_members()
