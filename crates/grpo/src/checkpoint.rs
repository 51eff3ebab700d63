//! Checkpoints: `output_dir/checkpoint-<step>/` holds an HF model directory (config.json,
//! model.safetensors, generation_config.json, tokenizer files: transformers loads it as is), or
//! for LoRA runs a PEFT adapter directory (adapter_config.json, adapter_model.safetensors), plus
//! the optimizer moments, the trainer state and the resolved run config.
//!
//! A checkpoint is written into a temporary directory, synced, then renamed into place, so a
//! crash or a full disk never leaves a half-written `checkpoint-N` and never touches the previous
//! ones. Only then are checkpoints beyond `save_total_limit` deleted, oldest first.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use crate::{Error, Result};
use grpo_models::files::{save_tensors, write_file};
use grpo_models::models::ModelConfig;
use grpo_models::tokenizer::Tokenizer;

/// What an HF model directory is written from.
pub struct HfExport<'a> {
    pub config: &'a ModelConfig,
    /// HF names -> tensors (HF layout), saved in their dtype.
    pub tensors: &'a [(String, Tensor)],
    pub tokenizer: Option<&'a Tokenizer>,
    /// The source model's `generation_config.json` (its sampling defaults are carried through;
    /// the EOS and BOS ids are set from the model).
    pub generation_config: Option<&'a serde_json::Value>,
    pub eos_token_ids: &'a [u32],
}

/// A PEFT adapter directory's contents (LoRA runs).
pub struct AdapterExport<'a> {
    pub config: &'a crate::peft::LoraConfig,
    pub model_config: &'a ModelConfig,
    /// `base_model_name_or_path`
    pub base_model: &'a str,
    /// PEFT-keyed adapter tensors.
    pub tensors: &'a [(String, Tensor)],
    pub tokenizer: Option<&'a Tokenizer>,
}

/// A model whose config and tokenizer files are those of the directory it was loaded from
/// (masked-LM generators): its tensors, with those files copied beside them.
pub struct CopiedExport<'a> {
    /// The HF directory the model came from.
    pub source: &'a Path,
    /// HF names -> tensors, saved in their dtype.
    pub tensors: &'a [(String, Tensor)],
}

/// The model part of a checkpoint: full weights, or adapters over a frozen base.
pub enum ModelFiles<'a> {
    Full(HfExport<'a>),
    Adapter(AdapterExport<'a>),
    Copied(CopiedExport<'a>),
}

/// The files beside a model's weights that [`CopiedExport`] copies when they exist.
const COPIED_FILES: &[&str] = &[
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
];

/// Writes `export` into `dir` (created): model.safetensors and the source's config and
/// tokenizer files.
pub fn write_copied_model(dir: &Path, export: &CopiedExport) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::file(dir, format!("cannot create: {e}")))?;
    for name in COPIED_FILES {
        let from = export.source.join(name);
        if from.is_file() {
            let bytes = std::fs::read(&from)
                .map_err(|e| Error::file(&from, format!("cannot read: {e}")))?;
            write_file(&dir.join(name), &bytes)?;
        }
    }
    save_tensors(&dir.join("model.safetensors"), export.tensors)
}

/// Everything a checkpoint holds.
pub struct CheckpointData<'a> {
    pub step: u64,
    pub model: ModelFiles<'a>,
    /// The AdamW state; `None` (`save_only_model`): the checkpoint cannot be resumed from.
    pub optimizer: Option<&'a [(String, Tensor)]>,
    pub trainer_state: &'a serde_json::Value,
    pub config_toml: &'a str,
}

/// A checkpoint read back (weights are loaded by the caller through `weights::load_model`).
pub struct LoadedCheckpoint {
    pub step: u64,
    pub dir: PathBuf,
    pub optimizer: HashMap<String, Tensor>,
    pub trainer_state: serde_json::Value,
    pub config_toml: String,
}

/// The `generation_config.json` beside a model (`origin` an HF directory), if any.
pub fn source_generation_config(origin: &Path) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(origin.join("generation_config.json")).ok()?;
    serde_json::from_str(&text).ok()
}

