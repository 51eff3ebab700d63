//! The training configuration: a TOML or YAML file plus `--key=value` overrides, resolved once
//! into a validated [`TrainConfig`] made of its sections ([`Run`], [`Data`], [`Generation`],
//! [`Update`], [`Lora`], [`Loss`], [`Logging`]).
//!
//! Option names follow TRL's `GRPOConfig` (and HF `TrainingArguments`) where TRL has the option,
//! so the GRPO keys of a TRL YAML config work as they are. Keys TRL/HF have that do not apply here
//! (`bf16`-style switches we resolve differently, vLLM and distributed settings, hub uploads) are
//! accepted and listed in [`TrainConfig::ignored_keys`] ([`ignored_trl_keys`] lists them all); any
//! other unknown key is an error that suggests the nearest known one. TRL's translation lives in
//! `trl.rs`.
//!
//! Every key is declared once, in `sections.rs`: its section, type, default and help. Resolution:
//! every key starts at its default, the file's values replace defaults, overrides replace both;
//! serde reads each section from the merged values (errors name the key and the expected type),
//! and `TrainConfig::validate` checks the rules that span keys. The `[[rewards]]` tables are
//! parsed into [`RewardSpec`]s at the same time, so a reward typo fails here, not after the model
//! loaded.

mod rules;
mod sections;
mod trl;
mod values;

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::Device;
use serde_json::Value;

use crate::eval::{
    check_correctness_reward, BatchBound, Correctness, EvalOptions, CORRECTNESS_THRESHOLD,
    MAX_BATCH_COMPLETIONS,
};
use crate::rewards::RewardSpec;
use crate::{Error, Result};

use sections::{is_key, suggest, Sections, KEYS};
pub use sections::{
    reference, Agent, Data, Generation, KeyDoc, Logging, Lora, Loss, Run, TaskConfig, Update,
};
pub use trl::{
    ignore_reason, ignored_trl_keys, trl_builtin_reward, trl_key, TrlKey, DEFAULT_DIFFERENCES,
};
pub use values::{DTypeOpt, DeviceSpec, MaskRatio, PolicyType, SaveStrategy, SpanLen};

/// The embedded default run (`grpo train` with no arguments).
pub const DEFAULT_CONFIG: &str = include_str!("../../configs/default.toml");
/// The embedded fill-in run: `grpo train --policy=fill_in` with nothing else.
pub const FILL_IN_CONFIG: &str = include_str!("../../configs/fill_in.toml");

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Toml,
    Yaml,
}

impl DeviceSpec {
    /// `auto` made definite: GPU 0 when this build has CUDA and it answers, else the CPU (the
    /// others are themselves).
    pub fn resolve(self) -> DeviceSpec {
        match self {
            DeviceSpec::Auto => {
                match candle_core::utils::cuda_is_available() && Device::new_cuda(0).is_ok() {
                    true => DeviceSpec::Cuda(0),
                    false => DeviceSpec::Cpu,
                }
            }
            spec => spec,
        }
    }

    /// Whether the spec names a GPU (a config value, not a device: nothing is opened).
    pub fn names_a_gpu(self) -> bool {
        matches!(self, DeviceSpec::Cuda(_))
    }

