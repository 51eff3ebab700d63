//! grpo-models: the model runtime under grpo. Nothing here knows about reinforcement learning.
//!
//! Layers, bottom up:
//! - [`error`]: the error type shared by every grpo crate (each variant names the file, tensor or
//!   key it is about).
//! - [`files`]: the files of a Hugging Face model directory (safetensors shards, JSON configs).
//! - [`kernels`]: how the models run fast: grpo's CPU and GPU kernels and the candle-op
//!   portable path, each op's dispatch from the model's resolved `Compute` (the device seam), and
//!   every `GRPO_*` kernel switch, read once.
//! - [`models`]: Llama / Qwen2 / Qwen3 / GPT-2 with HF weight names, a differentiable all-position
//!   forward for training and a cached incremental forward for sampling; BERT-family encoders and
//!   sequence classifiers for reward models.
//! - [`weights`]: loading HF directories (safetensors) and GGUF files into those models;
//!   [`gguf_write`]: the inverse, a model as a GGUF file for llama.cpp / Ollama.
//! - [`tokenizer`]: HF-exact tokenization from tokenizer.json or GGUF metadata, chat templates.
//! - [`hub`]: resolving `--model` (local dir, .gguf, hub id, the embedded default) with a cache.
//! - [`kv_cache`], [`sampler`]: batched, KV-cached, group-aware sampling.
//! - [`seeding`]: independent random streams from one seed.
//! - [`threads`]: the rayon pool and memory readings.

pub mod error;
pub mod faults;
pub mod files;
pub mod gguf_check;
pub mod gguf_write;
pub mod hub;
pub mod kernels;
pub mod kv_cache;
pub mod models;
pub mod sampler;
pub mod seeding;
pub mod threads;
pub mod tokenizer;
pub mod weights;

pub use error::{Error, Result};