/// Writes an HF model directory into `dir` (created; must not hold a model already).
pub fn write_hf_model(dir: &Path, export: &HfExport) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::file(dir, format!("cannot create: {e}")))?;
    if dir.join("model.safetensors").exists() {
        return Err(Error::file(
            dir,
            "already holds a model; choose an empty directory",
        ));
    }
    write_hf_model_as(dir, export, None, None)
}

/// [`write_hf_model`] with the weights in `dtype` (f32, bf16 or f16; `None`: as they are;
/// `config.json` says which) and, with `max_shard_bytes`, split into `model-0000K-of-0000N.safetensors` shards with
/// `model.safetensors.index.json`, as transformers writes large models.
pub fn write_hf_model_as(
    dir: &Path,
    export: &HfExport,
    dtype: Option<candle_core::DType>,
    max_shard_bytes: Option<u64>,
) -> Result<()> {
    let mut cfg = export.config.to_hf_json()?;
    let dtype = dtype
        .or_else(|| export.tensors.first().map(|(_, t)| t.dtype()))
        .unwrap_or(candle_core::DType::F32);
    let dtype_name = match dtype {
        candle_core::DType::BF16 => "bfloat16",
        candle_core::DType::F16 => "float16",
        _ => "float32",
    };
    cfg["torch_dtype"] = dtype_name.into();
    cfg["dtype"] = dtype_name.into();
    // A serde_json::Value always serializes (string keys only).
    let pretty = |v: &serde_json::Value| serde_json::to_vec_pretty(v).unwrap_or_default();
    write_file(&dir.join("config.json"), &pretty(&cfg))?;
    let mut gen = export
        .generation_config
        .filter(|g| g.is_object())
        .cloned()
        .unwrap_or_else(|| serde_json::json!({}));
    gen["eos_token_id"] = serde_json::json!(export.eos_token_ids);
    if let Some(b) = export.config.bos_token_id {
        gen["bos_token_id"] = b.into();
    }
    write_file(&dir.join("generation_config.json"), &pretty(&gen))?;
    let tensors: Vec<(String, Tensor)> = export
        .tensors
        .iter()
        .filter(|(n, _)| !(export.config.tie_word_embeddings && n == "lm_head.weight"))
        .map(|(n, t)| Ok((n.clone(), t.to_dtype(dtype)?)))
        .collect::<Result<_>>()?;
    let bytes = |t: &Tensor| (t.elem_count() * t.dtype().size_in_bytes()) as u64;
    let total: u64 = tensors.iter().map(|(_, t)| bytes(t)).sum();
    match max_shard_bytes {
        Some(max) if total > max => {
            // Shards in name order, each at most `max` bytes (a larger tensor alone).
            let mut shards: Vec<Vec<(String, Tensor)>> = vec![vec![]];
            let mut size = 0u64;
            for (n, t) in tensors {
                let b = bytes(&t);
                if size + b > max && !shards.last().is_some_and(|s| s.is_empty()) {
                    shards.push(vec![]);
                    size = 0;
                }
                size += b;
                if let Some(last) = shards.last_mut() {
                    last.push((n, t));
                }
            }
            let k = shards.len();
            let mut weight_map = serde_json::Map::new();
            for (i, shard) in shards.iter().enumerate() {
                let name = format!("model-{:05}-of-{k:05}.safetensors", i + 1);
                save_tensors(&dir.join(&name), shard)?;
                for (n, _) in shard {
                    weight_map.insert(n.clone(), name.clone().into());
                }
            }
            let index =
                serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
            write_file(&dir.join("model.safetensors.index.json"), &pretty(&index))?;
        }
        _ => save_tensors(&dir.join("model.safetensors"), &tensors)?,
    }
    if let Some(tok) = export.tokenizer {
        tok.save_hf_dir(dir)?;
    }
    Ok(())
}

fn step_of(name: &str) -> Option<u64> {
    name.strip_prefix("checkpoint-")?.parse().ok()
}

/// `checkpoint-<step>` directories, sorted by step.
pub fn list_checkpoints(output_dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let rd = match std::fs::read_dir(output_dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(Error::file(output_dir, format!("cannot list: {e}"))),
    };
    let mut out: Vec<(u64, PathBuf)> = rd
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .filter_map(|e| step_of(&e.file_name().to_string_lossy()).map(|s| (s, e.path())))
        .collect();
    out.sort();
    Ok(out)
}

