"""The docs cannot drift from the code unnoticed (issue 26).

- Every command in the docs and READMEs that runs one of our Python scripts, `sglang-mori` or
  `python -m sglang_mori.config` parses with that program's own argument parser (nothing runs:
  the parser is stopped right after it accepted the arguments). launch_pd.sh's options are checked by
  test_docs_links.py.
- Every `sglang_mori_*` metric named with labels has those labels, every label value named is one
  the code can emit, and the lists of reasons in deployment.md are exactly the code's lists.
- A figure of ours (a percentage or a ratio) outside docs/benchmarks.md and docs/reliability.md
  names its source: those pages or their raw data, or the external document it quotes.

Every `SGLANG_MORI_*` the code reads being documented is test_docs_config.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import shlex
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from sglang_mori import metrics

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md", REPO / "test" / "manual" / "README.md"]

# --- commands ------------------------------------------------------------------------------

PROGRAM = re.compile(r"(?:^|(?<=[\s(]))((?:\S*/)?scripts/\w+\.py|(?<![\w/.:-])sglang-mori|-m sglang_mori\.config)"
                     r"(?=\s|$)(.*)")
# Lines that begin with the program's name but are its output: log lines and error messages.
NOT_COMMANDS = re.compile(r"^sglang-mori (?:prefill|decode) tp\d|^sglang-mori supports ")
SHELL_STOPS = {"&&", "||", "|", ";", "&"}


def _code(text: str):
    """(code, is_block) for fenced blocks, indented blocks and inline code spans."""
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, re.S):
        yield block, True
    rest = re.sub(r"```[^\n]*\n.*?```", "", text, flags=re.S)
    for match in re.finditer(r"(?:^(?: {4}|\t).*\S.*\n?)+", rest, re.M):
        yield "\n".join(line[4:] for line in match.group(0).splitlines()), True
    for span in re.findall(r"`([^`\n]+)`", rest):
        yield span, False


def _synopsis_to_example(tail: str) -> str:
    """A usage synopsis as one concrete command: `[a | b]` -> `a`, `x|y` -> `x`."""
    tail = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"\s*\|\s*", m.group(1))[0], tail)
    return " ".join(t.split("|")[0] if re.fullmatch(r"\w+(\|\w+)+", t) else t for t in tail.split())


def doc_commands(text: str):
    """(program, argv) of every command of ours in a doc."""
    for code, is_block in _code(text):
        code = re.sub(r"\\\n\s*", " ", code)
        for line in code.splitlines():
            for match in PROGRAM.finditer(line):
                program, tail = match.group(1), match.group(2)
                if NOT_COMMANDS.match(line[match.start():]):
                    continue
                argv = []
                for token in shlex.split(_synopsis_to_example(tail), comments=True):
                    if token in SHELL_STOPS or token.startswith((">", "2>")):
                        break
                    argv.append(token)
                if argv or is_block:  # a bare name in running text is a mention, not a command
                    yield program.rsplit("/", 1)[-1] if "scripts/" in program else program, argv


class _Accepted(Exception):
    pass


PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")  # N, PORT, ADDR: a value the reader fills in


def _options(parser: argparse.ArgumentParser) -> dict:
    """Every option string of a parser and its subcommands' parsers -> its action."""
    out = dict(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out.update(_options(sub))
    return out


def _concrete(parser: argparse.ArgumentParser, argv: list) -> list:
    """`argv` with each placeholder value replaced by one its option's type or choices accept."""
    options, out = _options(parser), []
    for i, token in enumerate(argv):
        action = options.get(argv[i - 1]) if i else None
        if action is not None and action.nargs != 0 and PLACEHOLDER.fullmatch(token):
            if action.choices:
                token = str(next(iter(action.choices)))
            elif action.type in (int, float):
                token = "1"
        out.append(token)
    return out


def _parse_with_script(script: Path, argv: list) -> None:
    """Run the script's own argument parsing on `argv` and stop there: its parser's top-level
    parse_args is replaced by one that parses `argv` and raises _Accepted."""
    name = f"_doc_command_{script.stem}"
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the script is imported
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    real = argparse.ArgumentParser.parse_args

    def parse_only(parser, args=None, namespace=None):
        real(parser, _concrete(parser, argv), namespace)
        raise _Accepted

    entry = getattr(module, "build_parser", None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", parse_only)
        mp.setattr(sys, "argv", [str(script), *argv])
        with pytest.raises(_Accepted):
            if entry is not None:
                entry().parse_args(argv)
            elif hasattr(module, "parse_args"):
                module.parse_args()
            else:
                module.main()  # parses first (test_every_script_parses_before_it_acts)


def _parse(program: str, argv: list) -> None:
    if program == "sglang-mori":
        from sglang_mori.cli.main import build_parser

        parser = build_parser()
        parser.parse_args(_concrete(parser, argv))
    elif program == "-m sglang_mori.config":
        from sglang_mori import config

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            assert config.main(argv) == 0
    else:
        _parse_with_script(REPO / "scripts" / program, argv)


def _all_commands():
    seen = {}
    for doc in DOCS:
        for program, argv in doc_commands(doc.read_text()):
            seen.setdefault((program, tuple(argv)), doc.relative_to(REPO))
    return seen


COMMANDS = _all_commands()


def test_the_scan_finds_the_documented_commands():
    programs = {program for program, _ in COMMANDS}
    assert {"sglang-mori", "-m sglang_mori.config", "chaos_pd.py", "bench_backend.py", "gpu_bench.py",
            "bench_pd_latency.py", "bench_serving_pd.py", "demo.py"} <= programs
    assert len(COMMANDS) >= 30


@pytest.mark.parametrize("program, argv", sorted(COMMANDS), ids=lambda v: " ".join(v) if isinstance(v, tuple) else v)
def test_documented_command_parses(program, argv):
    where = COMMANDS[(program, argv)]
    try:
        _parse(program, list(argv))
    except SystemExit as exc:
        pytest.fail(f"{where}: `{program} {' '.join(argv)}` does not parse (exit {exc.code})")


def test_a_wrong_flag_is_caught():
    # Guards the check above: a flag the parser does not know fails it.
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        _parse("chaos_pd.py", ["--no-such-flag"])
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        _parse("sglang-mori", ["doctor", "--no-such-flag"])
    assert list(doc_commands("```bash\nscripts/bench_backend.py soak [--requests N | --quick] \\\n  --json\n```")) \
        == [("bench_backend.py", ["soak", "--requests", "N", "--json"])]


def test_every_script_parses_before_it_acts():
    # Scripts without a parse function are driven through main(): argument parsing must be the first
    # thing main() does, or the check above would start servers.
    for script in sorted((REPO / "scripts").glob("*.py")):
        source = script.read_text()
        if "build_parser" in source or re.search(r"^def parse_args", source, re.M) or "argparse" not in source:
            continue
        main = source[source.index("def main("):]
        body = main.split("\n", 1)[1]
        first = next(line for line in body.splitlines() if line.strip() and not line.strip().startswith("#"))
        assert "ArgumentParser(" in first, f"{script.name}: main() must build its parser first"


# --- metrics and labels --------------------------------------------------------------------

def _metric_labels() -> dict:
    """{metric name without sglang_mori_ prefix or _total: its label names, ranks excluded}."""
    registry = CollectorRegistry()
    metrics.TransferMetrics("prefill", registry=registry)
    collectors = getattr(registry, metrics._REGISTRY_ATTR)
    out = {}
    for metric in vars(collectors).values():
        name = getattr(metric, "_name", None)
        if name and name.startswith(metrics.PREFIX):
            out[name[len(metrics.PREFIX):]] = set(metric._labelnames) - set(metrics.RANK_LABELS)
    return out


LABEL_VALUES = {"reason": set(metrics.FAILURE_REASONS) | set(metrics.LAYERWISE_FALLBACK_REASONS),
                "outcome": {"ok", "failed"}}
REASONS_OF = {"failures": metrics.FAILURE_REASONS, "retries": metrics.FAILURE_REASONS,
              "layerwise_fallbacks": metrics.LAYERWISE_FALLBACK_REASONS}


def _base(name: str) -> str:
    return re.sub(r"_(total|bucket|count|sum)$", "", name)


def test_metric_labels_named_in_the_docs_exist():
    labels = _metric_labels()
    assert {"failures", "layerwise_fallbacks", "transfers"} <= set(labels)
    bad = []
    for doc in DOCS:
        for name, inside in re.findall(r"sglang_mori_(\w+)\{([^}]*)\}", doc.read_text()):
            base = _base(name)
            if base not in labels:
                bad.append(f"{doc.name}: sglang_mori_{name} is not a metric")
                continue
            for label, value in re.findall(r"(\w+)\s*(?:=~?\s*\"?([\w|.*]*)\"?)?", inside):
                if label not in labels[base]:
                    bad.append(f"{doc.name}: sglang_mori_{name} has no label {label!r}")
                elif value and label == "reason" and value not in REASONS_OF.get(base, LABEL_VALUES["reason"]):
                    bad.append(f"{doc.name}: sglang_mori_{name}{{{label}={value}}} is never emitted")
                elif value and label in LABEL_VALUES and label != "reason" and value not in LABEL_VALUES[label]:
                    bad.append(f"{doc.name}: sglang_mori_{name}{{{label}={value}}} is never emitted")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("metric", ["failures", "layerwise_fallbacks"])
def test_the_reasons_listed_in_deployment_md_are_the_codes(metric):
    row = next(line for line in (REPO / "docs" / "deployment.md").read_text().splitlines()
               if line.startswith(f"| `sglang_mori_{metric}_total{{reason}}`"))
    listed = set(re.findall(r"`(\w+)`", row.split("|")[3]))
    assert listed == set(REASONS_OF[metric]), (
        f"docs/deployment.md lists {sorted(listed)} for sglang_mori_{metric}_total; the code emits "
        f"{sorted(REASONS_OF[metric])}")


# --- figures and their sources -------------------------------------------------------------

# A percentage ("12%", "95 %") or a ratio ("1.5x"; "3 x (a + b)" is arithmetic, not a figure).
FIGURE = re.compile(r"(?<![\w.])[-+~]?\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?(?: ?%|x\b)")
SOURCE = re.compile(r"docs/benchmarks\.md|docs/reliability\.md|docs/data/|https?://"
                    r"|MORI(?:-IO)?'s (?:own |published |tuning )|MORI documents|ROCm/mori|AMD link specifications")
FIGURE_HOMES = {"benchmarks.md", "reliability.md"}


def _blocks(text: str):
    """Paragraphs, list items and table rows (code blocks left out)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return [b for b in re.split(r"\n\s*\n|\n(?=\s*[-*] |\s*\d+\. |\|)", text) if b.strip()]


def unsourced_figures(text: str) -> list:
    return [block for block in _blocks(text) if FIGURE.search(block) and not SOURCE.search(block)]


def test_figures_outside_the_benchmark_pages_name_their_source():
    bad = []
    for doc in DOCS:
        if doc.parent.name == "docs" and doc.name in FIGURE_HOMES:
            continue
        for block in unsourced_figures(doc.read_text()):
            bad.append(f"{doc.relative_to(REPO)}: {FIGURE.findall(block)} in: {' '.join(block.split())[:160]}")
    assert not bad, ("figures without a source (link docs/benchmarks.md or docs/reliability.md, where "
                     "figures live with their command):\n" + "\n".join(bad))


def test_the_figure_check_sees_an_unsourced_figure():
    assert unsourced_figures("A short forward slowed by 150-1000% with a write per layer.")
    assert unsourced_figures("XGMI is 1.3-1.5x one NIC.")
    assert not unsourced_figures("Slowed by 150-1000% (docs/benchmarks.md, \"GPU rig\").")
    assert not unsourced_figures("Out after 3 x (interval + timeout).")
