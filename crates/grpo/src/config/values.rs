//! Reading one merged value as a key's type: the conversions serde's own would refuse, kept
//! because the command line needs them (a number given as a string, a comma-separated list, -1
//! for an unset optional integer), and the config's small value types. Every section field is
//! read through [`lenient`]; the error is the message alone, the section reader adds the key.

use std::borrow::Cow;
use std::path::PathBuf;

use serde::{Deserialize, Deserializer};
use serde_json::Value;

use crate::advantages::{RewardAggregation, ScaleRewards};
use crate::loss::{IsLevel, LossType};
use crate::named::Named;
use crate::optim::{LrSchedule, ZeroStage};
use grpo_models::models::QuantType;

type Res<T> = std::result::Result<T, String>;

/// A type a key's merged value is read as (`None`: unset).
pub(super) trait FromValue: Sized {
    /// What the key accepts, for `grpo config --print`.
    fn kind() -> Cow<'static, str>;
    fn from_value(v: Option<&Value>) -> Res<Self>;
}

/// serde's `deserialize_with` for every section field: null is unset.
pub(super) fn lenient<'de, D: Deserializer<'de>, T: FromValue>(d: D) -> Result<T, D::Error> {
    let v = Value::deserialize(d)?;
    T::from_value(Some(&v).filter(|v| !v.is_null())).map_err(serde::de::Error::custom)
}

pub(super) fn expected(want: &str, got: &Value) -> String {
    format!("expected {want}, got {got}")
}

fn required<T>(v: Option<T>) -> Res<T> {
    v.ok_or_else(|| "is required".to_string())
}

/// The `Option<T>` reader of a type whose unset value is an error.
macro_rules! required_from_optional {
    ($($t:ty),*) => {$(
        impl FromValue for $t {
            fn kind() -> Cow<'static, str> {
                Option::<$t>::kind()
            }
            fn from_value(v: Option<&Value>) -> Res<Self> {
                required(Option::<$t>::from_value(v)?)
            }
        }
    )*};
}
required_from_optional!(f64, i64, bool, String);

impl FromValue for Option<f64> {
    fn kind() -> Cow<'static, str> {
        "float".into()
    }
    fn from_value(v: Option<&Value>) -> Res<Self> {
        match v {
            None => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(Value::String(s)) => s
                .parse()
                .map(Some)
                .map_err(|_| expected("a number", &Value::String(s.clone()))),
            Some(v) => Err(expected("a number", v)),
        }
    }
}

impl FromValue for Option<i64> {
    fn kind() -> Cow<'static, str> {
        "int".into()
    }
    fn from_value(v: Option<&Value>) -> Res<Self> {
        match v {
            None => Ok(None),
            Some(Value::Number(n)) => n
                .as_i64()
                .or_else(|| n.as_f64().filter(|f| f.fract() == 0.0).map(|f| f as i64))
                .map(Some)
                .ok_or_else(|| expected("an integer", &Value::Number(n.clone()))),
            Some(v) => Err(expected("an integer", v)),
        }
    }
}

/// A non-negative integer; -1 means unset.
impl FromValue for Option<usize> {
    fn kind() -> Cow<'static, str> {
        "int".into()
    }
    fn from_value(v: Option<&Value>) -> Res<Self> {
        match Option::<i64>::from_value(v)? {
            None | Some(-1) => Ok(None),
            Some(n) if n < 0 => Err(format!("must be >= 0, got {n}")),
            Some(n) => Ok(Some(n as usize)),
        }
    }
}

impl FromValue for usize {
    fn kind() -> Cow<'static, str> {
        "int".into()
    }
    fn from_value(v: Option<&Value>) -> Res<Self> {
        Option::<usize>::from_value(v)?.ok_or_else(|| "must be a non-negative integer".into())
    }
}

impl FromValue for u64 {
    fn kind() -> Cow<'static, str> {
        "int".into()
    }
    fn from_value(v: Option<&Value>) -> Res<Self> {
        usize::from_value(v).map(|n| n as u64)
    }
}

