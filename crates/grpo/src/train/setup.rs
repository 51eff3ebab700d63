//! Everything before the first round: the model and tokenizer, the prompt sets and rewards, the
//! policy's parameters (full fine-tuning or LoRA/QLoRA adapters, fresh or from a checkpoint), the
//! optimizer, the frozen reference, the resumed state, and the options each step uses, resolved
//! once from the config. Also the checkpoint that ends a round ([`Run::save`]).

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor, Var};

use super::policy::{CausalLmPolicy, Policy, Reference};
pub use super::state::{BestModel, TrainerState};
use super::update::{Schedule, UpdateOptions};
use super::world::World;
use crate::advantages::AdvantageOptions;
use crate::checkpoint::{self, CheckpointData};
use crate::config::{DTypeOpt, DeviceSpec, TrainConfig};
use crate::data::{self, PromptOrder};
use crate::inputs::{load_run_data, reward_weights, HostInputs, RunData};
use crate::logprobs::Entropy;
use crate::logs::MetricsWriter;
use crate::loss::KlMode;
use crate::optim::{AdamW, AdamWConfig, ZeroStage};
use crate::peft;
use crate::{Error, Result};
use grpo_models::hub::{self, ModelSource};
use grpo_models::kernels::{device_kind, DeviceKind};
use grpo_models::models::CausalLm;
use grpo_models::sampler::SamplingParams;
use grpo_models::tokenizer::Tokenizer;
use grpo_models::weights::load_model;

/// What a kind of policy loads for a run: the trainable policy (fresh, or from the checkpoint
/// resumed from), its frozen reference when one is needed, the tokenizer and the EOS ids.
pub struct Loaded<P: Policy> {
    pub policy: P,
    pub reference: Reference<P::Frozen>,
    pub tok: Tokenizer,
    pub eos_ids: Vec<u32>,
}

/// A kind of policy the loop can train: how a run checks its config, loads it and prepares its
/// inputs.
pub trait LoadPolicy: Policy + Sized {
    /// Checks the config before anything is loaded (and warns where an option does not apply
    /// on `device`).
    fn check(_cfg: &TrainConfig, _device: &Device, _main: bool) -> Result<()> {
        Ok(())
    }

    /// `needs_ref`: a KL term or a reward reads the reference's log-probs.
    fn load(
        cfg: &TrainConfig,
        resume_from: Option<&PathBuf>,
        needs_ref: bool,
        device: &Device,
    ) -> Result<Loaded<Self>>;

    /// Once the training prompts are tokenized (`train_ids`): checks or transforms the run's
    /// inputs (a fill-in generator's are masked). Default: prompts are used as they are.
    fn prepare_inputs(
        &mut self,
        _cfg: &TrainConfig,
        _tok: &Tokenizer,
        _data: &mut RunData,
        _train_ids: &[Vec<u32>],
    ) -> Result<()> {
        Ok(())
    }
}

/// A run, set up.
pub struct Run<'a, P: Policy = CausalLmPolicy> {
    pub cfg: &'a TrainConfig,
    pub tok: Tokenizer,
    pub pad: u32,
    pub data: RunData,
    /// Every training prompt, tokenized once.
    pub train_ids: Vec<Vec<u32>>,
    pub policy: P,
    pub opt: AdamW,
    pub reference: Reference<P::Frozen>,
    pub state: TrainerState,
    /// The checkpoint resumed from.
    pub resumed_from: Option<PathBuf>,
    pub metrics: MetricsWriter,
    /// The resolved config, as written into the run directory and every checkpoint.
    pub config_toml: String,
    pub opts: RoundOptions,
    /// Rounds in a row in which each reward was missing for every completion (not saved: a
    /// resumed run counts afresh).
    pub missing_streak: Vec<usize>,
    /// Multi-turn episodes with tools, when the config gives them.
    pub agent: Option<crate::agents::Agent>,
}

/// What every round uses, resolved once from the config and what the run loaded.
pub struct RoundOptions {
    /// Prompts and completions per prompt of a round.
    pub p: usize,
    pub g: usize,
    pub updates_per_round: u64,
    pub sampling: SamplingParams,
    pub adv: AdvantageOptions,
    /// One weight per reward function.
    pub weights: Vec<f32>,
    pub update: UpdateOptions,
    pub schedule: Schedule,
    /// Rewards scored while sampling runs (no reference log-probs needed).
    pub early_rewards: Vec<bool>,
    /// A reward reads the reference's log-probs (coherence).
    pub rewards_need_ref: bool,
    /// The loss's KL term needs the reference's log-probs.
    pub kl_needs_ref: bool,
    /// Updates are off-policy (several steps per round): the sampling policy's log-probs are kept.
    pub needs_old: bool,
    /// DAPO's dynamic sampling: groups without signal are replaced, for at most this many extra
    /// sampling passes per round.
    pub dynamic_sampling: bool,
    pub max_extra_passes: usize,
    /// Dynamic sampling: the first pass samples `ceil(P x oversample)` prompts.
    pub oversample: f64,
    /// `metric_for_best_model`: the best checkpoint is recorded and kept.
    pub best: Option<BestModel>,
}

