//! grpo: fine-tune causal language models with Group Relative Policy Optimization.
//!
//! The RL layer over [`grpo_models`] (the model runtime: models, sampler, tokenizer, hub, ...;
//! its users import it as `grpo_models::...`, not through this crate). Modules, bottom up:
//! - [`config`]: the training configuration (TOML/YAML with TRL's option names), validated once.
//! - [`data`]: prompt datasets (JSONL, CSV, Parquet) and the built-in arithmetic task.
//! - [`rewards`]: reward functions scoring completions.
//! - [`advantages`], [`loss`]: GRPO's group-relative advantages and clipped policy-gradient loss.
//! - [`logprobs`]: per-token log-probs for training, chunked over the vocabulary.
//! - [`optim`]: AdamW with saveable state, gradient clipping, learning-rate schedules.
//! - [`rollout`]: sampling groups into `Episode`s, scoring them, `TrainBatch`.
//! - [`peft`]: LoRA / QLoRA adapters in PEFT's format, merging (the LoRA layer itself is
//!   `grpo_models::models::lora`).
//! - [`checkpoint`], [`export`]: atomic checkpoints in HF layout; loading them back, `grpo export`.
//! - [`logs`]: a run's log files (metrics.jsonl, TensorBoard events, completions, health and
//!   eval rows), fanned out to the [`trackers`].
//! - [`inputs`]: a run's prompt sets and rewards, loaded one way for train, eval and rewards check.
//! - [`eval`]: held-out evaluation: pass@k, accuracy (greedy and sampled), mean rewards.
//! - [`flops`]: the update's model FLOPs, for its throughput and MFU.
//! - [`train`]: the training loop.
//! - [`embed`]: what the Python package asks of the library besides training (evaluation).

pub mod advantages;
pub mod agents;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod embed;
pub mod eval;
pub mod export;
pub mod fill_in;
pub mod flops;
pub mod inputs;
pub mod logprobs;
pub mod logs;
pub mod loss;
pub mod memory_plan;
pub mod named;
pub mod optim;
pub mod peft;
pub mod rewards;
pub mod rollout;
pub mod trackers;
pub mod train;

/// The library's error type is the model runtime's: one enum for both crates.
pub use grpo_models::error::{Error, Result};
