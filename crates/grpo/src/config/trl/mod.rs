//! TRL's (and PEFT's, HF `TrainingArguments`', the seeds') keys: aliases of grpo's keys, keys
//! read with their own rule (mapped), and keys accepted and ignored with their reason. A config
//! document's keys go through [`Translation::apply`] first; what it leaves is grpo's own.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::sections::{is_key, suggest};
use super::values::{expected, DeviceSpec};
use crate::{Error, Result};

mod keys;

use keys::ALIASES;
pub use keys::{
    defaults_relied_on, ignore_reason, ignored_trl_keys, names_trl_keys, trl_key, TrlKey,
    DEFAULT_DIFFERENCES,
};

/// The rewards of `trl grpo`'s `reward_funcs` names, as `[[rewards]]` tables; and whether one
/// reads the `solution` column.
fn trl_reward_funcs(v: &Value) -> Result<(Vec<Value>, bool)> {
    let names: Vec<String> = match v {
        // One name, or several from the command line (`--reward_funcs a b` arrives as "a,b").
        Value::String(s) => s.split(',').map(|x| x.trim().to_string()).collect(),
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
        let t = match trl_builtin_reward(&name) {
            Some((t, reads_solution)) => {
                solution |= reads_solution;
                t
            }
            // A Python function, as `trl grpo` takes it: `my_rewards.correctness` or
            // `path/to/file.py:correctness`, served by grpo's adapter (kind = "python").
            None if name.contains('.') || name.contains(':') => {
                crate::rewards::command::python_target(&name)
                    .map_err(|m| Error::config("reward_funcs", m))?;
                serde_json::json!({"kind": "python", "function": name})
            }
            None => {
                return Err(Error::config(
                    "reward_funcs",
                    format!(
                        "`{name}` is not one of TRL's rewards: accuracy_reward, \
                         reasoning_accuracy_reward, think_format_reward, \
                         get_soft_overlong_punishment, or a Python function as \
                         my_rewards.{name} or path/to/file.py:{name} (or give [[rewards]] \
                         tables)"
                    ),
                ))
            }
        };
        tables.push(t);
    }
    Ok((tables, solution))
}

/// One of TRL's built-in rewards by name, as a `[[rewards]]` table of grpo's rules, and whether
/// it reads the `solution` column; None for any other name.
pub fn trl_builtin_reward(name: &str) -> Option<(Value, bool)> {
    let t = match name {
        "accuracy_reward" => {
            return Some((
                serde_json::json!({"kind": "answer_match", "name": name, "extract": "boxed"}),
                true,
            ))
        }
        "reasoning_accuracy_reward" => {
            return Some((
                serde_json::json!({"kind": "answer_match", "name": name, "extract": "boxed",
                                   "after": "</think>"}),
                true,
            ))
        }
        "think_format_reward" => serde_json::json!({"kind": "think_format", "name": name}),
        // `trl grpo`'s fixed arguments.
        "get_soft_overlong_punishment" => serde_json::json!({
            "kind": "length", "name": "soft_overlong_punishment_reward",
            "max_length": 1280, "cache_length": 256}),
        _ => return None,
    };
    Some((t, false))
}

/// The file of split `split` of TRL's `dataset_name` (in configuration `config`, TRL's
/// `dataset_config`, when given): the name itself when it is a file; in a directory, the files
/// the hub's layout puts there (`{split}.jsonl|.json|.parquet|.csv|.txt`, or the split's parquet
/// shards, read together through a `*` pattern: [`grpo_models::hub::dataset_split_in`]); else a
/// hub id, whose split is fetched into the hub cache.
fn dataset_split_file(name: &str, split: &str, config: Option<&str>) -> Result<String> {
    let p = Path::new(name);
    if p.is_file() {
        if let Some(c) = config {
            return Err(Error::config(
                "dataset_config",
                format!("`{c}`: dataset_name {name} is one file, which has no configurations"),
            ));
        }
        return Ok(name.to_string());
    }
    if p.is_dir() {
        let files = files_below(p, 3);
        let names: Vec<&str> = files.iter().map(String::as_str).collect();
        let found = grpo_models::hub::dataset_split_in(&names, name, split, config)
            .map_err(|e| Error::config("dataset_name", e.to_string()))?;
        let paths: Vec<PathBuf> = found.iter().map(|f| p.join(f)).collect();
        let path = grpo_models::hub::split_path(&paths, split).ok_or_else(|| {
            Error::config(
                "dataset_name",
                format!("{name}: no file for split `{split}`"),
            )
        })?;
        return Ok(path.display().to_string());
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
    let path = grpo_models::hub::fetch_dataset_split(name, split, config)
        .map_err(|e| Error::config("dataset_name", e.to_string()))?;
    Ok(path.display().to_string())
}

/// The files under `dir`, as `/`-separated paths relative to it, at most `depth` directories
/// down (a dataset's `config/data/split-*.parquet`).
fn files_below(dir: &Path, depth: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![(dir.to_path_buf(), String::new(), 0)];
    while let Some((d, rel, level)) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let Some(n) = e.file_name().to_str().map(str::to_string) else {
                continue;
            };
            let r = if rel.is_empty() {
                n
            } else {
                format!("{rel}/{n}")
            };
            match e.path().is_dir() {
                true if level < depth => stack.push((e.path(), r, level + 1)),
                true => {}
                false => out.push(r),
            }
        }
    }
    out.sort();
    out
}

