"""docs/configuration.md lists every SGLANG_MORI_* variable the code reads, and its knob table is the
one config.py generates.

How variables are found: every `SGLANG_MORI_<NAME>` string literal or mention in the package source
(python/sglang_mori/**/*.py), in scripts/** and in test/** (the test and bench variables) counts as
read. That is deliberately wider than
"passed to os.environ.get": a name built into a constant (FAULTS_ENV = "SGLANG_MORI_...") or named in
a docstring is something an operator may meet, so it must be documented too. A name ending in "_"
is a prefix (e.g. a startswith() test) and is satisfied by any documented name it begins.
"""

import re
from pathlib import Path

from sglang_mori.config import KNOBS, markdown_table

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "configuration.md"
NAME = re.compile(r"SGLANG_MORI_[A-Z0-9_]+")
SOURCES = [REPO / "python" / "sglang_mori", REPO / "scripts", REPO / "test"]
# Names that appear in the sources but are no setting: a misspelling the doctor's test feeds it.
NOT_SETTINGS = {"SGLANG_MORI_QP_PER_TRANSFR"}


def _files(roots, suffixes):
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.is_file() and path.suffix in suffixes and "__pycache__" not in path.parts:
                yield path


def names_in(roots, suffixes=(".py", ".sh", "")) -> dict:
    found = {}
    for path in _files(roots, suffixes):
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for name in NAME.findall(text):
            found.setdefault(name, path.relative_to(REPO))
    return found


def documented() -> set:
    return set(NAME.findall(DOC.read_text()))


def test_every_variable_the_code_reads_is_documented():
    docs = documented()
    missing = []
    for name, where in sorted(names_in(SOURCES).items()):
        if name in NOT_SETTINGS:
            continue
        if name.endswith("_"):
            ok = any(d.startswith(name) for d in docs)
        else:
            ok = name in docs
        if not ok:
            missing.append(f"{name} (first seen in {where})")
    assert not missing, "docs/configuration.md does not list: " + ", ".join(missing)


def test_scanner_finds_the_knobs():
    # Guards the test itself: if the scan found nothing, the check above would pass vacuously.
    found = names_in(SOURCES)
    assert {k.name for k in KNOBS} <= set(found)


def test_knob_table_matches_config():
    text = DOC.read_text()
    begin, end = "<!-- knobs:begin -->\n", "<!-- knobs:end -->"
    assert begin in text and end in text
    table = text.split(begin, 1)[1].split(end, 1)[0]
    assert table == markdown_table(), (
        "the knob table in docs/configuration.md is stale: replace the lines between the knobs "
        "markers with the output of `python -m sglang_mori.config --markdown`")


def test_documented_names_exist_somewhere():
    # The other direction: a documented SGLANG_MORI_* name that nothing reads is stale documentation
    known = set(names_in(SOURCES))
    stale = sorted(d for d in documented() if d not in known)
    assert not stale, f"documented but read nowhere: {stale}"
