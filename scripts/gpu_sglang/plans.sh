# Sourced by device_run.sh (wheels installed, environment set): runs side by side on a 4-GPU
# machine, one plan per device call. Each run writes under $W; the JSONs are copied to $OUT and
# every log travels back in $OUT/<plan>.tgz (a call returns at most 8 files).
# Usage: device_run.sh plan plan1|plan2|plan3|tp_proof|tp_fp32_ieee|ttft8k_hotpath|ttft8k_pair (ORDER=...)|ttft8k_pollreads|ttft8k_ce|ttft8k_front (ORDER=...)|ttft8k_fwd (ORDER=...)|s16_final|s17_interf (ROUTE=, COPIES=, MODES=, DDEV=, GPU=, ROUNDS=, SECONDS_W=, DSTEPS=, DROUNDS=, LOADS=)|s17_link|s19_gpu1 (s17_interf + hotpath)|s19_link (RUNS=, SWEEP_S=, GPUTESTS=, LINK_SHAPES=, LINK_TOKENS=, LINK_ITERS=...)|s20_tpsg (S20_BUDGET_S=...)|s21_tpsg (S21_BUDGET_S=, S21_STEPS=...)|s22_meter (S22_BUDGET_S=, S22_CONFIGS=...)
# Port bases stay in 10000-21999: below the kernel's ephemeral range (32768+ there), where any
# outgoing connection of a server beside it (HTTP, NCCL, softio) may hold a port as its source, and
# below SGLang's own nccl_port range (22000-29999). With bases at 37000/38000 a PD prefill server of
# the second pair once exited during start-up with its port unreachable (session 12).
S="$ROOT/scripts/gpu_sglang"
W=/tmp/w

models() {
  python3 "$S/build_model.py" /tmp/gpu-llama --arch llama > /dev/null &&
  python3 "$S/build_model.py" /tmp/gpu-mla --arch mla > /dev/null
}

# Standalone identity reference (GPU $1) for the runs beside it; then, on the same GPU, the
# standalone latency run with per-request timestamps and each shape measured twice.
reference_then_standalone_latency() {
  python3 "$S/pd_identity.py" --model /tmp/gpu-llama --out $W/ref --phases standalone --gpu-base "$1" \
    --deterministic --tag standalone --port-base 14000 > $W/ref.out 2>&1
  python3 "$S/pd_latency.py" --out $W/lat --configs standalone --gpu-base "$1" --trace --repeats 2 \
    --tag latency_standalone --port-base 15000 > $W/lat_standalone.out 2>&1
}

# Prefill TP 2 (GPUs 0,1) into decode TP 1 (GPU 2), chunk-wise and layer-wise; then the fault runs
# on GPUs 0 (prefill) and 1 (decode). Both compare with the reference of GPU 3.
tp2_then_faults() {
  python3 "$S/pd_identity.py" --model /tmp/gpu-llama --out $W/tp2 --phases pd,pd_lw --gpus 2 --prefill-tp 2 \
    --deterministic --reference $W/ref/standalone.json --tag identity_tp2 > $W/tp2.out 2>&1
  python3 "$S/pd_faults.py" --model /tmp/gpu-llama --out $W/faults --reference $W/ref/standalone.json \
    --gpu-base 0 --tag faults > $W/faults.out 2>&1
}

plan1() {
  reference_then_standalone_latency 3 & local a=$!
  tp2_then_faults & local b=$!
  wait $a $b
}

# MLA prefill GPU 0 -> decode GPU 1 (standalone on GPU 0 first) beside the traced PD latency runs
# (prefill GPU 2, decode GPU 3).
plan2() {
  python3 "$S/pd_identity.py" --model /tmp/gpu-mla --out $W/mla --phases standalone,pd,pd_lw --gpus 2 \
    --deterministic --tag identity_mla_2gpu --port-base 16000 > $W/mla.out 2>&1 & local a=$!
  python3 "$S/pd_latency.py" --out $W/lat --configs pd_off,pd_auto --gpu-base 2 --trace \
    --tag latency_pd --port-base 17000 > $W/lat_pd.out 2>&1 & local b=$!
  wait $a $b
}

# Prefill TP 2 -> decode TP 1 again in float32 (meant as TP-invariant numerics, but its matmuls ran as
# TF32, Triton's float32 dot default: tp_fp32_ieee below is the IEEE run; bf16 TP 2 and TP 1 round
# differently, so the bf16 run cannot tell a wrong byte from rounding) beside its float32 standalone
# reference on GPU 3, and test/gpu/test_layerwise_graph_replay.py on GPU 3; then the traced PD run
# at 8K, concurrency 1, layer-wise auto (GPUs 0->1). (As run on 2026-11-27, a second PD run beside it
# on GPUs 2->3 set a thread switch-interval knob, removed after that A/B showed no effect: ff68889.)
plan3() {
  SGLANG_MORI_GPU_TESTS=1 CUDA_VISIBLE_DEVICES=3 python3 -m pytest "$ROOT/test/gpu/test_layerwise_graph_replay.py" \
    -q -rs -p no:cacheprovider > $W/gpu_test.out 2>&1 &
  python3 "$S/pd_identity.py" --model /tmp/gpu-llama --out $W/ref32 --phases standalone --gpu-base 3 \
    --deterministic --dtype float32 --tag standalone_fp32 --port-base 14000 --start-timeout 200 > $W/ref32.out 2>&1 & local a=$!
  python3 "$S/pd_identity.py" --model /tmp/gpu-llama --out $W/tp2f --phases pd --gpus 2 --prefill-tp 2 \
    --deterministic --dtype float32 --reference $W/ref32/standalone_fp32.json --tag identity_tp2_fp32 --start-timeout 200 \
    > $W/tp2f.out 2>&1
  wait $a
  python3 "$S/pd_latency.py" --out $W/lat --configs pd_auto --gpu-base 0 --trace --lengths 8192 \
    --concurrency 1 --tag latency_pd_auto --port-base 17000 > $W/lat_auto.out 2>&1
}

