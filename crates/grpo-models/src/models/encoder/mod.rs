//! Frozen reward models: BERT / RoBERTa / XLM-RoBERTa / DistilBERT encoders with their
//! `*ForSequenceClassification` heads, decoder sequence classifiers (Llama / Qwen2, see
//! [`crate::models::seq_cls`]) behind one [`SequenceClassifier`], and the sentence-transformers
//! embedder ([`SentenceEmbedder`], mean pooling, e.g. all-MiniLM-L6-v2).
//!
//! Inference only: nothing here records a backward, so the forwards use candle's fused kernels
//! (LayerNorm, softmax). Weights are f32 on the given device. Checkpoints are HF directories
//! (`config.json`, `model.safetensors` / its shards / `pytorch_model.bin`, `tokenizer.json`);
//! the encoder's keys may carry the prefix `bert.`, `roberta.` or `distilbert.` (classifiers)
//! or none (a bare model, as sentence-transformers saves it).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Module, Tensor};
use candle_nn::VarBuilder;
use tokenizers::{PostProcessor, TruncationDirection};

use super::layers::{linear, LayerNorm, Linear, Mode, MASK_VALUE};
use crate::files::require_tokenizer_json;
use crate::kernels::portable::softmax;
use crate::{Error, Result};

// ---------------------------------------------------------------------------------------------
// Checkpoint files
// ---------------------------------------------------------------------------------------------

/// `id2label` names in label order; `LABEL_i` for labels the config does not name. The number
/// of labels is `id2label`'s size, else `num_labels`, else 2 (transformers' default).
pub(crate) fn label_names(config: &serde_json::Value, path: &Path) -> Result<Vec<String>> {
    let id2label = config.get("id2label").and_then(|v| v.as_object());
    let n = match (id2label, config.get("num_labels").and_then(|v| v.as_u64())) {
        (Some(m), _) if !m.is_empty() => m.len(),
        (_, Some(n)) => n as usize,
        _ => 2,
    };
    let mut labels: Vec<String> = (0..n).map(|i| format!("LABEL_{i}")).collect();
    if let Some(m) = id2label {
        for (k, v) in m {
            let i: usize = k.parse().map_err(|_| {
                Error::file(path, format!("id2label key `{k}` is not a label index"))
            })?;
            let slot = labels.get_mut(i).ok_or_else(|| {
                Error::file(
                    path,
                    format!("id2label key {i} is out of range (labels 0..{n})"),
                )
            })?;
            *slot = v
                .as_str()
                .map(str::to_owned)
                .unwrap_or_else(|| v.to_string());
        }
    }
    if labels.is_empty() {
        return Err(Error::file(
            path,
            "the model has no labels (num_labels = 0)",
        ));
    }
    Ok(labels)
}

// ---------------------------------------------------------------------------------------------
// Encoder configuration
// ---------------------------------------------------------------------------------------------

/// Which encoder family; decides the key names, position ids and classification head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncoderKind {
    Bert,
    Roberta,
    XlmRoberta,
    DistilBert,
}

impl EncoderKind {
    /// The kind for a config.json `model_type`, if it is an encoder we support.
    pub fn from_model_type(model_type: &str) -> Option<Self> {
        match model_type {
            "bert" => Some(Self::Bert),
            "roberta" => Some(Self::Roberta),
            "xlm-roberta" => Some(Self::XlmRoberta),
            "distilbert" => Some(Self::DistilBert),
            _ => None,
        }
    }

    /// RoBERTa-family position ids start after the padding index.
    fn roberta_positions(self) -> bool {
        matches!(self, Self::Roberta | Self::XlmRoberta)
    }
}

/// Activation of the feed-forward block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Act {
    /// Exact GELU (`gelu`): `x * Phi(x)`.
    GeluErf,
    /// tanh approximation (`gelu_new`, `gelu_pytorch_tanh`).
    GeluTanh,
    Relu,
}

