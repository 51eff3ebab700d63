//! `grpo pretrain`: a small model trained from a text file, saved as an HF directory that
//! `grpo train`, `grpo generate` and transformers load.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use grpo::fill_in::pretrain::{pretrain_causal, pretrain_judge, pretrain_mlm, PretrainOptions};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Objective {
    /// A masked-LM generator (BERT, char tokenizer) that fills masked positions in one step:
    /// each example masked at its own ratio from --mask-ratio (single-step diffusion).
    Mlm,
    /// A judge (BERT classifier, labels `filled` and `real`) telling real lines from lines whose
    /// masked characters --generator filled; the generator's tokenizer is reused.
    Judge,
    /// A causal LM (Llama, tied embeddings) trained on next-token prediction, for `grpo train`
    /// and `grpo generate` like any causal model.
    Causal,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TokenizerKind {
    /// One token per character of the corpus, plus [PAD] [UNK] [CLS] [SEP] [MASK].
    Chars,
    /// Byte-level BPE learned from the corpus (--vocab-size tokens), plus the same specials.
    Bpe,
}

#[derive(Args, Debug)]
pub struct PretrainArgs {
    /// What to train.
    #[arg(long, value_enum)]
    pub objective: Objective,
    /// The corpus: a text file, one example per line (blank lines skipped; every 20th line is
    /// held out for the fill accuracy).
    #[arg(long)]
    pub data: PathBuf,
    /// The generator whose fills the judge learns to spot (--objective judge).
    #[arg(long)]
    pub generator: Option<PathBuf>,
    /// The tokenizer made from the corpus (--objective mlm and causal; a judge reuses its
    /// generator's).
    #[arg(long, value_enum, default_value = "chars")]
    pub tokenizer: TokenizerKind,
    /// Tokens of a BPE tokenizer (--tokenizer bpe).
    #[arg(long, default_value_t = 1000)]
    pub vocab_size: usize,
    /// A loadable copy of the model every this many steps, in checkpoint-N/ (0: none).
    #[arg(long, default_value_t = 0)]
    pub save_every: u64,
    /// Output directory (new, or empty): config.json, model.safetensors, tokenizer files and
    /// pretrain_log.jsonl.
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 128)]
    pub hidden: usize,
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// Longest example in tokens ([CLS] and [SEP] included); longer lines are cut.
    #[arg(long, default_value_t = 64)]
    pub max_len: usize,
    #[arg(long, default_value_t = 2000)]
    pub steps: u64,
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    #[arg(long, default_value_t = 1e-3)]
    pub learning_rate: f64,
    /// Linear warm-up steps before the cosine decay.
    #[arg(long, default_value_t = 100)]
    pub warmup_steps: u64,
    /// Mask ratio per example: a number (0.15) or a range LO..HI drawn uniformly per example.
    #[arg(long, default_value = "0.1..0.9")]
    pub mask_ratio: String,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Held-out fill accuracy every this many steps.
    #[arg(long, default_value_t = 200)]
    pub eval_every: u64,
    /// CPU threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
}

/// "0.15" or "0.1..0.9".
fn parse_ratio(s: &str) -> Result<(f64, f64)> {
    let num = |t: &str| -> Result<f64> {
        t.trim()
            .parse()
            .with_context(|| format!("--mask-ratio {s}: `{t}` is not a number"))
    };
    match s.split_once("..") {
        Some((a, b)) => Ok((num(a)?, num(b)?)),
        None => {
            let r = num(s)?;
            Ok((r, r))
        }
    }
}

pub fn run(a: PretrainArgs) -> Result<()> {
    if let Some(n) = a.threads {
        grpo_models::threads::set_global_threads(n)
            .map_err(|e| anyhow::anyhow!("--threads: {e}"))?;
    }
    let o = PretrainOptions {
        data: a.data.clone(),
        out: a.out.clone(),
        hidden: a.hidden,
        layers: a.layers,
        heads: a.heads,
        max_len: a.max_len,
        steps: a.steps,
        batch_size: a.batch_size,
        learning_rate: a.learning_rate,
        warmup_steps: a.warmup_steps,
        mask_ratio: parse_ratio(&a.mask_ratio)?,
        seed: a.seed,
        eval_every: a.eval_every,
        tokenizer: match a.tokenizer {
            TokenizerKind::Chars => grpo::fill_in::pretrain::TokenizerKind::Chars,
            TokenizerKind::Bpe => grpo::fill_in::pretrain::TokenizerKind::Bpe {
                vocab_size: a.vocab_size,
            },
        },
        save_every: a.save_every,
    };
    let bar = indicatif::ProgressBar::new(o.steps);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta_precise}]",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let t0 = std::time::Instant::now();
    let log = grpo_models::threads::on_pool(|| {
        let mut on_step = |r: &grpo::fill_in::pretrain::PretrainStep| {
            bar.set_position(r.step);
            bar.set_message(format!("loss {:.3}", r.loss));
            if let Some(acc) = r.eval_accuracy {
                let line = format!(
                    "step {:>5}  loss {:.4}  held-out accuracy {acc:.3}",
                    r.step, r.loss
                );
                // Without a terminal the bar is hidden, and so would be its lines.
                match bar.is_hidden() {
                    true => println!("{line}"),
                    false => bar.println(line),
                }
            }
        };
        match (a.objective, &a.generator) {
            (Objective::Mlm, _) => pretrain_mlm(&o, &mut on_step),
            (Objective::Causal, _) => pretrain_causal(&o, &mut on_step),
            (Objective::Judge, Some(g)) => pretrain_judge(&o, g, &mut on_step),
            (Objective::Judge, None) => Err(grpo::Error::config(
                "--generator",
                "--objective judge needs --generator DIR, the masked-LM generator whose fills it learns to spot",
            )),
        }
    })?;
    bar.finish_and_clear();
    let Some(last) = log.last() else {
        bail!("no step ran");
    };
    println!(
        "saved {} ({} steps in {:.0} s; loss {:.4}, held-out accuracy {:.3})",
        o.out.display(),
        last.step,
        t0.elapsed().as_secs_f64(),
        last.loss,
        last.eval_accuracy.unwrap_or(f64::NAN)
    );
    Ok(())
}
