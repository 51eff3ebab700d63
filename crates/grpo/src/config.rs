//! The training configuration: a TOML or YAML file plus `--key=value` overrides, resolved once
//! into a validated [`TrainConfig`] whose variants are enums.
//!
//! Option names follow TRL's `GRPOConfig` (and HF `TrainingArguments`) where TRL has the option,
//! so the GRPO keys of a TRL YAML config work as they are. Keys TRL/HF have that do not apply here
//! (`bf16`-style switches we resolve differently, vLLM and distributed settings, hub uploads) are
//! accepted and listed in [`TrainConfig::ignored_keys`] ([`ignored_trl_keys`] lists them all); any
//! other unknown key is an error that suggests the nearest known one.
//!
//! Every key is declared once, in the `config_keys!` table: its name, Rust type, default, help
//! and section. The table gives [`reference`] (`grpo config --print`) and a raw struct with one
//! typed field per key. Resolution: every key starts at its default, the file's values replace
//! defaults, overrides replace both; the merged values are read into the raw struct (errors name
//! the key and the expected type), and `TrainConfig::validate` checks the rules, cross-field ones
//! included, and resolves the variants. The `[[rewards]]` tables are parsed into
//! [`RewardSpec`]s at the same time, so a reward typo fails here, not after the model loaded.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::Device;
use serde_json::Value;

use crate::advantages::{RewardAggregation, ScaleRewards};
use crate::error::nearest;
use crate::eval::EvalOptions;
use crate::loss::{AdaptiveEntropy, AdaptiveKlCfg, IsLevel, KlMode, LossType, VespoParams};
use crate::models::QuantType;
use crate::named::Named;
use crate::optim::LrSchedule;
use crate::rewards::RewardSpec;
use crate::sampler::SamplingParams;
use crate::{Error, Result};

/// The embedded default run (`grpo train` with no arguments).
pub const DEFAULT_CONFIG: &str = include_str!("../configs/default.toml");
/// The embedded fill-in run: `grpo train --policy=fill_in` with nothing else.
pub const FILL_IN_CONFIG: &str = include_str!("../configs/fill_in.toml");

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

impl DTypeOpt {
    /// The models' compute dtype (parameters, AdamW's moments and the loss stay f32).
    pub fn compute(self) -> candle_core::DType {
        match self {
            DTypeOpt::F32 => candle_core::DType::F32,
            DTypeOpt::Bf16 => candle_core::DType::BF16,
        }
    }
}

/// Where training runs (`device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    #[default]
    Cpu,
    /// A CUDA GPU by ordinal (`cuda` is `cuda:0`).
    Cuda(usize),
}

impl DeviceSpec {
    /// The candle device; an error naming the `device` key when this build has no CUDA or the
    /// GPU cannot be opened.
    pub fn device(&self) -> Result<Device> {
        match *self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda(n) => {
                if !candle_core::utils::cuda_is_available() {
                    return Err(Error::config(
                        "device",
                        format!(
                            "`{self}`: this grpo was built without CUDA; rebuild with \
                             `--features cuda`, or set device = \"cpu\""
                        ),
                    ));
                }
                Device::new_cuda(n).map_err(|e| {
                    Error::config(
                        "device",
                        format!(
                            "`{self}` is not available ({e}); set device to a GPU this machine \
                             has, or to \"cpu\""
                        ),
                    )
                })
            }
        }
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::Cpu => write!(f, "cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl std::str::FromStr for DeviceSpec {
    type Err = String;
    /// `cpu`, `cuda` (GPU 0) or `cuda:N`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let bad = || format!("`{s}` is not a device: use cpu, cuda or cuda:N");
        match s {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            _ => match s.strip_prefix("cuda:") {
                Some(n) => n.parse().map(DeviceSpec::Cuda).map_err(|_| bad()),
                None => Err(bad()),
            },
        }
    }
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
    /// The built-in fill-in task's mask ratio range (`policy = "fill_in"`).
    pub mask_ratio: (f64, f64),
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
    pub policy: PolicyType,
    pub model: Option<String>,
    /// `policy = "fill_in"`: the judge of the default rewards.
    pub judge: Option<PathBuf>,
    pub dtype: DTypeOpt,
    pub output_dir: PathBuf,
    pub seed: u64,
    pub threads: Option<usize>,
    pub device: DeviceSpec,
    /// `kernels`: None leaves the process's setting.
    pub kernels: Option<crate::kernels::Kernels>,
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
    /// `policy = "fill_in"` with `mask_ratio`: inputs masked on the fly.
    pub masking: Option<Masking>,
    /// The `[[rewards]]` tables, parsed and checked (built into rewards by
    /// [`crate::inputs::config_rewards`]); empty: the built-in task's rewards.
    pub rewards: Vec<RewardSpec>,
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
    /// Sequences the sampler decodes at once (None: a whole round).
    pub sampling_batch_size: Option<usize>,
    // update
    pub per_device_train_batch_size: usize,
    /// Tokens per forward/backward pass; `None`: sized for the device at set-up
    /// ([`crate::train::Policy::forward_chunk_tokens`]).
    pub forward_chunk_tokens: Option<usize>,
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
    pub max_bad_steps: usize,
    /// SIGTERM / SIGINT finish the step and save a checkpoint (else they end the process).
    pub save_on_signal: bool,
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
    pub sapo_temperature_pos: f64,
    pub sapo_temperature_neg: f64,
    /// `loss_type = vespo`: the Gamma weight's parameters.
    pub vespo: VespoParams,
    /// Keep the top share of tokens by entropy in the policy term (1: all).
    pub top_entropy_quantile: f64,
    pub off_policy_mask_threshold: Option<f64>,
    /// `use_adaptive_entropy`: the controller's starting state (None: a fixed entropy_coef).
    pub adaptive_entropy: Option<AdaptiveEntropy>,
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
    /// Trackers besides metrics.jsonl: `tensorboard`, `wandb`, `mlflow` (checked, `all` expanded).
    pub report_to: Vec<String>,
    pub run_name: Option<String>,
    pub wandb_project: Option<String>,
    /// LoRA adapters instead of full fine-tuning (`lora.r` > 0). Empty `target_modules` means
    /// the architecture's default (see [`crate::peft::default_targets`]).
    pub lora: Option<crate::peft::LoraConfig>,
    /// QLoRA: keep the frozen base's projections quantized.
    pub base_quantization: Option<QuantType>,
    /// Recompute each block's activations in the backward instead of keeping them.
    pub gradient_checkpointing: bool,
    /// DAPO's dynamic sampling: groups whose rewards all equal are replaced by more prompts,
    /// for at most `dynamic_sampling_max_passes` extra sampling passes per round.
    pub dynamic_sampling: bool,
    pub dynamic_sampling_max_passes: usize,
    /// HF's `metric_for_best_model` (a logged metric, e.g. `eval/accuracy`) and
    /// `greater_is_better`: the best checkpoint is recorded and survives rotation.
    pub metric_for_best_model: Option<String>,
    pub greater_is_better: bool,
    /// HF's `load_best_model_at_end`: the run ends by naming the best checkpoint as its model.
    pub load_best_model_at_end: bool,
    /// TRL/HF keys that were given and are ignored here.
    pub ignored_keys: Vec<String>,
    /// TRL's `resume_from_checkpoint = true`: resume as `--resume` does.
    pub resume_from_checkpoint: bool,
    /// Extra chat-template variables (TRL's `chat_template_kwargs`, e.g. `enable_thinking`).
    pub chat_template_kwargs: serde_json::Map<String, Value>,
    /// The merged values of every key (and the `[[rewards]]` tables as given), for
    /// [`Self::to_toml`].
    resolved: BTreeMap<String, Value>,
}

/// One documented key.
#[derive(Debug, Clone)]
pub struct KeyDoc {
    pub key: &'static str,
    /// The accepted values: `int`, `list of string`, `grpo|bnpo|dr_grpo|dapo`, ...
    pub kind: String,
    /// Default as TOML text; empty = unset.
    pub default: &'static str,
    pub help: &'static str,
    pub section: &'static str,
}

// ---------------------------------------------------------------------------------------------
// Reading one value

/// A type a key's merged value is read as (`None`: unset, or null). Errors name the key and what
/// was expected; the conversions are lenient where the command line needs it (a float given as a
/// string, a comma-separated list, -1 for an unset optional integer).
trait FromValue: Sized {
    /// What the key accepts, for `grpo config --print`.
    fn kind() -> Cow<'static, str>;
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self>;
}

fn type_err(key: &str, want: &str, got: &Value) -> Error {
    Error::config(key, format!("expected {want}, got {got}"))
}

fn required<T>(key: &str, v: Option<T>) -> Result<T> {
    v.ok_or_else(|| Error::config(key, "is required"))
}

impl FromValue for Option<f64> {
    fn kind() -> Cow<'static, str> {
        "float".into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        match v {
            None => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(Value::String(s)) => s
                .parse()
                .map(Some)
                .map_err(|_| type_err(key, "a number", &Value::String(s.clone()))),
            Some(v) => Err(type_err(key, "a number", v)),
        }
    }
}

impl FromValue for f64 {
    fn kind() -> Cow<'static, str> {
        "float".into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        required(key, Option::<f64>::from_value(key, v)?)
    }
}

impl FromValue for Option<i64> {
    fn kind() -> Cow<'static, str> {
        "int".into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        match v {
            None => Ok(None),
            Some(Value::Number(n)) => n
                .as_i64()
                .or_else(|| n.as_f64().filter(|f| f.fract() == 0.0).map(|f| f as i64))
                .map(Some)
                .ok_or_else(|| type_err(key, "an integer", &Value::Number(n.clone()))),
            Some(v) => Err(type_err(key, "an integer", v)),
        }
    }
}

impl FromValue for i64 {
    fn kind() -> Cow<'static, str> {
        "int".into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        required(key, Option::<i64>::from_value(key, v)?)
    }
}

/// A non-negative integer; -1 means unset.
impl FromValue for Option<usize> {
    fn kind() -> Cow<'static, str> {
        "int".into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        match Option::<i64>::from_value(key, v)? {
            None | Some(-1) => Ok(None),
            Some(n) if n < 0 => Err(Error::config(key, format!("must be >= 0, got {n}"))),
            Some(n) => Ok(Some(n as usize)),
        }
    }
}

impl FromValue for usize {
    fn kind() -> Cow<'static, str> {
        "int".into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        Option::<usize>::from_value(key, v)?
            .ok_or_else(|| Error::config(key, "must be a non-negative integer"))
    }
}

impl FromValue for u64 {
    fn kind() -> Cow<'static, str> {
        "int".into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        usize::from_value(key, v).map(|n| n as u64)
    }
}

/// A whole number of steps (`logging_steps`): TRL's ratios of the total (0 < x < 1) are refused
/// with a word of why.
#[derive(Debug, Clone, Copy)]
struct Steps(usize);

impl FromValue for Steps {
    fn kind() -> Cow<'static, str> {
        "int".into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        if let Some(Value::Number(n)) = v {
            if n.as_f64().is_some_and(|f| f < 1.0 && f > 0.0) {
                return Err(Error::config(
                    key,
                    "a ratio of total steps is not supported: give a whole number of steps",
                ));
            }
        }
        usize::from_value(key, v).map(Steps)
    }
}

impl FromValue for Option<bool> {
    fn kind() -> Cow<'static, str> {
        "bool".into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        match v {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(type_err(key, "true or false", v)),
        }
    }
}

impl FromValue for bool {
    fn kind() -> Cow<'static, str> {
        "bool".into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        required(key, Option::<bool>::from_value(key, v)?)
    }
}

