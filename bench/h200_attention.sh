#!/usr/bin/env bash
# The H200 runs behind issue 19's acceptance: the short-query attention kernel (plugin/cuda/cuda_attention.py)
# wired into decoding through the dispatcher (plugin/cuda/attention.py), on and off (results: docs/benchmarks.md).
#
# Run from the repo root on the GPU machine with MLX-CUDA staged (../shared/gpu/prepare-mlx-cuda.sh puts it
# in $SITE, default /tmp/site). Each line below is meant as one device call (<= 10 minutes; not timed yet:
# where one runs out, give it fewer prompt lengths). Usage:
#   bash bench/h200_attention.sh check               # the kernel against MLX's SDPA (bench/gpu_attention_check.py)
#   bash bench/h200_attention.sh forwards            # bare forwards by positions 1..32 at 4k/16k keys, kernel on/off,
#                                                    #   padded cache (the plugin's) and KVCache; DFlash-shape block
#   bash bench/h200_attention.sh forwards-4bit       # the same with the target quantized (4 bits, group 64)
#   bash bench/h200_attention.sh e2e on 1            # mlx-spec bench, prompts near 512,2048,8192,16384 in one process
#   bash bench/h200_attention.sh e2e off 1           #   (oracle tau 6.5 and tau 1 adaptive, block 16, 256 new tokens),
#                                                    #   kernel on / off, run 1; then runs 2 and 3 (median of 3)
#   bash bench/h200_attention.sh e2e on 1 512,2048   # other prompt lengths (if a call would run out of time)
#   bash bench/h200_attention.sh e2e-4bit on         # the bench with the 4-bit target (prompts near 2048,8192), then off
#   bash bench/h200_attention.sh e2e-kvcache on 1    # the bench with mlx-lm's caches instead of the padded ones (the
#                                                    #   routed policy: the kernel at every key length), against e2e
#   bash bench/h200_attention.sh profile             # the DFlash block's parts against what its bytes cost to read
#                                                    #   (bench/dflash_block_profile.py, KVCache and padded context)
#   bash bench/h200_attention.sh profile-plugin      # the same with the drafter as the plugin runs it (compiled calls,
#                                                    #   the attention and projection kernels, padded context)
#   bash bench/h200_attention.sh trace 16384         # the bench's DFlash rounds phase by phase, fresh and warm
#                                                    #   (bench/round_trace.py; other base prompt lengths: 2048,16384)
#   bash bench/h200_attention.sh probe 2048,8192     # the round's steps timed, verifying ahead or not (bench/verify_ahead_probe.py;
#                                                    # MLX_MAX_OPS_PER_BUFFER / MLX_MAX_MB_PER_BUFFER pass through; BITS=4)
#   bash bench/h200_attention.sh probe-sweep 2048    # the probe at MLX's default task sizes, MB 20000 / ops 500, and 4-bit
#   bash bench/h200_attention.sh context             # the DFlash drafter's first context (a prompt's features), fresh
#                                                    #   and warm (bench/context_build_cost.py; CHUNK=512,2048 TOUCH=0:
#                                                    #   the longest append 512 then 2048, each at new lengths)
#   bash bench/h200_attention.sh matmul              # the projection kernel against MLX's matmul (bench/gpu_matmul_check.py)
#   bash bench/h200_attention.sh host-split          # build / encode / device per forward, MLX's matmuls and the
#                                                    #   projection kernel in one process (bench/host_split.py)
#   bash bench/h200_attention.sh host-split-compiled # the target's forwards plain and compiled (plugin/cuda/compiled.py)
#   bash bench/h200_attention.sh host-split-dflash   # the DFlash round alone, plain and compiled (TAG=-x: ...-x.json;
#                                                    #   MOST=10,4,1: a row per bound on the weights of one launch;
#                                                    #   compiled staged and as one graph: STAGED=on|off|both)
#   bash bench/h200_attention.sh ncu [--keys 4096]  # each kernel of the target's 1- and 16-position forwards and the
#                                                    #   DFlash round, by Nsight Compute (bench/forward_kernels.py);
#                                                    #   ncu --shapes --variants '1,8,1;2,8,2': each projection alone
#   bash bench/h200_attention.sh cache-write         # K/V writes at a device-scalar offset (bench/cache_write_cost.py)
#   bash bench/h200_attention.sh qmatmul             # MLX's 4-bit matmul by rows against its bytes (bench/quantized_matmul_cost.py)
#   VARIANTS='2,8,2;1,8,1,1' bash bench/h200_attention.sh matmul-variants  # the projection kernel's chains in these
#                                                    #   shapes (G,S,U[,P]; P 1: its loads pipelined; CHAINS=lm_head,fc:
#                                                    #   those of gpu_matmul_check.py's CHAINS, default q/o, gate/up+down, k/v+back)
#   bash bench/h200_attention.sh qcheck              # the 4-bit projection kernel against MLX (bench/gpu_qmatmul_check.py)
#   (TAG=-x names the 4-bit, matmul and qcheck runs' JSONs ...-x.json; SWEEP=1 runs matmul / qcheck with --sweep)
#   (the 4-bit target's verify-width projections go through plugin/cuda/cuda_qmatmul.py; MLX_SPEC_QUANTIZED_KERNEL=off: MLX's)
#   (qcheck takes gpu_qmatmul_check.py's flags after it: --shapes, --rows, --dtypes, --no-skeleton; WATCHDOG=S dumps and exits)
#   (e2e runs use compiled verify forwards where MLX runs on CUDA: --compiled-forward auto; COMPILED=off turns them off;
#   WIDTHS=1,2,4,8,16,32 compiles the one-token plain steps too; PAIRED=5 repeats the paired regime 5 times, with
#   its median: each repeat decodes every method once more per prompt length; SEED=N draws other weights, prompts and
#   oracle acceptance sequences: with the default 0 every run repeats the same draws, each prompt the same tau)
#   (AHEAD= takes --draft-ahead's modes: on (the default: the next block queued ahead), verify (the block and the
#   verify over it), off; several joined by commas run each fixed-tau DFlash method once per mode in the same
#   process, e.g. AHEAD=verify,on,off; both: on,off)
#   (COST_KEYS=4096 times the bare forwards after a run at the prompts' key lengths and 4096 only, default
#   4096,8192,16384: a 4-bit run at two prompt lengths with all three runs past 280 s)
# Results go to $OUT (the device tool's output folder) or ./h200-out, named h200-attention-*.json (an e2e run's
# printed lines also to h200-attention-e2e-RUN.log, which comes back when the call runs out of time); copy them to
# bench/results/kernels/ (forwards, check) and bench/results/attention/ (e2e) and regenerate bench/README.md.
set -euo pipefail
OUT=${OUT:-h200-out}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT" /tmp/new/mlx_speculative
for d in hooks plugin drafters benchmarks testing; do ln -sfn "$PWD/$d" "/tmp/new/mlx_speculative/$d"; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
py() { env PYTHONPATH="$SITE:/tmp/new" python3 "$@"; }
py -c "import mlx.core as mx; assert mx.cuda.is_available(), 'MLX-CUDA is not staged'; print(mx.__version__, mx.device_info().get('device_name'))"

