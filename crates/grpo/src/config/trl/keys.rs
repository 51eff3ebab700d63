//! The TRL, PEFT, HF `TrainingArguments` and seeds' keys grpo knows, as data: aliases of grpo's
//! keys, keys read with their own rule (mapped), keys accepted and ignored with their reason, and
//! grpo's defaults that differ from TRL's.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::config::sections::is_key;

/// grpo's defaults that differ from TRL 1.16's GRPOConfig, kept deliberately: `(key, grpo's
/// default, TRL's default, why)`. A config that names TRL keys and leaves one of these unset is
/// told at the start of the run ([`defaults_relied_on`]); docs/config.md has the same table.
pub const DEFAULT_DIFFERENCES: &[(&str, &str, &str, &str)] = &[
    ("num_train_epochs", "1", "3", "a GRPO run is usually sized by max_steps; one pass keeps a run left unsized short"),
    ("max_completion_length", "256", "512", "each token costs a decoding step on the CPU; set it to what the task needs"),
    ("max_prompt_length", "512", "none (TRL 1.16 keeps whole prompts)", "bounds a round's memory; -1 keeps whole prompts as TRL does"),
    ("gradient_checkpointing", "false", "true", "on the CPU, recomputing each block costs a forward and saves little; on a GPU turn it on where memory binds: on an H200 it took a 135M model's 8 x 4 x 64 f32 step from 7.3 to 4.1 GB peak at the same 0.44 s, while at 1.7B it would add a forward (~0.4 s) to a 3.4 s step"),
    ("logging_steps", "1", "10", "every step's metrics are cheap, and the report's plots and the health checks read them"),
    ("log_completions", "true", "false", "completions.jsonl is how you see what the model writes"),
    ("report_to", "[\"tensorboard\"]", "none", "local event files, no service needed"),
    ("output_dir", "runs/grpo", "trainer_output", "grpo's runs go under runs/"),
];

/// The keys of [`DEFAULT_DIFFERENCES`] that a config naming TRL keys (`trl_style`) leaves at
/// grpo's default, given the keys it sets.
pub fn defaults_relied_on(
    trl_style: bool,
    given: &std::collections::BTreeSet<String>,
) -> Vec<&'static str> {
    if !trl_style {
        return vec![];
    }
    DEFAULT_DIFFERENCES
        .iter()
        .map(|d| d.0)
        .filter(|k| !given.contains(*k))
        // A run sized by max_steps does not read num_train_epochs.
        .filter(|k| !(*k == "num_train_epochs" && given.contains("max_steps")))
        .collect()
}

/// Whether a config document is written for TRL: YAML (TRL's format), or a key that only TRL
/// or HF's TrainingArguments has.
pub fn names_trl_keys(doc: &BTreeMap<String, Value>, yaml: bool) -> bool {
    yaml || doc.keys().any(|k| {
        matches!(
            trl_key(k),
            Some(TrlKey::Alias(_) | TrlKey::Mapped(_) | TrlKey::Ignored(_))
        )
    })
}

/// TRL's, PEFT's and the seeds' names for grpo's keys (the value is used as it is).
pub(super) const ALIASES: &[(&str, &str)] = &[
    ("model_name_or_path", "model"),
    ("num_generations_eval", "eval_num_samples"),
    // The fill-in seed's names (single-step fill-in GRPO).
    ("generator_checkpoint", "model"),
    ("judge_checkpoint", "judge"),
    ("group_size", "num_generations"),
    ("wandb_run_name", "run_name"),
    ("kl_beta", "beta"),
    ("out_dir", "output_dir"),
    ("save_interval", "save_steps"),
    ("eval_interval", "eval_steps"),
    // The seeds' PPO-era names (TRL's PPOConfig and their scripts).
    ("cliprange", "epsilon"),
    ("clip_eps", "epsilon"),
    ("clip_range", "epsilon"),
    ("save_freq", "save_steps"),
    ("init_kl_coef", "kl_coef"),
    ("target_kl", "kl_target"),
    ("horizon", "kl_horizon"),
    ("normalize_batch", "normalize_advantages_batch"),
    ("gen_batch_size", "sampling_batch_size"),
    // grpo's own earlier name.
    ("max_consecutive_nonfinite", "max_bad_steps"),
    // TRL's ModelConfig names for PEFT.
    ("lora_r", "lora.r"),
    ("lora_alpha", "lora.alpha"),
    ("lora_dropout", "lora.dropout"),
    ("lora_target_modules", "lora.target_modules"),
    ("use_rslora", "lora.use_rslora"),
];

