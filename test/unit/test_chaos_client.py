"""harness/chaos/bench_client.py and load.py: SGLang's own client, as its parser reads our command
line, with the per-request records and the bounded session around its unchanged request function
(the `datasets` stub stands in where the bench requirements are not installed)."""

import asyncio
import json
import sys
from types import SimpleNamespace

from harness.chaos import bench_client
from harness.chaos.load import LoadSpec


def test_client_args_as_sglang_reads_them_and_records_each_request(tmp_path, monkeypatch):
    records = tmp_path / "r.jsonl"
    serving = bench_client._install(records, timeout_s=7.5)  # also: imports the client (datasets stub)
    # The session is bounded (the client's own default is 6 hours).
    async def timeout_of_a_session():
        async with serving._create_bench_client_session() as session:
            return session.timeout.total
    assert asyncio.run(timeout_of_a_session()) == 7.5

    spec = LoadSpec(num_prompts=32, input_len=512, output_len=32, range_ratio=0.125, max_concurrency=8,
                    request_rate=4.0, seed=3)
    seen = {}
    monkeypatch.setattr(serving, "run_benchmark", lambda a: seen.setdefault("args", a))
    monkeypatch.setattr(sys, "argv", ["bench_serving", *spec.client_args("http://10.77.0.3:31000", tmp_path / "m",
                                                                         tmp_path / "out.jsonl", pd=True)])
    serving.cli_main()
    a = seen["args"]
    assert a.backend == "sglang" and a.pd_separated and a.dataset_name == "random-ids" and a.tokenize_prompt
    assert (a.num_prompts, a.random_input_len, a.random_output_len, a.random_range_ratio) == (32, 512, 32, 0.125)
    assert (a.max_concurrency, a.request_rate, a.seed) == (8, 4.0, 3)
    assert a.disable_stream and not a.disable_ignore_eos and a.temperature == 0.0



def test_each_request_is_recorded_before_and_after(tmp_path):
    records = tmp_path / "r.jsonl"

    async def original(inp, pbar=None):
        assert not records.read_text() == ""  # the start line is on disk before the request goes out
        return SimpleNamespace(success=False, error="boom", generated_text="ab", output_len=2)

    wrapped = bench_client.record_requests(original, records)
    for n in range(2):
        out = asyncio.run(wrapped(SimpleNamespace(prompt=[5, 6, n], output_len=4)))
        assert out.error == "boom"
    lines = [json.loads(ln) for ln in records.read_text().splitlines()]
    assert [(ln["event"], ln["i"]) for ln in lines] == [("start", 0), ("end", 0), ("start", 1), ("end", 1)]
    assert lines[2]["prompt"] == [5, 6, 1] and lines[2]["output_len"] == 4
    assert lines[3]["success"] is False and lines[3]["error"] == "boom" and lines[3]["text"] == "ab"
    assert lines[0]["t"] <= lines[1]["t"] <= lines[2]["t"]