    /// The candle device; an error naming the `device` key when this build has no CUDA or the
    /// GPU cannot be opened.
    pub fn device(&self) -> Result<Device> {
        match *self {
            DeviceSpec::Auto => self.resolve().device(),
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
                let dev = Device::new_cuda(n).map_err(|e| {
                    Error::config(
                        "device",
                        format!(
                            "`{self}` is not available ({e}); set device to a GPU this machine \
                             has, or to \"cpu\""
                        ),
                    )
                })?;
                // Freed memory stays in CUDA's pool for the next pass's tensors (PyTorch's
                // caching allocator does the same); GRPO_CUDA_POOL=release hands it back, =trim
                // at the end of each phase of a step.
                if grpo_models::kernels::CudaPool::from_env()
                    != grpo_models::kernels::CudaPool::Release
                {
                    grpo_models::kernels::keep_device_pool(&dev)?;
                }
                grpo_models::kernels::untracked_device(&dev);
                Ok(dev)
            }
        }
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

/// The validated training configuration: the sections as their keys resolved (docs in
/// [`reference()`]), and what is resolved across them.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainConfig {
    pub run: Run,
    pub data: Data,
    pub generation: Generation,
    pub update: Update,
    pub lora: Lora,
    pub loss: Loss,
    pub logging: Logging,
    pub agent: Agent,
    /// Completions per generation round: `generation_batch_size`, else
    /// per_device_train_batch_size x steps_per_generation.
    pub generation_batch_size: usize,
    /// Micro-batches per generation round: `steps_per_generation`, else from
    /// `generation_batch_size`, else gradient_accumulation_steps.
    pub steps_per_generation: usize,
    /// `policy = "fill_in"` with `mask_ratio`: inputs masked on the fly.
    pub masking: Option<Masking>,
    /// The `[[rewards]]` tables, parsed and checked (built into rewards by
    /// [`crate::inputs::config_rewards`]); empty: the built-in task's rewards.
    pub rewards: Vec<RewardSpec>,
    /// TRL/HF keys that were given and are ignored here.
    pub ignored_keys: Vec<String>,
    /// A config written for TRL that leaves some of grpo's differing defaults
    /// ([`DEFAULT_DIFFERENCES`]) unset: those keys, warned about at the start of the run.
    pub trl_defaults_relied_on: Vec<&'static str>,
    /// TRL's `resume_from_checkpoint = true`: resume as `--resume` does.
    pub resume_from_checkpoint: bool,
    /// Extra chat-template variables (TRL's `chat_template_kwargs`, e.g. `enable_thinking`).
    pub chat_template_kwargs: serde_json::Map<String, Value>,
    /// The merged values of every key (and the `[[rewards]]` tables as given), for
    /// [`Self::to_toml`].
    resolved: BTreeMap<String, Value>,
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
                serde_yaml_ng::from_str(text)
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
pub(super) fn parse_override_value(raw: &str) -> Value {
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
        let trl_style = trl::names_trl_keys(&doc, format == Format::Yaml);
        Self::from_doc(doc, trl_style, origin, overrides, &[])
    }

    /// The fields of a Python `GRPOConfig` (TRL's names, read as a TRL YAML's keys are: one key
    /// table; an unknown field is an error naming it). `host_rewards` are the names of the
    /// rewards the host computes (`correctness_reward` may name one).
    pub fn from_fields(
        fields: serde_json::Map<String, Value>,
        host_rewards: &[String],
    ) -> Result<TrainConfig> {
        let mut doc = BTreeMap::new();
        flatten("", Value::Object(fields), &mut doc);
        Self::from_doc(doc, true, "GRPOConfig", &[], host_rewards)
    }

    fn from_doc(
        doc: BTreeMap<String, Value>,
        trl_style: bool,
        origin: &str,
        overrides: &[String],
        host_rewards: &[String],
    ) -> Result<TrainConfig> {
        trl::Translation::check_doc(&doc)?;
        let mut given = std::collections::BTreeSet::new();
        let mut merged: BTreeMap<String, Value> = KEYS
            .iter()
            .filter(|k| !k.default.is_empty())
            .map(|k| (k.key.to_string(), parse_override_value(k.default)))
            .collect();
        let mut trl = trl::Translation::default();
        let mut reward_tables = vec![];
        let mut apply = |k: String, v: Value, from: &str| -> Result<()> {
            let Some((k, v)) = trl.apply(&mut merged, k, v, from)? else {
                return Ok(());
            };
            if k == "rewards" {
                reward_tables = match v {
                    Value::Array(a) => a,
                    other => {
                        return Err(Error::config(
                            "rewards",
                            values::expected("a list of [[rewards]] tables", &other),
                        ))
                    }
                };
            } else if is_key(&k) {
                trl.answer_field_given |= k == "answer_field";
                given.insert(k.clone());
                merged.insert(k, v);
            } else {
                return Err(Error::config(
                    &k,
                    format!("unknown key in {from}{}", suggest(&k)),
                ));
            }
            Ok(())
        };
        for (k, v) in doc {
            apply(k, v, origin)?;
        }
        for (k, v) in parse_overrides(overrides)? {
            apply(k, v, "the command line")?;
        }
        trl.finish(&mut merged, &mut reward_tables)?;
        let mut cfg = Self::validate(Sections::read(&merged)?)?;
        cfg.rewards =
            crate::rewards::parse_specs(&reward_tables, cfg.generation.max_completion_length)?;
        cfg.check_correctness_reward(host_rewards)?;
        if cfg.run.policy == PolicyType::FillIn
            && cfg.data.train_file.is_some()
            && cfg.run.judge.is_none()
            && cfg.rewards.is_empty()
        {
            return Err(Error::config(
                "judge",
                "policy = \"fill_in\" with a train_file needs a reward: judge = a classifier \
                 directory (e.g. one `grpo pretrain --objective judge` made) or [[rewards]] tables",
            ));
        }
        cfg.ignored_keys = std::mem::take(&mut trl.ignored);
        cfg.trl_defaults_relied_on = trl::defaults_relied_on(trl_style, &given);
        cfg.resume_from_checkpoint = trl.resume_requested;
        cfg.chat_template_kwargs = trl.template_kwargs.clone();
        let mut resolved = merged;
        if !reward_tables.is_empty() {
            resolved.insert("rewards".into(), Value::Array(reward_tables));
        }
        if !trl.template_kwargs.is_empty() {
            resolved.insert(
                "chat_template_kwargs".into(),
                Value::Object(std::mem::take(&mut trl.template_kwargs)),
            );
        }
        cfg.resolved = resolved;
        Ok(cfg)
    }

