//! The memory plan (`grpo plan`): what each rank of a run holds, term by term, and its peak,
//! from the model's shapes and the config alone (no weight is loaded).
//!
//! A rank holds, for the whole run ([`Phase::Always`]), the process itself, the policy's weights,
//! the frozen reference when a KL term needs one, and AdamW's moments. On top of that, one phase
//! at a time: the rollout (the policy frozen for sampling, the KV cache of a sampling pass, the
//! last logits), the old/reference log-probs (a forward without a graph), and the update
//! (gradients, the activations a training pass keeps for its backward, and the LM head's
//! logits). The plan's peak is the always-held terms plus the largest phase. Each term's doc
//! comment in [`terms`] says which code it follows.
//!
//! ZeRO (`zero_stage` s over N ranks) shards the f32 state as DeepSpeed does: the moments for
//! s >= 1, the summed gradients for s >= 2 (whole while candle's backward makes them, then one
//! window at a time reduce-scattered), the trainable weights for s >= 3 (each block gathered in
//! turn for the forward, the whole model gathered for sampling, the parameters outside the
//! blocks gathered with their gradients for the step).
//!
//! Checked against measured peaks on the CPU (`crates/grpo-cli/tests/memory_plan.rs`: the
//! child's peak resident set; `crates/grpo-cli/tests/mpi.rs`: 2 ranks at each stage). GPU terms
//! follow the same code paths but are not measured.

mod model;
mod terms;
#[cfg(test)]
mod tests;

pub use model::{lora_activation_elems, safetensors_shapes, ModelShapes, ShapeSource};
pub use terms::{pass_shape, PassShape};

use grpo_models::kernels::Compute;

use crate::Result;

/// Bytes of the process itself on the CPU beyond every planned term: the binary and its
/// libraries, the tokenizer and the run's data, thread stacks, the allocator's own pages and its
/// slack. The one calibrated number of the plan: measured peak minus planned terms was 126 MiB
/// (median) over the three CPU shapes of `crates/grpo-cli/tests/memory_plan.rs` and 165 MiB
/// over 20 small f32 runs (`docs/distributed.md`, "Memory plan"); this is between the two.
pub const CPU_PROCESS_BYTES: u64 = 140 << 20;

/// Bytes a CPU rank of several holds beyond one process's [`CPU_PROCESS_BYTES`]: Open MPI's
/// libraries and shared-memory transport, and the collectives' own buffers. Calibrated: the
/// measured peak of 2 ranks at `zero_stage` 0 and 1 minus the plan without this term was 20 to
/// 60 MB over two shapes (`crates/grpo-cli/tests/mpi.rs`,
/// `the_plan_is_within_ten_percent_of_measured_peaks_on_2_ranks`).
pub const MPI_RANK_BYTES: u64 = 40 << 20;

/// Bytes a GPU rank holds beyond its tensors: the CUDA context, cuBLAS workspaces and the caching
/// pool's rounding. Assumed, not measured (no GPU run checks it).
pub const GPU_PROCESS_BYTES: u64 = 1 << 30;

/// The share of the memory the plan keeps free: a plan over `1 - FIT_HEADROOM` of the memory
/// is called tight (allocator fragmentation, the pool's rounding, other processes).
pub const FIT_HEADROOM: f64 = 0.10;

/// When a term is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// For the whole run.
    Always,
    /// While a round is sampled.
    Rollout,
    /// While the old and reference log-probs are taken.
    LogProbs,
    /// While the policy's gradients are computed and the optimizer steps.
    Update,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Always => "always",
            Phase::Rollout => "rollout",
            Phase::LogProbs => "log-probs",
            Phase::Update => "update",
        }
    }
}

