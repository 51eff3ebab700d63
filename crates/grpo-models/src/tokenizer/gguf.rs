//! Building a tokenizer from GGUF metadata (`tokenizer.ggml.*`, llama.cpp's key names).
//!
//! A GGUF carries the vocabulary, the merges and the special token ids, but not the normalizer or
//! pre-tokenizer: those are named by `tokenizer.ggml.pre` and rebuilt here the way the model's own
//! HF `tokenizer.json` defines them, so that the ids come out equal to the HF tokenizer's.
//!
//! Only byte-level BPE vocabularies (`tokenizer.ggml.model = "gpt2"`) are supported. SentencePiece
//! vocabularies (`"llama"`) are refused with an error that says to use the HF tokenizer instead.

use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value as GgufValue};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::error::{Error, Result};

/// llama.cpp token types (`tokenizer.ggml.token_type`).
const TYPE_UNKNOWN: i64 = 2;
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;

/// Qwen2's split regex, as in its `tokenizer.json` (`Split`, behavior `Isolated`).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Llama 3's split regex, as in its `tokenizer.json` (`Split`, behavior `Isolated`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The `tokenizer.ggml.pre` values this module can rebuild.
pub(crate) const SUPPORTED_PRE: &[&str] = &[
    "default",
    "gpt-2",
    "gpt2",
    "smollm",
    "starcoder",
    "qwen2",
    "llama-bpe",
    "llama3",
    "llama-v3",
];

/// Everything the GGUF says about its tokenizer, turned into a `tokenizers::Tokenizer` plus the
/// bits that live outside it.
pub(crate) struct GgufTokenizer {
    pub inner: tokenizers::Tokenizer,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub pad: Option<u32>,
    pub unk: Option<u32>,
    /// Prepend BOS when encoding with special tokens (`tokenizer.ggml.add_bos_token`).
    pub add_bos: bool,
    /// Append EOS when encoding with special tokens (`tokenizer.ggml.add_eos_token`).
    pub add_eos: bool,
    pub chat_template: Option<String>,
    /// The token strings, by id (for the special-token strings the chat template sees).
    pub tokens: Vec<String>,
}

pub(crate) fn build(content: &Content, path: &Path) -> Result<GgufTokenizer> {
    let md = Meta { content, path };
    let model = md.string("tokenizer.ggml.model")?.ok_or_else(|| {
        Error::file(
            path,
            "the GGUF file has no tokenizer metadata (`tokenizer.ggml.model` is missing); \
             give the model's HF tokenizer directory (with tokenizer.json) instead",
        )
    })?;
    match model {
        "gpt2" => build_byte_level_bpe(&md),
        "llama" => Err(Error::file(
            path,
            "GGUF SentencePiece tokenizers (`tokenizer.ggml.model` = \"llama\") are not supported; \
             give the model's HF tokenizer directory (with tokenizer.json) instead",
        )),
        other => Err(Error::file(
            path,
            format!(
                "unsupported GGUF tokenizer model `tokenizer.ggml.model` = {other:?} (only \"gpt2\", \
                 byte-level BPE, is supported); give the model's HF tokenizer directory (with \
                 tokenizer.json) instead"
            ),
        )),
    }
}

fn build_byte_level_bpe(md: &Meta) -> Result<GgufTokenizer> {
    let path = md.path;
    let (tokens, types, merges) = vocabulary(md)?;
    let Specials {
        bos,
        eos,
        pad,
        unk,
        add_bos,
        add_eos,
    } = Specials::read(md, tokens.len())?;
    let add_space_prefix = md.bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(false);
    let pre = md.string("tokenizer.ggml.pre")?;
    let chat_template = md.string("tokenizer.chat_template")?.map(str::to_owned);

    let layout = PreLayout::for_pre(pre, add_space_prefix).map_err(|msg| Error::file(path, msg))?;

    let vocab = byte_level_vocab(&tokens, &types);
    let pairs = merge_pairs(path, &merges)?;

    let bpe = BPE::builder()
        .vocab_and_merges(vocab, pairs)
        .ignore_merges(layout.ignore_merges)
        .build()
        .map_err(|e| {
            Error::file(
                path,
                format!("cannot build the BPE tokenizer from GGUF metadata: {e}"),
            )
        })?;

    let mut inner = tokenizers::Tokenizer::new(bpe);
    if layout.nfc {
        inner
            .with_normalizer(Some(NFC))
            .map_err(|e| Error::Tokenizer(format!("setting the NFC normalizer: {e}")))?;
    }
    inner.with_pre_tokenizer(Some(layout.pre_tokenizer));
    inner.with_decoder(Some(ByteLevelDecoder::default()));

    let named: Vec<u32> = [bos, eos, pad, unk].into_iter().flatten().collect();
    add_file_tokens(&mut inner, path, &tokens, &types, &named)?;

    Ok(GgufTokenizer {
        inner,
        bos,
        eos,
        pad,
        unk,
        add_bos,
        add_eos,
        chat_template,
        tokens: tokens.iter().map(|t| (*t).to_owned()).collect(),
    })
}

