//! The training configuration: a TOML or YAML file plus `--key=value` overrides, resolved once
//! into a validated [`TrainConfig`] whose variants are enums.
//!
//! Option names follow TRL's `GRPOConfig` (and HF `TrainingArguments`) where TRL has the option,
//! so the GRPO keys of a TRL YAML config work as they are. Keys TRL/HF have that do not apply here
//! (`bf16`-style switches we resolve differently, `report_to` values we lack, distributed settings)
//! are accepted and listed in [`TrainConfig::ignored_keys`]; any other unknown key is an error that
//! suggests the nearest known one.
//!
//! Resolution: every known key starts at its default (the table in [`reference`]), the file's
//! values replace defaults, overrides replace both. Then one function converts and checks each
//! value (errors name the key and the expected type) and the cross-field rules.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::advantages::{RewardAggregation, ScaleRewards};
use crate::error::nearest;
use crate::eval::EvalOptions;
use crate::loss::{AdaptiveKlCfg, IsLevel, KlMode, LossType};
use crate::named::Named;
use crate::optim::LrSchedule;
use crate::sampler::SamplingParams;
use crate::{Error, Result};

/// The embedded default run (`grpo train` with no arguments).
pub const DEFAULT_CONFIG: &str = include_str!("../configs/default.toml");

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Toml,
    Yaml,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DTypeOpt {
    F32,
    Bf16,
}

/// The built-in arithmetic task (`[task]`).
#[derive(Debug, Clone, PartialEq)]
pub struct TaskConfig {
    pub train_size: usize,
    pub eval_size: usize,
    pub min_operand: i64,
    pub max_operand: i64,
    pub ops: Vec<String>,
    pub seed: u64,
}

impl TaskConfig {
    /// The built-in task generator's parameters.
    pub fn params(&self) -> crate::data::arithmetic::TaskParams {
        crate::data::arithmetic::TaskParams {
            train_size: self.train_size,
            eval_size: self.eval_size,
            min_operand: self.min_operand,
            max_operand: self.max_operand,
            ops: self.ops.iter().filter_map(|s| s.chars().next()).collect(),
            seed: self.seed,
        }
    }
}

/// The validated training configuration. Field docs are in [`reference`].
#[derive(Debug, Clone, PartialEq)]
pub struct TrainConfig {
    // run
    pub model: Option<String>,
    pub dtype: DTypeOpt,
    pub output_dir: PathBuf,
    pub seed: u64,
    pub threads: Option<usize>,
    pub max_steps: Option<u64>,
    pub num_train_epochs: f64,
    // data
    pub train_file: Option<PathBuf>,
    pub eval_file: Option<PathBuf>,
    pub prompt_field: String,
    pub answer_field: String,
    pub system_prompt: Option<String>,
    pub shuffle_dataset: bool,
    pub skip_bad_rows: bool,
    pub max_prompt_length: Option<usize>,
    pub task: TaskConfig,
    pub rewards: Vec<Value>,
    pub reward_weights: Option<Vec<f64>>,
    // generation
    pub num_generations: usize,
    pub max_completion_length: usize,
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: usize,
    pub min_p: Option<f64>,
    pub repetition_penalty: f64,
    pub stop: Vec<String>,
    pub generation_batch_size: usize,
    pub steps_per_generation: usize,
    // update
    pub per_device_train_batch_size: usize,
    pub forward_chunk_tokens: usize,
    pub gradient_accumulation_steps: usize,
    pub num_iterations: usize,
    pub learning_rate: f64,
    pub adam_beta1: f64,
    pub adam_beta2: f64,
    pub adam_epsilon: f64,
    pub weight_decay: f64,
    pub max_grad_norm: f64,
    pub lr_scheduler_type: LrSchedule,
    pub warmup_ratio: f64,
    pub warmup_steps: usize,
    pub max_consecutive_nonfinite: usize,
    // loss
    pub loss_type: LossType,
    pub beta: f64,
    pub epsilon: f64,
    pub epsilon_high: f64,
    pub delta: Option<f64>,
    pub importance_sampling_level: IsLevel,
    pub scale_rewards: ScaleRewards,
    pub mask_truncated_completions: bool,
    pub entropy_coef: f64,
    pub use_bias_correction_kl: bool,
    pub reward_std_floor: Option<f64>,
    pub multi_objective_aggregation: RewardAggregation,
    pub normalize_advantages_batch: bool,
    pub drop_zero_std_groups: bool,
    pub kl_coef: f64,
    pub kl_target: Option<f64>,
    pub kl_horizon: f64,
    pub kl: KlMode,
    pub sync_ref_model: bool,
    pub ref_model_sync_steps: usize,
    pub ref_model_mixup_alpha: f64,
    // logging / checkpoints / eval
    pub logging_steps: usize,
    pub log_completions: bool,
    pub log_completions_steps: usize,
    pub num_completions_to_print: usize,
    pub save_steps: usize,
    pub save_total_limit: Option<usize>,
    pub eval_steps: usize,
    pub eval_num_prompts: Option<usize>,
    pub eval_num_samples: usize,
    /// Sorted, without duplicates.
    pub eval_k: Vec<usize>,
    /// `eval_temperature`, or `temperature` when unset.
    pub eval_temperature: f64,
    pub eval_greedy: bool,
    pub report_to: Vec<String>,
    /// LoRA adapters instead of full fine-tuning (`lora.r` > 0). Empty `target_modules` means
    /// the architecture's default (see [`crate::lora::default_targets`]).
    pub lora: Option<crate::lora::LoraConfig>,
    /// QLoRA: keep the frozen base's projections quantized.
    pub base_quantization: Option<crate::models::QuantType>,
    /// Recompute each block's activations in the backward instead of keeping them.
    pub gradient_checkpointing: bool,
    /// TRL/HF keys that were given and are ignored here.
    pub ignored_keys: Vec<String>,
    /// The merged values of every key, for [`Self::to_toml`].
    resolved: BTreeMap<String, Value>,
}

/// One documented key.
#[derive(Debug, Clone)]
pub struct KeyDoc {
    pub key: &'static str,
    pub kind: &'static str,
    /// Default as TOML text; empty = unset.
    pub default: &'static str,
    pub help: &'static str,
    pub section: &'static str,
}

macro_rules! keys {
    ($( $section:literal { $( $key:literal : $kind:literal = $default:literal , $help:literal ;)* } )*) => {
        &[ $( $( KeyDoc { key: $key, kind: $kind, default: $default, help: $help, section: $section }, )* )* ]
    };
}

