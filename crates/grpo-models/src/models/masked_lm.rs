//! Masked-LM generators for fill-in policies: BERT, RoBERTa and DistilBERT `*ForMaskedLM`
//! checkpoints (and the project's own small models, which are BERT masked LMs with a char-level
//! tokenizer). The generator fills every masked position of an input in one forward pass.
//!
//! One forward serves both uses: with detached weights it runs candle's fused kernels (sampling,
//! old and reference log-probs); with weights that track gradients (`Var`s, see
//! [`MaskedLm::from_tensors`]) only ops with a backward, so every parameter gets its gradient.
//! The vocabulary projection runs only at the positions asked for ([`MaskedLm::logits_at`]): the
//! masked ones, a small share of the input.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Module, Tensor};
use candle_nn::VarBuilder;

use super::encoder::{
    build_encoder_model, Act, Encoder, EncoderBatch, EncoderConfig, EncoderKind, EncoderTokenizer,
};
use super::layers::{linear, LayerNorm, Linear, Mode};
use crate::files::{read_json, read_weights};
use crate::{Error, Result};

/// Model types [`MaskedLm::load`] accepts, for messages.
pub const SUPPORTED_MASKED_LMS: &str = "bert, roberta, distilbert (*ForMaskedLM)";

/// The masked-LM head: dense + activation + LayerNorm, then the vocabulary projection (its
/// weight tied to the word embeddings unless the checkpoint stores its own).
#[derive(Debug, Clone)]
struct MlmHead {
    dense: Linear,
    act: Act,
    norm: LayerNorm,
    decoder: Linear,
}

impl MlmHead {
    fn forward(&self, h: &Tensor, mode: Mode) -> candle_core::Result<Tensor> {
        let x = self.act.apply(&self.dense.forward(h)?)?; // [N, H]
        self.decoder.forward(&self.norm.forward(&x, mode)?) // [N, V]
    }
}

/// A BERT-like `*ForMaskedLM`.
#[derive(Debug, Clone)]
pub struct MaskedLm {
    cfg: EncoderConfig,
    encoder: Encoder,
    head: MlmHead,
    mode: Mode,
    /// The checkpoint keys the model was built from (its parameters), sorted.
    used: Vec<String>,
}

/// Reads a masked LM's `config.json`: its encoder kind and hyper-parameters. A causal LM, a
/// classifier or an unknown architecture is an error that says what loads.
pub fn masked_lm_config(dir: &Path) -> Result<EncoderConfig> {
    let path = dir.join("config.json");
    let config = read_json(&path)?;
    let model_type = config
        .get("model_type")
        .and_then(|v| v.as_str())
        // A missing model_type matches no kind and is refused below.
        .unwrap_or_default();
    let archs: Vec<&str> = config
        .get("architectures")
        .and_then(|v| v.as_array())
        .map(|a| a.iter().filter_map(|x| x.as_str()).collect())
        // Only used to word the error below.
        .unwrap_or_default();
    let Some(kind) = EncoderKind::from_model_type(model_type) else {
        let causal = archs.iter().any(|a| a.ends_with("ForCausalLM"))
            || super::config::Arch::is_causal_model_type(model_type);
        let why = if causal {
            "is a causal LM (it generates left to right); a fill-in policy needs a bidirectional \
             masked-LM generator"
                .to_string()
        } else {
            format!("model_type `{model_type}` is not a supported masked LM")
        };
        return Err(Error::file(
            &path,
            format!("{why}; supported: {SUPPORTED_MASKED_LMS}"),
        ));
    };
    if kind == EncoderKind::XlmRoberta {
        return Err(Error::file(
            &path,
            format!(
                "xlm-roberta masked LMs are not supported yet; supported: {SUPPORTED_MASKED_LMS}"
            ),
        ));
    }
    if let Some(a) = archs.iter().find(|a| !a.ends_with("ForMaskedLM")) {
        return Err(Error::file(
            &path,
            format!(
                "architecture `{a}` has no masked-LM head; a fill-in generator is a \
                 {SUPPORTED_MASKED_LMS} checkpoint"
            ),
        ));
    }
    EncoderConfig::from_json(kind, &config, &path)
}

