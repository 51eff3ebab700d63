//! `grpo eval`: pass@k, accuracy and mean rewards of a model on held-out prompts.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;

use grpo::config::TrainConfig;
use grpo::eval::{self, Correctness, EvalOptions};

use crate::common::ModelArgs;

/// Samples per prompt when neither `--num-samples` nor a `--rewards-config` says.
const DEFAULT_NUM_SAMPLES: usize = 4;

#[derive(Args, Debug)]
#[command(
    after_help = "Per prompt: N sampled completions (seeded per prompt) and one greedy \
    completion, each scored by every reward. A completion is correct when the --correctness-reward \
    scores at least --correctness-threshold (any kind of reward: a Python function, a scorer \
    program, a model), else when every answer_match reward scores 1. Reported: eval/pass@K for each K (unbiased estimator 1 - C(N-c, K)/C(N, K), \
    c = correct samples, averaged over prompts), eval/mean_accuracy (share of correct samples), \
    eval/accuracy (greedy), eval/reward/NAME (mean over the samples; over the greedy completions \
    with --num-samples 0).\n\n\
    Options not given come from --rewards-config (its eval_*, sampling and data keys), else from \
    the embedded default run (the built-in arithmetic task, 32 new tokens, temperature 1).\n\n\
    Examples:\n  \
    grpo eval --model runs/x/checkpoint-200 --k 1,4,8 --num_samples 8\n  \
    grpo eval --model runs/x/checkpoint-200 --data test.jsonl --rewards-config run.toml --out answers.jsonl --json"
)]
pub struct EvalArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// LoRA checkpoints: the base model (default: the adapter's base_model_name_or_path).
    #[arg(long)]
    pub base: Option<String>,
    /// Held-out prompts with reference answers (.jsonl, .csv or .parquet). Default: the config's
    /// eval_file, else the built-in arithmetic task's held-out problems (the config's task.* keys).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Field holding the prompt (a string or a list of {role, content} messages). Default: the
    /// config's prompt_field ("prompt").
    #[arg(long, visible_alias = "prompt_field")]
    pub prompt_field: Option<String>,
    /// Field holding the reference answer. Default: the config's answer_field ("answer").
    #[arg(long, visible_alias = "answer_field")]
    pub answer_field: Option<String>,
    /// A training config (.toml, .yaml): its [[rewards]], data keys (eval_file, prompt_field,
    /// answer_field, system_prompt, task.*), sampling keys and eval_* keys. Default: the built-in
    /// task's rewards and the embedded default run's settings.
    #[arg(long, visible_aliases = ["rewards_config", "config"])]
    pub rewards_config: Option<PathBuf>,
    /// Report pass@K for each K, comma-separated (e.g. 1,4,8); each at most --num-samples.
    /// Default: the config's eval_k ([1]).
    #[arg(long, value_delimiter = ',')]
    pub k: Vec<usize>,
    /// Sampled completions per prompt (N); 0: only the greedy completion. Default: the config's
    /// eval_num_samples with --rewards-config, else 4.
    #[arg(long, visible_alias = "num_samples")]
    pub num_samples: Option<usize>,
    /// Sampling temperature of the N samples (0 = greedy). Default: the config's eval_temperature
    /// (or temperature).
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Nucleus sampling mass (1 = off). Default: the config's top_p.
    #[arg(long, visible_alias = "top_p")]
    pub top_p: Option<f64>,
    /// Keep only the k most likely tokens (0 = off). Default: the config's top_k.
    #[arg(long, visible_alias = "top_k")]
    pub top_k: Option<usize>,
    /// Maximum new tokens per completion. Default: the config's max_completion_length.
    #[arg(long, visible_alias = "max_new_tokens")]
    pub max_new_tokens: Option<usize>,
    /// The reward that decides whether a completion is correct, by name (a [[rewards]] name of
    /// --rewards-config, a reward_funcs function's name; any kind), for pass@K and the
    /// accuracies. Default: the config's correctness_reward, else every answer_match reward must
    /// score 1.
    #[arg(long, visible_alias = "correctness_reward")]
    pub correctness_reward: Option<String>,
    /// A completion is correct when the correctness reward scores at least this. Default: the
    /// config's correctness_threshold, else 1.0.
    #[arg(long, visible_alias = "correctness_threshold")]
    pub correctness_threshold: Option<f64>,
    /// Skip the greedy completion (no eval/accuracy).
    #[arg(long)]
    pub no_greedy: bool,
    /// Evaluate only the first N prompts. Default: the config's eval_num_prompts (all).
    #[arg(long, visible_alias = "num_prompts")]
    pub num_prompts: Option<usize>,
    /// Seed; prompt i's samples come from a stream derived from (seed, i). Default: the config's
    /// seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// System message put before each prompt (unless it has one). Default: the config's
    /// system_prompt.
    #[arg(long, visible_alias = "system_prompt")]
    pub system_prompt: Option<String>,
    /// Write one JSON line per prompt: prompt, answer, each completion with its rewards,
    /// correctness and stop reason, the number correct, the greedy completion.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print the metrics as one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// The options: command line first, then the config.