impl Act {
    fn parse(name: &str, path: &Path) -> Result<Self> {
        match name {
            "gelu" => Ok(Self::GeluErf),
            "gelu_new" | "gelu_pytorch_tanh" => Ok(Self::GeluTanh),
            "relu" => Ok(Self::Relu),
            other => Err(Error::file(
                path,
                format!("activation `{other}` is not supported (gelu, gelu_new, relu)"),
            )),
        }
    }

    pub(crate) fn apply(self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::GeluErf => x.gelu_erf(),
            Self::GeluTanh => x.gelu(),
            Self::Relu => x.relu(),
        }
    }
}

/// An encoder's hyper-parameters, from `config.json` (BERT names, or DistilBERT's `dim`,
/// `n_layers`, ...).
#[derive(Debug, Clone)]
pub struct EncoderConfig {
    pub kind: EncoderKind,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub max_position_embeddings: usize,
    /// 0 for DistilBERT (no token types).
    pub type_vocab_size: usize,
    pub layer_norm_eps: f64,
    pub pad_token_id: u32,
    pub(crate) act: Act,
}

impl EncoderConfig {
    /// Parses `config` (the JSON of `path`) for `kind`.
    pub fn from_json(kind: EncoderKind, config: &serde_json::Value, path: &Path) -> Result<Self> {
        let usize_key = |key: &str| -> Result<usize> {
            config
                .get(key)
                .and_then(|v| v.as_u64())
                .map(|v| v as usize)
                .ok_or_else(|| Error::file(path, format!("missing integer `{key}` in config.json")))
        };
        let str_key = |key: &str, default: &str| -> String {
            config
                .get(key)
                .and_then(|v| v.as_str())
                .unwrap_or(default)
                .to_string()
        };
        let pad_default = if kind.roberta_positions() { 1 } else { 0 };
        let pad_token_id = config
            .get("pad_token_id")
            .and_then(|v| v.as_u64())
            .unwrap_or(pad_default) as u32;
        let cfg = if kind == EncoderKind::DistilBert {
            if config.get("sinusoidal_pos_embds").and_then(|v| v.as_bool()) == Some(true) {
                // transformers fills the (saved) position table with sinusoids; we read it.
                tracing::debug!(
                    "{}: sinusoidal position table read from the weights",
                    path.display()
                );
            }
            Self {
                kind,
                vocab_size: usize_key("vocab_size")?,
                hidden_size: usize_key("dim")?,
                intermediate_size: usize_key("hidden_dim")?,
                num_layers: usize_key("n_layers")?,
                num_heads: usize_key("n_heads")?,
                max_position_embeddings: usize_key("max_position_embeddings")?,
                type_vocab_size: 0,
                layer_norm_eps: 1e-12,
                pad_token_id,
                act: Act::parse(&str_key("activation", "gelu"), path)?,
            }
        } else {
            let pos_type = str_key("position_embedding_type", "absolute");
            if pos_type != "absolute" {
                return Err(Error::file(
                    path,
                    format!("position_embedding_type `{pos_type}` is not supported (absolute)"),
                ));
            }
            Self {
                kind,
                vocab_size: usize_key("vocab_size")?,
                hidden_size: usize_key("hidden_size")?,
                intermediate_size: usize_key("intermediate_size")?,
                num_layers: usize_key("num_hidden_layers")?,
                num_heads: usize_key("num_attention_heads")?,
                max_position_embeddings: usize_key("max_position_embeddings")?,
                type_vocab_size: config
                    .get("type_vocab_size")
                    .and_then(|v| v.as_u64())
                    .unwrap_or(2) as usize,
                layer_norm_eps: config
                    .get("layer_norm_eps")
                    .and_then(|v| v.as_f64())
                    .unwrap_or(1e-12),
                pad_token_id,
                act: Act::parse(&str_key("hidden_act", "gelu"), path)?,
            }
        };
        if cfg.num_heads == 0 || cfg.hidden_size % cfg.num_heads != 0 {
            return Err(Error::file(
                path,
                format!(
                    "hidden size {} is not a multiple of the number of heads {}",
                    cfg.hidden_size, cfg.num_heads
                ),
            ));
        }
        if cfg.max_len() == 0 {
            return Err(Error::file(path, "max_position_embeddings is too small"));
        }
        Ok(cfg)
    }

