//! The update: a round's [`TrainBatch`] becomes optimizer steps. [`update_round`] walks TRL's
//! structure (`num_iterations` passes, each split into optimizer steps of
//! `gradient_accumulation_steps` micro-batches of `per_device_train_batch_size` completions);
//! [`update_policy`] is one optimizer step (the golden tests pin it to TRL); [`policy_gradients`]
//! is its forward/backward part.

use std::ops::Range;

use candle_core::Tensor;

use super::policy::{Policy, TrainForward};
use super::profile::{lap, Laps};
use super::world::World;
use crate::logprobs::{forward_chunks, Entropy};
use crate::loss::{grpo_loss, AdaptiveEntropy, LossInputs, LossOptions, MicroTotals, Reduction};
use crate::optim::{accumulate, clip_factor, lr_lambda, AdamW, LrSchedule};
use crate::rollout::TrainBatch;
use crate::{Error, Result};
use grpo_models::seeding::mix_seed;

/// How the update runs; resolved from the config once.
#[derive(Debug, Clone)]
pub struct UpdateOptions {
    pub loss: LossOptions,
    /// Entropies for logging (`Detached`) or with a gradient (an entropy bonus in the loss).
    pub entropy: Entropy,
    /// The sampling temperature (log-probs are taken under it).
    pub temperature: f64,
    /// Padding token id.
    pub pad: u32,
    /// Tokens per forward/backward pass (a micro-batch is split into chunks of whole groups).
    pub forward_chunk_tokens: usize,
    /// Global gradient-norm clipping (0: off).
    pub max_grad_norm: f64,
    pub gradient_checkpointing: bool,
    /// The run's seed (LoRA dropout streams).
    pub seed: u64,
    /// Completions per micro-batch.
    pub micro_batch: usize,
    pub accumulation_steps: usize,
    pub steps_per_generation: usize,
    pub num_iterations: usize,
    pub max_completion_length: usize,
    /// Stop after this many non-finite steps in a row.
    pub max_bad_steps: usize,
}

/// The learning rate at each optimizer step.
#[derive(Debug, Clone, Copy)]
pub struct Schedule {
    pub learning_rate: f64,
    pub kind: LrSchedule,
    pub warmup_steps: u64,
    pub total_steps: u64,
}

impl Schedule {
    pub fn lr(&self, step: u64) -> f64 {
        self.learning_rate * lr_lambda(self.kind, step, self.warmup_steps, self.total_steps)
    }
}

/// Statistics of one optimizer step.
#[derive(Debug, Clone, Default)]
pub struct StepStats {
    pub loss: f64,
    pub policy_loss: f64,
    pub kl: f64,
    pub entropy: f64,
    pub mean_logp: f64,
    pub clip_low: f64,
    pub clip_high: f64,
    pub clip_region: f64,
    pub grad_norm: f64,
    pub lr: f64,
    /// Entropy summed over the tokens the entropy bonus acts on, and their count.
    pub bonus_entropy_sum: f64,
    pub bonus_tokens: f64,
    /// The entropy coefficient after the step (adaptive entropy control moves it).
    pub entropy_coef: f64,
    /// Loss and gradient norm were finite (else the update was skipped).
    pub finite: bool,
    /// Model FLOPs of this rank's forward and backward passes ([`crate::flops`]; 0 where the
    /// policy kind does not count them).
    pub flops: f64,
}

impl StepStats {
    /// The statistics that are sums of per-rank shares (each normalized by the world's counts).
    fn shares_mut(&mut self) -> [&mut f64; 10] {
        [
            &mut self.loss,
            &mut self.policy_loss,
            &mut self.kl,
            &mut self.entropy,
            &mut self.mean_logp,
            &mut self.clip_low,
            &mut self.clip_high,
            &mut self.clip_region,
            &mut self.bonus_entropy_sum,
            &mut self.bonus_tokens,
        ]
    }
}