/// Keys that are read with their own rule (not a key of the table): what each does.
pub(super) const MAPPED: &[(&str, &str)] = &[
    ("use_peft", "true: LoRA at rank 16 unless lora_r says otherwise"),
    ("torch_dtype", "sets dtype on a GPU; on the CPU a half-precision torch_dtype sets dtype = \"auto\": bf16 products where the CPU has bf16 hardware (AVX512_BF16, AMX) that is faster than its f32, f32 elsewhere (the log says which)"),
    ("bf16", "true: dtype = bf16 on a GPU (mixed precision: bf16 weights and activations over f32 master parameters, f32 optimizer and loss); on the CPU dtype = \"auto\": bf16 products where the CPU has bf16 hardware (AVX512_BF16, AMX) that is faster than its f32, f32 elsewhere (the log says which)"),
    ("load_in_4bit", "base_quantization = nf4 (QLoRA's 4-bit NormalFloat, bitsandbytes' blocks of 64)"),
    ("load_in_8bit", "base_quantization = q8_0"),
    ("use_dora", "true is refused: DoRA adapters are not supported"),
    ("lora_modules_to_save", "refused when set: grpo trains adapters on projections only"),
    ("lora_target_parameters", "refused when set: adapters go on projections by name (lora_target_modules)"),
    ("model_revision", "main only (a hub model's main revision); another is refused with how to use it"),
    ("resume_from_checkpoint", "true: resume from the newest checkpoint in output_dir (as --resume); a path is refused with how to resume"),
    ("dataset_name", "a local dataset file, a directory holding its splits, or a hub dataset id whose split files are fetched into the hub cache: train_file / eval_file"),
    ("dataset_train_split", "the split of dataset_name used as train_file"),
    ("dataset_test_split", "the split of dataset_name used as eval_file"),
    ("dataset_config", "the configuration (subset) of dataset_name: its directory of split files"),
    ("reward_funcs", "TRL's built-in rewards as grpo rules (accuracy_reward, reasoning_accuracy_reward, think_format_reward, get_soft_overlong_punishment); Python functions (`module.function`, `file.py:function`) run unchanged as `kind = \"python\"` rewards"),
    ("reward_model_name_or_path", "a classifier reward on prompt + completion, label 0's logit (TRL's reward model)"),
    ("generation_kwargs", "temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens, stop_strings set the sampler's keys; others are refused"),
    ("chat_template_kwargs", "variables for the chat template (e.g. enable_thinking)"),
    ("optim", "adamw_* values are grpo's AdamW; another optimizer is refused"),
    ("wandb_log", "true: adds wandb to report_to (the seeds' switch)"),
    ("adap_kl_ctrl", "TRL PPOConfig's switch for the seeds' kl_ctl: true makes kl_coef adaptive (kl_target, TRL's default 6.0 unless given), false keeps it fixed"),
];

