#!/bin/bash
# A/B, alternated on the idle machine: the same bench command on the commit before Q5 (a clone of
# 57242f9 at /tmp/base, built there) and after (/work/main). The GGUF files are ../cpu-kquants/make_files.sh's (in
# /tmp/kq); the packing times are ../codes-search/packtime.py's.
. /work/main/.venv/bin/activate
for f in noisy-Q5_K_M; do
  for side in before after before2 after2; do
    root=/tmp/base; [ ${side%2} = after ] && root=/work/main
    ( cd $root && PYTHONPATH=$root timeout 900 python -m heterospec bench --target /tmp/kq --gguf-file $f.gguf \
        --draft /work/main/heterospec/data/smollm2-135m-instruct-eagle3 --methods ar,hf,heterospec \
        --profile /work/main/heterospec/data/smollm2-135m-instruct-eagle3/profile.json \
        --questions /work/main/benchmarks/data/questions --limit 2 --max-new-tokens 64 --no-plots \
        --out /tmp/q5b/$f-$side > /tmp/q5b/$f-$side.log 2>&1 )
    echo "$f $side rc=$?"
  done
done