/// A positive count; -1 means unset (`max_steps`).
impl FromValue for Option<u64> {
    fn kind() -> Cow<'static, str> {
        "int".into()
    }
    fn from_value(v: Option<&Value>) -> Res<Self> {
        match Option::<i64>::from_value(v)? {
            None | Some(-1) => Ok(None),
            Some(n) if n <= 0 => Err(format!("must be positive or -1, got {n}")),
            Some(n) => Ok(Some(n as u64)),
        }
    }
}

impl FromValue for Option<bool> {
    fn kind() -> Cow<'static, str> {
        "bool".into()
    }
    fn from_value(v: Option<&Value>) -> Res<Self> {
        match v {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(expected("true or false", v)),
        }
    }
}

impl FromValue for Option<String> {
    fn kind() -> Cow<'static, str> {
        "string".into()
    }
    fn from_value(v: Option<&Value>) -> Res<Self> {
        match v {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(expected("a string", v)),
        }
    }
}

impl FromValue for Option<PathBuf> {
    fn kind() -> Cow<'static, str> {
        "path".into()
    }
    fn from_value(v: Option<&Value>) -> Res<Self> {
        Ok(Option::<String>::from_value(v)?.map(PathBuf::from))
    }
}

impl FromValue for PathBuf {
    fn kind() -> Cow<'static, str> {
        "path".into()
    }
    fn from_value(v: Option<&Value>) -> Res<Self> {
        String::from_value(v).map(PathBuf::from)
    }
}

/// A list, or (from the command line) a comma-separated string.
impl FromValue for Vec<String> {
    fn kind() -> Cow<'static, str> {
        "list of string".into()
    }
    fn from_value(v: Option<&Value>) -> Res<Self> {
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
                        .ok_or_else(|| expected("a list of strings", v))
                })
                .collect(),
            Some(v) => Err(expected("a list of strings", v)),
        }
    }
}

/// A list of non-negative integers, one integer, or (from the command line) `1,4,8`.
impl FromValue for Vec<usize> {
    fn kind() -> Cow<'static, str> {
        "list of int".into()
    }
    fn from_value(v: Option<&Value>) -> Res<Self> {
        let want = "a list of non-negative integers";
        let one = |v: &Value| -> Res<usize> {
            match v {
                Value::Number(n) => n.as_u64().map(|x| x as usize),
                Value::String(s) => s.trim().parse().ok(),
                _ => None,
            }
            .ok_or_else(|| expected(want, v))
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
            Some(v) => Err(expected(want, v)),
        }
    }
}

impl FromValue for Option<Vec<f64>> {
    fn kind() -> Cow<'static, str> {
        "list of float".into()
    }
    fn from_value(v: Option<&Value>) -> Res<Self> {
        match v {
            None => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_f64().ok_or_else(|| expected("a list of numbers", v)))
                .collect::<Res<Vec<_>>>()
                .map(Some),
            Some(v) => Err(expected("a list of numbers", v)),
        }
    }
}

/// One of `options` by name; the error lists them.
fn choice<T: Copy>(v: Option<&Value>, options: &[(&str, T)]) -> Res<T> {
    crate::named::parse_choice(&String::from_value(v)?, options)
}

fn names<T: Named>() -> String {
    T::NAMES
        .iter()
        .map(|(n, _)| *n)
        .collect::<Vec<_>>()
        .join("|")
}

/// Enums chosen by their config name ([`crate::named`]); `$unset`: the variant when unset.
macro_rules! named_values {
    ($($t:ty $(= $unset:expr)?),*) => {$(
        impl FromValue for $t {
            fn kind() -> Cow<'static, str> {
                names::<$t>().into()
            }
            fn from_value(v: Option<&Value>) -> Res<Self> {
                $(if v.is_none() {
                    return Ok($unset);
                })?
                choice(v, <$t>::NAMES)
            }
        }
    )*};
}
// Unset policy: a causal LM (so older configs resolve as before).
named_values!(
    LossType,
    IsLevel,
    LrSchedule,
    RewardAggregation,
    SaveStrategy,
    PolicyType = PolicyType::CausalLm
);

/// `zero_stage`: 0, 1, 2 or 3.
impl FromValue for ZeroStage {
    fn kind() -> Cow<'static, str> {
        "0|1|2|3".into()
    }
    fn from_value(v: Option<&Value>) -> Res<Self> {
        match Option::<i64>::from_value(v)? {
            None => Ok(ZeroStage::Off),
            Some(n) => ZeroStage::from_number(n),
        }
    }
}