/// Where the optimizer-step counter and the non-finite streak live (the trainer's state).
pub struct StepCounter<'a> {
    pub step: &'a mut u64,
    pub consecutive_nonfinite: &'a mut usize,
    /// Steps skipped for non-finite numbers over the whole run.
    pub skipped_steps: &'a mut u64,
    /// Adaptive entropy control's state, when on.
    pub adaptive_entropy: Option<&'a mut AdaptiveEntropy>,
}

/// The optimizer steps of one round; `on_step(step)` after each. Stops at `schedule.total_steps`.
#[allow(clippy::too_many_arguments)]
pub fn update_round<P: Policy>(
    policy: &P,
    opt: &mut AdamW,
    batch: &TrainBatch,
    opts: &UpdateOptions,
    schedule: &Schedule,
    mut counter: StepCounter,
    world: &dyn World,
    on_step: &mut dyn FnMut(u64),
) -> Result<Vec<StepStats>> {
    let (mb, accum) = (opts.micro_batch, opts.accumulation_steps);
    let mut active = [batch.active_tokens() as f64];
    world.sum_f64(&mut active)?;
    let red = Reduction {
        accumulation_steps: accum,
        max_completion_length: opts.max_completion_length,
        dapo_tokens: active[0] * accum as f64 / opts.steps_per_generation as f64,
        micro: None,
    };
    // Micro-batches of `mb` rows in order; `accum` of them make one optimizer step.
    let micro: Vec<Range<usize>> = (0..batch.rows.len())
        .step_by(mb.max(1))
        .map(|s| s..(s + mb).min(batch.rows.len()))
        .collect();
    let mut stats = Vec::new();
    for _ in 0..opts.num_iterations {
        for window in micro.chunks(accum.max(1)) {
            if *counter.step >= schedule.total_steps {
                return Ok(stats);
            }
            let step = *counter.step;
            let adaptive_opts;
            let step_opts = match counter.adaptive_entropy.as_deref() {
                Some(ae) => {
                    adaptive_opts = UpdateOptions {
                        loss: LossOptions {
                            entropy_coef: ae.apply_coef(),
                            ..opts.loss.clone()
                        },
                        ..opts.clone()
                    };
                    &adaptive_opts
                }
                None => opts,
            };
            // LoRA dropout masks: one stream per optimizer step (exact resume).
            let mut st = update_policy(
                policy,
                opt,
                batch,
                window,
                &red,
                step_opts,
                schedule.lr(step),
                0x4452_4f50 ^ step,
                world,
            )?;
            st.entropy_coef = opts.loss.entropy_coef;
            if let Some(ae) = counter.adaptive_entropy.as_deref_mut() {
                // The window's entropy over the world's bonus tokens.
                let mut m = [st.bonus_entropy_sum, st.bonus_tokens];
                world.sum_f64(&mut m)?;
                ae.update(m[0] / m[1].max(1.0));
                st.entropy_coef = ae.coef;
            }
            let bad = (!st.finite).then_some("a non-finite loss or gradient");
            count_step(&mut counter, bad, opts.max_bad_steps)?;
            on_step(*counter.step);
            stats.push(st);
        }
    }
    Ok(stats)
}

/// Counts one optimizer step; a `bad` one (its update skipped, `bad` says why) extends the
/// streak of bad steps, and `max_bad_steps` in a row stop the run.
fn count_step(counter: &mut StepCounter, bad: Option<&str>, max_bad_steps: usize) -> Result<()> {
    *counter.step += 1;
    let Some(why) = bad else {
        *counter.consecutive_nonfinite = 0;
        return Ok(());
    };
    *counter.consecutive_nonfinite += 1;
    *counter.skipped_steps += 1;
    tracing::warn!(
        "step {}: {why}; update skipped ({} in a row, {} in this run)",
        counter.step,
        counter.consecutive_nonfinite,
        counter.skipped_steps
    );
    if *counter.consecutive_nonfinite >= max_bad_steps {
        return Err(Error::Training(format!(
            "{} steps in a row skipped for non-finite numbers (the last: {why}): stopping. \
             Look at the rewards and the learning rate; max_bad_steps (now {max_bad_steps}) \
             sets how many are tolerated",
            counter.consecutive_nonfinite
        )));
    }
    Ok(())
}