impl<'a, P: LoadPolicy> Run<'a, P> {
    /// Sets up a run as `cfg` says, continuing from the newest checkpoint in `output_dir` when
    /// `resume`: the process (kernels, device), the resume point, the model and data, the
    /// optimizer and trainer state, the run's writers, and the options each round uses.
    pub fn start(
        cfg: &'a TrainConfig,
        resume: bool,
        host: &HostInputs,
        world: &dyn World,
    ) -> Result<Run<'a, P>> {
        let main = world.is_main();
        check_world(cfg, world)?;
        let device = process_device(cfg, world)?;
        P::check(cfg, &device, main)?;
        let resumed_from = resume_point(cfg, resume, main)?;
        let mut loaded = load::<P>(cfg, resumed_from.as_ref(), &device, host)?;
        if cfg.update.zero_stage == ZeroStage::Params {
            loaded
                .policy
                .shard_parameters(super::world::shared_ranks(world))?;
        }
        let (opt, state) =
            optimizer_and_state(cfg, &loaded, resumed_from.as_ref(), &device, world)?;
        let (metrics, config_toml) = writers(cfg, resumed_from.is_some(), main)?;
        let opts = RoundOptions::resolve(cfg, &loaded, world)?;
        let LoadedRun {
            tok,
            pad,
            data,
            train_ids,
            policy,
            reference,
            agent,
            ..
        } = loaded;
        let missing_streak = vec![0; data.rewards.len()];
        Ok(Run {
            missing_streak,
            cfg,
            tok,
            pad,
            data,
            train_ids,
            policy,
            opt,
            reference,
            state,
            resumed_from,
            metrics,
            config_toml,
            opts,
            agent,
        })
    }
}

/// `cfg` with `dtype = "auto"` resolved ([`DTypeOpt::resolve`]): bf16 on a GPU and on a CPU
/// whose bf16 products (grpo's fused kernels, AVX512_BF16 or AMX) measure at least 1.25x its f32
/// ones, f32 elsewhere. `None` when `dtype` is not `auto`. Runs once, before the run is set up;
/// in a world of several processes every rank takes bf16 only if all of them measured it so.
pub(super) fn resolve_dtype(cfg: &TrainConfig, world: &dyn World) -> Result<Option<TrainConfig>> {
    use grpo_models::kernels::{Compute, Isa};
    if cfg.run.dtype != DTypeOpt::Auto {
        return Ok(None);
    }
    if let Some(k) = cfg.run.kernels {
        grpo_models::kernels::set_kernels(k);
    }
    let mixed = cfg.run.policy == crate::config::PolicyType::CausalLm;
    let on_gpu = cfg.run.device.resolve().names_a_gpu();
    let cpu_mixed = Compute::resolve(&Device::Cpu, candle_core::DType::BF16).bf16_matmuls();
    let rates = (mixed && !on_gpu && cpu_mixed && Isa::active() >= Isa::Avx512Bf16)
        .then(grpo_models::kernels::cpu::gemm_bf16::rates)
        .and_then(|r| r.ok());
    let mut dtype = cfg.run.dtype.resolve(mixed, on_gpu, rates);
    let mut votes = [f64::from(u8::from(dtype == DTypeOpt::Bf16))];
    world.sum_f64(&mut votes)?;
    let split = votes[0] > 0.0 && votes[0] < world.size() as f64;
    if split {
        dtype = DTypeOpt::F32;
    }
    let why = match (mixed, on_gpu, rates) {
        (false, _, _) => "this policy computes in f32".to_string(),
        (true, true, _) => "a GPU".to_string(),
        (true, false, Some((b, f))) => format!(
            "this CPU's bf16 products run at {b:.0} GFLOP/s, its f32 ones at {f:.0} \
             (instruction set {})",
            Isa::active()
        ),
        (true, false, None) => format!(
            "this CPU has no bf16 products in grpo's kernels (instruction set {}, kernels {})",
            Isa::active(),
            grpo_models::kernels::kernels().name()
        ),
    };
    let name = if dtype == DTypeOpt::Bf16 {
        "bf16"
    } else {
        "f32"
    };
    if world.is_main() {
        let agreed = match split {
            true => "; f32 on every rank, as not all of them measured bf16 faster",
            false => "",
        };
        tracing::info!("dtype = auto: {name} ({why}{agreed})");
    }
    let mut c = cfg.clone();
    c.run.dtype = dtype;
    Ok(Some(c))
}