/// The vocabulary's tokens (by id), their types (normal where the file gives none) and merges.
fn vocabulary<'a>(md: &Meta<'a>) -> Result<(Vec<&'a str>, Vec<i64>, Vec<&'a str>)> {
    let path = md.path;
    let tokens = md
        .string_array("tokenizer.ggml.tokens")?
        .ok_or_else(|| Error::file(path, "GGUF metadata `tokenizer.ggml.tokens` is missing"))?;
    if tokens.is_empty() {
        return Err(Error::file(
            path,
            "GGUF metadata `tokenizer.ggml.tokens` is empty",
        ));
    }
    let n = tokens.len();
    if u32::try_from(n).is_err() {
        return Err(Error::file(
            path,
            "GGUF metadata `tokenizer.ggml.tokens` is too long",
        ));
    }
    let types = match md.int_array("tokenizer.ggml.token_type")? {
        Some(t) if t.len() != n => {
            return Err(Error::file(
                path,
                format!(
                    "GGUF metadata `tokenizer.ggml.token_type` has {} entries but \
                     `tokenizer.ggml.tokens` has {n}",
                    t.len()
                ),
            ))
        }
        Some(t) => t,
        None => vec![1; n],
    };
    let merges = md.string_array("tokenizer.ggml.merges")?.ok_or_else(|| {
        Error::file(
            path,
            "GGUF metadata `tokenizer.ggml.merges` is missing (a byte-level BPE vocabulary needs it)",
        )
    })?;
    Ok((tokens, types, merges))
}

/// The special token ids a GGUF names, and whether encoding adds BOS and EOS.
struct Specials {
    bos: Option<u32>,
    eos: Option<u32>,
    pad: Option<u32>,
    unk: Option<u32>,
    add_bos: bool,
    add_eos: bool,
}

impl Specials {
    /// Reads them for a vocabulary of `n` tokens: an id out of range, or BOS / EOS insertion
    /// without its id, is an error.
    fn read(md: &Meta, n: usize) -> Result<Self> {
        let path = md.path;
        let special_id = |key: &str| -> Result<Option<u32>> {
            match md.u32(key)? {
                Some(id) if id as usize >= n => Err(Error::file(
                    path,
                    format!(
                        "GGUF metadata `{key}` = {id} is out of range (the vocabulary has {n} tokens)"
                    ),
                )),
                other => Ok(other),
            }
        };
        let bos = special_id("tokenizer.ggml.bos_token_id")?;
        let eos = special_id("tokenizer.ggml.eos_token_id")?;
        let pad = special_id("tokenizer.ggml.padding_token_id")?;
        let unk = special_id("tokenizer.ggml.unknown_token_id")?;
        // llama.cpp's default for BPE vocabularies is no BOS and no EOS unless the file says so.
        let add_bos = md.bool("tokenizer.ggml.add_bos_token")?.unwrap_or(false);
        let add_eos = md.bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        if add_bos && bos.is_none() {
            return Err(Error::file(
                path,
                "GGUF metadata sets `tokenizer.ggml.add_bos_token` but has no `tokenizer.ggml.bos_token_id`",
            ));
        }
        if add_eos && eos.is_none() {
            return Err(Error::file(
                path,
                "GGUF metadata sets `tokenizer.ggml.add_eos_token` but has no `tokenizer.ggml.eos_token_id`",
            ));
        }
        Ok(Specials {
            bos,
            eos,
            pad,
            unk,
            add_bos,
            add_eos,
        })
    }
}

