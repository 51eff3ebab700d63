"""Fixtures of the package's tests: a tiny random Llama with SmolLM2's tokenizer and chat
template (made here, as the Rust tests' tiny_llama.rs makes one), small datasets, the `grpo`
binary for the CLI comparisons."""

import array
import json
import os
import random
import shutil
import struct
import subprocess

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")

# The rows of scripts/record_trl_reward_kwargs.py (the TRL fixture's dataset).
ROWS = [
    {"prompt": "What is 2 + 3? Answer with a number.", "answer": "5", "level": 1,
     "tags": ["math", "add"]},
    {"prompt": "What is 7 - 4? Answer with a number.", "answer": "3", "level": 2,
     "tags": ["math"]},
]


def write_safetensors(path, tensors):
    """f32 tensors {name: (shape, array('f'))} in the safetensors format."""
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        shape, data = tensors[name]
        blob = data.tobytes()
        header[name] = {"dtype": "F32", "shape": list(shape),
                        "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def tiny_llama(directory, seed=7):
    """2 layers, hidden 32, SmolLM2's 49,152-token vocabulary, tokenizer and chat template."""
    os.makedirs(directory, exist_ok=True)
    vocab, h, inter, layers, heads, kv, hd = 49152, 32, 64, 2, 4, 2, 8
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    rng = random.Random(seed)

    def tensor(shape, scale, offset=0.0):
        n = 1
        for d in shape:
            n *= d
        return shape, array.array("f", (offset + rng.uniform(-scale, scale) for _ in range(n)))

    t = {"model.embed_tokens.weight": tensor((vocab, h), 0.5),
         "model.norm.weight": tensor((h,), 0.1, 1.0)}
    for layer in range(layers):
        p = f"model.layers.{layer}"
        for name, shape in (("self_attn.q_proj", (heads * hd, h)), ("self_attn.k_proj", (kv * hd, h)),
                            ("self_attn.v_proj", (kv * hd, h)), ("self_attn.o_proj", (h, heads * hd)),
                            ("mlp.gate_proj", (inter, h)), ("mlp.up_proj", (inter, h)),
                            ("mlp.down_proj", (h, inter))):
            t[f"{p}.{name}.weight"] = tensor(shape, 0.3)
        for name in ("input_layernorm", "post_attention_layernorm"):
            t[f"{p}.{name}.weight"] = tensor((h,), 0.1, 1.0)
    write_safetensors(os.path.join(directory, "model.safetensors"), t)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(FIXTURES, "smollm2", name), os.path.join(directory, name))
    return directory


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return tiny_llama(str(tmp_path_factory.mktemp("tiny") / "llama"))


def small_config(output_dir, **extra):
    """A run of a few seconds on the tiny model: 2 prompts x 2 completions of 8 tokens a step."""
    fields = dict(output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=4,
                  num_generations=2, max_completion_length=8, report_to="none",
                  logging_steps=1, save_steps=1, seed=0, dtype="f32", eval_steps=0,
                  log_completions=False)
    fields.update(extra)
    return fields


@pytest.fixture(scope="session")
def grpo_binary():
    """The `grpo` binary (GRPO_BIN, else target/debug/grpo, built here when missing)."""
    path = os.path.abspath(os.environ.get("GRPO_BIN") or os.path.join(ROOT, "target", "debug", "grpo"))
    if not os.path.exists(path):
        subprocess.run(["cargo", "build", "-p", "grpo-cli"], cwd=ROOT, check=True)
    return path
