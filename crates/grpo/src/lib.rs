//! grpo: fine-tune causal language models with Group Relative Policy Optimization.
//!
//! This crate is the library behind the `grpo` binary. Layers, bottom up:
//! - [`models`]: Llama / Qwen2 / Qwen3 / GPT-2 with HF weight names, a differentiable all-position
//!   forward for training and a cached incremental forward for sampling.
//! - [`weights`]: loading HF directories (safetensors) and GGUF files into those models.
//! - [`tokenizer`]: HF-exact tokenization from tokenizer.json or GGUF metadata, chat templates.
//! - [`hub`]: resolving `--model` (local dir, .gguf, hub id, the embedded default) with a cache.
//! - [`sampler`]: batched, KV-cached, group-aware sampling.
//! - [`logprobs`]: per-token log-probs for training, chunked over the vocabulary.
//! - [`config`]: the training configuration (TOML/YAML with TRL's option names), validated once.
//! - [`data`]: prompt datasets (JSONL, CSV, Parquet) and the built-in arithmetic task.
//! - [`rewards`]: reward functions scoring completions.
//! - [`advantages`], [`loss`]: GRPO's group-relative advantages and clipped policy-gradient loss.
//! - [`lora`]: LoRA / QLoRA adapters in PEFT's format, merging.
//! - [`optim`]: AdamW with saveable state, gradient clipping, learning-rate schedules.
//! - [`export`]: loading checkpoints (LoRA ones over their base) and `grpo export`.
//! - [`metrics`], [`checkpoint`]: metrics.jsonl + TensorBoard, atomic checkpoints in HF layout.
//! - [`eval`]: held-out evaluation: pass@k, accuracy (greedy and sampled), mean rewards.
//! - [`train`]: the training loop.
//! - [`report`]: `report.html` with PNG plots of a run directory.

pub mod advantages;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod error;
pub mod eval;
pub mod export;
pub mod hub;
pub mod kv_cache;
pub mod logprobs;
pub mod lora;
pub mod loss;
pub mod metrics;
pub mod models;
pub mod optim;
pub mod report;
pub mod rewards;
pub mod rollout;
pub mod sampler;
pub mod threads;
pub mod tokenizer;
pub mod train;
pub mod weights;

pub use error::{Error, Result};
