//! LoRA and QLoRA: which projections get adapters, their initialization, PEFT's file format
//! (`adapter_config.json` + `adapter_model.safetensors`), and merging into the base weights.
//!
//! Adapters follow PEFT exactly, so that `peft` loads what we save and we load what it saves:
//! - `lora_A` [r, in] starts as PEFT's `kaiming_uniform_(a = sqrt(5))`, i.e. uniform in
//!   `±1/sqrt(in)`; `lora_B` [out, r] starts at zero, so a fresh adapter changes nothing;
//! - the output is `base(x) + scale * dropout(x) A^T B^T` with `scale = alpha / r`, or
//!   `alpha / sqrt(r)` with rsLoRA;
//! - keys are `base_model.model.<module>.lora_A.weight` (PEFT drops the adapter name);
//! - `target_modules` entries match a module whose path equals the entry or ends with
//!   `.<entry>`; `all-linear` targets every projection (the LM head is never one).
//!
//! GPT-2's Conv1D weights are stored [in, out]: PEFT marks that with `fan_in_fan_out`, the
//! adapter shapes are the same, and only merging transposes the update.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;

use crate::{Error, Result};
use grpo_models::models::{Arch, CausalLm, LoraAdapter, LoraDropout, ModelConfig};
use grpo_models::seeding::mix_seed;

/// PEFT's key prefix for a causal LM (`PeftModelForCausalLM.base_model.model`).
pub const PEFT_PREFIX: &str = "base_model.model.";
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

/// Validated LoRA options (`lora.*` keys).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    pub r: usize,
    pub alpha: f64,
    pub dropout: f64,
    pub target_modules: Vec<String>,
    pub use_rslora: bool,
}

impl LoraConfig {
    /// The factor on the adapter's output.
    pub fn scale(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.r as f64).sqrt()
        } else {
            self.alpha / self.r as f64
        }
    }

    /// Whether the projection at HF module path `module` gets an adapter.
    pub fn targets(&self, module: &str) -> bool {
        self.target_modules
            .iter()
            .any(|t| t == "all-linear" || module == t || module.ends_with(&format!(".{t}")))
    }

    /// PEFT's `adapter_config.json` for these options.
    pub fn peft_json(&self, arch: Arch, base_model: &str) -> serde_json::Value {
        json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.r,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            // PEFT expands "all-linear" only when it is the whole value, not a list entry.
            "target_modules": match self.target_modules.iter().any(|t| t == "all-linear") {
                true => json!("all-linear"),
                false => json!(self.target_modules),
            },
            "use_rslora": self.use_rslora,
            "fan_in_fan_out": arch == Arch::Gpt2,
            "bias": "none",
            "init_lora_weights": true,
            "inference_mode": true,
            "modules_to_save": null,
        })
    }

    /// Reads PEFT's `adapter_config.json` (only what changes the computation).
    pub fn from_peft_json(v: &serde_json::Value, path: &Path) -> Result<Self> {
        let bad = |what: &str| Error::file(path, format!("{what}; is this a PEFT LoRA adapter?"));
        if v.get("peft_type").and_then(|t| t.as_str()) != Some("LORA") {
            return Err(bad("peft_type is not \"LORA\""));
        }
        let r = v
            .get("r")
            .and_then(|x| x.as_u64())
            .filter(|&r| r > 0)
            .ok_or_else(|| bad("no positive integer `r`"))? as usize;
        let alpha = v
            .get("lora_alpha")
            .and_then(|x| x.as_f64())
            .ok_or_else(|| bad("no number `lora_alpha`"))?;
        let target_modules = match v.get("target_modules") {
            Some(serde_json::Value::String(s)) => vec![s.clone()],
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .filter_map(|x| x.as_str().map(str::to_owned))
                .collect(),
            _ => return Err(bad("no `target_modules`")),
        };
        for key in ["rank_pattern", "alpha_pattern"] {
            if v.get(key)
                .and_then(|p| p.as_object())
                .is_some_and(|o| !o.is_empty())
            {
                return Err(bad(&format!("`{key}` (per-module ranks) is not supported")));
            }
        }
        if v.get("bias")
            .and_then(|b| b.as_str())
            .is_some_and(|b| b != "none")
        {
            return Err(bad("only bias = \"none\" adapters are supported"));
        }
        Ok(Self {
            r,
            alpha,
            dropout: v
                .get("lora_dropout")
                .and_then(|x| x.as_f64())
                .unwrap_or(0.0),
            target_modules,
            use_rslora: v
                .get("use_rslora")
                .and_then(|x| x.as_bool())
                .unwrap_or(false),
        })
    }
}

/// PEFT's default targets per architecture (used when `lora.target_modules` is unset).
pub fn default_targets(arch: Arch) -> Vec<String> {
    let t: &[&str] = match arch {
        Arch::Gpt2 => &["c_attn"],
        Arch::Llama | Arch::Qwen2 | Arch::Qwen3 | Arch::Mistral | Arch::Gemma2 | Arch::Gemma3 => {
            &["q_proj", "v_proj"]
        }
        Arch::Phi3 => &["qkv_proj"],
    };
    t.iter().map(|s| s.to_string()).collect()
}