/// The process's side of a run: TRL keys not honoured (warned about), the CPU kernels, and the
/// device this rank trains on (one process per GPU: rank r of a node takes GPU N + r).
fn process_device(cfg: &TrainConfig, world: &dyn World) -> Result<Device> {
    let main = world.is_main();
    if main && !cfg.ignored_keys.is_empty() {
        let lines: Vec<String> = cfg
            .ignored_keys
            .iter()
            .map(|k| format!("  {k}: {}", crate::config::ignore_reason(k)))
            .collect();
        tracing::warn!(
            "config keys accepted for TRL compatibility but not honoured as TRL does:\n{}",
            lines.join("\n")
        );
    }
    if main && !cfg.trl_defaults_relied_on.is_empty() {
        let lines: Vec<String> = crate::config::DEFAULT_DIFFERENCES
            .iter()
            .filter(|d| cfg.trl_defaults_relied_on.contains(&d.0))
            .map(|(k, ours, theirs, why)| format!("  {k} = {ours} (TRL: {theirs}): {why}"))
            .collect();
        tracing::warn!(
            "this config is written for TRL and relies on grpo defaults that differ from TRL \
             1.16's (set them to keep TRL's; docs/config.md lists them):\n{}",
            lines.join("\n")
        );
    }
    if let Some(k) = cfg.run.kernels {
        grpo_models::kernels::set_kernels(k);
    }
    if main {
        tracing::info!(
            "kernels: {} (CPU instruction set {})",
            grpo_models::kernels::kernels().name(),
            grpo_models::kernels::Isa::active()
        );
    }
    let spec = cfg.run.device.resolve();
    let device = match spec {
        DeviceSpec::Cuda(n) => {
            DeviceSpec::Cuda(super::world::rank_gpu(n, world.size())).device()?
        }
        spec => spec.device()?,
    };
    if main {
        // What every model and optimizer of the run resolves to ([`Compute::resolve`]).
        let compute = grpo_models::kernels::Compute::resolve(&device, cfg.run.dtype.compute());
        let why = match (cfg.run.device, spec) {
            (DeviceSpec::Auto, DeviceSpec::Cpu) if candle_core::utils::cuda_is_available() => {
                " (device = auto: no GPU answered)"
            }
            (DeviceSpec::Auto, DeviceSpec::Cpu) => " (device = auto: a build without CUDA)",
            (DeviceSpec::Auto, _) => " (device = auto: a GPU answered)",
            _ => "",
        };
        tracing::info!("compute: {} on {device:?}{why}", compute.name());
    }
    Ok(device)
}

/// The checkpoint to resume from (`resume`: the newest in `output_dir`, which must exist), after
/// cleaning up what a kill in the middle of a checkpoint write left; creates `output_dir`.
fn resume_point(cfg: &TrainConfig, resume: bool, main: bool) -> Result<Option<PathBuf>> {
    let out_dir = &cfg.run.output_dir;
    if main {
        checkpoint::recover(out_dir)?;
    }
    let resume_from = if resume {
        // As TRL: resuming needs a checkpoint; a fresh start must be asked for.
        let latest = checkpoint::latest_checkpoint(out_dir)?.ok_or_else(|| {
            Error::file(
                out_dir,
                "--resume: no checkpoint-<step> directory here to resume from; check \
                 output_dir, or leave out --resume (and resume_from_checkpoint) to start a \
                 fresh run",
            )
        })?;
        Some(latest)
    } else {
        None
    };
    std::fs::create_dir_all(out_dir)
        .map_err(|e| Error::io(format!("cannot create output_dir {}", out_dir.display()), e))?;
    Ok(resume_from)
}

/// What [`load`] brings: the prompt sets and rewards, the policy and its reference, and the
/// prompts tokenized.
struct LoadedRun<P: Policy> {
    data: RunData,
    policy: P,
    reference: Reference<P::Frozen>,
    eos_ids: Vec<u32>,
    tok: Tokenizer,
    pad: u32,
    train_ids: Vec<Vec<u32>>,
    agent: Option<crate::agents::Agent>,
    /// The frozen reference is loaded only when a KL term or a reward (coherence) needs it.
    kl_needs_ref: bool,
    rewards_need_ref: bool,
}