/// Every key, its type, its default and what it does.
const KEYS: &[KeyDoc] = keys! {
    "run" {
        "model": "string" = "", "HF directory, .gguf file or hub id (unset: SmolLM2-135M-Instruct, fetched once)";
        "dtype": "f32|bf16" = "\"f32\"", "precision of the weights for sampling and reference (training keeps f32 parameters)";
        "output_dir": "path" = "\"runs/grpo\"", "where metrics, samples and checkpoints go";
        "seed": "int" = "42", "seeds prompt order and sampling; a run is reproducible from it";
        "threads": "int" = "", "CPU threads (unset: all cores)";
        "max_steps": "int" = "-1", "optimizer steps to run (-1: from num_train_epochs)";
        "num_train_epochs": "float" = "1.0", "passes over the prompts when max_steps is -1";
    }
    "data" {
        "train_file": "path" = "", "prompts (.jsonl, .csv, .parquet); unset: the built-in arithmetic task";
        "eval_file": "path" = "", "held-out prompts for evaluation (the built-in task has its own)";
        "prompt_field": "string" = "\"prompt\"", "field holding the prompt: a string or a list of {role, content} messages";
        "answer_field": "string" = "\"answer\"", "field holding the reference answer passed to rewards";
        "system_prompt": "string" = "", "system message put before each prompt (unless it has one)";
        "shuffle_dataset": "bool" = "true", "shuffle prompts each epoch (seeded)";
        "skip_bad_rows": "bool" = "false", "skip and count malformed rows instead of stopping";
        "max_prompt_length": "int" = "512", "prompts longer than this are truncated from the left (-1: never)";
        "task.train_size": "int" = "2000", "built-in task: training problems";
        "task.eval_size": "int" = "200", "built-in task: held-out problems";
        "task.min_operand": "int" = "10", "built-in task: smallest operand";
        "task.max_operand": "int" = "99", "built-in task: largest operand";
        "task.ops": "list of \"+\" \"-\" \"*\"" = "[\"+\"]", "built-in task: operations";
        "task.seed": "int" = "1234", "built-in task: problem generator seed";
        "reward_weights": "list of float" = "", "weight of each reward function (unset: each reward's own weight)";
    }
    "generation" {
        "num_generations": "int" = "8", "completions per prompt (G, the group size)";
        "max_completion_length": "int" = "256", "maximum new tokens per completion";
        "temperature": "float" = "1.0", "sampling temperature (log-probs are taken at the same temperature)";
        "top_p": "float" = "1.0", "nucleus sampling (1: off)";
        "top_k": "int" = "0", "top-k sampling (0: off)";
        "min_p": "float" = "", "min-p sampling (unset: off)";
        "repetition_penalty": "float" = "1.0", "HF repetition penalty (1: off)";
        "stop": "list of string" = "[]", "stop strings (EOS always stops)";
        "generation_batch_size": "int" = "", "completions per generation round (default per_device_train_batch_size x steps_per_generation)";
        "steps_per_generation": "int" = "", "micro-batches per generation round (default gradient_accumulation_steps)";
    }
    "update" {
        "per_device_train_batch_size": "int" = "8", "completions per micro-batch";
        "gradient_accumulation_steps": "int" = "1", "micro-batches per optimizer step";
        "forward_chunk_tokens": "int" = "1024", "tokens per forward/backward pass: a micro-batch is split into chunks of whole groups (the math is unchanged; lower it to save memory, raise it for fewer, larger passes)";
        "num_iterations": "int" = "1", "updates per generation batch (mu in the paper); > 1 uses clipped ratios";
        "learning_rate": "float" = "1e-6", "AdamW learning rate";
        "adam_beta1": "float" = "0.9", "AdamW beta1";
        "adam_beta2": "float" = "0.999", "AdamW beta2";
        "adam_epsilon": "float" = "1e-8", "AdamW epsilon";
        "weight_decay": "float" = "0.0", "AdamW decoupled weight decay";
        "max_grad_norm": "float" = "1.0", "clip the global gradient norm (0: off)";
        "lr_scheduler_type": "constant|constant_with_warmup|linear|cosine" = "\"linear\"", "learning-rate schedule";
        "warmup_ratio": "float" = "0.0", "share of steps spent warming up";
        "warmup_steps": "int" = "0", "warm-up steps (wins over warmup_ratio when > 0)";
        "max_consecutive_nonfinite": "int" = "3", "stop after this many skipped non-finite steps in a row";
        "gradient_checkpointing": "bool" = "false", "keep only each block's input during the forward and recompute the block in the backward (less memory, one more forward); sampling then also skips the packed copy of the weights for the decoding GEMM (slower generation, lower peak with LoRA)";
    }
    "lora" {
        "lora.r": "int" = "0", "LoRA rank: train adapters on a frozen base (0: full fine-tuning; TRL: lora_r)";
        "lora.alpha": "float" = "", "LoRA alpha; the adapter output is scaled by alpha / r (unset: 2 x r)";
        "lora.dropout": "float" = "0.05", "dropout on the adapters' input during training";
        "lora.target_modules": "list of string" = "", "projections that get adapters, by name (q_proj, v_proj, ...) or \"all-linear\" (unset: q_proj, v_proj; GPT-2: c_attn)";
        "lora.use_rslora": "bool" = "false", "rank-stabilized LoRA: scale by alpha / sqrt(r)";
        "base_quantization": "none|q4_0|q4_1|q8_0" = "\"none\"", "QLoRA: keep the frozen base quantized (needs lora.r > 0); a GGUF of the same type is used as is";
    }
    "loss" {
        "loss_type": "grpo|bnpo|dr_grpo|dapo" = "\"dapo\"", "token-loss reduction, with TRL's normalizations";
        "beta": "float" = "0.0", "weight of the k3 KL penalty to the reference model in the loss";
        "epsilon": "float" = "0.2", "lower clipping range of the ratio";
        "epsilon_high": "float" = "", "upper clipping range (default: epsilon)";
        "delta": "float" = "", "two-sided clipping: cap on the unclipped ratio (unset: off)";
        "importance_sampling_level": "token|sequence" = "\"token\"", "ratio per token, or per sequence (GSPO)";
        "scale_rewards": "group|batch|none" = "\"group\"", "std used to scale advantages (none: Dr. GRPO)";
        "mask_truncated_completions": "bool" = "false", "leave completions that hit max_completion_length out of the loss";
        "entropy_coef": "float" = "0.0", "entropy bonus weight";
        "use_bias_correction_kl": "bool" = "true", "multiply the KL term by the importance ratio (unbiased reverse-KL gradient, TRL's default)";
        "reward_std_floor": "float" = "", "clamp each group's reward std from below before scaling";
        "multi_objective_aggregation": "sum_then_normalize|normalize_then_sum" = "\"sum_then_normalize\"", "several rewards: weighted sum then advantages, or each normalized in its group, summed, normalized over the batch (GDPO)";
        "normalize_advantages_batch": "bool" = "false", "re-normalize all advantages of a batch to mean 0, std 1";
        "drop_zero_std_groups": "bool" = "false", "leave groups whose rewards all equal out of the update";
        "kl_coef": "float" = "0.0", "KL in the reward: reward - kl_coef x sum_t(logp - ref_logp)";
        "kl_target": "float" = "", "adaptive KL controller target (unset: fixed kl_coef)";
        "kl_horizon": "float" = "10000.0", "adaptive KL controller horizon, in samples";
        "sync_ref_model": "bool" = "false", "mix the policy into the reference every ref_model_sync_steps";
        "ref_model_sync_steps": "int" = "512", "steps between reference syncs";
        "ref_model_mixup_alpha": "float" = "0.6", "ref = alpha x policy + (1 - alpha) x ref at each sync";
    }
    "logging" {
        "logging_steps": "int" = "1", "log metrics every N steps";
        "log_completions": "bool" = "true", "write prompts, completions, rewards and advantages to completions.jsonl";
        "log_completions_steps": "int" = "10", "every N generation rounds";
        "num_completions_to_print": "int" = "2", "samples shown on the console when completions are logged";
        "save_steps": "int" = "500", "checkpoint every N steps (0: only at the end)";
        "save_total_limit": "int" = "", "keep only the newest N checkpoints";
        "eval_steps": "int" = "0", "evaluate on the held-out prompts every N steps (0: off)";
        "eval_num_prompts": "int" = "", "held-out prompts per evaluation (unset: all)";
        "eval_num_samples": "int" = "4", "sampled completions per held-out prompt, for pass@k and eval/mean_accuracy (0: greedy only; eval_k is then ignored)";
        "eval_k": "list of int" = "[1]", "report eval/pass@k for each k (unbiased estimator; each k <= eval_num_samples)";
        "eval_temperature": "float" = "", "sampling temperature of the eval samples (unset: temperature)";
        "eval_greedy": "bool" = "true", "also one greedy completion per held-out prompt: eval/accuracy";
        "report_to": "list of tensorboard|jsonl|none" = "[\"tensorboard\"]", "metrics sinks besides metrics.jsonl";
    }
};