pub fn a_key(module: &str) -> String {
    format!("{PEFT_PREFIX}{module}.lora_A.weight")
}
pub fn b_key(module: &str) -> String {
    format!("{PEFT_PREFIX}{module}.lora_B.weight")
}

/// The targeted projections of `model`: (module path, in, out), in model order.
pub fn targeted(model: &CausalLm, cfg: &LoraConfig) -> Result<Vec<(String, usize, usize)>> {
    let all = model.projection_shapes()?;
    let hit: Vec<_> = all
        .iter()
        .filter(|(n, _, _)| cfg.targets(n))
        .cloned()
        .collect();
    if hit.is_empty() {
        let mut names: Vec<String> = all
            .iter()
            .filter_map(|(n, _, _)| n.rsplit('.').next().map(str::to_owned))
            .collect();
        names.dedup();
        names.sort();
        names.dedup();
        return Err(Error::config(
            "lora.target_modules",
            format!(
                "{:?} matches no projection of this model; its projections are {names:?} (or use \"all-linear\")",
                cfg.target_modules
            ),
        ));
    }
    Ok(hit)
}

/// Fresh adapter weights, PEFT-keyed and sorted by key: `lora_A` uniform in `±1/sqrt(in)`
/// from a generator seeded with `seed`, `lora_B` zero.
pub fn init_weights(
    model: &CausalLm,
    cfg: &LoraConfig,
    seed: u64,
    device: &Device,
) -> Result<Vec<(String, Tensor)>> {
    let mut rng = ChaCha8Rng::seed_from_u64(mix_seed(seed, 0x4c6f_5241)); // "LoRA"
    let mut out = Vec::new();
    for (module, i, o) in targeted(model, cfg)? {
        let bound = 1.0 / (i as f32).sqrt();
        let a: Vec<f32> = (0..cfg.r * i)
            .map(|_| rng.random_range(-bound..bound))
            .collect();
        out.push((a_key(&module), Tensor::from_vec(a, (cfg.r, i), device)?));
        out.push((
            b_key(&module),
            Tensor::zeros((o, cfg.r), DType::F32, device)?,
        ));
    }
    out.sort_by(|x, y| x.0.cmp(&y.0));
    Ok(out)
}

/// Adapters by module path from PEFT-keyed tensors (`lora_A`/`lora_B` pairs). `dropout`
/// (seed, clock) turns dropout on (training forwards; see [`LoraDropout`]); without it adapters
/// run without dropout.
pub fn adapters(
    tensors: &[(String, Tensor)],
    cfg: &LoraConfig,
    dropout: Option<(u64, Arc<AtomicU64>)>,
) -> Result<HashMap<String, LoraAdapter>> {
    let map: HashMap<&str, &Tensor> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut out = HashMap::new();
    for (name, a) in tensors {
        let Some(module) = name
            .strip_prefix(PEFT_PREFIX)
            .and_then(|n| n.strip_suffix(".lora_A.weight"))
        else {
            continue;
        };
        let b = map
            .get(b_key(module).as_str())
            .ok_or_else(|| Error::Model(format!("adapter {module} has lora_A but no lora_B")))?;
        let dropout = dropout.as_ref().map(|(s, clock)| {
            let h = module.bytes().fold(*s, |h, c| h.rotate_left(5) ^ c as u64);
            LoraDropout::new(cfg.dropout as f32, h, clock.clone())
        });
        let ad = LoraAdapter::new(a.clone(), (*b).clone(), cfg.scale(), dropout)
            .map_err(|e| Error::Model(format!("adapter {module}: {e}")))?;
        out.insert(module.to_string(), ad);
    }
    if out.is_empty() {
        return Err(Error::Model(
            "no lora_A weights among the adapter tensors".into(),
        ));
    }
    Ok(out)
}

/// Writes `adapter_config.json` and `adapter_model.safetensors` into `dir` (synced).
pub fn save_peft(
    dir: &Path,
    cfg: &LoraConfig,
    arch: Arch,
    base_model: &str,
    tensors: &[(String, Tensor)],
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::file(dir, format!("cannot create: {e}")))?;
    // A serde_json::Value always serializes (string keys only).
    let conf = serde_json::to_vec_pretty(&cfg.peft_json(arch, base_model)).unwrap_or_default();
    grpo_models::files::write_file(&dir.join(ADAPTER_CONFIG), &conf)?;
    grpo_models::files::save_tensors(&dir.join(ADAPTER_WEIGHTS), tensors)
}

/// Whether `dir` holds a PEFT adapter.
pub fn is_adapter_dir(dir: &Path) -> bool {
    dir.join(ADAPTER_CONFIG).is_file()
}

/// A PEFT adapter read back.
pub struct LoadedAdapter {
    pub config: LoraConfig,
    /// `base_model_name_or_path` as written.
    pub base_model: Option<String>,
    /// PEFT-keyed f32 tensors, sorted by key.
    pub tensors: Vec<(String, Tensor)>,
}