fn type_err(key: &str, want: &str, got: &Value) -> Error {
    Error::config(key, expected(want, got))
}

/// TRL's `generation_kwargs`: those that map onto the sampler are set as its keys (they win, as
/// in TRL), the rest are refused by name.
fn generation_kwargs(merged: &mut BTreeMap<String, Value>, v: Value) -> Result<()> {
    let Value::Object(m) = v else {
        return Err(type_err(
            "generation_kwargs",
            "a table of generation options",
            &v,
        ));
    };
    for (g, gv) in m {
        let key = match g.as_str() {
            "temperature" | "top_p" | "top_k" | "min_p" | "repetition_penalty" => g.clone(),
            "max_new_tokens" => "max_completion_length".into(),
            "stop_strings" | "stop" => "stop".into(),
            "do_sample" if gv == Value::Bool(true) => continue,
            other => {
                return Err(Error::config(
                    format!("generation_kwargs.{other}"),
                    "not a sampling option grpo has: give temperature, top_p, top_k, min_p, \
                     repetition_penalty, max_new_tokens, stop_strings (or do_sample = true)",
                ))
            }
        };
        merged.insert(key, gv);
    }
    Ok(())
}

/// TRL's `resume_from_checkpoint`: true resumes (as --resume); a path is refused with how.
fn resume(v: Value) -> Result<bool> {
    match v {
        Value::Bool(b) => Ok(b),
        other => Err(Error::config(
            "resume_from_checkpoint",
            format!(
                "{other}: grpo resumes from the newest checkpoint in output_dir: set \
                 resume_from_checkpoint = true (or pass --resume) with output_dir = the run's \
                 directory"
            ),
        )),
    }
}

/// TRL's keys whose other values grpo does not have: another model revision, DoRA, modules to
/// save, target parameters, another optimizer. Refused with what to do instead.
fn refuse_unsupported(k: &str, v: &Value) -> Result<()> {
    let set = match v {
        Value::Bool(b) => *b,
        Value::Array(a) => !a.is_empty(),
        _ => true,
    };
    let msg = match k {
        "model_revision" if *v != Value::String("main".into()) => format!(
            "{v}: grpo loads a hub model's main revision; download the revision you want and \
             give its directory as model"
        ),
        "optim" if !v.as_str().is_some_and(|o| o.starts_with("adamw")) => format!(
            "{v}: grpo's optimizer is AdamW (set adam_beta1, adam_beta2, adam_epsilon, \
             weight_decay); give an adamw_* value or leave it unset"
        ),
        "use_dora" if set => "DoRA adapters are not supported: use LoRA (use_peft = true)".into(),
        "lora_modules_to_save" if set => {
            "grpo trains adapters on projections only; leave it unset".into()
        }
        "lora_target_parameters" if set => {
            "give the projections by name in lora_target_modules".into()
        }
        _ => return Ok(()),
    };
    Err(Error::config(k, msg))
}

