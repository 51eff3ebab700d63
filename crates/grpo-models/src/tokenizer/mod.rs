//! Tokenization with the ids HF transformers would produce, from an HF tokenizer directory
//! (`tokenizer.json` + `tokenizer_config.json`) or from GGUF metadata, and chat templates rendered
//! like transformers' `apply_chat_template`.
//!
//! - [`Tokenizer::from_hf_dir`] runs the directory's `tokenizer.json` through the `tokenizers`
//!   crate (the library behind transformers' fast tokenizers), so ids are HF's by construction.
//!   Special-token strings and the chat template come from `tokenizer_config.json` /
//!   `chat_template.jinja`, with transformers' precedence.
//! - [`Tokenizer::from_gguf`] rebuilds the HF tokenizer from `tokenizer.ggml.*`: the vocabulary and
//!   merges, with the normalizer and pre-tokenizer chosen by `tokenizer.ggml.pre` (see
//!   [`Tokenizer::from_gguf`] for the supported values). It never adds a prefix space unless
//!   `tokenizer.ggml.add_space_prefix` says so, and adds BOS only when `tokenizer.ggml.add_bos_token`
//!   is set.

mod chat;
mod gguf;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use tokenizers::{AddedToken, ModelWrapper};

use self::chat::ChatTemplate;
use crate::error::{Error, Result};

/// One chat message, as in transformers' `[{"role": ..., "content": ...}]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// The named special tokens transformers hands to chat templates (`special_tokens_map`).
const SPECIAL_TOKEN_NAMES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// A tokenizer plus its special tokens and chat template.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Ids put around the text when encoding with special tokens, for tokenizers whose
    /// post-processing is not inside `inner` (GGUF: `add_bos_token` / `add_eos_token`).
    prepend: Option<u32>,
    append: Option<u32>,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    pad_id: Option<u32>,
    /// (variable name, token string) of the named special tokens, for the chat template.
    template_tokens: Vec<(String, String)>,
    /// Extra chat-template variables (`chat_template_kwargs`).
    template_kwargs: Vec<(String, serde_json::Value)>,
    chat: Option<ChatTemplate>,
    /// Why there is no chat template, for the error message.
    no_chat_reason: String,
    /// transformers' `clean_up_tokenization_spaces` on decode (never for BPE, as in transformers 5).
    clean_up_spaces: bool,
    vocab_size: usize,
    /// Where the tokenizer came from (directory or GGUF file), for messages.
    source: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("source", &self.source)
            .field("vocab_size", &self.vocab_size)
            .field("bos_id", &self.bos_id)
            .field("eos_id", &self.eos_id)
            .field("pad_id", &self.pad_id)
            .field(
                "chat_template",
                &self.chat.as_ref().map(ChatTemplate::origin),
            )
            .finish_non_exhaustive()
    }
}

/// Reads a UTF-8 file; a missing file is reported with `missing_hint`.
fn read_text(path: &Path, missing_hint: &str) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            Error::file(path, format!("not found ({missing_hint})"))
        } else {
            Error::file(path, format!("cannot read: {e}"))
        }
    })
}

/// A special token in tokenizer_config.json: a string or an AddedToken object `{"content": ...}`.
fn token_string(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(m) => {
            m.get("content").and_then(|c| c.as_str()).map(str::to_owned)
        }
        _ => None,
    }
}

fn vocab_size_of(inner: &tokenizers::Tokenizer) -> usize {
    inner
        .get_vocab(true)
        .values()
        .max()
        .map_or(0, |&m| m as usize + 1)
}

impl Tokenizer {
    /// Loads an HF tokenizer directory: `tokenizer.json` (required), `tokenizer_config.json`
    /// (optional: special tokens, `chat_template`) and `chat_template.jinja` (optional).
    ///
    /// As in transformers 5: `chat_template.jinja` takes priority over the config's
    /// `chat_template`; a list of named templates uses the one named "default"; special tokens the
    /// config names but `tokenizer.json` lacks are added; BOS/EOS insertion is `tokenizer.json`'s
    /// post-processor's business (transformers drops the config's `add_bos_token` /
    /// `add_eos_token` when a `tokenizer.json` is present).
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let tok_path = dir.join("tokenizer.json");
        let text = read_text(
            &tok_path,
            "an HF tokenizer directory must contain tokenizer.json",
        )?;
        let mut inner = tokenizers::Tokenizer::from_str(&text)
            .map_err(|e| Error::file(&tok_path, format!("not a valid tokenizer.json: {e}")))?;
        inner
            .with_truncation(None)
            .map_err(|e| Error::file(&tok_path, format!("cannot disable truncation: {e}")))?;
        inner.with_padding(None);

