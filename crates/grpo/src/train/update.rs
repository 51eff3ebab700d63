//! The update: a round's [`TrainBatch`] becomes optimizer steps. [`UpdatePlan`] walks TRL's
//! structure (`num_iterations` passes, each split into optimizer steps of
//! `gradient_accumulation_steps` micro-batches of `per_device_train_batch_size` completions);
//! one optimizer step is [`policy_gradients`] (forward, GRPO loss, backward) then
//! [`optimizer_step`] (the world's sums, clipping, AdamW), counted by [`StepCounter::count`].
//! `step::grpo_round` calls them in a round; [`update_policy`] (one step, which the
//! golden tests pin to TRL) and [`update_round`] (a batch's steps: the agents' warm-up) compose
//! the same calls.

use std::borrow::Cow;
use std::ops::Range;

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use super::policy::{Policy, TrainForward};
use super::probe::Probe;
use super::world::World;
use crate::logprobs::{forward_chunks, Entropy};
use crate::loss::{
    active_values, grpo_loss, AdaptiveEntropy, LossInputs, LossOptions, LossOutput, MicroTotals,
    Reduction,
};
use crate::optim::{accumulate, lr_lambda, AdamW, LrSchedule};
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
    /// Adds a forward chunk's loss statistics: the loss and the bonus sums as they are; the
    /// masked means weighted by the chunk's share of its micro-batch's active tokens
    /// (`micro_active` in the world), each of the step's `micro_batches` by its share.
    fn add_chunk(
        &mut self,
        out: &LossOutput,
        logps: &Tensor,
        mask: &Tensor,
        micro_active: f64,
        micro_batches: usize,
    ) -> Result<()> {
        let k = micro_batches as f64;
        let active = mask.sum_all()?.to_scalar::<f32>()? as f64;
        let w = active / micro_active.max(1.0) / k;
        self.loss += out.loss.to_scalar::<f32>()? as f64;
        self.policy_loss += out.policy_loss as f64;
        self.kl += out.kl as f64 * w;
        self.entropy += out.entropy.unwrap_or(f32::NAN) as f64 * w;
        self.clip_low += out.clip_low as f64 * w;
        self.clip_high += out.clip_high as f64 * w;
        self.clip_region += out.clip_region as f64 * w;
        self.bonus_entropy_sum += out.bonus_entropy_sum as f64;
        self.bonus_tokens += out.bonus_tokens as f64;
        // [n, Tc] f32 -> the masked sum of the log-probs
        self.mean_logp += (logps.detach() * mask)?.sum_all()?.to_scalar::<f32>()? as f64
            / micro_active.max(1.0)
            / k;
        Ok(())
    }

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

impl StepCounter<'_> {
    /// Counts the optimizer step `st` just took, with the entropy coefficient it ran under
    /// (adaptive entropy control moves it by the world's entropy over the bonus tokens); a
    /// non-finite step extends the streak of bad ones (`max_bad_steps` in a row stop the run).
    pub fn count(
        &mut self,
        mut st: StepStats,
        opts: &UpdateOptions,
        world: &dyn World,
    ) -> Result<StepStats> {
        st.entropy_coef = opts.loss.entropy_coef;
        if let Some(ae) = self.adaptive_entropy.as_deref_mut() {
            // The window's entropy over the world's bonus tokens.
            let mut m = [st.bonus_entropy_sum, st.bonus_tokens];
            world.sum_f64(&mut m)?;
            ae.update(m[0] / m[1].max(1.0));
            st.entropy_coef = ae.coef;
        }
        let bad = (!st.finite).then_some("a non-finite loss or gradient");
        count_step(self, bad, opts.max_bad_steps)?;
        Ok(st)
    }

    /// The options of the step at hand: `opts`, with adaptive entropy control's coefficient
    /// when it is on.
    pub fn options<'o>(&self, opts: &'o UpdateOptions) -> Cow<'o, UpdateOptions> {
        match self.adaptive_entropy.as_deref() {
            Some(ae) => Cow::Owned(UpdateOptions {
                loss: LossOptions {
                    entropy_coef: ae.apply_coef(),
                    ..opts.loss.clone()
                },
                ..opts.clone()
            }),
            None => Cow::Borrowed(opts),
        }
    }
}

/// How a round's batch becomes optimizer steps (TRL's structure): `num_iterations` passes over
/// it, each in windows of `gradient_accumulation_steps` micro-batches of
/// `per_device_train_batch_size` rows, one optimizer step per window; and the loss's
/// normalizers, over the world's active tokens.
pub struct UpdatePlan {
    pub reduction: Reduction,
    /// Micro-batches of rows, in order.
    micro: Vec<Range<usize>>,
    accumulation_steps: usize,
    num_iterations: usize,
}