/// TRL / HF `TrainingArguments` keys accepted and ignored (listed in the warning).
const IGNORED: &[&str] = &[
    "bf16",
    "fp16",
    "tf32",
    "gradient_checkpointing_kwargs",
    "use_vllm",
    "vllm_mode",
    "logging_dir",
    "push_to_hub",
    "hub_model_id",
    "run_name",
    "remove_unused_columns",
    "dataloader_num_workers",
    "dataloader_pin_memory",
    "dataloader_drop_last",
    "torch_compile",
    "ddp_find_unused_parameters",
    "ddp_backend",
    "log_level",
    "logging_first_step",
    "logging_strategy",
    "save_strategy",
    "eval_strategy",
    "evaluation_strategy",
    "overwrite_output_dir",
    "do_train",
    "do_eval",
    "use_cpu",
    "no_cuda",
    "optim",
    "model_init_kwargs",
    "disable_dropout",
    "ds3_gather_for_generation",
    "cache_implementation",
    "use_liger_loss",
    "use_liger_kernel",
    "log_on_each_node",
    "save_only_model",
    "load_best_model_at_end",
    "metric_for_best_model",
    "greater_is_better",
    "per_device_eval_batch_size",
    "shuffle_dataset_seed",
    "generation_kwargs",
    "chat_template_kwargs",
    "vllm_gpu_memory_utilization",
    "report_to_wandb",
    "wandb_project",
    "lr_scheduler_kwargs",
    "data_seed",
    "full_determinism",
];

/// Every key: name, type, default (as text), one-line help.
pub fn reference() -> Vec<KeyDoc> {
    KEYS.to_vec()
}

fn suggest(key: &str) -> String {
    let keys: Vec<&str> = KEYS.iter().map(|k| k.key).collect();
    match nearest(key, &keys) {
        Some(k) => format!("; did you mean `{k}`?"),
        None => "; `grpo config --print` lists every key".into(),
    }
}

/// Flattens nested tables into dotted keys (`task.train_size`); `rewards` stays a list.
fn flatten(prefix: &str, v: Value, out: &mut BTreeMap<String, Value>) {
    match v {
        Value::Object(m) if prefix.is_empty() || prefix == "task" || prefix == "lora" => {
            for (k, v) in m {
                let key = if prefix.is_empty() {
                    k
                } else {
                    format!("{prefix}.{k}")
                };
                if (key == "task" || key == "lora") && v.is_object() {
                    flatten(&key, v, out);
                } else {
                    out.insert(key, v);
                }
            }
        }
        other => {
            out.insert(prefix.to_string(), other);
        }
    }
}

/// Parses a config document into dotted keys.
fn parse_doc(text: &str, format: Format, origin: &str) -> Result<BTreeMap<String, Value>> {
    let v: Value = match format {
        Format::Toml => {
            let t: toml::Value = toml::from_str(text)
                .map_err(|e| Error::file(origin, format!("invalid TOML: {e}")))?;
            serde_json::to_value(t).map_err(|e| Error::file(origin, e))?
        }
        Format::Yaml => {
            if text.trim().is_empty() {
                Value::Object(Default::default())
            } else {
                serde_yaml::from_str(text)
                    .map_err(|e| Error::file(origin, format!("invalid YAML: {e}")))?
            }
        }
    };
    if !v.is_object() {
        return Err(Error::file(
            origin,
            "expected a table of `key = value` settings at the top level",
        ));
    }
    let mut out = BTreeMap::new();
    flatten("", v, &mut out);
    Ok(out)
}

/// A command-line value: a TOML scalar or array when it parses as one, else a string.
fn parse_override_value(raw: &str) -> Value {
    match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
        Ok(mut t) => t
            .remove("v")
            .and_then(|v| serde_json::to_value(v).ok())
            .unwrap_or_else(|| Value::String(raw.into())),
        Err(_) => Value::String(raw.into()),
    }
}

fn parse_overrides(overrides: &[String]) -> Result<Vec<(String, Value)>> {
    overrides
        .iter()
        .map(|o| {
            let body = o.trim_start_matches('-');
            let (k, v) = body.split_once('=').ok_or_else(|| {
                Error::config(
                    body,
                    format!("override `{o}` has no value: write --{body}=VALUE"),
                )
            })?;
            if k == "rewards" {
                return Err(Error::config("rewards", "set rewards in the config file"));
            }
            Ok((k.to_string(), parse_override_value(v)))
        })
        .collect()
}

/// Typed access to the merged values; every error names the key.
struct Values<'a>(&'a BTreeMap<String, Value>);

fn type_err(key: &str, want: &str, got: &Value) -> Error {
    Error::config(key, format!("expected {want}, got {got}"))
}

