//! The GRPO training loop, top to bottom: rollout, score, advantages, update, log, checkpoint.
//!
//! One *round* = one generation batch: `P` prompts x `G` completions, sampled with the current
//! policy, scored, turned into advantages, then used for `num_iterations x steps_per_generation /
//! gradient_accumulation_steps` optimizer steps of `gradient_accumulation_steps` micro-batches of
//! `per_device_train_batch_size` completions each (TRL's semantics). Checkpoints and resume happen
//! at round boundaries, so a resumed run replays exactly what the uninterrupted one does.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use serde_json::json;

use crate::advantages::RewardAggregation;
use crate::advantages::{
    combine_rewards, decoupled_advantages, group_advantages, AdvantageOptions,
};
use crate::checkpoint::{self, AdapterExport, CheckpointData, HfExport, ModelFiles};
use crate::config::TrainConfig;
use crate::data::{self, PromptOrder};
use crate::hub::{self, ModelSource};
use crate::logprobs::{completion_logprobs, forward_chunks, Entropy, Packing};
use crate::lora::{self, LoraConfig};
use crate::loss::KlMode;
use crate::loss::{grpo_loss, AdaptiveKl, LossInputs, LossOptions, MicroTotals, Reduction};
use crate::metrics::MetricsWriter;
use crate::models::checkpointing::CheckpointGrads;
use crate::models::grad_sink::GradSink;
use crate::models::{CausalLm, Mode, ModelConfig};
use crate::optim::{clip_factor, lr_lambda, AdamW, AdamWConfig};
use crate::rewards::Reward;
use crate::rollout::{self, Episode, TrainBatch, TrainRow};
use crate::sampler::SamplingParams;
use crate::seeding::mix_seed;
use crate::tokenizer::Tokenizer;
use crate::weights::load_model;
use crate::{Error, Result};

/// How the run is controlled from outside.
#[derive(Debug, Clone, Default)]
pub struct RunControl {
    /// Continue from the newest checkpoint in `output_dir`.
    pub resume: bool,
    /// Set (e.g. by Ctrl-C) to stop after the current round, saving a checkpoint.
    pub stop: Arc<AtomicBool>,
    /// Stop after this many rounds of this invocation (tests: "kill" a run after step k).
    pub max_rounds_this_run: Option<u64>,
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct TrainOutcome {
    /// Optimizer steps done in total (including before a resume).
    pub steps: u64,
    pub last_checkpoint: Option<PathBuf>,
    pub interrupted: bool,
    /// The last eval metrics, if any eval ran.
    pub last_eval: Option<Vec<(String, f64)>>,
}

/// Everything a checkpoint must hold beyond weights and moments to resume exactly.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct TrainerState {
    /// Optimizer steps done.
    step: u64,
    /// Rounds (generation batches) done.
    round: u64,
    order: PromptOrder,
    adaptive_kl: Option<AdaptiveKl>,
    consecutive_nonfinite: usize,
}

/// The policy: trainable `Var`s by name, plus what is needed to rebuild models over them.
struct Policy {
    cfg: ModelConfig,
    /// HF tensor names (full fine-tuning) or PEFT adapter keys (LoRA).
    names: Vec<String>,
    vars: Vec<Var>,
    device: Device,
    /// LoRA: the frozen base model (with adapters off it is also the reference) and the options.
    lora: Option<(CausalLm, LoraConfig)>,
}

impl Policy {
    fn tensors(&self, track: bool) -> Vec<(String, Tensor)> {
        self.names
            .iter()
            .zip(&self.vars)
            .map(|(n, v)| {
                let t = v.as_tensor();
                (n.clone(), if track { t.clone() } else { t.detach() })
            })
            .collect()
    }

    /// A detached model over the current parameters (sampling, old log-probs, evaluation).
    fn build(&self) -> Result<CausalLm> {
        self.build_with(false, None)
    }

    /// [`Self::build`], packed for the decoding GEMM (`models::packed`) unless `save_memory`
    /// (gradient checkpointing asked for): with LoRA the packed copy of the whole base (the size of
    /// the f32 model) would then set the run's peak memory.
    fn build_for_sampling(&self, save_memory: bool) -> Result<CausalLm> {
        let mut m = self.build()?;
        if !save_memory {
            m.pack_for_decoding()?;
        }
        Ok(m)
    }

    /// A differentiable model over the current parameters. LoRA dropout masks are drawn from
    /// `dropout_seed` and the returned clock, which the caller advances once per forward pass.
    fn build_train(&self, dropout_seed: u64) -> Result<(CausalLm, Arc<AtomicU64>)> {
        let clock = Arc::new(AtomicU64::new(0));
        let m = self.build_with(true, Some((dropout_seed, clock.clone())))?;
        Ok((m, clock))
    }

    fn build_with(&self, track: bool, dropout: Option<(u64, Arc<AtomicU64>)>) -> Result<CausalLm> {
        match &self.lora {
            None => {
                let tensors: HashMap<String, Tensor> = self.tensors(track).into_iter().collect();
                CausalLm::from_tensors(&self.cfg, tensors, DType::F32, &self.device)
            }
            Some((base, lcfg)) => {
                let mut m = base.clone();
                let adapters = lora::adapters(&self.tensors(track), lcfg, dropout)?;
                if track {
                    m.set_lora(&adapters)?;
                } else {
                    // Sampling and scoring: adapters merged into (copies of) the dense weights
                    // they touch, no extra matmuls per decoded token.
                    m.merge_lora(&adapters)?;
                }
                Ok(m)
            }
        }
    }

    fn named_tensors(&self) -> Vec<(String, Tensor)> {
        self.tensors(false)
    }
}