# Is prefill TP 2 -> decode TP 1's difference from the TP 1 standalone (7/64 identical in bf16)
# TP arithmetic or the transfer? Round 1: TP 2 standalone, bf16 (GPUs 0,1), beside TP 2 standalone
# in float32 with IEEE float32 dots (GPUs 2,3; Triton's default for a float32 dot is TF32, and the
# batch-invariant matmul is a Triton kernel). Round 2: PD TP 2 (GPUs 0,1) -> TP 1 (GPU 2) with the
# KV byte check (kv_hash.py), chunk-wise and layer-wise, beside the TP 1 standalone references on
# GPU 3 (bf16, then float32 IEEE), made on this machine. tp_invariance.py compares (a)-(d).
tp_proof() {
  local P="python3 $S/pd_identity.py --model /tmp/gpu-llama --deterministic"
  local IEEE="env TRITON_F32_DEFAULT=ieee TRITON_CACHE_DIR=/tmp/triton-ieee"
  PLAN_JSONS="$W/pd/*.json $W/analysis/*.json"  # the rest travels in the archive (8 files a call)
  $P --out $W/tp2s --phases standalone --standalone-tp 2 --gpu-base 0 --tag standalone_tp2 \
    --kv-hash $W/kv_tp2s --port-base 14000 > $W/tp2s.out 2>&1 & local a=$!
  $IEEE $P --out $W/tp2s32 --phases standalone --standalone-tp 2 --gpu-base 2 --dtype float32 \
    --tag standalone_tp2_fp32_ieee --kv-hash $W/kv_tp2s32 --port-base 15000 > $W/tp2s32.out 2>&1 & local b=$!
  wait $a $b
  ( $P --out $W/ref --phases standalone --gpu-base 3 --tag standalone --kv-hash $W/kv_ref \
      --port-base 16000 > $W/ref.out 2>&1
    $IEEE $P --out $W/ref32 --phases standalone --gpu-base 3 --dtype float32 --tag standalone_fp32_ieee \
      --kv-hash $W/kv_ref32 --port-base 16500 > $W/ref32.out 2>&1 ) & local c=$!
  $P --out $W/pd --phases pd,pd_lw --gpus 2 --prefill-tp 2 --reference $W/ref/standalone.json \
    --kv-hash $W/kv_pd --tag identity_tp2_kvhash --port-base 17000 > $W/pd.out 2>&1
  wait $c
  mkdir -p $W/analysis
  python3 "$S/tp_invariance.py" --tp1 $W/ref/standalone.json --tp2 $W/tp2s/standalone_tp2.json \
    --pd $W/pd/identity_tp2_kvhash.json --tp1-old docs/data/gpu_sglang_identity_tp2_h200x4.json \
    --tp1-ieee $W/ref32/standalone_fp32_ieee.json --tp2-ieee $W/tp2s32/standalone_tp2_fp32_ieee.json \
    --out $W/analysis/tp_invariance.json 2>&1 | tee $W/analysis.out
  for k in $W/kv_*; do echo "$k: $(cat $k/*/kv-*.jsonl 2>/dev/null | grep '"process"' | sort -u)"; done
}

# PD TP 2 -> TP 1 where TP 2 and TP 1 compute alike (float32, IEEE float32 dots: tp_proof found the
# two standalones 64/64 identical), chunk-wise and layer-wise, with the KV byte check, against the
# float32 IEEE TP 1 standalone that tp_proof made (carried: TP_REF, default docs/data/'s copy).
tp_fp32_ieee() {
  PLAN_JSONS="$W/*/*.json"
  env TRITON_F32_DEFAULT=ieee TRITON_CACHE_DIR=/tmp/triton-ieee python3 "$S/pd_identity.py" \
    --model /tmp/gpu-llama --deterministic --dtype float32 --out $W/pd32 --phases pd,pd_lw --gpus 2 \
    --prefill-tp 2 --reference "${TP_REF:-docs/data/gpu_sglang_tp1_fp32_ieee_h200x4.json}" --kv-hash $W/kv_pd32 \
    --tag identity_tp2_fp32_ieee_kvhash --port-base 17000 > $W/pd32.out 2>&1
  for k in $W/kv_*; do echo "$k: $(cat $k/*/kv-*.jsonl 2>/dev/null | grep '"process"' | sort -u)"; done
}

# Session 15 (issue 27, SGLang's optimistic prefill: the forward starts before decode's
# destinations arrive, and layer-wise joins the request to its stream when they do): the 8K
# concurrency-1 TTFT of standalone, PD `auto` and PD `auto` with --optimistic-prefill-attempts 1 on
# the prefill, two pairs side by side in both orders (GPUs 0->1, 2->3), traced.
ttft8k_optimistic() {
  PLAN_JSONS="$W/lat*/*.json"
  python3 "$S/pd_latency.py" --out $W/latA --configs standalone,pd_auto,pd_auto_optimistic --gpu-base 0 --trace \
    --lengths 8192 --concurrency 1 --requests-c1 12 --repeats 2 --tag latency_8k_opt_a --port-base 17000 > $W/latA.out 2>&1 & local a=$!
  python3 "$S/pd_latency.py" --out $W/latB --configs pd_auto_optimistic,pd_auto,standalone --gpu-base 2 --trace \
    --lengths 8192 --concurrency 1 --requests-c1 12 --repeats 2 --tag latency_8k_opt_b --port-base 18000 > $W/latB.out 2>&1 & local b=$!
  wait $a $b
}

# Session 15: token identity with optimistic prefill, Llama GQA (GPUs 0->1) beside DeepSeek-shaped
# MLA (GPUs 2->3): each its standalone, then chunk-wise, layer-wise and decode's radix cache with
# --optimistic-prefill-attempts 1 on the prefill.
identity_optimistic() {
  python3 "$S/pd_identity.py" --model /tmp/gpu-llama --out $W/gqa --phases standalone,pd_optimistic,pd_lw_optimistic,pd_dcache_optimistic \
    --gpus 2 --gpu-base 0 --deterministic --tag identity_optimistic_gqa --port-base 14000 > $W/gqa.out 2>&1 & local a=$!
  python3 "$S/pd_identity.py" --model /tmp/gpu-mla --out $W/mla --phases standalone,pd_optimistic,pd_lw_optimistic \
    --gpus 2 --gpu-base 2 --deterministic --tag identity_optimistic_mla --port-base 16000 > $W/mla.out 2>&1 & local b=$!
  wait $a $b
}

run_plan() {
  local plan=$1
  rm -rf $W && mkdir -p $W
  case $plan in
    s17_*|s19_link) ;;  # the GPU rig only: no SGLang server, no model
    *) models || { echo "model build failed"; return 1; } ;;
  esac
  nvidia-smi topo -m > $W/topo.txt 2>&1
  ( while sleep 30; do echo "[$(date +%T)] $(ls $W/*/*.json 2>/dev/null | tr '\n' ' ')"; done ) &
  local ticker=$!
  "$plan"  # each plan waits for its own runs by pid (a bare `wait` would wait for the ticker too)
  kill $ticker
  wait  # the plan's side jobs (a GPU test) have ended too; the ticker is gone
  for f in $W/*.out; do echo "=== $f"; tail -25 "$f"; done
  cp ${PLAN_JSONS:-$W/*/*.json} "$OUT/" 2>/dev/null
  tar czf "$OUT/$plan.tgz" -C $W . 2>/dev/null
  ls -la "$OUT"
}

