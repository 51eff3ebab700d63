#!/usr/bin/env python3
"""A random-weight model of a given shape with SmolLM2's tokenizer files, for grpo and TRL alike,
optionally with an end-of-sequence rate so that sampled lengths spread like real ones.

  bench/make_model.py SRC OUT SHAPE [--eos-rate P] [--device cuda] [--dtype bf16] [--dry]

SRC: a directory with SmolLM2's config and tokenizer files (tests/fixtures/smollm2).
SHAPE: 135m (SmolLM2-135M), 1.7b (SmolLM2-1.7B), 4b (Qwen3-4B's sizes, Qwen3 architecture),
8b (Llama-3.1-8B's sizes), tiny (2 layers, for tests). Every shape keeps SmolLM2's vocabulary
(49,152 tokens, so that both trainers share one tokenizer); the 8B shape is then 7.5B parameters.
Weights are seeded (seed 0) and saved in f32, or bf16 above 2B parameters (--dtype overrides).

--eos-rate P: each sampled token is the end-of-sequence token with probability about P, whatever
came before, so that completion lengths are roughly geometric: median ln2/P, and a share
exp(-cap P) of rows run to a cap. How: hidden dimension 0 of every token's embedding is set to a
constant, which the residual stream carries to the final norm, and the EOS row of the head reads
that dimension (the other rows do not) with a weight calibrated on random token sequences so that
the mean EOS probability is P. Random weights without it never stop early.
"""
import argparse
import json
import math
import shutil

import torch

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    "135m": {},
    "1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                 num_key_value_heads=32, head_dim=64),
    "4b": dict(architecture="qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0,
               rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=40960),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, rope_theta=500_000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=False, max_position_embeddings=131072),
}
CONSTANT = 1.0  # the value of hidden dimension 0 in every embedding


def build(src, shape, device, dry):
    cfg = json.load(open(f"{src}/config.json"))
    cfg.pop("_model_name_or_path", None)
    extra = dict(SHAPES[shape])
    arch = extra.pop("architecture", "llama")
    cfg.update(extra)
    if arch == "qwen3":
        from transformers import Qwen3Config as Config, Qwen3ForCausalLM as Model
        cfg["model_type"] = "qwen3"
        cfg["architectures"] = ["Qwen3ForCausalLM"]
        for k in ["mlp_bias", "pretraining_tp"]:
            cfg.pop(k, None)
    else:
        from transformers import LlamaConfig as Config, LlamaForCausalLM as Model
    config = Config(**cfg)
    torch.manual_seed(0)
    with torch.device("meta" if dry else device):
        model = Model(config)
    return model, config


@torch.no_grad()
def set_eos_rate(model, config, rate, device):
    """Dimension 0 of every embedding set to CONSTANT; the EOS row of the head reads it with the
    weight that makes the mean EOS probability on random sequences `rate`."""
    eos = config.eos_token_id if isinstance(config.eos_token_id, int) else config.eos_token_id[0]
    emb = model.get_input_embeddings().weight
    emb[:, 0] = CONSTANT
    head = model.get_output_embeddings().weight
    tied = head.data_ptr() == emb.data_ptr()
    if not tied:
        head[:, 0] = 0.0
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(3, config.vocab_size, (4, 128), generator=g).to(device)
    out = model(input_ids=ids, output_hidden_states=True)
    y = out.hidden_states[-1].float().reshape(-1, config.hidden_size)  # [N, H] after the final norm
    z = out.logits.float().reshape(-1, config.vocab_size)  # [N, V]
    others = torch.cat([z[:, :eos], z[:, eos + 1:]], dim=1).logsumexp(dim=1)  # [N]
    base, reads = z[:, eos], y[:, 0]  # the EOS logit, and what the added weight multiplies

    def mean_p(delta):
        return torch.sigmoid(base + delta * reads - others).mean().item()

    lo, hi = -100.0, 100.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_p(mid) < rate else (lo, mid)
    delta = (lo + hi) / 2
    head[eos, 0] += delta  # tied: the EOS embedding's dimension 0 too
    spread = reads.std().item() / max(abs(reads.mean().item()), 1e-9)
    return dict(eos=eos, delta=round(delta, 4), mean_p=round(mean_p(delta), 5), tied=tied,
                read_mean=round(reads.mean().item(), 3), read_rel_std=round(spread, 4))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--eos-rate", type=float, default=0.0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["f32", "bf16"], default=None)
    ap.add_argument("--dry", action="store_true", help="only count the parameters and write OUT's config and tokenizer (no weights)")
    args = ap.parse_args()
    model, config = build(args.src, args.shape, args.device, args.dry)
    n = sum(p.numel() for p in model.parameters())
    info = dict(shape=args.shape, params_m=round(n / 1e6, 1), arch=type(model).__name__)
    if args.dry:  # the config and tokenizer alone: enough for `grpo plan --model=OUT`
        config.save_pretrained(args.out)
        for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"]:
            shutil.copy(f"{args.src}/{f}", f"{args.out}/{f}")
        print(json.dumps(info), flush=True)
        return
    if args.eos_rate > 0:
        info["eos"] = set_eos_rate(model, config, args.eos_rate, args.device)
        info["eos"]["median_len"] = round(math.log(2) / args.eos_rate)
    dtype = args.dtype or ("bf16" if n > 2e9 else "f32")
    model = model.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    model.save_pretrained(args.out, safe_serialization=True)
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"]:
        shutil.copy(f"{args.src}/{f}", f"{args.out}/{f}")
    info.update(dtype=dtype, out=args.out)
    print(json.dumps(info), flush=True)


if __name__ == "__main__":
    main()
