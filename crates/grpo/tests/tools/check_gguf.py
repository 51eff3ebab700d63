"""Reads a GGUF file grpo exported with the real consumers: the `gguf` package (llama.cpp's own
reader) and llama.cpp itself (through llama-cpp-python). Prints one JSON object:

- `version`, `arch`, and per tensor its type, shape (llama.cpp's order) and the sum of its
  values as the `gguf` package dequantizes them (a check of the data, whatever the row order);
- `tokens`: llama.cpp's N greedy tokens after the prompt ids;
- `forced_logits`: llama.cpp's logits at each of N steps when fed FORCED (grpo's tokens) instead.

    python check_gguf.py MODEL.gguf '[1, 2, 3]' N '[4, 5, ...]'

llama.cpp's own log goes to stderr with CHECK_GGUF_VERBOSE=1.
"""
import json
import os
import sys

import gguf
import llama_cpp
import numpy as np

path, prompt, n, forced = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])

reader = gguf.GGUFReader(path)
field = reader.fields["general.architecture"]
arch = bytes(field.parts[field.data[0]]).decode()
tensors = {
    t.name: {
        "type": t.tensor_type.name,
        "shape": [int(d) for d in t.shape],
        "sum": float(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).sum()),
    }
    for t in reader.tensors
}

llm = llama_cpp.Llama(
    model_path=path,
    n_ctx=len(prompt) + n + 8,
    n_threads=2,
    logits_all=False,
    verbose=os.environ.get("CHECK_GGUF_VERBOSE") == "1",
)


def last_logits():
    # The last evaluated position's logits, from llama.cpp itself (llama-cpp-python keeps
    # `scores` only with logits_all).
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float32)


def decode(next_token):
    """N steps from the prompt; `next_token(step, logits)` picks what is fed next."""
    llm.reset()
    llm.eval(prompt)
    out = []
    for step in range(n):
        logits = last_logits()
        out.append(logits)
        llm.eval([next_token(step, logits)])
    return out


tokens = [int(np.argmax(l)) for l in decode(lambda _, logits: int(np.argmax(logits)))]
forced_logits = [l.tolist() for l in decode(lambda step, _: forced[step])]

print(
    json.dumps(
        {
            "version": int(reader.fields["GGUF.version"].parts[-1][0]),
            "arch": arch,
            "tensors": tensors,
            "tokens": tokens,
            "forced_logits": forced_logits,
        }
    )
)
