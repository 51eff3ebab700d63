//! Sentence embeddings: sentence-transformers' embedder (an encoder, then pooling).

use std::path::Path;

use candle_core::{DType, Device, Tensor, D};
use candle_nn::VarBuilder;

use super::*;
use crate::files::{read_json, read_weights};
use crate::{Error, Result};

/// How token states become one vector (sentence-transformers' Pooling module).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pooling {
    Mean,
    Cls,
}

/// A sentence-transformers model (Transformer -> Pooling -> optional Normalize), e.g.
/// all-MiniLM-L6-v2.
#[derive(Clone)]
pub struct SentenceEmbedder {
    encoder: Encoder,
    tokenizer: EncoderTokenizer,
    pooling: Pooling,
    normalize: bool,
}

impl std::fmt::Debug for SentenceEmbedder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentenceEmbedder")
            .field("tokenizer", &self.tokenizer.path)
            .field("pooling", &self.pooling)
            .field("normalize", &self.normalize)
            .finish_non_exhaustive()
    }
}

impl SentenceEmbedder {
    /// Loads a sentence-transformers directory (`modules.json`, `1_Pooling/config.json`,
    /// `sentence_bert_config.json`), or a plain HF encoder directory (mean pooling, no
    /// normalization, the model's maximum length).
    pub fn load(dir: &Path, device: &Device) -> Result<Self> {
        let modules_path = dir.join("modules.json");
        let mut model_dir = dir.to_path_buf();
        let mut pooling = Pooling::Mean;
        let mut normalize = false;
        if modules_path.is_file() {
            let modules = read_json(&modules_path)?;
            let list = modules
                .as_array()
                .ok_or_else(|| Error::file(&modules_path, "expected a list of modules"))?;
            for m in list {
                let ty = m.get("type").and_then(|v| v.as_str()).ok_or_else(|| {
                    Error::file(
                        &modules_path,
                        format!(
                            "module {m} has no `type`: give each module its class, e.g. \
                             \"sentence_transformers.models.Transformer\""
                        ),
                    )
                })?;
                // No path: the module is the directory itself (sentence-transformers writes "").
                let sub = dir.join(m.get("path").and_then(|v| v.as_str()).unwrap_or_default());
                // rsplit always yields a last piece.
                match ty.rsplit('.').next().unwrap_or_default() {
                    "Transformer" => model_dir = sub,
                    "Pooling" => pooling = read_pooling(&sub.join("config.json"))?,
                    "Normalize" => normalize = true,
                    other => {
                        return Err(Error::file(
                            &modules_path,
                            format!(
                                "module `{other}` ({ty}) is not supported (Transformer, \
                                 Pooling, Normalize)"
                            ),
                        ))
                    }
                }
            }
        }
        let config_path = model_dir.join("config.json");
        let config = read_json(&config_path)?;
        let model_type = config
            .get("model_type")
            .and_then(|v| v.as_str())
            // A missing model_type matches no kind and is refused below.
            .unwrap_or_default();
        let kind = EncoderKind::from_model_type(model_type).ok_or_else(|| {
            Error::file(
                &config_path,
                format!(
                    "model_type `{model_type}` is not a supported sentence encoder (bert, \
                     roberta, xlm-roberta, distilbert)"
                ),
            )
        })?;
        let cfg = EncoderConfig::from_json(kind, &config, &config_path)?;
        // sentence-transformers truncates to `max_seq_length` and may lowercase first.
        let st_path = model_dir.join("sentence_bert_config.json");
        let (mut max_len, mut lowercase) = (cfg.max_len(), false);
        if st_path.is_file() {
            let st = read_json(&st_path)?;
            if let Some(n) = st.get("max_seq_length").and_then(|v| v.as_u64()) {
                max_len = max_len.min(n as usize);
            }
            lowercase = st
                .get("do_lower_case")
                .and_then(|v| v.as_bool())
                .unwrap_or(false);
        }
        let tokenizer = EncoderTokenizer::load(&model_dir, max_len, lowercase)?;
        let (tensors, origin) = read_weights(&model_dir, device)?;
        let prefix = encoder_prefix(&tensors, &origin)?;
        let vb = VarBuilder::from_tensors(tensors, DType::F32, device);
        let encoder = Encoder::load(&cfg, encoder_root(&vb, prefix))
            .map_err(|e| Error::file(&origin, format!("cannot build the {kind:?} encoder: {e}")))?;
        Ok(Self {
            encoder,
            tokenizer,
            pooling,
            normalize,
        })
    }

