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
