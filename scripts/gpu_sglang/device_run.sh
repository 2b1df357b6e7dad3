#!/usr/bin/env bash
# On the GPU machine, from the device copy's root: install the carried wheels, register our plugin's
# entry point, and run `identity` / `identity-mla` (pd_identity.py on a random-weight Llama GQA / DeepSeek MLA model
# built here) or `latency`
# (pd_latency.py). Usage: device_run.sh identity|identity-mla|latency [ARGS of that script]
# Expects the worktree copy in .gpu/ and the wheels in .whl/ (README.md beside this file: how to send it).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WHL=${WHL:-$(pwd)/.whl}
OUT=${OUT:-/tmp/out}
SITE=/tmp/sglang-site
mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus.csv" 2>&1
python3 -m pip install -q --no-index --no-deps --target "$SITE" "$WHL"/*.whl > "$OUT/pip.log" 2>&1 \
  || { echo "pip install failed"; tail -20 "$OUT/pip.log"; exit 1; }
# SGLang loads plugins through entry points (group sglang.srt.plugins): a dist-info makes ours visible.
DI="$SITE/sglang_mori-0.1.0.dist-info"; mkdir -p "$DI"
printf 'Metadata-Version: 2.1\nName: sglang-mori\nVersion: 0.1.0\n' > "$DI/METADATA"
# room_trace and kv_hash (scripts/gpu_sglang) only act where SGLANG_MORI_ROOM_TRACE (pd_latency.py
# --trace) or SGLANG_MORI_KV_HASH (pd_identity.py --kv-hash) is set: measurement only.
printf '[sglang.srt.plugins]\nsglang_mori = sglang_mori.plugin:register\nroom_trace = room_trace:register\nkv_hash = kv_hash:register\n' > "$DI/entry_points.txt"
export PYTHONPATH="$ROOT/python:$ROOT/scripts/gpu_stubs:$ROOT/scripts/gpu_sglang:$SITE"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 SGLANG_HOST_IP=127.0.0.1 PYTHONUNBUFFERED=1
# The stand-in is not the sglang-kernel distribution SGLang's launcher asks for (>= 0.4.9).
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
# SGLang's bundled Rust radix tree is a binary built against torch 2.14; on this torch (2.11) it read an
# int64 index tensor as Half (gpu_host.md wall 6). SGLang's own Python tree core serves instead.
export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python
# Never NVLink multicast on this shared host (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
echo "install: $(( $(date +%s) - t0 )) s"
python3 -c "import torch, sglang, sglang_mori; print('torch', torch.__version__, 'sglang', sglang.__version__, torch.cuda.device_count(), 'GPUs')"
what=$1; shift
if [ "$what" = plan ]; then
  # Several runs side by side on a 4-GPU machine (plans.sh); logs come back as one archive.
  source "$ROOT/scripts/gpu_sglang/plans.sh"
  run_plan "$@"
elif [ "$what" = identity ] || [ "$what" = identity-mla ]; then
  arch=llama; [ "$what" = identity-mla ] && arch=mla
  python3 "$ROOT/scripts/gpu_sglang/build_model.py" /tmp/gpu-llama --arch $arch > /dev/null || exit 1
  python3 "$ROOT/scripts/gpu_sglang/pd_identity.py" --model /tmp/gpu-llama --out "$OUT" "$@"
else
  python3 "$ROOT/scripts/gpu_sglang/pd_latency.py" --out "$OUT" "$@"
fi
rc=$?
echo "total: $(( $(date +%s) - t0 )) s"
exit $rc