    /// The longest input in tokens (special tokens included): the position table's size, less
    /// the padding index + 1 slots that RoBERTa-family positions skip.
    pub fn max_len(&self) -> usize {
        if self.kind.roberta_positions() {
            self.max_position_embeddings
                .saturating_sub(self.pad_token_id as usize + 1)
        } else {
            self.max_position_embeddings
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The encoder
// ---------------------------------------------------------------------------------------------

/// One post-LayerNorm transformer block (BERT's and DistilBERT's are the same computation
/// under different names).
#[derive(Debug, Clone)]
struct EncoderLayer {
    query: Linear,
    key: Linear,
    value: Linear,
    attn_out: Linear,
    attn_norm: LayerNorm,
    ffn_in: Linear,
    ffn_out: Linear,
    out_norm: LayerNorm,
    num_heads: usize,
    act: Act,
}

impl EncoderLayer {
    fn load(cfg: &EncoderConfig, vb: VarBuilder) -> candle_core::Result<Self> {
        let (h, i, eps) = (cfg.hidden_size, cfg.intermediate_size, cfg.layer_norm_eps);
        if cfg.kind == EncoderKind::DistilBert {
            let a = vb.pp("attention");
            return Ok(Self {
                query: linear(h, h, true, a.pp("q_lin"))?,
                key: linear(h, h, true, a.pp("k_lin"))?,
                value: linear(h, h, true, a.pp("v_lin"))?,
                attn_out: linear(h, h, true, a.pp("out_lin"))?,
                attn_norm: LayerNorm::load(h, eps, vb.pp("sa_layer_norm"))?,
                ffn_in: linear(h, i, true, vb.pp("ffn").pp("lin1"))?,
                ffn_out: linear(i, h, true, vb.pp("ffn").pp("lin2"))?,
                out_norm: LayerNorm::load(h, eps, vb.pp("output_layer_norm"))?,
                num_heads: cfg.num_heads,
                act: cfg.act,
            });
        }
        let a = vb.pp("attention");
        Ok(Self {
            query: linear(h, h, true, a.pp("self").pp("query"))?,
            key: linear(h, h, true, a.pp("self").pp("key"))?,
            value: linear(h, h, true, a.pp("self").pp("value"))?,
            attn_out: linear(h, h, true, a.pp("output").pp("dense"))?,
            attn_norm: LayerNorm::load(h, eps, a.pp("output").pp("LayerNorm"))?,
            ffn_in: linear(h, i, true, vb.pp("intermediate").pp("dense"))?,
            ffn_out: linear(i, h, true, vb.pp("output").pp("dense"))?,
            out_norm: LayerNorm::load(h, eps, vb.pp("output").pp("LayerNorm"))?,
            num_heads: cfg.num_heads,
            act: cfg.act,
        })
    }

    /// `x` [B, T, H]; `mask` [B, 1, 1, T] additive (0 or MASK_VALUE at padding keys).
    fn forward(&self, x: &Tensor, mask: &Tensor, mode: Mode) -> candle_core::Result<Tensor> {
        let (b, t, h) = x.dims3()?;
        let (nh, hd) = (self.num_heads, h / self.num_heads);
        let heads = |p: &Linear| -> candle_core::Result<Tensor> {
            p.forward(x)? // [B, T, H]
                .reshape((b, t, nh, hd))?
                .transpose(1, 2)? // [B, nh, T, hd]
                .contiguous()
        };
        let (q, k, v) = (heads(&self.query)?, heads(&self.key)?, heads(&self.value)?);
        let scores = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?; // [B, nh, T, T]
        let probs = softmax(&scores.broadcast_add(mask)?, mode)?;
        let ctx = probs
            .matmul(&v)? // [B, nh, T, hd]
            .transpose(1, 2)?
            .reshape((b, t, h))?; // [B, T, H]
        let x = self
            .attn_norm
            .forward(&(x + self.attn_out.forward(&ctx)?)?, mode)?; // [B, T, H]
        let ff = self.act.apply(&self.ffn_in.forward(&x)?)?; // [B, T, I]
        self.out_norm
            .forward(&(x + self.ffn_out.forward(&ff)?)?, mode) // [B, T, H]
    }
}

/// Embeddings and transformer blocks of a BERT-like encoder.
#[derive(Debug, Clone)]
pub struct Encoder {
    cfg: EncoderConfig,
    word: Tensor,
    position: Tensor,
    token_type: Option<Tensor>,
    embed_norm: LayerNorm,
    layers: Vec<EncoderLayer>,
}

/// A padded batch for the encoder (right padding).
#[derive(Debug)]
pub struct EncoderBatch {
    /// [B, T] token ids (padding: the pad id).
    pub ids: Vec<Vec<u32>>,
    /// [B, T] token types (0 where the model has none).
    pub type_ids: Vec<Vec<u32>>,
    /// Real tokens per row.
    pub lengths: Vec<usize>,
}

impl Encoder {
    /// `vb` is rooted at the encoder (`embeddings.*`, `encoder.*` / `transformer.*`).
    pub(crate) fn load(cfg: &EncoderConfig, vb: VarBuilder) -> candle_core::Result<Self> {
        let h = cfg.hidden_size;
        let e = vb.pp("embeddings");
        let token_type = if cfg.type_vocab_size > 0 {
            Some(
                e.pp("token_type_embeddings")
                    .get((cfg.type_vocab_size, h), "weight")?,
            )
        } else {
            None
        };
        let blocks = if cfg.kind == EncoderKind::DistilBert {
            vb.pp("transformer").pp("layer")
        } else {
            vb.pp("encoder").pp("layer")
        };
        Ok(Self {
            word: e.pp("word_embeddings").get((cfg.vocab_size, h), "weight")?,
            position: e
                .pp("position_embeddings")
                .get((cfg.max_position_embeddings, h), "weight")?,
            token_type,
            embed_norm: LayerNorm::load(h, cfg.layer_norm_eps, e.pp("LayerNorm"))?,
            layers: (0..cfg.num_layers)
                .map(|i| EncoderLayer::load(cfg, blocks.pp(i)))
                .collect::<candle_core::Result<Vec<_>>>()?,
            cfg: cfg.clone(),
        })
    }

    pub fn config(&self) -> &EncoderConfig {
        &self.cfg
    }

    /// Position ids: 0.. per row; for RoBERTa-family models `pad + 1 + ` the count of non-pad
    /// tokens so far, and `pad` at pad tokens (transformers' rule, which looks at the ids).
    fn position_ids(&self, ids: &[u32]) -> Vec<u32> {
        if !self.cfg.kind.roberta_positions() {
            return (0..ids.len() as u32).collect();
        }
        let pad = self.cfg.pad_token_id;
        let mut seen = 0;
        ids.iter()
            .map(|&id| {
                if id == pad {
                    pad
                } else {
                    seen += 1;
                    pad + seen
                }
            })
            .collect()
    }

    /// Final hidden states [B, T, H] of a right-padded batch (fused kernels, no backward).
    pub fn forward(&self, batch: &EncoderBatch) -> Result<Tensor> {
        self.forward_mode(batch, Mode::Infer)
    }

    /// The word embedding table [V, H] (MLM heads tie their decoder to it).
    pub fn word_embeddings(&self) -> &Tensor {
        &self.word
    }

    /// [`Encoder::forward`] with the kernels of `mode` (`Train`: a graph back to every weight).
    pub fn forward_mode(&self, batch: &EncoderBatch, mode: Mode) -> Result<Tensor> {
        let dev = self.word.device();
        let b = batch.ids.len();
        let t = batch.ids.first().map_or(0, Vec::len);
        if b == 0 || t == 0 {
            return Err(Error::ModelInput(
                "an empty encoder batch (no texts, or texts with no tokens)".into(),
            ));
        }
        let flat = |rows: Vec<Vec<u32>>| rows.into_iter().flatten().collect::<Vec<u32>>();
        let positions = flat(batch.ids.iter().map(|r| self.position_ids(r)).collect());
        let ids = Tensor::from_vec(flat(batch.ids.clone()), b * t, dev)?; // [B*T]
        let positions = Tensor::from_vec(positions, b * t, dev)?; // [B*T]
        let h = self.cfg.hidden_size;
        let mut x =
            (self.word.index_select(&ids, 0)? + self.position.index_select(&positions, 0)?)?; // [B*T, H]
        if let Some(tt) = &self.token_type {
            let types = Tensor::from_vec(flat(batch.type_ids.clone()), b * t, dev)?; // [B*T]
            x = (x + tt.index_select(&types, 0)?)?;
        }
        let mut x = self.embed_norm.forward(&x.reshape((b, t, h))?, mode)?; // [B, T, H]
        let mask: Vec<f32> = batch
            .lengths
            .iter()
            .flat_map(|&n| (0..t).map(move |j| if j < n { 0.0 } else { MASK_VALUE }))
            .collect();
        let mask = Tensor::from_vec(mask, (b, 1, 1, t), dev)?; // [B, 1, 1, T]
        for layer in &self.layers {
            x = layer.forward(&x, &mask, mode)?;
        }
        Ok(x)
    }
}

/// Where the encoder's keys start: `bert.`, `roberta.`, `distilbert.` or nothing.
pub(crate) fn encoder_prefix(
    tensors: &HashMap<String, Tensor>,
    origin: &Path,
) -> Result<&'static str> {
    ["bert.", "roberta.", "distilbert.", ""]
        .into_iter()
        .find(|p| tensors.contains_key(&format!("{p}embeddings.word_embeddings.weight")))
        .ok_or_else(|| {
            Error::file(
                origin,
                "missing tensor `embeddings.word_embeddings.weight` (looked for it with the \
                 prefixes bert., roberta., distilbert. and none): not a BERT-like checkpoint",
            )
        })
}

/// `vb` moved to the encoder's keys (`prefix` from [`encoder_prefix`]).
pub(crate) fn encoder_root<'a>(vb: &VarBuilder<'a>, prefix: &str) -> VarBuilder<'a> {
    match prefix.strip_suffix('.') {
        Some(p) => vb.pp(p),
        None => vb.clone(),
    }
}

