//! `grpo report`: an HTML report with PNG plots of a training run.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// The run directory (the trainer's output_dir): reads metrics.jsonl, and completions.jsonl,
    /// eval/step-N.jsonl and config.toml when present.
    #[arg(value_name = "RUN_DIR")]
    run_dir: PathBuf,
    /// Write report.html and plots/ here instead of into RUN_DIR.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
}

pub fn run(a: ReportArgs) -> Result<()> {
    let out = a.out.as_deref().unwrap_or(&a.run_dir);
    let s = crate::report::write_report_to(&a.run_dir, out)
        .with_context(|| format!("cannot write the report of {}", a.run_dir.display()))?;
    println!("{}", s.html.display());
    for p in &s.plots {
        println!("{}", p.display());
    }
    if !s.skipped.is_empty() {
        tracing::info!("not plotted (no data): {}", s.skipped.join("; "));
    }
    Ok(())
}
