//! `grpo plan`: what each rank of a run will hold and whether it fits, from the config `grpo
//! train` would run (same file, same `--key=value` overrides) and the model's shapes (the
//! safetensors headers, a GGUF's tensor table, or `config.json` alone). Nothing is trained and
//! no weight is loaded; the arithmetic is `grpo::memory_plan`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::DType;
use clap::Args;

use grpo::config::{DTypeOpt, TrainConfig};
use grpo::loss::KlMode;
use grpo::memory_plan::{self as mp, BatchShape, LoraPlan, ModelShapes, Plan, PlanInput};
use grpo::optim::ZeroStage;
use grpo_models::kernels::Compute;

#[derive(Args, Debug)]
#[command(
    after_help = "The plan reads the config as `grpo train` does (--config and --key=value \
    overrides), the model's shapes without loading its weights (a directory with only \
    config.json is enough), and prints per rank: the process, the policy's weights (f32 \
    masters), the reference (a KL term), AdamW's moments, then the largest of the rollout \
    (sampler copy, KV cache, logits), the log-probs and the update (gradients, activations of a \
    pass, LM-head logits). ZeRO shards moments (stage >= 1), gradients (>= 2) and weights (3) \
    over --world_size ranks. It assumes every completion runs to max_completion_length.\n\n\
    Examples:\n  grpo plan --config run.toml --card h100-80gb\n  \
    grpo plan --model=tests/fixtures/smollm2 --world_size 8 --zero_stage 3 --card a100-40gb\n  \
    grpo plan --config run.toml --format json"
)]
pub struct PlanArgs {
    /// Config file (.toml, .yaml or .yml), as `grpo train` takes it. Without it, the embedded
    /// default run.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Ranks (processes, one per GPU) the run is launched with.
    #[arg(long = "world_size", alias = "world-size", default_value_t = 1)]
    world_size: usize,
    /// ZeRO stage of the plan: 0 (every rank holds everything), 1 (moments sharded), 2 (and
    /// gradients), 3 (and weights). Default: the config's `zero_stage`.
    #[arg(long = "zero_stage", alias = "zero-stage")]
    zero_stage: Option<u8>,
    /// Memory to check the plan against, e.g. 80GiB, 24GB (default: this machine's RAM for a
    /// CPU run; a GPU run needs --card or --memory).
    #[arg(long)]
    memory: Option<String>,
    /// A card whose memory to check against (plans for a GPU): h200, h100-80gb, h100-94gb,
    /// a100-80gb, a100-40gb, l40s, a10g, l4, rtx-4090, t4.
    #[arg(long)]
    card: Option<String>,
    /// Output: table or json.
    #[arg(long, default_value = "table")]
    format: String,
    /// Tokens of the longest prompt (default: measured on the training prompts when the model
    /// has a tokenizer, capped by max_prompt_length; else max_prompt_length).
    #[arg(long = "prompt_tokens", alias = "prompt-tokens")]
    prompt_tokens: Option<usize>,
    /// Overrides, `--key=value` (e.g. --per_device_train_batch_size=16 --beta=0.04).
    #[arg(value_name = "--KEY=VALUE", allow_hyphen_values = true, trailing_var_arg = true, num_args = 0..)]
    overrides: Vec<String>,
}

/// The plan's own options, wherever they stand among the overrides.
const OPTIONS: [&str; 7] = [
    "config",
    "world_size",
    "zero_stage",
    "memory",
    "card",
    "format",
    "prompt_tokens",
];