fn options(a: &EvalArgs, cfg: &TrainConfig) -> Result<EvalOptions> {
    let mut o = cfg.eval_options(vec![]);
    o.num_samples = a.num_samples.unwrap_or(if a.rewards_config.is_some() {
        cfg.logging.eval_num_samples
    } else {
        DEFAULT_NUM_SAMPLES
    });
    if !a.k.is_empty() {
        o.ks = a.k.clone();
    }
    o.greedy = cfg.logging.eval_greedy && !a.no_greedy;
    o.num_prompts = a.num_prompts.or(cfg.logging.eval_num_prompts);
    o.seed = a.seed.unwrap_or(cfg.run.seed);
    if a.system_prompt.is_some() {
        o.system_prompt = a.system_prompt.clone();
    }
    let s = &mut o.sampling;
    s.temperature = a.temperature.unwrap_or(s.temperature);
    s.top_p = a.top_p.unwrap_or(s.top_p);
    s.top_k = a.top_k.unwrap_or(s.top_k);
    s.max_new_tokens = a.max_new_tokens.unwrap_or(s.max_new_tokens);
    if let Some(reward) = &a.correctness_reward {
        let threshold = cfg.logging.correctness_threshold;
        o.correctness = Some(Correctness {
            reward: reward.clone(),
            threshold: threshold.unwrap_or(eval::CORRECTNESS_THRESHOLD),
        });
    }
    if let Some(t) = a.correctness_threshold {
        match &mut o.correctness {
            Some(c) => c.threshold = t,
            None => bail!(
                "--correctness-threshold needs --correctness-reward (or correctness_reward in \
                 --rewards-config): the reward whose score it bounds"
            ),
        }
    }
    Ok(o)
}

/// Checks the options with the command line's names.
fn validate(o: &EvalOptions) -> Result<()> {
    eval::check_ks(&o.ks, o.num_samples, "--k", "--num-samples")?;
    if o.num_samples == 0 && !o.greedy {
        bail!("--num-samples 0 with --no-greedy leaves nothing to evaluate");
    }
    o.sampling.validate()?;
    if let Some(c) = o.correctness.as_ref().filter(|c| !c.threshold.is_finite()) {
        bail!("--correctness-threshold {} is not a number", c.threshold);
    }
    Ok(())
}

pub fn run(a: EvalArgs) -> Result<()> {
    let mut cfg = TrainConfig::load(a.rewards_config.as_deref(), &[])
        .context("invalid configuration (--rewards-config)")?;
    let mut opts = options(&a, &cfg)?;
    validate(&opts)?;
    if let Some(f) = &a.prompt_field {
        cfg.data.prompt_field = f.clone();
    }
    if let Some(f) = &a.answer_field {
        cfg.data.answer_field = f.clone();
    }
    // Length rewards default to the completion budget.
    cfg.set_max_completion_length(opts.sampling.max_new_tokens)?;
    let examples = match &a.data {
        Some(p) => grpo::inputs::load_examples(&cfg, p)?,
        None => grpo::inputs::held_out_examples(&cfg)?,
    };
    let device = a.model.device()?;
    let mut rewards = grpo::inputs::config_rewards(&cfg, &device)?;
    if a.rewards_config.is_none() {
        if let Some(run_cfg) = a
            .model
            .model
            .as_deref()
            .map(|m| Path::new(m).join("config.toml"))
            .filter(|p| p.is_file())
        {
            tracing::info!(
                "using the built-in task's rewards and data; to use the run's, pass --rewards-config {}",
                run_cfg.display()
            );
        }
    }

    a.model.init_threads();
    let t0 = Instant::now();
    let (model, tok, eos) = eval::load_inference_model(
        a.model.model.as_deref(),
        a.base.as_deref(),
        a.model.dtype()?,
        &device,
    )?;
    tracing::info!(
        "loaded {} in {:.1}s",
        a.model.model.as_deref().unwrap_or("the default model"),
        t0.elapsed().as_secs_f64()
    );
    opts.sampling.eos_token_ids = eos;
    // A run with tools (the --rewards-config's `tools`, `environment_factory`): every sample is
    // an episode with them, as in training's evaluation.
    let tok = crate::generate_tools::with_template(tok, cfg.agent.chat_template.as_ref())?;
    let (agent, tok) = grpo::inputs::agent(&cfg, tok)?;
    // The environment's rewards, as in training (its get_reward, reward functions that take
    // `environments`, a program's summed step rewards).
    if let Some(agent) = &agent {
        grpo::inputs::environment_rewards(agent, &mut rewards);
    }
    // The reward that decides correctness is one of them (before any answer is sampled).
    if let Some(c) = &opts.correctness {
        let key = match a.correctness_reward {
            Some(_) => "--correctness-reward",
            None => "correctness_reward",
        };
        c.index(&rewards, key)?;
    }

    let mut file = match &a.out {
        Some(p) => Some(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("cannot create {}", p.display()))?,
        )),
        None => None,
    };
    let out_name = a.out.as_ref().map(|p| p.display().to_string());
    let mut write_row = |row: &serde_json::Value| -> grpo::Result<()> {
        if let Some(f) = file.as_mut() {
            writeln!(f, "{row}").map_err(|e| {
                grpo::Error::io(
                    format!("cannot write {}", out_name.as_deref().unwrap_or("")),
                    e,
                )
            })?;
        }
        Ok(())
    };
    let t0 = Instant::now();
    let report = eval::evaluate_agent(
        &model,
        &tok,
        &examples,
        &rewards,
        &opts,
        Some(&mut write_row),
        None,
        agent.as_ref(),
    )?;
    if let Some(mut f) = file {
        f.flush().context("cannot write --out")?;
    }
    tracing::info!(
        "evaluated {} prompts in {:.1}s",
        report.num_prompts,
        t0.elapsed().as_secs_f64()
    );
    if a.json {
        println!("{}", report.to_json());
    } else {
        print!("{}", report.table());
    }
    Ok(())
}
