#!/usr/bin/env bash
# Collect the cp312 manylinux wheels SGLang 0.5.23 needs on the GPU machine (which has no package
# registry) into an ignored folder, and check that they fit what one device call may carry (64 MiB
# with the tracked tree). Usage: collect_wheels.sh [DEST] (default: /work/main/.whl).
# Which packages, and why each: shared docs/research/gpu_host.md.
set -euo pipefail
DEST=${1:-/work/main/.whl}
PY=${PY:-/work/main/.venv/bin/python}
mkdir -p "$DEST"
PLAT=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp
      --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# Already on the GPU machine's image (not carried): torch, triton, numpy, transformers, tokenizers,
# safetensors, requests, aiohttp, uvloop, psutil, prometheus_client, pillow, einops, sentencepiece,
# tiktoken, regex, jinja2, httpx, httpcore, anyio, h11, click, attrs, zipp, pygments, tqdm.
PKGS=(
  sglang==0.5.23
  fastapi uvicorn starlette pydantic pydantic-core annotated-types typing-inspection
  orjson pybase64 msgspec pyzmq
  openai==2.8.0 distro jiter sniffio
  partial_json_parser jsonschema referencing rpds-py jsonschema-specifications
  xgrammar==0.2.7 compressed-tensors==0.18.0 loguru gguf apache-tvm-ffi==0.1.11 dill
  soundfile==0.13.1 cffi pycparser python-multipart setproctitle frozendict
  opentelemetry-api importlib_metadata
)
"$PY" -m pip download -q -d "$DEST" "${PLAT[@]}" "${PKGS[@]}"
# IPython: SGLang imports it only for a notebook helper; ipython_stub (scripts/gpu_sglang/stubs)
# stands in, so its 5 MB of dependencies need not travel.
"$PY" - "$DEST" <<'PYEOF'
import os, subprocess, sys
def size(path):
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total
tracked = subprocess.run(["git", "-C", "/work/main", "ls-files", "-z"], capture_output=True, check=True).stdout
tracked_b = sum(os.path.getsize(os.path.join("/work/main", f)) for f in tracked.decode().split("\0") if f and os.path.isfile(os.path.join("/work/main", f)))
parts = {"tracked": tracked_b, "wheels": size(sys.argv[1]), ".gpu": size("/work/main/.gpu")}
total = sum(parts.values())
print(" + ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in parts.items()), f"= {total / 2**20:.1f} MiB (limit 64)")
sys.exit(0 if total < 64 * 2**20 else "over the carry limit")
PYEOF
