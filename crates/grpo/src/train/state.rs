//! What a checkpoint holds beyond weights and moments to resume a run exactly
//! ([`TrainerState`], `trainer_state.json`), and which checkpoint is the best ([`BestModel`]).

use crate::data::PromptOrder;
use crate::loss::{AdaptiveEntropy, AdaptiveKl};

/// Everything a checkpoint must hold beyond weights and moments to resume exactly.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct TrainerState {
    /// Optimizer steps done.
    pub step: u64,
    /// Rounds (generation batches) done.
    pub round: u64,
    pub order: PromptOrder,
    pub adaptive_kl: Option<AdaptiveKl>,
    /// Adaptive entropy control's coefficient and last measurement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adaptive_entropy: Option<AdaptiveEntropy>,
    pub consecutive_nonfinite: usize,
    /// Optimizer steps skipped over the run for non-finite numbers (`skipped_steps`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub skipped_steps: u64,
    /// AdamW's own step count (its bias correction) where it differs from `step`: skipped
    /// steps and rounds without signal advance `step` without an AdamW step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_steps: Option<u64>,
    /// Dynamic sampling's extra passes so far (their random streams).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub extra_passes: u64,
    /// `metric_for_best_model`: the best value so far, its step and checkpoint (HF's names).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_metric: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_global_step: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_model_checkpoint: Option<String>,
}

/// Which checkpoint is the best (`metric_for_best_model`, `greater_is_better`).
#[derive(Debug, Clone, PartialEq)]
pub struct BestModel {
    /// A metric the round logs, e.g. `eval/accuracy`.
    pub metric: String,
    pub greater_is_better: bool,
}

impl BestModel {
    /// This round's value of the metric when it beats the best so far.
    pub fn improved_by(&self, m: &super::StepMetrics, state: &TrainerState) -> Option<f64> {
        let v = m
            .pairs()
            .into_iter()
            .find(|(k, _)| *k == self.metric)
            .map(|x| x.1)
            .filter(|v| v.is_finite())?;
        let better = match state.best_metric {
            None => true,
            Some(b) if self.greater_is_better => v > b,
            Some(b) => v < b,
        };
        better.then_some(v)
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}
