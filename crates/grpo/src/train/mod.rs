//! The GRPO training loop, top to bottom: sample, score, advantages, update, log, checkpoint.
//!
//! One *round* = one generation batch: `P` prompts x `G` completions, sampled with the current
//! policy, scored, turned into advantages, then used for `num_iterations x steps_per_generation /
//! gradient_accumulation_steps` optimizer steps of `gradient_accumulation_steps` micro-batches of
//! `per_device_train_batch_size` completions each (TRL's semantics). Checkpoints and resume happen
//! at round boundaries, so a resumed run replays exactly what the uninterrupted one does.
//!
//! A round is one call, [`step::grpo_round`]: sample -> score -> advantages -> loss -> optimizer
//! step on one screen, each phase a call that takes what it reads and returns what it produces
//! (the phases before the update are in [`round`], the update's in [`update`]; what watches
//! them, laps, FLOP counts and fault points, in [`probe`]). This file sets up and loops: set-up
//! (model, policy, optimizer, reference, resume, the options each round uses) is [`setup`];
//! logging, evaluation, health and checkpoints after a round [`after`], with the metrics it
//! logs in [`metrics`]. The [`Policy`] and [`World`] traits are the seams for other kinds of
//! policy (the fill-in generator, [`crate::fill_in`]) and for data-parallel runs.

mod after;
mod fill_in;
mod health;
mod launch;
mod metrics;
#[cfg(feature = "nccl")]
mod nccl;
mod observer;
mod policy;
mod probe;
mod profile;
mod round;
mod setup;
mod shard;
mod state;
mod step;
mod tcp_world;
mod update;
mod warmup;
mod world;

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

pub use fill_in::{FillInForward, FillInPolicy};
pub use health::{Health, HealthKind, HealthOptions, HealthWarning};
pub use metrics::{names, RewardMetrics, StepMetrics, UpdateMetrics, WorldMemory};
pub use observer::Observer;
pub use policy::{CausalLmForward, CausalLmPolicy, Policy, Reference, TrainForward};
pub use round::{Episodes, LogProbs, RoundBatch, RoundTimes, Scored};
pub use setup::{update_options, BestModel, LoadPolicy, Loaded, RoundOptions, TrainerState};
pub use step::Round;
pub use tcp_world::{env_rank, Rendezvous, TcpWorld, RENDEZVOUS_TIMEOUT_S};
pub use update::{
    optimizer_step, policy_gradients, skip_round, update_policy, update_round, Schedule,
    StepCounter, StepStats, UpdateOptions, UpdatePlan,
};
#[cfg(feature = "mpi")]
pub use world::MpiWorld;
pub use world::{launcher_world_size, SingleProcess, World};

use crate::config::{PolicyType, TrainConfig};
use crate::inputs::HostInputs;
use crate::Result;
use after::AfterRound;
use setup::Run;

/// How the run is controlled from outside.
#[derive(Clone, Default)]
pub struct RunControl {
    /// Continue from the newest checkpoint in `output_dir`.
    pub resume: bool,
    /// Set (e.g. by Ctrl-C) to stop after the current round, saving a checkpoint.
    pub stop: Arc<AtomicBool>,
    /// Stop after this many rounds of this invocation (tests: "kill" a run after step k).
    pub max_rounds_this_run: Option<u64>,
    /// Prompts and rewards of the program grpo runs in (the Python package); empty otherwise.
    pub host: HostInputs,
    /// Told of steps, logs, evaluations and checkpoints (the Python package's callbacks).
    pub observer: Option<Arc<dyn Observer>>,
}

impl std::fmt::Debug for RunControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunControl")
            .field("resume", &self.resume)
            .field("stop", &self.stop)
            .field("max_rounds_this_run", &self.max_rounds_this_run)
            .field("host", &self.host)
            .field("observer", &self.observer.is_some())
            .finish()
    }
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct TrainOutcome {
    /// Optimizer steps done in total (including before a resume).
    pub steps: u64,
    pub last_checkpoint: Option<PathBuf>,
    /// The best checkpoint by `metric_for_best_model`, when the run has one.
    pub best_checkpoint: Option<PathBuf>,
    pub interrupted: bool,
    /// The last eval metrics, if any eval ran.
    pub last_eval: Option<Vec<(String, f64)>>,
}