/// The prompt sets and rewards, then the policy (fresh or from the checkpoint) and its frozen
/// reference, then every training prompt tokenized once (errors name the row) and handed to the
/// policy kind.
fn load<P: LoadPolicy>(
    cfg: &TrainConfig,
    resume_from: Option<&PathBuf>,
    device: &Device,
    host: &HostInputs,
) -> Result<LoadedRun<P>> {
    let mut data = load_run_data(cfg, device, host)?;
    let kl_needs_ref = !matches!(cfg.loss.kl(), KlMode::None);
    let rewards_need_ref = data.rewards.iter().any(|r| r.needs_ref_logp());
    let Loaded {
        mut policy,
        reference,
        tok,
        eos_ids,
    } = P::load(cfg, resume_from, kl_needs_ref || rewards_need_ref, device)?;
    let tok = crate::inputs::configured_tokenizer(cfg, tok)?;
    // Tools and environments: started now, their schemas in the chat template's variables.
    let (agent, tok) = crate::inputs::agent(cfg, tok)?;
    if let Some(agent) = &agent {
        crate::inputs::environment_rewards(agent, &mut data.rewards);
    }
    // `correctness_reward` among them all (the config checked those it knows), before training.
    if let Some(c) = cfg.eval_options(vec![]).correctness {
        c.index(&data.rewards, "correctness_reward")?;
    }
    super::trace_memory("loading the policy and reference", device);
    let pad = tok.pad_token_id().or(tok.eos_token_id()).unwrap_or(0);
    tracing::info!(
        "data: {} train prompts, {} eval prompts, rewards: {}",
        data.train.len(),
        data.eval.len(),
        data.rewards
            .iter()
            .map(|r| r.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let train_ids = data
        .train
        .iter()
        .map(|ex| {
            data::prompt_ids(
                &tok,
                ex,
                cfg.data.system_prompt.as_deref(),
                cfg.data.max_prompt_length,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    policy.prepare_inputs(cfg, &tok, &mut data, &train_ids)?;
    Ok(LoadedRun {
        data,
        policy,
        reference,
        eos_ids,
        tok,
        pad,
        train_ids,
        agent,
        kl_needs_ref,
        rewards_need_ref,
    })
}

/// A fresh AdamW over `policy`'s parameters, as the config sets it: its state sharded over
/// `world` as `zero_stage` says.
pub(super) fn new_optimizer<P: Policy>(
    cfg: &TrainConfig,
    policy: &P,
    world: &dyn World,
) -> Result<AdamW> {
    let hyper = AdamWConfig {
        beta1: cfg.update.adam_beta1,
        beta2: cfg.update.adam_beta2,
        eps: cfg.update.adam_epsilon,
        weight_decay: cfg.update.weight_decay,
    };
    if let Some(p) = policy.sharded() {
        return AdamW::over_sharded(p.clone(), hyper);
    }
    AdamW::sharded(
        policy
            .names()
            .iter()
            .cloned()
            .zip(policy.vars().iter().cloned())
            .collect(),
        hyper,
        cfg.update.zero_stage,
        world,
    )
}

/// One line on how the optimizer's state is sharded (`zero_stage` over several ranks).
fn log_sharding(opt: &AdamW, world: &dyn World) {
    let (stage, shard) = opt.sharding();
    if shard.parts() == 1 || !world.is_main() {
        return;
    }
    let what = match stage {
        ZeroStage::Gradients => "AdamW's moments and summed gradients",
        ZeroStage::Params => "the parameters, AdamW's moments and summed gradients",
        _ => "AdamW's moments",
    };
    tracing::info!(
        "zero_stage = {}: each of {} ranks keeps {what} of its range of the {:.2}M trainable \
         parameters (rank 0: {:.2}M, {:.1} MB of moments; unsharded: {:.1} MB)",
        stage.number(),
        shard.parts(),
        shard.total() as f64 / 1e6,
        shard.range().len() as f64 / 1e6,
        opt.state_bytes() as f64 / 1e6,
        8.0 * shard.total() as f64 / 1e6,
    );
}

/// AdamW over the policy's parameters and the trainer state: fresh, or both from the checkpoint
/// resumed from (then the logs are cut back to its step). A checkpoint's moments are whole,
/// whichever world wrote them: a sharded optimizer keeps its range of them.
fn optimizer_and_state<P: Policy>(
    cfg: &TrainConfig,
    run: &LoadedRun<P>,
    resume_from: Option<&PathBuf>,
    device: &Device,
    world: &dyn World,
) -> Result<(AdamW, TrainerState)> {
    let main = world.is_main();
    let mut opt = new_optimizer(cfg, &run.policy, world)?;
    log_sharding(&opt, world);
    let Some(dir) = resume_from else {
        let state = TrainerState {
            step: 0,
            round: 0,
            order: PromptOrder::new(run.data.train.len(), cfg.run.seed, cfg.data.shuffle_dataset),
            adaptive_kl: cfg.loss.kl().adaptive_controller(),
            adaptive_entropy: cfg.loss.adaptive_entropy().clone(),
            consecutive_nonfinite: 0,
            skipped_steps: 0,
            optimizer_steps: None,
            extra_passes: 0,
            best_metric: None,
            best_global_step: None,
            best_model_checkpoint: None,
        };
        return Ok((opt, state));
    };
    let c = checkpoint::load_checkpoint(dir, device)?;
    let state: TrainerState = serde_json::from_value(c.trainer_state.clone()).map_err(|e| {
        Error::file(
            c.dir.join("trainer_state.json"),
            format!("unreadable trainer state: {e}"),
        )
    })?;
    opt.load_state(&c.optimizer, state.optimizer_steps.unwrap_or(state.step))
        .map_err(|e| {
            Error::file(
                c.dir.join("optimizer.safetensors"),
                format!("does not fit this run's model: {e}; resume with the model and LoRA settings the checkpoint was made with"),
            )
        })?;
    if cfg.loss.sync_ref_model {
        tracing::warn!(
            "{}: sync_ref_model with resume restarts the reference from the base model",
            dir.display()
        );
    }
    if main {
        crate::logs::truncate_after(&cfg.run.output_dir, state.step)?;
    }
    tracing::info!("resumed from {} at step {}", c.dir.display(), state.step);
    Ok((opt, state))
}

/// The main rank's writers: config.toml (the resolved config), metrics.jsonl with TensorBoard
/// and the trackers `report_to` names. A fresh run replaces an earlier run's logs. Other ranks
/// write nothing.
fn writers(cfg: &TrainConfig, resumed: bool, main: bool) -> Result<(MetricsWriter, String)> {
    let out_dir = &cfg.run.output_dir;
    let config_toml = cfg.to_toml();
    if !main {
        return Ok((MetricsWriter::discard()?, config_toml));
    }
    if !resumed && crate::logs::clear_logs(out_dir)? {
        tracing::warn!(
            "{}: an earlier run's logs were here; this fresh run replaces them (use \
             --resume to continue that run instead)",
            out_dir.display()
        );
    }
    grpo_models::files::write_atomic(&out_dir.join("config.toml"), config_toml.as_bytes())?;
    let trackers = crate::trackers::Trackers::open(
        &cfg.logging.report_to,
        &crate::trackers::RunInfo {
            output_dir: out_dir.clone(),
            run_name: cfg.logging.run_name.clone().unwrap_or_else(|| {
                out_dir
                    .file_name()
                    .map_or_else(|| "grpo".into(), |n| n.to_string_lossy().into_owned())
            }),
            config: cfg.redacted().into_iter().collect(),
            resume: resumed,
            wandb_project: cfg.logging.wandb_project.clone(),
            project: cfg
                .logging
                .project
                .clone()
                .unwrap_or_else(|| "huggingface".into()),
        },
    );
    let metrics = MetricsWriter::open(
        out_dir,
        cfg.logging.report_to.iter().any(|r| r == "tensorboard"),
    )?
    .with_trackers(trackers);
    Ok((metrics, config_toml))
}

impl RoundOptions {
    /// The sampling temperature of the next round, which its log-probs and update use too.
    pub fn set_temperature(&mut self, t: f64) {
        self.sampling.temperature = t;
        self.update.temperature = t;
    }

    /// The options each round uses, from the config and what the run loaded.
    fn resolve<P: Policy>(
        cfg: &TrainConfig,
        run: &LoadedRun<P>,
        world: &dyn World,
    ) -> Result<RoundOptions> {
        // Every rank's batch is per_device_train_batch_size: the round's groups are the world's.
        let p = cfg.prompts_per_step() * world.size();
        let updates_per_round = (cfg.update.num_iterations * cfg.steps_per_generation
            / cfg.update.gradient_accumulation_steps) as u64;
        let rounds_per_epoch = (run.data.train.len() as f64 / p as f64).max(1.0);
        let total_steps = cfg.run.max_steps.unwrap_or_else(|| {
            (cfg.run.num_train_epochs * rounds_per_epoch).ceil() as u64 * updates_per_round
        });
        let warmup = if cfg.update.warmup_steps > 0 {
            cfg.update.warmup_steps as u64
        } else {
            (cfg.update.warmup_ratio * total_steps as f64).ceil() as u64
        };
        let weights = reward_weights(cfg, &run.data.rewards)?;
        let mut update = update_options(cfg, run.pad);
        if cfg.update.forward_chunk_tokens.is_none() {
            update.forward_chunk_tokens = run
                .policy
                .forward_chunk_tokens(cfg.update.gradient_checkpointing);
            if world.is_main() {
                tracing::info!(
                    "forward_chunk_tokens: {} (unset: sized for the device)",
                    update.forward_chunk_tokens
                );
            }
        }
        Ok(RoundOptions {
            p,
            g: cfg.generation.num_generations,
            updates_per_round,
            sampling: cfg.generation.sampling(run.eos_ids.clone()),
            adv: AdvantageOptions {
                scale: cfg.loss.scale_rewards,
                std_floor: cfg.loss.reward_std_floor.map(|f| f as f32),
                normalize_batch: cfg.loss.normalize_advantages_batch,
                epsilon: cfg.loss.advantage_epsilon as f32,
            },
            weights,
            update,
            schedule: Schedule {
                learning_rate: cfg.update.learning_rate,
                kind: cfg.update.lr_scheduler_type,
                warmup_steps: warmup,
                total_steps,
            },
            early_rewards: run
                .data
                .rewards
                .iter()
                .map(|r| r.overlaps_sampling())
                .collect(),
            rewards_need_ref: run.rewards_need_ref,
            kl_needs_ref: run.kl_needs_ref,
            needs_old: cfg.update.num_iterations > 1
                || cfg.steps_per_generation > cfg.update.gradient_accumulation_steps,
            dynamic_sampling: cfg.logging.dynamic_sampling,
            max_extra_passes: cfg.logging.dynamic_sampling_max_passes,
            oversample: cfg.logging.dynamic_sampling_oversample,
            best: cfg
                .logging
                .metric_for_best_model
                .clone()
                .map(|metric| BestModel {
                    metric,
                    greater_is_better: cfg.logging.greater_is_better(),
                }),
        })
    }
}

impl<P: Policy> Run<'_, P> {
    /// The optimizer's moments for a checkpoint, whole (gathered when sharded: every rank
    /// calls it when one is due), on the main rank; `None` on the others and with
    /// `save_only_model`.
    pub fn optimizer_state(&self, world: &dyn World) -> Result<Option<Vec<(String, Tensor)>>> {
        match self.cfg.logging.save_only_model {
            true => Ok(None),
            false => self.opt.consolidated_state(world),
        }
    }

    /// Writes a checkpoint of the current step (weights or adapters `tensors`, from the policy's
    /// [`Policy::named_tensors`], the optimizer moments `optimizer` from
    /// [`Self::optimizer_state`], trainer state, config) atomically; rotates old ones as
    /// `save_total_limit` says, keeping the best. `new_best`: this step's value of
    /// `metric_for_best_model`, when it is the best so far.
    pub fn save(
        &mut self,
        new_best: Option<f64>,
        tensors: &[(String, Tensor)],
        optimizer: Option<&[(String, Tensor)]>,
    ) -> Result<PathBuf> {
        if let Some(v) = new_best {
            let dir = self
                .cfg
                .run
                .output_dir
                .join(format!("checkpoint-{}", self.state.step));
            self.state.best_metric = Some(v);
            self.state.best_global_step = Some(self.state.step);
            self.state.best_model_checkpoint = Some(dir.display().to_string());
        }
        let adam = self.opt.steps_taken();
        self.state.optimizer_steps = (adam != self.state.step).then_some(adam);
        let keep = self.state.best_model_checkpoint.as_ref().map(PathBuf::from);
        let trainer_state = serde_json::to_value(&self.state).map_err(|e| {
            Error::checkpoint(
                &self.cfg.run.output_dir,
                format!("cannot serialise trainer state: {e}"),
            )
        })?;
        checkpoint::save_checkpoint(
            &self.cfg.run.output_dir,
            &CheckpointData {
                step: self.state.step,
                model: self.policy.model_files(tensors, &self.tok),
                optimizer,
                trainer_state: &trainer_state,
                config_toml: &self.config_toml,
            },
            self.cfg.logging.save_total_limit,
            keep.as_deref(),
        )
    }
}

/// What a data-parallel run needs of the config: whole groups in each rank's micro-batch.
fn check_world(cfg: &TrainConfig, world: &dyn World) -> Result<()> {
    let n = world.size();
    if n == 1 {
        return Ok(());
    }
    let g = cfg.generation.num_generations;
    if !cfg.update.per_device_train_batch_size.is_multiple_of(g) {
        return Err(Error::config(
            "per_device_train_batch_size",
            format!(
                "{}: with {n} ranks each rank's micro-batch holds whole groups: make it a \
                 multiple of num_generations ({g})",
                cfg.update.per_device_train_batch_size
            ),
        ));
    }
    Ok(())
}

/// The update's options, from the config.
pub fn update_options(cfg: &TrainConfig, pad: u32) -> UpdateOptions {
    UpdateOptions {
        loss: cfg.loss.options(),
        entropy: if cfg.loss.entropy_coef != 0.0 || cfg.loss.use_adaptive_entropy {
            Entropy::WithGrad
        } else {
            Entropy::Detached
        },
        temperature: cfg.generation.temperature,
        pad,
        forward_chunk_tokens: cfg
            .update
            .forward_chunk_tokens
            .unwrap_or(crate::logprobs::DEFAULT_FORWARD_CHUNK_TOKENS),
        max_grad_norm: cfg.update.max_grad_norm,
        gradient_checkpointing: cfg.update.gradient_checkpointing,
        seed: cfg.run.seed,
        micro_batch: cfg.update.per_device_train_batch_size,
        accumulation_steps: cfg.update.gradient_accumulation_steps,
        steps_per_generation: cfg.steps_per_generation,
        num_iterations: cfg.update.num_iterations,
        max_completion_length: cfg.generation.max_completion_length,
        max_bad_steps: cfg.update.max_bad_steps,
    }
}

impl LoadPolicy for CausalLmPolicy {
    fn check(cfg: &TrainConfig, device: &Device, main: bool) -> Result<()> {
        let isa = grpo_models::kernels::Isa::active();
        let compute = grpo_models::kernels::Compute::resolve(device, cfg.run.dtype.compute());
        if cfg.run.dtype != DTypeOpt::F32 && device_kind(device) == DeviceKind::Cpu && main {
            if !compute.bf16_matmuls() {
                tracing::warn!(
                    "dtype = bf16 on the CPU without grpo's bf16 matmuls (kernels = portable, or \
                     no AVX-512: instruction set {isa}): candle multiplies bf16 matrices by \
                     widening them to f32, slower than dtype = \"f32\""
                );
            } else if isa < grpo_models::kernels::Isa::Avx512Bf16 {
                tracing::warn!(
                    "dtype = bf16 on a CPU without AVX512_BF16 (instruction set {isa}): the bf16 \
                     matmuls are emulated with f32 FMAs, slower than dtype = \"f32\""
                );
            } else if let Ok((bf16, f32)) = grpo_models::kernels::cpu::gemm_bf16::rates() {
                // Some CPUs issue `vdpbf16ps` at half the f32 FMA's rate: measured, not assumed.
                match bf16 < f32 {
                    true => tracing::warn!(
                        "dtype = bf16: this CPU's bf16 products run at {bf16:.0} GFLOP/s, its f32 \
                         ones at {f32:.0} (instruction set {isa}), so dtype = \"f32\" is likely \
                         faster here (`grpo bench gemm` measures both at more shapes)"
                    ),
                    false => tracing::info!(
                        "CPU mixed precision: bf16 products at {bf16:.0} GFLOP/s, f32 at {f32:.0} \
                         (instruction set {isa})"
                    ),
                }
            }
        }
        Ok(())
    }

    /// The model `cfg.run.model` names (hub id, HF directory or GGUF). The reference holds the base
    /// weights (never the resumed ones); its HF-layout tensors are kept only when they are mixed
    /// with the policy's later (`sync_ref_model`), otherwise the built model's own layout is the
    /// only copy. With LoRA the reference is the frozen base itself, adapters off.
    fn load(
        cfg: &TrainConfig,
        resume_from: Option<&PathBuf>,
        needs_ref: bool,
        device: &Device,
    ) -> Result<Loaded<Self>> {
        let source = hub::resolve_model(cfg.run.model.as_deref())?;
        tracing::info!("model: {}", source.path().display());
        let mut base = load_model(&source, DType::F32, device)?;
        let tok = base.tokenizer()?.clone();
        let policy = policy_parameters(cfg, &source, &mut base, resume_from, device)?;
        let reference = Reference {
            model: match (needs_ref, &policy.lora) {
                (false, _) => None,
                (true, Some((frozen, _))) => Some(frozen.clone()),
                (true, None) => {
                    let mut m = CausalLm::from_tensors(
                        &base.config,
                        base.tensors.clone(),
                        cfg.run.dtype.compute(),
                        device,
                    )?;
                    // CPU mixed precision: the reference's products read bf16 panels packed once
                    // (half its f32 copy's memory; the same numbers as packing at every call).
                    if m.compute().bf16_matmuls() {
                        m.pack_for_decoding()?;
                    }
                    Some(m)
                }
            },
            tensors: (needs_ref && cfg.loss.sync_ref_model).then(|| base.tensors.clone()),
        };
        Ok(Loaded {
            policy,
            reference,
            tok,
            eos_ids: base.eos_token_ids.clone(),
        })
    }
}

/// The policy's parameters: full fine-tuning trains every base tensor (from the checkpoint when
/// resuming); LoRA trains adapters (fresh, or from the checkpoint) over a frozen base, which
/// takes the base tensors (a QLoRA base is quantized projection by projection as it is built).
fn policy_parameters(
    cfg: &TrainConfig,
    source: &ModelSource,
    base: &mut grpo_models::weights::LoadedModel,
    resume_from: Option<&PathBuf>,
    device: &Device,
) -> Result<CausalLmPolicy> {
    let (names, vars, frozen_base) = match &cfg.lora.adapters() {
        None => {
            let start_tensors = match resume_from {
                Some(dir) => {
                    load_model(&ModelSource::HfDir(dir.clone()), DType::F32, device)?.tensors
                }
                None => base.tensors.clone(),
            };
            let mut names: Vec<String> = start_tensors.keys().cloned().collect();
            names.sort();
            let vars = names
                .iter()
                .map(|n| Var::from_tensor(&start_tensors[n]))
                .collect::<candle_core::Result<Vec<_>>>()?;
            (names, vars, None)
        }
        Some(lcfg) => {
            let mut lcfg = lcfg.clone();
            if lcfg.target_modules.is_empty() {
                lcfg.target_modules = peft::default_targets(base.config.arch);
            }
            let mut build_cfg = base.config.clone();
            build_cfg.build_quantized = cfg.lora.base_quantization;
            let mut frozen = CausalLm::from_tensors(
                &build_cfg,
                std::mem::take(&mut base.tensors),
                cfg.run.dtype.compute(),
                device,
            )?;
            if let Some(q) = cfg.lora.base_quantization {
                // A GGUF's weights of this type are used as they are; the rest are quantized.
                let given = match source {
                    ModelSource::Gguf(p) => grpo_models::weights::gguf_quantized_projections(p, q)?,
                    ModelSource::HfDir(_) => HashMap::new(),
                };
                let n = frozen.use_quantized(&given, q)?;
                tracing::info!(
                    "QLoRA: base projections kept in {} ({:.0} MB), {n} taken from the GGUF as they are",
                    q.name(),
                    frozen.quantized_bytes() as f64 / 1e6
                );
            }
            let tensors = match resume_from {
                Some(dir) => {
                    let a = peft::load_peft(dir, device)?;
                    if a.config.r != lcfg.r || a.config.target_modules != lcfg.target_modules {
                        return Err(Error::file(
                            dir.join(peft::ADAPTER_CONFIG),
                            format!(
                                "the checkpoint's adapters (r = {}, targets {:?}) differ from this run's (r = {}, targets {:?}): resume with the same lora.* settings",
                                a.config.r, a.config.target_modules, lcfg.r, lcfg.target_modules
                            ),
                        ));
                    }
                    a.tensors
                }
                None => peft::init_weights(&frozen, &lcfg, cfg.run.seed, device)?,
            };
            let n_params: usize = tensors.iter().map(|(_, t)| t.elem_count()).sum();
            tracing::info!(
                "LoRA: r = {}, alpha = {}, {} adapted projections ({:?}), {:.2}M trainable parameters",
                lcfg.r,
                lcfg.alpha,
                tensors.len() / 2,
                lcfg.target_modules,
                n_params as f64 / 1e6
            );
            let names = tensors.iter().map(|(n, _)| n.clone()).collect();
            let vars = tensors
                .iter()
                .map(|(_, t)| Var::from_tensor(t))
                .collect::<candle_core::Result<Vec<_>>>()?;
            (names, vars, Some((frozen, lcfg)))
        }
    };
    Ok(CausalLmPolicy {
        sharded: None,
        cfg: base.config.clone(),
        names,
        vars,
        device: device.clone(),
        dtype: cfg.run.dtype.compute(),
        lora: frozen_base,
        base_model_name: hub::portable_model_name(cfg.run.model.as_deref(), source),
        generation_config: checkpoint::source_generation_config(source.path()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use grpo_models::kernels::{kernels, Isa, Kernels};

    fn cfg(overrides: &[&str]) -> TrainConfig {
        let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        TrainConfig::load(None, &o).unwrap()
    }

    /// `dtype = "auto"` on this CPU: f32 without bf16 products in the fused kernels, and where it
    /// has them, what their measured rate says (asserted only where the rates are far apart, as
    /// the resolution measures them again); a fill-in policy and a given dtype are left alone.
    #[test]
    fn auto_dtype_resolves_on_this_cpu() {
        let one = super::super::SingleProcess;
        let resolve = |c: &TrainConfig| resolve_dtype(c, &one).unwrap();
        assert!(resolve(&cfg(&["--dtype=f32"])).is_none());
        assert!(resolve(&cfg(&["--dtype=bf16"])).is_none());
        let fill_in = cfg(&["--policy=fill_in", "--dtype=auto"]);
        assert_eq!(resolve(&fill_in).unwrap().run.dtype, DTypeOpt::F32);
        let auto = cfg(&["--dtype=auto", "--device=cpu"]);
        let got = resolve(&auto).unwrap();
        let mut want = auto.clone();
        want.run.dtype = got.run.dtype;
        assert_eq!(got, want, "only dtype changes");
        if Isa::active() < Isa::Avx512Bf16 || kernels() != Kernels::Fused {
            assert_eq!(got.run.dtype, DTypeOpt::F32);
        }
        // Where the CPU has bf16 products the choice follows rates measured at resolve time
        // (its rule, `DTypeOpt::resolve`, is pinned with fixed rates in config's tests): a
        // second measurement here would make this a timed test (it failed on a loaded 2-core
        // CI machine at 48 against 52 GFLOP/s where resolve had measured bf16 faster).
        assert!(matches!(got.run.dtype, DTypeOpt::F32 | DTypeOpt::Bf16));
    }
}
