"""docker/rocm.Dockerfile without a Docker engine: parse its instructions, then run its shell steps
(heredocs) with bash in dry-run mode for every NIC_BACKEND and ENABLE_MORI value."""

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "rocm.Dockerfile"
NIC_BACKENDS = ("none", "mlx5", "bnxt", "ainic")


def instructions():
    """(keyword, text) for each instruction; a heredoc's body is included in its RUN's text."""
    lines = DOCKERFILE.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        if not line.strip() or line.lstrip().startswith("#"):
            i += 1
            continue
        heredoc = re.search(r"<<-?'?(\w+)'?\s*$", line)
        text = line
        if heredoc:
            end = heredoc.group(1)
            body = []
            i += 1
            while lines[i] != end:
                body.append(lines[i])
                i += 1
            text = line + "\n" + "\n".join(body)
        out.append((line.split()[0].upper(), text))
        i += 1
    return out


def heredoc(name):
    for kw, text in instructions():
        if kw == "RUN" and re.search(rf"<<'{name}'", text.splitlines()[0]):
            return text.split("\n", 1)[1] + "\n"
    raise AssertionError(f"no RUN <<'{name}' heredoc in the Dockerfile")


def build_args():
    """ARG name -> default (None when declared without one), in declaration order."""
    args = {}
    for kw, text in instructions():
        if kw == "ARG":
            m = re.match(r"ARG\s+(\w+)(?:=(.*))?$", text)
            args[m.group(1)] = m.group(2)
    return args


def run_step(name, **env):
    """Always a dry run: the steps write apt sources and keys, which must never touch this host."""
    full = dict(os.environ)
    full.update({k: v for k, v in build_args().items() if v is not None})  # ARG defaults are env
    full.update(env)
    full["DOCKER_DRY_RUN"] = "1"
    return subprocess.run(["bash", "-c", heredoc(name)], env=full, capture_output=True, text=True,
                          timeout=60)


def test_build_args_and_defaults():
    args = build_args()
    assert args["BASE_IMAGE"].startswith("lmsysorg/sglang:v0.5.23-rocm")
    assert args["ENABLE_MORI"] == "1"
    assert args["NIC_BACKEND"] == "none"
    assert args["MORI_VERSION"] == "1.2.4"
    assert args["SGLANG_VERSION"] == "0.5.23"
    kws = [kw for kw, _ in instructions()]
    # BASE_IMAGE is declared before FROM (global scope) and used by it; the rest after FROM.
    assert kws.index("FROM") > list(args).index("BASE_IMAGE") == 0
    assert dict(instructions())["FROM"] == "FROM ${BASE_IMAGE}"