/// A round whose data is bad before any forward (an infinite reward): each of its optimizer
/// steps is counted and skipped, as a non-finite step is, and the weights and moments stay as
/// they are.
pub fn skip_round(
    updates_per_round: u64,
    schedule: &Schedule,
    mut counter: StepCounter,
    why: &str,
    max_bad_steps: usize,
) -> Result<Vec<StepStats>> {
    let mut stats = Vec::new();
    for _ in 0..updates_per_round {
        if *counter.step >= schedule.total_steps {
            break;
        }
        let lr = schedule.lr(*counter.step);
        count_step(&mut counter, Some(why), max_bad_steps)?;
        stats.push(StepStats {
            lr,
            loss: f64::NAN,
            grad_norm: f64::NAN,
            finite: false,
            ..Default::default()
        });
    }
    Ok(stats)
}

/// One optimizer step over the micro-batches `window` of `batch`: [`policy_gradients`], summed
/// over the world, clipped to `max_grad_norm`, AdamW at `lr`. A non-finite loss or gradient
/// skips the update (the statistics say so).
#[allow(clippy::too_many_arguments)]
pub fn update_policy<P: Policy>(
    policy: &P,
    opt: &mut AdamW,
    batch: &TrainBatch,
    window: &[Range<usize>],
    red: &Reduction,
    opts: &UpdateOptions,
    lr: f64,
    dropout_stream: u64,
    world: &dyn World,
) -> Result<StepStats> {
    let (mut grads, mut st) =
        policy_gradients(policy, batch, window, red, opts, dropout_stream, world)?;
    let mut laps = grads.first().and_then(|g| Laps::start(g.device()));
    world.sum_grads(&mut grads)?;
    // Each rank's statistics are its share of the world's (global normalizers): sum them.
    let mut sums = st.shares_mut().map(|x| *x);
    world.sum_f64(&mut sums)?;
    for (x, sum) in st.shares_mut().into_iter().zip(sums) {
        *x = sum;
    }
    if grpo_models::faults::fires("update.nan_grad") {
        if let Some(g) = grads.first_mut() {
            *g = (&*g * f64::NAN)?;
        }
    }
    if grpo_models::faults::fires("update.nan_loss") {
        st.loss = f64::NAN;
    }
    grpo_models::faults::kill_point("update.before_step");
    lap(&mut laps, "all-reduce");
    let (norm, scale) = clip_factor(&grads, opts.max_grad_norm, opt.compute())?;
    lap(&mut laps, "clip");
    st.lr = lr;
    st.grad_norm = norm;
    st.finite = st.loss.is_finite() && norm.is_finite();
    if st.finite {
        opt.step(&grads, lr, scale)?;
    }
    lap(&mut laps, "adamw");
    if let Some(l) = &laps {
        l.report("optimizer");
    }
    Ok(st)
}