impl MaskedLm {
    /// Loads an HF `*ForMaskedLM` directory with detached f32 weights (inference).
    pub fn load(dir: &Path, device: &Device) -> Result<Self> {
        let cfg = masked_lm_config(dir)?;
        let (tensors, origin) = read_weights(dir, device)?;
        Self::from_tensors(&cfg, tensors, &origin)
    }

    /// The checkpoint's tensors by name (f32 on `device`) and the file they came from.
    pub fn read_tensors(dir: &Path, device: &Device) -> Result<(HashMap<String, Tensor>, PathBuf)> {
        read_weights(dir, device)
    }

    /// Builds the model over `tensors` (checkpoint names). Tensors that track gradients give a
    /// training model (ops with a backward only); detached ones an inference model. `origin`
    /// names the checkpoint in errors.
    pub fn from_tensors(
        cfg: &EncoderConfig,
        tensors: HashMap<String, Tensor>,
        origin: &Path,
    ) -> Result<Self> {
        let (encoder, head, mode, used) =
            build_encoder_model(cfg, tensors, origin, "masked LM", |_, vb, encoder| {
                load_head(cfg, vb, encoder.word_embeddings())
            })?;
        Ok(Self {
            cfg: cfg.clone(),
            encoder,
            head,
            mode,
            used,
        })
    }

    pub fn config(&self) -> &EncoderConfig {
        &self.cfg
    }

    /// The checkpoint keys this model is made of (its trainable parameters), sorted. A tied
    /// decoder is the word embedding's key.
    pub fn parameter_names(&self) -> &[String] {
        &self.used
    }

    /// Whether the forward records a graph (built over tensors that track gradients).
    pub fn trains(&self) -> bool {
        self.mode == Mode::Train
    }

    /// Logits [B, T, V] at every position of a right-padded batch.
    pub fn logits(&self, batch: &EncoderBatch) -> Result<Tensor> {
        let hidden = self.encoder.forward_mode(batch, self.mode)?; // [B, T, H]
        let (b, t, h) = hidden.dims3()?;
        let logits = self.head.forward(&hidden.reshape((b * t, h))?, self.mode)?; // [B*T, V]
        Ok(logits.reshape((b, t, ()))?)
    }

    /// Logits [N, V] at `positions`, flat indices `row * T + column` into the batch.
    pub fn logits_at(&self, batch: &EncoderBatch, positions: &[u32]) -> Result<Tensor> {
        self.head_logits(&self.hidden_at(batch, positions)?) // [N, V]
    }

    /// Final hidden states [N, H] at `positions` (flat indices `row * T + column`).
    pub fn hidden_at(&self, batch: &EncoderBatch, positions: &[u32]) -> Result<Tensor> {
        let hidden = self.encoder.forward_mode(batch, self.mode)?; // [B, T, H]
        let (b, t, h) = hidden.dims3()?;
        if let Some(&p) = positions.iter().find(|&&p| p as usize >= b * t) {
            return Err(Error::Invariant(format!(
                "masked-LM position {p} is outside the batch ({b} x {t})"
            )));
        }
        let idx = Tensor::from_slice(positions, positions.len(), hidden.device())?; // [N]
        Ok(hidden.reshape((b * t, h))?.index_select(&idx, 0)?) // [N, H]
    }

    /// The masked-LM head: hidden states [N, H] -> logits [N, V].
    pub fn head_logits(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(self.head.forward(hidden, self.mode)?)
    }
}

