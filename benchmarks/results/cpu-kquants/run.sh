#!/bin/bash
# A/B: the same bench command on the commit before (floats for K-quants) and after (codes)
. /work/main/.venv/bin/activate
for f in noisy-Q4_K_M noisy-Q5_K_M noisy-Q6_K; do
  for side in before after; do
    root=/tmp/before; [ $side = after ] && root=/work/main
    ( cd $root && PYTHONPATH=$root timeout 900 python -m heterospec bench --target /tmp/kq --gguf-file $f.gguf \
        --draft /work/main/heterospec/data/smollm2-135m-instruct-eagle3 --methods ar,hf,heterospec --profile /work/main/heterospec/data/smollm2-135m-instruct-eagle3/profile.json \
        --questions /work/main/benchmarks/data/questions --limit 2 --max-new-tokens 64 --no-plots \
        --out /tmp/kqb/$f-$side > /tmp/kqb/$f-$side.log 2>&1 )
    echo "$f $side rc=$?"
  done
done