impl Values<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }
    fn f64(&self, key: &str) -> Result<f64> {
        self.opt_f64(key)?
            .ok_or_else(|| Error::config(key, "is required"))
    }
    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(Value::String(s)) => s
                .parse()
                .map(Some)
                .map_err(|_| type_err(key, "a number", &Value::String(s.clone()))),
            Some(v) => Err(type_err(key, "a number", v)),
        }
    }
    fn opt_i64(&self, key: &str) -> Result<Option<i64>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => n
                .as_i64()
                .or_else(|| n.as_f64().filter(|f| f.fract() == 0.0).map(|f| f as i64))
                .map(Some)
                .ok_or_else(|| type_err(key, "an integer", &Value::Number(n.clone()))),
            Some(v) => Err(type_err(key, "an integer", v)),
        }
    }
    fn i64(&self, key: &str) -> Result<i64> {
        self.opt_i64(key)?
            .ok_or_else(|| Error::config(key, "is required"))
    }
    /// Non-negative integer; `None` when unset (or -1 where -1 means unset).
    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.opt_i64(key)? {
            None | Some(-1) => Ok(None),
            Some(n) if n < 0 => Err(Error::config(key, format!("must be >= 0, got {n}"))),
            Some(n) => Ok(Some(n as usize)),
        }
    }
    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| Error::config(key, "must be a non-negative integer"))
    }
    fn bool(&self, key: &str) -> Result<bool> {
        match self.get(key) {
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(type_err(key, "true or false", v)),
            None => Err(Error::config(key, "is required")),
        }
    }
    fn opt_string(&self, key: &str) -> Result<Option<String>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(type_err(key, "a string", v)),
        }
    }
    fn string(&self, key: &str) -> Result<String> {
        self.opt_string(key)?
            .ok_or_else(|| Error::config(key, "is required"))
    }
    /// A list, or (from the command line) a comma-separated string.
    fn strings(&self, key: &str) -> Result<Vec<String>> {
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::String(s)) => Ok(s
                .split(',')
                .map(|x| x.trim().to_string())
                .filter(|x| !x.is_empty())
                .collect()),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| type_err(key, "a list of strings", v))
                })
                .collect(),
            Some(v) => Err(type_err(key, "a list of strings", v)),
        }
    }
    /// A list of non-negative integers, one integer, or (from the command line) `1,4,8`.
    fn usizes(&self, key: &str) -> Result<Vec<usize>> {
        let want = "a list of non-negative integers";
        let one = |v: &Value| -> Result<usize> {
            match v {
                Value::Number(n) => n.as_u64().map(|x| x as usize),
                Value::String(s) => s.trim().parse().ok(),
                _ => None,
            }
            .ok_or_else(|| type_err(key, want, v))
        };
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(a)) => a.iter().map(one).collect(),
            Some(Value::String(s)) => s
                .split(',')
                .filter(|x| !x.trim().is_empty())
                .map(|x| one(&Value::String(x.into())))
                .collect(),
            Some(v @ Value::Number(_)) => Ok(vec![one(v)?]),
            Some(v) => Err(type_err(key, want, v)),
        }
    }
    fn opt_f64s(&self, key: &str) -> Result<Option<Vec<f64>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_f64()
                        .ok_or_else(|| type_err(key, "a list of numbers", v))
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(v) => Err(type_err(key, "a list of numbers", v)),
        }
    }
    /// One of `T`'s config names (see [`crate::named`]).
    fn named<T: Named>(&self, key: &str) -> Result<T> {
        self.choice(key, T::NAMES)
    }
    fn choice<T: Copy>(&self, key: &str, options: &[(&str, T)]) -> Result<T> {
        let s = self.string(key)?;
        options
            .iter()
            .find(|(n, _)| *n == s)
            .map(|(_, v)| *v)
            .ok_or_else(|| {
                let names: Vec<&str> = options.iter().map(|(n, _)| *n).collect();
                Error::config(
                    key,
                    format!("`{s}` is not supported; use one of: {}", names.join(", ")),
                )
            })
    }
}

/// The eval keys: (eval_num_samples, eval_k sorted without duplicates, eval_temperature, eval_greedy).
fn eval_settings(v: &Values, temperature: f64) -> Result<(usize, Vec<usize>, f64, bool)> {
    let n = v.usize("eval_num_samples")?;
    let mut ks = v.usizes("eval_k")?;
    crate::eval::check_ks(&ks, n, "eval_k", "eval_num_samples")?;
    ks.sort_unstable();
    ks.dedup();
    let greedy = v.bool("eval_greedy")?;
    if n == 0 && !greedy {
        return Err(Error::config(
            "eval_num_samples",
            "0 samples with eval_greedy = false leave nothing to evaluate: set eval_num_samples \
             above 0 or eval_greedy = true",
        ));
    }
    let t = v.opt_f64("eval_temperature")?.unwrap_or(temperature);
    if !(t >= 0.0 && t.is_finite()) {
        return Err(Error::config(
            "eval_temperature",
            format!("must be >= 0 (0 = greedy), got {t}"),
        ));
    }
    Ok((n, ks, t, greedy))
}

impl TrainConfig {
    /// Loads `path` (None: the embedded default) with `overrides` (`--key=value`).
    pub fn load(path: Option<&Path>, overrides: &[String]) -> Result<TrainConfig> {
        match path {
            None => Self::from_str(
                DEFAULT_CONFIG,
                Format::Toml,
                "<embedded default config>",
                overrides,
            ),
            Some(p) => {
                let format = match p.extension().and_then(|e| e.to_str()) {
                    Some("toml") => Format::Toml,
                    Some("yaml") | Some("yml") => Format::Yaml,
                    _ => {
                        return Err(Error::file(
                            p,
                            "unknown config format: use a .toml, .yaml or .yml file",
                        ))
                    }
                };
                let text = std::fs::read_to_string(p)
                    .map_err(|e| Error::file(p, format!("cannot read config: {e}")))?;
                Self::from_str(&text, format, &p.display().to_string(), overrides)
            }
        }
    }

    /// Parses config text; `origin` names it in errors.
    pub fn from_str(
        text: &str,
        format: Format,
        origin: &str,
        overrides: &[String],
    ) -> Result<TrainConfig> {
        let doc = parse_doc(text, format, origin)?;
        let mut merged: BTreeMap<String, Value> = BTreeMap::new();
        for k in KEYS {
            if !k.default.is_empty() {
                merged.insert(k.key.to_string(), parse_override_value(k.default));
            }
        }
        let mut ignored = Vec::new();
        let mut rewards = vec![];
        let mut apply = |k: String, v: Value, from: &str| -> Result<()> {
            let k = match k.as_str() {
                "model_name_or_path" => "model".to_string(),
                // TRL's ModelConfig names for PEFT.
                "lora_r" => "lora.r".to_string(),
                "lora_alpha" => "lora.alpha".to_string(),
                "lora_dropout" => "lora.dropout".to_string(),
                "lora_target_modules" => "lora.target_modules".to_string(),
                "use_rslora" => "lora.use_rslora".to_string(),
                _ => k,
            };
            if k == "use_peft" {
                // TRL's switch: LoRA with its default rank 16 unless lora_r says otherwise.
                if v == Value::Bool(true)
                    && !merged.get("lora.r").is_some_and(|r| r != &Value::from(0))
                {
                    merged.insert("lora.r".into(), Value::from(16));
                }
                return Ok(());
            }
            if k == "rewards" {
                rewards = match v {
                    Value::Array(a) => a,
                    other => {
                        return Err(type_err("rewards", "a list of [[rewards]] tables", &other))
                    }
                };
                return Ok(());
            }
            if KEYS.iter().any(|d| d.key == k) {
                merged.insert(k, v);
            } else if IGNORED.contains(&k.as_str()) || k.starts_with("vllm_") {
                if k == "bf16" && v == Value::Bool(true) {
                    merged.insert("dtype".into(), Value::String("bf16".into()));
                }
                ignored.push(k);
            } else {
                return Err(Error::config(
                    &k,
                    format!("unknown key in {from}{}", suggest(&k)),
                ));
            }
            Ok(())
        };
        let has_bf16 = doc.get("bf16") == Some(&Value::Bool(true));
        if has_bf16 && doc.contains_key("dtype") {
            return Err(Error::config(
                "bf16",
                "give either `bf16 = true` or `dtype`, not both",
            ));
        }
        for (k, v) in doc {
            apply(k, v, origin)?;
        }
        for (k, v) in parse_overrides(overrides)? {
            apply(k, v, "the command line")?;
        }
        ignored.sort();
        ignored.dedup();
        let mut cfg = Self::validate(&merged, rewards.clone())?;
        cfg.ignored_keys = ignored;
        let mut resolved = merged;
        if !rewards.is_empty() {
            resolved.insert("rewards".into(), Value::Array(rewards));
        }
        cfg.resolved = resolved;
        Ok(cfg)
    }

