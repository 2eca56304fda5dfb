#!/usr/bin/env bash
# The default pair's EAGLE-3 head as one command: SmolLM2-135M-Instruct's own answers (committed, as token ids,
# in benchmarks/answers/smollm2-135m-instruct), their features by one teacher-forced forward (cached outside the
# repository), training warm-started from the shipped head.  Every part resumes after a stop: run it again.
#
#   bash benchmarks/head_recipe.sh collect   # answer more of the committed prompt list (PROMPTS, default: all)
#   bash benchmarks/head_recipe.sh train     # train on every answered shard (or the first PROMPTS prompts)
#   bash benchmarks/head_recipe.sh           # both
#
# Settings (environment): DEVICE (cpu | cuda), PROMPTS (use the first N prompts of the list), EPOCHS (2),
# GEN_BATCH (prompts answered at once: 64 on a CPU, 256 on a GPU), BATCH (sequences per step: 8 on a CPU, 32 on
# a GPU; LR scales with it), OUT (the head; default head-recipe/out), FEATURES (the feature cache), INIT (the head
# to warm-start from: default = the shipped head; a head of an earlier commit to reproduce a shipped one).  Extra
# arguments go to `heterospec train-draft` as they are.  The answers are generated in bfloat16 (1.46x on our
# 2-core AVX512-BF16 CPU, 98.9 % of positions equal to the float32 greedy token: benchmarks/bench_training.py);
# features and the loss are float32, the head's forward under bfloat16 autocast (1.49x).  Run one torch job at a
# time on a small CPU: two at once fight over the cores and each runs several times slower.
set -euo pipefail
cd "$(dirname "$0")/.."
what=all
case "${1:-}" in collect|train|all) what=$1; shift ;; esac

DEVICE=${DEVICE:-cpu}
if [[ $DEVICE == cuda* ]]; then gen=256 batch=32; else gen=64 batch=8; fi
GEN_BATCH=${GEN_BATCH:-$gen}
BATCH=${BATCH:-$batch}
OUT=${OUT:-head-recipe/out}
ANSWERS=${ANSWERS:-benchmarks/answers/smollm2-135m-instruct}
LR=${LR:-$(python3 -c "print(5e-4 * ($BATCH / 8) ** 0.5)")}
common=(--target default --device "$DEVICE" --dtype float32 --answer-dtype bfloat16 --answers "$ANSWERS"
        --max-new-tokens 256 --shard-size 256 --gen-batch-size "$GEN_BATCH" --out "$OUT")
[[ -n ${PROMPTS:-} ]] && common+=(--max-prompts "$PROMPTS")
[[ -n ${FEATURES:-} ]] && common+=(--features "$FEATURES")
mkdir -p "$(dirname "$OUT")"

if [[ $what == collect || $what == all ]]; then
  python3 -m heterospec train-draft "${common[@]}" --collect-only "$@"
fi
if [[ $what == train || $what == all ]]; then
  # only the answered shards are trained on; --resume continues a stopped run from its last checkpoint
  python3 -m heterospec train-draft "${common[@]}" --init-head "${INIT:-default}" --ttt-steps 7 --epochs "${EPOCHS:-2}" \
    --batch-size "$BATCH" --lr "$LR" --autocast bfloat16 --val-fraction 0.02 --eval-every 200 --patience 5 \
    --save-every 100 --resume "$@"
fi
