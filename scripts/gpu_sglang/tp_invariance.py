"""Why prefill TP 2 -> decode TP 1 is not token-identical to a TP 1 standalone: the comparisons of
plans.sh's `tp_proof`, from pd_identity.py's JSONs (there, or here on what came back).

(a) TP 2 standalone vs TP 1 standalone, same model and flags: where they differ, TP arithmetic does
    (no transfer is involved); bf16 with the float32 dot default (TF32 in Triton), and float32 with
    TRITON_F32_DEFAULT=ieee;
(b) the PD run's first output token of every prompt vs the TP 2 standalone's: prefill computes it,
    at TP 2, before any KV moves;
(c) which prompts PD and TP 2 standalone each change against TP 1;
(d) the KV byte check of each PD phase (kv_hash.py), as pd_identity.py recorded it.

Usage: tp_invariance.py --tp1 REF.json --tp2 TP2.json --pd PD.json [--tp1-old OLD.json]
       [--tp1-ieee A.json --tp2-ieee B.json] --out RESULT.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Dict, List, Optional

from pd_identity import compare

CONC = ("c1", "c16")


def standalone(path: Optional[str]) -> Optional[Dict]:
    if not path or not Path(path).exists():
        return None
    return json.loads(Path(path).read_text())["phases"].get("standalone")


def outputs_vs(ref: Optional[Dict], got: Optional[Dict]) -> Dict:
    if not ref or not got:
        return {"missing": True}
    return {c: compare(ref[c]["results"], got[c]["results"]) for c in CONC if c in ref and c in got}


def first_tokens_vs(ref: Dict, got: Dict) -> Dict:
    out = {}
    for c in CONC:
        pairs = [((a["output_ids"] or [None])[0], (b["output_ids"] or [None])[0])
                 for a, b in zip(ref[c]["results"], got[c]["results"])]
        bad = [i for i, (x, y) in enumerate(pairs) if x != y or x is None]
        out[c] = {"identical": len(pairs) - len(bad), "total": len(pairs), "mismatched": bad}
    return out


def changed(ref: Dict, got: Dict, c: str) -> List[int]:
    return [i for i, (a, b) in enumerate(zip(ref[c]["results"], got[c]["results"]))
            if a["output_ids"] != b["output_ids"]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp1", required=True)
    ap.add_argument("--tp1-old")
    ap.add_argument("--tp2", required=True)
    ap.add_argument("--pd", required=True)
    ap.add_argument("--tp1-ieee")
    ap.add_argument("--tp2-ieee")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    tp1, tp2 = standalone(a.tp1), standalone(a.tp2)
    pd_report = json.loads(Path(a.pd).read_text()) if Path(a.pd).exists() else {"phases": {}}
    result: Dict = {
        "a_tp2_vs_tp1_bf16": outputs_vs(tp1, tp2),
        "tp1_vs_previous_session_tp1": outputs_vs(standalone(a.tp1_old), tp1),
        "a_tp2_vs_tp1_float32_ieee": outputs_vs(standalone(a.tp1_ieee), standalone(a.tp2_ieee)),
        "pd": {},
    }
    for name, phase in pd_report["phases"].items():
        if name == "standalone" or "c1" not in phase:
            continue
        entry: Dict = {"vs_tp1": outputs_vs(tp1, phase), "vs_tp2_standalone": outputs_vs(tp2, phase),
                       "kv_hash": phase.get("kv_hash")}
        if tp2 and tp1:
            entry["b_first_token_vs_tp2_standalone"] = first_tokens_vs(tp2, phase)
            entry["c_changed_vs_tp1"] = {c: {"pd": changed(tp1, phase, c), "tp2_standalone": changed(tp1, tp2, c)}
                                         for c in CONC}
        result["pd"][name] = entry
    Path(a.out).write_text(json.dumps(result, indent=1))

    def short(v):
        return {c: f"{x['identical']}/{x['total']}" for c, x in v.items() if isinstance(x, dict) and "identical" in x}
    print("TP2 vs TP1 standalone, bf16:", short(result["a_tp2_vs_tp1_bf16"]))
    print("TP1 here vs previous session's TP1:", short(result["tp1_vs_previous_session_tp1"]))
    print("TP2 vs TP1 standalone, float32 ieee:", short(result["a_tp2_vs_tp1_float32_ieee"]))
    for name, e in result["pd"].items():
        kv = e.get("kv_hash") or {}
        print(f"{name}: vs TP1 {short(e['vs_tp1'])}, vs TP2 standalone {short(e['vs_tp2_standalone'])}, "
              f"first token vs TP2 {short(e.get('b_first_token_vs_tp2_standalone', {}))}, KV rooms "
              f"{kv.get('rooms_matched')}/{kv.get('rooms')}, bytes {kv.get('bytes_compared')}")


if __name__ == "__main__":
    main()