/// The vocabulary, in the byte-level spelling the merges use. A token the file stores in plain
/// text (an added token such as `<think>` with characters outside the byte alphabet) is also
/// entered in its byte-level spelling, and added tokens keep their plain spelling too, so the
/// added-token matcher finds them under the id the file gives them.
fn byte_level_vocab(tokens: &[&str], types: &[i64]) -> Vocab {
    let alphabet = ByteAlphabet::new();
    let mut vocab = Vocab::new();
    for (id, token) in tokens.iter().enumerate() {
        let id = id as u32;
        let ty = types[id as usize];
        let spelled = alphabet.respell(token);
        vocab.entry(spelled.clone()).or_insert(id);
        let added = matches!(ty, TYPE_UNKNOWN | TYPE_CONTROL | TYPE_USER_DEFINED);
        if added && spelled != *token {
            vocab.entry((*token).to_owned()).or_insert(id);
        }
    }
    vocab
}

/// The merges as token pairs (each `a b` in the file).
fn merge_pairs(path: &Path, merges: &[&str]) -> Result<Vec<(String, String)>> {
    let mut pairs = Vec::with_capacity(merges.len());
    for (i, merge) in merges.iter().enumerate() {
        let (a, b) = merge.split_once(' ').ok_or_else(|| {
            Error::file(
                path,
                format!("GGUF metadata `tokenizer.ggml.merges`[{i}] = {merge:?} is not two tokens separated by a space"),
            )
        })?;
        pairs.push((a.to_owned(), b.to_owned()));
    }
    Ok(pairs)
}

/// Adds the file's added tokens to `inner`: control (and unknown) tokens are special,
/// user-defined ones are plain added tokens; both are matched whole in the input, as llama.cpp and
/// HF do. The `named` special tokens are special whatever their type says. Warns when one does
/// not keep the file's id.
fn add_file_tokens(
    inner: &mut tokenizers::Tokenizer,
    path: &Path,
    tokens: &[&str],
    types: &[i64],
    named: &[u32],
) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    let mut special = Vec::new();
    let mut user = Vec::new();
    for (id, token) in tokens.iter().enumerate() {
        let ty = types[id];
        let is_special = matches!(ty, TYPE_UNKNOWN | TYPE_CONTROL) || named.contains(&(id as u32));
        if token.is_empty() || !(is_special || ty == TYPE_USER_DEFINED) || !seen.insert(*token) {
            continue;
        }
        let list = if is_special { &mut special } else { &mut user };
        list.push((
            id as u32,
            AddedToken::from(*token, is_special).normalized(false),
        ));
    }
    inner
        .add_special_tokens(special.iter().map(|(_, t)| t.clone()))
        .map_err(|e| Error::Tokenizer(format!("adding GGUF control tokens: {e}")))?;
    inner
        .add_tokens(user.iter().map(|(_, t)| t.clone()))
        .map_err(|e| Error::Tokenizer(format!("adding GGUF user-defined tokens: {e}")))?;
    // Every added token was entered in the vocabulary above, so each one keeps the file's id,
    // unless the file spells two tokens the same.
    for (id, t) in special.iter().chain(user.iter()) {
        let got = inner.token_to_id(&t.content);
        if got != Some(*id) {
            tracing::warn!(
                "{}: GGUF token {:?} (id {id}) resolves to id {got:?}: the vocabulary spells two tokens the same",
                path.display(),
                t.content
            );
        }
    }
    Ok(())
}

/// llama.cpp's type for the filler entries of a vocabulary shorter than the embedding matrix.
const TYPE_UNUSED: i32 = 5;
const TYPE_NORMAL: i32 = 1;