/// The text tokenizer of an encoder: `tokenizer.json` without the file's own padding and
/// truncation settings; inputs are truncated to `max_len` tokens (special tokens included) as
/// transformers' `truncation=True` does (see [`longest_first`]).
#[derive(Clone)]
pub(crate) struct EncoderTokenizer {
    pub(crate) inner: tokenizers::Tokenizer,
    pub(crate) path: PathBuf,
    max_len: usize,
    lowercase: bool,
}

/// Lengths `(a, b)` to keep of a text pair of `na` and `nb` tokens within `budget` tokens,
/// longest first: only the longer part is cut while the shorter fits in half the budget, else
/// both get half and the longer one (the pair on a tie) the odd token. This is what the Python
/// `tokenizers` 0.23.3 behind transformers does; the Rust crate 0.23.2 gives the odd token to
/// the pair when both parts exceed the budget, so the rule is applied here rather than there.
fn longest_first(na: usize, nb: usize, budget: usize) -> (usize, usize) {
    if na + nb <= budget {
        return (na, nb);
    }
    let (short, long) = (na.min(nb), na.max(nb));
    let (mut s, mut l) = (short, short.max(budget.saturating_sub(short)).min(long));
    if s + l > budget {
        s = budget / 2;
        l = s + budget % 2;
    }
    if na > nb {
        (l, s)
    } else {
        (s, l)
    }
}