    /// Converts and checks every value; the one place config rules live.
    fn validate(m: &BTreeMap<String, Value>, rewards: Vec<Value>) -> Result<TrainConfig> {
        let v = Values(m);
        let bad = |k: &str, msg: String| Err(Error::config(k, msg));
        let per_device = v.usize("per_device_train_batch_size")?;
        let accum = v.usize("gradient_accumulation_steps")?;
        let forward_chunk_tokens = v.usize("forward_chunk_tokens")?;
        if forward_chunk_tokens == 0 {
            return bad("forward_chunk_tokens", "must be at least 1".into());
        }
        let g = v.usize("num_generations")?;
        if per_device == 0 {
            return bad("per_device_train_batch_size", "must be at least 1".into());
        }
        if accum == 0 {
            return bad("gradient_accumulation_steps", "must be at least 1".into());
        }
        if g < 2 {
            return bad(
                "num_generations",
                format!("must be at least 2 (a group of {g} has no relative advantage)"),
            );
        }
        let (gbs, spg) = match (
            v.opt_usize("generation_batch_size")?,
            v.opt_usize("steps_per_generation")?,
        ) {
            (Some(_), Some(_)) => {
                return bad(
                    "generation_batch_size",
                    "set generation_batch_size or steps_per_generation, not both".into(),
                )
            }
            (Some(gbs), None) => {
                if gbs == 0 || gbs % per_device != 0 {
                    return bad("generation_batch_size", format!("{gbs} is not a positive multiple of per_device_train_batch_size={per_device}"));
                }
                (gbs, gbs / per_device)
            }
            (None, Some(spg)) => (per_device * spg.max(1), spg.max(1)),
            (None, None) => (per_device * accum, accum),
        };
        if gbs % g != 0 {
            return bad(
                "num_generations",
                format!("a batch must hold whole groups: generation_batch_size={gbs} is not a multiple of num_generations={g}; set per_device_train_batch_size to a multiple of {g}"),
            );
        }
        if spg % accum != 0 {
            return bad(
                "steps_per_generation",
                format!("steps_per_generation={spg} must be a multiple of gradient_accumulation_steps={accum} (each generation round ends on an optimizer step)"),
            );
        }
        let temperature = v.f64("temperature")?;
        if !(temperature > 0.0 && temperature.is_finite()) {
            return bad("temperature", format!("must be > 0, got {temperature}"));
        }
        let top_p = v.f64("top_p")?;
        if !(top_p > 0.0 && top_p <= 1.0) {
            return bad("top_p", format!("must be in (0, 1], got {top_p}"));
        }
        let epsilon = v.f64("epsilon")?;
        let epsilon_high = v.opt_f64("epsilon_high")?.unwrap_or(epsilon);
        for (k, x) in [("epsilon", epsilon), ("epsilon_high", epsilon_high)] {
            if x.is_nan() || x < 0.0 {
                return bad(k, format!("must be >= 0, got {x}"));
            }
        }
        let beta = v.f64("beta")?;
        let kl_coef = v.f64("kl_coef")?;
        for (k, x) in [("beta", beta), ("kl_coef", kl_coef)] {
            if !(x >= 0.0 && x.is_finite()) {
                return bad(k, format!("must be >= 0, got {x}"));
            }
        }
        let kl_target = v.opt_f64("kl_target")?;
        let kl_horizon = v.f64("kl_horizon")?;
        let kl =
            match (beta > 0.0, kl_coef > 0.0) {
                (true, true) => return bad(
                    "beta",
                    "beta (KL in the loss) and kl_coef (KL in the reward) are both set: choose one"
                        .into(),
                ),
                (true, false) => KlMode::Loss { beta },
                (false, true) => KlMode::Reward {
                    coef: kl_coef,
                    adaptive: kl_target.map(|t| AdaptiveKlCfg {
                        target: t,
                        horizon: kl_horizon,
                    }),
                },
                (false, false) => KlMode::None,
            };
        if kl_target.is_some() && kl_coef == 0.0 {
            return bad(
                "kl_target",
                "the adaptive KL controller needs kl_coef > 0 (its starting value)".into(),
            );
        }
        let lr = v.f64("learning_rate")?;
        if !(lr > 0.0 && lr.is_finite()) {
            return bad("learning_rate", format!("must be > 0, got {lr}"));
        }
        let warmup_ratio = v.f64("warmup_ratio")?;
        if !(0.0..=1.0).contains(&warmup_ratio) {
            return bad(
                "warmup_ratio",
                format!("must be in [0, 1], got {warmup_ratio}"),
            );
        }
        for k in ["adam_beta1", "adam_beta2"] {
            let b = v.f64(k)?;
            if !(0.0..1.0).contains(&b) {
                return bad(k, format!("must be in [0, 1), got {b}"));
            }
        }
        let max_completion_length = v.usize("max_completion_length")?;
        if max_completion_length == 0 {
            return bad("max_completion_length", "must be at least 1".into());
        }
        let num_iterations = v.usize("num_iterations")?;
        if num_iterations == 0 {
            return bad("num_iterations", "must be at least 1".into());
        }
        if let Some(Value::Number(n)) = v.get("logging_steps") {
            if n.as_f64().is_some_and(|f| f < 1.0 && f > 0.0) {
                return bad(
                    "logging_steps",
                    "a ratio of total steps is not supported: give a whole number of steps".into(),
                );
            }
        }
        let task = TaskConfig {
            train_size: v.usize("task.train_size")?,
            eval_size: v.usize("task.eval_size")?,
            min_operand: v.i64("task.min_operand")?,
            max_operand: v.i64("task.max_operand")?,
            ops: v.strings("task.ops")?,
            seed: v.usize("task.seed")? as u64,
        };
        if task.min_operand > task.max_operand {
            return bad(
                "task.min_operand",
                format!(
                    "{} is above task.max_operand={}",
                    task.min_operand, task.max_operand
                ),
            );
        }
        if task.train_size == 0 {
            return bad("task.train_size", "must be at least 1".into());
        }
        if task.ops.is_empty()
            || task
                .ops
                .iter()
                .any(|o| !["+", "-", "*"].contains(&o.as_str()))
        {
            return bad(
                "task.ops",
                format!("{:?}: use a list of \"+\", \"-\", \"*\"", task.ops),
            );
        }
        let report_to = v.strings("report_to")?;
        let lora_r = v.usize("lora.r")?;
        let lora = match lora_r {
            0 => None,
            r => {
                let alpha = v.opt_f64("lora.alpha")?.unwrap_or(2.0 * r as f64);
                if !(alpha > 0.0 && alpha.is_finite()) {
                    return bad("lora.alpha", format!("must be > 0, got {alpha}"));
                }
                let dropout = v.f64("lora.dropout")?;
                if !(0.0..1.0).contains(&dropout) {
                    return bad("lora.dropout", format!("must be in [0, 1), got {dropout}"));
                }
                Some(crate::lora::LoraConfig {
                    r,
                    alpha,
                    dropout,
                    target_modules: v.strings("lora.target_modules")?,
                    use_rslora: v.bool("lora.use_rslora")?,
                })
            }
        };
        let base_quantization = v.choice(
            "base_quantization",
            &[
                ("none", None),
                ("q4_0", Some(crate::models::QuantType::Q4_0)),
                ("q4_1", Some(crate::models::QuantType::Q4_1)),
                ("q8_0", Some(crate::models::QuantType::Q8_0)),
            ],
        )?;
        if base_quantization.is_some() && lora.is_none() {
            return bad(
                "base_quantization",
                "a quantized base is frozen, so it needs LoRA adapters to train: set lora.r (e.g. --lora.r=16)".into(),
            );
        }
        if lora.is_some() && v.bool("sync_ref_model")? {
            return bad(
                "sync_ref_model",
                "with LoRA the reference is the base model with adapters off; it cannot be synced: set sync_ref_model = false".into(),
            );
        }
        let dtype = v.choice(
            "dtype",
            &[
                ("f32", DTypeOpt::F32),
                ("float32", DTypeOpt::F32),
                ("bf16", DTypeOpt::Bf16),
                ("bfloat16", DTypeOpt::Bf16),
            ],
        )?;
        let scale_rewards = match v.get("scale_rewards") {
            Some(Value::Bool(true)) => ScaleRewards::Group,
            Some(Value::Bool(false)) => ScaleRewards::None,
            _ => v.named::<ScaleRewards>("scale_rewards")?,
        };
        let sync_steps = v.usize("ref_model_sync_steps")?;
        if sync_steps == 0 {
            return bad("ref_model_sync_steps", "must be at least 1".into());
        }
        let max_steps = match v.opt_i64("max_steps")? {
            None | Some(-1) => None,
            Some(n) if n <= 0 => {
                return bad("max_steps", format!("must be positive or -1, got {n}"))
            }
            Some(n) => Some(n as u64),
        };
        let multi_objective_aggregation =
            v.named::<RewardAggregation>("multi_objective_aggregation")?;
        if multi_objective_aggregation == RewardAggregation::NormalizeThenSum
            && matches!(kl, KlMode::Reward { .. })
        {
            return bad(
                "multi_objective_aggregation",
                "normalize_then_sum cannot be combined with kl_coef (KL in the reward); use beta \
                 (KL in the loss) instead"
                    .into(),
            );
        }
        let (eval_num_samples, eval_k, eval_temperature, eval_greedy) =
            eval_settings(&v, temperature)?;
        Ok(TrainConfig {
            model: v.opt_string("model")?,
            dtype,
            output_dir: PathBuf::from(v.string("output_dir")?),
            seed: v.usize("seed")? as u64,
            threads: v.opt_usize("threads")?.filter(|&n| n > 0),
            max_steps,
            num_train_epochs: v.f64("num_train_epochs")?,
            train_file: v.opt_string("train_file")?.map(PathBuf::from),
            eval_file: v.opt_string("eval_file")?.map(PathBuf::from),
            prompt_field: v.string("prompt_field")?,
            answer_field: v.string("answer_field")?,
            system_prompt: v.opt_string("system_prompt")?,
            shuffle_dataset: v.bool("shuffle_dataset")?,
            skip_bad_rows: v.bool("skip_bad_rows")?,
            max_prompt_length: v.opt_usize("max_prompt_length")?,
            task,
            rewards,
            reward_weights: v.opt_f64s("reward_weights")?,
            num_generations: g,
            max_completion_length,
            temperature,
            top_p,
            top_k: v.usize("top_k")?,
            min_p: v.opt_f64("min_p")?,
            repetition_penalty: v.f64("repetition_penalty")?,
            stop: v.strings("stop")?,
            generation_batch_size: gbs,
            steps_per_generation: spg,
            per_device_train_batch_size: per_device,
            forward_chunk_tokens,
            gradient_accumulation_steps: accum,
            num_iterations,
            learning_rate: lr,
            adam_beta1: v.f64("adam_beta1")?,
            adam_beta2: v.f64("adam_beta2")?,
            adam_epsilon: v.f64("adam_epsilon")?,
            weight_decay: v.f64("weight_decay")?,
            max_grad_norm: v.f64("max_grad_norm")?,
            lr_scheduler_type: v.named::<LrSchedule>("lr_scheduler_type")?,
            warmup_ratio,
            warmup_steps: v.usize("warmup_steps")?,
            max_consecutive_nonfinite: v.usize("max_consecutive_nonfinite")?.max(1),
            loss_type: v.named::<LossType>("loss_type")?,
            beta,
            epsilon,
            epsilon_high,
            delta: v.opt_f64("delta")?,
            importance_sampling_level: v.named::<IsLevel>("importance_sampling_level")?,
            scale_rewards,
            mask_truncated_completions: v.bool("mask_truncated_completions")?,
            entropy_coef: v.f64("entropy_coef")?,
            use_bias_correction_kl: v.bool("use_bias_correction_kl")?,
            reward_std_floor: v.opt_f64("reward_std_floor")?,
            multi_objective_aggregation,
            normalize_advantages_batch: v.bool("normalize_advantages_batch")?,
            drop_zero_std_groups: v.bool("drop_zero_std_groups")?,
            kl_coef,
            kl_target,
            kl_horizon,
            kl,
            sync_ref_model: v.bool("sync_ref_model")?,
            ref_model_sync_steps: sync_steps,
            ref_model_mixup_alpha: v.f64("ref_model_mixup_alpha")?,
            logging_steps: v.usize("logging_steps")?,
            log_completions: v.bool("log_completions")?,
            log_completions_steps: v.usize("log_completions_steps")?,
            num_completions_to_print: v.usize("num_completions_to_print")?,
            save_steps: v.usize("save_steps")?,
            save_total_limit: v.opt_usize("save_total_limit")?,
            eval_steps: v.usize("eval_steps")?,
            eval_num_prompts: v.opt_usize("eval_num_prompts")?,
            eval_num_samples,
            eval_k,
            eval_temperature,
            eval_greedy,
            report_to,
            lora,
            base_quantization,
            gradient_checkpointing: v.bool("gradient_checkpointing")?,
            ignored_keys: vec![],
            resolved: BTreeMap::new(),
        })
    }

