"""A small few-shot GSM8K evaluator over a local jsonl (lines with "question" and "answer", the
answer ending in "#### <number>", as in the public GSM8K test set), against SGLang's /generate.

    python test/manual/gsm8k_eval.py --url http://127.0.0.1:8000 --data gsm8k_test.jsonl -n 200
"""

from __future__ import annotations

import argparse
import json
import re
from concurrent.futures import ThreadPoolExecutor

import requests

NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def load(path: str):
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def label(answer: str) -> float:
    return float(answer.split("####")[-1].strip().replace(",", ""))


def predicted(text: str):
    nums = NUMBER.findall(text)
    if not nums:
        return None
    try:
        return float(nums[-1].replace(",", "").rstrip("."))
    except ValueError:
        return None


def few_shot_prefix(shots) -> str:
    return "".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in shots)


def evaluate(url: str, rows, shots: int = 5, n: int = 200, parallel: int = 64, max_tokens: int = 256,
             timeout: float = 600.0) -> dict:
    prefix = few_shot_prefix(rows[:shots])
    tests = rows[shots:shots + n]

    def ask(row):
        body = {"text": prefix + f"Question: {row['question']}\nAnswer:",
                "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0,
                                    "stop": ["Question", "\n\n\n"]}}
        try:
            r = requests.post(url.rstrip("/") + "/generate", json=body, timeout=timeout)
            r.raise_for_status()
            return predicted(r.json()["text"])
        except (requests.RequestException, KeyError, ValueError):
            return "error"

    with ThreadPoolExecutor(parallel) as pool:
        preds = list(pool.map(ask, tests))
    correct = sum(1 for p, row in zip(preds, tests) if isinstance(p, float) and abs(p - label(row["answer"])) < 1e-4)
    return {"n": len(tests), "accuracy": correct / len(tests),
            "invalid": sum(1 for p in preds if p is None) / len(tests),
            "errors": sum(1 for p in preds if p == "error")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("-n", type=int, default=200)
    p.add_argument("--shots", type=int, default=5)
    p.add_argument("--parallel", type=int, default=64)
    a = p.parse_args()
    print(json.dumps(evaluate(a.url, load(a.data), a.shots, a.n, a.parallel)))


if __name__ == "__main__":
    main()