def test_every_heredoc_is_valid_bash():
    for kw, text in instructions():
        if kw == "RUN" and "<<" in text.splitlines()[0]:
            body = text.split("\n", 1)[1]
            assert body.startswith("#!/usr/bin/env bash\nset -euo pipefail"), text.splitlines()[0]
            r = subprocess.run(["bash", "-n"], input=body, capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("nic", NIC_BACKENDS)
def test_validation_accepts_known_values(nic):
    for mori in ("0", "1"):
        r = run_step("VALIDATE_ARGS", NIC_BACKEND=nic, ENABLE_MORI=mori)
        assert r.returncode == 0, r.stderr
        assert f"NIC_BACKEND={nic} ENABLE_MORI={mori}" in r.stdout


def test_validation_rejects_unknown_values_clearly():
    r = run_step("VALIDATE_ARGS", NIC_BACKEND="cx7")
    assert r.returncode == 2
    assert "unknown NIC_BACKEND='cx7'" in r.stderr and "none, mlx5, bnxt, ainic" in r.stderr
    r = run_step("VALIDATE_ARGS", ENABLE_MORI="yes")
    assert r.returncode == 2 and "ENABLE_MORI must be 0 or 1" in r.stderr
    # Validation is the first RUN, so a typo fails before any download.
    first_run = next(text for kw, text in instructions() if kw == "RUN")
    assert "VALIDATE_ARGS" in first_run.splitlines()[0]


EXPECTED = {  # NIC_BACKEND -> what its branch must install and check
    "none": (["rdma-core", "ibverbs-utils"], []),
    "mlx5": (["rdma-core", "ibverbs-utils", "ibverbs-providers"], ["require libmlx5"]),
    "bnxt": (["rdma-core", "ibverbs-utils", "bnxt-rocelib"],
             ["require libbnxt_re", "ethernet-nic-debian-public jammy main"]),
    "ainic": (["rdma-core", "ibverbs-utils", "libionic-dev", "ionic-common"],
              ["require libionic", "amdainic/pensando/ubuntu/1.117.5"]),
}
VENDOR_PACKAGES = {"ibverbs-providers", "bnxt-rocelib", "libionic-dev", "ionic-common"}


def installed(stdout):
    pkgs = []
    for line in stdout.splitlines():
        if line.startswith("+ apt-get install"):
            pkgs += [w.split("=")[0] for w in line.split()[3:] if not w.startswith("-")]
    return pkgs


@pytest.mark.parametrize("nic", NIC_BACKENDS)
def test_nic_branch_installs_its_userspace(nic):
    r = run_step("NIC_USERSPACE", NIC_BACKEND=nic)
    assert r.returncode == 0, r.stderr
    pkgs = installed(r.stdout)
    want, other = EXPECTED[nic]
    for p in want:
        assert p in pkgs, (nic, pkgs)
    for p in VENDOR_PACKAGES - set(want):
        assert p not in pkgs, f"{nic} installs {p}"
    for text in other:
        assert text in r.stdout, (nic, r.stdout)
    assert r.stdout.rstrip().endswith("+ sh -c rm -rf /var/lib/apt/lists/*")


def test_nic_branch_pins_bnxt_version_and_rejects_unknown():
    r = run_step("NIC_USERSPACE", NIC_BACKEND="bnxt", BNXT_ROCELIB_VERSION="235.2.86.0")
    assert "bnxt-rocelib=235.2.86.0" in r.stdout
    r = run_step("NIC_USERSPACE", NIC_BACKEND="thor2")
    assert r.returncode == 2 and "unknown NIC_BACKEND='thor2'" in r.stderr
    assert "+ sh -c rm -rf" not in r.stdout


def test_require_lib_fails_the_build_when_the_provider_is_missing():
    # The step's own helper functions, run for real (they only read ldconfig's cache and /usr, /opt).
    body = heredoc("NIC_USERSPACE")
    helpers = body.split("\ncodename=", 1)[0]
    script = helpers + "\nrequire_lib libsglang_mori_no_such_provider\necho unreachable\n"
    r = subprocess.run(["bash", "-c", script], env={**os.environ, "NIC_BACKEND": "ainic"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "unreachable" not in r.stdout
    assert "libsglang_mori_no_such_provider not found after installing the NIC_BACKEND=ainic" in r.stderr
    present = subprocess.run(["bash", "-c", helpers + "\nrequire_lib libc\necho found\n"],
                             capture_output=True, text=True, timeout=120)
    assert present.returncode == 0 and "found" in present.stdout, present.stderr


def test_mori_step():
    on = run_step("MORI", ENABLE_MORI="1")
    assert on.returncode == 0, on.stderr
    assert "+ python3 -m pip install --no-cache-dir amd-mori==1.2.4" in on.stdout
    off = run_step("MORI", ENABLE_MORI="0")
    assert off.returncode == 0 and "pip install" not in off.stdout
    assert "SGLANG_MORI_ENGINE=soft" in off.stdout


def test_plugin_install_step():
    ins = instructions()
    copies = [text for kw, text in ins if kw == "COPY"]
    assert "COPY python /opt/sglang-mori/python" in copies
    assert "COPY setup.py /opt/sglang-mori/setup.py" in copies
    r = run_step("PLUGIN")
    assert r.returncode == 0, r.stderr
    assert "+ python3 -m pip install --no-cache-dir /opt/sglang-mori" in r.stdout
    assert "sglang-mori doctor --help" in r.stdout
    # The plugin is installed after the COPY of its sources and after MORI.
    order = [text.splitlines()[0] for kw, text in ins if kw in ("COPY", "RUN")]
    assert order.index("RUN <<'PLUGIN'") > order.index("COPY python /opt/sglang-mori/python")
    assert order.index("RUN <<'PLUGIN'") > order.index("RUN <<'MORI'")


def test_sglang_version_guard_really_checks():
    # Run the guard's python for real against this venv's SGLang (0.5.23) and a wrong wish.
    body = heredoc("PLUGIN")
    guard = next(line for line in body.splitlines() if "sglang.__version__" in line)
    code = guard.split("python3 -c ", 1)[1].strip()[1:-1]
    import sys

    ok = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SGLANG_VERSION": "0.5.23"},
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SGLANG_VERSION": "0.4.0"},
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "sglang-mori needs 0.4.0" in bad.stderr


def test_dockerignore_keeps_the_context_small():
    ignore = (REPO / "docker" / "rocm.Dockerfile.dockerignore").read_text().split()
    assert ignore[ignore.index("*")] == "*" and "!python/" in ignore and "!setup.py" in ignore