impl EncoderTokenizer {
    pub(crate) fn load(dir: &Path, max_len: usize, lowercase: bool) -> Result<Self> {
        let path = require_tokenizer_json(dir)?;
        let mut inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| Error::file(&path, format!("not a valid tokenizer.json: {e}")))?;
        inner.with_padding(None);
        inner
            .with_truncation(None)
            .map_err(|e| Error::file(&path, format!("cannot disable truncation: {e}")))?;
        Ok(Self {
            inner,
            path,
            max_len,
            lowercase,
        })
    }

    /// (ids, type ids) of a text or text pair, special tokens added.
    pub(crate) fn encode(&self, text: &str, pair: Option<&str>) -> Result<(Vec<u32>, Vec<u32>)> {
        let lower = |s: &str| {
            if self.lowercase {
                s.to_lowercase()
            } else {
                s.to_string()
            }
        };
        let err = |e| Error::Tokenizer(format!("encoding with {}: {e}", self.path.display()));
        let mut a = self.inner.encode(lower(text), false).map_err(err)?;
        let mut b = match pair {
            Some(p) => Some(self.inner.encode(lower(p), false).map_err(err)?),
            None => None,
        };
        let added = self
            .inner
            .get_post_processor()
            .map_or(0, |p| p.added_tokens(b.is_some()));
        let budget = self.max_len.saturating_sub(added);
        let nb = b.as_ref().map_or(0, |b| b.len());
        let (keep_a, keep_b) = longest_first(a.len(), nb, budget);
        a.truncate(keep_a, 0, TruncationDirection::Right);
        if let Some(b) = b.as_mut() {
            b.truncate(keep_b, 0, TruncationDirection::Right);
        }
        let enc = self.inner.post_process(a, b, true).map_err(err)?;
        Ok((enc.get_ids().to_vec(), enc.get_type_ids().to_vec()))
    }
}