/// The head of `cfg.kind` from `vb` (rooted at the checkpoint root); `word` [V, H] is the decoder
/// weight when the checkpoint stores none (tied embeddings).
fn load_head(cfg: &EncoderConfig, vb: &VarBuilder, word: &Tensor) -> candle_core::Result<MlmHead> {
    let (h, v) = (cfg.hidden_size, cfg.vocab_size);
    // (dense, norm, decoder, bias names, norm eps, activation)
    let (dense, norm, decoder, biases, eps, act) = match cfg.kind {
        EncoderKind::Bert => (
            "cls.predictions.transform.dense",
            "cls.predictions.transform.LayerNorm",
            "cls.predictions.decoder",
            ["cls.predictions.bias", "cls.predictions.decoder.bias"],
            cfg.layer_norm_eps,
            cfg.act,
        ),
        // RobertaLMHead always uses exact GELU, whatever the encoder's activation.
        EncoderKind::Roberta | EncoderKind::XlmRoberta => (
            "lm_head.dense",
            "lm_head.layer_norm",
            "lm_head.decoder",
            ["lm_head.bias", "lm_head.decoder.bias"],
            cfg.layer_norm_eps,
            Act::GeluErf,
        ),
        EncoderKind::DistilBert => (
            "vocab_transform",
            "vocab_layer_norm",
            "vocab_projector",
            ["vocab_projector.bias", "vocab_projector.bias"],
            1e-12,
            cfg.act,
        ),
    };
    let weight = match vb.contains_tensor(&format!("{decoder}.weight")) {
        true => vb.pp(decoder).get((v, h), "weight")?,
        false => word.clone(),
    };
    let bias_name = biases
        .iter()
        .find(|b| vb.contains_tensor(b))
        .copied()
        .unwrap_or(biases[0]);
    let bias = vb.get(v, bias_name)?;
    Ok(MlmHead {
        dense: linear(h, h, true, vb.pp(dense))?,
        act,
        norm: LayerNorm::load(h, eps, vb.pp(norm))?,
        decoder: Linear::new(weight, Some(bias))?,
    })
}

/// A masked LM's tokenizer: `tokenizer.json` with special tokens added (`[CLS] text [SEP]` or
/// `<s> text </s>`), the mask token, and the special ids that fills never take.
#[derive(Clone)]
pub struct MlmTokenizer {
    inner: EncoderTokenizer,
    mask_id: u32,
    mask_token: String,
    special_ids: Vec<u32>,
}

impl std::fmt::Debug for MlmTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MlmTokenizer")
            .field("path", &self.inner.path)
            .field("mask_token", &self.mask_token)
            .finish_non_exhaustive()
    }
}

impl MlmTokenizer {
    /// `dir`'s `tokenizer.json`; the mask token is `tokenizer_config.json`'s `mask_token`, else
    /// `[MASK]` or `<mask>` when the vocabulary has it. Inputs are cut to `max_len` tokens.
    pub fn load(dir: &Path, max_len: usize) -> Result<Self> {
        let inner = EncoderTokenizer::load(dir, max_len, false)?;
        let tc = dir.join("tokenizer_config.json");
        let configured = match tc.is_file() {
            true => read_json(&tc)?
                .get("mask_token")
                .and_then(|v| v.as_str().or_else(|| v.get("content")?.as_str()))
                .map(str::to_owned),
            false => None,
        };
        let candidates: Vec<String> = match configured {
            Some(m) => vec![m],
            None => vec!["[MASK]".into(), "<mask>".into()],
        };
        let found = candidates
            .iter()
            .find_map(|m| inner.inner.token_to_id(m).map(|id| (m.clone(), id)));
        let Some((mask_token, mask_id)) = found else {
            return Err(Error::file(
                &inner.path,
                format!(
                    "the tokenizer has no mask token (looked for {}); a fill-in generator's \
                     tokenizer needs one",
                    candidates.join(", ")
                ),
            ));
        };
        let mut special_ids: Vec<u32> = inner
            .inner
            .get_added_tokens_decoder()
            .iter()
            .filter(|(_, t)| t.special)
            .map(|(&id, _)| id)
            .collect();
        special_ids.sort_unstable();
        Ok(Self {
            inner,
            mask_id,
            mask_token,
            special_ids,
        })
    }

    pub fn mask_id(&self) -> u32 {
        self.mask_id
    }

    pub fn mask_token(&self) -> &str {
        &self.mask_token
    }

    /// Ids of the special tokens (padding, [CLS], [SEP], [MASK], ...), sorted.
    pub fn special_ids(&self) -> &[u32] {
        &self.special_ids
    }

