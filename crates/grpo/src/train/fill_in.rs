//! The fill-in policy kind (`policy = "fill_in"`): a masked-LM generator (BERT, RoBERTa,
//! DistilBERT `*ForMaskedLM`, or a model `grpo pretrain` made) trained with the loop's GRPO
//! core. Prompts are masked inputs; completions are the tokens sampled at their masked
//! positions ([`crate::fill_in`]). The reference is the frozen initial generator.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{Device, Tensor, Var};

use super::{LoadPolicy, Loaded, Policy, Reference, StepMetrics, TrainForward};
use crate::checkpoint::{CopiedExport, ModelFiles};
use crate::config::{DTypeOpt, TrainConfig};
use crate::fill_in::{fill_logprobs, FillInModel, FillInputs, FILL_JUDGE_SCORE};
use crate::inputs::RunData;
use crate::logprobs::Entropy;
use crate::optim::var_tensors;
use crate::rewards::Reward;
use crate::rollout::{Episode, MicroBatch};
use crate::{Error, Result};
use grpo_models::hub::{self, ModelSource};
use grpo_models::models::encoder::EncoderConfig;
use grpo_models::models::masked_lm::{masked_lm_config, MaskedLm, MlmTokenizer};
use grpo_models::tokenizer::Tokenizer;

/// A masked-LM generator, every tensor it uses trained.
pub struct FillInPolicy {
    pub cfg: EncoderConfig,
    /// Checkpoint names of the parameters, sorted.
    pub names: Vec<String>,
    pub vars: Vec<Var>,
    pub device: Device,
    pub mask_id: u32,
    pub special_ids: Vec<u32>,
    /// The generator's directory: checkpoints copy its config and tokenizer files.
    pub source: PathBuf,
    /// The run's inputs (masking, originals, fill metrics), once [`LoadPolicy::prepare_inputs`]
    /// has seen them.
    pub inputs: Option<FillInputs>,
}

impl FillInPolicy {
    fn build(&self, tensors: HashMap<String, Tensor>) -> Result<FillInModel> {
        let lm = MaskedLm::from_tensors(&self.cfg, tensors, &self.source)?;
        FillInModel::new(lm, self.mask_id, &self.special_ids, &self.device)
    }

    fn tensors(&self, track: bool) -> HashMap<String, Tensor> {
        var_tensors(&self.names, &self.vars, track)
    }
}

impl Policy for FillInPolicy {
    type Frozen = FillInModel;
    type Train = FillInForward;

    fn names(&self) -> &[String] {
        &self.names
    }

    fn vars(&self) -> &[Var] {
        &self.vars
    }

    fn freeze(&self, _save_memory: bool) -> Result<FillInModel> {
        self.build(self.tensors(false))
    }

    /// No dropout (the forward is deterministic) and no recomputation: an encoder's activations
    /// at these sizes fit.
    fn for_update(&self, _dropout_seed: u64, _checkpointing: bool) -> Result<FillInForward> {
        Ok(FillInForward {
            model: self.build(self.tensors(true))?,
        })
    }

    fn model_files<'a>(
        &'a self,
        tensors: &'a [(String, Tensor)],
        _tok: &'a Tokenizer,
    ) -> ModelFiles<'a> {
        ModelFiles::Copied(CopiedExport {
            source: &self.source,
            tensors,
        })
    }

    fn frozen_from(&self, tensors: HashMap<String, Tensor>) -> Result<FillInModel> {
        self.build(tensors)
    }

    /// An input masked on the fly: its masks drawn from the group's seed.
    fn round_input(&self, prompt_ids: &[u32], seed: u64) -> Vec<u32> {
        match &self.inputs {
            Some(f) => f.input(prompt_ids, seed),
            None => prompt_ids.to_vec(),
        }
    }

    /// Masked positions per input and fill accuracy against the original
    /// ([`FillInputs::metrics`]), the judge's mean score (the first reward scored by a model or
    /// the user's scorer), and the fill-in seed's names for grpo's metrics (`mean_reward`,
    /// `std_reward`, `mean_advantage`, `mean_kl`; `loss`, `pg_loss`, `kl_penalty` and
    /// `mean_log_prob` are grpo's names already).
    fn round_metrics(
        &self,
        m: &StepMetrics,
        episodes: &[Episode],
        rewards: &[Reward],
    ) -> Vec<(String, f64)> {
        let mut out = match &self.inputs {
            Some(f) => f.metrics(episodes),
            None => vec![],
        };
        if let Some(j) = rewards.iter().position(Reward::is_judge) {
            out.push((FILL_JUDGE_SCORE.into(), m.rewards[j].mean));
        }
        out.push(("mean_reward".into(), m.reward));
        out.push(("std_reward".into(), m.reward_std));
        out.push(("mean_advantage".into(), m.advantage_mean));
        if let Some(u) = &m.update {
            out.push(("mean_kl".into(), u.kl));
        }
        out
    }

    /// The input with its masks written out.
    fn shown_prompt(&self, tok: &Tokenizer, e: &Episode) -> Result<Option<String>> {
        match &self.inputs {
            Some(f) => f.display(tok, &e.prompt_ids).map(Some),
            None => Ok(None),
        }
    }
}