impl UpdatePlan {
    /// Across ranks every rank takes the world's number of micro-batches (the most any rank
    /// has): a rank whose part of one is empty takes it with no rows, so that all take the same
    /// collectives.
    pub fn new(batch: &TrainBatch, opts: &UpdateOptions, world: &dyn World) -> Result<UpdatePlan> {
        let (mb, accum) = (opts.micro_batch.max(1), opts.accumulation_steps);
        let rows = batch.rows.len();
        // [this rank's active tokens, its micro-batches]: the world's sum and its most.
        let mut active = [batch.active_tokens() as f64];
        world.sum_f64(&mut active)?;
        let micro_batches = world.max_usize(rows.div_ceil(mb))?;
        Ok(UpdatePlan {
            reduction: Reduction {
                accumulation_steps: accum,
                max_completion_length: opts.max_completion_length,
                dapo_tokens: active[0] * accum as f64 / opts.steps_per_generation as f64,
                micro: None,
            },
            micro: (0..micro_batches)
                .map(|m| (m * mb).min(rows)..((m + 1) * mb).min(rows))
                .collect(),
            accumulation_steps: accum,
            num_iterations: opts.num_iterations,
        })
    }

    /// Whether the world has nothing to train on this round.
    pub fn is_empty(&self) -> bool {
        self.micro.is_empty()
    }

    /// Each optimizer step's window of micro-batches, in order.
    pub fn windows(&self) -> impl Iterator<Item = &[Range<usize>]> {
        (0..self.num_iterations).flat_map(|_| self.micro.chunks(self.accumulation_steps.max(1)))
    }
}

/// The LoRA dropout stream of optimizer step `step` (one per step: exact resume).
pub fn dropout_stream(step: u64) -> u64 {
    0x4452_4f50 ^ step
}

/// The optimizer steps of a batch outside a GRPO round (the agents' supervised warm-up, tests):
/// per window of [`UpdatePlan`], [`update_policy`]; `on_step(step)` after each. Stops at
/// `schedule.total_steps`. (A GRPO round takes the same steps in `step::grpo_round`.)
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
    let plan = UpdatePlan::new(batch, opts, world)?;
    let mut stats = Vec::new();
    for window in plan.windows() {
        let step = *counter.step;
        if step >= schedule.total_steps {
            break;
        }
        let step_opts = counter.options(opts);
        let lr = schedule.lr(step);
        let st = update_policy(
            policy,
            opt,
            batch,
            window,
            &plan.reduction,
            &step_opts,
            lr,
            dropout_stream(step),
            world,
        )?;
        stats.push(counter.count(st, opts, world)?);
        on_step(*counter.step);
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

/// One optimizer step over the micro-batches `window` of `batch`: [`policy_gradients`], then
/// [`optimizer_step`] (what the golden tests pin to TRL).
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
    let (grads, st) = policy_gradients(policy, batch, window, red, opts, dropout_stream, world)?;
    optimizer_step(opt, grads, st, lr, opts, world)
}

/// The optimizer step on this rank's gradients `grads` and statistics `st`: both summed over
/// the world (the gradients as the optimizer's `zero_stage` takes them: each whole, or this
/// rank's range), clipped to `max_grad_norm` by their global norm, AdamW at `lr`. A non-finite
/// loss or gradient skips the update (the statistics say so).
pub fn optimizer_step(
    opt: &mut AdamW,
    mut grads: Vec<Tensor>,
    mut st: StepStats,
    lr: f64,
    opts: &UpdateOptions,
    world: &dyn World,
) -> Result<StepStats> {
    let mut probe = Probe::new(grads.first().map(|g| g.device()), None);
    probe.before_step(&mut grads, &mut st.loss)?;
    sum_stats(world, &mut st)?;
    let grads = opt.reduce(grads, world)?;
    probe.lap("all-reduce");
    let (norm, scale) = opt.clip(&grads, opts.max_grad_norm, world)?;
    probe.lap("clip");
    st.lr = lr;
    st.grad_norm = norm;
    st.finite = st.loss.is_finite() && norm.is_finite();
    if st.finite {
        opt.update(grads, lr, scale, world)?;
    }
    probe.lap("adamw");
    probe.report("optimizer");
    Ok(st)
}

/// Sums this rank's statistics over the world: each is its share of the world's (the loss's
/// normalizers count the world's rows and tokens).
fn sum_stats(world: &dyn World, st: &mut StepStats) -> Result<()> {
    let mut sums = st.shares_mut().map(|x| *x);
    world.sum_f64(&mut sums)?;
    for (x, sum) in st.shares_mut().into_iter().zip(sums) {
        *x = sum;
    }
    Ok(())
}

