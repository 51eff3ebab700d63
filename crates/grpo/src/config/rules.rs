//! The rules that span keys, one function per section as [`sections`](super::sections) declares
//! the keys: each checks its section's keys against each other (and against the keys of other
//! sections they depend on), and a few normalize values in place. Every error names its key.
//! `TrainConfig::validate` calls them in turn.

use super::sections::{Agent, Data, Generation, Logging, Lora, Loss, Run, Update};
use super::values::{self, PolicyType, SpanLen};
use super::Masking;
use crate::{Error, Result};

fn bad<T>(k: &str, msg: String) -> Result<T> {
    Err(Error::config(k, msg))
}

/// `[generation]` with `[update]`: a generation round's size in completions and in micro-batches
/// (`generation_batch_size`, `steps_per_generation`: one of them, or per_device_train_batch_size
/// x gradient_accumulation_steps), in whole groups, ending on an optimizer step.
pub(super) fn batch_sizes(gen: &Generation, update: &Update) -> Result<(usize, usize)> {
    let per_device = update.per_device_train_batch_size;
    let accum = update.gradient_accumulation_steps;
    let g = gen.num_generations;
    let (gbs, spg) = match (gen.generation_batch_size, gen.steps_per_generation) {
        (Some(_), Some(_)) => {
            return bad(
                "generation_batch_size",
                "set generation_batch_size or steps_per_generation, not both".into(),
            )
        }
        (Some(gbs), None) => {
            if gbs == 0 || gbs % per_device != 0 {
                return bad("generation_batch_size", format!("{gbs} is not a positive multiple of per_device_train_batch_size={per_device}"));
            }
            (gbs, gbs / per_device)
        }
        (None, Some(spg)) => (per_device * spg.max(1), spg.max(1)),
        (None, None) => (per_device * accum, accum),
    };
    if gbs % g != 0 {
        return bad(
            "num_generations",
            format!("a batch must hold whole groups: generation_batch_size={gbs} is not a multiple of num_generations={g}; set per_device_train_batch_size to a multiple of {g}"),
        );
    }
    if spg % accum != 0 {
        return bad(
            "steps_per_generation",
            format!("steps_per_generation={spg} must be a multiple of gradient_accumulation_steps={accum} (each generation round ends on an optimizer step)"),
        );
    }
    Ok((gbs, spg))
}

/// `[generation]`: the temperature warm-up's hold needs a warm-up.
pub(super) fn generation(gen: &Generation) -> Result<()> {
    if gen.temperature_warmup_hold_steps > 0 && gen.temperature_warmup_steps == 0 {
        return bad(
            "temperature_warmup_hold_steps",
            "holds temperature_warmup_start before a warm-up, but there is none: set temperature_warmup_steps (e.g. 40) or remove the hold".into(),
        );
    }
    Ok(())
}

/// `[loss]`: the adaptive entropy control's bounds and step.
pub(super) fn adaptive_entropy(loss: &Loss) -> Result<()> {
    if loss.use_adaptive_entropy {
        let (lo, hi, d) = (
            loss.entropy_coef_min,
            loss.entropy_coef_max,
            loss.entropy_coef_delta,
        );
        if !(lo >= 0.0 && lo <= hi && hi.is_finite()) {
            return bad(
                "entropy_coef_min",
                format!("needs 0 <= entropy_coef_min <= entropy_coef_max, got {lo} and {hi}"),
            );
        }
        if !(d >= 0.0 && d.is_finite()) {
            return bad("entropy_coef_delta", format!("must be >= 0, got {d}"));
        }
    }
    Ok(())
}

/// `[loss]`: one KL (in the loss or in the reward); the adaptive KL controller's start.
pub(super) fn kl(loss: &Loss) -> Result<()> {
    if loss.beta > 0.0 && loss.kl_coef > 0.0 {
        return bad(
            "beta",
            "beta (KL in the loss) and kl_coef (KL in the reward) are both set: choose one".into(),
        );
    }
    if loss.kl_target.is_some() && loss.kl_coef == 0.0 {
        return bad(
            "kl_target",
            "the adaptive KL controller needs kl_coef > 0 (its starting value)".into(),
        );
    }
    Ok(())
}

/// `[data]`: the built-in task's operand range.
pub(super) fn data(data: &Data) -> Result<()> {
    if data.task_min_operand > data.task_max_operand {
        return bad(
            "task.min_operand",
            format!(
                "{} is above task.max_operand={}",
                data.task_min_operand, data.task_max_operand
            ),
        );
    }
    Ok(())
}