    /// Checks the rules that span keys (a key's own type checks its value; the rules are in
    /// `rules.rs`, one function per section, called here in turn), resolves what depends on
    /// several keys, and normalizes a few values in place. Every error names its key.
    fn validate(s: Sections) -> Result<TrainConfig> {
        let Sections {
            mut run,
            data,
            generation: gen,
            mut update,
            lora,
            loss,
            mut logging,
            agent,
        } = s;
        let (gbs, spg) = rules::batch_sizes(&gen, &update)?;
        rules::adaptive_entropy(&loss)?;
        rules::generation(&gen)?;
        rules::kl(&loss)?;
        rules::data(&data)?;
        rules::lora(&lora, &loss)?;
        rules::aggregation(&loss)?;
        rules::agent(&agent)?;
        rules::fill_in_policy(&run, &data, &lora, &update)?;
        rules::zero_stage(&run, &lora, &update)?;
        let masking = rules::masking(&run, &data)?;
        rules::logging(&mut logging)?;
        run.threads = run.threads.filter(|&n| n > 0);
        update.max_bad_steps = update.max_bad_steps.max(1);
        Ok(TrainConfig {
            run,
            data,
            generation: gen,
            update,
            lora,
            loss,
            logging,
            agent,
            generation_batch_size: gbs,
            steps_per_generation: spg,
            masking,
            rewards: vec![],
            ignored_keys: vec![],
            trl_defaults_relied_on: vec![],
            resume_from_checkpoint: false,
            chat_template_kwargs: Default::default(),
            resolved: BTreeMap::new(),
        })
    }

    /// Every key of the config as it resolved (defaults included), secrets included: what the
    /// run uses. What leaves the process is [`Self::redacted`].
    pub fn resolved(&self) -> &BTreeMap<String, Value> {
        &self.resolved
    }

    /// [`Self::resolved`] with its secrets replaced by `"<redacted>"`: every value of a reward's
    /// `headers` and `env`, and any string under a key named like a secret (`api_key`,
    /// `hf_token`, `password`, `secret`, ...). This is what `config.toml` (in the run directory
    /// and every checkpoint), the trackers' run config and the report show.
    pub fn redacted(&self) -> BTreeMap<String, Value> {
        self.resolved
            .iter()
            .map(|(k, v)| (k.clone(), redact(k, v)))
            .collect()
    }

    /// This config's eval settings (`eval_num_samples`, `eval_k`, `eval_greedy`,
    /// `eval_num_prompts`, `eval_temperature` and the other sampling keys, `seed`,
    /// `system_prompt`, `max_prompt_length`).
    pub fn eval_options(&self, eos_token_ids: Vec<u32>) -> EvalOptions {
        let l = &self.logging;
        let mut sampling = self.generation.sampling(eos_token_ids);
        sampling.temperature = self.eval_temperature();
        EvalOptions {
            num_samples: l.eval_num_samples,
            ks: l.eval_k.clone(),
            greedy: l.eval_greedy,
            num_prompts: l.eval_num_prompts,
            seed: self.run.seed,
            sampling,
            system_prompt: self.data.system_prompt.clone(),
            max_prompt_length: self.data.max_prompt_length,
            correctness: l.correctness_reward.clone().map(|reward| Correctness {
                reward,
                threshold: l.correctness_threshold.unwrap_or(CORRECTNESS_THRESHOLD),
            }),
            batch: self.eval_batch_bound(),
        }
    }

    /// What bounds evaluation's sampling calls: a training pass's activations
    /// (`forward_chunk_tokens`, 1024 when unset: the CPU's default; training gives the size it
    /// resolved), at least a round's completions, at most 64 or `sampling_batch_size`.
    pub fn eval_batch_bound(&self) -> BatchBound {
        let cap = self.generation.sampling_batch_size.unwrap_or(usize::MAX);
        BatchBound {
            pass_tokens: self
                .update
                .forward_chunk_tokens
                .unwrap_or(crate::logprobs::DEFAULT_FORWARD_CHUNK_TOKENS),
            gradient_checkpointing: self.update.gradient_checkpointing,
            round: self.generation_batch_size.min(cap),
            max: MAX_BATCH_COMPLETIONS.min(cap),
        }
    }

