"""No module of the package uses a `_`-prefixed name of another of its modules.

A private name is one module's own business: another module that needs it wants a public part
instead (the layer-wise worker once called `ChunkSubmitter._post`, the layer planner imported
`plans._to_pairs`, the hooks called `session._stop`). Checked on the source:

- `from sglang_mori.x import _name` (or a relative import of one);
- `obj._name` on anything but `self` / `cls`, where `_name` is defined by another module of the
  package (a module-level name, a class member, or an attribute it assigns on `self`) and not by
  the module that uses it. SGLang's private members are sglang_compat.py's business, checked in
  test_backend_boundaries.py.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "python" / "sglang_mori"


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_privates(tree: ast.AST) -> set:
    """Private names a module defines: module-level and class-level definitions and assignments,
    and attributes it assigns on `self`."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and private(node.name):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and private(node.id):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and private(node.attr):
            out.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and private(node.target.id):
            out.add(node.target.id)
        elif isinstance(node, ast.keyword) and node.arg and private(node.arg):
            out.add(node.arg)  # e.g. argparse's set_defaults(_name=...)
    return out


# softio's modules share the private members of its descriptors and status objects the way
# MORI-IO's C++ classes are friends of each other: inside softio/, softio's own private names are
# not counted (anything else, and softio's names used outside it, are).
def friends(user: str, owners: set) -> bool:
    return user.startswith("softio/") and all(str(o.relative_to(PACKAGE)).startswith("softio/") for o in owners)


def modules() -> dict:
    return {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def test_no_module_uses_another_modules_private_names():
    trees = modules()
    owners: dict = {}
    for path, tree in trees.items():
        for name in defined_privates(tree):
            owners.setdefault(name, set()).add(path)
    offenders = []
    for path, tree in trees.items():
        own = defined_privates(tree)
        rel = path.relative_to(REPO)
        inner = str(path.relative_to(PACKAGE))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("sglang_mori")):
                offenders += [f"{rel}:{node.lineno}: from {node.module} import {a.name}"
                              for a in node.names if private(a.name) and not inner.startswith("softio/")]
            elif isinstance(node, ast.Attribute) and private(node.attr) and node.attr not in own:
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                others = owners.get(node.attr, set()) - {path}
                if others and not friends(inner, others):
                    where = ", ".join(str(p.relative_to(PACKAGE)) for p in sorted(others))
                    offenders.append(f"{rel}:{node.lineno}: .{node.attr} (defined in {where})")
    assert offenders == [], "\n".join(offenders)


def test_the_check_sees_what_it_forbids():
    """The scan's own rules, on a two-module sample."""
    a = ast.parse("class Submitter:\n    def _post(self):\n        self._n = 1\n")
    b = ast.parse("from pkg.a import _helper\n\ndef run(s):\n    s._post()\n    s._mine = 2\n")
    assert defined_privates(a) == {"_post", "_n"}
    assert "_mine" in defined_privates(b) and "_post" not in defined_privates(b)