    /// This config's eval settings (`eval_num_samples`, `eval_k`, `eval_greedy`,
    /// `eval_num_prompts`, `eval_temperature` and the other sampling keys, `seed`,
    /// `system_prompt`, `max_prompt_length`).
    pub fn eval_options(&self, eos_token_ids: Vec<u32>) -> EvalOptions {
        let cfg = self;
        EvalOptions {
            num_samples: cfg.eval_num_samples,
            ks: cfg.eval_k.clone(),
            greedy: cfg.eval_greedy,
            num_prompts: cfg.eval_num_prompts,
            seed: cfg.seed,
            sampling: SamplingParams {
                max_new_tokens: cfg.max_completion_length,
                min_new_tokens: 0,
                temperature: cfg.eval_temperature,
                top_k: cfg.top_k,
                top_p: cfg.top_p,
                min_p: cfg.min_p.unwrap_or(0.0),
                repetition_penalty: cfg.repetition_penalty,
                stop_strings: cfg.stop.clone(),
                eos_token_ids,
            },
            system_prompt: cfg.system_prompt.clone(),
            max_prompt_length: cfg.max_prompt_length,
        }
    }

    /// Prompts per generation round.
    pub fn prompts_per_step(&self) -> usize {
        self.generation_batch_size / self.num_generations
    }

