//! `grpo train`: the main job. Config file + `--key=value` overrides -> one validated config ->
//! the training loop. Ctrl-C stops after the current step with a checkpoint.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;

use grpo::config::TrainConfig;
use grpo::train::{train, RunControl};

#[derive(Args, Debug)]
#[command(
    after_help = "Any config key can be overridden on the command line as --key=value \
    (TRL's GRPOConfig names: --num_generations=8 --beta=0.04 --learning_rate=5e-6). \
    `grpo config --print` lists every key with its default.\n\n\
    With no --config, grpo trains SmolLM2-135M-Instruct on the built-in arithmetic task."
)]
pub struct TrainArgs {
    /// Config file (.toml, .yaml or .yml). Without it, the embedded default run.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Continue from the newest checkpoint in output_dir.
    #[arg(long)]
    resume: bool,
    /// Overrides, `--key=value` (e.g. --num_generations=8 --task.train_size=500).
    #[arg(value_name = "--KEY=VALUE", allow_hyphen_values = true, trailing_var_arg = true, num_args = 0..)]
    overrides: Vec<String>,
}

pub fn run(a: TrainArgs) -> Result<()> {
    let (config, t) = crate::common::config_and_trailing(a.config, &a.overrides, &["resume"])?;
    let cfg =
        TrainConfig::load(config.as_deref(), &t.overrides).context("invalid configuration")?;
    let resume = a.resume || t.flag("resume") || cfg.resume_from_checkpoint;
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    // save_on_signal = false: the signals keep their default action (the process ends at once).
    if cfg.run.save_on_signal {
        catch_stop_signals(flag)?;
    }
    let outcome = train(
        &cfg,
        &RunControl {
            resume,
            stop,
            ..Default::default()
        },
    )?;
    // Launched as several processes, rank 0 wrote the run and reports it; the others are done.
    if crate::launcher_rank().is_some_and(|r| r > 0) {
        return Ok(());
    }
    // The run report (plots + HTML); a failure here never fails the finished run.
    match crate::report::write_report(&cfg.run.output_dir) {
        Ok(r) => {
            tracing::info!("report: {}", r.html.display());
            if cfg.logging.report_to.iter().any(|t| t == "mlflow") {
                grpo::trackers::upload_artifact(&cfg.run.output_dir, &r.html);
            }
        }
        Err(e) => tracing::warn!("no run report: {e}"),
    }
    if let Some(dir) = &outcome.best_checkpoint {
        println!("best checkpoint: {}", dir.display());
    }
    if let Some(dir) = &outcome.last_checkpoint {
        println!(
            "{} steps; last checkpoint: {}",
            outcome.steps,
            dir.display()
        );
    }
    if let Some(ev) = &outcome.last_eval {
        for (k, v) in ev {
            println!("{k}: {v:.4}");
        }
    }
    if outcome.interrupted {
        println!("interrupted: continue with `grpo train --resume` and the same config");
        let code = preempted_exit_code()?;
        if code != 0 {
            return Err(Interrupted(code).into());
        }
    }
    Ok(())
}

/// The exit status of a run stopped by a signal after its checkpoint was written: 75 (EX_TEMPFAIL,
/// "not finished, try again"), so that a scheduler requeues it instead of reading it as done;
/// `GRPO_PREEMPTED_EXIT_CODE` sets another (0: exit as a finished run does).
pub const PREEMPTED_EXIT_CODE: u8 = 75;

fn preempted_exit_code() -> Result<u8> {
    match std::env::var("GRPO_PREEMPTED_EXIT_CODE") {
        Err(_) => Ok(PREEMPTED_EXIT_CODE),
        Ok(v) => v.trim().parse::<u8>().map_err(|_| {
            anyhow::anyhow!(
                "GRPO_PREEMPTED_EXIT_CODE=`{v}` is not an exit status: give 0 to 255 (unset: {PREEMPTED_EXIT_CODE})"
            )
        }),
    }
}

/// A run stopped by SIGTERM / Ctrl-C with its checkpoint saved: `main` exits with this status
/// and prints no error.
#[derive(Debug)]
pub struct Interrupted(pub u8);

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "stopped before the last step (exit status {})", self.0)
    }
}

impl std::error::Error for Interrupted {}

/// SIGINT (Ctrl-C) and SIGTERM (Slurm, Kubernetes, `kill`) set `flag`: the loop finishes its
/// step, saves a checkpoint and returns. A second signal exits at once.
fn catch_stop_signals(flag: Arc<AtomicBool>) -> Result<()> {
    ctrlc::set_handler(move || {
        if flag.swap(true, Ordering::SeqCst) {
            eprintln!("\nsecond Ctrl-C: exiting without a checkpoint");
            std::process::exit(130);
        }
        eprintln!("\nstop requested (Ctrl-C or SIGTERM): finishing the current step, then saving a checkpoint (Ctrl-C again to quit now)");
    })
    .context("cannot install the Ctrl-C handler")?;
    Ok(())
}