/// TRL / HF keys accepted and ignored, each with its reason (listed in the warning at start).
/// Any `vllm_*` key is ignored too: grpo samples with its own KV-cached sampler.
const IGNORED: &[(&str, &str)] = &[
    ("fp16", "grpo computes in f32 (bf16 through dtype)"),
    ("tf32", "grpo computes in f32 (bf16 through dtype)"),
    ("bf16_full_eval", "evaluation runs at dtype"),
    ("fp16_full_eval", "evaluation runs at dtype"),
    (
        "cast_lm_head_to_fp32",
        "grpo computes the LM head in f32 already",
    ),
    ("use_vllm", "grpo samples with its own KV-cached sampler"),
    ("vllm_mode", "grpo samples with its own KV-cached sampler"),
    (
        "use_transformers_paged",
        "grpo samples with its own KV-cached sampler",
    ),
    (
        "use_transformers_continuous_batching",
        "grpo samples with its own KV-cached sampler",
    ),
    (
        "transformers_continuous_batching_config",
        "grpo samples with its own KV-cached sampler",
    ),
    (
        "cache_implementation",
        "grpo samples with its own KV-cached sampler",
    ),
    (
        "use_cache",
        "sampling always uses the KV cache, training never needs one",
    ),
    (
        "attn_implementation",
        "grpo's attention kernels are its own",
    ),
    (
        "trust_remote_code",
        "grpo runs no model code from the hub; its architectures are built in",
    ),
    (
        "model_init_kwargs",
        "models load through grpo's own loader (dtype, base_quantization)",
    ),
    (
        "disable_dropout",
        "grpo's policies run without dropout (LoRA's own dropout is lora_dropout)",
    ),
    (
        "router_aux_loss_coef",
        "grpo's architectures have no mixture-of-experts router",
    ),
    ("pad_to_multiple_of", "grpo packs and pads its own batches"),
    ("torch_compile", "PyTorch-only speed-ups"),
    ("torch_compile_backend", "PyTorch-only speed-ups"),
    ("torch_compile_mode", "PyTorch-only speed-ups"),
    ("use_liger_loss", "PyTorch-only speed-ups"),
    ("use_liger_kernel", "PyTorch-only speed-ups"),
    ("liger_kernel_config", "PyTorch-only speed-ups"),
    ("torch_empty_cache_steps", "PyTorch's allocator setting"),
    (
        "auto_find_batch_size",
        "grpo bounds memory with forward_chunk_tokens instead",
    ),
    (
        "gradient_checkpointing_kwargs",
        "gradient_checkpointing has no options in grpo",
    ),
    (
        "gradient_checkpointing_use_reentrant",
        "gradient_checkpointing has no options in grpo",
    ),
    ("activation_checkpointing", "use gradient_checkpointing"),
    (
        "activation_checkpointing_kwargs",
        "use gradient_checkpointing",
    ),
    (
        "optim_args",
        "grpo's AdamW takes adam_beta1, adam_beta2, adam_epsilon, weight_decay",
    ),
    (
        "optim_target_modules",
        "grpo's AdamW updates every trainable parameter",
    ),
    (
        "lr_scheduler_kwargs",
        "grpo's schedules take warmup_steps / warmup_ratio only",
    ),
    ("label_smoothing_factor", "a supervised-training setting"),
    ("neftune_noise_alpha", "a supervised-training setting"),
    ("label_names", "a supervised-training setting"),
    ("length_column_name", "a supervised-training setting"),
    (
        "train_sampling_strategy",
        "prompts are shuffled by shuffle_dataset and seed",
    ),
    (
        "include_num_input_tokens_seen",
        "grpo logs its own token counts",
    ),
    (
        "logging_nan_inf_filter",
        "a non-finite step is skipped and logged (max_bad_steps)",
    ),
    ("logging_dir", "TensorBoard events go to output_dir/tb"),
    ("logging_strategy", "grpo logs every logging_steps steps"),
    ("logging_first_step", "grpo logs every logging_steps steps"),
    ("log_level", "set RUST_LOG (e.g. RUST_LOG=debug)"),
    ("log_level_replica", "set RUST_LOG (e.g. RUST_LOG=debug)"),
    ("log_on_each_node", "rank 0 logs"),
    (
        "disable_tqdm",
        "the progress bar hides itself without a terminal",
    ),
    ("log_multimodal", "grpo trains text models"),
    ("log_unique_prompts", "completions.jsonl has every prompt"),
    (
        "log_completions_hub_repo",
        "grpo does not upload; completions.jsonl is in output_dir",
    ),
    (
        "trackio_space_id",
        "report_to = trackio logs locally (TRACKIO_DIR); sync it to a Space with `trackio sync`",
    ),
    (
        "trackio_bucket_id",
        "report_to = trackio logs locally (TRACKIO_DIR); sync it with `trackio sync`",
    ),
    (
        "trackio_static_space_id",
        "report_to = trackio logs locally (TRACKIO_DIR); sync it with `trackio sync`",
    ),
    ("eval_strategy", "evaluation runs every eval_steps (0: off)"),
    (
        "evaluation_strategy",
        "evaluation runs every eval_steps (0: off)",
    ),
    (
        "eval_on_start",
        "with eval_steps > 0 grpo always evaluates before the first step",
    ),
    ("eval_delay", "evaluation runs every eval_steps (0: off)"),
    (
        "per_device_eval_batch_size",
        "evaluation batches are sized by the sampler",
    ),
    (
        "prediction_loss_only",
        "a Trainer evaluation setting GRPO does not use",
    ),
    (
        "eval_do_concat_batches",
        "a Trainer evaluation setting GRPO does not use",
    ),
    (
        "eval_use_gather_object",
        "a Trainer evaluation setting GRPO does not use",
    ),
    (
        "eval_accumulation_steps",
        "a Trainer evaluation setting GRPO does not use",
    ),
    (
        "include_for_metrics",
        "a Trainer evaluation setting GRPO does not use",
    ),
    (
        "batch_eval_metrics",
        "a Trainer evaluation setting GRPO does not use",
    ),
    ("do_train", "grpo train trains"),
    ("do_eval", "evaluation runs every eval_steps (0: off)"),
    ("do_predict", "grpo eval evaluates a model"),
    ("save_on_each_node", "rank 0 writes checkpoints"),
    (
        "enable_jit_checkpoint",
        "checkpoints are written atomically every save_steps and on SIGINT/SIGTERM",
    ),
    (
        "overwrite_output_dir",
        "grpo resumes only when asked (--resume) and never deletes a run",
    ),
    (
        "ignore_data_skip",
        "resume restores the prompt order exactly",
    ),
    (
        "restore_callback_states_from_checkpoint",
        "grpo has no callbacks; trainer_state.json restores everything",
    ),
    (
        "push_to_hub",
        "grpo does not upload; `grpo export` writes the HF directory",
    ),
    (
        "hub_model_id",
        "grpo does not upload; `grpo export` writes the HF directory",
    ),
    (
        "hub_token",
        "grpo does not upload; `grpo export` writes the HF directory",
    ),
    (
        "hub_private_repo",
        "grpo does not upload; `grpo export` writes the HF directory",
    ),
    (
        "hub_strategy",
        "grpo does not upload; `grpo export` writes the HF directory",
    ),
    (
        "hub_always_push",
        "grpo does not upload; `grpo export` writes the HF directory",
    ),
    (
        "hub_revision",
        "grpo does not upload; `grpo export` writes the HF directory",
    ),
    ("full_determinism", "grpo runs are deterministic from seed"),
    ("data_seed", "prompt order and sampling follow seed"),
    (
        "shuffle_dataset_seed",
        "prompt order and sampling follow seed",
    ),
    ("use_cpu", "set device"),
    ("no_cuda", "set device"),
    (
        "remove_unused_columns",
        "rows keep every field; rewards read what they need",
    ),
    ("dataset_streaming", "datasets are read from disk whole"),
    ("report_to_wandb", "use report_to = [\"wandb\"]"),
    ("ignore_bias_buffers", "a DDP setting"),
    (
        "lora_task_type",
        "grpo's adapters are for causal LMs (PEFT's CAUSAL_LM)",
    ),
    (
        "bnb_4bit_quant_type",
        "load_in_4bit is NF4 (fp4 is not implemented; base_quantization = q4_0 is grpo's other 4-bit type)",
    ),
    (
        "use_bnb_nested_quant",
        "NF4's absmax stays f32 (no double quantization)",
    ),
    (
        "bnb_4bit_quant_storage",
        "NF4 codes are stored two per byte",
    ),
    (
        "accelerator_config",
        "Accelerate settings: grpo runs one process, or MPI ranks",
    ),
    (
        "parallelism_config",
        "Accelerate settings: grpo runs one process, or MPI ranks",
    ),
    (
        "local_rank",
        "set by launchers for PyTorch; grpo's ranks come from MPI",
    ),
    (
        "average_tokens_across_devices",
        "dapo's normalizer counts every rank's tokens",
    ),
    (
        "ds3_gather_for_generation",
        "PyTorch distributed and data-loader settings",
    ),
    ("deepspeed", "PyTorch distributed and data-loader settings"),
    ("fsdp", "PyTorch distributed and data-loader settings"),
    (
        "fsdp_config",
        "PyTorch distributed and data-loader settings",
    ),
    ("debug", "PyTorch distributed and data-loader settings"),
    (
        "skip_memory_metrics",
        "grpo traces memory with RUST_LOG=grpo=debug",
    ),
];

