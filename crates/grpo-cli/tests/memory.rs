//! Peak memory of a whole micro-batch in one pass on the portable kernels (the candle ops a GPU
//! runs), measured on the CPU as the child process's peak resident set: the CI's proxy for GPU
//! memory. One test in its own binary, so the only child whose peak is read is the run.

use std::process::Command;

#[path = "../../grpo/tests/support/tiny_llama.rs"]
mod support;

/// Peak resident set of the children this process has waited for, in bytes.
fn children_peak_rss() -> u64 {
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `u` is a valid rusage to write into.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut u) }, 0);
    u.ru_maxrss as u64 * 1024 // kilobytes on Linux
}

/// One GRPO step of a small Llama with SmolLM2's 49,152-token vocabulary, 8 prompts x 4
/// completions x 256 tokens (8,192 completion tokens) in ONE forward/backward pass
/// (`forward_chunk_tokens` far above it), a KL to the reference, on `--kernels=portable`.
///
/// The bound, derived: the static state is ~3.3M parameters (the tied 49,152 x 64 embedding is
/// 3.1M) kept as policy weights, gradients, two AdamW moments, the reference and the sampler's
/// copy: 6 x 13 MB = 80 MB. What a training pass keeps for its backward grows with tokens x
/// hidden (8,192 x 64-256 floats per tensor, a few dozen tensors per layer, 2 layers: < 100 MB).
/// What it holds at a time beyond that is bounded by the chunk budget of the recomputed
/// attention and LM head (`CHUNK_BYTES` = 256 MB of f32 per tensor, at most ~4 such tensors live:
/// logits, probabilities, their gradient, its cast) = 1 GB. The process itself (binary,
/// tokenizer, allocator slack, sampling buffers) stays under 0.5 GB. Bound: 2 GB.
///
/// Without the recomputation, autograd keeps the [8192, 49152] f32 logits and 3-4 tensors made
/// from them for the backward: 1.6 GB each, > 6 GB in all (the previous portable path measured
/// 12.8 GB on this run).
#[test]
fn a_whole_micro_batch_on_the_portable_path_stays_within_its_memory_bound() {
    let tmp = tempfile::tempdir().unwrap();
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let model = tmp.path().join("model");
    support::random_llama(&model, &fixtures, (64, 256, 2, 4, 2, 16));
    let out = tmp.path().join("run");
    // GRPO_MEMORY_TEST_BIN: another build to measure (an earlier commit's, for comparison).
    let bin = std::env::var("GRPO_MEMORY_TEST_BIN").unwrap_or(env!("CARGO_BIN_EXE_grpo").into());
    let o = Command::new(bin)
        .args(["train", "--kernels=portable", "--max_steps=1"])
        .args(["--num_generations=4", "--per_device_train_batch_size=32"])
        .args([
            "--gradient_accumulation_steps=1",
            "--max_completion_length=256",
        ])
        .args([
            "--forward_chunk_tokens=1000000",
            "--beta=0.04",
            "--threads=2",
        ])
        .args(["--save_steps=0", "--eval_steps=0", "--report_to=none"])
        // One pass of exactly this micro-batch (the default's dynamic sampling would sample
        // 1.5x the prompts, and keep no group of a random model).
        .args(["--dynamic_sampling=false", "--temperature=1.0"])
        .args(["--task.train_size=8", "--task.eval_size=2"])
        .arg(format!("--model={}", model.display()))
        .arg(format!("--output_dir={}", out.display()))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let peak = children_peak_rss();
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let step: serde_json::Value = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|r| r["step"] == 1)
        .expect("a step-1 row");
    // The pass really ran over ~8k tokens and took a step.
    let len = step["completions/mean_length"].as_f64().unwrap();
    assert!(len > 200.0, "completions of {len} tokens on average");
    assert!(
        step["grad_norm"].as_f64().is_some_and(f64::is_finite),
        "{step}"
    );
    let gb = peak as f64 / 1e9;
    eprintln!("peak RSS of one 8x4x256 micro-batch on the portable path: {gb:.2} GB");
    assert!(gb < 2.0, "peak RSS {gb:.2} GB is above the 2 GB bound");
}