/// What TRL's keys said, collected while the documents are merged and applied at the end.
#[derive(Default)]
pub(super) struct Translation {
    /// TRL/HF keys given that are ignored here.
    pub ignored: Vec<String>,
    /// TRL's `bf16 = true`: bf16 on a GPU, `auto` on the CPU, see MAPPED.
    trl_bf16: bool,
    torch_dtype: Option<String>,
    dtype_given: bool,
    wandb_log: bool,
    /// `dataset_name`, `dataset_train_split`, `dataset_test_split`, `dataset_config`.
    script: BTreeMap<String, String>,
    pub resume_requested: bool,
    pub template_kwargs: serde_json::Map<String, Value>,
    rewards: Vec<Value>,
    reward_model: Option<Value>,
    needs_solution: bool,
    pub answer_field_given: bool,
    adaptive_kl: Option<bool>,
}

impl Translation {
    /// TRL asked for half precision (`bf16 = true`, or a half `torch_dtype`).
    fn wants_half(&self) -> bool {
        self.trl_bf16
            || self
                .torch_dtype
                .as_deref()
                .is_some_and(|t| matches!(t, "bfloat16" | "bf16" | "float16" | "fp16" | "half"))
    }

    /// Refuses a document that sets both TRL's `bf16 = true` and grpo's `dtype`.
    pub fn check_doc(doc: &BTreeMap<String, Value>) -> Result<()> {
        if doc.get("bf16") == Some(&Value::Bool(true)) && doc.contains_key("dtype") {
            return Err(Error::config(
                "bf16",
                "give either `bf16 = true` or `dtype`, not both",
            ));
        }
        Ok(())
    }

    /// Reads TRL's key `k` (an alias becomes its grpo key). Returns the key and value when they
    /// are left for the caller (grpo's own keys, `rewards`, unknown keys); `None` when consumed.
    pub fn apply(
        &mut self,
        merged: &mut BTreeMap<String, Value>,
        k: String,
        v: Value,
        from: &str,
    ) -> Result<Option<(String, Value)>> {
        if k == "torch_dtype" {
            // Like `bf16`: decided in `finish`, once the device is known.
            self.torch_dtype = v.as_str().map(str::to_string);
            return Ok(None);
        }
        let k = ALIASES
            .iter()
            .find(|(a, _)| *a == k)
            .map_or(k, |(_, to)| to.to_string());
        self.dtype_given |= k == "dtype";
        if v.is_null() {
            // YAML's `key: null` (TRL's dumps have many): unset, the default stays.
            return match trl_key(&k) {
                Some(_) => Ok(None),
                None if k == "rewards" || k == "wandb_log" => Ok(None),
                None => Err(Error::config(
                    &k,
                    format!("unknown key in {from}{}", suggest(&k)),
                )),
            };
        }
        if k == "logging_steps" && v.as_f64().is_some_and(|f| f > 0.0 && f < 1.0) {
            // TRL's ratio of the total steps.
            return Err(Error::config(
                &k,
                "a ratio of total steps is not supported: give a whole number of steps",
            ));
        }
        match k.as_str() {
            // TRL's switch: LoRA with its default rank 16 unless lora_r says otherwise.
            "use_peft" => {
                if v == Value::Bool(true)
                    && !merged.get("lora.r").is_some_and(|r| r != &Value::from(0))
                {
                    merged.insert("lora.r".into(), Value::from(16));
                }
            }
            // TRL passes these to generate(); those that map onto the sampler are set as its
            // keys (they win, as in TRL), the rest are refused by name.
            "generation_kwargs" => generation_kwargs(merged, v)?,
            "dataset_name" | "dataset_train_split" | "dataset_test_split" | "dataset_config" => {
                let text = match &v {
                    Value::String(t) => t.clone(),
                    other => return Err(type_err(&k, "a string", other)),
                };
                self.script.insert(k, text);
            }
            "chat_template_kwargs" => {
                let Value::Object(m) = v else {
                    return Err(type_err(&k, "a table of chat-template variables", &v));
                };
                self.template_kwargs = m;
            }
            "resume_from_checkpoint" => self.resume_requested = resume(v)?,
            "load_in_4bit" | "load_in_8bit" => {
                if v == Value::Bool(true) {
                    let q = if k == "load_in_4bit" { "nf4" } else { "q8_0" };
                    merged.insert("base_quantization".into(), Value::String(q.into()));
                    self.ignored.push(k);
                }
            }
            "model_revision"
            | "use_dora"
            | "lora_modules_to_save"
            | "lora_target_parameters"
            | "optim" => refuse_unsupported(&k, &v)?,
            // A later value replaces an earlier one (the command line the file's), as for
            // every list key and as in TRL.
            "reward_funcs" => {
                let (tables, solution) = trl_reward_funcs(&v)?;
                self.rewards = tables;
                self.needs_solution = solution;
            }
            "reward_model_name_or_path" => {
                let Some(path) = v.as_str() else {
                    return Err(type_err(&k, "a model directory", &v));
                };
                // TRL scores prompt + completion with the model's first logit.
                self.reward_model = Some(serde_json::json!({
                    "kind": "classifier", "name": "reward_model", "model": path,
                    "input": "joined", "label": 0, "output": "logit"}));
            }
            "adap_kl_ctrl" => self.adaptive_kl = Some(v == Value::Bool(true)),
            // The seeds' switch: W&B beside what report_to already names.
            "wandb_log" => self.wandb_log = v == Value::Bool(true),
            "bf16" => self.trl_bf16 = v == Value::Bool(true),
            _ if !is_key(&k) && matches!(trl_key(&k), Some(TrlKey::Ignored(_))) => {
                self.ignored.push(k)
            }
            _ => return Ok(Some((k, v))),
        }
        Ok(None)
    }