# Session 12 (issue 27 TTFT after Success moved to the thread that sees the room complete; issue 28
# hot path of a candidate branch): the 8K concurrency-1 TTFT of standalone, PD chunk-wise and PD
# `auto`, twice side by side (GPUs 0->1 in one order, 2->3 in the other; standalone on the prefill's
# GPU), traced; beside them, on the CPU, `bench hotpath --engine instant` of this tree against the
# candidate copied to .gpu/cand (ROOT is .gpu there) (absent: skipped), in both orders.
ttft8k_hotpath() {
  python3 "$S/pd_latency.py" --out $W/latA --configs standalone,pd_off,pd_auto --gpu-base 0 --trace \
    --lengths 8192 --concurrency 1 --requests-c1 12 --repeats 2 --tag latency_8k_a --port-base 17000 > $W/latA.out 2>&1 & local a=$!
  python3 "$S/pd_latency.py" --out $W/latB --configs pd_auto,pd_off,standalone --gpu-base 2 --trace \
    --lengths 8192 --concurrency 1 --requests-c1 12 --repeats 2 --tag latency_8k_b --port-base 18000 > $W/latB.out 2>&1 & local b=$!
  hotpath_ab
  wait $a $b
}

# `bench hotpath --engine instant` of this tree against the candidate in .gpu/cand (absent: skipped),
# alternating, on the machine's CPU.
hotpath_ab() {
  [ -d "$ROOT/cand/python" ] || return 0
  mkdir -p $W/hot
  for r in $(seq ${HOT_ROUNDS:-2}); do
    python3 "$ROOT/scripts/bench_backend.py" hotpath --engine instant --json > $W/hot/main_$r.jsonl 2> $W/hot/main_$r.err
    python3 "$ROOT/scripts/bench_backend.py" hotpath --engine instant --json --backend-root "$ROOT/cand" \
      > $W/hot/cand_$r.jsonl 2> $W/hot/cand_$r.err
  done
  cat $W/hot/*.jsonl > $W/hot/hotpath_all.json
}

# Session 13 (two GPUs lent): one pair, prefill GPU 0 -> decode GPU 1 (standalone on GPU 0), the
# configurations one after another in $ORDER (a second call runs the other order), 8K concurrency 1,
# traced; then the hot path A/B on the CPU (after, not beside: on this smaller host it would load the
# CPU under one configuration and not the others).
ttft8k_pair() {
  python3 "$S/pd_latency.py" --out $W/lat --configs "${ORDER:-standalone,pd_off,pd_auto}" --gpu-base 0 --trace \
    --lengths 8192 --concurrency 1 --requests-c1 12 --repeats 2 --tag latency_8k_pair --port-base 17000 > $W/lat.out 2>&1
  # only while the call has time left for it (a call ends at 600 s)
  if [ $SECONDS -lt ${HOT_BEFORE_S:-440} ]; then hotpath_ab; else echo "hot path A/B skipped at ${SECONDS}s"; fi
}

# Issue 27, the messages read by SGLang's poll: 8K concurrency-1 TTFT of standalone, PD `auto` with
# SGLANG_MORI_POLL_READS on (default) and off, side by side in both orders, traced (ttft_breakdown:
# destinations_readers, success_readers, and the destinations / Success segments).
ttft8k_pollreads() {
  python3 "$S/pd_latency.py" --out $W/latA --configs standalone,pd_auto,pd_auto_threadreads --gpu-base 0 --trace \
    --lengths 8192 --concurrency 1 --requests-c1 12 --repeats 2 --tag latency_8k_a --port-base 17000 > $W/latA.out 2>&1 & local a=$!
  python3 "$S/pd_latency.py" --out $W/latB --configs pd_auto_threadreads,pd_auto,standalone --gpu-base 2 --trace \
    --lengths 8192 --concurrency 1 --requests-c1 12 --repeats 2 --tag latency_8k_b --port-base 18000 > $W/latB.out 2>&1 & local b=$!
  wait $a $b
}

# Session 14 (long ranges to the copy engines): the rig's link and layer-wise cost at page size 1 with
# whole-request runs (a fresh SGLang pool), default vs SGLANG_MORI_SOFTIO_CE_MIN_BYTES=0, then the 8K
# TTFT of standalone, PD `auto` with the kernel only and PD `auto` (ORDER=...), traced.
ttft8k_ce() {
  PLAN_JSONS="$W/lat/*.json"  # the rig JSONs travel in the archive
  mkdir -p $W/rig
  for r in 1 2; do
    for v in ce kernelonly; do
      local ce=""; [ $v = kernelonly ] && ce=0
      env SGLANG_MORI_RIG_PAGE1_RUN=8192 SGLANG_MORI_SOFTIO_CE_MIN_BYTES=$ce timeout 60 python3 "$ROOT/scripts/gpu_bench.py" \
        --parts link --decode-device 1 --shapes gqa:1,mla:1 --link-tokens 8192,32768 --iters 5 \
        --json $W/rig/link_${v}_$r.json 2>&1 | grep "^link\|rror" | sed "s/^/$v $r: /" >> $W/rig.out
    done
  done
  for v in ce kernelonly; do
    local ce=""; [ $v = kernelonly ] && ce=0
    env SGLANG_MORI_RIG_PAGE1_RUN=8192 SGLANG_MORI_SOFTIO_CE_MIN_BYTES=$ce timeout 45 python3 "$ROOT/scripts/gpu_bench.py" \
      --parts cost --decode-device 1 --shapes gqa:1 --tokens 8192 --requests 1 --iters 5 \
      --json $W/rig/cost_${v}.json 2>&1 | grep "^cost\|rror" | sed "s/^/$v: /" >> $W/rig.out
  done
  python3 "$S/pd_latency.py" --out $W/lat --configs "${ORDER:-standalone,pd_auto_kernelonly,pd_auto}" --gpu-base 0 --trace \
    --lengths 8192 --concurrency 1 --requests-c1 12 --repeats 2 --tag latency_8k_ce --port-base 17000 > $W/lat.out 2>&1
}

# Session 16 (issue 27, where PD's 8K TTFT excess goes; two GPUs): one pair, prefill GPU 0 -> decode
# GPU 1 (standalone on GPU 0), 8K prompts, concurrency 1, 12 requests measured twice, traced, the
# configurations one after another in $ORDER (a second call runs the reverse). Default: standalone,
# PD `auto` of this tree, and `pd_auto_cand`: PD `auto` with both servers importing the candidate's
# sglang_mori (.gpu/cand/python: main's code copied there after stage.sh, the same call's
# baseline; room_trace records which package each server imported). Without .gpu/cand that config
# fails by name and the others still run. Every config is measured with both clients in turn on the
# same servers (CLIENTS, default new,old: servers.py's, and client_before16.py's two-thread PD front
# and requests-based standalone client; the old client's results under 8192tok_c1_oldclient*), so
# the call also measures what the client change does to the front.
# Timing (the server logs of sessions 13-14's ttft8k_pair / ttft8k_ce calls, 2x H200): the first
# config ends 150-200 s after the call starts (install, models, servers compiling on first start),
# each further one 90-115 s later: three configs take at most about 420 s; a fourth would reach
# about 530 s (both clients add about 6 s a config). LAT_S (default 470 s of pd_latency.py)
# interrupts it (SIGINT: the running config's servers are stopped, the configs done so far are
# kept), so the call stays near 540 s at most.
ttft8k_front() {
  PLAN_JSONS="$W/lat/*.json $W/attribution_*.json"
  timeout -s INT ${LAT_S:-470} python3 "$S/pd_latency.py" --out $W/lat --configs "${ORDER:-standalone,pd_auto,pd_auto_cand}" \
    --gpu-base 0 --trace --lengths 8192 --concurrency 1 --requests-c1 12 --repeats 2 --clients "${CLIENTS:-new,old}" \
    --tag latency_8k_front --port-base 17000 > $W/lat.out 2>&1
  python3 "$S/ttft_breakdown.py" $W/lat/latency_8k_front.json --traces $W/lat/logs --shape 8192tok_c1 > $W/breakdown.out 2>&1
  for shape in 8192tok_c1 8192tok_c1_oldclient; do
    for c in pd_auto pd_auto_cand; do
      python3 "$S/ttft_attribution.py" $W/lat/latency_8k_front.json --traces $W/lat/logs --label call --config $c \
        --shape $shape --json $W/attribution_$shape.json 2>&1 | sed "s/^/[$c $shape] /" > $W/attribution_${c}_$shape.out
    done
  done
}

# Session 16, issue 27 (why layer-wise lengthens the prefill forward; two GPUs): ttft8k_front with
# forward_trace.py on in every server (SGLANG_MORI_FORWARD_TRACE=1: a timing event after each
# attention layer, our begin_batch's CPU, the launch's end), by default standalone, PD chunk-wise and
# PD `auto`, in the order pd_auto, standalone, pd_off (ORDER; the pair that decides it first, should
# LAT_S (420) cut the last one short), the new client only (CLIENTS): 3 configs in about 400 s.
# forward_timeline.py then splits each config's forwards (forward_timeline.out, in the archive).
ttft8k_fwd() {
  export SGLANG_MORI_FORWARD_TRACE=1
  ORDER=${ORDER:-pd_auto,standalone,pd_off} CLIENTS=${CLIENTS:-new} LAT_S=${LAT_S:-420} ttft8k_front
  python3 "$S/forward_timeline.py" $W/lat/logs > $W/forward_timeline.out 2>&1
}

# Session 16, the last call of a 2-GPU machine (one pair): the GPU test of the non-blocking page-row
# read (branch bb27; reverted, its test is skipped where absent), the 8K concurrency-1 TTFT of standalone and PD `auto` with the forward trace, then
# issue 28's interference A/B of the transfer-process prototype (switch off / on, same call, same card,
# 48 GB/s pacing as the issue's run) and `bench hotpath --transfer-process` on this host's CPU. Each part
# is bounded, and the rig parts write into $OUT as they finish (a call cut at the budget keeps them).
s16_final() {
  PLAN_JSONS="$W/lat/*.json"
  mkdir -p $W/rig
  [ -f "$ROOT/test/gpu/test_layerwise_page_reads_device.py" ] && SGLANG_MORI_GPU_TESTS=1 timeout 60 python3 -m pytest -q "$ROOT/test/gpu/test_layerwise_page_reads_device.py" \
    -p no:cacheprovider > $W/gputest.out 2>&1; cp $W/gputest.out "$OUT/"
  export SGLANG_MORI_FORWARD_TRACE=1
  timeout -s INT ${LAT_S:-230} python3 "$S/pd_latency.py" --out $W/lat --configs "${ORDER:-standalone,pd_auto}" \
    --gpu-base 0 --trace --lengths 8192 --concurrency 1 --requests-c1 12 --repeats 2 \
    --tag latency_8k_final --port-base 17000 > $W/lat.out 2>&1
  unset SGLANG_MORI_FORWARD_TRACE
  cp $W/lat/*.json "$OUT/" 2>/dev/null
  python3 "$S/forward_timeline.py" $W/lat/logs > $W/forward_timeline.out 2>&1; cp $W/forward_timeline.out "$OUT/"
  python3 "$S/ttft_attribution.py" $W/lat/latency_8k_final.json --traces $W/lat/logs --label call --config pd_auto \
    --shape 8192tok_c1 --json $W/attribution.json > $W/attribution.out 2>&1; cp $W/attribution.* "$OUT/" 2>/dev/null
  for v in off on; do
    local tp=""; [ $v = on ] && tp=--transfer-process
    SGLANG_MORI_SOFTIO_LINK_GBPS=48 timeout ${INTERF_S:-100} python3 "$ROOT/scripts/gpu_bench.py" --parts interference \
      --rounds 3 --seconds 4 $tp --json "$OUT/interf_$v.json" > "$OUT/interf_$v.txt" 2>&1
  done
  timeout 60 python3 "$ROOT/scripts/bench_backend.py" hotpath --engine instant --requests 96 --transfer-process --json \
    > "$OUT/hotpath_tp.jsonl" 2> "$OUT/hotpath_tp.err"
}

# Session 17 (issue 28: what is left of the forward's slowdown with the transfer process): on ONE GPU
# (GPU, default 0), the interference part at both loads (50/s x 1K, 200/s x 128; 48 GB/s pacing),
# with the transfer process (MODES="off on": in-process first, doubling the time), forward windows
# (1 s, 8 rounds) and decode windows (200 steps, 32 rounds: session 19) interleaved, beside
# copies-only loads (test/gpu/copy_load.py: the same copies at the same rate with none of
# our Python): from a spawned process (its own CUDA context, as the transfer process) in both modes,
# and in the in-process mode also from a thread of the forward's process (the forward's context: the
# copies' SM and memory traffic without the context switching). COPIES=... sets the list for both
# modes. ROUTE=memcpy (or kernel) sets softio's device copy route for every engine of the run
# (default: the gather kernel). Each mode is bounded by INTERF_S (default 330 s; SIGINT keeps the
# points done; expected about 270 s with the transfer process: per load ~20 s of start-up, 24 s of
# forward windows, ~90 s of decode windows). Returns
# s17_interf.tgz (logs, JSONs) and s17_summary.txt (one line per point, also printed: run_plan tails
# $W/s17.out).
s17_interf() {
  PLAN_JSONS="$W/s17_summary.txt"
  mkdir -p $W/interf
  local route=""; [ -n "${ROUTE:-}" ] && route="--device-copy $ROUTE"
  # MODES / ROUNDS / SECONDS_W / DSTEPS / DROUNDS / LOADS: short windows, many rounds resolve a few
  # percent where 4 s windows drift by tens of percent between rounds on this launch-bound forward;
  # the decode windows get their own rounds (DROUNDS), the decode goal's +2 % needs more of them.
  # DDEV=1 GPU=0,1: decode (its step loop, its KV) on the second GPU, as in a deployment.
  for v in ${MODES:-on}; do
    local tp="" copies=${COPIES:-process,thread}
    [ $v = on ] && tp=--transfer-process copies=${COPIES:-process}
    local t0=$(date +%s)
    CUDA_VISIBLE_DEVICES=${GPU:-0} SGLANG_MORI_SOFTIO_LINK_GBPS=48 timeout -s INT -k 15 ${INTERF_S:-330} \
      python3 "$ROOT/scripts/gpu_bench.py" --parts interference ${DDEV:+--decode-device $DDEV} --rounds ${ROUNDS:-8} --seconds ${SECONDS_W:-1} --decode-steps ${DSTEPS:-200} --decode-rounds ${DROUNDS:-32} --copies "$copies" --loads ${LOADS:-50x1024,200x128} \
      $route $tp --json $W/interf/interf_$v.json > $W/interf/interf_$v.log 2>&1
    echo "transfer_process=$v rc=$? $(( $(date +%s) - t0 )) s" >> $W/s17.out
    grep "^interference\|^  built-in\|Error\|rror:" $W/interf/interf_$v.log | tail -6 >> $W/s17.out
  done
  cp $W/s17.out $W/s17_summary.txt
}

# Session 17, issue 28's link goal (two GPUs, unpaced: the whole path at least 0.8x a plain copy at 8K
# tokens and above). First the byte-exact GPU tests of the device path this branch changed (softio's
# table of shared ranges: the cross-GPU rig, the copy-engine route, softio's own device tests; bounded
# by GPUTEST_S), then `gpu_bench.py --parts link`, decode on GPU 1, MLA page 64 and GQA page 16 at 8K
# and 32K tokens, this tree in-process (`new_in`) and through the transfer process (`new_tp`), and
# main's backend under the same rig (`base_in`, `base_tp`: --backend-root .gpu/cand/python, skipped
# where absent), alternating, each run bounded by LINK_RUN_S and started only while the plan's
# LINK_BUDGET_S (tests included) leaves room for it (a run cut by its timeout keeps the points it
# measured). One compact line per point (link_summary.py) on stdout and in
# link_summary.txt; the JSONs and logs travel in the archive.
s17_link() {
  PLAN_JSONS="$W/link_summary.txt"
  mkdir -p $W/link
  local start=$SECONDS run=${LINK_RUN_S:-70} budget=${LINK_BUDGET_S:-390}
  SGLANG_MORI_GPU_TESTS=1 timeout -k 10 ${GPUTEST_S:-120} python3 -m pytest -q -x -p no:cacheprovider \
    "$ROOT/test/gpu/test_two_gpus.py" "$ROOT/test/gpu/test_copy_engine_route.py" "$ROOT/test/gpu/test_softio_device_path.py" \
    > $W/gputest.out 2>&1
  echo "gpu tests: rc $? at $(( SECONDS - start )) s: $(tail -1 $W/gputest.out)" >> $W/link.out
  local runs="new_in base_in new_tp base_tp new_in2 base_in2"
  for v in $runs; do
    local backend="" tp=""
    case $v in base*) [ -d "$ROOT/cand/python" ] || continue; backend="--backend-root $ROOT/cand/python";; esac
    case $v in *_tp*) tp=--transfer-process;; esac
    if [ $(( SECONDS - start + run + 10 )) -gt $budget ]; then echo "$v skipped at $(( SECONDS - start )) s" >> $W/link.out; continue; fi
    timeout -s INT -k 10 $run python3 "$ROOT/scripts/gpu_bench.py" --parts link --decode-device 1 --shapes mla:64,gqa:16 \
      --link-tokens 8192,32768 --iters 6 $tp $backend --json $W/link/$v.json > $W/link/$v.log 2>&1
    echo "$v: rc $? at $(( SECONDS - start )) s" >> $W/link.out
  done
  python3 "$S/link_summary.py" $W/link/*.json > $W/link_summary.txt 2>&1
  tail -1 $W/gputest.out >> $W/link_summary.txt
  cat $W/link_summary.txt
}

# Session 19, issue 28 on one GPU: the interference run of s17_interf with decode's session 17-18
# changes (the decode step loop's goal), then, on that host's CPU, `bench hotpath` of both sides at
# 1K and 8K for both shapes, decode read by its thread and by SGLang-style polls, two rounds each
# (decode's 100 us goal), each bounded by HOT_S. JSON lines in hot_s19.jsonl.
s19_gpu1() {
  s17_interf
  mkdir -p $W/hot
  local cases=mla61p64:1024,mla61p64:8192,gqa32p16:1024,gqa32p16:8192
  for r in 1 2; do
    for polls in "" --decode-polls; do
      timeout -k 5 ${HOT_S:-60} python3 "$ROOT/scripts/bench_backend.py" hotpath --engine instant --requests 96 --json \
        --cases $cases $polls >> $W/hot/hot_s19.jsonl 2>> $W/hot/hot_s19.err
      echo "hotpath round $r ${polls:-thread-reads}: rc $?" >> $W/s17.out
    done
  done
  cp $W/hot/hot_s19.jsonl $W/s17_summary.txt $W/
  PLAN_JSONS="$W/s17_summary.txt $W/hot_s19.jsonl"
}

# Session 19, issue 28's link goal on two GPUs: s17_link's GPU tests, then the link part for the runs
# in RUNS (space-separated; default below), each `NAME` one of new_*/base_* (base: .gpu/cand/python,
# skipped where absent), `*_tp*` through the transfer process, `*_inl*` with SGLANG_MORI_INLINE_POST=on
# (in-process: the scheduler's thread posts when nothing waits). Bounded as s17_link (LINK_RUN_S,
# LINK_BUDGET_S, GPUTEST_S); summary lines in link_summary.txt.
s19_link() {
  PLAN_JSONS="$W/link_summary.txt $W/gather_sweep.json"
  mkdir -p $W/link
  local start=$SECONDS run=${LINK_RUN_S:-70} budget=${LINK_BUDGET_S:-480}
  if [ "${GPUTEST_S:-120}" -gt 0 ]; then
    # GPUTESTS: the test files (names under test/gpu), default all four
    local files="" f
    for f in ${GPUTESTS:-test_gather_kernel test_two_gpus test_copy_engine_route test_softio_device_path}; do
      files="$files $ROOT/test/gpu/$f.py"
    done
    SGLANG_MORI_GPU_TESTS=1 timeout -k 10 ${GPUTEST_S:-120} python3 -m pytest -q -x -p no:cacheprovider $files \
      > $W/gputest.out 2>&1
    echo "gpu tests: rc $? at $(( SECONDS - start )) s: $(tail -1 $W/gputest.out)" >> $W/link.out
  fi
  # Session 22: the gather-kernel sweep (test/gpu/gather_sweep.py; SWEEP_S, 0: none); its best
  # candidate's SGLANG_MORI_SOFTIO_GATHER_* settings go to the `new` runs only (base keeps its own)
  local new_env=""
  if [ "${SWEEP_S:-0}" -gt 0 ]; then
    timeout -k 10 $SWEEP_S python3 "$ROOT/test/gpu/gather_sweep.py" --env-out $W/gather_best.env \
      --json $W/gather_sweep.json > $W/sweep.out 2>&1
    echo "gather sweep: rc $? at $(( SECONDS - start )) s: $(tail -1 $W/sweep.out)" >> $W/link.out
    [ -s $W/gather_best.env ] && new_env=$(cat $W/gather_best.env)
    echo "new runs with: ${new_env:-the defaults}" >> $W/link.out
  fi
  for v in ${RUNS:-new_in base_in new_inl new_tp base_tp new_in2 base_in2 new_inl2}; do
    local backend="" tp="" inline=auto
    case $v in base*) [ -d "$ROOT/cand/python" ] || continue; backend="--backend-root $ROOT/cand/python";; esac
    case $v in *_tp*) tp=--transfer-process;; esac
    case $v in *_inl*) inline=on;; esac
    if [ $(( SECONDS - start + run + 10 )) -gt $budget ]; then echo "$v skipped at $(( SECONDS - start )) s" >> $W/link.out; continue; fi
    local extra=""
    case $v in new*) extra=$new_env;; esac
    env $extra SGLANG_MORI_INLINE_POST=$inline timeout -s INT -k 10 $run python3 "$ROOT/scripts/gpu_bench.py" --parts link --decode-device 1 \
      --shapes ${LINK_SHAPES:-mla:64,gqa:16} --link-tokens ${LINK_TOKENS:-8192,32768} --iters ${LINK_ITERS:-6} $tp $backend \
      --json $W/link/$v.json > $W/link/$v.log 2>&1
    echo "$v: rc $? at $(( SECONDS - start )) s" >> $W/link.out
  done
  python3 "$S/link_summary.py" $W/link/*.json > $W/link_summary.txt 2>&1
  [ -f $W/gputest.out ] && tail -1 $W/gputest.out >> $W/link_summary.txt
  cat $W/link_summary.txt
}

# Session 20, issue 28 on ONE GPU: the transfer process (SGLANG_MORI_TRANSFER_PROCESS=on on the
# prefill server) inside real SGLang servers, prefill and decode on GPU 0 (--gpus 1). In order of
# what it decides, each step bounded by its own timeout and by what is left of S20_BUDGET_S (default
# 420 s; a step that cannot get its minimum is skipped, by name, in s20.out):
#  1. identity (S20_ID_S, 240 s): pd_tp first (the transfer process; with the KV byte check, which
#     needs no reference), then standalone (the token reference), concurrency 1 and 16; pd_tp fails
#     by name unless the prefill log shows the child accepted, proven and carrying rooms to Success
#     (tproc_check.py);
#  2. latency (S20_LAT_S, 230 s): pd_off_tproc then pd_off (in-process), 1K and 8K prompts,
#     concurrency 1, S20_REQ requests each (8), Llama-3-8B widths, dummy weights;
#  3. identity (S20_PD_S, 150 s): pd (in-process) against step 1's standalone, KV byte check.
# Expected on an H200 (sessions 13-19's start-ups: ~50 s a prefill, ~40 s a decode started after it
# on the same GPU, ~80 s the first standalone): ~230 + ~230 + ~120 s; the default budget runs steps 1
# and 2 (step 3, proven in sessions 10-19, needs S20_BUDGET_S=560 or a second call). Each step's JSON
# is copied into $OUT as it ends (a cut call keeps what finished).
# BUDGET START OUT NAME MIN_S MAX_S COMMAND...: run COMMAND under min(MAX_S, what is left of BUDGET
# seconds since START), or skip it by name when that is under MIN_S; its rc and time go to OUT.
budget_step() {
  local budget=$1 start=$2 out=$3 name=$4 min=$5 max=$6; shift 6
  local left=$(( budget - (SECONDS - start) ))
  local limit=$(( left < max ? left : max ))
  if [ $limit -lt $min ]; then echo "$name: skipped at $(( SECONDS - start )) s (${left} s left)" >> $out; return; fi
  local t0=$SECONDS
  timeout -s INT -k 25 $limit "$@"
  echo "$name: rc $? in $(( SECONDS - t0 )) s (limit $limit s)" >> $out
}

s20_step() { budget_step ${S20_BUDGET_S:-420} $S20_START $W/s20.out "$@"; }  # NAME MIN_S MAX_S COMMAND...

# Knobs for a shorter call: S20_STEPS (default "identity_tp latency_tp identity_pd"), S20_REF (a
# pd_identity JSON whose standalone phase is the token reference, e.g. a stored one under docs/data:
# then step 1 runs no standalone and step 3 compares with it too), S20_MAXTOK (--max-total-tokens of
# the latency servers: a smaller decode pool starts faster), S20_PROMPTS, S20_REQ, S20_*_S.
s20_tpsg() {
  S20_START=$SECONDS
  PLAN_JSONS="$W/s20.out $W/*/*.json"
  local steps=" ${S20_STEPS:-identity_tp latency_tp identity_pd} "
  local P="python3 $S/pd_identity.py --model /tmp/gpu-llama --deterministic --gpus 1 --gpu-base 0 --prompts ${S20_PROMPTS:-64}"
  local ref1="" phases1=${S20_ID_PHASES:-pd_tp,standalone}
  if [ -n "${S20_REF:-}" ]; then ref1="--reference $S20_REF"; phases1=${S20_ID_PHASES:-pd_tp}; fi
  [[ $steps == *" identity_tp "* ]] && s20_step identity_tp 150 ${S20_ID_S:-240} $P --out $W/id --phases $phases1 $ref1 \
    --kv-hash $W/kv_id --tag identity_tp_1gpu --port-base 14000 > $W/id.out 2>&1
  cp $W/id/*.json "$OUT/" 2>/dev/null
  [[ $steps == *" latency_tp "* ]] && s20_step latency_tp 120 ${S20_LAT_S:-230} python3 "$S/pd_latency.py" --out $W/lat \
    --configs ${S20_LAT_CONFIGS:-pd_off_tproc,pd_off} --gpus 1 --gpu-base 0 --mem 0.3 --lengths 1024,8192 --concurrency 1 \
    --requests-c1 ${S20_REQ:-8} ${S20_MAXTOK:+--max-total-tokens $S20_MAXTOK} --tag latency_tp_1gpu --port-base 15000 > $W/lat.out 2>&1
  cp $W/lat/*.json "$OUT/" 2>/dev/null
  # against S20_REF, else step 1's standalone where it wrote one, else its own, first
  local ref="--phases standalone,pd"
  if [ -n "${S20_REF:-}" ]; then ref="--phases pd --reference $S20_REF"
  elif grep -q '"standalone"' $W/id/identity_tp_1gpu.json 2>/dev/null; then ref="--phases pd --reference $W/id/identity_tp_1gpu.json"; fi
  [[ $steps == *" identity_pd "* ]] && s20_step identity_pd 100 ${S20_PD_S:-150} $P --out $W/pd $ref --kv-hash $W/kv_pd \
    --tag identity_pd_1gpu --port-base 16000 > $W/pd.out 2>&1
  cp $W/pd/*.json "$OUT/" 2>/dev/null
  for f in $W/id/logs/*prefill*.log $W/lat/logs/*prefill*.log $W/pd/logs/*prefill*.log; do
    [ -f "$f" ] && echo "$(basename $f): $(grep -h -o 'serves control port\|registered and proven\|first room reached Success\|TRANSFER_PROCESS=on refused: .*\|Scheduler hit an exception\|chunk not handed over' "$f" | sort | uniq -c | tr -s ' \n' ' ')" >> $W/s20.out
  done
  grep -h "KV bytes\|transfer process:\|FAILED\|tok_c1: \|identical" $W/*.out | cut -c1-400 >> $W/s20.out 2>/dev/null
  cat $W/s20.out
}

# Session 21, issue 28's prefill goal on TWO GPUs: the transfer process inside real SGLang with an MLA
# pool and with prefill TP 2 (two children, one per rank). In order of what it decides, each step bounded
# by its own timeout and by what is left of S21_BUDGET_S (default 460 s; a step that cannot get its
# minimum is skipped, by name, in s21.out); every step's JSON is copied into $OUT as it ends:
#  1. mla (S21_MLA_S, 130 s): the random-weight DeepSeek-MLA model, prefill GPU 0 -> decode GPU 1, phase
#     pd_tp (S21_MLA_PHASES), 64 prompts at concurrency 1 and 16, the KV byte check (kv_hash.py hashes the
#     MLA latent), against the stored MLA standalone (S21_MLA_REF: digest 5d14a34a5bad2b50 in sessions 12,
#     15 and 21); with S21_MLA_PHASES=pd_tp,pd also against this call's pd (--compare-phase pd);
#  2. tp2 (S21_TP2_S, 180 s): the Llama GQA model, prefill TP 2 on GPUs 0,1 -> decode TP 1 on GPU 0
#     (started after the prefill, the shared fraction), phase pd_tp (S21_TP2_PHASES), KV byte check; TP 2
#     and TP 1 differ by bf16 arithmetic (session 15), so the reference is PD at TP 2: the stored session
#     15 pd (S21_TP2_REF, digest 8daf1f45244cf40d, --reference-phase pd), and this call's pd with
#     S21_TP2_PHASES=pd_tp,pd; pd_tp needs both ranks' children accepted, proven and carrying rooms
#     (tproc_check.py, ranks 2);
#  3. load (S21_LOAD_S, 200 s): pd_off_tproc then pd_off at concurrency S21_CONC (16), 1K prompts, prefill
#     GPU 0 -> decode GPU 1, Llama-3-8B widths (pd_latency.py), each measured twice (S21_LOAD_REPEATS): on a
#     fresh machine the first config's first c16 measurement compiled 33 Triton kernels (session 21), so
#     read `1024tok_c16_repeat1`.
# Measured (session 21's call, 2x H200): the first server of a call spends ~30 s more in its prefill
# graph capture (Triton's cold JIT); an MLA pd_tp phase ~100 s, a pd phase ~65 s; a TP 2 phase with decode
# started after its prefill ~150 s (prefill ~48 s, decode ~60 s, prompts ~10 s, stop ~15-20 s). The
# in-call pd phases therefore do not fit beside the rest in one 540 s call (the first call, with them,
# cut both); by default they are left to the stored references, which pd_tp matched digest for digest.
# s21.out: every step's rc, each prefill log's transfer-process lines (accepted, proven, first Success,
# refusals, the child's "start-up used N ms of CPU", IPC-handle warnings), the identity lines, the KV
# byte checks and the servers' ready times.
s21_step() { budget_step ${S21_BUDGET_S:-460} $S21_START $W/s21.out "$@"; }  # NAME MIN_S MAX_S COMMAND...

s21_logs() {  # what each prefill log says of the transfer process, one line per log (into LOGS_OUT, default s21.out)
  local f
  for f in "$@"; do
    [ -f "$f" ] || continue
    echo "$(basename $(dirname $(dirname $f)))/$(basename $f): $(grep -h -o 'serves control port\|registered and proven\|first room reached Success\|TRANSFER_PROCESS=on refused: .*\|Scheduler hit an exception\|chunk not handed over\|registered without an IPC handle\|could not start: .*' "$f" | sort | uniq -c | tr -s ' \n' ' ')" >> ${LOGS_OUT:-$W/s21.out}
    grep -h -o 'transfer process pid [0-9]*: engine .*start-up used [0-9]* ms of CPU' "$f" | sed 's/: engine .*start-up used/: start-up used/' >> ${LOGS_OUT:-$W/s21.out}
  done
}

s21_tpsg() {
  S21_START=$SECONDS
  PLAN_JSONS="$W/s21.out $W/*/*.json"
  local steps=" ${S21_STEPS:-mla tp2 load} "
  local P="python3 $S/pd_identity.py --deterministic --prompts ${S21_PROMPTS:-64} --concurrency 1,16"
  if [[ $steps == *" mla "* ]]; then
    s21_step mla 90 ${S21_MLA_S:-130} $P --model /tmp/gpu-mla --out $W/mla --gpus 2 --gpu-base 0 --phases ${S21_MLA_PHASES:-pd_tp} \
      --reference "${S21_MLA_REF:-docs/data/gpu_sglang_identity_mla_2gpu_h200x4.json}" --compare-phase pd \
      --kv-hash $W/kv_mla --tag identity_mla_tproc --port-base 14000 > $W/mla.out 2>&1
    cp $W/mla/*.json "$OUT/" 2>/dev/null
  fi
  if [[ $steps == *" tp2 "* ]]; then
    s21_step tp2 150 ${S21_TP2_S:-180} $P --model /tmp/gpu-llama --out $W/tp2 --gpus 2 --gpu-base 0 --prefill-tp 2 --decode-gpu 0 \
      --phases ${S21_TP2_PHASES:-pd_tp} --reference "${S21_TP2_REF:-docs/data/gpu_sglang_identity_tp2_kvhash_h200x4.json}" \
      --reference-phase pd --compare-phase pd --kv-hash $W/kv_tp2 --tag identity_tp2_tproc --port-base 15000 > $W/tp2.out 2>&1
    cp $W/tp2/*.json "$OUT/" 2>/dev/null
  fi
  [[ $steps == *" load "* ]] && s21_step load 120 ${S21_LOAD_S:-200} python3 "$S/pd_latency.py" --out $W/load \
    --configs ${S21_LOAD_CONFIGS:-pd_off_tproc,pd_off} --gpus 2 --gpu-base 0 --lengths 1024 --concurrency ${S21_CONC:-16} \
    --requests-per-conc ${S21_REQ_PER_CONC:-4} --repeats ${S21_LOAD_REPEATS:-2} --max-total-tokens ${S21_MAXTOK:-131072} --tag load_tproc --port-base 16000 \
    > $W/load.out 2>&1
  cp $W/load/*.json "$OUT/" 2>/dev/null
  s21_logs $W/mla/logs/*prefill*.log $W/tp2/logs/*prefill*.log $W/load/logs/*prefill*.log
  local f
  for f in $W/mla.out $W/tp2.out $W/load.out; do
    [ -f "$f" ] && grep -h "KV bytes\|transfer process:\|FAILED\|tok_c[0-9]*: \|\] c[0-9]*: digest\|ready_s" "$f" \
      | sed "s|^|$(basename $f .out) |" | cut -c1-400 >> $W/s21.out
  done
  cat $W/s21.out
}

# Session 22, issue 28's goals counted INSIDE real SGLang (2 GPUs): our Python per request on the prefill
# and the decode scheduler processes (SGLANG_MORI_CALL_METER, python/sglang_mori/call_meter.py: SGLang's
# calls into our manager, sender and receiver timed on the calling thread, plus our threads' CPU), under
# load, chunk-wise, prefill GPU 0 -> decode GPU 1, the 8-layer Llama-3-8B-widths model (dummy weights):
# pd_latency.py --call-meter, one invocation per config in S22_CONFIGS (default the transfer process, then
# in-process), each bounded by S22_CONFIG_S (220 s) and by what is left of S22_BUDGET_S (450 s; a config
# that cannot get S22_MIN_S (150 s) is skipped by name in s22.out). Prompts of S22_LENGTHS (1K and 8K) at
# concurrency S22_CONC (1 and 16; S22_REQ_PER_CONC x 16 requests at c16, S22_REQ_C1 at c1), each shape
# measured twice (--repeats 2) after a warm-up at the shape's full concurrency (--full-warmup: the batch-16
# kernels compile there, not in the measurement; session 21's first config compiled 33 during it). The
# *_tproc config fails by name unless the prefill log shows the child accepted, proven and serving
# (tproc_check.py). s22.out: every config's rc, the transfer-process log lines, and meter_summary.py's
# table (TTFT p50/p90, ITL p50, tok/s, prefill and decode us/request = calls + threads, the largest parts).
# S22_MODEL=/tmp/gpu-mla (run_plan builds it) measures the random-weight DeepSeek-MLA model instead (dummy
# weights; a second call: both models do not fit one).
# Expected on 2x H200 (session 21): ~90 s start (+30 s of Triton JIT for the call's first), ~60 s of
# measurements, ~20 s stop a config: about 180 + 150 s after ~40 s of install and models.
s22_step() { budget_step ${S22_BUDGET_S:-450} $S22_START $W/s22.out "$@"; }  # NAME MIN_S MAX_S COMMAND...

s22_meter() {
  S22_START=$SECONDS
  PLAN_JSONS="$W/s22.out $W/load/*.json"
  local port=16000 c
  for c in ${S22_CONFIGS:-pd_off_tproc pd_off}; do
    s22_step $c ${S22_MIN_S:-150} ${S22_CONFIG_S:-220} python3 "$S/pd_latency.py" --out $W/load --configs $c --gpus 2 \
      --gpu-base 0 --lengths ${S22_LENGTHS:-1024,8192} --concurrency ${S22_CONC:-1,16} --requests-c1 ${S22_REQ_C1:-8} \
      --requests-per-conc ${S22_REQ_PER_CONC:-4} --repeats 2 --full-warmup --call-meter ${S22_MODEL:+--model-dir $S22_MODEL} \
      --max-total-tokens ${S22_MAXTOK:-262144} --tag meter_$c --port-base $port > $W/load_$c.out 2>&1
    cp $W/load/meter_$c.json "$OUT/" 2>/dev/null
    port=$(( port + 1000 ))
  done
  LOGS_OUT=$W/s22.out s21_logs $W/load/logs/*prefill*.log
  grep -h "transfer process:\|FAILED\|Traceback\|Error" $W/load_*.out | cut -c1-400 >> $W/s22.out 2>/dev/null
  python3 "$S/meter_summary.py" $W/load/meter_*.json >> $W/s22.out 2>&1
  cat $W/s22.out
}