    /// The resolved config as TOML (every key that has a value), loadable by [`Self::load`].
    pub fn to_toml(&self) -> String {
        let mut root = toml::Table::new();
        let mut task = toml::Table::new();
        let mut lora = toml::Table::new();
        for (k, v) in &self.resolved {
            let Ok(tv) = serde_json::from_value::<toml::Value>(v.clone()) else {
                continue;
            };
            if let Some(sub) = k.strip_prefix("task.") {
                task.insert(sub.to_string(), tv);
            } else if let Some(sub) = k.strip_prefix("lora.") {
                lora.insert(sub.to_string(), tv);
            } else {
                root.insert(k.clone(), tv);
            }
        }
        // Scalars first, then tables/arrays of tables, as TOML requires.
        root.insert("task".into(), toml::Value::Table(task));
        root.insert("lora".into(), toml::Value::Table(lora));
        toml::to_string(&root).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str, f: Format, o: &[&str]) -> Result<TrainConfig> {
        let o: Vec<String> = o.iter().map(|s| s.to_string()).collect();
        TrainConfig::from_str(text, f, "test", &o)
    }

    #[test]
    fn defaults_follow_trl() {
        let c = load("", Format::Toml, &[]).unwrap();
        assert_eq!(c.num_generations, 8);
        assert_eq!(c.max_completion_length, 256);
        assert_eq!(c.learning_rate, 1e-6);
        assert_eq!(c.beta, 0.0);
        assert_eq!(c.kl, KlMode::None);
        assert_eq!(c.epsilon, 0.2);
        assert_eq!(c.epsilon_high, 0.2);
        assert_eq!(c.loss_type, LossType::Dapo);
        assert_eq!(c.scale_rewards, ScaleRewards::Group);
        assert_eq!(c.lr_scheduler_type, LrSchedule::Linear);
        assert_eq!(c.per_device_train_batch_size, 8);
        assert_eq!(c.generation_batch_size, 8);
        assert_eq!(c.prompts_per_step(), 1);
        assert_eq!(c.max_prompt_length, Some(512));
        assert_eq!(c.max_grad_norm, 1.0);
    }

    #[test]
    fn trl_yaml_loads_and_ignores_what_does_not_apply() {
        let y = "learning_rate: 1.0e-06\nbf16: true\nreport_to: none\ngradient_checkpointing: true\n\
                 num_generations: 4\nper_device_train_batch_size: 16\nloss_type: dr_grpo\nscale_rewards: false\n\
                 use_vllm: false\nmax_completion_length: 128\n";
        let c = load(y, Format::Yaml, &[]).unwrap();
        assert_eq!(c.loss_type, LossType::DrGrpo);
        assert_eq!(c.scale_rewards, ScaleRewards::None);
        assert_eq!(c.dtype, DTypeOpt::Bf16);
        assert_eq!(c.prompts_per_step(), 4);
        assert_eq!(c.ignored_keys, vec!["bf16", "use_vllm"]);
        assert!(c.gradient_checkpointing, "a real key now");
        assert_eq!(c.report_to, vec!["none"]);
        // TRL's PEFT switches map onto lora.*.
        let p = "use_peft: true
lora_alpha: 64
lora_target_modules: [q_proj, k_proj]
";
        let c = load(p, Format::Yaml, &[]).unwrap();
        let l = c.lora.unwrap();
        assert_eq!((l.r, l.alpha), (16, 64.0));
        assert_eq!(l.target_modules, vec!["q_proj", "k_proj"]);
        let c = load(
            "",
            Format::Toml,
            &["--lora.r=8", "--lora.target_modules=q_proj,v_proj"],
        )
        .unwrap();
        let l = c.lora.unwrap();
        assert_eq!((l.r, l.alpha, l.target_modules.len()), (8, 16.0, 2));
        assert!(load("", Format::Toml, &[]).unwrap().lora.is_none());
        // QLoRA without adapters, and LoRA with a synced reference, are refused naming the key.
        for (o, key) in [
            (&["--base_quantization=q4_0"][..], "base_quantization"),
            (
                &["--lora.r=4", "--sync_ref_model=true"][..],
                "sync_ref_model",
            ),
            (&["--lora.r=4", "--lora.dropout=1.5"][..], "lora.dropout"),
            (
                &["--lora.r=4", "--base_quantization=q3_k"][..],
                "base_quantization",
            ),
        ] {
            let e = load("", Format::Toml, o).unwrap_err().to_string();
            assert!(e.contains(key), "{o:?}: {e}");
        }
    }