/// The gradient of the GRPO loss for every parameter of `policy` (in [`Policy::vars`] order) over
/// the micro-batches `window`, each split into forward chunks of whole groups; and the step's loss
/// statistics. Every parameter must receive a gradient (an op without a backward is an error).
/// Across ranks, each micro-batch is this rank's part of the world's: its normalizers count the
/// world's rows and tokens, so the ranks' gradients and statistics sum to the world's.
pub fn policy_gradients<P: Policy>(
    policy: &P,
    batch: &TrainBatch,
    window: &[Range<usize>],
    red: &Reduction,
    opts: &UpdateOptions,
    dropout_stream: u64,
    world: &dyn World,
) -> Result<(Vec<Tensor>, StepStats)> {
    let fwd = policy.for_update(
        mix_seed(opts.seed, dropout_stream),
        opts.gradient_checkpointing,
    )?;
    let vars = policy.vars();
    let device = vars
        .first()
        .map(|v| v.device().clone())
        .unwrap_or(candle_core::Device::Cpu);
    let mut grads: Vec<Option<Tensor>> = vec![None; vars.len()];
    let mut st = StepStats::default();
    let mut laps = Laps::start(&device);
    let flop_shape = policy.flop_shape();
    let k = window.len() as f64;
    for range in window {
        grpo_models::faults::kill_point("update.micro_batch");
        let mut t = [
            range.len() as f64,
            batch.active_tokens_in(range.clone()) as f64,
        ];
        world.sum_f64(&mut t)?;
        let totals = MicroTotals {
            rows: t[0] as usize,
            active_tokens: t[1],
        };
        let red = Reduction {
            micro: Some(totals),
            ..*red
        };
        let rows = &batch.rows[range.clone()];
        let prompts: Vec<&[u32]> = rows.iter().map(|r| r.prompt_ids.as_slice()).collect();
        let comps: Vec<&[u32]> = rows.iter().map(|r| r.completion_ids.as_slice()).collect();
        // The high-entropy mask's quantile is over the micro-batch: take it in one piece.
        let chunk_tokens = if opts.loss.top_entropy_quantile < 1.0 {
            usize::MAX
        } else {
            opts.forward_chunk_tokens
        };
        for part in forward_chunks(&prompts, &comps, chunk_tokens) {
            let part = range.start + part.start..range.start + part.end;
            let mb = batch.micro(part, &device)?;
            if let Some(f) = &flop_shape {
                st.flops += f.pass(&crate::flops::pass_work(&mb.prompts, &mb.completions));
            }
            lap(&mut laps, "inputs");
            let (mut logps, ents) = fwd.logprobs(&mb, opts.pad, opts.temperature, opts.entropy)?; // [n, Tc] f32
            lap(&mut laps, "forward");
            if grpo_models::faults::fires("update.nan_logits") {
                logps = (logps * f64::NAN)?;
            }
            let out = grpo_loss(
                &LossInputs {
                    logps: &logps,
                    old_logps: mb.old_logps.as_ref(),
                    ref_logps: mb.ref_logps.as_ref(),
                    advantages: &mb.advantages,
                    mask: &mb.mask,
                    entropies: ents.as_ref(),
                },
                &opts.loss,
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
            st.bonus_entropy_sum += out.bonus_entropy_sum as f64;
            st.bonus_tokens += out.bonus_tokens as f64;
            st.mean_logp += (logps.detach() * &mb.mask)?.sum_all()?.to_scalar::<f32>()? as f64
                / totals.active_tokens.max(1.0)
                / k;
            lap(&mut laps, "loss");
            let mut g = out.loss.backward()?;
            lap(&mut laps, "backward");
            super::trace_memory("a chunk's backward", &device);
            // Take each gradient out of the store as it is added, so that at most one
            // parameter's chunk gradient is alive beside the accumulators. Every stored gradient
            // is a fresh sum made by the backward, so adding into it in place aliases nothing.
            for (i, v) in vars.iter().enumerate() {
                let gi = match (g.remove(v), fwd.take_chunk_grad(v)?) {
                    (Some(a), Some(b)) => Some((a + b)?),
                    (a, b) => a.or(b),
                };
                if let Some(gi) = gi {
                    grads[i] = Some(match grads[i].take() {
                        Some(acc) => accumulate(acc, &gi)?,
                        None => gi,
                    });
                }
            }
            lap(&mut laps, "accumulate");
        }
    }
    if let Some(l) = &laps {
        let passes = l.seconds(&["forward", "loss", "backward"]);
        let rate = match crate::flops::throughput(st.flops, passes, None) {
            Some((t, _)) => format!("; {t:.2} TFLOP/s over forward, loss and backward"),
            None => String::new(),
        };
        l.report(&format!("gradients ({} micro-batches{rate})", window.len()));
    }
    let mut all = Vec::with_capacity(grads.len());
    for ((v, name), graph) in vars.iter().zip(policy.names()).zip(grads) {
        all.push(match (graph, fwd.take_step_grad(v)?) {
            (Some(a), Some(b)) => accumulate(a, &b)?,
            (Some(a), None) | (None, Some(a)) => a,
            (None, None) => {
                return Err(Error::Invariant(format!(
                    "parameter {name} received no gradient (a forward op without backward?)"
                )))
            }
        });
    }
    Ok((all, st))
}
