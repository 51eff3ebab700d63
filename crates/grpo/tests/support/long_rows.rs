//! Long, uneven completions (issue 59): the sampler's log-probs against the trainer's passes'.
//! Shared by `tiny_models.rs` (the CPU: fused, and portable in its rerun) and the opt-in GPU
//! checks (`cuda/main.rs`), `#[path]`-included.
//!
//! The tiny Llama fixture, its positions raised to 1,024, samples 4 prompts x 4 rows of up to
//! 400 tokens with token 2 as EOS: rows end anywhere from a few tokens to the cap, so the
//! decoding cache grows past its first 256 slots and drops finished rows on the way, and the
//! prompts share their prefill. The trainer's old-policy pass (`sequence_logprobs`: forward
//! chunks, rows shared by uneven packs off the fused CPU path) then scores the same tokens.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use grpo::logprobs::sequence_logprobs;
use grpo_models::hub::ModelSource;
use grpo_models::models::CausalLm;
use grpo_models::sampler::{generate, PromptInput, SamplingParams, StopReason};
use grpo_models::weights::load_model;

/// Completion cap of the check.
const CAP: usize = 400;

/// How far the sampler's log-probs were from the trainer's (the rows' lengths are printed).
pub struct LongRows {
    /// The largest |sampler - trainer| log-prob over every sampled token.
    pub max_gap: f32,
    /// The mean |sampler - trainer| log-prob.
    pub mean_gap: f32,
}

/// The tiny Llama fixture with `max_position_embeddings` 1,024, in `dir`.
fn long_llama(dir: &Path) {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/llama");
    for f in ["model.safetensors", "generation_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let text = std::fs::read_to_string(src.join("config.json")).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
    cfg["max_position_embeddings"] = 1024.into();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
}

/// Samples the check's rows with `prepare(model)` (the trainer's sampling copy: packed for
/// decoding on the fused CPU path) on `device` in `dtype`, then scores them with the plain
/// model in passes of at most `chunk_tokens`.
pub fn long_uneven_logprob_gap(
    device: &Device,
    dtype: DType,
    chunk_tokens: usize,
    prepare: impl Fn(&mut CausalLm),
) -> LongRows {
    let tmp = tempfile::tempdir().unwrap();
    long_llama(tmp.path());
    let m = load_model(&ModelSource::HfDir(tmp.path().into()), dtype, device).unwrap();
    let mut sampler = m.build().unwrap();
    prepare(&mut sampler);
    let prompts: Vec<PromptInput> = (0..4u32)
        .map(|p| PromptInput {
            ids: (0..5 + 2 * p)
                .map(|t| 3 + (p * 41 + t * 13) % 250)
                .collect(),
            seed: 11 + p as u64,
        })
        .collect();
    let temperature = 1.0;
    let params = SamplingParams {
        max_new_tokens: CAP,
        temperature,
        eos_token_ids: vec![2],
        ..Default::default()
    };
    let (out, stats) = generate(&sampler, None, &prompts, 4, &params).unwrap();
    let trainer = m.build().unwrap();
    let mut pairs = Vec::new();
    let mut sampled = Vec::new();
    let mut eos = 0;
    for (p, group) in prompts.iter().zip(&out) {
        for c in group {
            assert_eq!(c.ids.len(), c.logprobs.len());
            eos += usize::from(c.stop_reason == StopReason::Eos);
            pairs.push((p.ids.as_slice(), c.ids.as_slice()));
            sampled.push(c.logprobs.as_slice());
        }
    }
    let scored = sequence_logprobs(&trainer, &pairs, 0, temperature, chunk_tokens).unwrap();
    let (mut max_gap, mut sum, mut n) = (0f32, 0f32, 0usize);
    for (s, t) in sampled.iter().zip(&scored) {
        assert_eq!(s.len(), t.len());
        for (a, b) in s.iter().zip(t) {
            max_gap = max_gap.max((a - b).abs());
            (sum, n) = (sum + (a - b).abs(), n + 1);
        }
    }
    let lengths: Vec<usize> = pairs.iter().map(|(_, c)| c.len()).collect();
    // What the check is for: rows past the cache's first 256 slots, rows 4x shorter, rows ended
    // on EOS and dropped from the decoding batch.
    let (shortest, longest) = (
        lengths.iter().min().copied().unwrap_or(0),
        lengths.iter().max().copied().unwrap_or(0),
    );
    assert!(
        longest > 256 && shortest * 4 < longest && eos > 0 && stats.compactions > 0,
        "not long and uneven: {lengths:?}, {eos} on EOS, {} compactions",
        stats.compactions
    );
    let mean_gap = sum / n.max(1) as f32;
    eprintln!(
        "{dtype:?} on {device:?}: lengths {lengths:?}, {eos} on EOS; sampler vs trainer log-probs \
         differ by {max_gap} at most, {mean_gap} on average"
    );
    LongRows { max_gap, mean_gap }
}
