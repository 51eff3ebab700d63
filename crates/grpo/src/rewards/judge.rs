//! `kind = "judge"`: a frozen causal LM asked a rubric question about each completion.
//!
//! The rubric is a template (minijinja, Jinja syntax) over `prompt`, `completion`, `answer` and
//! `metadata`; it is rendered as one user message with the judge's chat template (or fed as plain
//! text with `chat = false`), and the judge's next-token distribution gives the reward:
//! - `mode = "yes_probability"`: the probability of the `yes` token(s); with `no` given, the
//!   probability renormalized over yes and no, `P(yes) / (P(yes) + P(no))`;
//! - `mode = "expected_score"`: the expected value over the `scores` tokens (renormalized over
//!   them), each worth its `score_values` entry (default: 1, 2, 3, ...).

use candle_core::{DType, Device, IndexOp, D};

use super::table::Table;
use super::ScoreItem;
use crate::{Error, Result};
use grpo_models::hub;
use grpo_models::models::{CausalLm, Mode, SeqBatch};
use grpo_models::tokenizer::{ChatMessage, Tokenizer};
use grpo_models::weights::load_model;

const DEFAULT_TEMPLATE: &str = "Question: {{ prompt }}\n\nResponse: {{ completion }}\n\
{% if answer %}Reference answer: {{ answer }}\n\n{% endif %}\
Is the response correct and helpful? Answer Yes or No.";

#[derive(Debug, Clone, PartialEq)]
pub enum JudgeMode {
    /// Token-id sets for yes and (optionally) no.
    YesProbability { yes: Vec<u32>, no: Vec<u32> },
    /// (token ids, value) per score.
    ExpectedScore { scores: Vec<(u32, f32)> },
}

/// The options of a `kind = "judge"` reward, checked; the model is loaded by [`Judge::load`].
#[derive(Debug, Clone, PartialEq)]
pub struct JudgeSpec {
    /// HF directory, .gguf file or hub id (unset: the default model).
    pub model: Option<String>,
    /// The rubric (minijinja), checked to render.
    pub template: String,
    /// Render the rubric with the judge's chat template (unset: when the judge has one).
    pub chat: Option<bool>,
    pub mode: JudgeWords,
    pub batch_size: usize,
}

/// The words whose next-token probabilities make the reward (token ids once the judge's
/// tokenizer is loaded: [`JudgeMode`]).
#[derive(Debug, Clone, PartialEq)]
pub enum JudgeWords {
    YesProbability {
        yes: Vec<String>,
        no: Vec<String>,
    },
    /// Score words and the value of each.
    ExpectedScore {
        scores: Vec<String>,
        values: Vec<f32>,
    },
}

impl JudgeSpec {
    pub const KEYS: &'static [&'static str] = &[
        "model",
        "template",
        "chat",
        "mode",
        "yes",
        "no",
        "scores",
        "score_values",
        "batch_size",
    ];

    pub fn from_table(t: &Table) -> Result<Self> {
        let template = t.str("template", DEFAULT_TEMPLATE)?.to_string();
        // Check the template once with empty values, so a syntax error names the key now.
        render(&template, &ScoreItemOwned::default())
            .map_err(|e| t.err("template", format!("cannot render: {e}")))?;
        let model = t.opt_str("model")?.map(str::to_owned);
        let chat = t.opt_bool("chat")?;
        #[derive(Clone, Copy)]
        enum M {
            Yes,
            Expected,
        }
        let mode = match t.choice(
            "mode",
            M::Yes,
            &[("yes_probability", M::Yes), ("expected_score", M::Expected)],
        )? {
            M::Yes => JudgeWords::YesProbability {
                yes: t.opt_strs("yes")?.unwrap_or_else(|| vec!["Yes".into()]),
                // An absent key means none (documented default).
                no: t.opt_strs("no")?.unwrap_or_default(),
            },
            M::Expected => {
                let scores = t.opt_strs("scores")?.ok_or_else(|| {
                    t.err(
                        "scores",
                        "missing: the score tokens, e.g. [\"1\", \"2\", \"3\", \"4\", \"5\"]",
                    )
                })?;
                let values: Vec<f32> = match t.get("score_values") {
                    None => (1..=scores.len()).map(|v| v as f32).collect(),
                    Some(v) => serde_json::from_value::<Vec<f32>>(v.clone()).map_err(|_| {
                        t.err(
                            "score_values",
                            format!("expected a list of numbers, got {v}"),
                        )
                    })?,
                };
                if values.len() != scores.len() {
                    return Err(t.err(
                        "score_values",
                        format!("{} values for {} score tokens", values.len(), scores.len()),
                    ));
                }
                JudgeWords::ExpectedScore { scores, values }
            }
        };
        Ok(JudgeSpec {
            model,
            template,
            chat,
            mode,
            batch_size: t.usize("batch_size", 8)?.max(1),
        })
    }
}

#[derive(Debug)]
pub struct Judge {
    model: CausalLm,
    tok: Tokenizer,
    template: String,
    /// The template's key in the config (`rewards[2].template`), for errors.
    template_key: String,
    chat: bool,
    mode: JudgeMode,
    batch_size: usize,
    pad: u32,
}