impl FromValue for Option<String> {
    fn kind() -> Cow<'static, str> {
        "string".into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        match v {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(type_err(key, "a string", v)),
        }
    }
}

impl FromValue for String {
    fn kind() -> Cow<'static, str> {
        "string".into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        required(key, Option::<String>::from_value(key, v)?)
    }
}

impl FromValue for Option<PathBuf> {
    fn kind() -> Cow<'static, str> {
        "path".into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        Ok(Option::<String>::from_value(key, v)?.map(PathBuf::from))
    }
}

impl FromValue for PathBuf {
    fn kind() -> Cow<'static, str> {
        "path".into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        String::from_value(key, v).map(PathBuf::from)
    }
}

/// A list, or (from the command line) a comma-separated string.
impl FromValue for Vec<String> {
    fn kind() -> Cow<'static, str> {
        "list of string".into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        match v {
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
}

/// A list of non-negative integers, one integer, or (from the command line) `1,4,8`.
impl FromValue for Vec<usize> {
    fn kind() -> Cow<'static, str> {
        "list of int".into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        let want = "a list of non-negative integers";
        let one = |v: &Value| -> Result<usize> {
            match v {
                Value::Number(n) => n.as_u64().map(|x| x as usize),
                Value::String(s) => s.trim().parse().ok(),
                _ => None,
            }
            .ok_or_else(|| type_err(key, want, v))
        };
        match v {
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
}

impl FromValue for Option<Vec<f64>> {
    fn kind() -> Cow<'static, str> {
        "list of float".into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        match v {
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
}

/// One of `options` by name; the error lists them.
fn choice<T: Copy>(key: &str, v: Option<&Value>, options: &[(&str, T)]) -> Result<T> {
    let s = String::from_value(key, v)?;
    crate::named::parse_choice(&s, options).map_err(|e| Error::config(key, e))
}

fn names<T: Named>() -> Vec<&'static str> {
    T::NAMES.iter().map(|(n, _)| *n).collect()
}

/// Enums chosen by their config name ([`crate::named`]).
macro_rules! named_keys {
    ($($t:ty),*) => {$(
        impl FromValue for $t {
            fn kind() -> Cow<'static, str> {
                names::<$t>().join("|").into()
            }
            fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
                String::from_value(key, v)?
                    .parse()
                    .map_err(|e: String| Error::config(key, e))
            }
        }
    )*};
}
named_keys!(LossType, IsLevel, LrSchedule, RewardAggregation);

/// A name, or TRL's booleans: true = group, false = none.
impl FromValue for ScaleRewards {
    fn kind() -> Cow<'static, str> {
        names::<ScaleRewards>().join("|").into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        match v {
            Some(Value::Bool(true)) => Ok(ScaleRewards::Group),
            Some(Value::Bool(false)) => Ok(ScaleRewards::None),
            _ => choice(key, v, ScaleRewards::NAMES),
        }
    }
}

impl FromValue for DTypeOpt {
    fn kind() -> Cow<'static, str> {
        "f32|bf16".into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        choice(
            key,
            v,
            &[
                ("f32", DTypeOpt::F32),
                ("float32", DTypeOpt::F32),
                ("bf16", DTypeOpt::Bf16),
                ("bfloat16", DTypeOpt::Bf16),
            ],
        )
    }
}

/// `base_quantization`.
const QUANT_CHOICES: &[(&str, Option<QuantType>)] = &[
    ("none", None),
    ("q4_0", Some(QuantType::Q4_0)),
    ("q4_1", Some(QuantType::Q4_1)),
    ("nf4", Some(QuantType::Nf4)),
    ("q8_0", Some(QuantType::Q8_0)),
];

impl FromValue for Option<QuantType> {
    fn kind() -> Cow<'static, str> {
        let names: Vec<&str> = QUANT_CHOICES.iter().map(|(n, _)| *n).collect();
        names.join("|").into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        choice(key, v, QUANT_CHOICES)
    }
}

crate::named::named_enum! {
    /// What kind of policy is trained (`policy`).
    pub enum PolicyType {
        /// A causal LM that writes completions token by token (unset: this).
        CausalLm = "causal_lm",
        /// A masked-LM generator that fills every masked position of its input in one step.
        FillIn = "fill_in",
    }
}

/// How `policy = "fill_in"` masks inputs on the fly (`mask_ratio`, `mask_span`, `mask_seed`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Masking {
    /// Each input's share of masked tokens is drawn uniformly from this range.
    pub ratio: (f64, f64),
    /// Span lengths in tokens, drawn uniformly from this range per span.
    pub span: (usize, usize),
    pub seed: u64,
}

/// A mask ratio or a range `LO..HI` drawn per example; unset: 0.1..0.5.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MaskRatio(pub (f64, f64));

impl FromValue for MaskRatio {
    fn kind() -> Cow<'static, str> {
        "ratio or \"LO..HI\"".into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        let bad = || {
            Error::config(
                key,
                "must be a ratio in (0, 1] or a range \"LO..HI\" with 0 < LO <= HI <= 1",
            )
        };
        let (lo, hi) = match v {
            None => return Ok(MaskRatio((0.1, 0.5))),
            Some(Value::Number(n)) => {
                let r = n.as_f64().ok_or_else(bad)?;
                (r, r)
            }
            Some(Value::String(s)) => {
                let num = |t: &str| t.trim().parse::<f64>().map_err(|_| bad());
                match s.split_once("..") {
                    Some((a, b)) => (num(a)?, num(b)?),
                    None => {
                        let r = num(s)?;
                        (r, r)
                    }
                }
            }
            Some(_) => return Err(bad()),
        };
        if !(lo > 0.0 && lo <= hi && hi <= 1.0) {
            return Err(bad());
        }
        Ok(MaskRatio((lo, hi)))
    }
}

impl FromValue for Option<MaskRatio> {
    fn kind() -> Cow<'static, str> {
        MaskRatio::kind()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        v.map(|v| MaskRatio::from_value(key, Some(v))).transpose()
    }
}

/// A span length in tokens or a range `LO..HI` drawn per span; unset: 1.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpanLen(pub (usize, usize));

impl FromValue for SpanLen {
    fn kind() -> Cow<'static, str> {
        "length or \"LO..HI\"".into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        let bad = || {
            Error::config(
                key,
                "must be a span length >= 1 or a range \"LO..HI\" with 1 <= LO <= HI",
            )
        };
        let (lo, hi) = match v {
            None => return Ok(SpanLen((1, 1))),
            Some(Value::Number(n)) => {
                let l = n.as_u64().ok_or_else(bad)? as usize;
                (l, l)
            }
            Some(Value::String(s)) => {
                let num = |t: &str| t.trim().parse::<usize>().map_err(|_| bad());
                match s.split_once("..") {
                    Some((a, b)) => (num(a)?, num(b)?),
                    None => {
                        let l = num(s)?;
                        (l, l)
                    }
                }
            }
            Some(_) => return Err(bad()),
        };
        if !(lo >= 1 && lo <= hi) {
            return Err(bad());
        }
        Ok(SpanLen((lo, hi)))
    }
}

impl FromValue for Option<u64> {
    fn kind() -> Cow<'static, str> {
        "int".into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        v.map(|v| u64::from_value(key, Some(v))).transpose()
    }
}

/// The file of split `split` of TRL's `dataset_name`: the name itself when it is a file, else in
/// that directory `{split}.jsonl|.json|.parquet|.csv|.txt`, or `data/{split}-*.parquet` as the
/// hub lays datasets out; else a hub id, whose split is fetched into the hub cache.
fn dataset_split_file(name: &str, split: &str) -> Result<String> {
    let p = Path::new(name);
    if p.is_file() {
        return Ok(name.to_string());
    }
    if p.is_dir() {
        for ext in ["jsonl", "json", "parquet", "csv", "txt"] {
            let f = p.join(format!("{split}.{ext}"));
            if f.is_file() {
                return Ok(f.display().to_string());
            }
        }
        let data = p.join("data");
        let mut parts: Vec<PathBuf> = std::fs::read_dir(&data)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|f| {
                f.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&format!("{split}-")) && n.ends_with(".parquet"))
            })
            .collect();
        parts.sort();
        if let [one] = parts.as_slice() {
            return Ok(one.display().to_string());
        }
        return Err(Error::config(
            "dataset_name",
            format!(
                "{name}: no file for split `{split}` ({split}.jsonl, .json, .parquet, .csv, .txt, \
                 or one data/{split}-*.parquet); {} found",
                if parts.is_empty() {
                    "none".to_string()
                } else {
                    format!("{} parquet shards", parts.len())
                }
            ),
        ));
    }
    // A hub id (`owner/name`): the split fetched through the hub client into its cache.
    let hub_id = name.split('/').count() == 2
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c));
    if !hub_id {
        return Err(Error::config(
            "dataset_name",
            format!(
                "{name}: not a local file or directory, nor a hub dataset id (owner/name): give \
                 a dataset file, a directory holding its splits, or a hub id"
            ),
        ));
    }
    let path = crate::hub::fetch_dataset_split(name, split)
        .map_err(|e| Error::config("dataset_name", e.to_string()))?;
    Ok(path.display().to_string())
}

/// `report_to` as TRL spells it, checked: `all` is every tracker grpo has, `none` (alone) none;
/// `jsonl` is accepted (metrics.jsonl is always written). Unknown values are errors naming them.
fn resolve_report_to(values: Vec<String>) -> Result<Vec<String>> {
    let mut out: Vec<String> = Vec::new();
    for v in values {
        match v.as_str() {
            "tensorboard" | "wandb" | "mlflow" => out.push(v),
            "all" => out.extend(["tensorboard", "wandb", "mlflow"].map(String::from)),
            "none" | "jsonl" => {}
            "trackio" => {
                return Err(Error::config(
                    "report_to",
                    "trackio is not supported: keep tensorboard (event files in output_dir/tb, \
                     which trackio can import) or use wandb / mlflow",
                ))
            }
            other => {
                return Err(Error::config(
                    "report_to",
                    format!(
                        "unknown value `{other}`: use tensorboard, wandb, mlflow, all or none \
                         (metrics.jsonl is always written)"
                    ),
                ))
            }
        }
    }
    out.dedup();
    out.sort();
    out.dedup();
    Ok(out)
}

/// Unset: a causal LM (so older configs resolve as before).
impl FromValue for PolicyType {
    fn kind() -> Cow<'static, str> {
        names::<PolicyType>().join("|").into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        match Option::<String>::from_value(key, v)? {
            None => Ok(PolicyType::CausalLm),
            Some(s) => s.parse().map_err(|e: String| Error::config(key, e)),
        }
    }
}

/// Unset: the CPU.
impl FromValue for DeviceSpec {
    fn kind() -> Cow<'static, str> {
        "cpu|cuda|cuda:N".into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        match Option::<String>::from_value(key, v)? {
            None => Ok(DeviceSpec::Cpu),
            Some(s) => s.parse().map_err(|e: String| Error::config(key, e)),
        }
    }
}

