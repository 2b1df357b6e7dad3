"""SGLang's own serving client (`sglang.benchmark.serving`, alias `sglang.bench_serving`) with a
per-request record, for the chaos run:

    python -m harness.chaos.bench_client RECORDS.jsonl REQUEST_TIMEOUT_S -- <bench_serving args>

Two things are added around the unchanged client, and nothing else:

- every request writes a `start` line and, when it returns, an `end` line to RECORDS (flushed at
  once, so a client killed at its time cap still shows which requests never came back): the
  prompt's token ids, the asked and returned output lengths, success, the error text, and
  monotonic times (CLOCK_MONOTONIC is one clock for every process on the machine, so they line
  up with the controller's fault times);
- the client's HTTP session times out after REQUEST_TIMEOUT_S instead of its built-in 6 hours,
  so a request the servers never answer ends (and is counted as hung) within a bounded run.

`datasets` is imported by the client at load time; without it the stub in client_stubs/ is used.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
from pathlib import Path

_STUBS = Path(__file__).resolve().parent / "client_stubs"


def record_requests(original, records_path: Path):
    """`original` (one of the client's request functions) wrapped to write a start and an end line
    per request to `records_path`."""
    out = open(records_path, "a", buffering=1)  # line-buffered: each record reaches the file whole
    lock = threading.Lock()
    counter = iter(range(1 << 30))

    def write(record: dict) -> None:
        with lock:
            out.write(json.dumps(record) + "\n")

    async def recorded(request_func_input, pbar=None):
        i = next(counter)
        write({"event": "start", "i": i, "t": time.monotonic(), "prompt": request_func_input.prompt,
               "output_len": request_func_input.output_len})
        result = await original(request_func_input, pbar)
        write({"event": "end", "i": i, "t": time.monotonic(), "success": bool(result.success),
               "error": result.error or "", "text": result.generated_text, "got_len": result.output_len})
        return result

    return recorded


def _install(records_path: Path, timeout_s: float):
    if importlib.util.find_spec("datasets") is None and str(_STUBS) not in sys.path:
        sys.path.append(str(_STUBS))
    import aiohttp
    import sglang.benchmark.serving as serving

    def session():
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     read_bufsize=10 * 1024 ** 2)

    recorded = record_requests(serving.ASYNC_REQUEST_FUNCS["sglang"], records_path)
    serving._create_bench_client_session = session
    for name in ("sglang", "sglang-native"):
        serving.ASYNC_REQUEST_FUNCS[name] = recorded
    return serving


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[2] != "--":
        sys.exit(__doc__)
    records, timeout_s, rest = Path(argv[0]), float(argv[1]), argv[3:]
    serving = _install(records, timeout_s)
    sys.argv = ["sglang.benchmark.serving"] + rest
    serving.cli_main()


if __name__ == "__main__":
    main()
