"""softio's API against the real amd-mori 1.2.4 Python layer, read from the wheel with `ast`.

Nothing of the wheel is imported (it needs ROCm). The test fails when softio lacks a class, a
method or a parameter that `mori/io/engine.py` has, orders parameters differently, or lacks a name
that `mori/io/__init__.py` re-exports from `mori.cpp`. Names of the compiled layer that softio
implements (config fields, status methods, enum members) must appear in the pybind library.
"""

from __future__ import annotations

import ast
import inspect
import os
import zipfile
from pathlib import Path

import pytest

from sglang_mori import softio
from sglang_mori.softio import engine as softio_engine
from harness.reference_wheel import CACHE_ENV, RegistryUnreachable, fetch

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def wheel() -> zipfile.ZipFile:
    cache = Path(os.environ.get(CACHE_ENV) or REPO / ".cache" / "wheels")
    try:
        path = fetch(cache)
    except RegistryUnreachable as exc:
        pytest.skip(f"amd-mori 1.2.4 wheel is not in {cache} and the package registry cannot be "
                    f"reached to download it (run `make install` with network first): {exc}")
    with zipfile.ZipFile(path) as zf:
        yield zf


def parse(wheel, name: str) -> ast.Module:
    return ast.parse(wheel.read(name).decode(), filename=name)


def param_names(fn: ast.FunctionDef) -> list[str]:
    args = fn.args
    names = [a.arg for a in args.posonlyargs + args.args]
    if args.vararg:
        names.append("*" + args.vararg.arg)
    names += [a.arg for a in args.kwonlyargs]
    return names[1:] if names and names[0] == "self" else names


def forwarded_helper(fn: ast.FunctionDef) -> str | None:
    """`def read(self, *args): return self._helper(self._engine.Read, *args)` -> "_helper"."""
    if param_names(fn) != ["*args"] or len(fn.body) != 1:
        return None
    node = fn.body[0]
    call = node.value if isinstance(node, ast.Return) else None
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


def real_signatures(cls: ast.ClassDef) -> dict[str, list[str]]:
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    out = {}
    for name, fn in methods.items():
        if name.startswith("_") and name != "__init__":
            continue
        params = param_names(fn)
        helper = forwarded_helper(fn)
        if helper is not None:
            params = param_names(methods[helper])[1:]  # drop the bound C++ function argument
        out[name] = params
    return out


def softio_params(obj) -> list[str]:
    sig = inspect.signature(obj)
    names = []
    for p in sig.parameters.values():
        if p.name == "self":
            continue
        names.append(("*" + p.name) if p.kind is p.VAR_POSITIONAL else p.name)
    return names


def test_engine_classes_methods_and_parameters_match(wheel):
    tree = parse(wheel, "mori/io/engine.py")
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    assert {c.name for c in classes} >= {"IOEngine", "IOEngineSession"}
    problems = []
    for cls in classes:
        ours = getattr(softio_engine, cls.name, None)
        if ours is None:
            problems.append(f"softio lacks class {cls.name}")
            continue
        for method, params in real_signatures(cls).items():
            mine = getattr(ours, method, None)
            if mine is None:
                problems.append(f"softio {cls.name} lacks {method}{tuple(params)}")
            elif softio_params(mine) != params:
                problems.append(f"{cls.name}.{method}: real {params}, softio {softio_params(mine)}")
    assert not problems, "\n".join(problems)


def test_default_values_match(wheel):
    tree = parse(wheel, "mori/io/engine.py")
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            defaults = fn.args.defaults
            if not defaults:
                continue
            names = [a.arg for a in fn.args.args][-len(defaults):]
            sig = inspect.signature(getattr(getattr(softio_engine, cls.name), fn.name))
            for name, node in zip(names, defaults):
                assert sig.parameters[name].default == ast.literal_eval(node), \
                    f"{cls.name}.{fn.name}({name}=...)"


def test_module_level_names_of_engine_py_exist(wheel):
    tree = parse(wheel, "mori/io/engine.py")
    names = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    names |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
              if isinstance(t, ast.Name) and not t.id.startswith("_")}
    assert names, "engine.py parsed to nothing"
    missing = sorted(n for n in names if not hasattr(softio_engine, n))
    assert not missing, f"softio.engine lacks {missing}"


def test_names_reexported_from_mori_cpp_are_exported(wheel):
    tree = parse(wheel, "mori/io/__init__.py")
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             and node.module == "mori.cpp" for alias in node.names]
    assert "IOEngineConfig" in names and "PeerFailureEvent" in names
    # engine.py itself reaches into mori.cpp too (e.g. mori_cpp.TransferStatus).
    engine_tree = parse(wheel, "mori/io/engine.py")
    names += [node.attr for node in ast.walk(engine_tree) if isinstance(node, ast.Attribute)
              and isinstance(node.value, ast.Name) and node.value.id == "mori_cpp"]
    missing = sorted({n for n in names if not hasattr(softio, n)})
    assert not missing, f"softio does not export {missing}"


def test_compiled_names_softio_implements_exist_in_the_bindings(wheel):
    binary = next(n for n in wheel.namelist() if n.endswith("libmori_pybinds.so"))
    data = wheel.read(binary)
    names = set(vars(softio.RdmaBackendConfig()))
    names |= set(vars(softio.XgmiBackendConfig())) | {"host", "port"}
    names |= {m for m in vars(softio.TransferStatus) if m[:1].isupper()}
    for enum in (softio.StatusCode, softio.BackendType, softio.MemoryLocationType,
                 softio.PollCqMode, softio.PeerFailureReason):
        names.add(enum.__name__)
        names |= set(enum.__members__)
    names |= {"remote_engine_key", "reason", "qp_num", "port_num", "device_name", "detail",
              "engine_key", "device_bus_id", "numa_node", "ipc_handle", "node_id", "hostname",
              "PopPeerFailure", "PopInboundTransferStatus", "WaitAll", "timeout_ms"}
    missing = sorted(n for n in names if n.encode() not in data)
    assert not missing, f"not in {binary}: {missing}"