/// The generator's differentiable forward for one optimizer step.
pub struct FillInForward {
    model: FillInModel,
}

impl TrainForward for FillInForward {
    fn logprobs(
        &self,
        mb: &MicroBatch,
        _pad: u32,
        temperature: f64,
        entropy: Entropy,
    ) -> Result<(Tensor, Option<Tensor>)> {
        fill_logprobs(
            &self.model,
            &mb.prompts,
            &mb.completions,
            temperature,
            entropy,
        )
    }

    fn take_chunk_grad(&self, _v: &Var) -> Result<Option<Tensor>> {
        Ok(None)
    }

    fn take_step_grad(&self, _v: &Var) -> Result<Option<Tensor>> {
        Ok(None)
    }
}

impl LoadPolicy for FillInPolicy {
    /// bf16 does not apply; a `model` directory that cannot be a generator is refused before any
    /// reward model (the built-in judge is pretrained for minutes) is loaded.
    fn check(cfg: &TrainConfig, _device: &Device, _main: bool) -> Result<()> {
        if cfg.run.dtype != DTypeOpt::F32 {
            tracing::warn!("dtype = bf16 is not used by fill-in policies: they run in f32");
        }
        if let Some(m) = cfg.run.model.as_deref() {
            let dir = std::path::Path::new(m);
            if dir.join("config.json").is_file() {
                masked_lm_config(dir)?;
            }
        }
        Ok(())
    }

    /// The inputs checked for masks, or masked on the fly (`mask_ratio`); the held-out inputs
    /// masked once.
    fn prepare_inputs(
        &mut self,
        cfg: &TrainConfig,
        tok: &Tokenizer,
        data: &mut RunData,
        train_ids: &[Vec<u32>],
    ) -> Result<()> {
        let f = FillInputs::new(
            cfg.masking,
            self.mask_id,
            &self.special_ids,
            tok,
            &data.train,
            train_ids,
        )?;
        f.mask_held_out(tok, &mut data.eval, cfg.data.max_prompt_length)?;
        self.inputs = Some(f);
        Ok(())
    }

    /// `model` is the generator's HF directory; the parameters come from the checkpoint resumed
    /// from when there is one, the reference always from the generator as given.
    fn load(
        cfg: &TrainConfig,
        resume_from: Option<&PathBuf>,
        needs_ref: bool,
        device: &Device,
    ) -> Result<Loaded<Self>> {
        let dir = match cfg.run.model.as_deref() {
            // The built-in task's generator (pretrained once, then cached).
            None if cfg.data.train_file.is_none() => {
                crate::fill_in::pretrain::builtin_fill_in_models(&cfg.data.task(), false)?.0
            }
            None => {
                return Err(Error::config(
                    "model",
                    "policy = \"fill_in\" with a train_file needs model = the directory of a \
                     masked-LM generator (BERT, RoBERTa or DistilBERT *ForMaskedLM, or one \
                     `grpo pretrain` made)",
                ))
            }
            Some(spec) => resolve_generator(spec)?,
        };
        Self::load_from(cfg, dir, resume_from, needs_ref, device)
    }
}