/// Reads a PEFT adapter directory.
pub fn load_peft(dir: &Path, device: &Device) -> Result<LoadedAdapter> {
    let cpath = dir.join(ADAPTER_CONFIG);
    let text = std::fs::read_to_string(&cpath)
        .map_err(|e| Error::file(&cpath, format!("cannot read: {e}")))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::file(&cpath, format!("invalid JSON: {e}")))?;
    let config = LoraConfig::from_peft_json(&v, &cpath)?;
    let wpath = dir.join(ADAPTER_WEIGHTS);
    let loaded = candle_core::safetensors::load(&wpath, device)
        .map_err(|e| Error::file(&wpath, format!("cannot read: {e}")))?;
    let mut tensors = loaded
        .into_iter()
        .map(|(n, t)| Ok((n, t.to_dtype(DType::F32)?)))
        .collect::<candle_core::Result<Vec<_>>>()?;
    tensors.sort_by(|x, y| x.0.cmp(&y.0));
    for (n, t) in &tensors {
        let r_dim = match (n.ends_with(".lora_A.weight"), n.ends_with(".lora_B.weight")) {
            (true, _) => 0,
            (_, true) => 1,
            _ => continue,
        };
        if t.rank() != 2 || t.dims()[r_dim] != config.r {
            return Err(Error::file(
                &wpath,
                format!("{n} has shape {:?}, not rank r = {}", t.dims(), config.r),
            ));
        }
    }
    Ok(LoadedAdapter {
        config,
        base_model: v
            .get("base_model_name_or_path")
            .and_then(|b| b.as_str())
            .map(str::to_owned),
        tensors,
    })
}

/// Adds each adapter's `scale * B A` into the base weights (HF names, HF layout; GPT-2's Conv1D
/// weights, stored [in, out], get the transpose).
pub fn merge_into(
    base: &mut HashMap<String, Tensor>,
    model_cfg: &ModelConfig,
    adapters: &HashMap<String, LoraAdapter>,
) -> Result<()> {
    for (module, ad) in adapters {
        let key = format!("{module}.weight");
        let w = base.get(&key).ok_or_else(|| {
            Error::Model(format!("the base model has no {key} for adapter {module}"))
        })?;
        let mut delta = ad.delta_weight()?; // [out, in]
        if model_cfg.arch == Arch::Gpt2 {
            delta = delta.t()?;
        }
        if delta.dims() != w.dims() {
            return Err(Error::Model(format!(
                "adapter {module} update {:?} does not fit {key} {:?}",
                delta.dims(),
                w.dims()
            )));
        }
        let merged = (w.to_dtype(DType::F32)? + delta)?.to_dtype(w.dtype())?;
        base.insert(key, merged);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(targets: &[&str]) -> LoraConfig {
        LoraConfig {
            r: 4,
            alpha: 8.0,
            dropout: 0.0,
            target_modules: targets.iter().map(|s| s.to_string()).collect(),
            use_rslora: false,
        }
    }

    #[test]
    fn targets_match_like_peft() {
        let c = cfg(&["q_proj", "v_proj"]);
        assert!(c.targets("model.layers.0.self_attn.q_proj"));
        assert!(!c.targets("model.layers.0.self_attn.qq_proj"));
        assert!(!c.targets("model.layers.0.self_attn.o_proj"));
        assert!(cfg(&["all-linear"]).targets("model.layers.3.mlp.down_proj"));
        assert!(cfg(&["self_attn.o_proj"]).targets("model.layers.1.self_attn.o_proj"));
        assert_eq!(c.scale(), 2.0);
        let rs = LoraConfig {
            use_rslora: true,
            ..c
        };
        assert_eq!(rs.scale(), 4.0);
    }

    #[test]
    fn all_linear_is_written_as_peft_spells_it() {
        let j = cfg(&["all-linear"]).peft_json(Arch::Llama, "base");
        assert_eq!(j["target_modules"], "all-linear");
        let back = LoraConfig::from_peft_json(&j, Path::new("a.json")).unwrap();
        assert_eq!(back.target_modules, ["all-linear"]);
        let j = cfg(&["q_proj", "v_proj"]).peft_json(Arch::Llama, "base");
        assert_eq!(j["target_modules"], json!(["q_proj", "v_proj"]));
    }

    #[test]
    fn safetensors_files_say_their_format_like_transformers() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.safetensors");
        let t = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
        grpo_models::files::save_tensors(&p, &[("w".into(), t)]).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let m = meta.metadata().as_ref().unwrap();
        assert_eq!(m.get("format").map(String::as_str), Some("pt"));
    }

    #[test]
    fn peft_config_round_trips_and_rejects_other_types() {
        let c = cfg(&["q_proj"]);
        let v = c.peft_json(Arch::Llama, "base");
        assert_eq!(LoraConfig::from_peft_json(&v, Path::new("x")).unwrap(), c);
        let mut bad = v.clone();
        bad["peft_type"] = json!("IA3");
        let e = LoraConfig::from_peft_json(&bad, Path::new("a/adapter_config.json")).unwrap_err();
        assert!(e.to_string().contains("adapter_config.json"), "{e}");
    }
}