        let cfg_path = dir.join("tokenizer_config.json");
        let config = read_tokenizer_config(&cfg_path)?;
        let template_tokens = named_special_tokens(&config);
        let missing: Vec<AddedToken> = template_tokens
            .iter()
            .filter(|(_, s)| !s.is_empty() && inner.token_to_id(s).is_none())
            .map(|(_, s)| AddedToken::from(s.clone(), true))
            .collect();
        if !missing.is_empty() {
            inner
                .add_special_tokens(missing)
                .map_err(|e| Error::file(&cfg_path, format!("cannot add special tokens: {e}")))?;
        }
        let id_of = |name: &str| {
            template_tokens
                .iter()
                .find(|(n, _)| n == name)
                .and_then(|(_, s)| inner.token_to_id(s))
        };
        let (bos_id, eos_id, pad_id) = (id_of("bos_token"), id_of("eos_token"), id_of("pad_token"));

        let (chat, no_chat_reason) = hf_chat_template(dir, &cfg_path, &config)?;

        let clean_up_spaces = config
            .get("clean_up_tokenization_spaces")
            .and_then(|v| v.as_bool())
            .unwrap_or(false)
            && !matches!(inner.get_model(), ModelWrapper::BPE(_));

        let vocab_size = vocab_size_of(&inner);
        Ok(Self {
            inner,
            prepend: None,
            append: None,
            bos_id,
            eos_id,
            pad_id,
            template_tokens,
            template_kwargs: vec![],
            chat,
            no_chat_reason,
            clean_up_spaces,
            vocab_size,
            source: dir.to_path_buf(),
        })
    }

    /// Builds the tokenizer from GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`).
    /// `path` is only used in error messages.
    ///
    /// Supported: `tokenizer.ggml.model` = "gpt2" (byte-level BPE) with `tokenizer.ggml.pre` one of
    /// "default"/"gpt-2"/"gpt2", "smollm", "starcoder", "qwen2", "llama-bpe"/"llama3"/"llama-v3". Anything else
    /// (including SentencePiece "llama" vocabularies) is an error that says to use the HF tokenizer.
    pub fn from_gguf(
        content: &candle_core::quantized::gguf_file::Content,
        path: &Path,
    ) -> Result<Self> {
        let g = gguf::build(content, path)?;
        let name_of = |id: Option<u32>| id.and_then(|i| g.tokens.get(i as usize).cloned());
        // transformers' GGUF loader names exactly these four.
        let template_tokens: Vec<(String, String)> = [
            ("bos_token", g.bos),
            ("eos_token", g.eos),
            ("unk_token", g.unk),
            ("pad_token", g.pad),
        ]
        .into_iter()
        .filter_map(|(name, id)| name_of(id).map(|s| (name.to_owned(), s)))
        .collect();
        let chat = match &g.chat_template {
            Some(source) => Some(ChatTemplate::compile(
                source,
                format!("{} (`tokenizer.chat_template`)", path.display()),
            )?),
            None => None,
        };
        let vocab_size = vocab_size_of(&g.inner).max(g.tokens.len());
        Ok(Self {
            prepend: if g.add_bos { g.bos } else { None },
            append: if g.add_eos { g.eos } else { None },
            bos_id: g.bos,
            eos_id: g.eos,
            pad_id: g.pad,
            template_tokens,
            template_kwargs: vec![],
            chat,
            no_chat_reason: format!("{} has no `tokenizer.chat_template`", path.display()),
            clean_up_spaces: false,
            vocab_size,
            source: path.to_path_buf(),
            inner: g.inner,
        })
    }

    /// Replaces the chat template (e.g. from a `--chat-template` file). `origin` names where it
    /// came from, for error messages.
    pub fn with_chat_template(mut self, source: &str, origin: &str) -> Result<Self> {
        self.chat = Some(ChatTemplate::compile(source, origin)?);
        Ok(self)
    }

    /// Token ids of `text`. Special-token strings in the text (e.g. `<|im_end|>`) are matched as
    /// such. `add_special_tokens` adds what the tokenizer adds around a sequence (BOS/EOS), which
    /// for many tokenizers, SmolLM2's included, is nothing.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| {
                Error::Tokenizer(format!("encoding with {}: {e}", self.source.display()))
            })?;
        let ids = encoding.get_ids();
        if !add_special_tokens || (self.prepend.is_none() && self.append.is_none()) {
            return Ok(ids.to_vec());
        }
        let mut out = Vec::with_capacity(ids.len() + 2);
        out.extend(self.prepend);
        out.extend_from_slice(ids);
        out.extend(self.append);
        Ok(out)
    }

    /// Text of `ids`; `skip_special_tokens` drops special tokens (BOS, EOS, `<|im_start|>`, ...).
    /// Ids outside the vocabulary are skipped, as HF does.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        let text = self.inner.decode(ids, skip_special_tokens).map_err(|e| {
            Error::Tokenizer(format!("decoding with {}: {e}", self.source.display()))
        })?;
        Ok(if self.clean_up_spaces {
            clean_up_tokenization(&text)
        } else {
            text
        })
    }

    /// Vocabulary size including added tokens (largest id + 1).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token's string as the vocabulary spells it (byte-level BPE: `Ġ` for a space, ...).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_id
    }

    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_id
    }

    pub fn pad_token_id(&self) -> Option<u32> {
        self.pad_id
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat.is_some()
    }

    /// The `tokenizer.*` metadata of a GGUF file (llama.cpp's keys) for this tokenizer, its
    /// vocabulary padded to `vocab_size` entries (the model's embedding rows). Byte-level BPE
    /// tokenizers whose pre-tokenizer llama.cpp knows by name (GPT-2, SmolLM, Qwen2, Llama 3)
    /// only; [`Tokenizer::from_gguf`] reads it back.
    pub fn gguf_metadata(
        &self,
        vocab_size: usize,
    ) -> Result<Vec<(String, candle_core::quantized::gguf_file::Value)>> {
        gguf::metadata(self, vocab_size)
    }

    /// Writes `tokenizer.json` and `tokenizer_config.json` (special tokens, chat template) into
    /// `dir`, so that [`Tokenizer::from_hf_dir`] and transformers' `AutoTokenizer` load it back.
    pub fn save_hf_dir(&self, dir: &Path) -> Result<()> {
        let json = self
            .inner
            .to_string(false)
            .map_err(|e| Error::Tokenizer(format!("cannot serialise the tokenizer: {e}")))?;
        let write = |name: &str, text: &str| {
            std::fs::write(dir.join(name), text)
                .map_err(|e| Error::file(dir.join(name), format!("cannot write: {e}")))
        };
        write("tokenizer.json", &json)?;
        let tok = |id: Option<u32>| {
            id.and_then(|i| self.id_to_token(i))
                .map(serde_json::Value::String)
        };
        let mut cfg = serde_json::Map::new();
        cfg.insert("tokenizer_class".into(), "PreTrainedTokenizerFast".into());
        for (k, id) in [
            ("bos_token", self.bos_id),
            ("eos_token", self.eos_id),
            ("pad_token", self.pad_id),
        ] {
            if let Some(v) = tok(id) {
                cfg.insert(k.into(), v);
            }
        }
        cfg.insert("add_bos_token".into(), self.prepend.is_some().into());
        cfg.insert("add_eos_token".into(), self.append.is_some().into());
        cfg.insert(
            "clean_up_tokenization_spaces".into(),
            self.clean_up_spaces.into(),
        );
        cfg.insert(
            "model_max_length".into(),
            serde_json::json!(1_000_000_000_000_000_000u64),
        );
        if let Some(t) = &self.chat {
            cfg.insert("chat_template".into(), t.source().into());
        }
        let text = serde_json::to_string_pretty(&serde_json::Value::Object(cfg))
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        write("tokenizer_config.json", &text)
    }

    /// Passes `kwargs` to the chat template as variables (transformers'
    /// `apply_chat_template(..., **kwargs)`; TRL's `chat_template_kwargs`).
    pub fn with_template_kwargs(
        mut self,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Self {
        self.template_kwargs = kwargs.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        self
    }

    /// Sets one chat-template variable for every rendering from now on (replacing a variable of
    /// that name): `tools` (the JSON schemas of an agent's tools, as transformers'
    /// `apply_chat_template(tools=...)` passes them), or any `chat_template_kwargs` entry.
    pub fn with_template_var(mut self, name: &str, value: serde_json::Value) -> Self {
        self.template_kwargs.retain(|(k, _)| k != name);
        self.template_kwargs.push((name.to_string(), value));
        self
    }

    /// The chat template's text, when there is one.
    pub fn chat_template_source(&self) -> Option<&str> {
        self.chat.as_ref().map(|t| t.source())
    }

    /// Renders `messages` with the chat template, like transformers'
    /// `apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        match &self.chat {
            Some(template) => template.render(
                messages,
                add_generation_prompt,
                &self.template_tokens,
                &self.template_kwargs,
            ),
            None => Err(Error::Tokenizer(format!(
                "no chat template: {}; use --no-chat to feed prompts as plain text, or supply a chat \
                 template (a `chat_template` in tokenizer_config.json or a chat_template.jinja next to it)",
                self.no_chat_reason
            ))),
        }
    }

    /// Renders `messages` and encodes the text without adding special tokens, as transformers'
    /// `apply_chat_template(tokenize=True)` does (the template writes them itself).
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let text = self.apply_chat_template(messages, add_generation_prompt)?;
        self.encode(&text, false)
    }
}

