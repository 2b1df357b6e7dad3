"""The operator docs point at things that exist: repository paths, launch_pd.sh options, knobs and
metric names. A renamed file, flag or metric breaks this test instead of silently breaking the docs."""

import re
from pathlib import Path

import pytest

from sglang_mori.config import KNOBS

REPO = Path(__file__).resolve().parents[2]
DOCS = ["deployment.md", "tuning.md", "troubleshooting.md", "design.md", "configuration.md", "reliability.md"]
PATH = re.compile(r"(?<![\w/.-])((?:python/sglang_mori|scripts|docker|test|docs)/[\w./-]*[\w/])")


def text(name):
    return (REPO / "docs" / name).read_text()


@pytest.mark.parametrize("doc", DOCS)
def test_repository_paths_exist(doc):
    missing = sorted({p for p in PATH.findall(text(doc)) if not (REPO / p).exists()})
    assert not missing, f"docs/{doc} names paths that do not exist: {missing}"


def _launch_pd_commands(doc_text):
    """Every launch_pd.sh command in a doc: inline `...launch_pd.sh ...` spans, and lines of bash
    blocks from a launch_pd.sh line through its backslash continuations."""
    commands = [span for span in re.findall(r"`([^`]*launch_pd\.sh[^`]*)`", doc_text)]
    for block in re.findall(r"```bash\n(.*?)```", doc_text, re.S):
        current = None
        for line in block.splitlines():
            if current is None and "launch_pd.sh" in line:
                current = line
            elif current is not None:
                current += " " + line
            if current is not None and not line.rstrip().endswith("\\"):
                commands.append(current)
                current = None
    return commands


def test_launch_pd_options_in_docs_exist():
    script = (REPO / "scripts" / "launch_pd.sh").read_text()
    options = set(re.findall(r"^\s+(--[a-z-]+)\)", script, re.M))
    used = set()
    readmes = [(REPO / "README.md").read_text(), (REPO / "test" / "manual" / "README.md").read_text()]
    for doc_text in [text(doc) for doc in DOCS] + readmes:
        for cmd in _launch_pd_commands(doc_text):
            used |= set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", cmd))
    assert {"--prefill-gpus", "--role", "--cpu-demo"} <= used  # the scan sees the documented uses
    unknown = sorted(used - options)
    assert not unknown, f"docs use launch_pd.sh options it does not have: {unknown}"


def test_knobs_named_in_docs_exist():
    knobs = {k.name for k in KNOBS}
    for doc in ("deployment.md", "tuning.md", "troubleshooting.md", "design.md"):
        named = set(re.findall(r"SGLANG_MORI_[A-Z0-9_]*[A-Z0-9]", text(doc)))
        unknown = sorted(n for n in named if n not in knobs)
        assert not unknown, f"docs/{doc} names unknown knobs: {unknown}"


def test_every_knob_has_tuning_or_deployment_advice():
    covered = text("tuning.md") + text("deployment.md")
    missing = [k.name for k in KNOBS if k.name not in covered and k.name not in ("SGLANG_MORI_HOST",)]
    assert not missing, f"no guidance for {missing}"


def test_metric_names_in_docs_exist():
    source = (REPO / "python" / "sglang_mori" / "metrics.py").read_text()
    defined = {"sglang_mori_" + n for n in re.findall(r'PREFIX \+ "(\w+)"', source)}
    assert len(defined) >= 10
    for doc in DOCS:
        for name in set(re.findall(r"sglang_mori_\w+", text(doc))):
            base = re.sub(r"_(total|bucket|count|sum)$", "", name)
            assert base in defined, f"docs/{doc} names metric {name}, not defined in metrics.py"
    # And every defined metric is documented for operators.
    deployment = text("deployment.md")
    undocumented = sorted(d for d in defined if d not in deployment)
    assert not undocumented, f"metrics missing from docs/deployment.md: {undocumented}"
