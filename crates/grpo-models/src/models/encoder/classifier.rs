//! Sequence classification: BERT-family `*ForSequenceClassification` heads on the encoder,
//! decoder classifiers (Llama / Qwen2) behind one [`SequenceClassifier`].

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;

use super::*;
use crate::files::{read_json, read_weights};
use crate::models::layers::{linear, Linear, Mode};
use crate::models::seq_cls::DecoderClassifier;
use crate::{Error, Result};

/// The classification head on the first token's hidden state.
#[derive(Debug, Clone)]
enum Head {
    /// BERT: pooler (dense + tanh), then `classifier`.
    Pooler { pooler: Linear, classifier: Linear },
    /// RoBERTa / XLM-R: `classifier.dense` + tanh, then `classifier.out_proj`.
    Dense { dense: Linear, out_proj: Linear },
    /// DistilBERT: `pre_classifier` + ReLU, then `classifier`.
    PreClassifier { pre: Linear, classifier: Linear },
}

impl Head {
    fn load(
        kind: EncoderKind,
        prefix: &str,
        h: usize,
        labels: usize,
        vb: VarBuilder,
    ) -> candle_core::Result<Self> {
        Ok(match kind {
            EncoderKind::Bert => Self::Pooler {
                pooler: linear(h, h, true, vb.pp(format!("{prefix}pooler.dense")))?,
                classifier: linear(h, labels, true, vb.pp("classifier"))?,
            },
            EncoderKind::Roberta | EncoderKind::XlmRoberta => Self::Dense {
                dense: linear(h, h, true, vb.pp("classifier").pp("dense"))?,
                out_proj: linear(h, labels, true, vb.pp("classifier").pp("out_proj"))?,
            },
            EncoderKind::DistilBert => Self::PreClassifier {
                pre: linear(h, h, true, vb.pp("pre_classifier"))?,
                classifier: linear(h, labels, true, vb.pp("classifier"))?,
            },
        })
    }

    /// `first` [B, H] (the first token's hidden state) -> logits [B, L].
    fn forward(&self, first: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::Pooler { pooler, classifier } => {
                classifier.forward(&pooler.forward(first)?.tanh()?)
            }
            Self::Dense { dense, out_proj } => out_proj.forward(&dense.forward(first)?.tanh()?),
            Self::PreClassifier { pre, classifier } => {
                classifier.forward(&pre.forward(first)?.relu()?)
            }
        }
    }
}

/// The network of a BERT-like `*ForSequenceClassification`: encoder and head, over detached
/// weights (inference, fused kernels) or weights that track gradients (training a judge).
#[derive(Debug, Clone)]
pub struct ClassifierNet {
    encoder: Encoder,
    head: Head,
    mode: Mode,
    /// The checkpoint keys it was built from, sorted.
    used: Vec<String>,
}

impl ClassifierNet {
    /// Builds the network of `cfg.kind` with `num_labels` labels over `tensors` (checkpoint
    /// names); `origin` names the checkpoint in errors.
    pub fn from_tensors(
        cfg: &EncoderConfig,
        num_labels: usize,
        tensors: HashMap<String, Tensor>,
        origin: &Path,
    ) -> Result<Self> {
        let (encoder, head, mode, used) =
            build_encoder_model(cfg, tensors, origin, "classifier", |prefix, vb, _| {
                Head::load(cfg.kind, prefix, cfg.hidden_size, num_labels, vb.clone())
            })?;
        Ok(Self {
            encoder,
            head,
            mode,
            used,
        })
    }

    pub fn config(&self) -> &EncoderConfig {
        &self.encoder.cfg
    }

    /// The checkpoint keys this network is made of (its parameters), sorted.
    pub fn parameter_names(&self) -> &[String] {
        &self.used
    }

    /// Logits [B, L] of a right-padded batch (the first token's hidden state through the head).
    pub fn logits(&self, batch: &EncoderBatch) -> Result<Tensor> {
        let hidden = self.encoder.forward_mode(batch, self.mode)?; // [B, T, H]
        let first = hidden.narrow(1, 0, 1)?.squeeze(1)?; // [B, H]
        Ok(self.head.forward(&first)?) // [B, L]
    }
}