/// Per-token log-probs `[N][len]` of `rows` (prompt, completion) under `model`, without a graph,
/// in packed forward chunks of at most `chunk_tokens` tokens.
fn logprobs_of(
    model: &CausalLm,
    rows: &[(&[u32], &[u32])],
    pad: u32,
    temperature: f64,
    chunk_tokens: usize,
) -> Result<Vec<Vec<f32>>> {
    let prompts: Vec<&[u32]> = rows.iter().map(|r| r.0).collect();
    let comps: Vec<&[u32]> = rows.iter().map(|r| r.1).collect();
    let mut out = Vec::with_capacity(rows.len());
    for part in forward_chunks(&prompts, &comps, chunk_tokens) {
        let (lp, _) = completion_logprobs(
            model,
            &prompts[part.clone()],
            &comps[part.clone()],
            pad,
            temperature,
            Mode::Infer,
            Entropy::Skip,
            Packing::SharedPrompt,
        )?; // [n, Tc]
        let lens: Vec<usize> = comps[part].iter().map(|c| c.len()).collect();
        out.extend(rollout::unpad_rows(&lp, &lens)?);
    }
    Ok(out)
}

/// Evaluation on the held-out prompts as the config's `eval_*` keys say (see [`crate::eval`]):
/// pass@k, sampled and greedy accuracy, mean rewards. Every answer goes to `eval/step-N.jsonl`.
#[allow(clippy::too_many_arguments)]
fn evaluate(
    cfg: &TrainConfig,
    model: &CausalLm,
    tok: &Tokenizer,
    ds: &crate::inputs::RunData,
    params: &SamplingParams,
    step: u64,
    metrics: &mut MetricsWriter,
) -> Result<Vec<(String, f64)>> {
    let opts = cfg.eval_options(params.eos_token_ids.clone());
    let file = format!("eval/step-{step}.jsonl");
    let mut log = |row: &serde_json::Value| metrics.log_json(&file, row);
    let report = crate::eval::evaluate(model, tok, &ds.eval, &ds.rewards, &opts, Some(&mut log))?;
    Ok(report.metrics)
}

fn reward_map(rewards: &[Reward], scores: &[f32]) -> serde_json::Value {
    let m: serde_json::Map<String, serde_json::Value> = rewards
        .iter()
        .zip(scores)
        .map(|(r, &s)| {
            (
                r.name.clone(),
                if s.is_finite() {
                    json!(s)
                } else {
                    serde_json::Value::Null
                },
            )
        })
        .collect();
    serde_json::Value::Object(m)
}

fn mean(xs: impl IntoIterator<Item = f64>) -> f64 {
    let (s, n) = xs
        .into_iter()
        .fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 {
        0.0
    } else {
        s / n as f64
    }
}

/// Runs GRPO training as configured.
pub fn train(cfg: &TrainConfig, ctl: &RunControl) -> Result<TrainOutcome> {
    if let Some(n) = cfg.threads {
        if let Err(e) = crate::threads::set_global_threads(n) {
            tracing::warn!("threads: {e}");
        }
    }
    crate::threads::on_pool(|| run(cfg, ctl))
}

