#!/usr/bin/env bash
# GPU check: real-size GLM-Image (random weights) through grpo_glm on one GPU, every case of issue 39 item 8.
# Each case is its own process under its own `timeout`. The limits come from one budget (the sum of the set's
# shares): a case may use its share plus whatever the cases before it left unused, never more, so the limits
# sum to at most the budget. Results: $OUT/<case>.json (phases, written as they finish: a cut case still reports),
# the log on stdout (the caller tees it to $OUT/log.txt), a summary table at the end (.ci/gpu/summary.py).
#   OUT=/tmp/o SMALL=1 bash .ci/gpu/cases.sh                 # the CPU dry run (toy widths)
#   ONLY="ar512 dit512" bash .ci/gpu/cases.sh                 # a subset
cd "$(dirname "$0")/../.." || exit 1  # the repo root
P=.ci/gpu
OUT=${OUT:-/tmp/gpuout}
mkdir -p "$OUT" /tmp/r
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor_cache}  # shared: a later case's same graph hits
date -u +"%F %T UTC"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
python3 -c "
import importlib.metadata as m, sys
print('python', sys.version.split()[0], *[f'{p} {m.version(p)}' for p in ('torch', 'transformers', 'diffusers', 'peft',
      'tokenizers', 'huggingface_hub', 'safetensors', 'accelerate')])"
echo "grpo_glm.py: $(wc -l < grpo_glm.py) lines, $(git log -1 --format='%h %s' 2>/dev/null | cut -c1-90)"

T2I=$P/t2i_var.txt  # two prompts of different lengths: a run must not recompile for the second
common="--model zai-org/GLM-Image --sample-every 0 --save-every 1000 --prompts-per-step 1 --gradient-checkpointing"
LORA="--lora-rank 64"   # the AR's: not with --policy dit (grpo_glm refuses it)
# name | limit s | real_size.py's decode_backend ('' grpo_glm's CUDA graph of eager kernels, 'none' eager,
# 'inductor' compiled then captured, 'dit-compiled' the frozen DiT's blocks compiled) | flags. SET=A or SET=B picks a list (two calls: B can follow A).
# A: every policy of issue 39 item 8, each one step. B: what A leaves open (inductor kernels in the decode graph or
# none, a compiled frozen DiT: step 2 against A's ar1024).
A=(
  "ar512|60||--prompts $T2I --group-size 4 --height 512 --width 512 --steps 2 $LORA --num-inference-steps 10"
  "ar1024|100||--prompts $T2I --group-size 8 --height 1024 --width 1024 --steps 1 $LORA --num-inference-steps 10"
  "dit512|65||--prompts $T2I --group-size 4 --height 512 --width 512 --steps 1 --policy dit --dit-lora-rank 64 --num-inference-steps 10 --inner-epochs 1"
  "both512|70||--prompts $T2I --group-size 4 --height 512 --width 512 --steps 1 $LORA --policy both --dit-lora-rank 64 --num-inference-steps 10 --inner-epochs 1"
  "i2i512|60||--prompts $P/edit512.txt --mode i2i --group-size 4 --height 512 --width 512 --steps 1 $LORA --num-inference-steps 10"
  "offload512|105||--prompts $T2I --group-size 4 --height 512 --width 512 --steps 1 --offload $LORA --num-inference-steps 10"
)
B=(
  "ar512ind|150|inductor|--prompts $T2I --group-size 4 --height 512 --width 512 --steps 2 $LORA --num-inference-steps 10"
  "ar512eager|60|none|--prompts $T2I --group-size 4 --height 512 --width 512 --steps 1 $LORA --num-inference-steps 10 --disable-cuda-graph"
  "ar1024dc|120|dit-compiled|--prompts $T2I --group-size 8 --height 1024 --width 1024 --steps 2 $LORA --num-inference-steps 10"
)
if [ "$SET" = B ]; then CASES=("${B[@]}"); else CASES=("${A[@]}"); fi
t_all=$SECONDS
budget=0
for c in "${CASES[@]}"; do IFS='|' read -r _ share _ <<<"$c"; budget=$((budget + share)); done
spare=0   # what the cases before left of their limits
for c in "${CASES[@]}"; do
  IFS='|' read -r name share backend flags <<<"$c"
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then continue; fi
  limit=$((share + spare))
  [ "$SMALL" = 1 ] && limit=$((3 * share))   # 2 shared CPU cores
  # SMALL (the CPU dry run): the same flags, then smaller images and fewer DiT steps and passes (the last flag wins);
  # i2i stays 512^2, the real processor's least source size
  [ "$SMALL" = 1 ] && flags="$flags --device cpu --dtype float32 --num-inference-steps 2 --inner-epochs 1" &&
    [ "$name" != i2i512 ] && flags="$flags ${SMALL_SIZE:---height 256 --width 256}"
  echo
  echo "== $name: limit ${limit} s ($(date -u +%T)): $flags"
  rm -rf "/tmp/r/$name"
  t0=$SECONDS
  # -k 5: SIGTERM first (grpo_glm stops at the step's update), SIGKILL 5 s later
  DECODE_BACKEND=$backend CASE_LIMIT=$limit timeout -k 5 "$limit" python3 $P/real_size.py "$name" "$OUT" $common $flags \
    --out "/tmp/r/$name" 2>&1 | grep --line-buffered -v "kept in float32"
  rc=${PIPESTATUS[0]}
  python3 $P/summary.py --mark "$OUT" "$name" "$rc" "$((SECONDS - t0))" "$limit"
  echo "== $name: rc $rc, $((SECONDS - t0)) s of ${limit}"
  spare=$((limit - (SECONDS - t0))); [ $spare -lt 0 ] && spare=0
done
echo
echo "== all cases: $((SECONDS - t_all)) s of budget $budget"
nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null
python3 $P/summary.py "$OUT"