/// The `tokenizer.*` GGUF metadata for `tok` (the inverse of [`build`]): the byte-level BPE
/// vocabulary padded to `vocab_size` entries (the embedding rows; llama.cpp wants one token per
/// row), token types, merges, the `tokenizer.ggml.pre` name of its pre-tokenizer, the special
/// ids, BOS/EOS insertion and the chat template.
pub(crate) fn metadata(
    tok: &super::Tokenizer,
    vocab_size: usize,
) -> Result<Vec<(String, GgufValue)>> {
    let unsupported = |what: String| {
        Error::Tokenizer(format!(
            "{}: cannot write this tokenizer as GGUF metadata: {what}",
            tok.source.display()
        ))
    };
    let json: serde_json::Value = serde_json::from_str(
        &tok.inner
            .to_string(false)
            .map_err(|e| Error::Tokenizer(format!("cannot serialise the tokenizer: {e}")))?,
    )
    .map_err(|e| Error::Tokenizer(format!("cannot read the serialised tokenizer: {e}")))?;
    let model = &json["model"];
    if model["type"] != "BPE" {
        return Err(unsupported(format!(
            "only byte-level BPE vocabularies are supported, not {}",
            model["type"]
        )));
    }
    let pre = pre_name(&json).map_err(unsupported)?;
    let (tokens, types) = tokens_by_id(&json, vocab_size).map_err(unsupported)?;
    let merges = gguf_merges(model).map_err(unsupported)?;

    // BOS / EOS insertion: what encoding with special tokens adds around a text.
    let plain = tok.encode("a", false)?;
    let with = tok.encode("a", true)?;
    let add_bos = tok.bos_id.is_some()
        && with.first() != plain.first()
        && with.first() == tok.bos_id.as_ref();
    let add_eos =
        tok.eos_id.is_some() && with.last() != plain.last() && with.last() == tok.eos_id.as_ref();

    let s = |v: &str| GgufValue::String(v.to_owned());
    let mut md = vec![
        ("tokenizer.ggml.model".to_owned(), s("gpt2")),
        ("tokenizer.ggml.pre".to_owned(), s(pre)),
        ("tokenizer.ggml.tokens".to_owned(), GgufValue::Array(tokens)),
        (
            "tokenizer.ggml.token_type".to_owned(),
            GgufValue::Array(types.into_iter().map(GgufValue::I32).collect()),
        ),
        ("tokenizer.ggml.merges".to_owned(), GgufValue::Array(merges)),
    ];
    let unk = tok
        .template_tokens
        .iter()
        .find(|(n, _)| n == "unk_token")
        .and_then(|(_, t)| tok.inner.token_to_id(t));
    for (key, id) in [
        ("bos_token_id", tok.bos_id),
        ("eos_token_id", tok.eos_id),
        ("unknown_token_id", unk),
        ("padding_token_id", tok.pad_id),
    ] {
        if let Some(id) = id {
            md.push((format!("tokenizer.ggml.{key}"), GgufValue::U32(id)));
        }
    }
    md.push((
        "tokenizer.ggml.add_bos_token".to_owned(),
        GgufValue::Bool(add_bos),
    ));
    md.push((
        "tokenizer.ggml.add_eos_token".to_owned(),
        GgufValue::Bool(add_eos),
    ));
    if let Some(t) = &tok.chat {
        md.push(("tokenizer.chat_template".to_owned(), s(t.source())));
    }
    Ok(md)
}

/// The tokens of a serialised BPE tokenizer by id, `vocab_size` of them, and their llama.cpp
/// types: added tokens in their plain spelling, the rest as the vocabulary spells them
/// (byte-level); ids nothing names are filled with `[PAD{id}]`, type unused, as llama.cpp's
/// converter does. An error says why the tokenizer cannot be written.
fn tokens_by_id(
    json: &serde_json::Value,
    vocab_size: usize,
) -> std::result::Result<(Vec<GgufValue>, Vec<i32>), String> {
    let alphabet = ByteAlphabet::new();
    let mut tokens: Vec<Option<String>> = vec![None; vocab_size];
    let mut types = vec![TYPE_NORMAL; vocab_size];
    let vocab = json["model"]["vocab"]
        .as_object()
        .ok_or_else(|| "the BPE model has no vocabulary".to_string())?;
    for (text, id) in vocab {
        let id = id.as_u64().unwrap_or(u64::MAX) as usize;
        let slot = tokens.get_mut(id).ok_or_else(|| {
            format!("token {text:?} has id {id}, outside the model's {vocab_size} embedding rows")
        })?;
        // A GGUF-built vocabulary holds added tokens under two spellings: keep the byte-level
        // one (the added-token list below has the plain one); between equals, the smaller.
        let byte_level = |t: &str| t.chars().all(|c| alphabet.contains(c));
        let replace = match slot.as_deref() {
            None => true,
            Some(old) => (byte_level(text), old) > (byte_level(old), text.as_str()),
        };
        if replace {
            *slot = Some(text.clone());
        }
    }
    // A GGUF's own fillers stay fillers.
    for (id, t) in tokens.iter().enumerate() {
        if t.as_deref() == Some(format!("[PAD{id}]").as_str()) {
            types[id] = TYPE_UNUSED;
        }
    }
    for added in json["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(text)) = (added["id"].as_u64(), added["content"].as_str()) else {
            continue;
        };
        let id = id as usize;
        if id >= vocab_size {
            return Err(format!(
                "added token {text:?} has id {id}, outside the model's {vocab_size} embedding rows"
            ));
        }
        tokens[id] = Some(text.to_owned());
        types[id] = if added["special"].as_bool() == Some(true) {
            TYPE_CONTROL as i32
        } else {
            TYPE_USER_DEFINED as i32
        };
    }
    let tokens: Vec<GgufValue> = tokens
        .into_iter()
        .enumerate()
        .map(|(id, t)| {
            GgufValue::String(t.unwrap_or_else(|| {
                types[id] = TYPE_UNUSED;
                format!("[PAD{id}]")
            }))
        })
        .collect();
    Ok((tokens, types))
}