/// LoRA's part of a plan.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraPlan {
    /// Adapter parameters (A and B of every adapted projection).
    pub trainable: u64,
    /// Elements of the dense weights a merge copies (the joined projections that hold an
    /// adapted part).
    pub merged_elems: u64,
    /// QLoRA: bits per element of the quantized projections (scales included).
    pub quantized_bits: Option<f64>,
    /// Elements per token the adapters keep for the backward, all layers
    /// ([`ModelShapes::lora_activation_elems`]).
    pub activation_elems: u64,
}

/// The batch a rank sees.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchShape {
    /// Tokens of the longest prompt (the sampler pads prompts to it).
    pub prompt_tokens: usize,
    /// `max_completion_length`: the plan assumes every completion runs to it.
    pub completion_tokens: usize,
    /// `num_generations` (G).
    pub generations: usize,
    /// `per_device_train_batch_size`: completions per micro-batch.
    pub micro_batch: usize,
    /// Completions this rank samples per round (`generation_batch_size`, times the dynamic
    /// sampling's oversampling).
    pub round_sequences: usize,
    /// `sampling_batch_size` (0: a whole round at once).
    pub sampling_batch: usize,
    /// `forward_chunk_tokens`; `None`: the trainer's default for the device.
    pub forward_chunk_tokens: Option<usize>,
}

/// What the plan is made from.
#[derive(Debug, Clone)]
pub struct PlanInput {
    pub model: ModelShapes,
    /// The run's compute (device, dtype and kernels resolved).
    pub compute: Compute,
    /// Bytes of an element in the compute dtype (4 for f32, 2 for bf16).
    pub dtype_bytes: usize,
    pub lora: Option<LoraPlan>,
    /// A KL term (or a reward) reads a frozen reference.
    pub reference: bool,
    /// `sync_ref_model`: the reference's f32 tensors are kept to mix the policy into.
    pub sync_ref_model: bool,
    /// The update is off-policy: the sampling policy's log-probs are taken after the rollout.
    pub needs_old: bool,
    pub gradient_checkpointing: bool,
    pub world_size: usize,
    pub zero_stage: u8,
    pub batch: BatchShape,
    /// The memory the plan is checked against (sizes the GPU's default pass).
    pub memory: Option<u64>,
}

/// One line of the plan.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Term {
    pub name: &'static str,
    pub phase: Phase,
    pub bytes: u64,
    /// How the bytes were counted.
    pub how: String,
}

/// What a rank holds, term by term, and its peak.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Plan {
    pub params: u64,
    pub trainable: u64,
    pub shape_source: ShapeSource,
    pub compute: &'static str,
    pub world_size: usize,
    pub zero_stage: u8,
    /// A training pass: tokens, completion tokens, passes per micro-batch.
    pub pass: PassShape,
    pub terms: Vec<Term>,
    /// The phase whose terms, with the always-held ones, make the peak.
    pub peak_phase: Phase,
    pub peak_bytes: u64,
}

impl Plan {
    /// Bytes of the terms held in `phase` (the always-held ones not included).
    pub fn phase_bytes(&self, phase: Phase) -> u64 {
        self.terms
            .iter()
            .filter(|t| t.phase == phase)
            .map(|t| t.bytes)
            .sum()
    }
}

/// The plan of `input`: every term, then the peak over the phases.
pub fn plan(input: &PlanInput) -> Result<Plan> {
    input.check()?;
    let mut terms = terms::always(input);
    let held: u64 = terms.iter().map(|t| t.bytes).sum();
    let chunk = terms::forward_chunk_tokens(input, held);
    let pass = pass_shape(&input.batch, chunk, crate::logprobs::one_row(input.compute));
    terms.extend(terms::rollout(input));
    terms.extend(terms::log_probs(input, chunk));
    terms.extend(terms::update(input, &pass));
    let mut plan = Plan {
        params: input.model.params(),
        trainable: terms::trainable(input),
        shape_source: input.model.source,
        compute: input.compute.name(),
        world_size: input.world_size,
        zero_stage: input.zero_stage,
        pass,
        terms,
        peak_phase: Phase::Update,
        peak_bytes: 0,
    };
    let (phase, bytes) = [Phase::Rollout, Phase::LogProbs, Phase::Update]
        .into_iter()
        .map(|p| (p, plan.phase_bytes(p)))
        .fold((Phase::Update, 0), |best, x| match x.1 > best.1 {
            true => x,
            false => best,
        });
    plan.peak_phase = phase;
    plan.peak_bytes = plan.phase_bytes(Phase::Always) + bytes;
    Ok(plan)
}

