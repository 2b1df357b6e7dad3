"""The chaos run's load: SGLang's own client (bench_client.py around sglang.benchmark.serving) with
random token-id prompts of mixed lengths, bounded in count and in time.

Non-streamed (`--disable-stream`): a failed request then comes back as an HTTP error whose body
names the cause. Streamed, SGLang reports a failure inside a 200 stream, which the client keeps as
a success with a short text: the run would count it as a mismatch without its cause.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from harness import launch
from harness.procs import ManagedProcess

REPO = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class LoadSpec:
    num_prompts: int = 64
    input_len: int = 512  # prompts of input_len x range_ratio .. input_len tokens
    output_len: int = 32  # outputs of output_len x range_ratio .. output_len tokens (ignore_eos)
    range_ratio: float = 0.125
    max_concurrency: int = 8
    request_rate: float = 8.0  # Poisson arrivals per second, bounded by max_concurrency
    seed: int = 20

    def client_args(self, base_url: str, model_dir: Path, out_file: Path, pd: bool) -> List[str]:
        return [
            "--backend", "sglang",
            "--base-url", base_url,
            *(["--pd-separated"] if pd else []),
            "--dataset-name", "random-ids",
            "--tokenize-prompt",
            "--random-input-len", str(self.input_len),
            "--random-output-len", str(self.output_len),
            "--random-range-ratio", str(self.range_ratio),
            "--num-prompts", str(self.num_prompts),
            "--max-concurrency", str(self.max_concurrency),
            "--request-rate", str(self.request_rate),
            "--disable-stream",
            "--model", str(model_dir),
            "--tokenizer", str(model_dir),
            "--seed", str(self.seed),
            "--warmup-requests", "1",
            "--ready-check-timeout-sec", "60",
            "--disable-tqdm",
            "--output-file", str(out_file),
        ]


def client_env() -> Dict[str, str]:
    env = launch.base_env(None)
    env["PYTHONPATH"] = ":".join([str(REPO / "test"), str(REPO / "python"), env["PYTHONPATH"]])
    # bench_serving flushes the server cache when it believes it runs in SGLang's CI; not here.
    env.pop("SGLANG_IS_IN_CI", None)
    return env


def start_client(spec: LoadSpec, base_url: str, model_dir: Path, records: Path, request_timeout_s: float,
                 log_path: Path, pd: bool, prefix: Sequence[str] = ()) -> ManagedProcess:
    """SGLang's client as a process of its own (own process group), optionally on a chaos host."""
    argv = list(prefix) + [sys.executable, "-m", "harness.chaos.bench_client", str(records),
                           str(request_timeout_s), "--"]
    argv += spec.client_args(base_url, model_dir, records.with_suffix(".result.jsonl"), pd)
    return ManagedProcess(f"client-{records.stem}", argv, client_env(), log_path).start()


def wait_client(proc: ManagedProcess, cap_s: float) -> Optional[int]:
    """The client's exit code, or None if it ran past `cap_s` and was stopped."""
    import subprocess

    try:
        return proc.proc.wait(timeout=cap_s)
    except subprocess.TimeoutExpired:
        proc.stop(grace_s=2.0)
        return None