/// Runs GRPO training as configured, in this process.
pub fn train(cfg: &TrainConfig, ctl: &RunControl) -> Result<TrainOutcome> {
    // The world: this process, or every rank of an MPI or torchrun-style launch.
    let world = launch::from_launcher()?;
    let w = world.as_world();
    // A rank's threads default to the cores the launcher bound it to (or its node's share).
    let threads = cfg
        .run
        .threads
        .or_else(|| (w.size() > 1).then(tcp_world::cores_per_rank));
    if let Some(n) = threads {
        if let Err(e) = grpo_models::threads::set_global_threads(n) {
            tracing::warn!("threads: {e}");
        }
    }
    let out = grpo_models::threads::on_pool(|| {
        // `dtype = "auto"` becomes f32 or bf16 here, on the pool the run computes on.
        let resolved = setup::resolve_dtype(cfg, w)?;
        let cfg = resolved.as_ref().unwrap_or(cfg);
        match cfg.run.policy {
            PolicyType::CausalLm => run::<CausalLmPolicy>(cfg, ctl, w),
            PolicyType::FillIn => run::<FillInPolicy>(cfg, ctl, w),
        }
    });
    if let (Err(e), true) = (&out, w.size() > 1) {
        // One rank failing ends the job, naming itself, instead of leaving the others waiting.
        eprintln!("error: grpo rank {} of {}: {e}", w.rank(), w.size());
        world.abort_job(1);
    }
    out
}

fn run<P: LoadPolicy>(
    cfg: &TrainConfig,
    ctl: &RunControl,
    world: &dyn World,
) -> Result<TrainOutcome> {
    let mut r = Run::<P>::start(cfg, ctl.resume, &ctl.host, world)?;
    let total_steps = r.opts.schedule.total_steps;
    let console = Console::new(total_steps, r.state.step, world.is_main());
    let observer = ctl.observer.clone().filter(|_| world.is_main());
    if let Some(o) = &observer {
        o.on_train_begin(total_steps, r.state.step);
    }
    let mut after = AfterRound::new(&r, observer);
    after.before_training(&mut r, world, &console)?;
    // Agents: supervised steps on tool-use traces first, when asked for (a fresh run only).
    warmup::sft_warmup(&mut r, world, &console)?;
    tracing::info!(
        "training: {total_steps} steps, {} prompts x {} completions per round, {} optimizer step(s) per round, output {}",
        r.opts.p,
        r.opts.g,
        r.opts.updates_per_round,
        cfg.run.output_dir.display()
    );
    let mut interrupted = false;
    while r.state.step < total_steps {
        // 1-5. Sample -> score -> advantages -> loss -> optimizer step.
        let round = step::grpo_round(&mut r, world, &console)?;
        // 6. Log, evaluate every eval_steps, check health.
        let metrics = after.log(&mut r, &round, world, &console)?;
        // 7. Checkpoint every save_steps, at the end and when asked to stop.
        if after.checkpoint(&mut r, &metrics, ctl, world, &console)? {
            interrupted = true;
            break;
        }
    }
    console.finish();
    Ok(after.finish(&mut r, interrupted, world))
}

/// The console: a progress bar of optimizer steps on every rank, and lines above it from the
/// main rank (plain stderr when there is no terminal).
pub struct Console {
    bar: indicatif::ProgressBar,
    main: bool,
}

impl Console {
    fn new(total_steps: u64, step: u64, main: bool) -> Console {
        let bar = indicatif::ProgressBar::new(total_steps);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:30} {pos}/{len} steps  {elapsed_precise} < {eta_precise}  {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar.set_position(step);
        Console { bar, main }
    }

    /// A line above the progress bar, from the main rank.
    pub fn say(&self, line: impl AsRef<str>) {
        if !self.main {
            return;
        }
        if self.bar.is_hidden() {
            eprintln!("{}", line.as_ref());
        } else {
            self.bar.println(line.as_ref());
        }
    }

    /// Runs `f` with the bar hidden (another bar, evaluation's, draws meanwhile).
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        self.bar.suspend(f)
    }

    pub fn set_position(&self, step: u64) {
        self.bar.set_position(step);
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// Current and peak RSS at `phase`, at debug level (`--log-level debug`); on a GPU with
/// `GRPO_PROFILE=1`, also the phase's peak of the device's memory pool ([`profile::memory`]).
fn trace_memory(phase: &str, device: &candle_core::Device) {
    if let Some((cur, peak)) = grpo_models::threads::rss_gb() {
        tracing::debug!("memory after {phase}: rss {cur:.2} GB, peak {peak:.2} GB");
    }
    profile::memory(device, phase);
}

/// The end of a phase of a step (rollout, log-probs, update): [`trace_memory`], then, under
/// `GRPO_CUDA_POOL=trim`, the pool's free memory back to the driver
/// ([`grpo_models::kernels::end_phase_of_pool`]).
fn end_phase(phase: &str, device: &candle_core::Device) {
    trace_memory(phase, device);
    grpo_models::kernels::end_phase_of_pool(device);
}

/// The device a policy's parameters live on.
fn policy_device<P: policy::Policy>(p: &P) -> candle_core::Device {
    p.device()
}