/// `[lora]` (with `[loss]`): alpha and dropout; a quantized base needs adapters; a LoRA run's
/// reference cannot be synced.
pub(super) fn lora(lora: &Lora, loss: &Loss) -> Result<()> {
    if let Some(l) = lora.adapters() {
        if !(l.alpha > 0.0 && l.alpha.is_finite()) {
            return bad("lora.alpha", format!("must be > 0, got {}", l.alpha));
        }
        if !(0.0..1.0).contains(&l.dropout) {
            return bad(
                "lora.dropout",
                format!("must be in [0, 1), got {}", l.dropout),
            );
        }
    }
    if lora.base_quantization.is_some() && lora.r == 0 {
        return bad(
            "base_quantization",
            "a quantized base is frozen, so it needs LoRA adapters to train: set lora.r (e.g. --lora.r=16)".into(),
        );
    }
    if lora.r > 0 && loss.sync_ref_model {
        return bad(
            "sync_ref_model",
            "with LoRA the reference is the base model with adapters off; it cannot be synced: set sync_ref_model = false".into(),
        );
    }
    Ok(())
}

/// `[loss]`: several rewards normalized then summed leave no place for KL in the reward.
pub(super) fn aggregation(loss: &Loss) -> Result<()> {
    if loss.multi_objective_aggregation == crate::advantages::RewardAggregation::NormalizeThenSum
        && loss.kl_coef > 0.0
    {
        return bad(
            "multi_objective_aggregation",
            "normalize_then_sum cannot be combined with kl_coef (KL in the reward); use beta \
             (KL in the loss) instead"
                .into(),
        );
    }
    Ok(())
}

/// `[run]` `policy = "fill_in"`: no adapters or gradient checkpointing, and a generator for the
/// user's inputs.
pub(super) fn fill_in_policy(run: &Run, data: &Data, lora: &Lora, update: &Update) -> Result<()> {
    // The fill-in policy trains its whole generator in f32 without recomputation: adapters
    // and gradient checkpointing would be silently ignored, so they are refused.
    if run.policy == PolicyType::FillIn {
        if lora.r > 0 {
            return bad(
                "lora.r",
                "policy = \"fill_in\" trains the whole generator: LoRA adapters are not \
                 implemented for it; leave lora.r (TRL: lora_r, use_peft) unset"
                    .into(),
            );
        }
        if update.gradient_checkpointing {
            return bad(
                "gradient_checkpointing",
                "policy = \"fill_in\" has no gradient checkpointing (its generator is \
                 small and single-step); leave it false"
                    .into(),
            );
        }
    }
    // A fill-in run on the user's inputs needs their generator (the built-in task brings
    // one); its reward is checked once the reward tables are read.
    if run.policy == PolicyType::FillIn && data.train_file.is_some() && run.model.is_none() {
        return bad(
            "model",
            "policy = \"fill_in\" with a train_file needs model = the directory of a \
             masked-LM generator (BERT, RoBERTa or DistilBERT *ForMaskedLM, or one \
             `grpo pretrain` made)"
                .into(),
        );
    }
    Ok(())
}

/// `zero_stage = 3` shards the causal LM's own parameters, gathering each block inside gradient
/// checkpointing's recomputation: it needs both, and has nothing to shard under LoRA (the
/// adapters are small and the base is frozen).
pub(super) fn zero_stage(run: &Run, lora: &Lora, update: &Update) -> Result<()> {
    if update.zero_stage != crate::optim::ZeroStage::Params {
        return Ok(());
    }
    if run.policy != PolicyType::CausalLm {
        return bad(
            "zero_stage",
            "3 shards a causal LM's parameters; policy = \"fill_in\" trains a small generator \
             whole: use 0, 1 or 2"
                .into(),
        );
    }
    if lora.r > 0 {
        return bad(
            "zero_stage",
            "3 shards the trained parameters, and with LoRA (lora.r) those are the small \
             adapters over a frozen base: use 2 (moments and gradients sharded)"
                .into(),
        );
    }
    if !update.gradient_checkpointing {
        return bad(
            "gradient_checkpointing",
            "zero_stage = 3 gathers each block's parameters for its forward and again for \
             gradient checkpointing's recomputation in the backward: set \
             gradient_checkpointing = true (or use zero_stage = 2)"
                .into(),
        );
    }
    Ok(())
}