/// `spec` as an HF directory (a GGUF file, a PyTorch pickle or a hub id that is not a directory
/// is refused, saying what loads).
fn resolve_generator(spec: &str) -> Result<PathBuf> {
    let p = std::path::Path::new(spec);
    // No extension: none of the refused ones below.
    let ext = p.extension().and_then(|e| e.to_str()).unwrap_or_default();
    if p.is_file() && matches!(ext, "pt" | "pth" | "ckpt" | "bin") {
        return Err(Error::file(
            p,
            "a PyTorch checkpoint of an unknown architecture: a fill-in generator is an HF \
             directory (config.json, model.safetensors, tokenizer.json) of a BERT, RoBERTa or \
             DistilBERT *ForMaskedLM, or one `grpo pretrain --objective mlm` made. Convert a \
             transformers model with `model.save_pretrained(dir)` and `tokenizer.save_pretrained(dir)`; \
             a model of your own architecture must be ported to one of these first",
        ));
    }
    Ok(match hub::resolve_model(Some(spec))? {
        ModelSource::HfDir(d) => d,
        other => {
            return Err(Error::config(
                "model",
                format!(
                    "{}: a fill-in generator is an HF directory (config.json, \
                     model.safetensors, tokenizer.json), not a GGUF file",
                    other.path().display()
                ),
            ))
        }
    })
}

impl FillInPolicy {
    fn load_from(
        cfg: &TrainConfig,
        dir: PathBuf,
        resume_from: Option<&PathBuf>,
        needs_ref: bool,
        device: &Device,
    ) -> Result<Loaded<Self>> {
        tracing::info!("fill-in generator: {}", dir.display());
        let mcfg = masked_lm_config(&dir)?;
        let (base, origin) = MaskedLm::read_tensors(&dir, device)?;
        // The parameters: the tensors the model is made of (a checkpoint may hold more).
        let base_model = MaskedLm::from_tensors(&mcfg, base.clone(), &origin)?;
        let names = base_model.parameter_names().to_vec();
        let start = match resume_from {
            Some(ck) => MaskedLm::read_tensors(ck, device)?.0,
            None => base.clone(),
        };
        let vars = names
            .iter()
            .map(|n| {
                let t = start.get(n).ok_or_else(|| {
                    Error::file(
                        resume_from.unwrap_or(&dir),
                        format!("missing tensor `{n}` of the generator"),
                    )
                })?;
                Ok(Var::from_tensor(t)?)
            })
            .collect::<Result<Vec<_>>>()?;
        let mt = MlmTokenizer::load(&dir, mcfg.max_len())?;
        let tok = Tokenizer::from_hf_dir(&dir)?;
        if let Some(judge) = &cfg.run.judge {
            same_vocabulary(&tok, &dir, judge)?;
        }
        let policy = FillInPolicy {
            cfg: mcfg,
            names,
            vars,
            device: device.clone(),
            mask_id: mt.mask_id(),
            special_ids: mt.special_ids().to_vec(),
            source: dir,
            inputs: None,
        };
        let reference = Reference {
            model: match needs_ref {
                true => Some(FillInModel::new(
                    base_model,
                    policy.mask_id,
                    &policy.special_ids,
                    device,
                )?),
                false => None,
            },
            tensors: (needs_ref && cfg.loss.sync_ref_model).then_some(base),
        };
        Ok(Loaded {
            policy,
            reference,
            tok,
            eos_ids: vec![],
        })
    }
}

/// `judge` (the `judge` key) reads the generator's text with the generator's tokenizer: a judge
/// that `grpo pretrain --objective judge --generator` made does. Another vocabulary would see
/// the fills as unknown tokens, so it is refused, with the way to use such a judge anyway.
fn same_vocabulary(
    tok: &Tokenizer,
    generator: &std::path::Path,
    judge: &std::path::Path,
) -> Result<()> {
    let jt = Tokenizer::from_hf_dir(judge)?;
    let (a, b) = (tok.vocab_size(), jt.vocab_size());
    let first_diff = (0..a.max(b) as u32).find(|&i| tok.id_to_token(i) != jt.id_to_token(i));
    match first_diff {
        None => Ok(()),
        Some(i) => Err(Error::config(
            "judge",
            format!(
                "{}: the judge's tokenizer differs from the generator's ({}): {} tokens against \
                 {}, first difference at id {i} ({:?} against {:?}). Train the judge on this \
                 generator (`grpo pretrain --objective judge --generator {}`), or, to score with \
                 a judge of another vocabulary on purpose, give it as a [[rewards]] table with \
                 kind = \"classifier\"",
                judge.display(),
                generator.display(),
                b,
                a,
                jt.id_to_token(i),
                tok.id_to_token(i),
                generator.display()
            ),
        )),
    }
}