/// How grpo reads a TRL (or PEFT, or the seeds') key: `None` when it does not know the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrlKey {
    /// A key of grpo's own, same name and meaning.
    Key,
    /// Another name for the grpo key given.
    Alias(&'static str),
    /// Read with its own rule, described.
    Mapped(&'static str),
    /// Accepted and ignored with a warning giving the reason.
    Ignored(&'static str),
}

pub fn trl_key(key: &str) -> Option<TrlKey> {
    let find = |t: &'static [(&'static str, &'static str)]| {
        t.iter().find(|(k, _)| *k == key).map(|(_, v)| *v)
    };
    if is_key(key) {
        Some(TrlKey::Key)
    } else if let Some(to) = find(ALIASES) {
        Some(TrlKey::Alias(to))
    } else if let Some(how) = find(MAPPED) {
        Some(TrlKey::Mapped(how))
    } else if let Some(why) = find(IGNORED) {
        Some(TrlKey::Ignored(why))
    } else if key.starts_with("vllm_") {
        Some(TrlKey::Ignored(
            "grpo samples with its own KV-cached sampler",
        ))
    } else if key.starts_with("ddp_") || key.starts_with("dataloader_") {
        Some(TrlKey::Ignored(
            "PyTorch distributed and data-loader settings",
        ))
    } else {
        None
    }
}

/// Why a TRL/HF key is ignored (the warning's line for it).
pub fn ignore_reason(key: &str) -> &'static str {
    match trl_key(key) {
        Some(TrlKey::Ignored(why) | TrlKey::Mapped(why)) => why,
        _ => "no effect in grpo",
    }
}

/// The TRL/HF keys that are accepted and ignored with a warning (besides any `vllm_*` key).
pub fn ignored_trl_keys() -> Vec<&'static str> {
    IGNORED.iter().map(|(k, _)| *k).collect()
}
