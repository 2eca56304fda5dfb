#!/bin/bash
# How the GGUF files of this directory's runs were made (2026-12-07, forty-fifth session).  Needs the cached float
# copy of the default target (~/.cache/heterospec/smollm2-135m-instruct, written by `heterospec demo`), and
# llama.cpp's converter and llama-quantize from the llama.cpp vendored in llama-cpp-python 0.3.36's sdist
# (cmake --build build --target llama-quantize; the converter needs sentencepiece importable).
set -e
LLAMA=${LLAMA:-/tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp}
OUT=${OUT:-/tmp/kq}
mkdir -p $OUT/noisy
cp ~/.cache/heterospec/smollm2-135m-instruct/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} $OUT/noisy/
# The default target's weights are Q4_1 decodings (16 levels a block of 32): quantized again they would give
# K-quant blocks of few distinct values, unlike a real checkpoint's.  Gaussian noise of 5 % of each matrix's
# standard deviation makes them continuous again (a model of its own; its outputs are checked against transformers'
# generate on the same weights, so lossless still means what it says).
python - <<'PY'
import torch
from safetensors.torch import load_file, save_file
import os
sd = load_file(os.path.expanduser("~/.cache/heterospec/smollm2-135m-instruct/model.safetensors"))
g = torch.Generator().manual_seed(0)
out = {k: (v + torch.randn(v.shape, generator=g) * v.std() * 0.05 if v.dim() == 2 else v).contiguous()
       for k, v in sd.items()}
save_file(out, os.environ.get("OUT", "/tmp/kq") + "/noisy/model.safetensors", metadata={"format": "pt"})
PY
PYTHONPATH=$LLAMA/gguf-py:$PYTHONPATH python $LLAMA/convert_hf_to_gguf.py $OUT/noisy --outfile $OUT/noisy-f32.gguf --outtype f32
for t in Q4_K_M Q5_K_M Q6_K; do $LLAMA/build/bin/llama-quantize $OUT/noisy-f32.gguf $OUT/noisy-$t.gguf $t; done
