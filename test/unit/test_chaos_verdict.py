"""The chaos run's counting (harness/chaos/verdict.py), leftover bounds and table: pure logic."""

import json

from harness.chaos import leftovers as lo
from harness.chaos.runner import FaultResult
from harness.chaos.table import passed, render, render_causes, verdict
from harness.chaos.verdict import (Counts, batch_dependent, cause, classify, merge_references, read_records,
                                   references)

HANG = 50.0


def write_records(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def start(i, t, prompt=(1, 2, 3), out=8):
    return {"event": "start", "i": i, "t": t, "prompt": list(prompt), "output_len": out}


def end(i, t, success=True, error="", text="abc"):
    return {"event": "end", "i": i, "t": t, "success": success, "error": error, "text": text, "got_len": 8}


def test_read_records_pairs_start_and_end_and_ignores_a_torn_line(tmp_path):
    path = tmp_path / "r.jsonl"
    write_records(path, [start(0, 1.0), start(1, 2.0, prompt=(4,)), end(0, 3.0)])
    with open(path, "a") as f:
        f.write('{"event": "end", "i": 1, "t"')  # the client was killed mid-write
    reqs = read_records(path)
    assert [(r.i, r.end) for r in reqs] == [(0, 3.0), (1, None)]
    assert reqs[1].prompt == (4,) and reqs[0].key == ((1, 2, 3), 8)


def test_classify_every_request_once(tmp_path):
    path = tmp_path / "r.jsonl"
    write_records(path, [
        start(0, 0.0), end(0, 5.0, text="abc"),  # completed
        start(1, 0.0, prompt=(9,)), end(1, 5.0, text="abX"),  # mismatch
        start(2, 0.0), end(2, 12.0, success=False, error='Internal Server Error: {"error": {"message": '
                          '"KV transfer of room 1234567 failed: peer dead"}}'),  # failed, named
        start(3, 0.0), end(3, HANG + 1, success=False, error="TimeoutError"),  # past the bound: hung
        start(4, 0.0),  # never answered: hung
        start(5, 0.0, prompt=(7,)), end(5, 1.0),  # no reference for this prompt
        start(6, 0.0), end(6, 2.0, success=False, error="Bad Gateway: "),  # failed, names nothing
    ])
    refs = {((1, 2, 3), 8): "abc", ((9,), 8): "abc"}
    c = classify(read_records(path), refs, HANG, until=100.0)
    assert (c.requests, c.completed, c.mismatch, c.failed, c.hung, c.no_reference) == (7, 1, 1, 2, 2, 1)
    assert c.causes == {"KV transfer of room N failed: peer dead": 1, "Bad Gateway:": 1}
    assert c.unnamed == 1
    assert c.slowest_failure_s == 12.0


def test_references_keep_only_answered_successes(tmp_path):
    path = tmp_path / "r.jsonl"
    write_records(path, [start(0, 0.0), end(0, 1.0, text="x"), start(1, 0.0, prompt=(5,)),
                         end(1, 1.0, success=False, error="boom")])
    assert references(read_records(path)) == {((1, 2, 3), 8): "x"}


def test_merge_references_keeps_every_answer_the_standalone_server_gave():
    tie, plain = ((17126, 17127), 20), ((5,), 8)
    passes = [{tie: "sampfantastrai", plain: "x"}, {tie: "sampfantasamp", plain: "x"}, {tie: "sampfantastrai"}]
    refs = merge_references(passes)
    assert refs == {tie: ("sampfantastrai", "sampfantasamp"), plain: ("x",)}
    assert batch_dependent(refs) == {tie: ("sampfantastrai", "sampfantasamp")}


def test_a_batch_dependent_prompt_accepts_only_the_standalone_servers_answers(tmp_path):
    """PD's answer to a near-tie prompt completes when the standalone server gave it too (and is
    counted apart); any other answer stays a mismatch, as does another answer to a plain prompt."""
    tie, plain = (17126, 17127), (5,)
    path = tmp_path / "r.jsonl"
    write_records(path, [
        start(0, 0.0, prompt=tie), end(0, 1.0, text="sampfantasamp"),  # the standalone's 2nd answer
        start(1, 0.0, prompt=tie), end(1, 1.0, text="sampfantastrai"),  # its 1st
        start(2, 0.0, prompt=tie), end(2, 1.0, text="sampfantaXXXX"),  # neither: a real failure
        start(3, 0.0, prompt=plain), end(3, 1.0, text="sampfantasamp"),  # not this prompt's
        start(4, 0.0, prompt=plain), end(4, 1.0, text="x"),
    ])
    refs = merge_references([{(tie, 8): "sampfantastrai", (plain, 8): "x"},
                             {(tie, 8): "sampfantasamp", (plain, 8): "x"}])
    c = classify(read_records(path), refs, HANG, until=10.0)
    assert (c.completed, c.mismatch, c.batch_dependent, c.batch_dependent_answers) == (3, 2, 2, 2)
    assert [m.split(" (")[0] for m in c.mismatches] == ["request 2", "request 3"]
    assert "reference 'sampfantastrai' or 'sampfantasamp'" in c.mismatches[0]
    # A one-pass reference (a plain text per prompt) still classifies as before.
    one = classify(read_records(path), {(tie, 8): "sampfantastrai", (plain, 8): "x"}, HANG, until=10.0)
    assert (one.completed, one.mismatch, one.batch_dependent) == (2, 3, 0)


def test_cause_takes_the_message_or_the_last_traceback_line():
    assert cause('Bad Gateway: {"error": {"message": "prefill 10.77.0.1:31234 unreachable"}}') == \
        "prefill X.X:31234 unreachable"
    tb = "Traceback (most recent call last):\n  File x\naiohttp.ClientConnectorError: Cannot connect"
    assert cause(tb) == "aiohttp.ClientConnectorError: Cannot connect"
    assert cause("") == "(no message)"
    assert len(cause("y" * 500)) == 103


def snap(pid=10, requests=0, fds=100, rss=1000.0, conns=4, **gauges):
    return lo.Snapshot(pid, requests, dict(gauges), fds, rss, conns)


def test_leftover_bounds():
    bounds = lo.Bounds(fd_growth=10, rss_growth_mib=100.0, extra_link_conns=2)
    base = snap()
    assert lo.leftover_problems(snap(fds=110, rss=1100.0, conns=6), base, bounds) == []
    problems = lo.leftover_problems(snap(requests=2, fds=111, rss=1101.0, conns=7,
                                         sglang_mori_open_rooms=3.0), base, bounds)
    assert problems == ["2 requests held", "sglang_mori_open_rooms=3", "fds +11", "RSS +101 MiB",
                        "link connections +3"]
    # A restarted server (new pid) is not held to the old process's descriptors or memory.
    assert lo.leftover_problems(snap(pid=11, fds=500, rss=5000.0), base, bounds) == []
    assert lo.leftover_problems(snap(requests=-1), base, bounds) == ["server not answering"]


def result(**kw):
    c = Counts(requests=10, completed=8, failed=2)
    c.causes.update({"peer dead": 2})
    r = FaultResult("mori", "link_1s", c, recovered_s=2.0, leftovers={"prefill": [], "decode": []})
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_goals_and_table():
    ok = result()
    assert verdict(ok) == "pass"
    slow = result(recovered_s=11.0)
    assert verdict(slow) == "FAIL: serving again after 11.0 s > 10 s"
    restart = result(fault="prefill_restart", recovered_s=25.0)  # a restart's goal is 30 s
    assert verdict(restart) == "pass"
    bad = result(recovered_s=None, other_restarts=["decode"], leftovers={"decode": ["fds +99"]})
    bad.counts.hung = 1
    assert verdict(bad) == ("FAIL: 1 hung; not serving again in time; unplanned restart of decode; "
                            "decode leftovers: fds +99")
    table = render([ok, bad])
    assert "| P-D link down 1 s | ours | 8/10 | 0 | 2 | 0.0 s | 0 | 2.0 s | none | pass |" in table
    assert "| no | decode: fds +99 |" in table
    assert render_causes([ok]) == "- P-D link down 1 s, ours: 2 x `peer dead`"


def test_batch_dependent_answers_pass_but_are_said_in_the_table_and_verdict():
    tie = result()
    tie.counts.batch_dependent, tie.counts.batch_dependent_answers = 1, 2
    assert verdict(tie) == "pass; 1 batch-dependent (standalone gives 2 answers)" and passed(tie)
    assert "| ours | 8/10, 1 batch-dependent (standalone gives 2 answers) | 0 |" in render([tie])
    tie.counts.mismatch = 1
    assert verdict(tie) == "FAIL: 1 token mismatches" and not passed(tie)