/// The merges of a serialised BPE model as GGUF strings (`a b`); they may be stored as strings or
/// as pairs.
fn gguf_merges(model: &serde_json::Value) -> std::result::Result<Vec<GgufValue>, String> {
    model["merges"]
        .as_array()
        .ok_or_else(|| "the BPE model has no merges".to_string())?
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => Ok(GgufValue::String(s.clone())),
            serde_json::Value::Array(p) => match (p.first(), p.get(1)) {
                (Some(serde_json::Value::String(a)), Some(serde_json::Value::String(b))) => {
                    Ok(GgufValue::String(format!("{a} {b}")))
                }
                _ => Err(format!("a merge is not a pair of tokens: {m}")),
            },
            _ => Err(format!("a merge is not a pair of tokens: {m}")),
        })
        .collect()
}

/// The `tokenizer.ggml.pre` name of a serialised tokenizer's normalizer and pre-tokenizer: the
/// layouts [`PreLayout::for_pre`] builds, recognised back.
fn pre_name(json: &serde_json::Value) -> std::result::Result<&'static str, String> {
    let pre = &json["pre_tokenizer"];
    let nfc = match &json["normalizer"] {
        serde_json::Value::Null => false,
        n if n["type"] == "NFC" => true,
        n => return Err(format!("its normalizer {n} has no llama.cpp equivalent")),
    };
    let byte_level = |p: &serde_json::Value, regex: bool| {
        p["type"] == "ByteLevel"
            && p["use_regex"].as_bool() == Some(regex)
            && p["add_prefix_space"].as_bool() != Some(true)
    };
    let parts: Vec<&serde_json::Value> = match pre["type"].as_str() {
        Some("Sequence") => pre["pretokenizers"]
            .as_array()
            .into_iter()
            .flatten()
            .collect(),
        _ => vec![pre],
    };
    let name = match parts.as_slice() {
        // llama.cpp spells GPT-2's "gpt-2".
        [b] if !nfc && byte_level(b, true) => Some("gpt-2"),
        [d, b]
            if !nfc
                && d["type"] == "Digits"
                && d["individual_digits"].as_bool() == Some(true)
                && byte_level(b, true) =>
        {
            Some("smollm")
        }
        [sp, b]
            if sp["type"] == "Split"
                && sp["behavior"] == "Isolated"
                && sp["invert"].as_bool() != Some(true)
                && byte_level(b, false) =>
        {
            match sp["pattern"]["Regex"].as_str() {
                Some(QWEN2_SPLIT) if nfc => Some("qwen2"),
                Some(LLAMA3_SPLIT) if !nfc => Some("llama-bpe"),
                _ => None,
            }
        }
        _ => None,
    };
    name.ok_or_else(|| {
        format!(
            "its pre-tokenizer {pre} (normalizer: {}) is none of GPT-2's, SmolLM's, Qwen2's or Llama 3's, which llama.cpp knows by name",
            json["normalizer"]
        )
    })
}

/// Normalizer, pre-tokenizer and BPE options for one `tokenizer.ggml.pre` value.
struct PreLayout {
    nfc: bool,
    pre_tokenizer: PreTokenizerWrapper,
    ignore_merges: bool,
}

