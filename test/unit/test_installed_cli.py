"""`pip install .` into a clean virtual environment outside the checkout, then every verb that
`sglang-mori --help` lists runs there: the wheel's CLI never needs the source tree (test/ is not
on any path, the working directory is elsewhere, PYTHONPATH is unset).

The virtual environment reuses this interpreter's installed dependencies (a .pth line naming its
site-packages, which is not processed as a site dir, so this checkout's editable install does not
leak in); sglang_mori itself comes only from the fresh install.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Each leaf verb `sglang-mori --help` lists, with a minimal, bounded argument set and a check of
# what it printed. A verb added to the CLI without an entry here fails the test.
VERBS = {
    ("bench", "engine"): (["--sizes", "4096", "--paths", "tcp", "--iters", "2", "--seconds", "0.2"],
                          lambda out: "4KiB" in out),
    ("doctor",): (["--json", "--timeout", "0.5"],
                  lambda out: any(c["name"] == "sglang" for c in json.loads(out))),
}


def _install(tmp: Path) -> Path:
    src = tmp / "src"
    shutil.copytree(REPO / "python", src / "python", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("setup.py", "README.md"):
        shutil.copy2(REPO / name, src / name)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "_reuse_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    r = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                        "--disable-pip-version-check", "-q", str(src)],
                       capture_output=True, text=True, timeout=300, cwd=tmp, env=_env())
    assert r.returncode == 0, r.stdout + r.stderr
    return venv


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["SGLANG_MORI_ENGINE"] = "soft"
    return env


def _verbs(cli: Path, cwd: Path, prefix: tuple = ()) -> list:
    """Leaf verbs under `prefix`, read from the --help of each level."""
    r = subprocess.run([str(cli), *prefix, "--help"], capture_output=True, text=True, timeout=120, cwd=cwd, env=_env())
    assert r.returncode == 0, r.stdout + r.stderr
    choices = re.search(r"\{([\w,-]+)\}", r.stdout)
    if choices is None:
        return [prefix]
    return [leaf for verb in choices.group(1).split(",") for leaf in _verbs(cli, cwd, prefix + (verb,))]


def test_every_listed_verb_runs_from_a_clean_install(tmp_path):
    venv = _install(tmp_path)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import sglang_mori; print(sglang_mori.__file__)"],
                           capture_output=True, text=True, check=True, cwd=cwd, env=_env()).stdout.strip()
    assert where.startswith(str(venv)), where

    cli = venv / "bin" / "sglang-mori"
    listed = _verbs(cli, cwd)
    assert sorted(listed) == sorted(VERBS), f"sglang-mori --help lists {listed}; give each a case in VERBS"
    for verb in listed:
        args, check = VERBS[verb]
        r = subprocess.run([str(cli), *verb, *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=_env())
        # doctor exits 1 when a check of this host fails (no MORI here); anything else is a crash.
        assert r.returncode in ((0, 1) if verb == ("doctor",) else (0,)), (verb, r.stdout[-2000:], r.stderr[-2000:])
        assert "Traceback" not in r.stderr, (verb, r.stderr[-2000:])
        assert check(r.stdout), (verb, r.stdout[-2000:])