    /// `correctness_reward` names one of the run's rewards (the `[[rewards]]` and `reward_funcs`,
    /// else the built-in task's; a tool environment's are known once it starts, and checked
    /// then); `correctness_threshold` needs it.
    fn check_correctness_reward(&self, host_rewards: &[String]) -> Result<()> {
        let (l, a) = (&self.logging, &self.agent);
        let Some(name) = &l.correctness_reward else {
            return match l.correctness_threshold {
                Some(_) => Err(Error::config(
                    "correctness_threshold",
                    "needs correctness_reward: the reward whose score it bounds",
                )),
                None => Ok(()),
            };
        };
        let environment = a.environment_factory.is_some()
            || !a.environment_command.is_empty()
            || a.environment_url.is_some();
        let names: Vec<String> = match (
            self.rewards.is_empty() && host_rewards.is_empty(),
            self.run.policy,
        ) {
            (false, _) => self
                .rewards
                .iter()
                .map(|r| r.name.clone())
                .chain(host_rewards.iter().cloned())
                .collect(),
            (true, PolicyType::CausalLm) => crate::rewards::builtin_task_rewards()
                .into_iter()
                .map(|r| r.name)
                .collect(),
            // A fill-in run's built-in rewards are built with its judge: checked at the eval.
            (true, PolicyType::FillIn) => return Ok(()),
        };
        if environment && !names.contains(name) {
            return Ok(());
        }
        let names = names.iter().map(String::as_str);
        check_correctness_reward(name, names, "correctness_reward").map(|_| ())
    }

    /// `eval_temperature`, or `temperature` when unset.
    pub fn eval_temperature(&self) -> f64 {
        self.logging
            .eval_temperature
            .unwrap_or(self.generation.temperature)
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
        self.generation.max_completion_length = n;
        self.resolved
            .insert("max_completion_length".into(), Value::from(n));
        Ok(())
    }

    /// Prompts per generation round.
    pub fn prompts_per_step(&self) -> usize {
        self.generation_batch_size / self.generation.num_generations
    }

    /// The resolved config as TOML (every key that has a value), loadable by [`Self::load`].
    pub fn to_toml(&self) -> String {
        let mut root = toml::Table::new();
        let mut task = toml::Table::new();
        let mut lora = toml::Table::new();
        for (k, v) in &self.redacted() {
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
        // Cannot fail: every value is a toml::Value converted from the resolved JSON (null and
        // anything TOML cannot hold were left out above), under string keys. Were it to, the
        // file says so instead of being written empty.
        toml::to_string(&root)
            .unwrap_or_else(|e| format!("# grpo could not write this config as TOML: {e}\n"))
    }
}

#[cfg(test)]
mod tests;

/// What replaces a secret in everything grpo writes.
pub const REDACTED: &str = "<redacted>";

/// Whether a key names a secret: `password`, `secret`, `credentials`, `apikey`, or a `key` /
/// `token` qualified as one (`api_key`, `access_key`, `hf_token`, `auth_token`, ...), not a
/// tokenizer's `pad_token` or a length in tokens.
pub fn secret_like(key: &str) -> bool {
    let lower = key.to_ascii_lowercase();
    let segs: Vec<&str> = lower.split(['_', '-', '.']).collect();
    let plain = [
        "secret",
        "secrets",
        "password",
        "passwd",
        "credential",
        "credentials",
        "apikey",
    ];
    let qualifier = [
        "api", "access", "auth", "hub", "hf", "wandb", "private", "secret", "bearer", "session",
    ];
    lower == "token"
        || segs.iter().any(|s| plain.contains(s))
        || segs
            .windows(2)
            .any(|w| qualifier.contains(&w[0]) && matches!(w[1], "key" | "token"))
}

/// `v` (under key `k`) with its secrets replaced ([`TrainConfig::redacted`]).
fn redact(k: &str, v: &Value) -> Value {
    let hide_all = |v: &Value| match v {
        Value::Object(m) => Value::Object(
            m.keys()
                .map(|name| (name.clone(), Value::String(REDACTED.into())))
                .collect(),
        ),
        _ => Value::String(REDACTED.into()),
    };
    match v {
        Value::String(_) if secret_like(k) => Value::String(REDACTED.into()),
        Value::Object(m) => Value::Object(
            m.iter()
                .map(|(name, x)| {
                    let x = match name.as_str() {
                        "headers" | "env" => hide_all(x),
                        _ => redact(name, x),
                    };
                    (name.clone(), x)
                })
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(|x| redact(k, x)).collect()),
        other => other.clone(),
    }
}
