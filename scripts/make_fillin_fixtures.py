#!/usr/bin/env python3
"""Reference fixtures for the Rust masked-LM generators (fill-in policies) from transformers.

Usage:
    /opt/peers/venv/bin/python scripts/make_fillin_fixtures.py [--out tests/fixtures/fillin]

What it writes (under --out, default ``tests/fixtures/fillin``):

  <name>/{config.json, model.safetensors, tokenizer.json, tokenizer_config.json}
      Tiny random ``*ForMaskedLM`` checkpoints, ``<name>`` one of bert_mlm (tied decoder),
      roberta_mlm (tied), distilbert_mlm (untied ``vocab_projector``), with the small tokenizers of
      ``make_reward_fixtures.py``.
  <name>/expected.json
      The inputs (texts with mask tokens), their ids as one right-padded batch, the masked
      positions, the fill token sampled here for each, its weight and the temperature.
  <name>/expected.safetensors
      ``logits`` [B, T, V] of the padded batch (what ``model(input_ids, attention_mask)`` gives),
      ``loss`` [] = sum over masked positions of weight * log_softmax(logits / temperature)[fill],
      and ``grad.<parameter>`` for every parameter: d loss / d parameter (tied weights once, under
      the name the checkpoint stores).

Deterministic: fixed seeds, f32, CPU, 2 threads; running it twice gives identical files.
"""

import argparse
import importlib.metadata
import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_reward_fixtures as rf  # noqa: E402  (tiny tokenizers, init, json writer)

from transformers import (  # noqa: E402
    BertConfig,
    BertForMaskedLM,
    DistilBertConfig,
    DistilBertForMaskedLM,
    PreTrainedTokenizerFast,
    RobertaConfig,
    RobertaForMaskedLM,
)

MAX_LEN = rf.MAX_LEN
TEMPERATURE = 0.8
# Texts with mask tokens ({m} stands for the model's mask token); lengths differ so the batch pads.
TEXTS = [
    "The quick brown {m} jumps over the {m} dog.",
    "What is 17 plus 25? The answer is {m}{m}.",
    "{m} cat sat on the {m}.",
]


def specs():
    enc = dict(hidden_size=rf.HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, layer_norm_eps=1e-12)
    return [
        ("bert_mlm", BertForMaskedLM, rf.wordpiece_tokenizer,
         lambda tok: BertConfig(vocab_size=tok.get_vocab_size(), max_position_embeddings=MAX_LEN, type_vocab_size=2,
                                hidden_act="gelu", pad_token_id=tok.token_to_id("[PAD]"), tie_word_embeddings=True, **enc)),
        ("roberta_mlm", RobertaForMaskedLM, rf.roberta_tokenizer,
         lambda tok: RobertaConfig(vocab_size=tok.get_vocab_size(), max_position_embeddings=MAX_LEN + 2, type_vocab_size=1,
                                   hidden_act="gelu", pad_token_id=tok.token_to_id("<pad>"), bos_token_id=tok.token_to_id("<s>"),
                                   eos_token_id=tok.token_to_id("</s>"), tie_word_embeddings=True, **enc)),
        ("distilbert_mlm", DistilBertForMaskedLM, rf.wordpiece_tokenizer,
         lambda tok: DistilBertConfig(vocab_size=tok.get_vocab_size(), max_position_embeddings=MAX_LEN, dim=rf.HIDDEN, n_layers=2,
                                      n_heads=4, hidden_dim=32, activation="gelu", dropout=0.0, attention_dropout=0.0,
                                      pad_token_id=tok.token_to_id("[PAD]"), tie_word_embeddings=False)),
    ]


def make(name, cls, make_tok, make_cfg, out_root, seed):
    print(f"=== fillin/{name} ===")
    out_dir = os.path.join(out_root, name)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    raw_tok, sp = make_tok()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=raw_tok, model_max_length=MAX_LEN, **sp)
    hf_tok.save_pretrained(out_dir)
    config = make_cfg(raw_tok)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    with torch.no_grad():
        rf.reinit_weights(model, seed)
    model.save_pretrained(out_dir)
    for extra in ("special_tokens_map.json", "generation_config.json"):
        if os.path.exists(os.path.join(out_dir, extra)):
            os.remove(os.path.join(out_dir, extra))

    tok = PreTrainedTokenizerFast.from_pretrained(out_dir)
    texts = [t.format(m=tok.mask_token) for t in TEXTS]
    enc = tok(texts, padding=True, return_tensors="pt")
    ids, attn = enc["input_ids"], enc["attention_mask"]
    masked = (ids == tok.mask_token_id).nonzero().tolist()  # [[row, pos], ...]
    assert len(masked) >= 6, masked
    g = torch.Generator().manual_seed(seed + 1)
    vocab = config.vocab_size
    fills = torch.randint(0, vocab, (len(masked),), generator=g)
    weights = torch.randn(len(masked), generator=g)

    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=attn).logits  # [B, T, V]
    rows = torch.tensor([r for r, _ in masked])
    cols = torch.tensor([c for _, c in masked])
    lp = torch.log_softmax(logits[rows, cols] / TEMPERATURE, -1)  # [N, V]
    loss = (weights * lp.gather(-1, fills.unsqueeze(-1)).squeeze(-1)).sum()
    loss.backward()

    # The stored names: what the checkpoint has (tied decoders are not stored twice).
    from safetensors import safe_open

    with safe_open(os.path.join(out_dir, "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    tensors = {"logits": logits.detach().contiguous(), "loss": loss.detach().reshape(())}
    seen = set()
    for pname, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        assert pname in stored, (pname, sorted(stored))
        assert p.grad is not None, pname
        tensors[f"grad.{pname}"] = p.grad.detach().clone().contiguous()
    missing = stored - {k[5:] for k in tensors if k.startswith("grad.")}
    assert not missing, f"stored tensors without a gradient: {missing}"
    save_file(tensors, os.path.join(out_dir, "expected.safetensors"))
    rf.write_json(os.path.join(out_dir, "expected.json"), {
        "name": name,
        "model_type": config.model_type,
        "texts": texts,
        "mask_token": tok.mask_token,
        "mask_token_id": tok.mask_token_id,
        "input_ids": ids.tolist(),
        "lengths": attn.sum(1).tolist(),
        "masked": masked,
        "fills": fills.tolist(),
        "weights": [float(str(w)) for w in weights.numpy()],
        "temperature": TEMPERATURE,
        "parameters": len(seen),
        "stored": sorted(stored),
    })
    print(f"  vocab {vocab}, batch {list(ids.shape)}, masked {len(masked)}, parameters {len(seen)}, loss {loss.item():.6f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/fillin")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for i, (name, cls, make_tok, make_cfg) in enumerate(specs()):
        make(name, cls, make_tok, make_cfg, a.out, 100 + i)
    versions = {"script": "scripts/make_fillin_fixtures.py"}
    for pkg in ("torch", "transformers", "tokenizers", "safetensors"):
        versions[pkg] = importlib.metadata.version(pkg)
    with open(os.path.join(a.out, "versions.json"), "w") as f:
        f.write("{\n" + ",\n".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in versions.items()) + "\n}\n")


if __name__ == "__main__":
    main()