/// An encoder and the head `head(prefix, vb, encoder)` builds, over `tensors` (checkpoint names),
/// with the forward mode the tensors call for and the keys read (sorted). `what` names the
/// model in errors, with `origin`.
pub(crate) fn build_encoder_model<H>(
    cfg: &EncoderConfig,
    tensors: HashMap<String, Tensor>,
    origin: &Path,
    what: &str,
    head: impl FnOnce(&str, &VarBuilder, &Encoder) -> candle_core::Result<H>,
) -> Result<(Encoder, H, Mode, Vec<String>)> {
    let prefix = encoder_prefix(&tensors, origin)?;
    let mode = tracking_mode(&tensors, prefix);
    let rec = Recorder::new(tensors);
    let built = {
        let vb = rec.var_builder();
        Encoder::load(cfg, encoder_root(&vb, prefix)).and_then(|encoder| {
            let h = head(prefix, &vb, &encoder)?;
            Ok((encoder, h))
        })
    };
    let (encoder, h) = built.map_err(|e| {
        Error::file(
            origin,
            format!("cannot build the {:?} {what}: {e}", cfg.kind),
        )
    })?;
    Ok((encoder, h, mode, rec.used()?))
}

/// `Train` when the word embeddings track gradients, else `Infer`.
pub(crate) fn tracking_mode(tensors: &HashMap<String, Tensor>, prefix: &str) -> Mode {
    match tensors
        .get(&format!("{prefix}embeddings.word_embeddings.weight"))
        .is_some_and(|t| t.track_op())
    {
        true => Mode::Train,
        false => Mode::Infer,
    }
}

/// A tensor map that records which keys were read, so that a model knows its parameters (a
/// checkpoint may hold more, e.g. BERT's pooler and next-sentence head under a masked LM).
pub(crate) struct Recorder {
    tensors: HashMap<String, Tensor>,
    used: Mutex<BTreeSet<String>>,
}

struct RecorderRef<'a>(&'a Recorder);

impl Recorder {
    pub(crate) fn new(tensors: HashMap<String, Tensor>) -> Self {
        Self {
            tensors,
            used: Mutex::new(BTreeSet::new()),
        }
    }

    /// A VarBuilder (f32) over the tensors that records every key read.
    pub(crate) fn var_builder(&self) -> VarBuilder<'_> {
        let device = self
            .tensors
            .values()
            .next()
            .map(|t| t.device().clone())
            .unwrap_or(Device::Cpu);
        VarBuilder::from_backend(Box::new(RecorderRef(self)), DType::F32, device)
    }

    /// The keys read so far, sorted.
    pub(crate) fn used(self) -> Result<Vec<String>> {
        Ok(self
            .used
            .into_inner()
            .map_err(|_| Error::Model("model loader poisoned".into()))?
            .into_iter()
            .collect())
    }
}

impl SimpleBackend for RecorderRef<'_> {
    fn get(
        &self,
        s: candle_core::Shape,
        name: &str,
        h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = SimpleBackend::get(&self.0.tensors, s, name, h, dtype, dev)?;
        if let Ok(mut used) = self.0.used.lock() {
            used.insert(name.to_string());
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let t = SimpleBackend::get_unchecked(&self.0.tensors, name, dtype, dev)?;
        if let Ok(mut used) = self.0.used.lock() {
            used.insert(name.to_string());
        }
        Ok(t)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.tensors.contains_key(name)
    }
}

/// A BERT-like `*ForSequenceClassification` with its tokenizer.
#[derive(Clone)]
struct EncoderClassifier {
    net: ClassifierNet,
    tokenizer: EncoderTokenizer,
}

impl EncoderClassifier {
    fn load(
        dir: &Path,
        kind: EncoderKind,
        config: &serde_json::Value,
        num_labels: usize,
        device: &Device,
    ) -> Result<Self> {
        let config_path = dir.join("config.json");
        let cfg = EncoderConfig::from_json(kind, config, &config_path)?;
        let tokenizer = EncoderTokenizer::load(dir, cfg.max_len(), false)?;
        let (tensors, origin) = read_weights(dir, device)?;
        Ok(Self {
            net: ClassifierNet::from_tensors(&cfg, num_labels, tensors, &origin)?,
            tokenizer,
        })
    }

    fn logits(&self, inputs: &[(&str, Option<&str>)]) -> Result<Tensor> {
        let batch = encoder_batch(&self.tokenizer, self.net.config(), inputs)?;
        self.net.logits(&batch) // [B, L]
    }
}

#[derive(Clone)]
enum Classifier {
    Encoder(Box<EncoderClassifier>),
    Decoder(Box<DecoderClassifier>),
}

/// A frozen `*ForSequenceClassification` model: BERT, RoBERTa, XLM-RoBERTa or DistilBERT
/// encoders, or Llama / Qwen2 decoders (score at the last non-pad token).
#[derive(Clone)]
pub struct SequenceClassifier {
    inner: Classifier,
    labels: Vec<String>,
    dir: PathBuf,
}

impl std::fmt::Debug for SequenceClassifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SequenceClassifier")
            .field("dir", &self.dir)
            .field("labels", &self.labels)
            .finish_non_exhaustive()
    }
}

/// Model types [`SequenceClassifier::load`] accepts, for messages.
pub const SUPPORTED_CLASSIFIERS: &str =
    "bert, roberta, xlm-roberta, distilbert (encoders); llama, qwen2, qwen3, mistral (decoders)";