fn run(cfg: &TrainConfig, ctl: &RunControl) -> Result<TrainOutcome> {
    // ---------------------------------------------------------------- set-up
    for k in &cfg.ignored_keys {
        tracing::warn!("config key `{k}` is accepted for TRL compatibility and ignored");
    }
    let device = Device::Cpu;
    if cfg.dtype != crate::config::DTypeOpt::F32 {
        tracing::warn!(
            "dtype = bf16 is not used by training yet: sampling, reference and training run in f32"
        );
    }
    let out_dir = cfg.output_dir.clone();
    std::fs::create_dir_all(&out_dir)
        .map_err(|e| Error::io(format!("cannot create output_dir {}", out_dir.display()), e))?;
    let resume_from = if ctl.resume {
        let latest = checkpoint::latest_checkpoint(&out_dir)?;
        if latest.is_none() {
            tracing::warn!(
                "--resume: no checkpoint in {}, starting fresh",
                out_dir.display()
            );
        }
        latest
    } else {
        None
    };
    let source = hub::resolve_model(cfg.model.as_deref())?;
    tracing::info!("model: {}", source.path().display());
    // What LoRA checkpoints name as their base (`base_model_name_or_path`).
    let base_model_name = source.path().display().to_string();
    let mut base = load_model(&source, DType::F32, &device)?;
    let tok = base.tokenizer()?.clone();
    let pad = tok.pad_token_id().or(tok.eos_token_id()).unwrap_or(0);
    let ds = crate::inputs::load_run_data(cfg, &device)?;
    tracing::info!(
        "data: {} train prompts, {} eval prompts, rewards: {}",
        ds.train.len(),
        ds.eval.len(),
        ds.rewards
            .iter()
            .map(|r| r.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    // Tokenize every training prompt once; errors name the row.
    let train_ids = ds
        .train
        .iter()
        .map(|ex| {
            data::prompt_ids(
                &tok,
                ex,
                cfg.system_prompt.as_deref(),
                cfg.max_prompt_length,
            )
        })
        .collect::<Result<Vec<_>>>()?;

    // Policy parameters: full fine-tuning trains every base tensor (from the checkpoint when
    // resuming); LoRA trains adapters (fresh, or from the checkpoint) over a frozen base.
    let (names, vars, frozen_base) = match &cfg.lora {
        None => {
            let start_tensors = match &resume_from {
                Some(dir) => {
                    load_model(&ModelSource::HfDir(dir.clone()), DType::F32, &device)?.tensors
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
                lcfg.target_modules = lora::default_targets(base.config.arch);
            }
            // The base tensors move into the frozen model (the reference too: nothing else
            // needs them); a QLoRA base is quantized projection by projection as it is built.
            let mut build_cfg = base.config.clone();
            build_cfg.build_quantized = cfg.base_quantization;
            let mut frozen = CausalLm::from_tensors(
                &build_cfg,
                std::mem::take(&mut base.tensors),
                DType::F32,
                &device,
            )?;
            if let Some(q) = cfg.base_quantization {
                // A GGUF's weights of this type are used as they are; the rest are quantized.
                let given = match &source {
                    ModelSource::Gguf(p) => crate::weights::gguf_quantized_projections(p, q)?,
                    ModelSource::HfDir(_) => HashMap::new(),
                };
                let n = frozen.use_quantized(&given, q)?;
                tracing::info!(
                    "QLoRA: base projections kept in {} ({:.0} MB), {n} taken from the GGUF as they are",
                    q.name(),
                    frozen.quantized_bytes() as f64 / 1e6
                );
            }
            let tensors = match &resume_from {
                Some(dir) => {
                    let a = lora::load_peft(dir, &device)?;
                    if a.config.r != lcfg.r || a.config.target_modules != lcfg.target_modules {
                        return Err(Error::file(
                            dir.join(lora::ADAPTER_CONFIG),
                            format!(
                                "the checkpoint's adapters (r = {}, targets {:?}) differ from this run's (r = {}, targets {:?}): resume with the same lora.* settings",
                                a.config.r, a.config.target_modules, lcfg.r, lcfg.target_modules
                            ),
                        ));
                    }
                    a.tensors
                }
                None => lora::init_weights(&frozen, &lcfg, cfg.seed, &device)?,
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
    let ckpt = match &resume_from {
        Some(dir) => Some(checkpoint::load_checkpoint(dir, &device)?),
        None => None,
    };
    let policy = Policy {
        cfg: base.config.clone(),
        names: names.clone(),
        vars,
        device: device.clone(),
        lora: frozen_base,
    };
    let mut opt = AdamW::new(
        names
            .iter()
            .cloned()
            .zip(policy.vars.iter().cloned())
            .collect(),
        AdamWConfig {
            beta1: cfg.adam_beta1,
            beta2: cfg.adam_beta2,
            eps: cfg.adam_epsilon,
            weight_decay: cfg.weight_decay,
        },
    )?;

    // The frozen reference: the base weights (never the resumed ones), only when a KL or a
    // reward (coherence) needs it.
    let kl_needs_ref = !matches!(cfg.kl, KlMode::None);
    let rewards_need_ref = ds.rewards.iter().any(|r| r.needs_ref_logp());
    let early_rewards: Vec<bool> = ds.rewards.iter().map(|r| r.overlaps_sampling()).collect();
    let needs_ref = kl_needs_ref || rewards_need_ref;
    // Its HF-layout tensors are kept only when they are mixed with the policy's later
    // (`sync_ref_model`); otherwise the built model's own layout is the only copy.
    // With LoRA the reference is the frozen base itself, adapters off: no second copy.
    let mut ref_model = match (needs_ref, &policy.lora) {
        (false, _) => None,
        (true, Some((frozen, _))) => Some(frozen.clone()),
        (true, None) => Some(CausalLm::from_tensors(
            &base.config,
            base.tensors.clone(),
            DType::F32,
            &device,
        )?),
    };
    let mut ref_tensors: Option<HashMap<String, Tensor>> =
        (needs_ref && cfg.sync_ref_model).then(|| base.tensors.clone());
    let eos_ids = base.eos_token_ids.clone();
    drop(base);
    trace_memory("loading the policy, optimizer and reference");

    // Run state.
    let p = cfg.prompts_per_step();
    let g = cfg.num_generations;
    let mut state = TrainerState {
        step: 0,
        round: 0,
        order: PromptOrder::new(ds.train.len(), cfg.seed, cfg.shuffle_dataset),
        adaptive_kl: match &cfg.kl {
            KlMode::Reward {
                coef,
                adaptive: Some(a),
            } => Some(AdaptiveKl {
                coef: *coef,
                target: a.target,
                horizon: a.horizon,
            }),
            _ => None,
        },
        consecutive_nonfinite: 0,
    };
    if let Some(c) = &ckpt {
        state = serde_json::from_value(c.trainer_state.clone()).map_err(|e| {
            Error::file(
                c.dir.join("trainer_state.json"),
                format!("unreadable trainer state: {e}"),
            )
        })?;
        opt.load_state(&c.optimizer, state.step)?;
        if let (Some(dir), true) = (&resume_from, cfg.sync_ref_model) {
            tracing::warn!(
                "{}: sync_ref_model with resume restarts the reference from the base model",
                dir.display()
            );
        }
        crate::metrics::truncate_after(&out_dir, state.step)?;
        tracing::info!("resumed from {} at step {}", c.dir.display(), state.step);
    }
    let config_toml = cfg.to_toml();
    std::fs::write(out_dir.join("config.toml"), &config_toml).map_err(|e| {
        Error::io(
            format!("cannot write {}", out_dir.join("config.toml").display()),
            e,
        )
    })?;
    let mut metrics =
        MetricsWriter::open(&out_dir, cfg.report_to.iter().any(|r| r == "tensorboard"))?;

    let updates_per_round =
        (cfg.num_iterations * cfg.steps_per_generation / cfg.gradient_accumulation_steps) as u64;
    let rounds_per_epoch = (ds.train.len() as f64 / p as f64).max(1.0);
    let total_steps = cfg.max_steps.unwrap_or_else(|| {
        (cfg.num_train_epochs * rounds_per_epoch).ceil() as u64 * updates_per_round
    });
    let warmup = if cfg.warmup_steps > 0 {
        cfg.warmup_steps as u64
    } else {
        (cfg.warmup_ratio * total_steps as f64).ceil() as u64
    };
    let sampling = SamplingParams {
        max_new_tokens: cfg.max_completion_length,
        min_new_tokens: 0,
        temperature: cfg.temperature,
        top_k: cfg.top_k,
        top_p: cfg.top_p,
        min_p: cfg.min_p.unwrap_or(0.0),
        repetition_penalty: cfg.repetition_penalty,
        stop_strings: cfg.stop.clone(),
        eos_token_ids: eos_ids,
    };
    let loss_opts = LossOptions {
        loss_type: cfg.loss_type,
        importance_sampling_level: cfg.importance_sampling_level,
        epsilon_low: cfg.epsilon,
        epsilon_high: cfg.epsilon_high,
        delta: cfg.delta,
        beta: match cfg.kl {
            KlMode::Loss { beta } => beta,
            _ => 0.0,
        },
        entropy_coef: cfg.entropy_coef,
        use_bias_correction_kl: cfg.use_bias_correction_kl,
    };
    let adv_opts = AdvantageOptions {
        scale: cfg.scale_rewards,
        std_floor: cfg.reward_std_floor.map(|f| f as f32),
        normalize_batch: cfg.normalize_advantages_batch,
    };
    let weights: Vec<f32> = match &cfg.reward_weights {
        Some(w) if w.len() != ds.rewards.len() => {
            return Err(Error::config(
                "reward_weights",
                format!(
                    "{} weights for {} reward functions",
                    w.len(),
                    ds.rewards.len()
                ),
            ))
        }
        Some(w) => w.iter().map(|&x| x as f32).collect(),
        None => ds.rewards.iter().map(|r| r.weight).collect(),
    };
    let needs_old =
        cfg.num_iterations > 1 || cfg.steps_per_generation > cfg.gradient_accumulation_steps;
    let entropy_mode = if cfg.entropy_coef != 0.0 {
        Entropy::WithGrad
    } else {
        Entropy::Detached
    };
    let bar = indicatif::ProgressBar::new(total_steps);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} steps  {elapsed_precise} < {eta_precise}  {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_position(state.step);
    let mut last_ckpt = resume_from.clone();
    let mut last_eval = None;
    let mut rounds_this_run = 0u64;
    let mut interrupted = false;
    if cfg.eval_steps > 0 && !ds.eval.is_empty() && state.step == 0 {
        let model = policy.build_for_sampling(cfg.gradient_checkpointing)?;
        let ev = evaluate(cfg, &model, &tok, &ds, &sampling, 0, &mut metrics)?;
        let acc = ev
            .iter()
            .find(|(n, _)| n == "eval/accuracy")
            .map_or(f64::NAN, |x| x.1);
        say(
            &bar,
            format!("step    0  eval acc {acc:.3} (before training)"),
        );
        metrics.log(0, &ev)?;
    }
    tracing::info!(
        "training: {total_steps} steps, {p} prompts x {g} completions per round, {updates_per_round} optimizer step(s) per round, output {}",
        out_dir.display()
    );

    // ---------------------------------------------------------------- rounds
    while state.step < total_steps {
        let t_round = Instant::now();
        // 1. Rollout with the current policy; rewards that allow it score each group on a
        //    second thread as soon as the group has finished sampling.
        let t0 = Instant::now();
        let sampler_model = policy.build_for_sampling(cfg.gradient_checkpointing)?;
        let batch_idx = state.order.next_batch(p);
        let prompt_ids: Vec<Vec<u32>> = batch_idx.iter().map(|&i| train_ids[i].clone()).collect();
        let seeds: Vec<u64> = (0..p)
            .map(|i| mix_seed(cfg.seed, state.round * p as u64 + i as u64))
            .collect();
        let (mut episodes, gen_stats, early) = rollout::rollout_scoring_early(
            &sampler_model,
            &tok,
            &batch_idx,
            prompt_ids,
            &seeds,
            g,
            &sampling,
            &ds.train,
            &ds.rewards,
            &early_rewards,
        )?;
        for (ep, s) in episodes.iter_mut().zip(early.scores) {
            ep.rewards = s;
        }
        let t_generate = t0.elapsed().as_secs_f64() - early.wait_s;
        trace_memory("rollout");

        // 2. Old (sampling-policy) and reference log-probs, without a graph.
        let t0 = Instant::now();
        let pairs: Vec<(&[u32], &[u32])> = episodes
            .iter()
            .map(|e| (e.prompt_ids.as_slice(), e.completion_ids.as_slice()))
            .collect();
        let kl_in_reward = matches!(cfg.kl, KlMode::Reward { .. });
        let old_logps = if needs_old || kl_in_reward {
            Some(logprobs_of(
                &sampler_model,
                &pairs,
                pad,
                cfg.temperature,
                cfg.forward_chunk_tokens,
            )?)
        } else {
            None
        };
        drop(sampler_model);
        let ref_logps = match &ref_model {
            Some(m) => Some(logprobs_of(
                m,
                &pairs,
                pad,
                cfg.temperature,
                cfg.forward_chunk_tokens,
            )?),
            None => None,
        };
        let t_reference = t0.elapsed().as_secs_f64();
        trace_memory("old/reference log-probs");

        // 3. Score (coherence rewards read the reference's mean log-prob of each completion).
        let t0 = Instant::now();
        let ref_means: Option<Vec<f32>> =
            ref_logps.as_ref().filter(|_| rewards_need_ref).map(|r| {
                r.iter()
                    .map(|l| l.iter().sum::<f32>() / l.len().max(1) as f32)
                    .collect()
            });
        let late: Vec<usize> = (0..ds.rewards.len())
            .filter(|&k| !early_rewards[k])
            .collect();
        let late_secs = rollout::score(
            &mut episodes,
            &ds.train,
            &ds.rewards,
            &late,
            ref_means.as_deref(),
        )?;
        let reward_secs: Vec<f64> = late_secs
            .iter()
            .zip(&early.secs)
            .map(|(a, b)| a + b)
            .collect();
        // What scoring added to the step: waiting for the early scorer, then the late rewards.
        let t_score = early.wait_s + t0.elapsed().as_secs_f64();

        // 4. Rewards -> advantages (KL in the reward when so configured).
        let per_func: Vec<f32> = episodes
            .iter()
            .flat_map(|e| e.rewards.iter().copied())
            .collect();
        // The weighted sum is what is logged as `reward` in both aggregation modes.
        let decoupled = cfg.multi_objective_aggregation == RewardAggregation::NormalizeThenSum;
        let mut combined = combine_rewards(&per_func, &weights)?;
        let mut seq_kl_mean = None;
        if let (KlMode::Reward { coef, .. }, Some(old), Some(refl)) =
            (&cfg.kl, &old_logps, &ref_logps)
        {
            let coef = state.adaptive_kl.as_ref().map_or(*coef, |a| a.coef);
            let kls: Vec<f32> = old
                .iter()
                .zip(refl)
                .map(|(o, r)| o.iter().zip(r).map(|(a, b)| a - b).sum())
                .collect();
            for (c, k) in combined.iter_mut().zip(&kls) {
                *c -= coef as f32 * k;
            }
            let m = mean(kls.iter().map(|&k| k as f64));
            seq_kl_mean = Some(m);
            if let Some(a) = state.adaptive_kl.as_mut() {
                a.update(m, episodes.len());
            }
        }
        let mut adv = if decoupled {
            decoupled_advantages(&per_func, &weights, g)?
        } else {
            group_advantages(&combined, g, &adv_opts)?
        };
        adv.rewards = combined;
        check_round_invariants(&episodes, p, g, &adv.advantages, &adv_opts)?;
        let keep: Vec<bool> = episodes
            .iter()
            .map(|e| !(cfg.drop_zero_std_groups && adv.zero_std[e.group]))
            .collect();
        let batch = TrainBatch {
            rows: episodes
                .iter()
                .enumerate()
                .filter(|(i, _)| keep[*i])
                .map(|(i, e)| TrainRow {
                    prompt_ids: e.prompt_ids.clone(),
                    completion_ids: e.completion_ids.clone(),
                    active: !(cfg.mask_truncated_completions && e.truncated()),
                    advantage: adv.advantages[i],
                    old_logps: if needs_old {
                        old_logps.as_ref().map(|o| o[i].clone())
                    } else {
                        None
                    },
                    ref_logps: ref_logps
                        .as_ref()
                        .filter(|_| kl_needs_ref)
                        .map(|r| r[i].clone()),
                })
                .collect(),
        };

        // 5. Update: num_iterations passes, each split into optimizer steps of accumulated micro-batches.
        let t0 = Instant::now();
        let mb = cfg.per_device_train_batch_size;
        let accum = cfg.gradient_accumulation_steps;
        let steps_per_gen = cfg.steps_per_generation;
        let dapo_tokens = batch.active_tokens() as f64 * accum as f64 / steps_per_gen as f64;
        let red = Reduction {
            accumulation_steps: accum,
            max_completion_length: cfg.max_completion_length,
            dapo_tokens,
            micro: None,
        };
        let mut step_stats: Vec<StepStats> = Vec::new();
        // Micro-batches of `mb` rows in order; `accum` of them make one optimizer step.
        let micro: Vec<std::ops::Range<usize>> = (0..batch.rows.len())
            .step_by(mb.max(1))
            .map(|s| s..(s + mb).min(batch.rows.len()))
            .collect();
        if batch.rows.is_empty() {
            // Every group had equal rewards and drop_zero_std_groups left nothing to learn from.
            say(
                &bar,
                format!(
                    "step {}: every group had equal rewards; no update this round",
                    state.step + 1
                ),
            );
            state.step = (state.step + updates_per_round).min(total_steps);
        }
        'passes: for _ in 0..cfg.num_iterations {
            let windows: Vec<Vec<std::ops::Range<usize>>> =
                micro.chunks(accum.max(1)).map(|w| w.to_vec()).collect();
            for window in windows {
                if window.is_empty() || state.step >= total_steps {
                    continue;
                }
                let lr = cfg.learning_rate
                    * lr_lambda(cfg.lr_scheduler_type, state.step, warmup, total_steps);
                let st = optimizer_step(
                    &policy,
                    &mut opt,
                    &batch,
                    &window,
                    &loss_opts,
                    &red,
                    cfg,
                    lr,
                    pad,
                    entropy_mode,
                    // LoRA dropout masks: one stream per optimizer step (exact resume).
                    0x4452_4f50 ^ state.step,
                )?;
                if st.finite {
                    state.consecutive_nonfinite = 0;
                } else {
                    state.consecutive_nonfinite += 1;
                    tracing::warn!(
                        "step {}: non-finite loss or gradient, update skipped ({} in a row)",
                        state.step + 1,
                        state.consecutive_nonfinite
                    );
                    if state.consecutive_nonfinite >= cfg.max_consecutive_nonfinite {
                        return Err(Error::Generate(format!(
                            "{} non-finite steps in a row: stopping (raise max_consecutive_nonfinite, or lower learning_rate)",
                            state.consecutive_nonfinite
                        )));
                    }
                }
                state.step += 1;
                bar.set_position(state.step);
                step_stats.push(st);
                if state.step >= total_steps {
                    break 'passes;
                }
            }
        }
        let t_update = t0.elapsed().as_secs_f64();
        trace_memory("update");
        state.round += 1;
        rounds_this_run += 1;

        // Reference sync (TRL: ref = alpha * policy + (1 - alpha) * ref every N steps).
        if cfg.sync_ref_model && state.step.is_multiple_of(cfg.ref_model_sync_steps as u64) {
            if let Some(rt) = ref_tensors.as_mut() {
                let a = cfg.ref_model_mixup_alpha;
                for (n, v) in names.iter().zip(&policy.vars) {
                    if let Some(r) = rt.get_mut(n) {
                        *r = ((v.as_tensor().detach() * a)? + (r.clone() * (1.0 - a))?)?;
                    }
                }
                ref_model = Some(CausalLm::from_tensors(
                    &policy.cfg,
                    rt.clone(),
                    DType::F32,
                    &device,
                )?);
            }
        }

        // 6. Log.
        let mut m: Vec<(String, f64)> = Vec::new();
        let n_eps = episodes.len();
        let lens: Vec<f64> = episodes
            .iter()
            .map(|e| e.completion_ids.len() as f64)
            .collect();
        let finite_rewards: Vec<f64> = adv
            .rewards
            .iter()
            .filter(|r| r.is_finite())
            .map(|&r| r as f64)
            .collect();
        let push = |m: &mut Vec<(String, f64)>, k: &str, v: f64| m.push((k.to_string(), v));
        push(&mut m, "reward", mean(finite_rewards.iter().copied()));
        push(
            &mut m,
            "reward_std",
            crate::advantages::nan_std(&adv.rewards) as f64,
        );
        for (k, r) in ds.rewards.iter().enumerate() {
            let vals: Vec<f64> = episodes
                .iter()
                .map(|e| e.rewards[k] as f64)
                .filter(|x| x.is_finite())
                .collect();
            push(
                &mut m,
                &format!("rewards/{}/mean", r.name),
                mean(vals.iter().copied()),
            );
            let v32: Vec<f32> = episodes.iter().map(|e| e.rewards[k]).collect();
            push(
                &mut m,
                &format!("rewards/{}/std", r.name),
                crate::advantages::nan_std(&v32) as f64,
            );
            push(
                &mut m,
                &format!("rewards/{}/missing", r.name),
                (n_eps - vals.len()) as f64,
            );
            push(&mut m, &format!("time/reward/{}", r.name), reward_secs[k]);
            if let Some(st) = r.scorer_stats() {
                // Running totals since the scorer started: why completions went missing.
                for (what, n) in [
                    ("timeouts", st.timeout),
                    ("crashes", st.crash),
                    ("garbage", st.garbage + st.garbage_lines),
                    ("http_errors", st.http_error),
                    ("restarts", st.restarts),
                ] {
                    push(&mut m, &format!("scorer/{}/{what}", r.name), n as f64);
                }
            }
        }
        push(&mut m, "frac_reward_zero_std", adv.frac_zero_std() as f64);
        push(
            &mut m,
            "advantage_mean",
            mean(adv.advantages.iter().map(|&a| a as f64)),
        );
        push(
            &mut m,
            "advantage_std",
            crate::advantages::nan_std(&adv.advantages) as f64,
        );
        push(
            &mut m,
            "completions/mean_length",
            mean(lens.iter().copied()),
        );
        push(
            &mut m,
            "completions/min_length",
            lens.iter().cloned().fold(f64::INFINITY, f64::min),
        );
        push(
            &mut m,
            "completions/max_length",
            lens.iter().cloned().fold(0.0, f64::max),
        );
        push(
            &mut m,
            "completions/clipped_ratio",
            episodes.iter().filter(|e| e.truncated()).count() as f64 / n_eps as f64,
        );
        if !step_stats.is_empty() {
            let avg = |f: &dyn Fn(&StepStats) -> f64| mean(step_stats.iter().map(f));
            push(&mut m, "loss", avg(&|s| s.loss));
            push(&mut m, "pg_loss", avg(&|s| s.policy_loss));
            push(&mut m, "kl", avg(&|s| s.kl));
            push(&mut m, "kl_penalty", loss_opts.beta * avg(&|s| s.kl));
            push(&mut m, "entropy", avg(&|s| s.entropy));
            push(&mut m, "mean_log_prob", avg(&|s| s.mean_logp));
            push(&mut m, "clip_ratio/low_mean", avg(&|s| s.clip_low));
            push(&mut m, "clip_ratio/high_mean", avg(&|s| s.clip_high));
            push(&mut m, "clip_ratio/region_mean", avg(&|s| s.clip_region));
            push(&mut m, "grad_norm", avg(&|s| s.grad_norm));
            push(
                &mut m,
                "learning_rate",
                step_stats.last().map_or(0.0, |s| s.lr),
            );
        }
        if let Some(k) = seq_kl_mean {
            push(&mut m, "kl_reward/seq_kl", k);
        }
        if let Some(a) = &state.adaptive_kl {
            push(&mut m, "kl_reward/coef", a.coef);
        }
        push(&mut m, "time/generate", t_generate);
        push(&mut m, "time/score", t_score);
        push(&mut m, "time/reference", t_reference);
        push(&mut m, "time/update", t_update);
        let t_total = t_round.elapsed().as_secs_f64();
        push(&mut m, "time/step", t_total);
        push(
            &mut m,
            "tokens_per_second",
            gen_stats.generated_tokens as f64 / t_total.max(1e-9),
        );
        push(&mut m, "epoch", state.order.epoch() as f64);
        if let Some((_, peak)) = crate::threads::rss_gb() {
            push(&mut m, "memory/rss_peak_gb", peak);
        }

        // 7. Periodic eval.
        if cfg.eval_steps > 0
            && !ds.eval.is_empty()
            && (state.step.is_multiple_of(cfg.eval_steps as u64) || state.step >= total_steps)
        {
            let model = policy.build_for_sampling(cfg.gradient_checkpointing)?;
            let t0 = Instant::now();
            let ev = evaluate(cfg, &model, &tok, &ds, &sampling, state.step, &mut metrics)?;
            push(&mut m, "time/eval", t0.elapsed().as_secs_f64());
            m.extend(ev.iter().cloned());
            last_eval = Some(ev);
        }
        if cfg.logging_steps > 0
            && (state.step.is_multiple_of(cfg.logging_steps as u64) || state.step >= total_steps)
        {
            metrics.log(state.step, &m)?;
            let get = |k: &str| m.iter().find(|(n, _)| n == k).map_or(f64::NAN, |x| x.1);
            let mut line = format!(
                "step {:>4}  reward {:.3}  loss {:+.4}  kl {:.4}  len {:.1}  grad {:.3}  {:.1}s (gen {:.1} ref {:.1} upd {:.1})",
                state.step,
                get("reward"),
                get("loss"),
                get("kl"),
                get("completions/mean_length"),
                get("grad_norm"),
                t_total,
                t_generate,
                t_reference,
                t_update
            );
            if let Some(a) = m.iter().find(|(n, _)| n == "eval/accuracy") {
                line.push_str(&format!("  eval acc {:.3}", a.1));
            }
            say(&bar, line);
        }
        if cfg.log_completions
            && (state
                .round
                .is_multiple_of(cfg.log_completions_steps.max(1) as u64)
                || state.round == 1)
        {
            for (i, e) in episodes.iter().enumerate() {
                metrics.log_json(
                    "completions.jsonl",
                    &json!({
                        "step": state.step,
                        "prompt": data::prompt_text(&ds.train[e.example]),
                        "completion": e.text,
                        "stop_reason": e.stop_reason,
                        "rewards": reward_map(&ds.rewards, &e.rewards),
                        "reward": adv.rewards[i],
                        "advantage": adv.advantages[i],
                    }),
                )?;
            }
            for e in episodes
                .iter()
                .step_by(g)
                .take(cfg.num_completions_to_print)
            {
                say(
                    &bar,
                    format!(
                        "  sample: {:?} -> {:?} (rewards {:?})",
                        data::prompt_text(&ds.train[e.example])
                            .chars()
                            .take(80)
                            .collect::<String>(),
                        e.text.chars().take(120).collect::<String>(),
                        e.rewards
                    ),
                );
            }
        }

        // 8. Checkpoint.
        let stop_now = ctl.stop.load(Ordering::SeqCst)
            || ctl
                .max_rounds_this_run
                .is_some_and(|k| rounds_this_run >= k);
        let at_end = state.step >= total_steps;
        let periodic =
            cfg.save_steps > 0 && crossed(state.step, updates_per_round, cfg.save_steps as u64);
        if periodic || at_end || stop_now {
            let dir = save(
                cfg,
                &base_model_name,
                &policy,
                &opt,
                &state,
                &tok,
                &config_toml,
            )?;
            say(&bar, format!("saved {}", dir.display()));
            last_ckpt = Some(dir);
        }
        if stop_now && !at_end {
            interrupted = true;
            break;
        }
    }
    bar.finish_and_clear();
    Ok(TrainOutcome {
        steps: state.step,
        last_checkpoint: last_ckpt,
        interrupted,
        last_eval,
    })
}

/// A console line above the progress bar (plain stderr when there is no terminal).
/// Current and peak RSS at `phase`, at debug level (`--log-level debug`).
fn trace_memory(phase: &str) {
    if let Some((cur, peak)) = crate::threads::rss_gb() {
        tracing::debug!("memory after {phase}: rss {cur:.2} GB, peak {peak:.2} GB");
    }
}

fn say(bar: &indicatif::ProgressBar, line: impl AsRef<str>) {
    if bar.is_hidden() {
        eprintln!("{}", line.as_ref());
    } else {
        bar.println(line.as_ref());
    }
}

/// Whether the optimizer steps of the round just done crossed a multiple of `every`.
fn crossed(step: u64, per_round: u64, every: u64) -> bool {
    let before = step.saturating_sub(per_round);
    step / every > before / every
}

fn save(
    cfg: &TrainConfig,
    base_model: &str,
    policy: &Policy,
    opt: &AdamW,
    state: &TrainerState,
    tok: &Tokenizer,
    config_toml: &str,
) -> Result<PathBuf> {
    let tensors = policy.named_tensors();
    let optimizer = opt.state_tensors()?;
    let trainer_state = serde_json::to_value(state)
        .map_err(|e| Error::Generate(format!("cannot serialise trainer state: {e}")))?;
    let eos = policy.cfg.eos_token_ids.clone();
    let model = match &policy.lora {
        None => ModelFiles::Full(HfExport {
            config: &policy.cfg,
            tensors: &tensors,
            tokenizer: Some(tok),
            eos_token_ids: &eos,
        }),
        Some((_, lcfg)) => ModelFiles::Adapter(AdapterExport {
            config: lcfg,
            model_config: &policy.cfg,
            base_model,
            tensors: &tensors,
            tokenizer: Some(tok),
        }),
    };
    checkpoint::save_checkpoint(
        &cfg.output_dir,
        &CheckpointData {
            step: state.step,
            model,
            optimizer: &optimizer,
            trainer_state: &trainer_state,
            config_toml,
        },
        cfg.save_total_limit,
    )
}

/// Statistics of one optimizer step.
#[derive(Debug, Clone, Default)]
struct StepStats {
    loss: f64,
    policy_loss: f64,
    kl: f64,
    entropy: f64,
    mean_logp: f64,
    clip_low: f64,
    clip_high: f64,
    clip_region: f64,
    grad_norm: f64,
    lr: f64,
    finite: bool,
}

/// One optimizer step: forward/backward over each micro-batch of `window`, gradients summed,
/// clipped, AdamW applied. A non-finite loss or gradient skips the update.
#[allow(clippy::too_many_arguments)]
fn optimizer_step(
    policy: &Policy,
    opt: &mut AdamW,
    batch: &TrainBatch,
    window: &[std::ops::Range<usize>],
    loss_opts: &LossOptions,
    red: &Reduction,
    cfg: &TrainConfig,
    lr: f64,
    pad: u32,
    entropy_mode: Entropy,
    dropout_stream: u64,
) -> Result<StepStats> {
    let (mut model, dropout_clock) = policy.build_train(mix_seed(cfg.seed, dropout_stream))?;
    // Projection weights' gradients go straight into accumulators (CPU, f32); the rest (embedding,
    // norms, biases, LoRA adapters) through candle's autograd, or, for blocks recomputed by
    // gradient checkpointing, into the checkpoint store.
    let sink = GradSink::new(&policy.vars);
    if policy.lora.is_none() {
        model.attach_grad_sink(&sink)?;
    }
    let ckpt = match cfg.gradient_checkpointing {
        true => Some(CheckpointGrads::new(&policy.vars)?),
        false => None,
    };
    model.set_checkpointing(ckpt.clone());
    trace_memory("building the training model");
    let mut grads: Vec<Option<Tensor>> = vec![None; policy.vars.len()];
    let mut st = StepStats {
        lr,
        ..Default::default()
    };
    let k = window.len() as f64;
    for range in window {
        let totals = MicroTotals {
            rows: range.len(),
            active_tokens: batch.active_tokens_in(range.clone()) as f64,
        };
        let red = Reduction {
            micro: Some(totals),
            ..*red
        };
        let rows = &batch.rows[range.clone()];
        let prompts: Vec<&[u32]> = rows.iter().map(|r| r.prompt_ids.as_slice()).collect();
        let comps: Vec<&[u32]> = rows.iter().map(|r| r.completion_ids.as_slice()).collect();
        let chunks = forward_chunks(&prompts, &comps, cfg.forward_chunk_tokens);
        for part in chunks {
            let part = range.start + part.start..range.start + part.end;
            let mb = batch.micro(part, &policy.device)?;
            dropout_clock.fetch_add(1, Ordering::Relaxed);
            let (logps, ents) = completion_logprobs(
                &model,
                &mb.prompts,
                &mb.completions,
                pad,
                cfg.temperature,
                Mode::Train,
                entropy_mode,
                Packing::SharedPrompt,
            )?; // [n, Tc] f32
            let out = grpo_loss(
                &LossInputs {
                    logps: &logps,
                    old_logps: mb.old_logps.as_ref(),
                    ref_logps: mb.ref_logps.as_ref(),
                    advantages: &mb.advantages,
                    mask: &mb.mask,
                    entropies: ents.as_ref(),
                },
                loss_opts,
                &red,
            )?;
            // Chunk statistics are masked means; weight them by the chunk's share of the
            // micro-batch's active tokens, and the micro-batch by 1/k.
            let active = mb.mask.sum_all()?.to_scalar::<f32>()? as f64;
            let w = active / totals.active_tokens.max(1.0) / k;
            st.loss += out.loss.to_scalar::<f32>()? as f64;
            st.policy_loss += out.policy_loss as f64;
            st.kl += out.kl as f64 * w;
            st.entropy += out.entropy.unwrap_or(f32::NAN) as f64 * w;
            st.clip_low += out.clip_low as f64 * w;
            st.clip_high += out.clip_high as f64 * w;
            st.clip_region += out.clip_region as f64 * w;
            st.mean_logp += (logps.detach() * &mb.mask)?.sum_all()?.to_scalar::<f32>()? as f64
                / totals.active_tokens.max(1.0)
                / k;
            let mut g = out.loss.backward()?;
            trace_memory("a chunk's backward");
            // Take each gradient out of the store as it is added, so that at most one
            // parameter's chunk gradient is alive beside the accumulators. Every stored gradient
            // is a fresh sum made by the backward, so adding into it in place aliases nothing.
            for (i, v) in policy.vars.iter().enumerate() {
                let from_ckpt = match &ckpt {
                    Some(c) => c.take(v)?,
                    None => None,
                };
                let gi = match (g.remove(v), from_ckpt) {
                    (Some(a), Some(b)) => Some((a + b)?),
                    (a, b) => a.or(b),
                };
                if let Some(gi) = gi {
                    grads[i] = Some(match grads[i].take() {
                        Some(acc) => crate::optim::accumulate(acc, &gi)?,
                        None => gi,
                    });
                }
            }
        }
    }
    let mut all = Vec::with_capacity(grads.len());
    for ((v, name), graph) in policy.vars.iter().zip(&policy.names).zip(grads) {
        all.push(match (graph, sink.take(v)?) {
            (Some(a), Some(b)) => crate::optim::accumulate(a, &b)?,
            (Some(a), None) | (None, Some(a)) => a,
            (None, None) => {
                return Err(Error::Generate(format!(
                "invariant: parameter {name} received no gradient (a forward op without backward?)"
            )))
            }
        });
    }
    let grads = all;
    let (norm, scale) = clip_factor(&grads, cfg.max_grad_norm)?;
    st.grad_norm = norm;
    st.finite = st.loss.is_finite() && norm.is_finite();
    if st.finite {
        opt.step(&grads, lr, scale)?;
    }
    Ok(st)
}

/// Per-round invariants, reported as errors: P x G completions, each group from one prompt,
/// normalized groups' advantages summing to about 0.
fn check_round_invariants(
    episodes: &[Episode],
    p: usize,
    g: usize,
    advantages: &[f32],
    opts: &AdvantageOptions,
) -> Result<()> {
    if episodes.len() != p * g || advantages.len() != p * g {
        return Err(Error::Generate(format!(
            "invariant: {} completions and {} advantages for {p} prompts x {g}",
            episodes.len(),
            advantages.len()
        )));
    }
    for (gi, group) in episodes.chunks(g).enumerate() {
        if group
            .iter()
            .any(|e| e.group != gi || e.prompt_ids != group[0].prompt_ids)
        {
            return Err(Error::Generate(format!(
                "invariant: group {gi} mixes prompts"
            )));
        }
    }
    if !opts.normalize_batch {
        for (gi, a) in advantages.chunks(g).enumerate() {
            let s: f32 = a.iter().sum();
            let scale: f32 = a.iter().map(|x| x.abs()).sum::<f32>().max(1.0);
            // Missing rewards (advantage 0, excluded from the mean) keep the sum at 0 too.
            if s.abs() > 1e-3 * scale {
                return Err(Error::Generate(format!(
                    "invariant: advantages of group {gi} sum to {s}, not 0"
                )));
            }
        }
    }
    Ok(())
}