pub fn latest_checkpoint(output_dir: &Path) -> Result<Option<PathBuf>> {
    Ok(list_checkpoints(output_dir)?.pop().map(|(_, p)| p))
}

/// The best checkpoint a run recorded (`best_model_checkpoint` in the newest checkpoint's
/// `trainer_state.json`, set when the run had a `metric_for_best_model`), if it still exists.
pub fn best_checkpoint(output_dir: &Path) -> Result<Option<PathBuf>> {
    let Some(latest) = latest_checkpoint(output_dir)? else {
        return Ok(None);
    };
    let path = latest.join("trainer_state.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(None);
    };
    let state: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::file(&path, format!("invalid JSON: {e}")))?;
    Ok(state
        .get("best_model_checkpoint")
        .and_then(|v| v.as_str())
        .and_then(|name| Path::new(name).file_name().map(|n| output_dir.join(n)))
        .filter(|p| p.is_dir()))
}

/// A checkpoint given as a run directory (one holding `checkpoint-<step>` directories and no
/// model of its own) is its best checkpoint when the run recorded one, else its newest; any
/// other path is itself.
pub fn resolve_run_dir(path: &Path) -> Result<PathBuf> {
    let holds_model = path.join("config.json").is_file()
        || path.join(crate::peft::ADAPTER_CONFIG).is_file()
        || !path.is_dir();
    if holds_model {
        return Ok(path.to_path_buf());
    }
    match best_checkpoint(path)? {
        Some(best) => Ok(best),
        None => Ok(latest_checkpoint(path)?.unwrap_or_else(|| path.to_path_buf())),
    }
}

/// Puts `output_dir` back in order after a process was killed inside [`save_checkpoint`]: a
/// checkpoint moved aside to be replaced (`.old-checkpoint-<step>-<pid>`) goes back when its
/// replacement never arrived, else it is deleted; half-written `.tmp-checkpoint-*` directories
/// are deleted. Nothing else is touched.
pub fn recover(output_dir: &Path) -> Result<()> {
    let Ok(rd) = std::fs::read_dir(output_dir) else {
        return Ok(());
    };
    let mut names: Vec<String> = rd
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    for name in names {
        let path = output_dir.join(&name);
        if let Some(rest) = name.strip_prefix(".old-checkpoint-") {
            // split always yields a first piece; a bad one fails the parse below.
            let step = rest.split('-').next().unwrap_or_default();
            let target = output_dir.join(format!("checkpoint-{step}"));
            if step.parse::<u64>().is_ok() && !target.exists() {
                tracing::warn!(
                    "{}: restored from {name} (a run was stopped while replacing it)",
                    target.display()
                );
                std::fs::rename(&path, &target)
                    .map_err(|e| Error::file(&path, format!("cannot restore: {e}")))?;
                continue;
            }
        } else if !name.starts_with(".tmp-checkpoint-") {
            continue;
        }
        tracing::warn!(
            "{}: deleting an unfinished checkpoint write",
            path.display()
        );
        std::fs::remove_dir_all(&path)
            .map_err(|e| Error::file(&path, format!("cannot delete: {e}")))?;
    }
    Ok(())
}