impl SequenceClassifier {
    /// Loads a `*ForSequenceClassification` HF directory (encoder or Llama/Qwen2 family).
    pub fn load(dir: &Path, device: &Device) -> Result<Self> {
        let config_path = dir.join("config.json");
        let config = read_json(&config_path)?;
        let model_type = config
            .get("model_type")
            .and_then(|v| v.as_str())
            // A missing model_type matches no kind and is refused below.
            .unwrap_or_default()
            .to_string();
        let labels = label_names(&config, &config_path)?;
        let inner = if let Some(kind) = EncoderKind::from_model_type(&model_type) {
            Classifier::Encoder(Box::new(EncoderClassifier::load(
                dir,
                kind,
                &config,
                labels.len(),
                device,
            )?))
        } else if matches!(model_type.as_str(), "llama" | "qwen2" | "qwen3" | "mistral") {
            Classifier::Decoder(Box::new(DecoderClassifier::load(
                dir,
                &config,
                labels.len(),
                device,
            )?))
        } else {
            return Err(Error::file(
                &config_path,
                format!(
                    "model_type `{model_type}` is not a supported sequence classifier; \
                     supported: {SUPPORTED_CLASSIFIERS}"
                ),
            ));
        };
        Ok(Self {
            inner,
            labels,
            dir: dir.to_path_buf(),
        })
    }

    /// id2label names in label order ("LABEL_0".. when the config has none).
    pub fn labels(&self) -> &[String] {
        &self.labels
    }

    /// The token ids the model sees for one input (see [`SequenceClassifier::logits`]).
    pub fn token_ids(&self, text: &str, pair: Option<&str>) -> Result<Vec<u32>> {
        match &self.inner {
            Classifier::Encoder(m) => Ok(m.tokenizer.encode(text, pair)?.0),
            Classifier::Decoder(m) => m.encode(text, pair),
        }
    }

    /// Whether the model is a decoder whose tokenizer has a chat template.
    pub fn has_chat_template(&self) -> bool {
        matches!(&self.inner, Classifier::Decoder(m) if m.has_chat_template())
    }

    /// Logits [N][num_labels] of (prompt, completion) conversations: for a decoder with a chat
    /// template, the user prompt and the assistant completion rendered with it (how chat reward
    /// models are trained); otherwise the (prompt, completion) text pair of
    /// [`SequenceClassifier::logits`].
    pub fn logits_chat(&self, convs: &[(&str, &str)], batch_size: usize) -> Result<Vec<Vec<f32>>> {
        match &self.inner {
            Classifier::Decoder(m) if m.has_chat_template() => {
                if batch_size == 0 {
                    return Err(Error::config("batch_size", "must be at least 1"));
                }
                let mut out = Vec::with_capacity(convs.len());
                for chunk in convs.chunks(batch_size) {
                    let seqs = chunk
                        .iter()
                        .map(|(p, c)| m.encode_chat(p, c))
                        .collect::<Result<Vec<_>>>()?;
                    let logits = m.logits_of_ids(seqs)?; // [B, L]
                    out.extend(logits.to_dtype(DType::F32)?.to_vec2::<f32>()?);
                }
                Ok(out)
            }
            _ => {
                let pairs: Vec<(&str, Option<&str>)> =
                    convs.iter().map(|(p, c)| (*p, Some(*c))).collect();
                self.logits(&pairs, batch_size)
            }
        }
    }

    /// Logits [N][num_labels] for texts or (text, text_pair) pairs, in batches of `batch_size`
    /// (padded per batch, truncated to the model's maximum length).
    ///
    /// Encoders tokenize a pair with the tokenizer's pair template (`[CLS] a [SEP] b [SEP]`,
    /// `<s> a </s></s> b </s>`), truncating the longer part first. Decoders encode `text` with
    /// the tokenizer's special tokens (e.g. BOS) followed by `pair` encoded without any, each
    /// tokenized on its own, and keep the first `max_position_embeddings` tokens.
    pub fn logits(
        &self,
        inputs: &[(&str, Option<&str>)],
        batch_size: usize,
    ) -> Result<Vec<Vec<f32>>> {
        if batch_size == 0 {
            return Err(Error::config("batch_size", "must be at least 1"));
        }
        let mut out = Vec::with_capacity(inputs.len());
        for chunk in inputs.chunks(batch_size) {
            let logits = match &self.inner {
                Classifier::Encoder(m) => m.logits(chunk)?,
                Classifier::Decoder(m) => m.logits(chunk)?,
            }; // [B, L]
            out.extend(logits.to_dtype(DType::F32)?.to_vec2::<f32>()?);
        }
        Ok(out)
    }
}