    #[test]
    fn unknown_keys_suggest_the_nearest() {
        let e = load("num_generation = 4", Format::Toml, &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("num_generation") && e.contains("did you mean `num_generations`"),
            "{e}"
        );
        let e = load("", Format::Toml, &["--lerning_rate=1e-5"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("learning_rate"), "{e}");
    }

    #[test]
    fn overrides_win_and_parse_types() {
        let c = load(
            "num_generations = 4\nper_device_train_batch_size = 8\n[task]\ntrain_size = 50\n",
            Format::Toml,
            &[
                "--num_generations=8",
                "--learning_rate=5e-6",
                "--task.train_size=70",
                "--stop=###,END",
                "beta=0.04",
            ],
        )
        .unwrap();
        assert_eq!(c.num_generations, 8);
        assert_eq!(c.learning_rate, 5e-6);
        assert_eq!(c.task.train_size, 70);
        assert_eq!(c.stop, vec!["###", "END"]);
        assert_eq!(c.kl, KlMode::Loss { beta: 0.04 });
        assert!(load("", Format::Toml, &["--beta"]).is_err());
    }

    #[test]
    fn each_rule_names_its_key() {
        let cases: &[(&str, &str)] = &[
            ("num_generations = 3", "num_generations"),
            (
                "num_generations = 1\nper_device_train_batch_size = 1",
                "num_generations",
            ),
            ("temperature = 0.0", "temperature"),
            ("top_p = 1.5", "top_p"),
            ("learning_rate = -1.0", "learning_rate"),
            ("warmup_ratio = 2.0", "warmup_ratio"),
            ("adam_beta2 = 1.0", "adam_beta2"),
            ("beta = 0.1\nkl_coef = 0.1", "beta"),
            ("loss_type = \"cispo\"", "loss_type"),
            ("num_generations = \"eight\"", "num_generations"),
            (
                "steps_per_generation = 3\ngradient_accumulation_steps = 2",
                "steps_per_generation",
            ),
            (
                "[task]\nmin_operand = 50\nmax_operand = 10",
                "task.min_operand",
            ),
            ("[task]\nops = [\"/\"]", "task.ops"),
            ("logging_steps = 0.5", "logging_steps"),
            ("kl_target = 6.0", "kl_target"),
            ("eval_num_samples = 4\neval_k = [1, 8]", "eval_k"),
            ("eval_k = [0]", "eval_k"),
            ("eval_k = \"x\"", "eval_k"),
            (
                "eval_num_samples = 0\neval_greedy = false",
                "eval_num_samples",
            ),
            ("eval_temperature = -1.0", "eval_temperature"),
        ];
        for (text, key) in cases {
            let e = load(text, Format::Toml, &[]).unwrap_err().to_string();
            assert!(e.contains(&format!("`{key}`")), "{text}: {e}");
        }
        let e = load("a = [", Format::Toml, &[]).unwrap_err().to_string();
        assert!(e.contains("test") && e.contains("line"), "{e}");
    }

    #[test]
    fn eval_keys_default_and_parse() {
        let c = load("temperature = 0.7", Format::Toml, &[]).unwrap();
        assert_eq!(c.eval_num_samples, 4);
        assert_eq!(c.eval_k, vec![1]);
        assert_eq!(c.eval_temperature, 0.7);
        assert!(c.eval_greedy);
        let c = load(
            "eval_num_samples = 8\neval_k = [8, 1, 4, 4]\neval_temperature = 0.0",
            Format::Toml,
            &[],
        )
        .unwrap();
        assert_eq!(c.eval_k, vec![1, 4, 8]);
        assert_eq!(c.eval_temperature, 0.0);
        let c = load(
            "",
            Format::Toml,
            &["--eval_num_samples=8", "--eval_k=1,4,8"],
        )
        .unwrap();
        assert_eq!(c.eval_k, vec![1, 4, 8]);
        let c = load("", Format::Toml, &["--eval_k=2"]).unwrap();
        assert_eq!(c.eval_k, vec![2]);
        // Greedy only: the ks are not checked.
        let c = load("eval_num_samples = 0\neval_k = [16]", Format::Toml, &[]).unwrap();
        assert_eq!(c.eval_num_samples, 0);
        let e = load("eval_num_samples = 2\neval_k = [1, 4]", Format::Toml, &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`eval_k`") && e.contains("raise eval_num_samples to 4"),
            "{e}"
        );
    }

    #[test]
    fn resolved_toml_round_trips() {
        let c = load(
            "beta = 0.04\nstop = [\"x\"]\n[[rewards]]\nkind = \"answer_match\"\nweight = 2.0\n",
            Format::Toml,
            &["--task.ops=+,-"],
        )
        .unwrap();
        let text = c.to_toml();
        let c2 = load(&text, Format::Toml, &[]).unwrap();
        assert_eq!(c, c2, "{text}");
        assert_eq!(c2.rewards.len(), 1);
    }

    /// The configs whose `to_toml()` is pinned byte for byte (it is each checkpoint's
    /// config.toml): (name, input text, format, overrides).
    fn golden_cases() -> Vec<(&'static str, &'static str, Format, Vec<String>)> {
        let o = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        vec![
            ("default", DEFAULT_CONFIG, Format::Toml, vec![]),
            (
                "trl",
                include_str!("../testdata/to_toml/trl.yaml"),
                Format::Yaml,
                vec![],
            ),
            (
                "rewards",
                include_str!("../testdata/to_toml/rewards.toml"),
                Format::Toml,
                vec![],
            ),
            (
                "lora",
                include_str!("../testdata/to_toml/lora.toml"),
                Format::Toml,
                o(&["--lora.dropout=0.1"]),
            ),
            (
                "overrides",
                DEFAULT_CONFIG,
                Format::Toml,
                o(&[
                    "--num_generations=4",
                    "--stop=###,END",
                    "--eval_k=1,4",
                    "--eval_num_samples=4",
                    "--task.ops=+,-",
                    "--lora_r=4",
                    "--max_steps=-1",
                    "--threads=2",
                    "--model_name_or_path=/models/x",
                    "--learning_rate=5e-6",
                    "--temperature=\"0.7\"",
                    "--report_to=jsonl,tensorboard",
                    "--reward_weights=[1.0, 0.5]",
                    "--generation_batch_size=128",
                    "--gradient_accumulation_steps=2",
                    "--use_vllm=true",
                    "--system_prompt=Be brief.",
                ]),
            ),
        ]
    }

    /// `to_toml()` is written into every checkpoint: the same input must give the same bytes.
    #[test]
    fn to_toml_is_pinned_byte_for_byte() {
        let expected = [
            include_str!("../testdata/to_toml/default.expected.toml"),
            include_str!("../testdata/to_toml/trl.expected.toml"),
            include_str!("../testdata/to_toml/rewards.expected.toml"),
            include_str!("../testdata/to_toml/lora.expected.toml"),
            include_str!("../testdata/to_toml/overrides.expected.toml"),
        ];
        for ((name, text, f, o), want) in golden_cases().into_iter().zip(expected) {
            let c = TrainConfig::from_str(text, f, name, &o).unwrap();
            let got = c.to_toml();
            assert!(got == want, "{name}: to_toml changed:\n{got}");
            // And it loads back to the same config.
            let c2 = TrainConfig::from_str(&got, Format::Toml, name, &[]).unwrap();
            assert_eq!(c2.to_toml(), got, "{name}");
        }
    }

    #[test]
    fn embedded_default_is_valid() {
        let c = TrainConfig::load(None, &[]).unwrap();
        assert!(c.train_file.is_none());
        assert!(c.max_steps.is_some());
    }

    #[test]
    fn options_from_the_default_config_validate() {
        let cfg = TrainConfig::load(None, &[]).unwrap();
        let o = cfg.eval_options(vec![2]);
        o.validate().unwrap();
        assert_eq!(o.sampling.temperature, cfg.eval_temperature);
        let bad = crate::eval::EvalOptions {
            num_samples: 0,
            greedy: false,
            ..o.clone()
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("eval_num_samples"));
        let bad = crate::eval::EvalOptions {
            num_samples: 2,
            ks: vec![4],
            ..o
        };
        assert!(bad.validate().unwrap_err().to_string().contains("eval_k"));
    }
}
