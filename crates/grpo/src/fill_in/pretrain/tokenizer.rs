//! The tokenizers `grpo pretrain` makes from its corpus (one token per character, or a
//! byte-level BPE learned from it), and the corpus tokenized with them.

use std::collections::{BTreeSet, HashMap};

use serde_json::json;

use super::{PretrainOptions, TokenizerKind, CLS, SEP, SPECIALS};
use crate::{Error, Result};

/// The vocabulary of a char tokenizer over `lines`: the specials, then each distinct character
/// in code-point order.
pub fn char_vocab(lines: &[String]) -> Vec<String> {
    let chars: BTreeSet<char> = lines.iter().flat_map(|l| l.chars()).collect();
    SPECIALS
        .iter()
        .map(|s| s.to_string())
        .chain(chars.into_iter().map(String::from))
        .collect()
}

/// `tokenizer.json` of a char-level tokenizer over `vocab` ([`char_vocab`]): every character a
/// token, `[CLS] text [SEP]`, mask tokens written as `[MASK]` in the text, decoding by
/// concatenation.
pub fn char_tokenizer_json(vocab: &[String]) -> serde_json::Value {
    char_tokenizer_json_for(vocab, Objective::Mlm)
}

/// What a pretrained model is: it decides how its tokenizer frames a text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Objective {
    /// `[CLS] text [SEP]`, as BERT.
    Mlm,
    /// `[CLS] text`: `[CLS]` is the BOS token, `[SEP]` the EOS the model learns to end with.
    Causal,
}

/// The tokenizer's post-processor: `[CLS] text [SEP]` (masked LM) or `[CLS] text` (causal).
fn template_json(objective: Objective) -> serde_json::Value {
    let special = |t: &str, id: u32| json!({"id": t, "ids": [id], "tokens": [t]});
    let cls = json!({"SpecialToken": {"id": "[CLS]", "type_id": 0}});
    let sep = |ty: u32| json!({"SpecialToken": {"id": "[SEP]", "type_id": ty}});
    let seq = |id: &str, ty: u32| json!({"Sequence": {"id": id, "type_id": ty}});
    let (single, pair) = match objective {
        Objective::Mlm => (
            vec![cls.clone(), seq("A", 0), sep(0)],
            vec![cls, seq("A", 0), sep(0), seq("B", 1), sep(1)],
        ),
        Objective::Causal => (
            vec![cls.clone(), seq("A", 0)],
            vec![cls, seq("A", 0), seq("B", 1)],
        ),
    };
    json!({
        "type": "TemplateProcessing",
        "single": single,
        "pair": pair,
        "special_tokens": {"[CLS]": special("[CLS]", CLS), "[SEP]": special("[SEP]", SEP)}
    })
}

/// `tokenizer.json` of the char tokenizer over `vocab` framing texts for `objective`.
fn char_tokenizer_json_for(vocab: &[String], objective: Objective) -> serde_json::Value {
    let added: Vec<serde_json::Value> = SPECIALS
        .iter()
        .enumerate()
        .map(|(i, s)| {
            json!({"id": i, "content": s, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": true})
        })
        .collect();
    let ids: serde_json::Map<String, serde_json::Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated", "invert": false},
        "post_processor": template_json(objective),
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": ids, "unk_token": "[UNK]"}
    })
}

/// Tokenizes a line with the char vocabulary: `[CLS] chars [SEP]`, cut to `max_len`.
fn encode_line(line: &str, ids: &HashMap<char, u32>, max_len: usize) -> Vec<u32> {
    let mut out = vec![CLS];
    out.extend(
        line.chars()
            .take(max_len - 2)
            .map(|c| ids.get(&c).copied().unwrap_or(1)),
    );
    out.push(SEP);
    out
}

/// A corpus tokenized for pretraining: `[CLS] tokens [SEP]` per line (cut to `max_len`), the
/// tokenizer's `tokenizer.json` and its vocabulary size.
pub(super) struct Corpus {
    pub(super) rows: Vec<Vec<u32>>,
    pub(super) tokenizer: serde_json::Value,
    pub(super) vocab_size: usize,
}

/// Tokenizes `lines` with the tokenizer `o.tokenizer` says, made from them. Ids 0-4 are the
/// specials `[PAD] [UNK] [CLS] [SEP] [MASK]` whichever the kind.
pub(super) fn tokenize_corpus(
    o: &PretrainOptions,
    lines: &[String],
    objective: Objective,
) -> Result<Corpus> {
    match o.tokenizer {
        TokenizerKind::Chars => {
            let vocab = char_vocab(lines);
            let char_ids: HashMap<char, u32> = vocab
                .iter()
                .enumerate()
                .skip(SPECIALS.len())
                .filter_map(|(i, t)| t.chars().next().map(|c| (c, i as u32)))
                .collect();
            Ok(Corpus {
                rows: lines
                    .iter()
                    .map(|l| encode_line(l, &char_ids, o.max_len))
                    .collect(),
                tokenizer: char_tokenizer_json_for(&vocab, objective),
                vocab_size: vocab.len(),
            })
        }
        TokenizerKind::Bpe { vocab_size } => {
            let tok = train_bpe(lines, vocab_size)?;
            let mut rows = Vec::with_capacity(lines.len());
            for l in lines {
                let enc = tok
                    .encode(l.as_str(), false)
                    .map_err(|e| Error::Tokenizer(format!("the trained BPE tokenizer: {e}")))?;
                let mut ids = vec![CLS];
                ids.extend(enc.get_ids().iter().take(o.max_len - 2));
                ids.push(SEP);
                rows.push(ids);
            }
            let mut json: serde_json::Value = serde_json::from_str(
                &tok.to_string(false)
                    .map_err(|e| Error::Tokenizer(format!("the trained BPE tokenizer: {e}")))?,
            )
            .map_err(|e| Error::Tokenizer(format!("the trained BPE tokenizer: {e}")))?;
            json["post_processor"] = template_json(objective);
            Ok(Corpus {
                rows,
                tokenizer: json,
                vocab_size: tok.get_vocab_size(true),
            })
        }
    }
}

/// A byte-level BPE tokenizer of `vocab_size` tokens learned from `lines`, the specials first.
fn train_bpe(lines: &[String], vocab_size: usize) -> Result<tokenizers::Tokenizer> {
    use tokenizers::models::bpe::{BpeTrainer, BPE};
    use tokenizers::models::TrainerWrapper;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::AddedToken;
    let fail = |e: tokenizers::Error| Error::Tokenizer(format!("training the BPE tokenizer: {e}"));
    let trainer = BpeTrainer::builder()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(
            SPECIALS
                .iter()
                .map(|t| AddedToken::from(*t, true))
                .collect(),
        )
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut tok = tokenizers::Tokenizer::new(BPE::default());
    tok.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tok.with_decoder(Some(ByteLevel::default()));
    let mut trainer: TrainerWrapper = trainer.into();
    tok.train(&mut trainer, lines.iter()).map_err(fail)?;
    Ok(tok)
}

/// `tokenizer_config.json` of the char tokenizer (transformers' `PreTrainedTokenizerFast`).
pub(super) fn char_tokenizer_config(max_len: usize) -> serde_json::Value {
    json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_len,
        "pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]",
        "sep_token": "[SEP]", "mask_token": "[MASK]"
    })
}