/// A name, or TRL's booleans: true = group, false = none.
impl FromValue for ScaleRewards {
    fn kind() -> Cow<'static, str> {
        names::<ScaleRewards>().into()
    }
    fn from_value(v: Option<&Value>) -> Res<Self> {
        match v {
            Some(Value::Bool(true)) => Ok(ScaleRewards::Group),
            Some(Value::Bool(false)) => Ok(ScaleRewards::None),
            _ => choice(v, ScaleRewards::NAMES),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DTypeOpt {
    F32,
    Bf16,
    /// bf16 where the device computes it faster than f32 (a GPU; a CPU with bf16 products,
    /// AVX512_BF16 or AMX), else f32. Resolved once, when a run starts (`train::setup::resolve_dtype`).
    Auto,
}

impl DTypeOpt {
    /// The models' compute dtype (parameters, AdamW's moments and the loss stay f32). `Auto` is
    /// resolved before any model is built; unresolved it means f32.
    pub fn compute(self) -> candle_core::DType {
        match self {
            DTypeOpt::F32 | DTypeOpt::Auto => candle_core::DType::F32,
            DTypeOpt::Bf16 => candle_core::DType::BF16,
        }
    }

    /// What `auto` resolves to: bf16 on a GPU, and on a CPU whose bf16 products (grpo's fused
    /// kernels, measured `rates` = (bf16, f32) GFLOP/s) run at least 1.25x its f32 ones; f32
    /// elsewhere, and for policies that do not use bf16 (`mixed_precision = false`). Other values
    /// are kept.
    pub fn resolve(self, mixed_precision: bool, on_gpu: bool, rates: Option<(f64, f64)>) -> Self {
        match self {
            DTypeOpt::Auto if !mixed_precision => DTypeOpt::F32,
            DTypeOpt::Auto if on_gpu => DTypeOpt::Bf16,
            DTypeOpt::Auto => match rates {
                Some((bf16, f32)) if bf16 >= 1.25 * f32 => DTypeOpt::Bf16,
                _ => DTypeOpt::F32,
            },
            d => d,
        }
    }
}

impl FromValue for DTypeOpt {
    fn kind() -> Cow<'static, str> {
        "f32|bf16|auto".into()
    }
    fn from_value(v: Option<&Value>) -> Res<Self> {
        choice(
            v,
            &[
                ("f32", DTypeOpt::F32),
                ("float32", DTypeOpt::F32),
                ("bf16", DTypeOpt::Bf16),
                ("bfloat16", DTypeOpt::Bf16),
                ("auto", DTypeOpt::Auto),
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
    fn from_value(v: Option<&Value>) -> Res<Self> {
        choice(v, QUANT_CHOICES)
    }
}

crate::named::named_enum! {
    /// When checkpoints are written (`save_strategy`, TRL's names).
    pub enum SaveStrategy {
        /// Every `save_steps` steps, at the end, and when the run is asked to stop.
        Steps = "steps",
        /// The same (grpo's checkpoints are step-based; an epoch's end is not one of them).
        Epoch = "epoch",
        /// The same, the best by `metric_for_best_model` kept as with `steps`.
        Best = "best",
        /// Never: no checkpoint, so the trained model is not saved.
        No = "no",
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

/// Where training runs (`device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// A GPU when this build has CUDA and one answers (GPU 0; under a launcher, the rank's),
    /// else the CPU (unset: this).
    #[default]
    Auto,
    Cpu,
    /// A CUDA GPU by ordinal (`cuda` is `cuda:0`).
    Cuda(usize),
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::Auto => write!(f, "auto"),
            DeviceSpec::Cpu => write!(f, "cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl std::str::FromStr for DeviceSpec {
    type Err = String;
    /// `auto`, `cpu`, `cuda` (GPU 0) or `cuda:N`.
    fn from_str(s: &str) -> Res<Self> {
        let bad = || format!("`{s}` is not a device: use auto, cpu, cuda or cuda:N");
        match s {
            "auto" => Ok(DeviceSpec::Auto),
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            _ => match s.strip_prefix("cuda:") {
                Some(n) => n.parse().map(DeviceSpec::Cuda).map_err(|_| bad()),
                None => Err(bad()),
            },
        }
    }
}

/// Unset: `auto`.
impl FromValue for DeviceSpec {
    fn kind() -> Cow<'static, str> {
        "auto|cpu|cuda|cuda:N".into()
    }
    fn from_value(v: Option<&Value>) -> Res<Self> {
        Option::<String>::from_value(v)?.map_or(Ok(DeviceSpec::Auto), |s| s.parse())
    }
}

/// Unset: the process's setting (`GRPO_KERNELS`, else fused).
impl FromValue for Option<grpo_models::kernels::Kernels> {
    fn kind() -> Cow<'static, str> {
        "auto|fused|portable".into()
    }
    fn from_value(v: Option<&Value>) -> Res<Self> {
        Option::<String>::from_value(v)?
            .map(|s| grpo_models::kernels::Kernels::parse(&s).map_err(|e| e.to_string()))
            .transpose()
    }
}

/// A ratio, or a range `LO..HI` drawn per example / per span, from a number or a string.
fn range<T: std::str::FromStr + Copy>(
    v: &Value,
    num: impl Fn(&serde_json::Number) -> Option<T>,
    bad: &dyn Fn() -> String,
) -> Res<(T, T)> {
    let parse = |t: &str| t.trim().parse::<T>().map_err(|_| bad());
    match v {
        Value::Number(n) => num(n).map(|x| (x, x)).ok_or_else(bad),
        Value::String(s) => match s.split_once("..") {
            Some((a, b)) => Ok((parse(a)?, parse(b)?)),
            None => parse(s).map(|x| (x, x)),
        },
        _ => Err(bad()),
    }
}

/// A mask ratio or a range `LO..HI` drawn per example; unset: 0.1..0.5.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MaskRatio(pub (f64, f64));

impl FromValue for MaskRatio {
    fn kind() -> Cow<'static, str> {
        "ratio or \"LO..HI\"".into()
    }
    fn from_value(v: Option<&Value>) -> Res<Self> {
        let bad =
            || "must be a ratio in (0, 1] or a range \"LO..HI\" with 0 < LO <= HI <= 1".into();
        let Some(v) = v else {
            return Ok(MaskRatio((0.1, 0.5)));
        };
        let (lo, hi) = range(v, serde_json::Number::as_f64, &bad)?;
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
    fn from_value(v: Option<&Value>) -> Res<Self> {
        v.map(|v| MaskRatio::from_value(Some(v))).transpose()
    }
}

/// A span length in tokens or a range `LO..HI` drawn per span; unset: 1.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpanLen(pub (usize, usize));

impl FromValue for SpanLen {
    fn kind() -> Cow<'static, str> {
        "length or \"LO..HI\"".into()
    }
    fn from_value(v: Option<&Value>) -> Res<Self> {
        let bad = || "must be a span length >= 1 or a range \"LO..HI\" with 1 <= LO <= HI".into();
        let Some(v) = v else {
            return Ok(SpanLen((1, 1)));
        };
        let (lo, hi) = range(v, |n| n.as_u64().map(|l| l as usize), &bad)?;
        if !(lo >= 1 && lo <= hi) {
            return Err(bad());
        }
        Ok(SpanLen((lo, hi)))
    }
}

/// `report_to` as TRL spells it, checked: `all` is TensorBoard, W&B and MLflow (Trackio only
/// when named: it needs its package), `none` (alone) none;
/// `jsonl` is accepted (metrics.jsonl is always written). Unknown values are errors naming them.
pub(super) fn resolve_report_to(values: &[String]) -> Res<Vec<String>> {
    let mut out: Vec<String> = Vec::new();
    for v in values {
        match v.as_str() {
            "tensorboard" | "wandb" | "mlflow" | "trackio" => out.push(v.clone()),
            "all" => out.extend(["tensorboard", "wandb", "mlflow"].map(String::from)),
            "none" | "jsonl" => {}
            other => {
                return Err(format!(
                    "unknown value `{other}`: use tensorboard, wandb, mlflow, trackio, all or \
                     none (metrics.jsonl is always written)"
                ))
            }
        }
    }
    out.dedup();
    out.sort();
    out.dedup();
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Rules on one key's value (`check` in the key table); the reader adds the key to the message.

/// `Err(msg)` unless `ok`.
fn rule(ok: bool, msg: impl FnOnce() -> String) -> Res<()> {
    if ok {
        Ok(())
    } else {
        Err(msg())
    }
}

pub(super) fn reward_errors(v: &String) -> Res<()> {
    rule(matches!(v.as_str(), "raise" | "missing"), || {
        format!("`{v}`: use \"raise\" (stop the run) or \"missing\" (lose the batch's scores)")
    })
}

pub(super) fn at_least_one(n: &usize) -> Res<()> {
    rule(*n >= 1, || "must be at least 1".into())
}

pub(super) fn at_least_one_when_set(n: &Option<usize>) -> Res<()> {
    n.as_ref().map_or(Ok(()), at_least_one)
}

pub(super) fn whole_groups_when_set(n: &Option<usize>) -> Res<()> {
    rule(*n != Some(0), || {
        "must be at least 1 (unset: a whole round at once)".into()
    })
}

pub(super) fn group_size(g: &usize) -> Res<()> {
    rule(*g >= 2, || {
        format!("must be at least 2 (a group of {g} has no relative advantage)")
    })
}

/// Greater than 0 and finite.
pub(super) fn positive(x: &f64) -> Res<()> {
    rule(*x > 0.0 && x.is_finite(), || {
        format!("must be > 0, got {x}")
    })
}

/// Unset, or greater than 0 and finite.
pub(super) fn positive_when_set(x: &Option<f64>) -> Res<()> {
    x.as_ref().map_or(Ok(()), positive)
}

/// At least 1 and finite (a multiple of a count that must not shrink it).
pub(super) fn at_least_one_f(x: &f64) -> Res<()> {
    rule(*x >= 1.0 && x.is_finite(), || {
        format!("must be >= 1, got {x}")
    })
}

/// At least 0 and finite.
pub(super) fn non_negative(x: &f64) -> Res<()> {
    rule(*x >= 0.0 && x.is_finite(), || {
        format!("must be >= 0, got {x}")
    })
}

/// At least 0 (infinity allowed: no clipping on that side).
pub(super) fn not_negative(x: &f64) -> Res<()> {
    rule(!(x.is_nan() || *x < 0.0), || {
        format!("must be >= 0, got {x}")
    })
}

pub(super) fn not_negative_when_set(x: &Option<f64>) -> Res<()> {
    x.as_ref().map_or(Ok(()), not_negative)
}

pub(super) fn finite(x: &f64) -> Res<()> {
    rule(x.is_finite(), || format!("must be finite, got {x}"))
}

pub(super) fn finite_when_set(x: &Option<f64>) -> Res<()> {
    x.as_ref().map_or(Ok(()), finite)
}

/// In (0, 1].
pub(super) fn probability(p: &f64) -> Res<()> {
    rule(*p > 0.0 && *p <= 1.0, || {
        format!("must be in (0, 1], got {p}")
    })
}

/// In [0, 1].
pub(super) fn unit_interval(x: &f64) -> Res<()> {
    rule((0.0..=1.0).contains(x), || {
        format!("must be in [0, 1], got {x}")
    })
}

pub(super) fn quantile(q: &f64) -> Res<()> {
    rule((0.0..=1.0).contains(q), || {
        format!("must be in [0, 1] (1 keeps every token), got {q}")
    })
}

/// In [0, 1).
pub(super) fn adam_beta(b: &f64) -> Res<()> {
    rule((0.0..1.0).contains(b), || {
        format!("must be in [0, 1), got {b}")
    })
}

pub(super) fn greedy_or_positive(t: &Option<f64>) -> Res<()> {
    t.map_or(Ok(()), |t| {
        rule(t >= 0.0 && t.is_finite(), || {
            format!("must be >= 0 (0 = greedy), got {t}")
        })
    })
}

pub(super) fn task_ops(ops: &Vec<String>) -> Res<()> {
    let known = |o: &String| ["+", "-", "*"].contains(&o.as_str());
    rule(!ops.is_empty() && ops.iter().all(known), || {
        format!("{ops:?}: use a list of \"+\", \"-\", \"*\"")
    })
}