/// Writes `checkpoint-<step>` atomically and applies `save_total_limit`, which never deletes
/// `keep` (the best checkpoint, as HF's Trainer keeps it).
pub fn save_checkpoint(
    output_dir: &Path,
    data: &CheckpointData,
    save_total_limit: Option<usize>,
    keep: Option<&Path>,
) -> Result<PathBuf> {
    let final_dir = output_dir.join(format!("checkpoint-{}", data.step));
    let tmp = output_dir.join(format!(
        ".tmp-checkpoint-{}-{}",
        data.step,
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    let write_all = || -> Result<()> {
        match &data.model {
            ModelFiles::Full(m) => write_hf_model(&tmp, m)?,
            ModelFiles::Copied(m) => write_copied_model(&tmp, m)?,
            ModelFiles::Adapter(a) => {
                crate::peft::save_peft(
                    &tmp,
                    a.config,
                    a.model_config.arch,
                    a.base_model,
                    a.tensors,
                )?;
                if let Some(tok) = a.tokenizer {
                    tok.save_hf_dir(&tmp)?;
                }
            }
        }
        grpo_models::faults::kill_point("checkpoint.model_written");
        if let Some(optimizer) = data.optimizer {
            save_tensors(&tmp.join("optimizer.safetensors"), optimizer)?;
        }
        let state = serde_json::to_vec_pretty(data.trainer_state).map_err(|e| {
            crate::Error::Invariant(format!("trainer_state.json could not be written: {e}"))
        })?;
        write_file(&tmp.join("trainer_state.json"), &state)?;
        write_file(&tmp.join("config.toml"), data.config_toml.as_bytes())
    };
    if let Err(e) = write_all() {
        let _ = std::fs::remove_dir_all(&tmp);
        let last = latest_checkpoint(output_dir).ok().flatten();
        let hint = match last {
            Some(p) => format!("; the last good checkpoint is {}", p.display()),
            None => String::new(),
        };
        return Err(Error::checkpoint(
            &final_dir,
            format!("not saved: {e}{hint}"),
        ));
    }
    // Replace an existing checkpoint of the same step: move it aside first.
    let aside = output_dir.join(format!(
        ".old-checkpoint-{}-{}",
        data.step,
        std::process::id()
    ));
    let had_old = final_dir.exists();
    grpo_models::faults::kill_point("checkpoint.before_rename");
    if had_old {
        std::fs::rename(&final_dir, &aside)
            .map_err(|e| Error::file(&final_dir, format!("cannot replace: {e}")))?;
        grpo_models::faults::kill_point("checkpoint.replacing");
    }
    std::fs::rename(&tmp, &final_dir).map_err(|e| {
        let _ = std::fs::remove_dir_all(&tmp);
        if had_old {
            let _ = std::fs::rename(&aside, &final_dir);
        }
        Error::file(
            &final_dir,
            format!("cannot rename the finished checkpoint into place: {e}"),
        )
    })?;
    if had_old {
        let _ = std::fs::remove_dir_all(&aside);
    }
    // The rename is durable once the directory is synced; a failure leaves the checkpoint
    // complete on disk but possibly not yet after a power loss: said, not fatal.
    if let Err(e) = std::fs::File::open(output_dir).and_then(|d| d.sync_all()) {
        tracing::warn!(
            "{}: cannot sync the directory after writing {} ({e}); the checkpoint may not \
             survive a power loss",
            output_dir.display(),
            final_dir.display()
        );
    }
    if let Some(limit) = save_total_limit {
        // Oldest first, with the kept (best) checkpoint counted as the newest; a limit of 1
        // keeps two when the best is not the one just written (HF's rule).
        let mut all: Vec<PathBuf> = list_checkpoints(output_dir)?
            .into_iter()
            .map(|(_, p)| p)
            .collect();
        let mut limit = limit.max(1);
        if let Some(i) = all.iter().position(|p| Some(p.as_path()) == keep) {
            let best = all.remove(i);
            all.push(best);
            if limit == 1 && keep != Some(final_dir.as_path()) {
                limit = 2;
            }
        }
        let excess = all.len().saturating_sub(limit);
        for p in all.into_iter().take(excess) {
            if p != final_dir {
                std::fs::remove_dir_all(&p)
                    .map_err(|e| Error::file(&p, format!("cannot delete old checkpoint: {e}")))?;
            }
        }
    }
    Ok(final_dir)
}

/// Reads a checkpoint's optimizer state, trainer state and config.
pub fn load_checkpoint(dir: &Path, device: &Device) -> Result<LoadedCheckpoint> {
    let step = dir
        .file_name()
        .and_then(|n| step_of(&n.to_string_lossy()))
        .ok_or_else(|| Error::file(dir, "not a checkpoint-<step> directory"))?;
    let opt_path = dir.join("optimizer.safetensors");
    // A checkpoint saved with save_only_model (its config says so) has no optimizer state by
    // design; any other without one is broken (the error below names the file).
    let saved_only_model = std::fs::read_to_string(dir.join("config.toml"))
        .is_ok_and(|t| t.lines().any(|l| l.trim() == "save_only_model = true"));
    if !opt_path.exists() && saved_only_model {
        return Err(Error::checkpoint(
            dir,
            "has no optimizer state (saved with save_only_model = true), so --resume cannot \
             continue it exactly; start a new run from its weights instead (model = this \
             directory, without --resume)",
        ));
    }
    let optimizer = candle_core::safetensors::load(&opt_path, device).map_err(|e| {
        Error::file(
            &opt_path,
            format!("missing or corrupt optimizer state: {e}"),
        )
    })?;
    let ts_path = dir.join("trainer_state.json");
    let text = std::fs::read_to_string(&ts_path)
        .map_err(|e| Error::file(&ts_path, format!("cannot read: {e}")))?;
    let trainer_state =
        serde_json::from_str(&text).map_err(|e| Error::file(&ts_path, format!("corrupt: {e}")))?;
    let cfg_path = dir.join("config.toml");
    let config_toml = std::fs::read_to_string(&cfg_path)
        .map_err(|e| Error::file(&cfg_path, format!("cannot read: {e}")))?;
    Ok(LoadedCheckpoint {
        step,
        dir: dir.to_path_buf(),
        optimizer,
        trainer_state,
        config_toml,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;
    use grpo_models::hub::ModelSource;
    use grpo_models::weights::load_model;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures")
            .join(name)
    }

    #[test]
    fn hf_export_round_trips_every_tiny_model() {
        for name in ["llama", "llama3", "qwen2", "qwen3", "gpt2"] {
            let m = load_model(
                &ModelSource::HfDir(fixture(&format!("tiny/{name}"))),
                DType::F32,
                &Device::Cpu,
            )
            .unwrap();
            let dir = tempfile::tempdir().unwrap();
            let out = dir.path().join("m");
            let tensors: Vec<(String, Tensor)> = m
                .tensors
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            write_hf_model(
                &out,
                &HfExport {
                    config: &m.config,
                    tensors: &tensors,
                    tokenizer: None,
                    generation_config: None,
                    eos_token_ids: &m.eos_token_ids,
                },
            )
            .unwrap();
            let back =
                load_model(&ModelSource::HfDir(out.clone()), DType::F32, &Device::Cpu).unwrap();
            assert_eq!(back.config, m.config, "{name}");
            assert_eq!(back.eos_token_ids, m.eos_token_ids, "{name}");
            for (k, v) in &m.tensors {
                let w = &back.tensors[k];
                let d = (v - w)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                assert_eq!(d, 0.0, "{name} {k}");
            }
            assert!(write_hf_model(
                &out,
                &HfExport {
                    config: &m.config,
                    tensors: &tensors,
                    tokenizer: None,
                    generation_config: None,
                    eos_token_ids: &[]
                }
            )
            .is_err());
        }
    }

    #[test]
    fn tokenizer_round_trips() {
        let tok = Tokenizer::from_hf_dir(&fixture("smollm2")).unwrap();
        let dir = tempfile::tempdir().unwrap();
        tok.save_hf_dir(dir.path()).unwrap();
        let back = Tokenizer::from_hf_dir(dir.path()).unwrap();
        let msgs = [grpo_models::tokenizer::ChatMessage::user(
            "What is 12 + 30?  Answer:\n ok",
        )];
        assert_eq!(
            back.encode_chat(&msgs, true).unwrap(),
            tok.encode_chat(&msgs, true).unwrap()
        );
        assert_eq!(
            back.encode("héllo  world 123", true).unwrap(),
            tok.encode("héllo  world 123", true).unwrap()
        );
        assert_eq!(back.eos_token_id(), tok.eos_token_id());
    }

    fn data<'a>(
        step: u64,
        cfg: &'a ModelConfig,
        t: &'a [(String, Tensor)],
        opt: &'a [(String, Tensor)],
        st: &'a serde_json::Value,
    ) -> CheckpointData<'a> {
        CheckpointData {
            step,
            model: ModelFiles::Full(HfExport {
                config: cfg,
                tensors: t,
                tokenizer: None,
                generation_config: None,
                eos_token_ids: &[2],
            }),
            optimizer: Some(opt),
            trainer_state: st,
            config_toml: "seed = 1\n",
        }
    }

    #[test]
    fn atomic_save_rotation_and_failure_leave_good_checkpoints() {
        let m = load_model(
            &ModelSource::HfDir(fixture("tiny/llama")),
            DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        let t: Vec<(String, Tensor)> = m
            .tensors
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let opt = vec![(
            "exp_avg.x".to_string(),
            Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap(),
        )];
        let st = serde_json::json!({"step": 1});
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("junk")).unwrap();
        for s in [10, 20, 30] {
            save_checkpoint(
                dir.path(),
                &data(s, &m.config, &t, &opt, &st),
                Some(2),
                None,
            )
            .unwrap();
        }
        let steps: Vec<u64> = list_checkpoints(dir.path())
            .unwrap()
            .iter()
            .map(|x| x.0)
            .collect();
        assert_eq!(steps, vec![20, 30]);
        let c = load_checkpoint(&dir.path().join("checkpoint-30"), &Device::Cpu).unwrap();
        assert_eq!(c.step, 30);
        assert_eq!(
            c.optimizer["exp_avg.x"].to_vec1::<f32>().unwrap(),
            vec![1.0, 2.0]
        );
        assert_eq!(c.trainer_state, st);
        // A failing save (a tensor name safetensors rejects is hard to make; an unwritable
        // model config is not): a model whose RoPE cannot be expressed fails mid-write.
        let mut bad = m.config.clone();
        bad.rope_freq_factors = Some(vec![1.0]);
        let e = save_checkpoint(dir.path(), &data(40, &bad, &t, &opt, &st), Some(2), None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("checkpoint-40") && e.contains("checkpoint-30"),
            "{e}"
        );
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.starts_with(".tmp")), "{names:?}");
        assert_eq!(
            latest_checkpoint(dir.path()).unwrap().unwrap(),
            dir.path().join("checkpoint-30")
        );
        // Re-saving the same step replaces it.
        save_checkpoint(
            dir.path(),
            &data(30, &m.config, &t, &opt, &serde_json::json!({"step": 2})),
            None,
            None,
        )
        .unwrap();
        assert_eq!(
            load_checkpoint(&dir.path().join("checkpoint-30"), &Device::Cpu)
                .unwrap()
                .trainer_state["step"],
            2
        );
    }

    #[test]
    fn rotation_keeps_the_best_checkpoint() {
        let m = load_model(
            &ModelSource::HfDir(fixture("tiny/llama")),
            DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        let t: Vec<(String, Tensor)> = m.tensors.clone().into_iter().collect();
        let opt = vec![];
        let dir = tempfile::tempdir().unwrap();
        let best = dir.path().join("checkpoint-20");
        for s in [10, 20, 30, 40] {
            let st = if s >= 20 {
                serde_json::json!({"step": s, "best_model_checkpoint": best.display().to_string()})
            } else {
                serde_json::json!({"step": s})
            };
            let keep = (s >= 20).then_some(best.as_path());
            save_checkpoint(
                dir.path(),
                &data(s, &m.config, &t, &opt, &st),
                Some(2),
                keep,
            )
            .unwrap();
        }
        let steps: Vec<u64> = list_checkpoints(dir.path())
            .unwrap()
            .iter()
            .map(|x| x.0)
            .collect();
        assert_eq!(
            steps,
            vec![20, 40],
            "the best survives; the limit still holds"
        );
        assert_eq!(best_checkpoint(dir.path()).unwrap(), Some(best.clone()));
        assert_eq!(resolve_run_dir(dir.path()).unwrap(), best);
        assert_eq!(resolve_run_dir(&best).unwrap(), best);
        // A limit of 1 keeps the best beside the newest.
        save_checkpoint(
            dir.path(),
            &data(50, &m.config, &t, &opt, &serde_json::json!({})),
            Some(1),
            Some(&best),
        )
        .unwrap();
        let steps: Vec<u64> = list_checkpoints(dir.path())
            .unwrap()
            .iter()
            .map(|x| x.0)
            .collect();
        assert_eq!(steps, vec![20, 50]);
        // Without a recorded best, a run directory is its newest checkpoint.
        assert_eq!(
            resolve_run_dir(dir.path()).unwrap(),
            dir.path().join("checkpoint-50")
        );
    }
}