    /// The embedding size.
    pub fn dim(&self) -> usize {
        self.encoder.cfg.hidden_size
    }

    /// Mean pooling over the attention mask; L2-normalized when the directory's
    /// sentence-transformers modules.json lists a Normalize module.
    pub fn embed(&self, texts: &[&str], batch_size: usize) -> Result<Vec<Vec<f32>>> {
        if batch_size == 0 {
            return Err(Error::config("batch_size", "must be at least 1"));
        }
        let mut out = Vec::with_capacity(texts.len());
        for chunk in texts.chunks(batch_size) {
            let inputs: Vec<(&str, Option<&str>)> = chunk.iter().map(|t| (*t, None)).collect();
            let batch = encoder_batch(&self.tokenizer, &self.encoder.cfg, &inputs)?;
            let hidden = self.encoder.forward(&batch)?; // [B, T, H]
            let (b, t, _) = hidden.dims3()?;
            let pooled = match self.pooling {
                Pooling::Cls => hidden.narrow(1, 0, 1)?.squeeze(1)?, // [B, H]
                Pooling::Mean => {
                    let mask: Vec<f32> = batch
                        .lengths
                        .iter()
                        .flat_map(|&n| (0..t).map(move |j| if j < n { 1.0 } else { 0.0 }))
                        .collect();
                    let mask = Tensor::from_vec(mask, (b, t, 1), hidden.device())?; // [B, T, 1]
                    let sum = hidden.broadcast_mul(&mask)?.sum(1)?; // [B, H]
                    let count = mask.sum(1)?.clamp(1e-9, f64::INFINITY)?; // [B, 1]
                    sum.broadcast_div(&count)?
                }
            };
            let pooled = if self.normalize {
                let norm = pooled
                    .sqr()?
                    .sum_keepdim(D::Minus1)?
                    .sqrt()?
                    .clamp(1e-12, f64::INFINITY)?; // [B, 1]
                pooled.broadcast_div(&norm)?
            } else {
                pooled
            };
            out.extend(pooled.to_vec2::<f32>()?);
        }
        Ok(out)
    }
}

fn read_pooling(path: &Path) -> Result<Pooling> {
    if !path.is_file() {
        return Ok(Pooling::Mean);
    }
    let cfg = read_json(path)?;
    let on = |k: &str| cfg.get(k).and_then(|v| v.as_bool()).unwrap_or(false);
    let modes = [
        "pooling_mode_cls_token",
        "pooling_mode_mean_tokens",
        "pooling_mode_max_tokens",
        "pooling_mode_mean_sqrt_len_tokens",
        "pooling_mode_weightedmean_tokens",
        "pooling_mode_lasttoken",
    ];
    let set: Vec<&str> = modes.iter().copied().filter(|m| on(m)).collect();
    match set.as_slice() {
        ["pooling_mode_mean_tokens"] => Ok(Pooling::Mean),
        ["pooling_mode_cls_token"] => Ok(Pooling::Cls),
        [] => Err(Error::file(path, "no pooling mode is enabled")),
        other => Err(Error::file(
            path,
            format!(
                "pooling {} is not supported (exactly one of pooling_mode_mean_tokens, \
                 pooling_mode_cls_token)",
                other.join(" + ")
            ),
        )),
    }
}