/// The world's collectives, as a sharded optimizer state takes them.
impl<W: World + ?Sized> crate::optim::Ranks for W {
    fn rank(&self) -> usize {
        World::rank(self)
    }
    fn size(&self) -> usize {
        World::size(self)
    }
    fn sum_f64(&self, xs: &mut [f64]) -> Result<()> {
        World::sum_f64(self, xs)
    }
    fn sum_grads(&self, grads: &mut [Tensor]) -> Result<()> {
        World::sum_grads(self, grads)
    }
    fn reduce_scatter_f32(&self, xs: &[f32], counts: &[usize]) -> Result<Vec<f32>> {
        World::reduce_scatter_f32(self, xs, counts)
    }
    fn all_gather_f32(&self, mine: &[f32]) -> Result<Vec<f32>> {
        World::all_gather_f32(self, mine)
    }
}

/// The world's rows and active tokens in micro-batch `range` (each rank holds its part).
fn world_totals(world: &dyn World, batch: &TrainBatch, range: Range<usize>) -> Result<MicroTotals> {
    let mut t = [range.len() as f64, batch.active_tokens_in(range) as f64];
    world.sum_f64(&mut t)?;
    Ok(MicroTotals {
        rows: t[0] as usize,
        active_tokens: t[1],
    })
}

/// The gradient of the GRPO loss for every parameter of `policy` (in [`Policy::vars`] order) over
/// the micro-batches `window`, each split into forward chunks of whole groups; and the step's loss
/// statistics. Every parameter must receive a gradient (an op without a backward is an error).
/// Across ranks, each micro-batch is this rank's part of the world's: its normalizers count the
/// world's rows and tokens, so the ranks' gradients and statistics sum to the world's. Under
/// `zero_stage = 3` the result is one tensor, this rank's range of the world's summed gradients
/// (the gradient of the optimizer's one flat parameter), and every rank takes as many forward
/// passes per micro-batch as the rank with the most (idle ones only join the collectives).
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
    let sharded = fwd.sharded();
    let (vars, names) = match sharded {
        Some(s) => (&s.outer_vars[..], &s.outer_names[..]),
        None => (policy.vars(), policy.names()),
    };
    let device = super::policy_device(policy);
    let mut probe = Probe::new(Some(&device), policy.flop_shape());
    let mut grads: Vec<Option<Tensor>> = vec![None; vars.len()];
    let mut st = StepStats::default();
    let high_entropy = opts.loss.top_entropy_quantile < 1.0;
    for range in window {
        probe.micro_batch();
        let totals = world_totals(world, batch, range.clone())?;
        let red = Reduction {
            micro: Some(totals),
            ..*red
        };
        if range.is_empty() && high_entropy && sharded.is_none() {
            // This rank's part of the micro-batch is empty: it still takes the collective.
            world_entropy_threshold(world, None, opts.loss.top_entropy_quantile)?;
        }
        let parts = forward_parts(batch, range.clone(), opts, fwd.one_row());
        let passes = match sharded {
            Some(_) => world.max_usize(parts.len())?,
            None => parts.len(),
        };
        for k in 0..passes {
            let Some(part) = parts.get(k).cloned() else {
                if let Some(s) = sharded {
                    idle_pass(
                        s,
                        world,
                        high_entropy.then_some(opts.loss.top_entropy_quantile),
                    )?;
                }
                continue;
            };
            let mb = batch.micro(part, &device)?;
            probe.inputs(&mb);
            let (mut logps, ents) = fwd.logprobs(&mb, opts.pad, opts.temperature, opts.entropy)?; // [n, Tc] f32
            probe.forward(&mut logps)?;
            // The high-entropy tokens' threshold over the world's micro-batch (one piece here).
            let entropy_threshold = match (high_entropy, &ents) {
                (true, Some(e)) => {
                    let q = opts.loss.top_entropy_quantile;
                    world_entropy_threshold(world, Some((e, &mb.mask)), q)?
                }
                _ => None,
            };
            let inputs = LossInputs {
                logps: &logps,
                old_logps: mb.old_logps.as_ref(),
                ref_logps: mb.ref_logps.as_ref(),
                advantages: &mb.advantages,
                mask: &mb.mask,
                entropies: ents.as_ref(),
                entropy_threshold,
            };
            let out = grpo_loss(&inputs, &opts.loss, &red)?;
            st.add_chunk(&out, &logps, &mb.mask, totals.active_tokens, window.len())?;
            probe.lap("loss");
            let g = out.loss.backward()?;
            if let Some(s) = sharded {
                s.exchange.flush()?; // the blocks' gradients, reduced while the backward ran
            }
            probe.backward(&device);
            add_chunk_gradients(&mut grads, vars, g, &fwd)?;
            probe.lap("accumulate");
        }
    }
    st.flops = probe.flops;
    probe.report_gradients(window.len());
    // A rank with no rows in the window (its parts of the world's micro-batches were empty)
    // contributes zero gradients to the world's sum.
    let no_rows = window.iter().all(|r| r.is_empty());
    let all = step_gradients(grads, vars, names, &fwd, no_rows)?;
    match sharded {
        Some(s) => Ok((vec![s.finish(&all)?], st)),
        None => Ok((all, st)),
    }
}

