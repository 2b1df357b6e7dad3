"""Every reason the code can fail a request with is a metrics label of its own (issue 26: queue-full
failures were counted as "other" because BACKPRESSURE was missing from metrics.FAILURE_REASONS).

The labels are the constants of backend/failure_reasons.py. The code passes a label at a few call
sites (a failure door's `fail`, `fail_life`, `conclude_locked`; the metrics' `failure`, `retry`,
`request_finished(reason=)`, `transfer_finished(reason=)`); at each of them, the label must be one of
those constants by name, a string literal among them, or a parameter handing a caller's label on.
"""

import ast
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from sglang_mori.backend import failure_reasons
from sglang_mori.metrics import FAILURE_REASONS, TransferMetrics, normalize_reason

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "sglang_mori"
CONSTANTS = {name: value for name, value in vars(failure_reasons).items()
             if name.isupper() and isinstance(value, str)}
# Call -> where its label is: a positional index, or a keyword.
LABEL_AT = {"fail": 2, "fail_life": 2, "conclude_locked": 2, "failure": 0, "retry": 0,
            "request_finished": "reason", "transfer_finished": "reason"}
# Names that hand on a label a caller chose (checked at that caller); `fx`/`times` are the effects
# and count arguments of functions that share a name with a door (conclude_locked(r, fx, ...),
# a fault's fail(n, ...)).
PASS_THROUGH = {"label", "reason", "f.label", "None", "fx", "times"}


def test_every_failure_reason_is_a_metric_label():
    assert set(CONSTANTS.values()) == set(FAILURE_REASONS)
    for reason in FAILURE_REASONS:
        assert normalize_reason(reason) == reason


@pytest.mark.parametrize("reason", sorted(CONSTANTS.values()))
def test_each_reason_is_counted_under_its_own_label(reason):
    reg = CollectorRegistry()
    TransferMetrics("prefill", tp_rank=0, registry=reg).failure(reason)
    labels = {"engine_type": "prefill", "tp_rank": "0", "pp_rank": "0", "dp_rank": "0", "reason": reason}
    assert reg.get_sample_value("sglang_mori_failures_total", labels) == 1


def _labels_passed():
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            where = LABEL_AT.get(node.func.attr)
            if isinstance(where, int) and len(node.args) > where:
                yield path, node, node.args[where]
            elif isinstance(where, str):
                for keyword in node.keywords:
                    if keyword.arg == where:
                        yield path, node, keyword.value


def _leaves(expr):
    if isinstance(expr, ast.IfExp):
        yield from _leaves(expr.body)
        yield from _leaves(expr.orelse)
    else:
        yield expr


def test_every_label_the_code_passes_is_a_failure_reason():
    bad, named = [], set()
    for path, call, label in _labels_passed():
        for leaf in _leaves(label):
            text = ast.unparse(leaf)
            if isinstance(leaf, ast.Constant) and leaf.value in FAILURE_REASONS:
                continue
            if isinstance(leaf, ast.Name) and leaf.id in CONSTANTS:
                named.add(leaf.id)
            elif text not in PASS_THROUGH:
                bad.append(f"{path.name}:{call.lineno} passes {text} as a failure label")
    assert not bad, "\n".join(bad)
    # Guards the scan: it sees the doors that fail rooms with these reasons.
    assert {"BACKPRESSURE", "TIMEOUT", "PEER_DEAD", "SUBMIT_ERROR", "ABORTED", "PROTOCOL"} <= named
