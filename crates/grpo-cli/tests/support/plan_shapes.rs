//! What the memory plan's measured checks share (`tests/memory_plan.rs` in one process,
//! `tests/mpi.rs` on 2 ranks): the arguments `grpo plan` and `grpo train` both take, and the
//! model shapes (SmolLM2's vocabulary, random weights from `tiny_llama.rs`'s `random_llama`).

/// One micro-batch of 16 completions of 16 tokens in one pass, f32 on the fused CPU kernels.
pub const COMMON: [&str; 10] = [
    "--dtype=f32",
    "--num_generations=4",
    "--per_device_train_batch_size=16",
    "--gradient_accumulation_steps=1",
    "--max_completion_length=16",
    // One pass of exactly this batch: no dynamic sampling (it oversamples and keeps no group of
    // a random model), the fused CPU kernels' default budget holds the whole micro-batch.
    "--dynamic_sampling=false",
    "--task.train_size=8",
    "--task.eval_size=2",
    "--temperature=1.0",
    "--kernels=fused",
];

/// A wide model: hidden 256, 4 layers (hidden, intermediate, layers, heads, kv heads, head dim).
pub const WIDE: (usize, usize, usize, usize, usize, usize) = (256, 1024, 4, 8, 4, 32);

/// A deep one: hidden 128, 16 layers.
pub const DEEP: (usize, usize, usize, usize, usize, usize) = (128, 512, 16, 4, 2, 32);