pub fn run(mut a: PlanArgs) -> Result<()> {
    let t = crate::common::split_trailing(&a.overrides, &[], &OPTIONS)?;
    take_trailing(&mut a, &t)?;
    let cfg =
        TrainConfig::load(a.config.as_deref(), &t.overrides).context("invalid configuration")?;
    if let Some(k) = cfg.run.kernels {
        grpo_models::kernels::set_kernels(k);
    }
    let source = grpo_models::hub::resolve_model(cfg.run.model.as_deref())?;
    let model = ModelShapes::read(&source)?;
    let memory = memory(&a)?;
    let memory_bytes = memory.as_ref().map(|m| m.0);
    let on_gpu = a.card.is_some() || cfg.run.device.names_a_gpu();
    let (compute, dtype) = compute(&cfg, on_gpu);
    let (prompt_tokens, prompt_from) = match a.prompt_tokens {
        Some(n) => (n, "--prompt_tokens".to_string()),
        None => prompt_tokens(&cfg, &source),
    };
    let input = PlanInput {
        lora: lora(&cfg, &model),
        compute,
        dtype_bytes: dtype.size_in_bytes(),
        reference: !matches!(cfg.loss.kl(), KlMode::None),
        sync_ref_model: cfg.loss.sync_ref_model,
        needs_old: cfg.update.num_iterations > 1
            || cfg.steps_per_generation > cfg.update.gradient_accumulation_steps
            || matches!(cfg.loss.kl(), KlMode::Reward { .. }),
        gradient_checkpointing: cfg.update.gradient_checkpointing,
        world_size: a.world_size,
        zero_stage: a.zero_stage.unwrap_or(match cfg.update.zero_stage {
            ZeroStage::Off => 0,
            ZeroStage::Moments => 1,
            ZeroStage::Gradients => 2,
            ZeroStage::Params => 3,
        }),
        batch: batch(&cfg, prompt_tokens),
        memory: memory_bytes,
        model,
    };
    let plan = mp::plan(&input)?;
    match a.format.as_str() {
        "json" => {
            let mut v = serde_json::to_value(&plan)?;
            v["memory_bytes"] = serde_json::json!(memory_bytes);
            v["prompt_tokens"] = serde_json::json!(prompt_tokens);
            v["fits"] =
                serde_json::json!(memory_bytes
                    .map(|b| plan.peak_bytes as f64 <= b as f64 * (1.0 - mp::FIT_HEADROOM)));
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
        "table" => print_table(&plan, &input, &source, &prompt_from, memory),
        other => bail!("--format {other}: expected table or json"),
    }
    Ok(())
}

/// The plan's options given among the overrides (`--world_size 8` after `--beta=0.04`).
fn take_trailing(a: &mut PlanArgs, t: &crate::common::Trailing) -> Result<()> {
    let num = |name: &str, v: &str| -> Result<usize> {
        v.parse()
            .with_context(|| format!("--{name} {v}: expected a whole number"))
    };
    if let Some(v) = t.option("config") {
        if a.config.is_some() {
            bail!("--config is given twice");
        }
        a.config = Some(PathBuf::from(v));
    }
    if let Some(v) = t.option("world_size") {
        a.world_size = num("world_size", v)?;
    }
    if let Some(v) = t.option("zero_stage") {
        a.zero_stage = Some(u8::try_from(num("zero_stage", v)?).unwrap_or(u8::MAX));
    }
    if let Some(v) = t.option("prompt_tokens") {
        a.prompt_tokens = Some(num("prompt_tokens", v)?);
    }
    for (name, slot) in [("memory", &mut a.memory), ("card", &mut a.card)] {
        if let Some(v) = t.option(name) {
            *slot = Some(v.to_string());
        }
    }
    if let Some(v) = t.option("format") {
        a.format = v.to_string();
    }
    Ok(())
}

/// The memory to check against and where it comes from: `--memory`, `--card`, else this
/// machine's RAM (`None` when neither is known).
fn memory(a: &PlanArgs) -> Result<Option<(u64, String)>> {
    match (&a.memory, &a.card) {
        (Some(_), Some(_)) => bail!("give --memory or --card, not both"),
        (Some(m), None) => Ok(Some((mp::parse_bytes(m)?, format!("--memory {m}")))),
        (None, Some(c)) => Ok(Some((mp::card_memory(c)?, format!("card {c}")))),
        (None, None) => Ok(machine_ram().map(|b| (b, "this machine's RAM".to_string()))),
    }
}

/// `MemTotal` of `/proc/meminfo`, in bytes.
fn machine_ram() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line
        .trim_start_matches("MemTotal:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// The compute the run would take and its dtype: a GPU's kernels in the config's dtype (`auto`:
/// bf16), or what this CPU resolves the dtype to (`auto`: bf16 where its products have bf16
/// hardware; the run itself measures both rates and may keep f32).
fn compute(cfg: &TrainConfig, on_gpu: bool) -> (Compute, DType) {
    let bf16_cpu = Compute::resolve(&candle_core::Device::Cpu, DType::BF16).bf16_matmuls();
    let dtype = match cfg.run.dtype {
        DTypeOpt::Auto if on_gpu || bf16_cpu => DType::BF16,
        d => d.compute(),
    };
    match on_gpu {
        true => (Compute::Gpu, dtype),
        false => (Compute::resolve(&candle_core::Device::Cpu, dtype), dtype),
    }
}

/// LoRA's adapters (`lora.*`), counted on the model's projections.
fn lora(cfg: &TrainConfig, model: &ModelShapes) -> Option<LoraPlan> {
    let mut l = cfg.lora.adapters()?;
    if l.target_modules.is_empty() {
        l.target_modules = grpo::peft::default_targets(model.config.arch);
    }
    let targets = |m: &str| l.targets(m);
    Some(LoraPlan {
        trainable: model.lora_elems(l.r, &targets),
        merged_elems: model.merged_elems(&targets),
        activation_elems: model.lora_activation_elems(&targets, l.dropout > 0.0),
        quantized_bits: cfg.lora.base_quantization.map(|q| match q.name() {
            "q8_0" => 8.5,
            "q4_1" => 5.0,
            _ => 4.5,
        }),
    })
}

/// The batch a rank sees, from the config.
fn batch(cfg: &TrainConfig, prompt_tokens: usize) -> BatchShape {
    let oversample = match cfg.logging.dynamic_sampling {
        true => cfg.logging.dynamic_sampling_oversample.max(1.0),
        false => 1.0,
    };
    let g = cfg.generation.num_generations.max(1);
    let groups = (cfg.prompts_per_step() as f64 * oversample).ceil() as usize;
    BatchShape {
        prompt_tokens,
        completion_tokens: cfg.generation.max_completion_length,
        generations: g,
        micro_batch: cfg.update.per_device_train_batch_size,
        round_sequences: groups.max(1) * g,
        sampling_batch: cfg.generation.sampling_batch_size.unwrap_or(0),
        forward_chunk_tokens: cfg.update.forward_chunk_tokens,
    }
}

/// The longest training prompt in tokens (capped by `max_prompt_length`) and how it was found:
/// measured with the model's tokenizer on the training prompts (their first 5,000), else
/// `max_prompt_length` (512 when unlimited).
fn prompt_tokens(cfg: &TrainConfig, source: &grpo_models::hub::ModelSource) -> (usize, String) {
    let cap = cfg.data.max_prompt_length;
    let fallback = |why: String| (cap.unwrap_or(512), format!("max_prompt_length ({why})"));
    let tok = match grpo_models::weights::load_tokenizer(source) {
        Ok(t) => t,
        Err(e) => return fallback(format!("no tokenizer: {e}")),
    };
    let examples = match grpo::inputs::train_examples(cfg) {
        Ok(x) => x,
        Err(e) => return fallback(format!("training prompts unreadable: {e}")),
    };
    let mut longest = 0;
    for ex in examples.iter().take(5000) {
        match grpo::data::prompt_ids(&tok, ex, cfg.data.system_prompt.as_deref(), cap) {
            Ok(ids) => longest = longest.max(ids.len()),
            Err(e) => return fallback(format!("a prompt does not tokenize: {e}")),
        }
    }
    let n = examples.len().min(5000);
    (longest.max(1), format!("longest of {n} training prompts"))
}

fn print_table(
    plan: &Plan,
    input: &PlanInput,
    source: &grpo_models::hub::ModelSource,
    prompt_from: &str,
    memory: Option<(u64, String)>,
) {
    let c = &input.model.config;
    let b = &input.batch;
    println!(
        "model: {} ({}, {:.1} M params, {} layers, hidden {}, vocab {}; shapes from {:?})",
        source.path().display(),
        c.arch.name(),
        plan.params as f64 / 1e6,
        c.num_layers,
        c.hidden_size,
        c.vocab_size,
        plan.shape_source
    );
    println!(
        "run: {} compute, {} B/element, {}, {} rank(s), ZeRO stage {}",
        plan.compute,
        input.dtype_bytes,
        match &input.lora {
            Some(l) => format!("LoRA ({:.2} M trainable)", l.trainable as f64 / 1e6),
            None => "full fine-tuning".to_string(),
        },
        plan.world_size,
        plan.zero_stage
    );
    println!(
        "batch per rank: {} completions per round, micro-batch {}, prompt {} tokens ({prompt_from}), completion {}; a pass: {} tokens ({} completion), {} per micro-batch (budget {})",
        b.round_sequences,
        b.micro_batch,
        b.prompt_tokens,
        b.completion_tokens,
        plan.pass.tokens,
        plan.pass.completion_tokens,
        plan.pass.passes,
        plan.pass.budget
    );
    println!();
    println!("{:<20} {:<10} {:>12}  how", "per rank", "held", "bytes");
    for t in &plan.terms {
        println!(
            "{:<20} {:<10} {:>12}  {}",
            t.name,
            t.phase.name(),
            mp::human(t.bytes),
            t.how
        );
    }
    println!(
        "{:<20} {:<10} {:>12}  always-held + {} (rollout {}, log-probs {}, update {})",
        "peak",
        "",
        mp::human(plan.peak_bytes),
        plan.peak_phase.name(),
        mp::human(plan.phase_bytes(mp::Phase::Rollout)),
        mp::human(plan.phase_bytes(mp::Phase::LogProbs)),
        mp::human(plan.phase_bytes(mp::Phase::Update)),
    );
    match memory {
        Some((bytes, from)) => println!("\n{} ({from})", mp::verdict(plan.peak_bytes, bytes)),
        None => println!("\n(no memory to check against: give --card or --memory)"),
    }
}