/// `[data]` `mask_ratio`, `mask_span`, `mask_seed`: how a fill-in run masks its inputs on the
/// fly (None: they hold their masks).
pub(super) fn masking(run: &Run, data: &Data) -> Result<Option<Masking>> {
    Ok(match data.mask_ratio {
        Some(r) if run.policy == PolicyType::FillIn => Some(Masking {
            ratio: r.0,
            span: data.mask_span.0,
            seed: data.mask_seed.map_or(run.seed, |s| s as u64),
        }),
        Some(_) => {
            return bad(
                "mask_ratio",
                "masks inputs of policy = \"fill_in\"; a causal LM has nothing to mask".into(),
            )
        }
        None if data.mask_span != SpanLen((1, 1)) || data.mask_seed.is_some() => {
            let key = match data.mask_seed.is_some() {
                true => "mask_seed",
                false => "mask_span",
            };
            return bad(
                key,
                "applies to inputs masked on the fly: set mask_ratio too".into(),
            );
        }
        None => None,
    })
}

/// `[logging]`: the best model's metric (normalized) and what keeping it needs; the eval's ks
/// (sorted, without duplicates) and something to evaluate; `report_to` resolved.
pub(super) fn logging(logging: &mut Logging) -> Result<()> {
    // The best model: HF's spellings of an eval metric (`eval_accuracy`, `accuracy`) name ours.
    logging.metric_for_best_model = logging.metric_for_best_model.as_deref().map(|m| {
        if m.contains('/') {
            m.to_string()
        } else {
            format!("eval/{}", m.strip_prefix("eval_").unwrap_or(m))
        }
    });
    if logging.load_best_model_at_end {
        if logging.metric_for_best_model.is_none() {
            return bad(
                "load_best_model_at_end",
                "needs metric_for_best_model (e.g. \"eval/accuracy\") to know which checkpoint is best".into(),
            );
        }
        if logging.eval_steps == 0 || !logging.save_steps.is_multiple_of(logging.eval_steps) {
            return bad(
                "load_best_model_at_end",
                format!(
                    "needs save_steps ({}) to be a multiple of eval_steps ({}), so that every checkpoint has an evaluation",
                    logging.save_steps, logging.eval_steps
                ),
            );
        }
    }
    // Eval: the ks against the sample count, something to evaluate, the temperature.
    crate::eval::check_ks(
        &logging.eval_k,
        logging.eval_num_samples,
        "eval_k",
        "eval_num_samples",
    )?;
    logging.eval_k.sort_unstable();
    logging.eval_k.dedup();
    if logging.eval_num_samples == 0 && !logging.eval_greedy {
        return bad(
            "eval_num_samples",
            "0 samples with eval_greedy = false leave nothing to evaluate: set eval_num_samples \
             above 0 or eval_greedy = true"
                .into(),
        );
    }
    logging.report_to =
        values::resolve_report_to(&logging.report_to).map_err(|e| Error::config("report_to", e))?;
    Ok(())
}

/// `[agent]`: an agent's world is one of: tools and an environment class, an environment
/// program, an environment service. A program's episodes have no tool calls (every turn is an
/// action). The warm-up's traces need a warm-up, and their file must exist.
pub(super) fn agent(a: &Agent) -> Result<()> {
    if let Some(path) = &a.sft_warmup_file {
        if a.sft_warmup_steps == 0 {
            return Err(Error::config(
                "sft_warmup_file",
                "the warm-up's traces are read only when there is a warm-up: set sft_warmup_steps \
                 (e.g. 12), or remove sft_warmup_file",
            ));
        }
        if !path.is_file() {
            return Err(Error::config(
                "sft_warmup_file",
                format!("{}: no such file", path.display()),
            ));
        }
    }
    let given: Vec<&str> = [
        ("environment_factory", a.environment_factory.is_some()),
        ("environment_command", !a.environment_command.is_empty()),
        ("environment_url", a.environment_url.is_some()),
    ]
    .into_iter()
    .filter_map(|(k, set)| set.then_some(k))
    .collect();
    if let [first, second, ..] = given[..] {
        return Err(Error::config(
            second,
            format!("{first} and {second} are two ways to give the environment: set one"),
        ));
    }
    let Some(&program) = given.first().filter(|k| **k != "environment_factory") else {
        return Ok(());
    };
    if !a.tools.is_empty() {
        return Err(Error::config(
            "tools",
            format!(
                "an environment program ({program}) has no tools: every model turn is its \
                 action; remove tools, or give the environment as environment_factory"
            ),
        ));
    }
    if a.sft_warmup_steps > 0 {
        return Err(Error::config(
            "sft_warmup_steps",
            format!(
                "the warm-up's traces call a tool; an environment program ({program}) has none"
            ),
        ));
    }
    if let Some(url) = &a.environment_url {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(Error::config(
                "environment_url",
                format!("`{url}` must start with http:// or https://"),
            ));
        }
    }
    if a.environment_command.first().is_some_and(|p| p.is_empty()) {
        return Err(Error::config(
            "environment_command",
            "starts with an empty program name",
        ));
    }
    Ok(())
}