/// Encodes `inputs` and pads them on the right into an [`EncoderBatch`].
fn encoder_batch(
    tok: &EncoderTokenizer,
    cfg: &EncoderConfig,
    inputs: &[(&str, Option<&str>)],
) -> Result<EncoderBatch> {
    let mut rows = Vec::with_capacity(inputs.len());
    for (text, pair) in inputs {
        let (ids, types) = tok.encode(text, *pair)?;
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= cfg.vocab_size) {
            return Err(Error::Tokenizer(format!(
                "{} produced token id {bad}, outside the model's vocabulary ({})",
                tok.path.display(),
                cfg.vocab_size
            )));
        }
        // Only BERT uses segment ids; RoBERTa-family models have one token type.
        let types = if cfg.kind == EncoderKind::Bert {
            types
                .into_iter()
                .map(|t| t.min(cfg.type_vocab_size.saturating_sub(1) as u32))
                .collect()
        } else {
            vec![0; ids.len()]
        };
        rows.push((ids, types));
    }
    let t = rows.iter().map(|(i, _)| i.len()).max().unwrap_or(0);
    let mut batch = EncoderBatch {
        ids: vec![],
        type_ids: vec![],
        lengths: vec![],
    };
    for (mut ids, mut types) in rows {
        batch.lengths.push(ids.len());
        ids.resize(t, cfg.pad_token_id);
        types.resize(t, 0);
        batch.ids.push(ids);
        batch.type_ids.push(types);
    }
    Ok(batch)
}

mod classifier;
mod embedder;

