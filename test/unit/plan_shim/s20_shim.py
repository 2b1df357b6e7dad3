"""Stands in for `python3 SCRIPT ARGS` inside plans.sh on this CPU (test_s20_plan.py): runs the
rig script's real main() (its argument parsing, phase and config tables, JSON writing, the
transfer-process log check) with fake servers that answer at once and write a prefill log whose
transfer-process lines say what S20_FAKE_TPROC asks (serving / refused / refused_tp1), one per TP rank."""

import importlib.util
import json
import os
import sys
import threading
from pathlib import Path

SERVING = ("sglang-mori transfer process pid 7: engine soft on 127.0.0.1, control port 9, 16 KV buffers registered "
           "and proven; start-up used 5 ms of CPU\nsglang-mori: transfer process pid 7 serves control port 9\n"
           "sglang-mori transfer process pid 7: first room reached Success (room 3)\n")
REFUSED = "sglang-mori prefill tp0: SGLANG_MORI_TRANSFER_PROCESS=on refused: injected; transfers stay in the scheduler's process\n"


def prefill_log(argv) -> str:
    """One serving child per TP rank (pids 7, 8, ...); `refused`: every rank refused; `refused_tp1`:
    rank 0 serves and rank 1 refused."""
    mode = os.environ.get("S20_FAKE_TPROC")
    ranks = int(argv[argv.index("--tp-size") + 1]) if "--tp-size" in argv else 1
    lines = []
    for rank in range(ranks):
        refused = mode == "refused" or (mode == "refused_tp1" and rank == 1)
        lines.append(REFUSED.replace("tp0", f"tp{rank}") if refused else SERVING.replace("pid 7", f"pid {7 + rank}"))
    return "".join(lines)


METERED = []  # (folder, role) of the fake servers started with SGLANG_MORI_CALL_METER
REQUESTS = [0]
LOCK = threading.Lock()  # the client's threads count and write in turn (the real writer is one thread)


def write_meter_snapshots() -> None:
    """What call_meter.py's writer would say after REQUESTS requests: prefill 100 us of calls + 20 us of
    threads per request, decode 50 + 30 (written as of a far future time, so the rig waits for none)."""
    n = REQUESTS[0]
    parts = {"prefill": ({"MoriKVSender.send": [n, n * 100_000]}, {"mori-shard-N": n * 20_000}),
             "decode": ({"MoriKVReceiver.poll": [3 * n, n * 50_000]}, {"mori-decode-status": n * 30_000})}
    for folder, role in METERED:
        calls, threads = parts[role]
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{role}-1.json").write_text(json.dumps(
            {"pid": 1, "role": role, "time": 4e9, "requests": n, "calls": calls, "callers": {}, "threads": threads}))


class FakeServer:
    def __init__(self, name, argv, env, logs, port):
        self.name, self.argv, self.env, self.url, self.ready_s = name, argv, env, f"http://h:{port}", 1.0
        self.log = Path(logs) / f"{name}.log"

    def start(self):
        self.log.parent.mkdir(parents=True, exist_ok=True)
        tproc = self.env.get("SGLANG_MORI_TRANSFER_PROCESS") == "on"
        self.log.write_text(prefill_log(self.argv) if tproc else "")
        if self.env.get("SGLANG_MORI_CALL_METER"):
            METERED.append((self.env["SGLANG_MORI_CALL_METER"], "prefill" if "prefill" in self.argv else "decode"))
            write_meter_snapshots()
        return self

    def wait_ready(self, deadline_s):
        pass

    def metrics(self):
        return {}

    def stop(self):
        METERED.clear()


class FakePDClient:
    def __init__(self, *args):
        pass

    def __call__(self, body):
        return {"output_ids": [len(body["input_ids"]) % 97], "error": None}

    def stream(self, body):
        with LOCK:
            REQUESTS[0] += 1
            write_meter_snapshots()
        return {"ttft_s": 0.05, "itl_s": [0.002], "tokens": 2, "e2e_s": 0.1, "sent_at": 1.0, "first_at": 1.05}


def main():
    script = Path(sys.argv[1])
    sys.path.insert(0, str(script.parent))
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.Server, module.PDClient = FakeServer, FakePDClient
    if hasattr(module, "generate"):
        module.generate = lambda url, body: FakePDClient()(body)  # the standalone phase
    if hasattr(module, "compiled_files"):
        module.compiled_files = lambda: 0
    sys.argv = sys.argv[1:]
    module.main()


if __name__ == "__main__":
    main()