/// transformers' `clean_up_tokenization` (WordPiece-era space cleanup).
fn clean_up_tokenization(text: &str) -> String {
    text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
}

/// `tokenizer_config.json` as a JSON object (empty when the file is absent).
fn read_tokenizer_config(cfg_path: &Path) -> Result<serde_json::Map<String, serde_json::Value>> {
    match std::fs::read_to_string(cfg_path) {
        Ok(text) => match serde_json::from_str::<serde_json::Value>(&text) {
            Ok(serde_json::Value::Object(m)) => Ok(m),
            Ok(_) => Err(Error::file(cfg_path, "not a JSON object")),
            Err(e) => Err(Error::file(cfg_path, format!("invalid JSON: {e}"))),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(serde_json::Map::new()),
        Err(e) => Err(Error::file(cfg_path, format!("cannot read: {e}"))),
    }
}

/// The config's named special tokens (`bos_token`, ...), then any `extra_special_tokens` given
/// by name: (name, token) pairs, as chat templates read them.
fn named_special_tokens(
    config: &serde_json::Map<String, serde_json::Value>,
) -> Vec<(String, String)> {
    let mut tokens: Vec<(String, String)> = SPECIAL_TOKEN_NAMES
        .iter()
        .filter_map(|&name| {
            config
                .get(name)
                .and_then(token_string)
                .map(|s| (name.to_owned(), s))
        })
        .collect();
    if let Some(serde_json::Value::Object(extra)) = config.get("extra_special_tokens") {
        for (name, v) in extra {
            if let Some(s) = token_string(v) {
                if !tokens.iter().any(|(n, _)| n == name) {
                    tokens.push((name.clone(), s));
                }
            }
        }
    }
    tokens
}

/// An HF directory's chat template: `chat_template.jinja`, else the config's `chat_template` (a
/// string, or the list entry named "default"); without one, why not (for the error a chat
/// prompt then gets).
fn hf_chat_template(
    dir: &Path,
    cfg_path: &Path,
    config: &serde_json::Map<String, serde_json::Value>,
) -> Result<(Option<ChatTemplate>, String)> {
    let jinja_path = dir.join("chat_template.jinja");
    let mut no_chat_reason = format!(
        "neither {} has a `chat_template` nor is there a {}",
        cfg_path.display(),
        jinja_path.display()
    );
    let chat = if jinja_path.is_file() {
        let source = read_text(&jinja_path, "")?;
        Some(ChatTemplate::compile(
            &source,
            jinja_path.display().to_string(),
        )?)
    } else {
        let origin = format!("{} (`chat_template`)", cfg_path.display());
        match config.get("chat_template") {
            Some(serde_json::Value::String(s)) => Some(ChatTemplate::compile(s, origin)?),
            Some(serde_json::Value::Array(list)) => {
                let named: Vec<(&str, &str)> = list
                    .iter()
                    .filter_map(|t| Some((t.get("name")?.as_str()?, t.get("template")?.as_str()?)))
                    .collect();
                match named.iter().find(|(n, _)| *n == "default") {
                    Some((_, s)) => {
                        Some(ChatTemplate::compile(s, format!("{origin}, \"default\""))?)
                    }
                    None => {
                        let names: Vec<&str> = named.iter().map(|(n, _)| *n).collect();
                        no_chat_reason = format!(
                            "{} has named chat templates ({}) but none named \"default\"",
                            cfg_path.display(),
                            names.join(", ")
                        );
                        None
                    }
                }
            }
            Some(serde_json::Value::Null) | None => None,
            Some(_) => return Err(Error::file(
                cfg_path,
                "`chat_template` must be a string or a list of {\"name\", \"template\"} objects",
            )),
        }
    };
    Ok((chat, no_chat_reason))
}
