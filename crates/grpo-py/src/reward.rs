//! A Python reward function as a library reward ([`grpo::rewards::host::HostReward`]): each batch
//! of completions goes to the package's caller (`grpo._rewards.Caller`) as one JSON object,
//!
//! ```text
//! {"prompts": [...], "completions": [...], "completion_ids": [[...]], "columns": {name: [...]}}
//! ```
//!
//! which calls the function as TRL does (its keyword arguments, `trainer_state`, async functions
//! awaited) and returns one float or None per completion.

use pyo3::prelude::*;
use serde_json::{json, Map, Value};

use grpo::data::Prompt;
use grpo::rewards::ScoreItem;

use crate::{keep_raised, Raised};

pub struct PyReward {
    name: String,
    /// `score(batch_json) -> list[float | None]`.
    score: Py<PyAny>,
    /// The dataset column the answers were read from (`answer_field`): it goes back to the
    /// function under that name, as TRL passes every column.
    answer_field: String,
    raised: Raised,
}

impl std::fmt::Debug for PyReward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PyReward({})", self.name)
    }
}

impl PyReward {
    pub fn new(name: String, score: Py<PyAny>, answer_field: String, raised: Raised) -> Self {
        PyReward {
            name,
            score,
            answer_field,
            raised,
        }
    }
}

impl grpo::rewards::host::HostReward for PyReward {
    fn score(&self, items: &[ScoreItem]) -> grpo::Result<Vec<f32>> {
        let batch = batch_json(items, &self.answer_field).to_string();
        Python::attach(|py| {
            let out = self
                .score
                .call1(py, (batch,))
                .and_then(|v| v.extract::<Vec<Option<f64>>>(py));
            match out {
                Ok(v) => Ok(v
                    .into_iter()
                    .map(|x| x.map_or(f32::NAN, |x| x as f32))
                    .collect()),
                Err(e) => {
                    let msg = e.to_string();
                    keep_raised(&self.raised, e);
                    Err(grpo::Error::reward(&self.name, msg))
                }
            }
        })
    }
}

/// Dataset columns TRL does not pass to reward functions as columns.
const NOT_COLUMNS: &[&str] = &["prompt", "completion", "completion_ids"];

/// The batch as TRL's reward functions get it: prompts as the dataset holds them (a string or
/// messages); completions as strings, or for a conversational prompt as `[{"role":
/// "assistant", "content": ...}]` (an agent's episode: its messages); token ids (the EOS, when
/// sampled, last); every other column as a list (None where a row lacks it).
pub fn batch_json(items: &[ScoreItem], answer_field: &str) -> Value {
    let prompts: Vec<Value> = items.iter().map(ScoreItem::prompt_json).collect();
    let completions: Vec<Value> = items
        .iter()
        .map(|it| match (it.messages, it.prompt) {
            (Some(ms), _) => Value::Array(ms.to_vec()),
            (None, Prompt::Messages(_)) => {
                json!([{"role": "assistant", "content": it.completion}])
            }
            (None, Prompt::Text(_)) => Value::String(it.completion.to_string()),
        })
        .collect();
    let ids: Vec<Value> = items
        .iter()
        .map(|it| it.completion_ids.map_or(Value::Null, |ids| json!(ids)))
        .collect();
    let mut columns = Map::new();
    let has_answers = items.iter().any(|it| it.answer.is_some());
    if has_answers {
        let answers = items.iter().map(|it| json!(it.answer)).collect();
        columns.insert(answer_field.to_string(), Value::Array(answers));
    }
    for it in items {
        // TRL passes every column but the prompt, a completion and completion ids.
        for k in it
            .metadata
            .keys()
            .filter(|k| !NOT_COLUMNS.contains(&k.as_str()))
        {
            if !columns.contains_key(k) {
                let col = items
                    .iter()
                    .map(|x| x.metadata.get(k).cloned().unwrap_or(Value::Null))
                    .collect();
                columns.insert(k.clone(), Value::Array(col));
            }
        }
    }
    json!({
        "prompts": prompts,
        "completions": completions,
        "completion_ids": ids,
        "columns": columns,
    })
}