impl PreLayout {
    fn for_pre(pre: Option<&str>, add_space_prefix: bool) -> std::result::Result<Self, String> {
        let name = pre.unwrap_or("default");
        // `ByteLevel` with its own GPT-2 regex, as GPT-2's tokenizer.json has it.
        let gpt2 = |prefix: bool| ByteLevel::new(prefix, true, true);
        // `ByteLevel` after a `Split`: it only maps bytes.
        let bytes_only = |trim_offsets: bool| ByteLevel::new(false, trim_offsets, false);
        let split = |pattern: &str| -> std::result::Result<PreTokenizerWrapper, String> {
            Split::new(
                SplitPattern::Regex(pattern.to_owned()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map(PreTokenizerWrapper::from)
            .map_err(|e| {
                format!("cannot compile the split regex for `tokenizer.ggml.pre` = {name:?}: {e}")
            })
        };
        let no_prefix = || -> std::result::Result<(), String> {
            if add_space_prefix {
                Err(format!(
                    "`tokenizer.ggml.add_space_prefix` = true is not supported with `tokenizer.ggml.pre` = {name:?}; \
                     give the model's HF tokenizer directory (with tokenizer.json) instead"
                ))
            } else {
                Ok(())
            }
        };
        let layout = match name {
            // GPT-2: the byte-level regex only. (llama.cpp's "default" uses a different regex, but
            // a GGUF without `tokenizer.ggml.pre` is an old GPT-2-style conversion.)
            "default" | "gpt-2" | "gpt2" => Self {
                nfc: false,
                pre_tokenizer: gpt2(add_space_prefix).into(),
                ignore_merges: false,
            },
            // StarCoder and SmolLM: every digit on its own, then the GPT-2 regex
            // (tokenizer.json: Sequence[Digits(individual_digits=true), ByteLevel]).
            "smollm" | "starcoder" => {
                no_prefix()?;
                Self {
                    nfc: false,
                    pre_tokenizer: Sequence::new(vec![
                        Digits::new(true).into(),
                        gpt2(false).into(),
                    ])
                    .into(),
                    ignore_merges: false,
                }
            }
            // Qwen2: NFC, then the Qwen split regex, then bytes.
            "qwen2" => {
                no_prefix()?;
                Self {
                    nfc: true,
                    pre_tokenizer: Sequence::new(vec![
                        split(QWEN2_SPLIT)?,
                        bytes_only(false).into(),
                    ])
                    .into(),
                    ignore_merges: false,
                }
            }
            // Llama 3: the Llama 3 split regex, then bytes; whole words in the vocabulary skip
            // the merges (tokenizer.json has `ignore_merges: true`).
            "llama-bpe" | "llama3" | "llama-v3" => {
                no_prefix()?;
                Self {
                    nfc: false,
                    pre_tokenizer: Sequence::new(vec![
                        split(LLAMA3_SPLIT)?,
                        bytes_only(true).into(),
                    ])
                    .into(),
                    ignore_merges: true,
                }
            }
            other => {
                return Err(format!(
                "unsupported GGUF pre-tokenizer `tokenizer.ggml.pre` = {other:?} (supported: {}); \
                     give the model's HF tokenizer directory (with tokenizer.json) instead",
                SUPPORTED_PRE.join(", ")
            ))
            }
        };
        Ok(layout)
    }
}

/// GPT-2's reversible byte-to-character mapping: printable bytes stand for themselves, the
/// others are shifted to U+0100 and up.
struct ByteAlphabet {
    chars: [char; 256],
}

impl ByteAlphabet {
    fn new() -> Self {
        let mut chars = ['\0'; 256];
        let mut next = 256u32;
        for b in 0..=255u8 {
            let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
            chars[b as usize] = if printable {
                char::from(b)
            } else {
                let c = char::from_u32(next).unwrap_or('\u{FFFD}');
                next += 1;
                c
            };
        }
        Self { chars }
    }

    fn contains(&self, c: char) -> bool {
        let u = c as u32;
        // The image is [0x21, 0x7E] ∪ [0xA1, 0xAC] ∪ [0xAE, 0xFF] ∪ [0x100, 0x143].
        matches!(u, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0x143)
    }

    /// The token in byte-level spelling: as is when it already is, else its UTF-8 bytes mapped.
    fn respell(&self, token: &str) -> String {
        if token.chars().all(|c| self.contains(c)) {
            token.to_owned()
        } else {
            token.bytes().map(|b| self.chars[b as usize]).collect()
        }
    }
}

/// Typed access to GGUF metadata, with errors that name the file and key.
struct Meta<'a> {
    content: &'a Content,
    path: &'a Path,
}

fn type_name(v: &GgufValue) -> &'static str {
    match v {
        GgufValue::U8(_) => "u8",
        GgufValue::I8(_) => "i8",
        GgufValue::U16(_) => "u16",
        GgufValue::I16(_) => "i16",
        GgufValue::U32(_) => "u32",
        GgufValue::I32(_) => "i32",
        GgufValue::U64(_) => "u64",
        GgufValue::I64(_) => "i64",
        GgufValue::F32(_) => "f32",
        GgufValue::F64(_) => "f64",
        GgufValue::Bool(_) => "bool",
        GgufValue::String(_) => "string",
        GgufValue::Array(_) => "array",
    }
}