    /// Applies what TRL's keys said once every document is merged; `reward_tables` are the
    /// `[[rewards]]` given, TRL's rewards come before them.
    pub fn finish(
        &mut self,
        merged: &mut BTreeMap<String, Value>,
        reward_tables: &mut Vec<Value>,
    ) -> Result<()> {
        // `trl grpo`'s rewards come first (its reward model, then its functions), as TRL orders
        // them; TRL's accuracy rewards read the `solution` column.
        if self.reward_model.is_some() || !self.rewards.is_empty() {
            let mut all: Vec<Value> = self.reward_model.take().into_iter().collect();
            all.append(&mut self.rewards);
            all.append(reward_tables);
            *reward_tables = all;
        }
        match self.adaptive_kl {
            Some(true) if !merged.contains_key("kl_target") => {
                merged.insert("kl_target".into(), Value::from(6.0));
            }
            Some(false) => {
                merged.remove("kl_target");
            }
            _ => {}
        }
        if self.needs_solution && !self.answer_field_given {
            merged.insert("answer_field".into(), Value::String("solution".into()));
        }
        // `dataset_name`: a local dataset file, a directory holding its splits, or a hub id.
        if let Some(name) = self.script.get("dataset_name") {
            let config = self.script.get("dataset_config").map(String::as_str);
            let train_split = self
                .script
                .get("dataset_train_split")
                .map_or("train", String::as_str);
            if !merged.contains_key("train_file") {
                merged.insert(
                    "train_file".into(),
                    Value::String(dataset_split_file(name, train_split, config)?),
                );
            }
            if let (Some(test), false) = (
                self.script.get("dataset_test_split"),
                merged.contains_key("eval_file"),
            ) {
                merged.insert(
                    "eval_file".into(),
                    Value::String(dataset_split_file(name, test, config)?),
                );
            }
        }
        if self.script.contains_key("dataset_config") && !self.script.contains_key("dataset_name") {
            return Err(Error::config(
                "dataset_config",
                "names a configuration of dataset_name, which is not given",
            ));
        }
        if self.wandb_log {
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
        // `device` unset or `auto`: a GPU when this build has CUDA and one answers (probed only
        // when TRL's half-precision keys ask).
        let on_gpu = match merged.get("device") {
            Some(Value::String(d)) if d.starts_with("cuda") => true,
            None | Some(Value::Null) => {
                self.wants_half() && DeviceSpec::Auto.resolve().names_a_gpu()
            }
            Some(Value::String(d)) if d == "auto" => {
                self.wants_half() && DeviceSpec::Auto.resolve().names_a_gpu()
            }
            _ => false,
        };
        if let Some(t) = self.torch_dtype.take().filter(|_| !self.dtype_given) {
            let half = matches!(
                t.as_str(),
                "bfloat16" | "bf16" | "float16" | "fp16" | "half"
            );
            let dtype = match on_gpu || !half {
                true => t,
                false => "auto".into(),
            };
            merged.insert("dtype".into(), Value::String(dtype));
        }
        if self.trl_bf16 {
            let dtype = if on_gpu { "bf16" } else { "auto" };
            merged.insert("dtype".into(), Value::String(dtype.into()));
        }
        self.ignored.sort();
        self.ignored.dedup();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Format, TrainConfig};

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
            let yaml = serde_yaml_ng::to_string(&Value::Object(doc)).unwrap();
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