/// Unset: the process's setting (`GRPO_KERNELS`, else fused).
impl FromValue for Option<crate::kernels::Kernels> {
    fn kind() -> Cow<'static, str> {
        "auto|fused|portable".into()
    }
    fn from_value(key: &str, v: Option<&Value>) -> Result<Self> {
        match Option::<String>::from_value(key, v)? {
            None => Ok(None),
            Some(s) => crate::kernels::Kernels::parse(&s)
                .map(Some)
                .map_err(|e| Error::config(key, e)),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The keys

/// One declared key (see [`config_keys!`]).
struct KeyDef {
    key: &'static str,
    section: &'static str,
    /// Default as TOML text; empty = unset.
    default: &'static str,
    help: &'static str,
    /// What the key accepts, when the declaration says more than its type.
    kind: Option<&'static str>,
    type_kind: fn() -> Cow<'static, str>,
}

/// Declares every key once:
///
/// ```text
/// "section" {
///     field ["dotted.key"]: RawType [as "kind"] = "default as TOML", "help";
/// }
/// ```
///
/// and generates the table [`KEYS`] (key, section, default, help; the kind comes from the raw
/// type unless `as` gives it) and [`RawConfig`], one field of that type per key, read from the
/// merged values by [`FromValue`]. The key is the field's name unless a dotted key is given.
macro_rules! config_keys {
    ($( $section:literal {
        $( $field:ident $($key:literal)? : $ty:ty $(as $kind:literal)? = $default:literal, $help:literal; )*
    } )*) => {
        /// Every key, in `grpo config --print` order.
        const KEYS: &[KeyDef] = &[$($(
            KeyDef {
                key: config_keys!(@key $field $($key)?),
                section: $section,
                default: $default,
                help: $help,
                kind: config_keys!(@kind $($kind)?),
                type_kind: <$ty as FromValue>::kind,
            },
        )*)*];

        /// Every key's value read as its declared type, before any rule is checked.
        #[derive(Debug)]
        struct RawConfig {
            $($( $field: $ty, )*)*
        }

        impl RawConfig {
            /// Reads the merged values, in table order; the first bad value is the error.
            fn read(m: &BTreeMap<String, Value>) -> Result<Self> {
                let get = |k: &str| m.get(k).filter(|v| !v.is_null());
                Ok(RawConfig {
                    $($( $field: {
                        let key = config_keys!(@key $field $($key)?);
                        <$ty as FromValue>::from_value(key, get(key))?
                    }, )*)*
                })
            }
        }
    };
    (@key $field:ident) => { stringify!($field) };
    (@key $field:ident $key:literal) => { $key };
    (@kind) => { None };
    (@kind $kind:literal) => { Some($kind) };
}

config_keys! {
    "run" {
        judge: Option<PathBuf> = "", "fill_in: the judge (a *ForSequenceClassification directory) whose probability of the label `real` (else its last label) rewards the fills when no [[rewards]] are given (unset: the built-in task's pretrained judge)";
        policy: PolicyType = "", "what is trained: causal_lm (completions token by token; unset) or fill_in (a masked-LM generator filling every masked position at once)";
        model: Option<String> = "", "HF directory, .gguf file or hub id (unset: SmolLM2-135M-Instruct, fetched once)";
        dtype: DTypeOpt = "\"f32\"", "compute precision of sampling, the reference and the training forward: f32, or bf16 (mixed precision: bf16 weights and activations, f32 master parameters, AdamW moments, log-softmax and loss)";
        output_dir: PathBuf = "\"runs/grpo\"", "where metrics, samples and checkpoints go";
        seed: u64 = "42", "seeds prompt order and sampling; a run is reproducible from it";
        threads: Option<usize> = "", "CPU threads (unset: all cores)";
        device: DeviceSpec = "", "where training runs: cpu, cuda or cuda:N (needs a build with --features cuda)";
        kernels: Option<crate::kernels::Kernels> = "", "CPU kernels: auto or fused (grpo's fused f32 kernels where they apply), or portable (candle ops only: the path a GPU runs, on the CPU); unset: GRPO_KERNELS, else fused";
        max_steps: Option<i64> = "-1", "optimizer steps to run (-1: from num_train_epochs)";
        num_train_epochs: f64 = "1.0", "passes over the prompts when max_steps is -1";
        save_on_signal: bool = "true", "SIGTERM / SIGINT (Slurm or Kubernetes preemption, Ctrl-C) finish the current step, save a checkpoint and exit 0 (false: exit at once, 143 / 130, without one)";
    }
    "data" {
        train_file: Option<PathBuf> = "", "prompts (.jsonl, .csv, .parquet, or .txt with one prompt per line); unset: the built-in task";
        eval_file: Option<PathBuf> = "", "held-out prompts for evaluation (the built-in task has its own)";
        prompt_field: String = "\"prompt\"", "field holding the prompt: a string or a list of {role, content} messages";
        answer_field: String = "\"answer\"", "field holding the reference answer passed to rewards";
        system_prompt: Option<String> = "", "system message put before each prompt (unless it has one)";
        shuffle_dataset: bool = "true", "shuffle prompts each epoch (seeded)";
        skip_bad_rows: bool = "false", "skip and count malformed rows instead of stopping";
        max_prompt_length: Option<usize> = "512", "prompts longer than this are truncated from the left (-1: never)";
        task_train_size "task.train_size": usize = "2000", "built-in task: training problems";
        task_eval_size "task.eval_size": usize = "200", "built-in task: held-out problems";
        task_min_operand "task.min_operand": i64 = "10", "built-in task: smallest operand";
        task_max_operand "task.max_operand": i64 = "99", "built-in task: largest operand";
        task_ops "task.ops": Vec<String> as "list of \"+\" \"-\" \"*\"" = "[\"+\"]", "built-in task: operations";
        task_seed "task.seed": u64 = "1234", "built-in task: problem generator seed";
        task_mask_ratio "task.mask_ratio": MaskRatio as "ratio or \"LO..HI\"" = "", "built-in fill-in task (policy = fill_in): share of each equation's characters masked, a ratio or a range drawn per example (unset: 0.1..0.5)";
        mask_ratio: Option<MaskRatio> as "ratio or \"LO..HI\"" = "", "fill_in: mask every training input on the fly, each draw its own masks (held-out inputs once, fixed): the share of its tokens masked, a ratio or a range drawn per input (unset: inputs must hold mask tokens)";
        mask_span: SpanLen as "length or \"LO..HI\"" = "", "fill_in with mask_ratio: length in tokens of each masked span, fixed or drawn per span (unset: 1)";
        mask_seed: Option<u64> = "", "fill_in with mask_ratio: seeds the masks (unset: seed)";
        reward_weights: Option<Vec<f64>> = "", "weight of each reward function (unset: each reward's own weight)";
    }
    "generation" {
        num_generations: usize = "8", "completions per prompt (G, the group size)";
        max_completion_length: usize = "256", "maximum new tokens per completion";
        temperature: f64 = "1.0", "sampling temperature (log-probs are taken at the same temperature)";
        top_p: f64 = "1.0", "nucleus sampling (1: off)";
        top_k: usize = "0", "top-k sampling (0: off)";
        min_p: Option<f64> = "", "min-p sampling (unset: off)";
        repetition_penalty: f64 = "1.0", "HF repetition penalty (1: off)";
        stop: Vec<String> = "[]", "stop strings (EOS always stops)";
        generation_batch_size: Option<usize> = "", "completions per generation round (default per_device_train_batch_size x steps_per_generation)";
        steps_per_generation: Option<usize> = "", "micro-batches per generation round (default gradient_accumulation_steps)";
        sampling_batch_size: Option<usize> = "", "completions decoded at once, in whole groups (at least one): bounds the sampler's memory; completions do not depend on it (unset: a whole round at once; the seeds' gen_batch_size)";
    }
    "update" {
        per_device_train_batch_size: usize = "8", "completions per micro-batch";
        gradient_accumulation_steps: usize = "1", "micro-batches per optimizer step";
        forward_chunk_tokens: Option<usize> = "", "tokens per forward/backward pass: a micro-batch is split into chunks of whole groups (the math is unchanged; lower it to save memory, raise it for fewer, larger passes); unset: 1024 on the fused CPU path (passes sized to the CPU's caches), elsewhere (a GPU, bf16, kernels = portable) as many tokens as a pass's activations fit in half the device's free memory at start";
        num_iterations: usize = "1", "updates per generation batch (mu in the paper); > 1 uses clipped ratios";
        learning_rate: f64 = "1e-6", "AdamW learning rate";
        adam_beta1: f64 = "0.9", "AdamW beta1";
        adam_beta2: f64 = "0.999", "AdamW beta2";
        adam_epsilon: f64 = "1e-8", "AdamW epsilon";
        weight_decay: f64 = "0.0", "AdamW decoupled weight decay";
        max_grad_norm: f64 = "1.0", "clip the global gradient norm (0: off)";
        lr_scheduler_type: LrSchedule = "\"linear\"", "learning-rate schedule";
        warmup_ratio: f64 = "0.0", "share of steps spent warming up";
        warmup_steps: usize = "0", "warm-up steps (wins over warmup_ratio when > 0)";
        max_bad_steps: usize = "3", "a NaN or Inf in a step's rewards, log-probs, loss or gradients skips its update (counted in skipped_steps); this many in a row stop the run with an error";
        gradient_checkpointing: bool = "false", "keep only each block's input during the forward and recompute the block in the backward (less memory, one more forward); sampling then also skips the packed copy of the weights for the decoding GEMM (slower generation, lower peak with LoRA)";
    }
    "lora" {
        lora_r "lora.r": usize = "0", "LoRA rank: train adapters on a frozen base (0: full fine-tuning; TRL: lora_r)";
        lora_alpha "lora.alpha": Option<f64> = "", "LoRA alpha; the adapter output is scaled by alpha / r (unset: 2 x r)";
        lora_dropout "lora.dropout": f64 = "0.05", "dropout on the adapters' input during training";
        lora_target_modules "lora.target_modules": Vec<String> = "", "projections that get adapters, by name (q_proj, v_proj, ...) or \"all-linear\" (unset: q_proj, v_proj; GPT-2: c_attn)";
        lora_use_rslora "lora.use_rslora": bool = "false", "rank-stabilized LoRA: scale by alpha / sqrt(r)";
        base_quantization: Option<QuantType> = "\"none\"", "QLoRA: keep the frozen base quantized (needs lora.r > 0); a GGUF of the same type is used as is";
    }
    "loss" {
        loss_type: LossType = "\"dapo\"", "token-loss reduction, with TRL's normalizations";
        beta: f64 = "0.0", "weight of the k3 KL penalty to the reference model in the loss";
        epsilon: f64 = "0.2", "lower clipping range of the ratio";
        epsilon_high: Option<f64> = "", "upper clipping range (default: epsilon)";
        delta: Option<f64> = "", "two-sided clipping: cap on the unclipped ratio (unset: off)";
        importance_sampling_level: IsLevel = "\"token\"", "ratio per token, or per sequence (GSPO)";
        scale_rewards: ScaleRewards = "\"group\"", "std used to scale advantages (none: Dr. GRPO)";
        mask_truncated_completions: bool = "false", "leave completions that hit max_completion_length out of the loss";
        entropy_coef: f64 = "0.0", "entropy bonus weight";
        use_bias_correction_kl: bool = "true", "multiply the KL term by the importance ratio (unbiased reverse-KL gradient, TRL's default)";
        sapo_temperature_pos: Option<f64> = "", "loss_type = sapo: the gate's temperature for tokens with positive advantage (unset: 1.0)";
        sapo_temperature_neg: Option<f64> = "", "loss_type = sapo: the gate's temperature for tokens with non-positive advantage (unset: 1.05)";
        vespo_k_pos: f64 = "2.0", "loss_type = vespo: shape k of the Gamma weight for non-negative advantages";
        vespo_lambda_pos: f64 = "3.0", "loss_type = vespo: rate lambda of the Gamma weight for non-negative advantages";
        vespo_k_neg: f64 = "3.0", "loss_type = vespo: shape k for negative advantages";
        vespo_lambda_neg: f64 = "2.0", "loss_type = vespo: rate lambda for negative advantages";
        top_entropy_quantile: f64 = "1.0", "keep in the policy term only this top share of each micro-batch's tokens by entropy (\"Beyond the 80/20 rule\"; 0.2 in the paper; 1: all tokens)";
        off_policy_mask_threshold: Option<f64> = "", "drop from the policy term sequences with a negative advantage whose mean old-minus-current log-prob exceeds this (DeepSeek-V3.2; e.g. 0.5; unset: off)";
        use_adaptive_entropy: bool = "false", "adaptive entropy control (Skywork-OR1): entropy_coef moves by entropy_coef_delta each step towards keeping the entropy above entropy_target, and applies only while the entropy is at or below it";
        entropy_coef_min: f64 = "0.0", "adaptive entropy control: smallest entropy_coef";
        entropy_coef_max: f64 = "1.0", "adaptive entropy control: largest entropy_coef";
        entropy_coef_delta: f64 = "0.005", "adaptive entropy control: change of entropy_coef per optimizer step";
        entropy_target: f64 = "0.2", "adaptive entropy control: target mean entropy per token, in nats (set it near the entropy of the first steps)";
        reward_std_floor: Option<f64> = "", "clamp each group's reward std from below before scaling";
        multi_objective_aggregation: RewardAggregation = "\"sum_then_normalize\"", "several rewards: weighted sum then advantages, or each normalized in its group, summed, normalized over the batch (GDPO)";
        normalize_advantages_batch: bool = "false", "re-normalize all advantages of a batch to mean 0, std 1";
        drop_zero_std_groups: bool = "false", "leave groups whose rewards all equal out of the update";
        kl_coef: f64 = "0.0", "KL in the reward: reward - kl_coef x sum_t(logp - ref_logp)";
        kl_target: Option<f64> = "", "adaptive KL controller target (unset: fixed kl_coef)";
        kl_horizon: f64 = "10000.0", "adaptive KL controller horizon, in samples";
        sync_ref_model: bool = "false", "mix the policy into the reference every ref_model_sync_steps";
        ref_model_sync_steps: usize = "512", "steps between reference syncs";
        ref_model_mixup_alpha: f64 = "0.6", "ref = alpha x policy + (1 - alpha) x ref at each sync";
    }
    "logging" {
        logging_steps: Steps = "1", "log metrics every N steps";
        log_completions: bool = "true", "write prompts, completions, rewards and advantages to completions.jsonl";
        log_completions_steps: usize = "10", "every N generation rounds";
        num_completions_to_print: usize = "2", "samples shown on the console when completions are logged";
        save_steps: usize = "500", "checkpoint every N steps (0: only at the end)";
        save_total_limit: Option<usize> = "", "keep only the newest N checkpoints";
        eval_steps: usize = "0", "evaluate on the held-out prompts every N steps (0: off)";
        eval_num_prompts: Option<usize> = "", "held-out prompts per evaluation (unset: all)";
        eval_num_samples: usize = "4", "sampled completions per held-out prompt, for pass@k and eval/mean_accuracy (0: greedy only; eval_k is then ignored)";
        eval_k: Vec<usize> = "[1]", "report eval/pass@k for each k (unbiased estimator; each k <= eval_num_samples)";
        eval_temperature: Option<f64> = "", "sampling temperature of the eval samples (unset: temperature)";
        eval_greedy: bool = "true", "also one greedy completion per held-out prompt: eval/accuracy";
        report_to: Vec<String> as "list of tensorboard|wandb|mlflow|all|none" = "[\"tensorboard\"]", "where metrics go besides metrics.jsonl (always written): tensorboard (output_dir/tb), wandb (your wandb package; WANDB_* settings apply), mlflow (the server at MLFLOW_TRACKING_URI), all, none";
        run_name: Option<String> = "", "the run's name in W&B and MLflow (unset: the output directory's name)";
        wandb_project: Option<String> = "", "the W&B project (unset: WANDB_PROJECT, else grpo)";
        metric_for_best_model: Option<String> = "", "keep the best checkpoint by this logged metric (e.g. eval/accuracy; HF's eval_accuracy and accuracy mean the same): it survives save_total_limit and trainer_state.json names it (unset: off)";
        greater_is_better: Option<bool> = "", "whether a larger metric_for_best_model is better (unset: true, false for a metric named like a loss)";
        load_best_model_at_end: Option<bool> = "", "end the run with the best checkpoint as its model (needs metric_for_best_model and save_steps a multiple of eval_steps; unset: false)";
        dynamic_sampling: Option<bool> = "", "DAPO's dynamic sampling: drop groups whose rewards all equal and sample more prompts until the batch is full (unset: false)";
        dynamic_sampling_max_passes: Option<usize> = "", "dynamic sampling: extra sampling passes per round at most (unset: 4)";
    }
}

/// TRL's, PEFT's and the seeds' names for grpo's keys (the value is used as it is).
const ALIASES: &[(&str, &str)] = &[
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
const MAPPED: &[(&str, &str)] = &[
    ("use_peft", "true: LoRA at rank 16 unless lora_r says otherwise"),
    ("torch_dtype", "sets dtype on a GPU; on the CPU a half-precision torch_dtype is ignored (warned) and training stays f32, as candle has no fast bf16 GEMM there: set dtype = \"bf16\" to force it"),
    ("bf16", "true: dtype = bf16 on a GPU (mixed precision: bf16 weights and activations over f32 master parameters, f32 optimizer and loss); on the CPU training stays f32 (warned), as candle has no fast bf16 GEMM there: set dtype = \"bf16\" to force it"),
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
    ("reward_funcs", "TRL's built-in rewards as grpo rules (accuracy_reward, reasoning_accuracy_reward, think_format_reward, get_soft_overlong_punishment); dotted Python paths are refused with how to use a command scorer"),
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
    ("project", "a Trackio setting; W&B takes wandb_project"),
    (
        "trackio_space_id",
        "trackio is not supported (report_to = trackio is an error)",
    ),
    (
        "trackio_bucket_id",
        "trackio is not supported (report_to = trackio is an error)",
    ),
    (
        "trackio_static_space_id",
        "trackio is not supported (report_to = trackio is an error)",
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
    (
        "save_strategy",
        "grpo saves every save_steps steps and at the end",
    ),
    (
        "save_only_model",
        "checkpoints hold what exact resume needs",
    ),
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
    (
        "dataset_config",
        "a local dataset directory has one configuration",
    ),
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
    ("max_tool_calling_iterations", "grpo has no tool calling"),
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
    if KEYS.iter().any(|d| d.key == key) {
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

/// The rewards of `trl grpo`'s `reward_funcs` names, as `[[rewards]]` tables; and whether one
/// reads the `solution` column.
fn trl_reward_funcs(v: &Value) -> Result<(Vec<Value>, bool)> {
    let names: Vec<String> = match v {
        Value::String(s) => vec![s.clone()],
        Value::Array(a) => a
            .iter()
            .map(|x| {
                x.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| type_err("reward_funcs", "a list of reward names", x))
            })
            .collect::<Result<_>>()?,
        other => return Err(type_err("reward_funcs", "a list of reward names", other)),
    };
    let (mut tables, mut solution) = (vec![], false);
    for name in names {
        let t = match name.as_str() {
            "accuracy_reward" => {
                solution = true;
                serde_json::json!({"kind": "answer_match", "name": name, "extract": "boxed"})
            }
            "reasoning_accuracy_reward" => {
                solution = true;
                serde_json::json!({"kind": "answer_match", "name": name, "extract": "boxed",
                                   "after": "</think>"})
            }
            "think_format_reward" => serde_json::json!({"kind": "think_format", "name": name}),
            // `trl grpo`'s fixed arguments.
            "get_soft_overlong_punishment" => serde_json::json!({
                "kind": "length", "name": "soft_overlong_punishment_reward",
                "max_length": 1280, "cache_length": 256}),
            other if other.contains('.') => {
                return Err(Error::config(
                    "reward_funcs",
                    format!(
                        "`{other}`: grpo does not import Python reward functions; run it as a \
                         scorer program instead ([[rewards]] kind = \"command\", docs/rewards.md \
                         shows a Python scorer in a few lines)"
                    ),
                ))
            }
            other => {
                return Err(Error::config(
                    "reward_funcs",
                    format!(
                        "`{other}` is not one of TRL's rewards: accuracy_reward, \
                         reasoning_accuracy_reward, think_format_reward, \
                         get_soft_overlong_punishment (or give [[rewards]] tables)"
                    ),
                ))
            }
        };
        tables.push(t);
    }
    Ok((tables, solution))
}

/// Every key: name, type, default (as text), one-line help.
pub fn reference() -> Vec<KeyDoc> {
    KEYS.iter()
        .map(|k| KeyDoc {
            key: k.key,
            kind: k
                .kind
                .map_or_else(|| (k.type_kind)().into_owned(), str::to_owned),
            default: k.default,
            help: k.help,
            section: k.section,
        })
        .collect()
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
            // A bare `--flag` is `--flag=true`, as in TRL's argument parser, unless the key
            // is one of grpo's that is not true/false (TRL's and the seeds' names are checked
            // when they are read).
            let needs_value = |k: &str| {
                KEYS.iter()
                    .any(|d| d.key == k && !matches!(d.default, "true" | "false"))
            };
            let (k, v) = match body.split_once('=') {
                Some(kv) => kv,
                None if !needs_value(body) => (body, "true"),
                None => {
                    return Err(Error::config(
                        body,
                        format!("override `{o}` has no value: write --{body}=VALUE"),
                    ))
                }
            };
            if k == "rewards" {
                return Err(Error::config("rewards", "set rewards in the config file"));
            }
            Ok((k.to_string(), parse_override_value(v)))
        })
        .collect()
}

impl TrainConfig {
    /// Loads `path` (None: the embedded default, or the embedded fill-in run when the overrides
    /// say `--policy=fill_in`) with `overrides` (`--key=value`).
    pub fn load(path: Option<&Path>, overrides: &[String]) -> Result<TrainConfig> {
        let fill_in = overrides
            .iter()
            .any(|o| o.trim_start_matches('-').replace('-', "_") == "policy=fill_in");
        match path {
            None if fill_in => Self::from_str(
                FILL_IN_CONFIG,
                Format::Toml,
                "<embedded fill-in config>",
                overrides,
            ),
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
        // TRL's `bf16 = true`: bf16 on a GPU, f32 on the CPU (warned), see MAPPED.
        let mut trl_bf16 = false;
        let mut trl_torch_dtype: Option<String> = None;
        let mut dtype_given = false;
        let mut reward_tables = vec![];
        let mut wandb_log = false;
        let mut script: BTreeMap<String, String> = BTreeMap::new();
        let mut resume_requested = false;
        let mut template_kwargs = serde_json::Map::new();
        let (mut trl_rewards, mut trl_reward_model) = (Vec::new(), None);
        let (mut needs_solution, mut answer_field_given) = (false, false);
        let mut adaptive_kl: Option<bool> = None;
        let mut apply =
            |k: String, v: Value, from: &str| -> Result<()> {
                if k == "torch_dtype" {
                    // Like `bf16`: decided below, once the device is known.
                    trl_torch_dtype = v.as_str().map(str::to_string);
                    return Ok(());
                }
                let k = ALIASES
                    .iter()
                    .find(|(a, _)| *a == k)
                    .map_or(k, |(_, to)| to.to_string());
                dtype_given |= k == "dtype";
                if v.is_null() {
                    // YAML's `key: null` (TRL's dumps have many): unset, the default stays.
                    return match trl_key(&k) {
                        Some(_) => Ok(()),
                        None if k == "rewards" || k == "wandb_log" => Ok(()),
                        None => Err(Error::config(
                            &k,
                            format!("unknown key in {from}{}", suggest(&k)),
                        )),
                    };
                }
                if k == "use_peft" {
                    // TRL's switch: LoRA with its default rank 16 unless lora_r says otherwise.
                    if v == Value::Bool(true)
                        && !merged.get("lora.r").is_some_and(|r| r != &Value::from(0))
                    {
                        merged.insert("lora.r".into(), Value::from(16));
                    }
                    return Ok(());
                }
                // `trl grpo`'s script and model arguments.
                match k.as_str() {
                    // TRL passes these to generate(); those that map onto the sampler are set
                    // as its keys (they win, as in TRL), the rest are refused by name.
                    "generation_kwargs" => {
                        let Value::Object(m) = v else {
                            return Err(type_err(&k, "a table of generation options", &v));
                        };
                        for (g, gv) in m {
                            let key =
                                match g.as_str() {
                                    "temperature" | "top_p" | "top_k" | "min_p"
                                    | "repetition_penalty" => g.clone(),
                                    "max_new_tokens" => "max_completion_length".into(),
                                    "stop_strings" | "stop" => "stop".into(),
                                    "do_sample" if gv == Value::Bool(true) => continue,
                                    other => return Err(Error::config(
                                        format!("generation_kwargs.{other}"),
                                        "not a sampling option grpo has: give temperature, top_p, \
                                     top_k, min_p, repetition_penalty, max_new_tokens, \
                                     stop_strings (or do_sample = true)",
                                    )),
                                };
                            merged.insert(key, gv);
                        }
                        return Ok(());
                    }
                    "dataset_name" | "dataset_train_split" | "dataset_test_split" => {
                        let text = match &v {
                            Value::String(t) => t.clone(),
                            other => return Err(type_err(&k, "a string", other)),
                        };
                        script.insert(k, text);
                        return Ok(());
                    }
                    "chat_template_kwargs" => {
                        let Value::Object(m) = v else {
                            return Err(type_err(&k, "a table of chat-template variables", &v));
                        };
                        template_kwargs = m;
                        return Ok(());
                    }
                    "resume_from_checkpoint" => {
                        return match v {
                            Value::Bool(b) => {
                                resume_requested = b;
                                Ok(())
                            }
                            Value::Null => Ok(()),
                            other => Err(Error::config(
                                "resume_from_checkpoint",
                                format!(
                                "{other}: grpo resumes from the newest checkpoint in output_dir: \
                                 set resume_from_checkpoint = true (or pass --resume) with \
                                 output_dir = the run's directory"
                            ),
                            )),
                        };
                    }
                    "load_in_4bit" | "load_in_8bit" => {
                        if v == Value::Bool(true) {
                            let q = if k == "load_in_4bit" { "nf4" } else { "q8_0" };
                            merged.insert("base_quantization".into(), Value::String(q.into()));
                            ignored.push(k);
                        }
                        return Ok(());
                    }
                    "model_revision" => {
                        if v != Value::String("main".into()) && !v.is_null() {
                            return Err(Error::config(
                                "model_revision",
                                format!(
                                    "{v}: grpo loads a hub model's main revision; download the \
                                 revision you want and give its directory as model"
                                ),
                            ));
                        }
                        return Ok(());
                    }
                    "use_dora" | "lora_modules_to_save" | "lora_target_parameters" => {
                        let set = match &v {
                            Value::Bool(b) => *b,
                            Value::Array(a) => !a.is_empty(),
                            _ => true,
                        };
                        if set {
                            return Err(Error::config(
                            &k,
                            match k.as_str() {
                                "use_dora" => {
                                    "DoRA adapters are not supported: use LoRA (use_peft = true)"
                                }
                                "lora_modules_to_save" => {
                                    "grpo trains adapters on projections only; leave it unset"
                                }
                                _ => "give the projections by name in lora_target_modules",
                            },
                        ));
                        }
                        return Ok(());
                    }
                    "optim" => {
                        return match v.as_str() {
                            Some(o) if o.starts_with("adamw") => Ok(()),
                            _ => Err(Error::config(
                                "optim",
                                format!(
                                    "{v}: grpo's optimizer is AdamW (set adam_beta1, adam_beta2, \
                                     adam_epsilon, weight_decay); give an adamw_* value or leave \
                                     it unset"
                                ),
                            )),
                        };
                    }
                    "reward_funcs" => {
                        let (tables, solution) = trl_reward_funcs(&v)?;
                        trl_rewards.extend(tables);
                        needs_solution |= solution;
                        return Ok(());
                    }
                    "reward_model_name_or_path" => {
                        let Some(path) = v.as_str() else {
                            return Err(type_err(&k, "a model directory", &v));
                        };
                        // TRL scores prompt + completion with the model's first logit.
                        trl_reward_model = Some(serde_json::json!({
                            "kind": "classifier", "name": "reward_model", "model": path,
                            "input": "joined", "label": 0, "output": "logit"}));
                        return Ok(());
                    }
                    _ => {}
                }
                if k == "adap_kl_ctrl" {
                    adaptive_kl = Some(v == Value::Bool(true));
                    return Ok(());
                }
                if k == "wandb_log" {
                    // The seeds' switch: W&B beside what report_to already names.
                    wandb_log = v == Value::Bool(true);
                    return Ok(());
                }
                if k == "rewards" {
                    reward_tables = match v {
                        Value::Array(a) => a,
                        other => {
                            return Err(type_err("rewards", "a list of [[rewards]] tables", &other))
                        }
                    };
                    return Ok(());
                }
                if KEYS.iter().any(|d| d.key == k) {
                    if k == "answer_field" {
                        answer_field_given = true;
                    }
                    merged.insert(k, v);
                } else if k == "bf16" {
                    trl_bf16 = v == Value::Bool(true);
                } else if matches!(trl_key(&k), Some(TrlKey::Ignored(_))) {
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
        // `trl grpo`'s rewards come first (its reward model, then its functions), as TRL orders
        // them; TRL's accuracy rewards read the `solution` column.
        if trl_reward_model.is_some() || !trl_rewards.is_empty() {
            let mut all: Vec<Value> = trl_reward_model.into_iter().collect();
            all.extend(trl_rewards);
            all.append(&mut reward_tables);
            reward_tables = all;
        }
        match adaptive_kl {
            Some(true) if !merged.contains_key("kl_target") => {
                merged.insert("kl_target".into(), Value::from(6.0));
            }
            Some(false) => {
                merged.remove("kl_target");
            }
            _ => {}
        }
        if needs_solution && !answer_field_given {
            merged.insert("answer_field".into(), Value::String("solution".into()));
        }
        // `dataset_name`: a local dataset file, a directory holding its splits, or a hub id.
        if let Some(name) = script.get("dataset_name") {
            let train_split = script
                .get("dataset_train_split")
                .map_or("train", String::as_str);
            if !merged.contains_key("train_file") {
                merged.insert(
                    "train_file".into(),
                    Value::String(dataset_split_file(name, train_split)?),
                );
            }
            if let (Some(test), false) = (
                script.get("dataset_test_split"),
                merged.contains_key("eval_file"),
            ) {
                merged.insert(
                    "eval_file".into(),
                    Value::String(dataset_split_file(name, test)?),
                );
            }
        }
        if wandb_log {
            let mut to = match merged.get("report_to") {
                Some(Value::Array(a)) => a.clone(),
                Some(Value::String(s)) => s
                    .split(',')
                    .map(|x| Value::String(x.trim().to_string()))
                    .filter(|x| x != "none")
                    .collect(),
                Some(_) => vec![],
                None => vec![Value::String("tensorboard".into())],
            };
            to.push(Value::String("wandb".into()));
            merged.insert("report_to".into(), Value::Array(to));
        }
        let on_gpu =
            matches!(merged.get("device"), Some(Value::String(d)) if d.starts_with("cuda"));
        if let Some(t) = trl_torch_dtype.filter(|_| !dtype_given) {
            let half = matches!(
                t.as_str(),
                "bfloat16" | "bf16" | "float16" | "fp16" | "half"
            );
            match on_gpu || !half {
                true => {
                    merged.insert("dtype".into(), Value::String(t));
                }
                false => ignored.push("torch_dtype".into()),
            }
        }
        if trl_bf16 {
            match on_gpu {
                true => merged.insert("dtype".into(), Value::String("bf16".into())),
                false => {
                    ignored.push("bf16".into());
                    None
                }
            };
        }
        ignored.sort();
        ignored.dedup();
        let mut cfg = Self::validate(RawConfig::read(&merged)?)?;
        cfg.rewards = crate::rewards::parse_specs(&reward_tables, cfg.max_completion_length)?;
        if cfg.policy == PolicyType::FillIn
            && cfg.train_file.is_some()
            && cfg.judge.is_none()
            && cfg.rewards.is_empty()
        {
            return Err(Error::config(
                "judge",
                "policy = \"fill_in\" with a train_file needs a reward: judge = a classifier \
                 directory (e.g. one `grpo pretrain --objective judge` made) or [[rewards]] tables",
            ));
        }
        cfg.ignored_keys = ignored;
        cfg.resume_from_checkpoint = resume_requested;
        cfg.chat_template_kwargs = template_kwargs.clone();
        let mut resolved = merged;
        if !reward_tables.is_empty() {
            resolved.insert("rewards".into(), Value::Array(reward_tables));
        }
        if !template_kwargs.is_empty() {
            resolved.insert(
                "chat_template_kwargs".into(),
                Value::Object(template_kwargs),
            );
        }
        cfg.resolved = resolved;
        Ok(cfg)
    }

    /// Checks the rules on the raw values, cross-field ones included, and resolves the
    /// variants; the one place config rules live. Every error names its key.
    fn validate(raw: RawConfig) -> Result<TrainConfig> {
        let bad = |k: &str, msg: String| Err(Error::config(k, msg));
        let per_device = raw.per_device_train_batch_size;
        let accum = raw.gradient_accumulation_steps;
        if raw.forward_chunk_tokens == Some(0) {
            return bad("forward_chunk_tokens", "must be at least 1".into());
        }
        let g = raw.num_generations;
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
        let (gbs, spg) = match (raw.generation_batch_size, raw.steps_per_generation) {
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
        let temperature = raw.temperature;
        if !(temperature > 0.0 && temperature.is_finite()) {
            return bad("temperature", format!("must be > 0, got {temperature}"));
        }
        let top_p = raw.top_p;
        if !(top_p > 0.0 && top_p <= 1.0) {
            return bad("top_p", format!("must be in (0, 1], got {top_p}"));
        }
        let epsilon = raw.epsilon;
        let epsilon_high = raw.epsilon_high.unwrap_or(epsilon);
        for (k, x) in [("epsilon", epsilon), ("epsilon_high", epsilon_high)] {
            if x.is_nan() || x < 0.0 {
                return bad(k, format!("must be >= 0, got {x}"));
            }
        }
        let q = raw.top_entropy_quantile;
        if !(0.0..=1.0).contains(&q) {
            return bad(
                "top_entropy_quantile",
                format!("must be in [0, 1] (1 keeps every token), got {q}"),
            );
        }
        if let Some(t) = raw.off_policy_mask_threshold {
            if !t.is_finite() {
                return bad(
                    "off_policy_mask_threshold",
                    format!("must be finite, got {t}"),
                );
            }
        }
        if raw.use_adaptive_entropy {
            let (lo, hi, d) = (
                raw.entropy_coef_min,
                raw.entropy_coef_max,
                raw.entropy_coef_delta,
            );
            if !(lo >= 0.0 && lo <= hi && hi.is_finite()) {
                return bad(
                    "entropy_coef_min",
                    format!("needs 0 <= entropy_coef_min <= entropy_coef_max, got {lo} and {hi}"),
                );
            }
            if !(d >= 0.0 && d.is_finite()) {
                return bad("entropy_coef_delta", format!("must be >= 0, got {d}"));
            }
        }
        for (k, x) in [
            ("vespo_k_pos", raw.vespo_k_pos),
            ("vespo_lambda_pos", raw.vespo_lambda_pos),
            ("vespo_k_neg", raw.vespo_k_neg),
            ("vespo_lambda_neg", raw.vespo_lambda_neg),
        ] {
            if !x.is_finite() {
                return bad(k, format!("must be finite, got {x}"));
            }
        }
        let (beta, kl_coef) = (raw.beta, raw.kl_coef);
        for (k, x) in [("beta", beta), ("kl_coef", kl_coef)] {
            if !(x >= 0.0 && x.is_finite()) {
                return bad(k, format!("must be >= 0, got {x}"));
            }
        }
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
                    adaptive: raw.kl_target.map(|t| AdaptiveKlCfg {
                        target: t,
                        horizon: raw.kl_horizon,
                    }),
                },
                (false, false) => KlMode::None,
            };
        if raw.kl_target.is_some() && kl_coef == 0.0 {
            return bad(
                "kl_target",
                "the adaptive KL controller needs kl_coef > 0 (its starting value)".into(),
            );
        }
        let lr = raw.learning_rate;
        if !(lr > 0.0 && lr.is_finite()) {
            return bad("learning_rate", format!("must be > 0, got {lr}"));
        }
        if !(0.0..=1.0).contains(&raw.warmup_ratio) {
            return bad(
                "warmup_ratio",
                format!("must be in [0, 1], got {}", raw.warmup_ratio),
            );
        }
        for (k, b) in [
            ("adam_beta1", raw.adam_beta1),
            ("adam_beta2", raw.adam_beta2),
        ] {
            if !(0.0..1.0).contains(&b) {
                return bad(k, format!("must be in [0, 1), got {b}"));
            }
        }
        if raw.max_completion_length == 0 {
            return bad("max_completion_length", "must be at least 1".into());
        }
        if raw.num_iterations == 0 {
            return bad("num_iterations", "must be at least 1".into());
        }
        let task = TaskConfig {
            train_size: raw.task_train_size,
            eval_size: raw.task_eval_size,
            min_operand: raw.task_min_operand,
            max_operand: raw.task_max_operand,
            ops: raw.task_ops,
            seed: raw.task_seed,
            mask_ratio: raw.task_mask_ratio.0,
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
        let lora = match raw.lora_r {
            0 => None,
            r => {
                let alpha = raw.lora_alpha.unwrap_or(2.0 * r as f64);
                if !(alpha > 0.0 && alpha.is_finite()) {
                    return bad("lora.alpha", format!("must be > 0, got {alpha}"));
                }
                let dropout = raw.lora_dropout;
                if !(0.0..1.0).contains(&dropout) {
                    return bad("lora.dropout", format!("must be in [0, 1), got {dropout}"));
                }
                Some(crate::peft::LoraConfig {
                    r,
                    alpha,
                    dropout,
                    target_modules: raw.lora_target_modules,
                    use_rslora: raw.lora_use_rslora,
                })
            }
        };
        if raw.base_quantization.is_some() && lora.is_none() {
            return bad(
                "base_quantization",
                "a quantized base is frozen, so it needs LoRA adapters to train: set lora.r (e.g. --lora.r=16)".into(),
            );
        }
        if lora.is_some() && raw.sync_ref_model {
            return bad(
                "sync_ref_model",
                "with LoRA the reference is the base model with adapters off; it cannot be synced: set sync_ref_model = false".into(),
            );
        }
        if raw.ref_model_sync_steps == 0 {
            return bad("ref_model_sync_steps", "must be at least 1".into());
        }
        let max_steps = match raw.max_steps {
            None | Some(-1) => None,
            Some(n) if n <= 0 => {
                return bad("max_steps", format!("must be positive or -1, got {n}"))
            }
            Some(n) => Some(n as u64),
        };
        if raw.multi_objective_aggregation == RewardAggregation::NormalizeThenSum
            && matches!(kl, KlMode::Reward { .. })
        {
            return bad(
                "multi_objective_aggregation",
                "normalize_then_sum cannot be combined with kl_coef (KL in the reward); use beta \
                 (KL in the loss) instead"
                    .into(),
            );
        }
        // A fill-in run on the user's inputs needs their generator (the built-in task brings
        // one); its reward is checked once the reward tables are read.
        if raw.policy == PolicyType::FillIn && raw.train_file.is_some() && raw.model.is_none() {
            return bad(
                "model",
                "policy = \"fill_in\" with a train_file needs model = the directory of a \
                 masked-LM generator (BERT, RoBERTa or DistilBERT *ForMaskedLM, or one \
                 `grpo pretrain` made)"
                    .into(),
            );
        }
        let masking = match raw.mask_ratio {
            Some(r) if raw.policy == PolicyType::FillIn => Some(Masking {
                ratio: r.0,
                span: raw.mask_span.0,
                seed: raw.mask_seed.unwrap_or(raw.seed),
            }),
            Some(_) => {
                return bad(
                    "mask_ratio",
                    "masks inputs of policy = \"fill_in\"; a causal LM has nothing to mask".into(),
                )
            }
            None if raw.mask_span != SpanLen((1, 1)) || raw.mask_seed.is_some() => {
                let key = match raw.mask_seed.is_some() {
                    true => "mask_seed",
                    false => "mask_span",
                };
                return bad(
                    key,
                    "applies to inputs masked on the fly: set mask_ratio too".into(),
                );
            }
            None => None,
        };
        // The best model: HF's spellings of an eval metric (`eval_accuracy`, `accuracy`) name ours.
        let metric_for_best_model = raw.metric_for_best_model.as_deref().map(|m| {
            if m.contains('/') {
                m.to_string()
            } else {
                format!("eval/{}", m.strip_prefix("eval_").unwrap_or(m))
            }
        });
        let load_best_model_at_end = raw.load_best_model_at_end.unwrap_or(false);
        if load_best_model_at_end {
            if metric_for_best_model.is_none() {
                return bad(
                    "load_best_model_at_end",
                    "needs metric_for_best_model (e.g. \"eval/accuracy\") to know which checkpoint is best".into(),
                );
            }
            if raw.eval_steps == 0 || !raw.save_steps.is_multiple_of(raw.eval_steps) {
                return bad(
                    "load_best_model_at_end",
                    format!(
                        "needs save_steps ({}) to be a multiple of eval_steps ({}), so that every checkpoint has an evaluation",
                        raw.save_steps, raw.eval_steps
                    ),
                );
            }
        }
        // Eval: the ks against the sample count, something to evaluate, the temperature.
        let mut eval_k = raw.eval_k;
        crate::eval::check_ks(&eval_k, raw.eval_num_samples, "eval_k", "eval_num_samples")?;
        eval_k.sort_unstable();
        eval_k.dedup();
        if raw.eval_num_samples == 0 && !raw.eval_greedy {
            return bad(
                "eval_num_samples",
                "0 samples with eval_greedy = false leave nothing to evaluate: set eval_num_samples \
                 above 0 or eval_greedy = true"
                    .into(),
            );
        }
        let eval_temperature = raw.eval_temperature.unwrap_or(temperature);
        if !(eval_temperature >= 0.0 && eval_temperature.is_finite()) {
            return bad(
                "eval_temperature",
                format!("must be >= 0 (0 = greedy), got {eval_temperature}"),
            );
        }
        Ok(TrainConfig {
            policy: raw.policy,
            model: raw.model,
            judge: raw.judge,
            dtype: raw.dtype,
            output_dir: raw.output_dir,
            seed: raw.seed,
            threads: raw.threads.filter(|&n| n > 0),
            device: raw.device,
            kernels: raw.kernels,
            max_steps,
            num_train_epochs: raw.num_train_epochs,
            train_file: raw.train_file,
            eval_file: raw.eval_file,
            prompt_field: raw.prompt_field,
            answer_field: raw.answer_field,
            system_prompt: raw.system_prompt,
            shuffle_dataset: raw.shuffle_dataset,
            skip_bad_rows: raw.skip_bad_rows,
            max_prompt_length: raw.max_prompt_length,
            task,
            masking,
            rewards: vec![],
            reward_weights: raw.reward_weights,
            num_generations: g,
            max_completion_length: raw.max_completion_length,
            temperature,
            top_p,
            top_k: raw.top_k,
            min_p: raw.min_p,
            repetition_penalty: raw.repetition_penalty,
            stop: raw.stop,
            generation_batch_size: gbs,
            steps_per_generation: spg,
            sampling_batch_size: match raw.sampling_batch_size {
                Some(0) => {
                    return bad(
                        "sampling_batch_size",
                        "must be at least 1 (unset: a whole round at once)".into(),
                    )
                }
                other => other,
            },
            per_device_train_batch_size: per_device,
            forward_chunk_tokens: raw.forward_chunk_tokens,
            gradient_accumulation_steps: accum,
            num_iterations: raw.num_iterations,
            learning_rate: lr,
            adam_beta1: raw.adam_beta1,
            adam_beta2: raw.adam_beta2,
            adam_epsilon: raw.adam_epsilon,
            weight_decay: raw.weight_decay,
            max_grad_norm: raw.max_grad_norm,
            lr_scheduler_type: raw.lr_scheduler_type,
            warmup_ratio: raw.warmup_ratio,
            warmup_steps: raw.warmup_steps,
            max_bad_steps: raw.max_bad_steps.max(1),
            save_on_signal: raw.save_on_signal,
            loss_type: raw.loss_type,
            beta,
            epsilon,
            epsilon_high,
            delta: raw.delta,
            importance_sampling_level: raw.importance_sampling_level,
            scale_rewards: raw.scale_rewards,
            mask_truncated_completions: raw.mask_truncated_completions,
            entropy_coef: raw.entropy_coef,
            use_bias_correction_kl: raw.use_bias_correction_kl,
            sapo_temperature_pos: raw.sapo_temperature_pos.unwrap_or(1.0),
            sapo_temperature_neg: raw.sapo_temperature_neg.unwrap_or(1.05),
            vespo: VespoParams {
                k_pos: raw.vespo_k_pos,
                lambda_pos: raw.vespo_lambda_pos,
                k_neg: raw.vespo_k_neg,
                lambda_neg: raw.vespo_lambda_neg,
            },
            top_entropy_quantile: raw.top_entropy_quantile,
            off_policy_mask_threshold: raw.off_policy_mask_threshold,
            adaptive_entropy: raw.use_adaptive_entropy.then_some(AdaptiveEntropy {
                coef: raw.entropy_coef,
                last_entropy: None,
                min: raw.entropy_coef_min,
                max: raw.entropy_coef_max,
                delta: raw.entropy_coef_delta,
                target: raw.entropy_target,
            }),
            reward_std_floor: raw.reward_std_floor,
            multi_objective_aggregation: raw.multi_objective_aggregation,
            normalize_advantages_batch: raw.normalize_advantages_batch,
            drop_zero_std_groups: raw.drop_zero_std_groups,
            kl_coef,
            kl_target: raw.kl_target,
            kl_horizon: raw.kl_horizon,
            kl,
            sync_ref_model: raw.sync_ref_model,
            ref_model_sync_steps: raw.ref_model_sync_steps,
            ref_model_mixup_alpha: raw.ref_model_mixup_alpha,
            logging_steps: raw.logging_steps.0,
            log_completions: raw.log_completions,
            log_completions_steps: raw.log_completions_steps,
            num_completions_to_print: raw.num_completions_to_print,
            save_steps: raw.save_steps,
            save_total_limit: raw.save_total_limit,
            eval_steps: raw.eval_steps,
            eval_num_prompts: raw.eval_num_prompts,
            eval_num_samples: raw.eval_num_samples,
            eval_k,
            eval_temperature,
            eval_greedy: raw.eval_greedy,
            report_to: resolve_report_to(raw.report_to)?,
            run_name: raw.run_name,
            wandb_project: raw.wandb_project,
            lora,
            base_quantization: raw.base_quantization,
            gradient_checkpointing: raw.gradient_checkpointing,
            dynamic_sampling: raw.dynamic_sampling.unwrap_or(false),
            dynamic_sampling_max_passes: raw.dynamic_sampling_max_passes.unwrap_or(4),
            greater_is_better: raw.greater_is_better.unwrap_or_else(|| {
                !metric_for_best_model
                    .as_deref()
                    .is_some_and(|m| m.contains("loss"))
            }),
            metric_for_best_model,
            load_best_model_at_end,
            ignored_keys: vec![],
            resume_from_checkpoint: false,
            chat_template_kwargs: Default::default(),
            resolved: BTreeMap::new(),
        })
    }

    /// Every key of the config as it resolved (defaults included), as `config.toml` has them.
    pub fn resolved(&self) -> &BTreeMap<String, Value> {
        &self.resolved
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
                max_batch_sequences: cfg.sampling_batch_size.unwrap_or(0),
            },
            system_prompt: cfg.system_prompt.clone(),
            max_prompt_length: cfg.max_prompt_length,
        }
    }

    /// Sets `max_completion_length` after loading (`grpo eval --max-new-tokens`), and with it the
    /// default `max_length` of length rewards: the reward tables are parsed again.
    pub fn set_max_completion_length(&mut self, n: usize) -> Result<()> {
        if n == 0 {
            return Err(Error::config("max_completion_length", "must be at least 1"));
        }
        if let Some(Value::Array(tables)) = self.resolved.get("rewards") {
            self.rewards = crate::rewards::parse_specs(tables, n)?;
        }
        self.max_completion_length = n;
        self.resolved
            .insert("max_completion_length".into(), Value::from(n));
        Ok(())
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
        // TRL's bf16 = true trains in f32 on the CPU (listed as ignored), bf16 on a GPU.
        assert_eq!(c.dtype, DTypeOpt::F32);
        assert_eq!(c.prompts_per_step(), 4);
        assert_eq!(c.ignored_keys, vec!["bf16", "use_vllm"]);
        let g = load(y, Format::Yaml, &["--device=cuda"]).unwrap();
        assert_eq!(g.dtype, DTypeOpt::Bf16);
        assert_eq!(g.ignored_keys, vec!["use_vllm"]);
        // The same for the model arguments' torch_dtype.
        let t = load("torch_dtype: bfloat16\n", Format::Yaml, &[]).unwrap();
        assert_eq!(
            (t.dtype, t.ignored_keys),
            (DTypeOpt::F32, vec!["torch_dtype".to_string()])
        );
        let t = load(
            "torch_dtype: bfloat16\n",
            Format::Yaml,
            &["--device=cuda:1"],
        )
        .unwrap();
        assert_eq!((t.dtype, t.ignored_keys.len()), (DTypeOpt::Bf16, 0));
        let t = load("torch_dtype: float32\n", Format::Yaml, &[]).unwrap();
        assert_eq!((t.dtype, t.ignored_keys.len()), (DTypeOpt::F32, 0));
        assert!(c.gradient_checkpointing, "a real key now");
        assert!(c.report_to.is_empty());
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
        // A bare flag is true: grpo's own booleans, and TRL's (use_peft turns LoRA on).
        let c = load("", Format::Toml, &["--save_on_signal=false", "--use_peft"]).unwrap();
        assert!(!c.save_on_signal && c.lora.is_some());
        let c = load(
            "save_on_signal = false",
            Format::Toml,
            &["--save_on_signal"],
        )
        .unwrap();
        assert!(c.save_on_signal);
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
            ("loss_type = \"ppo\"", "loss_type"),
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

    #[test]
    fn reward_tables_are_checked_when_the_config_is_read() {
        let c = load(
            "max_completion_length = 40\n[[rewards]]\nkind = \"length\"\n\
             [[rewards]]\nkind = \"command\"\ncommand = \"python3 score.py\"\nname = \"mine\"\n",
            Format::Toml,
            &[],
        )
        .unwrap();
        use crate::rewards::{rules::Length, RewardKind};
        assert_eq!(c.rewards.len(), 2);
        // The default max_length of a length reward is the config's max_completion_length.
        assert_eq!(
            c.rewards[0].kind,
            RewardKind::Length(Length::Overlong {
                max_length: 40,
                cache: 10
            })
        );
        assert_eq!(
            (c.rewards[1].name.as_str(), c.rewards[1].path.as_str()),
            ("mine", "rewards[1]")
        );
        // Nothing is started while the config is read: the scorer program need not exist.
        assert!(
            matches!(&c.rewards[1].kind, RewardKind::Command(s) if s.command == ["python3", "score.py"])
        );
        for (text, want) in [
            (
                "[[rewards]]\nkind = \"answer_match\"\n[[rewards]]\nkind = \"answer_matc\"\n",
                &["rewards[1].kind", "did you mean `answer_match`"][..],
            ),
            (
                "[[rewards]]\nkind = \"format\"\npatern = \"x\"\n",
                &["rewards[0].patern", "did you mean `pattern`"],
            ),
            (
                "[[rewards]]\nkind = \"composite\"\n[rewards.quality]\nkind = \"judge\"\nmode = \"x\"\n",
                &["rewards[0].quality.mode"],
            ),
            (
                "[[rewards]]\nkind = \"classifier\"\n",
                &["rewards[0].model", "missing"],
            ),
            (
                "[[rewards]]\nkind = \"judge\"\nmode = \"expected_score\"\nscores = [\"1\", \"2\"]\nscore_values = [1.0]\n",
                &["rewards[0].score_values", "1 values for 2 score tokens"],
            ),
            (
                "[[rewards]]\nkind = \"diversity\"\n[[rewards]]\nkind = \"diversity\"\n",
                &["rewards[1].name"],
            ),
        ] {
            let e = load(text, Format::Toml, &[]).unwrap_err().to_string();
            for w in want {
                assert!(e.contains(w), "{text}: {e}");
            }
        }
    }

    #[test]
    fn a_new_completion_budget_moves_the_length_default() {
        use crate::rewards::{rules::Length, RewardKind};
        let mut c = load(
            "max_completion_length = 40\n[[rewards]]\nkind = \"length\"\n\
             [[rewards]]\nkind = \"length\"\nmax_length = 8\nname = \"fixed\"\n",
            Format::Toml,
            &[],
        )
        .unwrap();
        c.set_max_completion_length(100).unwrap();
        assert_eq!(c.max_completion_length, 100);
        let lengths: Vec<&RewardKind> = c.rewards.iter().map(|r| &r.kind).collect();
        assert_eq!(
            lengths,
            [
                &RewardKind::Length(Length::Overlong {
                    max_length: 100,
                    cache: 25
                }),
                &RewardKind::Length(Length::Overlong {
                    max_length: 8,
                    cache: 2
                })
            ]
        );
        assert!(c.to_toml().contains("max_completion_length = 100\n"));
        assert!(c.set_max_completion_length(0).is_err());
    }

    #[test]
    fn kernels_key_parses_and_stays_out_of_the_toml_when_unset() {
        use crate::kernels::Kernels;
        let c = load("", Format::Toml, &[]).unwrap();
        assert_eq!(c.kernels, None);
        assert!(!c.to_toml().lines().any(|l| l.starts_with("kernels")));
        for (v, want) in [("portable", Kernels::Portable), ("auto", Kernels::Fused)] {
            let c = load(&format!("kernels = \"{v}\""), Format::Toml, &[]).unwrap();
            assert_eq!(c.kernels, Some(want));
            assert!(c.to_toml().contains(&format!("kernels = \"{v}\"")));
        }
        let c = load("", Format::Toml, &["--kernels=portable"]).unwrap();
        assert_eq!(c.kernels, Some(Kernels::Portable));
        let e = load("kernels = \"gpu\"", Format::Toml, &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("`kernels`") && e.contains("portable"), "{e}");
    }

    #[test]
    fn device_key_parses_and_stays_out_of_the_toml_when_unset() {
        let c = load("", Format::Toml, &[]).unwrap();
        assert_eq!(c.device, DeviceSpec::Cpu);
        assert!(!c.to_toml().lines().any(|l| l.starts_with("device")));
        assert!(c.device.device().unwrap().is_cpu());
        for (v, want) in [
            ("cpu", DeviceSpec::Cpu),
            ("cuda", DeviceSpec::Cuda(0)),
            ("cuda:1", DeviceSpec::Cuda(1)),
        ] {
            let c = load(&format!("device = \"{v}\""), Format::Toml, &[]).unwrap();
            assert_eq!(c.device, want);
            assert!(c
                .to_toml()
                .lines()
                .any(|l| l == format!("device = \"{v}\"")));
        }
        let c = load("", Format::Toml, &["--device=cuda:2"]).unwrap();
        assert_eq!(c.device, DeviceSpec::Cuda(2));
        for bad in ["\"tpu\"", "\"cuda:x\"", "\"cuda1\"", "1"] {
            let e = load(&format!("device = {bad}"), Format::Toml, &[])
                .unwrap_err()
                .to_string();
            assert!(e.contains("`device`"), "{bad}: {e}");
        }
        #[cfg(not(feature = "cuda"))]
        {
            let e = DeviceSpec::Cuda(0).device().unwrap_err().to_string();
            assert!(
                e.contains("`device`") && e.contains("--features cuda"),
                "{e}"
            );
        }
    }

    #[test]
    fn ignored_trl_keys_are_not_keys() {
        for k in ignored_trl_keys() {
            assert!(
                !KEYS.iter().any(|d| d.key == k),
                "{k} is a key and in IGNORED"
            );
        }
        for k in ["report_to", "gradient_checkpointing"] {
            assert!(
                KEYS.iter().any(|d| d.key == k) && !ignored_trl_keys().contains(&k),
                "{k}"
            );
        }
        let c = load(
            "report_to = [\"jsonl\"]\ngradient_checkpointing = true\nfp16 = false",
            Format::Toml,
            &[],
        )
        .unwrap();
        assert_eq!(c.ignored_keys, vec!["fp16"]);
        assert!(c.gradient_checkpointing && c.report_to.is_empty());
    }

    #[test]
    fn kinds_come_from_the_declared_types() {
        let kind = |key: &str| {
            reference()
                .into_iter()
                .find(|k| k.key == key)
                .map(|k| k.kind)
                .unwrap()
        };
        assert_eq!(
            kind("loss_type"),
            "grpo|bnpo|dr_grpo|dapo|cispo|sapo|luspo|vespo"
        );
        assert_eq!(kind("scale_rewards"), "group|batch|none");
        assert_eq!(kind("base_quantization"), "none|q4_0|q4_1|nf4|q8_0");
        assert_eq!(kind("output_dir"), "path");
        assert_eq!(kind("eval_k"), "list of int");
        assert_eq!(kind("task.ops"), "list of \"+\" \"-\" \"*\"");
        assert_eq!(kind("device"), "cpu|cuda|cuda:N");
        let keys: Vec<&str> = KEYS.iter().map(|k| k.key).collect();
        let mut unique = keys.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), keys.len(), "a key is declared twice");
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
        let files = ["default", "trl", "rewards", "lora", "overrides"];
        for (((name, text, f, o), want), file) in
            golden_cases().into_iter().zip(expected).zip(files)
        {
            let c = TrainConfig::from_str(text, f, name, &o).unwrap();
            let got = c.to_toml();
            // A deliberate change: GRPO_BLESS=1 rewrites the pinned files (review the diff).
            if std::env::var_os("GRPO_BLESS").is_some() {
                let path = Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join(format!("testdata/to_toml/{file}.expected.toml"));
                std::fs::write(path, &got).unwrap();
                continue;
            }
            assert!(got == want, "{name}: to_toml changed:\n{got}");
            // And it loads back to the same config.
            let c2 = TrainConfig::from_str(&got, Format::Toml, name, &[]).unwrap();
            assert_eq!(c2.to_toml(), got, "{name}");
        }
    }

    #[test]
    fn policy_fill_in_alone_loads_the_embedded_fill_in_run() {
        let c = TrainConfig::load(None, &["--policy=fill_in".to_string()]).unwrap();
        assert_eq!(c.policy, PolicyType::FillIn);
        assert_eq!(c.task.mask_ratio, (0.1, 0.5));
        assert_eq!((c.temperature, c.top_p, c.beta), (0.8, 0.95, 0.1));
        assert!(c.model.is_none() && c.train_file.is_none());
        // The causal default is unchanged; bad ratios name the key.
        assert_eq!(
            TrainConfig::load(None, &[]).unwrap().policy,
            PolicyType::CausalLm
        );
        for bad in ["0", "0.5..0.2", "x", "0.2..1.5"] {
            let e = TrainConfig::load(
                None,
                &[
                    "--policy=fill_in".into(),
                    format!("--task.mask_ratio={bad}"),
                ],
            )
            .unwrap_err()
            .to_string();
            assert!(e.contains("task.mask_ratio"), "{bad}: {e}");
        }
        let c = TrainConfig::load(
            None,
            &["--policy=fill_in".into(), "--task.mask_ratio=0.3".into()],
        )
        .unwrap();
        assert_eq!(c.task.mask_ratio, (0.3, 0.3));
    }

    #[test]
    fn trl_generation_and_template_kwargs_map_onto_grpo() {
        let y = "generation_kwargs:\n  temperature: 0.7\n  top_k: 20\n  max_new_tokens: 64\n  \
                 do_sample: true\nchat_template_kwargs:\n  enable_thinking: false\n\
                 num_generations_eval: 6\n";
        let c = load(y, Format::Yaml, &[]).unwrap();
        assert_eq!(
            (c.temperature, c.top_k, c.max_completion_length),
            (0.7, 20, 64)
        );
        assert_eq!(c.eval_num_samples, 6);
        assert_eq!(
            c.chat_template_kwargs["enable_thinking"],
            Value::Bool(false)
        );
        // Into config.toml and back.
        let back = TrainConfig::from_str(&c.to_toml(), Format::Toml, "t", &[]).unwrap();
        assert_eq!(back.chat_template_kwargs, c.chat_template_kwargs);
        let e = load("generation_kwargs:\n  num_beams: 4\n", Format::Yaml, &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("generation_kwargs.num_beams"), "{e}");
    }

    #[test]
    fn the_seeds_ppo_era_names_work() {
        for k in ["cliprange", "clip_eps", "clip_range"] {
            let c = load(&format!("{k} = 0.1\n"), Format::Toml, &[]).unwrap();
            assert_eq!(c.epsilon, 0.1, "{k}");
        }
        let c = load(
            "save_freq = 5\ninit_kl_coef = 0.05\ntarget_kl = 6.0\nhorizon = 5000\n",
            Format::Toml,
            &[],
        )
        .unwrap();
        assert_eq!(c.save_steps, 5);
        let KlMode::Reward { coef, adaptive } = c.kl else {
            panic!("{:?}", c.kl)
        };
        assert_eq!(coef, 0.05);
        let a = adaptive.unwrap();
        assert_eq!((a.target, a.horizon), (6.0, 5000.0));
        // TRL PPOConfig's adap_kl_ctrl: on with its default target, or off (a fixed coef).
        let c = load(
            "init_kl_coef = 0.2\nadap_kl_ctrl = true\n",
            Format::Toml,
            &[],
        )
        .unwrap();
        assert!(matches!(c.kl, KlMode::Reward { adaptive: Some(a), .. } if a.target == 6.0));
        let c = load(
            "init_kl_coef = 0.2\nadap_kl_ctrl = false\ntarget_kl = 3.0\ngen_batch_size = 8\n",
            Format::Toml,
            &[],
        )
        .unwrap();
        assert!(matches!(c.kl, KlMode::Reward { adaptive: None, coef } if coef == 0.2));
        assert_eq!(c.sampling_batch_size, Some(8));
    }

    #[test]
    fn the_fill_in_seeds_names_work() {
        let c = load(
            "policy = \"fill_in\"\ngenerator_checkpoint = \"gen\"\njudge_checkpoint = \"judge\"\n\
             group_size = 16\nkl_beta = 0.2\nout_dir = \"out-grpo\"\nsave_interval = 7\n\
             eval_interval = 7\nlearning_rate = 5e-6\nper_device_train_batch_size = 32\n",
            Format::Toml,
            &[],
        )
        .unwrap();
        assert_eq!(c.model.as_deref(), Some("gen"));
        assert_eq!(c.judge.as_deref(), Some(Path::new("judge")));
        assert_eq!((c.num_generations, c.beta), (16, 0.2));
        assert_eq!(c.output_dir, PathBuf::from("out-grpo"));
        assert_eq!((c.save_steps, c.eval_steps), (7, 7));
        // On the command line too, as the seed's README runs it.
        let c = TrainConfig::load(
            None,
            &[
                "--policy=fill_in".into(),
                "--group_size=16".into(),
                "--kl_beta=0.2".into(),
                "--learning_rate=5e-6".into(),
            ],
        )
        .unwrap();
        assert_eq!(
            (c.num_generations, c.beta, c.learning_rate),
            (16, 0.2, 5e-6)
        );
        // The example config with the seed's defaults loads.
        let c = load(
            include_str!("../../../examples/configs/fill_in.toml"),
            Format::Toml,
            &["--group_size=16", "--kl_beta=0.2"],
        )
        .unwrap();
        assert_eq!(c.policy, PolicyType::FillIn);
        assert_eq!(
            (c.num_generations, c.beta, c.temperature, c.top_p),
            (16, 0.2, 0.8, 0.95)
        );
        assert_eq!(c.lr_scheduler_type, LrSchedule::Cosine);
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

    #[test]
    fn best_model_and_dynamic_sampling_keys() {
        // The embedded default keeps its best checkpoint by held-out accuracy.
        let d = TrainConfig::load(None, &[]).unwrap();
        assert_eq!(d.metric_for_best_model.as_deref(), Some("eval/accuracy"));
        assert!(d.greater_is_better && !d.load_best_model_at_end);
        // TRL's defaults: off.
        let load = |o: &[&str]| {
            let o: Vec<String> = o.iter().map(|s| s.to_string()).collect();
            TrainConfig::from_str("", Format::Toml, "empty", &o)
        };
        let c = load(&[]).unwrap();
        assert!(
            !c.dynamic_sampling && c.metric_for_best_model.is_none() && !c.load_best_model_at_end
        );
        assert_eq!(c.dynamic_sampling_max_passes, 4);
        // HF's spellings name the eval metric; a loss is lower-is-better unless told.
        for (given, want) in [
            ("eval_accuracy", "eval/accuracy"),
            ("accuracy", "eval/accuracy"),
            ("eval/pass@4", "eval/pass@4"),
        ] {
            let c = load(&[&format!("--metric_for_best_model={given}")]).unwrap();
            assert_eq!(c.metric_for_best_model.as_deref(), Some(want));
            assert!(c.greater_is_better);
        }
        assert!(
            !load(&["--metric_for_best_model=loss"])
                .unwrap()
                .greater_is_better
        );
        let e = load(&["--load_best_model_at_end=true"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("load_best_model_at_end") && e.contains("metric_for_best_model"),
            "{e}"
        );
        let e = load(&[
            "--load_best_model_at_end=true",
            "--metric_for_best_model=eval/accuracy",
            "--save_steps=7",
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("multiple of eval_steps"), "{e}");
        // Unset keys stay out of the resolved config, so older runs resolve as before.
        assert!(!c.to_toml().contains("dynamic_sampling"));
    }
}

#[cfg(test)]
mod trl_keys {
    use super::*;

    /// Every key of TRL 1.16's GRPOConfig (TrainingArguments included) and of `trl grpo`'s
    /// script and model arguments, as `scripts/dump_trl_keys.py` wrote them.
    fn trl_keys() -> Vec<(String, String, Value)> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/trl/keys.json");
        let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        v["keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| {
                (
                    k["key"].as_str().unwrap().to_string(),
                    k["origin"].as_str().unwrap().to_string(),
                    k["default"].clone(),
                )
            })
            .collect()
    }

    /// The key table of docs/config.md: every TRL key and what grpo does with it.
    fn trl_table() -> String {
        let mut out = String::from("| key | TRL class | in grpo |\n| --- | --- | --- |\n");
        for (key, origin, _) in trl_keys() {
            let what = match trl_key(&key) {
                Some(TrlKey::Key) => "implemented".to_string(),
                Some(TrlKey::Alias(to)) => format!("read as `{to}`"),
                Some(TrlKey::Mapped(how)) => how.to_string(),
                Some(TrlKey::Ignored(why)) => format!("ignored (warned): {why}"),
                None => "unknown".to_string(),
            };
            out.push_str(&format!("| `{key}` | {origin} | {what} |\n"));
        }
        out
    }

    /// docs/config.md lists every TRL key with its status, as [`trl_table`] makes it
    /// (GRPO_BLESS=1 rewrites the table there).
    #[test]
    fn docs_list_every_trl_key() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/config.md");
        let doc = std::fs::read_to_string(&path).unwrap();
        let (begin, end) = ("<!-- trl-keys:begin -->\n", "<!-- trl-keys:end -->");
        let i = doc
            .find(begin)
            .expect("docs/config.md has the trl-keys markers")
            + begin.len();
        let j = doc.find(end).unwrap();
        let table = trl_table();
        if std::env::var_os("GRPO_BLESS").is_some() {
            std::fs::write(&path, format!("{}{table}{}", &doc[..i], &doc[j..])).unwrap();
            return;
        }
        assert!(
            doc[i..j] == table,
            "docs/config.md's TRL key table is stale: rerun with GRPO_BLESS=1"
        );
        assert!(!table.contains("| unknown |"));
    }

    #[test]
    fn every_trl_key_loads_at_its_default() {
        let mut bad = vec![];
        for (key, origin, default) in trl_keys() {
            let mut doc = serde_json::Map::new();
            doc.insert(key.clone(), default.clone());
            let yaml = serde_yaml::to_string(&Value::Object(doc)).unwrap();
            if let Err(e) = TrainConfig::from_str(&yaml, Format::Yaml, "trl.yaml", &[]) {
                bad.push(format!("{key} ({origin}) = {default}: {e}"));
            }
        }
        assert!(
            bad.is_empty(),
            "{} keys fail:\n{}",
            bad.len(),
            bad.join("\n")
        );
    }
}