fn as_int(v: &GgufValue) -> Option<i64> {
    Some(match v {
        GgufValue::U8(x) => i64::from(*x),
        GgufValue::I8(x) => i64::from(*x),
        GgufValue::U16(x) => i64::from(*x),
        GgufValue::I16(x) => i64::from(*x),
        GgufValue::U32(x) => i64::from(*x),
        GgufValue::I32(x) => i64::from(*x),
        GgufValue::U64(x) => i64::try_from(*x).ok()?,
        GgufValue::I64(x) => *x,
        _ => return None,
    })
}

impl<'a> Meta<'a> {
    fn get(&self, key: &str) -> Option<&'a GgufValue> {
        self.content.metadata.get(key)
    }

    fn wrong_type(&self, key: &str, want: &str, got: &GgufValue) -> Error {
        Error::file(
            self.path,
            format!(
                "GGUF metadata `{key}` should be {want}, found {}",
                type_name(got)
            ),
        )
    }

    fn string(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(GgufValue::String(s)) => Ok(Some(s.as_str())),
            Some(v) => Err(self.wrong_type(key, "a string", v)),
        }
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(GgufValue::Bool(b)) => Ok(Some(*b)),
            // Some converters write flags as integers.
            Some(v) => match as_int(v) {
                Some(i) => Ok(Some(i != 0)),
                None => Err(self.wrong_type(key, "a bool", v)),
            },
        }
    }

    fn u32(&self, key: &str) -> Result<Option<u32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match as_int(v).map(u32::try_from) {
                Some(Ok(i)) => Ok(Some(i)),
                Some(Err(_)) => Err(Error::file(
                    self.path,
                    format!(
                        "GGUF metadata `{key}` = {} is not a valid token id",
                        as_int(v).unwrap_or(-1)
                    ),
                )),
                None => Err(self.wrong_type(key, "an integer", v)),
            },
        }
    }

    fn array(&self, key: &str) -> Result<Option<&'a [GgufValue]>> {
        match self.get(key) {
            None => Ok(None),
            Some(GgufValue::Array(a)) => Ok(Some(a.as_slice())),
            Some(v) => Err(self.wrong_type(key, "an array", v)),
        }
    }

    fn string_array(&self, key: &str) -> Result<Option<Vec<&'a str>>> {
        let Some(items) = self.array(key)? else {
            return Ok(None);
        };
        items
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                GgufValue::String(s) => Ok(s.as_str()),
                v => Err(Error::file(
                    self.path,
                    format!(
                        "GGUF metadata `{key}`[{i}] should be a string, found {}",
                        type_name(v)
                    ),
                )),
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    fn int_array(&self, key: &str) -> Result<Option<Vec<i64>>> {
        let Some(items) = self.array(key)? else {
            return Ok(None);
        };
        items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                as_int(v).ok_or_else(|| {
                    Error::file(
                        self.path,
                        format!(
                            "GGUF metadata `{key}`[{i}] should be an integer, found {}",
                            type_name(v)
                        ),
                    )
                })
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_alphabet_is_gpt2s() {
        let a = ByteAlphabet::new();
        assert_eq!(a.chars[b' ' as usize], 'Ġ');
        assert_eq!(a.chars[b'\n' as usize], 'Ċ');
        assert_eq!(a.chars[b'a' as usize], 'a');
        let mut seen = std::collections::HashSet::new();
        for c in a.chars {
            assert!(a.contains(c), "{c:?}");
            assert!(seen.insert(c));
        }
        assert_eq!(a.respell("Ġhello"), "Ġhello");
        assert_eq!(a.respell(" hi"), "Ġhi");
        assert_eq!(a.respell("é"), "é");
        assert_eq!(a.respell("a b"), "aĠb");
        assert_eq!(a.respell("日"), "æĹ¥");
    }
}

#[cfg(test)]
pub(crate) mod tests_support {
    /// The 256 byte-level symbols, in byte order.
    pub(crate) fn byte_symbols() -> Vec<char> {
        super::ByteAlphabet::new().chars.to_vec()
    }
}