impl PlanInput {
    fn check(&self) -> Result<()> {
        use crate::Error;
        if self.world_size == 0 {
            return Err(Error::config("world_size", "must be at least 1"));
        }
        if self.zero_stage > 3 {
            return Err(Error::config(
                "zero_stage",
                format!("{}: expected 0, 1, 2 or 3", self.zero_stage),
            ));
        }
        if self.batch.generations == 0 || self.batch.micro_batch == 0 {
            return Err(Error::config(
                "num_generations",
                "the plan needs at least one completion per group and per micro-batch",
            ));
        }
        Ok(())
    }
}

/// A card's memory, by the names `--card` takes.
pub const CARDS: [(&str, u64); 10] = [
    ("h200", 141_000_000_000),
    ("h100-80gb", 80 << 30),
    ("h100-94gb", 94 << 30),
    ("a100-80gb", 80 << 30),
    ("a100-40gb", 40 << 30),
    ("l40s", 48 << 30),
    ("a10g", 24 << 30),
    ("l4", 24 << 30),
    ("rtx-4090", 24 << 30),
    ("t4", 16 << 30),
];

/// The memory of card `name` (case-insensitive), or an error listing the known ones.
pub fn card_memory(name: &str) -> Result<u64> {
    let want = name.to_ascii_lowercase();
    CARDS
        .iter()
        .find(|(n, _)| *n == want)
        .map(|(_, b)| *b)
        .ok_or_else(|| {
            let known: Vec<&str> = CARDS.iter().map(|(n, _)| *n).collect();
            crate::Error::config(
                "card",
                format!(
                    "`{name}` is not a card the plan knows: {} (or give --memory, e.g. --memory 80GiB)",
                    known.join(", ")
                ),
            )
        })
}

/// Bytes from `80GiB`, `80GB`, `512MiB`, `1.5TB` or a plain number of bytes.
pub fn parse_bytes(text: &str) -> Result<u64> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    let scale: f64 = match unit.as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" | "g" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => (1u64 << 20) as f64,
        "gib" => (1u64 << 30) as f64,
        "tib" => (1u64 << 40) as f64,
        _ => f64::NAN,
    };
    match num.parse::<f64>() {
        Ok(n) if n > 0.0 && scale.is_finite() => Ok((n * scale) as u64),
        _ => Err(crate::Error::config(
            "memory",
            format!("`{text}` is not a size: give e.g. 80GiB, 24GB or 512MiB"),
        )),
    }
}

/// `bytes` as GiB (or MiB below one GiB), for tables.
pub fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", b / (1u64 << 20) as f64)
    }
}

/// Whether `peak` fits `memory` with [`FIT_HEADROOM`] to spare: a sentence.
pub fn verdict(peak: u64, memory: u64) -> String {
    let usable = (memory as f64 * (1.0 - FIT_HEADROOM)) as u64;
    if peak <= usable {
        format!(
            "fits: {} of {} ({:.0}%), {} to spare",
            human(peak),
            human(memory),
            100.0 * peak as f64 / memory as f64,
            human(memory - peak)
        )
    } else if peak <= memory {
        format!(
            "tight: {} of {} ({:.0}%) leaves less than the {:.0}% headroom",
            human(peak),
            human(memory),
            100.0 * peak as f64 / memory as f64,
            100.0 * FIT_HEADROOM
        )
    } else {
        format!(
            "does not fit: {} needed, {} available ({} short)",
            human(peak),
            human(memory),
            human(peak - memory)
        )
    }
}
