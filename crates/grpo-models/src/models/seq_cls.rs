//! Decoder reward models: `LlamaForSequenceClassification` / `Qwen2ForSequenceClassification`
//! (and Qwen3 / Mistral, which share the layout). The project's causal LM gives the final hidden
//! states; the head `score.weight` [num_labels, hidden] (no bias) is applied at the last token of
//! each row that is not the pad token, as transformers does. Used through
//! [`super::encoder::SequenceClassifier`].

use std::path::Path;

use candle_core::{DType, Device, Tensor};

use super::{CausalLm, Mode, ModelConfig, SeqBatch};
use crate::files::{read_weights, require_tokenizer_json};
use crate::tokenizer::{ChatMessage, Tokenizer};
use crate::{Error, Result};

#[derive(Debug, Clone)]
pub(crate) struct DecoderClassifier {
    lm: CausalLm,
    /// [H, L]: `score.weight` transposed.
    score_t: Tensor,
    tokenizer: Tokenizer,
    /// `pad_token_id` of config.json: trailing tokens with this id are not scored.
    pad_id: Option<u32>,
    max_len: usize,
    vocab_size: usize,
}

impl DecoderClassifier {
    pub(crate) fn load(
        dir: &Path,
        config: &serde_json::Value,
        num_labels: usize,
        device: &Device,
    ) -> Result<Self> {
        let mut cfg = ModelConfig::from_hf_file(&dir.join("config.json"))?;
        require_tokenizer_json(dir)?;
        let tokenizer = Tokenizer::from_hf_dir(dir)?;
        let (mut tensors, origin) = read_weights(dir, device)?;
        let score = tensors.remove("score.weight").ok_or_else(|| {
            Error::file(
                &origin,
                format!(
                    "missing tensor `score.weight` ([{num_labels}, {}]): not a \
                     *ForSequenceClassification checkpoint",
                    cfg.hidden_size
                ),
            )
        })?;
        if score.dims() != [num_labels, cfg.hidden_size] {
            return Err(Error::file(
                &origin,
                format!(
                    "tensor `score.weight` has shape {:?}, expected [{num_labels}, {}] \
                     (num_labels from config.json, hidden_size)",
                    score.dims(),
                    cfg.hidden_size
                ),
            ));
        }
        // Sequence-classification checkpoints have no LM head, and it is never used here:
        // building the causal LM with a tied head (an alias of the embedding, no copy) lets it
        // load without `lm_head.weight`.
        cfg.tie_word_embeddings = true;
        let lm = CausalLm::from_tensors(&cfg, tensors, DType::F32, device)
            .map_err(|e| Error::file(&origin, e))?;
        let pad_id = config
            .get("pad_token_id")
            .and_then(|v| v.as_u64())
            .map(|v| v as u32);
        Ok(Self {
            max_len: cfg.max_position_embeddings.min(lm.max_positions()),
            vocab_size: cfg.vocab_size,
            score_t: score.t()?.contiguous()?,
            lm,
            tokenizer,
            pad_id,
        })
    }

    /// Token ids of one input: `text` with the tokenizer's special tokens, then `pair` without,
    /// cut to the first `max_len` tokens.
    pub(crate) fn encode(&self, text: &str, pair: Option<&str>) -> Result<Vec<u32>> {
        let mut ids = self.tokenizer.encode(text, true)?;
        if let Some(p) = pair {
            ids.extend(self.tokenizer.encode(p, false)?);
        }
        ids.truncate(self.max_len);
        if ids.is_empty() {
            return Err(Error::ModelInput(
                "an empty text has no tokens to score (the tokenizer adds no BOS)".into(),
            ));
        }
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(Error::Tokenizer(format!(
                "token id {bad} is outside the model's vocabulary ({})",
                self.vocab_size
            )));
        }
        Ok(ids)
    }

    /// Whether the tokenizer has a chat template ([`DecoderClassifier::encode_chat`]).
    pub(crate) fn has_chat_template(&self) -> bool {
        self.tokenizer.has_chat_template()
    }

    /// Token ids of a (user prompt, assistant completion) conversation rendered with the chat
    /// template, as transformers' `apply_chat_template(conversation, tokenize=True)` gives them
    /// (reward models are trained on such conversations); cut to the first `max_len` tokens.
    pub(crate) fn encode_chat(&self, prompt: &str, completion: &str) -> Result<Vec<u32>> {
        let conv = [
            ChatMessage::user(prompt),
            ChatMessage::assistant(completion),
        ];
        let mut ids = self.tokenizer.encode_chat(&conv, false)?;
        ids.truncate(self.max_len);
        Ok(ids)
    }

    /// Logits [B, L] for a batch of inputs.
    pub(crate) fn logits(&self, inputs: &[(&str, Option<&str>)]) -> Result<Tensor> {
        let seqs = inputs
            .iter()
            .map(|(t, p)| self.encode(t, *p))
            .collect::<Result<Vec<_>>>()?;
        self.logits_of_ids(seqs)
    }

    /// Logits [B, L] for a batch of token sequences.
    pub(crate) fn logits_of_ids(&self, seqs: Vec<Vec<u32>>) -> Result<Tensor> {
        // transformers scores the rightmost token that is not the pad token (index 0 when all
        // are); without a pad token, the last one.
        let scored: Vec<usize> = seqs
            .iter()
            .map(|s| match self.pad_id {
                Some(pad) => s.iter().rposition(|&id| id != pad).unwrap_or(0),
                None => s.len() - 1,
            })
            .collect();
        let dev = self.lm.device();
        let batch = SeqBatch::right_padded(&seqs, self.pad_id.unwrap_or(0), dev)?;
        let (b, t) = batch.dims();
        let hidden = self.lm.forward_hidden(&batch, Mode::Infer)?; // [B, T, H]
        let h = hidden.dim(2)?;
        let rows: Vec<u32> = scored
            .iter()
            .enumerate()
            .map(|(i, &j)| (i * t + j) as u32)
            .collect();
        let rows = Tensor::from_vec(rows, b, dev)?; // [B]
        let last = hidden.reshape((b * t, h))?.index_select(&rows, 0)?; // [B, H]
        Ok(last.to_dtype(DType::F32)?.matmul(&self.score_t)?) // [B, L]
    }
}