/// `zero_stage = 3`: a forward pass's collectives on a rank that has no chunk left for it (its
/// part of the micro-batch is shorter than another rank's), in a pass's order: each block
/// gathered for the forward, the high-entropy threshold's gather (`quantile`), each block
/// gathered and its (zero) gradients reduced for the backward.
fn idle_pass(
    s: &super::policy::ShardedStep,
    world: &dyn World,
    quantile: Option<f64>,
) -> Result<()> {
    s.exchange.idle_forward()?;
    if let Some(q) = quantile {
        world_entropy_threshold(world, None, q)?;
    }
    s.exchange.idle_backward()
}

/// The `1 - q` quantile of the entropies of the tokens that count, over the world's micro-batch
/// (this rank's part: `entropies` and `mask` [n, T], or None when it has no rows); None when no
/// token counts anywhere.
fn world_entropy_threshold(
    world: &dyn World,
    part: Option<(&Tensor, &Tensor)>,
    q: f64,
) -> Result<Option<f32>> {
    let mine = match part {
        Some((ent, mask)) => active_values(ent, mask)?,
        None => vec![],
    };
    let all = match world.size() {
        1 => mine,
        _ => world.all_gather_f32(&mine)?,
    };
    Ok(crate::loss::quantile(&all, 1.0 - q))
}

/// The forward chunks of micro-batch `range` of `batch` (whole groups, at most
/// `forward_chunk_tokens` tokens each, counted as laid out in `one_row` or padded rows), as row
/// ranges of the batch. The high-entropy mask's quantile is over the micro-batch: then it is
/// taken in one piece.
fn forward_parts(
    batch: &TrainBatch,
    range: Range<usize>,
    opts: &UpdateOptions,
    one_row: bool,
) -> Vec<Range<usize>> {
    let rows = &batch.rows[range.clone()];
    let prompts: Vec<&[u32]> = rows.iter().map(|r| r.prompt_ids.as_slice()).collect();
    let comps: Vec<&[u32]> = rows.iter().map(|r| r.completion_ids.as_slice()).collect();
    let chunk_tokens = if opts.loss.top_entropy_quantile < 1.0 {
        usize::MAX
    } else {
        opts.forward_chunk_tokens
    };
    forward_chunks(&prompts, &comps, chunk_tokens, one_row)
        .into_iter()
        .map(|part| range.start + part.start..range.start + part.end)
        .collect()
}

/// Adds a chunk's gradients (candle's store `g`, and what the forward's recomputed blocks left
/// outside it) into the accumulators `acc`, taking each out of the store as it is added, so
/// that at most one parameter's chunk gradient is alive beside the accumulators. Every stored
/// gradient is a fresh sum made by the backward, so adding into it in place aliases nothing.
fn add_chunk_gradients<F: TrainForward>(
    acc: &mut [Option<Tensor>],
    vars: &[Var],
    mut g: GradStore,
    fwd: &F,
) -> Result<()> {
    for (i, v) in vars.iter().enumerate() {
        let gi = match (g.remove(v), fwd.take_chunk_grad(v)?) {
            (Some(a), Some(b)) => Some((a + b)?),
            (a, b) => a.or(b),
        };
        if let Some(gi) = gi {
            acc[i] = Some(match acc[i].take() {
                Some(a) => accumulate(a, &gi)?,
                None => gi,
            });
        }
    }
    Ok(())
}

/// The step's gradient of every parameter: the chunks' sums `acc` plus what the forward's
/// gradient sinks accumulated over the step. A parameter without either is an error (an op
/// without a backward).
fn step_gradients<F: TrainForward>(
    acc: Vec<Option<Tensor>>,
    vars: &[Var],
    names: &[String],
    fwd: &F,
    no_rows: bool,
) -> Result<Vec<Tensor>> {
    let mut all = Vec::with_capacity(acc.len());
    for ((v, name), graph) in vars.iter().zip(names).zip(acc) {
        all.push(match (graph, fwd.take_step_grad(v)?) {
            (Some(a), Some(b)) => accumulate(a, &b)?,
            (Some(a), None) | (None, Some(a)) => a,
            (None, None) if no_rows => v.as_tensor().zeros_like()?,
            (None, None) => {
                return Err(Error::Invariant(format!(
                    "parameter {name} received no gradient (a forward op without backward?)"
                )))
            }
        });
    }
    Ok(all)
}