    /// Ids of `text` with the special tokens added; mask tokens written in the text become the
    /// mask id.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.inner.encode(text, None)?.0)
    }

    /// Text of `ids` without special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.inner.decode(ids, true).map_err(|e| {
            Error::Tokenizer(format!("decoding with {}: {e}", self.inner.path.display()))
        })
    }
}

/// Right-pads `rows` into an [`EncoderBatch`] (one token type, `pad` after each row).
pub fn pad_batch(rows: &[&[u32]], pad: u32) -> EncoderBatch {
    let t = rows.iter().map(|r| r.len()).max().unwrap_or(0);
    EncoderBatch {
        ids: rows
            .iter()
            .map(|r| {
                let mut v = r.to_vec();
                v.resize(t, pad);
                v
            })
            .collect(),
        type_ids: vec![vec![0; t]; rows.len()],
        lengths: rows.iter().map(|r| r.len()).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixtures() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/fillin")
    }

    struct Expected {
        input_ids: Vec<Vec<u32>>,
        masked: Vec<(usize, usize)>,
        fills: Vec<u32>,
        weights: Vec<f32>,
        temperature: f64,
        mask_token_id: u32,
        tensors: HashMap<String, Tensor>,
    }

    fn expected(name: &str) -> Expected {
        let dir = fixtures().join(name);
        let j = read_json(&dir.join("expected.json")).unwrap();
        let u32s = |v: &serde_json::Value| -> Vec<u32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        };
        Expected {
            input_ids: j["input_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(u32s)
                .collect(),
            masked: j["masked"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| {
                    let p = u32s(p);
                    (p[0] as usize, p[1] as usize)
                })
                .collect(),
            fills: u32s(&j["fills"]),
            weights: j["weights"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect(),
            temperature: j["temperature"].as_f64().unwrap(),
            mask_token_id: j["mask_token_id"].as_u64().unwrap() as u32,
            tensors: candle_core::safetensors::load(dir.join("expected.safetensors"), &Device::Cpu)
                .unwrap(),
        }
    }

    fn batch_of(e: &Expected, cfg: &EncoderConfig) -> EncoderBatch {
        let rows: Vec<Vec<u32>> = e
            .input_ids
            .iter()
            .map(|r| {
                let n = r.iter().rposition(|&x| x != cfg.pad_token_id).unwrap() + 1;
                r[..n].to_vec()
            })
            .collect();
        let refs: Vec<&[u32]> = rows.iter().map(Vec::as_slice).collect();
        pad_batch(&refs, cfg.pad_token_id)
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    const NAMES: [&str; 3] = ["bert_mlm", "roberta_mlm", "distilbert_mlm"];

    #[test]
    fn logits_match_transformers() {
        for name in NAMES {
            let dir = fixtures().join(name);
            let m = MaskedLm::load(&dir, &Device::Cpu).unwrap();
            let e = expected(name);
            let batch = batch_of(&e, m.config());
            let got = m.logits(&batch).unwrap(); // [B, T, V]
            let want = &e.tensors["logits"];
            // Padding positions' logits are not compared (transformers computes them from
            // attention over the real tokens too, so they match, but they mean nothing).
            for (b, &n) in batch.lengths.iter().enumerate() {
                let g = got.get(b).unwrap().narrow(0, 0, n).unwrap();
                let w = want.get(b).unwrap().narrow(0, 0, n).unwrap();
                let d = max_diff(&g, &w);
                assert!(d < 1e-4, "{name} row {b}: max |diff| {d}");
            }
            // The masked positions alone: the same numbers.
            let t = batch.ids[0].len();
            let pos: Vec<u32> = e.masked.iter().map(|&(r, c)| (r * t + c) as u32).collect();
            let at = m.logits_at(&batch, &pos).unwrap(); // [N, V]
            for (i, &(r, c)) in e.masked.iter().enumerate() {
                let d = max_diff(&at.get(i).unwrap(), &want.get(r).unwrap().get(c).unwrap());
                assert!(d < 1e-4, "{name} masked {i}: max |diff| {d}");
            }
            let tok = MlmTokenizer::load(&dir, m.config().max_len()).unwrap();
            assert_eq!(tok.mask_id(), e.mask_token_id, "{name}");
            assert!(tok.special_ids().contains(&e.mask_token_id));
        }
    }

    #[test]
    fn tokenizer_encodes_like_transformers() {
        for name in NAMES {
            let dir = fixtures().join(name);
            let j = read_json(&dir.join("expected.json")).unwrap();
            let cfg = masked_lm_config(&dir).unwrap();
            let tok = MlmTokenizer::load(&dir, cfg.max_len()).unwrap();
            for (text, ids) in j["texts"]
                .as_array()
                .unwrap()
                .iter()
                .zip(j["input_ids"].as_array().unwrap())
            {
                let got = tok.encode(text.as_str().unwrap()).unwrap();
                let want: Vec<u32> = ids
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u32)
                    .take(got.len())
                    .collect();
                assert_eq!(got, want, "{name}: {text}");
            }
        }
    }

    /// Every parameter's gradient of sum_i w_i log_softmax(logits_i / T)[fill_i] over the
    /// masked positions equals torch's.
    #[test]
    fn gradients_match_torch_for_every_parameter() {
        for name in NAMES {
            let dir = fixtures().join(name);
            let cfg = masked_lm_config(&dir).unwrap();
            let (tensors, origin) = MaskedLm::read_tensors(&dir, &Device::Cpu).unwrap();
            let vars: HashMap<String, candle_core::Var> = tensors
                .iter()
                .map(|(k, t)| (k.clone(), candle_core::Var::from_tensor(t).unwrap()))
                .collect();
            let tracked = vars
                .iter()
                .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
                .collect();
            let m = MaskedLm::from_tensors(&cfg, tracked, &origin).unwrap();
            assert!(m.trains());
            let e = expected(name);
            let batch = batch_of(&e, &cfg);
            let t = batch.ids[0].len();
            let pos: Vec<u32> = e.masked.iter().map(|&(r, c)| (r * t + c) as u32).collect();
            let logits = m.logits_at(&batch, &pos).unwrap(); // [N, V]
            let lp = candle_nn::ops::log_softmax(&(logits / e.temperature).unwrap(), 1).unwrap();
            let fills = Tensor::from_slice(&e.fills, (e.fills.len(), 1), &Device::Cpu).unwrap();
            let picked = lp.gather(&fills, 1).unwrap().squeeze(1).unwrap(); // [N]
            let w = Tensor::from_slice(&e.weights, e.weights.len(), &Device::Cpu).unwrap();
            let loss = (picked * w).unwrap().sum_all().unwrap();
            let dl = (loss.to_scalar::<f32>().unwrap()
                - e.tensors["loss"].to_scalar::<f32>().unwrap())
            .abs();
            assert!(dl < 1e-4, "{name}: loss differs by {dl}");
            let grads = loss.backward().unwrap();
            let names = m.parameter_names();
            assert_eq!(
                names.len(),
                vars.len(),
                "{name}: every stored tensor is used"
            );
            for n in names {
                let want = &e.tensors[&format!("grad.{n}")];
                let got = grads
                    .get(vars[n].as_tensor())
                    .unwrap_or_else(|| panic!("{name}: no gradient for {n}"));
                let scale = want
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                let d = max_diff(got, want);
                assert!(
                    d <= 1e-4 * scale.max(1.0),
                    "{name}: gradient of {n} differs by {d} (scale {scale})"
                );
            }
        }
    }

    #[test]
    fn a_causal_lm_is_refused_with_what_loads() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}"#,
        )
        .unwrap();
        let e = masked_lm_config(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("causal LM") && e.contains("bert, roberta"),
            "{e}"
        );
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"model_type": "bert", "architectures": ["BertForSequenceClassification"]}"#,
        )
        .unwrap();
        let e = masked_lm_config(dir.path()).unwrap_err().to_string();
        assert!(e.contains("no masked-LM head"), "{e}");
    }
}