impl Judge {
    /// Loads the judge model on `device`; `path` names the reward table in errors
    /// (`rewards[2]`).
    pub fn load(spec: &JudgeSpec, path: &str, device: &Device) -> Result<Self> {
        let err = |k: &str, msg: String| Error::config(format!("{path}.{k}"), msg);
        let source = hub::resolve_model(spec.model.as_deref())?;
        let loaded = load_model(&source, DType::F32, device)?;
        let tok = loaded.tokenizer()?.clone();
        let mut model = loaded.build()?;
        model.pack_for_decoding()?;
        let chat = spec.chat.unwrap_or(tok.has_chat_template());
        if chat && !tok.has_chat_template() {
            return Err(err(
                "chat",
                format!(
                    "the judge {} has no chat template; set chat = false",
                    source.path().display()
                ),
            ));
        }
        let ids_of = |k: &str, words: &[String]| -> Result<Vec<u32>> {
            words
                .iter()
                .map(|w| {
                    let ids = tok.encode(w, false)?;
                    match ids.as_slice() {
                        [id] => Ok(*id),
                        _ => Err(err(
                            k,
                            format!(
                                "`{w}` is {} tokens for the judge's tokenizer; give words that are \
                                 one token each (e.g. \"Yes\" and \" Yes\")",
                                ids.len()
                            ),
                        )),
                    }
                })
                .collect()
        };
        let mode = match &spec.mode {
            JudgeWords::YesProbability { yes, no } => JudgeMode::YesProbability {
                yes: ids_of("yes", yes)?,
                no: ids_of("no", no)?,
            },
            JudgeWords::ExpectedScore { scores, values } => JudgeMode::ExpectedScore {
                scores: ids_of("scores", scores)?
                    .into_iter()
                    .zip(values.iter().copied())
                    .collect(),
            },
        };
        let pad = tok.pad_token_id().or(tok.eos_token_id()).unwrap_or(0);
        Ok(Judge {
            model,
            tok,
            template: spec.template.clone(),
            template_key: format!("{path}.template"),
            chat,
            mode,
            batch_size: spec.batch_size,
            pad,
        })
    }

    /// The judge's input ids for one item.
    fn input_ids(&self, item: &ScoreItem) -> Result<Vec<u32>> {
        let text = render(&self.template, &ScoreItemOwned::from(item)).map_err(|e| {
            Error::config(
                &self.template_key,
                format!("the judge's rubric cannot render for a completion: {e}"),
            )
        })?;
        let mut ids = if self.chat {
            self.tok.encode_chat(&[ChatMessage::user(text)], true)?
        } else {
            self.tok.encode(&text, true)?
        };
        // Keep the end (the question) when the text is longer than the judge's context.
        let max = self.model.max_positions();
        if ids.len() > max {
            ids.drain(..ids.len() - max);
        }
        Ok(ids)
    }

    pub fn score(&self, items: &[ScoreItem]) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(items.len());
        for chunk in items.chunks(self.batch_size) {
            let seqs = chunk
                .iter()
                .map(|it| self.input_ids(it))
                .collect::<Result<Vec<_>>>()?;
            let batch = SeqBatch::left_padded(&seqs, self.pad, self.model.device())?;
            let (_, t) = batch.dims();
            let hidden = self.model.forward_hidden(&batch, Mode::Infer)?; // [B, T, H]
            let last = hidden.i((.., t - 1, ..))?.contiguous()?; // [B, H]
            let logits = self.model.logits(&last)?; // [B, V] f32
            let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?.to_vec2::<f32>()?;
            out.extend(logp.iter().map(|row| self.reduce(row)));
        }
        Ok(out)
    }

    /// The reward from one next-token log-prob row.
    fn reduce(&self, logp: &[f32]) -> f32 {
        let p = |id: u32| logp.get(id as usize).map_or(0.0, |l| l.exp());
        match &self.mode {
            JudgeMode::YesProbability { yes, no } => {
                let py: f32 = yes.iter().map(|&i| p(i)).sum();
                if no.is_empty() {
                    py
                } else {
                    let pn: f32 = no.iter().map(|&i| p(i)).sum();
                    if py + pn > 0.0 {
                        py / (py + pn)
                    } else {
                        f32::NAN
                    }
                }
            }
            JudgeMode::ExpectedScore { scores } => {
                let total: f32 = scores.iter().map(|&(i, _)| p(i)).sum();
                if total > 0.0 {
                    scores.iter().map(|&(i, v)| p(i) * v).sum::<f32>() / total
                } else {
                    f32::NAN
                }
            }
        }
    }
}

/// What the rubric template sees.
#[derive(Debug, Default, serde::Serialize)]
struct ScoreItemOwned {
    prompt: String,
    completion: String,
    answer: Option<String>,
    metadata: serde_json::Map<String, serde_json::Value>,
}

impl From<&ScoreItem<'_>> for ScoreItemOwned {
    fn from(it: &ScoreItem) -> Self {
        ScoreItemOwned {
            prompt: it.prompt_text().to_string(),
            completion: it.completion.to_string(),
            answer: it.answer.map(str::to_owned),
            metadata: it.metadata.clone(),
        }
    }
}

fn render(template: &str, item: &ScoreItemOwned) -> std::result::Result<String, minijinja::Error> {
    let env = minijinja::Environment::new();
    env.render_str(template, item)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_template_renders_with_and_without_an_answer() {
        let mut it = ScoreItemOwned {
            prompt: "2+2?".into(),
            completion: "4".into(),
            ..Default::default()
        };
        let a = render(DEFAULT_TEMPLATE, &it).unwrap();
        assert!(a.contains("Question: 2+2?") && a.contains("Response: 4"));
        assert!(!a.contains("Reference"));
        it.answer = Some("4".into());
        assert!(render(DEFAULT_TEMPLATE, &it)
            .unwrap()
            .contains("Reference answer: 4"));
        assert!(render("{{ x", &it).is_err());
    }
}