pub use classifier::*;
pub use embedder::*;

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn cfg(kind: EncoderKind, pad: u32) -> EncoderConfig {
        EncoderConfig {
            kind,
            vocab_size: 10,
            hidden_size: 4,
            intermediate_size: 8,
            num_layers: 0,
            num_heads: 2,
            max_position_embeddings: 16,
            type_vocab_size: 1,
            layer_norm_eps: 1e-12,
            pad_token_id: pad,
            act: Act::GeluErf,
        }
    }

    fn encoder(kind: EncoderKind, pad: u32) -> Encoder {
        let dev = Device::Cpu;
        let z = |r: usize| Tensor::zeros((r, 4), DType::F32, &dev).unwrap();
        let mut map = HashMap::new();
        map.insert("embeddings.word_embeddings.weight".into(), z(10));
        map.insert("embeddings.position_embeddings.weight".into(), z(16));
        map.insert("embeddings.token_type_embeddings.weight".into(), z(1));
        map.insert(
            "embeddings.LayerNorm.weight".into(),
            Tensor::ones(4, DType::F32, &dev).unwrap(),
        );
        map.insert(
            "embeddings.LayerNorm.bias".into(),
            Tensor::zeros(4, DType::F32, &dev).unwrap(),
        );
        let vb = VarBuilder::from_tensors(map, DType::F32, &dev);
        Encoder::load(&cfg(kind, pad), vb).unwrap()
    }

    #[test]
    fn roberta_positions_skip_pads() {
        let e = encoder(EncoderKind::Roberta, 1);
        assert_eq!(e.position_ids(&[0, 5, 7, 2, 1, 1]), vec![2, 3, 4, 5, 1, 1]);
        let e = encoder(EncoderKind::Bert, 0);
        assert_eq!(e.position_ids(&[2, 5, 0]), vec![0, 1, 2]);
        assert_eq!(cfg(EncoderKind::XlmRoberta, 1).max_len(), 14);
        assert_eq!(cfg(EncoderKind::Bert, 0).max_len(), 16);
    }

    /// The Python tokenizers' longest-first lengths, measured (budget 61).
    #[test]
    fn longest_first_matches_python_tokenizers() {
        for ((na, nb), want) in [
            ((120, 100), (31, 30)),
            ((100, 120), (30, 31)),
            ((50, 50), (30, 31)),
            ((61, 61), (30, 31)),
            ((40, 100), (30, 31)),
            ((100, 40), (31, 30)),
            ((10, 100), (10, 51)),
            ((30, 32), (30, 31)),
            ((32, 30), (31, 30)),
            ((70, 29), (32, 29)),
            ((20, 30), (20, 30)),
            ((100, 0), (61, 0)),
        ] {
            assert_eq!(longest_first(na, nb, 61), want, "{na} {nb}");
        }
    }

    #[test]
    fn labels_default_and_named() {
        let p = Path::new("config.json");
        let v = serde_json::json!({"num_labels": 3});
        assert_eq!(
            label_names(&v, p).unwrap(),
            ["LABEL_0", "LABEL_1", "LABEL_2"]
        );
        let v = serde_json::json!({"id2label": {"1": "pos", "0": "neg"}});
        assert_eq!(label_names(&v, p).unwrap(), ["neg", "pos"]);
        assert_eq!(label_names(&serde_json::json!({}), p).unwrap().len(), 2);
        let v = serde_json::json!({"id2label": {"5": "x"}});
        assert!(label_names(&v, p)
            .unwrap_err()
            .to_string()
            .contains("id2label"));
    }

    /// Exact GELU against the erf formula on a few points (a plain-f64 twin).
    #[test]
    fn gelu_is_exact() {
        let xs = [-3.0f32, -1.0, -0.1, 0.0, 0.5, 2.0];
        let t = Tensor::new(&xs[..], &Device::Cpu).unwrap();
        let got = Act::GeluErf.apply(&t).unwrap().to_vec1::<f32>().unwrap();
        for (x, g) in xs.iter().zip(got) {
            let x = *x as f64;
            // erf via its series (converges fast for |x| <= 3 / sqrt 2).
            let z = x / std::f64::consts::SQRT_2;
            let mut term = z;
            let mut erf = z;
            for n in 1..60 {
                term *= -z * z / n as f64;
                erf += term / (2 * n + 1) as f64;
            }
            let erf = erf * 2.0 / std::f64::consts::PI.sqrt();
            let want = 0.5 * x * (1.0 + erf);
            assert!(
                (g as f64 - want).abs() < 1e-5,
                "gelu({x}) = {g}, want {want}"
            );
        }
    }
}
