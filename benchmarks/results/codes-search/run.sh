#!/bin/bash
# A/B, alternated processes: the decoder's whole packing (CpuDecoder(model), three times in one process) on the
# commit before the C search (a worktree at /tmp/before, built there) and after (/work/main). The GGUF files are
# those of ../cpu-kquants/make_files.sh (in /tmp/kq).
. /work/main/.venv/bin/activate
for spec in default noisy-Q4_K_M.gguf noisy-Q5_K_M.gguf noisy-Q6_K.gguf /tmp/kq/noisy; do
  for root in /tmp/before /work/main /tmp/before /work/main; do
    (cd $root && PYTHONPATH=$root python "$(dirname "$0")/packtime.py" $spec 2>&1 | grep "pack s")
  done
done

# The IQ files (llama.cpp's llama-quantize, as ../cpu-kquants/make_files.sh makes the K-quants) and their bench:
#   for t in IQ4_XS IQ4_NL IQ3_S TQ2_0; do
#     $LLAMA/build/bin/llama-quantize /tmp/kq/noisy-f32.gguf /tmp/kq/noisy-$t.gguf $t; done
#   python -m heterospec bench --target /tmp/kq --gguf-file noisy-IQ4_XS.gguf \
#     --draft heterospec/data/smollm2-135m-instruct-eagle3 --methods ar,hf,heterospec \
#     --profile heterospec/data/smollm2-135m-instruct-eagle3/profile.json --questions benchmarks/data/questions \
#     --limit 2 --max-new-tokens 64 --no-plots --out iq/noisy-IQ4_XS     (likewise noisy-IQ3_S)
