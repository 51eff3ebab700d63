//! The fill-in policy kind (`policy = "fill_in"`): a masked-LM generator (BERT, RoBERTa,
//! DistilBERT `*ForMaskedLM`, or a model `grpo pretrain` made) trained with the loop's GRPO
//! core. Prompts are masked inputs; completions are the tokens sampled at their masked
//! positions ([`crate::fill_in`]). The reference is the frozen initial generator.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{Device, Tensor, Var};

use super::policy::{Policy, Reference, TrainForward};
use super::setup::{LoadPolicy, Loaded};
use crate::checkpoint::{CopiedExport, ModelFiles};
use crate::config::TrainConfig;
use crate::fill_in::{fill_logprobs, FillInModel};
use crate::hub::{self, ModelSource};
use crate::logprobs::Entropy;
use crate::models::encoder::EncoderConfig;
use crate::models::masked_lm::{masked_lm_config, MaskedLm, MlmTokenizer};
use crate::optim::var_tensors;
use crate::rollout::MicroBatch;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

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
                crate::pretrain::builtin_fill_in_models(&cfg.data.task(), false)?.0
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
        let mask = Some((policy.mask_id, policy.special_ids.clone()));
        Ok(Loaded {
            policy,
            reference,
            tok,
            eos_ids: vec![],
            mask,
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