FORWARDS=(bench/attention_forwards.py --synthetic-target llama-8b --keys 4096,16384 --widths 1,2,4,8,16,32
          --block 16 --dflash-layers 5 --iters 10 --kernel both)
BENCH=(-m mlx_speculative.benchmarks --synthetic-target llama-8b --kind dflash --oracle-acceptance 6.5
       --adaptive-at 1 --block-sizes 16 --max-tokens 256 --no-mlx-lm-spec --paired "${PAIRED:-1}" --compiled-forward "${COMPILED:-auto}"
       --compiled-widths "${WIDTHS:-2,4,8,16,32}" --cost-keys "${COST_KEYS:-4096,8192,16384}" --seed "${SEED:-0}"
       --draft-ahead "${AHEAD:-on}")
what=${1:-}; shift || true
case "$what" in
  check)
    py bench/gpu_attention_check.py --out "$OUT/h200-attention-kernel-check.json" | tail -20 ;;
  forwards)
    py "${FORWARDS[@]}" --cache padded --json "$OUT/h200-attention-forwards-padded.json"
    py "${FORWARDS[@]}" --cache kvcache --block 0 --json "$OUT/h200-attention-forwards-kvcache.json" ;;
  forwards-4bit)
    py "${FORWARDS[@]}" --cache padded --quantize-target 4 --json "$OUT/h200-attention-forwards-padded-4bit${TAG:-}.json" ;;
  e2e)  # e2e on|off RUN [LENGTHS]
    k=$1; run=$2; lengths=${3:-512,2048,8192,16384}
    py "${BENCH[@]}" --prompt-lengths "$lengths" --kernel "$k" \
      --json "$OUT/h200-attention-e2e-${lengths//,/-}-kernel-$k-$run.json" | tee "$OUT/h200-attention-e2e-$run.log" | tail -30 ;;
  e2e-4bit)  # e2e-4bit on|off [LENGTHS]
    k=$1; lengths=${2:-2048,8192}
    py "${BENCH[@]}" --prompt-lengths "$lengths" --quantize-target 4 --kernel "$k" \
      --json "$OUT/h200-attention-e2e-4bit-${lengths//,/-}-kernel-$k${TAG:-}.json" | tail -30 ;;
  e2e-kvcache)  # e2e-kvcache on|off RUN [LENGTHS]
    k=$1; run=$2; lengths=${3:-512,2048,8192,16384}
    py "${BENCH[@]}" --prompt-lengths "$lengths" --kernel "$k" --padded-cache off \
      --json "$OUT/h200-attention-e2e-kvcache-${lengths//,/-}-kernel-$k-$run.json" | tail -30 ;;
  profile)
    py bench/dflash_block_profile.py --keys 4096,16384 --json "$OUT/h200-dflash-block-profile-kvcache.json" | tail -30
    py bench/dflash_block_profile.py --keys 4096,16384 --padded --kernel on --json "$OUT/h200-dflash-block-profile-padded-kernel.json" | tail -30
    py bench/dflash_block_profile.py --keys 4096,16384 --padded --json "$OUT/h200-dflash-block-profile-padded.json" | tail -30 ;;
  profile-plugin)
    py bench/dflash_block_profile.py --keys 4096,16384 --plugin --json "$OUT/h200-dflash-block-profile-plugin${TAG:-}.json" | tail -30 ;;
  trace)  # trace [LENGTHS]
    py bench/round_trace.py --prompt-lengths "${1:-16384}" --json "$OUT/h200-round-trace${TAG:-}.json" 2>&1 \
      | tee "$OUT/h200-round-trace${TAG:-}.log" | grep -v '^\[trace\]' | tail -40 ;;
  probe)  # probe [LENGTHS]: the round's steps timed with and without verifying ahead (BITS=4: the 4-bit target)
    py bench/verify_ahead_probe.py --prompt-lengths "${1:-2048,8192}" ${BITS:+--quantize-target "$BITS"} \
      --json "$OUT/h200-verify-ahead-probe${TAG:-}.json" 2>&1 | grep -v '^\[probe\]' | tail -12 ;;
  probe-sweep)  # probe-sweep [LENGTH]: the probe at MLX's default task sizes, at larger ones, and on the 4-bit target
    L=${1:-2048}
    py bench/verify_ahead_probe.py --prompt-lengths "$L" --json "$OUT/h200-verify-ahead-probe-default${TAG:-}.json" 2>&1 \
      | grep -v '^\[probe\]' | tail -4
    MLX_MAX_MB_PER_BUFFER=20000 MLX_MAX_OPS_PER_BUFFER=500 py bench/verify_ahead_probe.py --prompt-lengths "$L" \
      --json "$OUT/h200-verify-ahead-probe-mb20000-ops500${TAG:-}.json" 2>&1 | grep -v '^\[probe\]' | tail -4
    py bench/verify_ahead_probe.py --prompt-lengths "$L" --quantize-target 4 \
      --json "$OUT/h200-verify-ahead-probe-4bit${TAG:-}.json" 2>&1 | grep -v '^\[probe\]' | tail -4 ;;
  context)
    py bench/context_build_cost.py --lengths 2048,8192,16384 --touch-gib "${TOUCH:-8}" ${CHUNK:+--chunk "$CHUNK"} \
      --json "$OUT/h200-context-build${TAG:-}.json" | tail -12 ;;
  matmul)
    py bench/gpu_matmul_check.py ${SWEEP:+--sweep} --out "$OUT/h200-matmul-check${TAG:-}.json" | tail -12 ;;
  matmul-variants)  # VARIANTS='G,S,U[,P];...': the chains alone for these kernel shapes
    py bench/gpu_matmul_check.py --chains-only --sweep --variants "$VARIANTS" ${CHAINS:+--chains "$CHAINS"} \
      --out "$OUT/h200-matmul-variants${TAG:-}.json" 2>&1 | tee "$OUT/h200-matmul-variants${TAG:-}.log" | tail -8 ;;
  host-split)
    py bench/host_split.py --keys 4096,16384 --linear mlx,kernel --json "$OUT/h200-host-split-projections.json" | tail -8 ;;
  host-split-compiled)
    py bench/host_split.py --keys 4096,16384 --linear kernel --compiled both --json "$OUT/h200-host-split-compiled.json" | tail -8 ;;
  host-split-dflash)  # the DFlash round alone, plain and compiled
    py bench/host_split.py --keys 4096,16384 --linear kernel --compiled both --drafter-only ${MOST:+--max-weights "$MOST"} --staged "${STAGED:-both}" \
      --json "$OUT/h200-host-split-dflash${TAG:-}.json" | tail -8 ;;
  ncu)  # each kernel of the forwards timed by Nsight Compute, summed by group (bench/forward_kernels.py)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | tail -1)
    env PYTHONPATH="$SITE:/tmp/new" timeout "${NCU_LIMIT:-480}" "$NCU" --profile-from-start off --clock-control none \
      --cache-control none --metrics gpu__time_duration.sum --print-units base --csv --log-file "$OUT/h200-forward-kernels${TAG:-}.csv" \
      python3 bench/forward_kernels.py --windows "$OUT/h200-forward-kernels-windows${TAG:-}.json" "$@" | tail -12
    py bench/forward_kernels.py --windows "$OUT/h200-forward-kernels-windows${TAG:-}.json" \
      --summarise "$OUT/h200-forward-kernels${TAG:-}.csv" --json "$OUT/h200-forward-kernels${TAG:-}.json" | tail -${LINES_SHOWN:-12} ;;
  cache-write)
    py bench/cache_write_cost.py | tee "$OUT/h200-cache-write.txt" ;;
  qcheck)
    py bench/gpu_qmatmul_check.py ${SWEEP:+--sweep} --watchdog "${WATCHDOG:-500}" --out "$OUT/h200-qmatmul-check${TAG:-}.json" "$@" 2>&1 | tee "$OUT/h200-qmatmul-check${TAG:-}.log" | tail -40 ;;
  qmatmul)
    py bench/quantized_matmul_cost.py --skeleton --json "$OUT/h200-quantized-matmul-cost${TAG:-}.json" ;;
  *) echo "unknown: '$what' (check | forwards | forwards-4bit | e2e on|off RUN [LENGTHS] | e2e-4bit on|off [LENGTHS] | e2e-kvcache on|off RUN [LENGTHS] | profile | trace [LENGTHS] | context | matmul | matmul-variants | host-split | host-split-compiled | host-split-dflash | cache-write | qmatmul | qcheck)"; exit 2 ;;
esac
