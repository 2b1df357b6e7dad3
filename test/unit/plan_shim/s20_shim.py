"""Stands in for `python3 SCRIPT ARGS` inside plans.sh on this CPU (test_s20_plan.py): runs the
rig script's real main() (its argument parsing, phase and config tables, JSON writing, the
transfer-process log check) with fake servers that answer at once and write a prefill log whose
transfer-process lines say what S20_FAKE_TPROC asks (serving / refused / refused_tp1), one per TP rank."""

import importlib.util
import os
import sys
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


class FakeServer:
    def __init__(self, name, argv, env, logs, port):
        self.name, self.argv, self.env, self.url, self.ready_s = name, argv, env, f"http://h:{port}", 1.0
        self.log = Path(logs) / f"{name}.log"

    def start(self):
        self.log.parent.mkdir(parents=True, exist_ok=True)
        tproc = self.env.get("SGLANG_MORI_TRANSFER_PROCESS") == "on"
        self.log.write_text(prefill_log(self.argv) if tproc else "")
        return self

    def wait_ready(self, deadline_s):
        pass

    def metrics(self):
        return {}

    def stop(self):
        pass


class FakePDClient:
    def __init__(self, *args):
        pass

    def __call__(self, body):
        return {"output_ids": [len(body["input_ids"]) % 97], "error": None}

    def stream(self, body):
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
