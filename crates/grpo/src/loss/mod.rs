//! The GRPO objective on per-token log-probs: importance ratios, the clipped surrogate, the k3 KL
//! penalty, the entropy bonus and the `loss_type` reductions, with TRL's normalizations.
//!
//! Every function takes tensors laid out `[N, T]` (N completions of one micro-batch, T completion
//! positions, right-padded) plus a `[N, T]` f32 mask of real completion tokens, and returns
//! tensors; the tests check each against a plain-`f32` twin.

use candle_core::{Tensor, D};

use crate::named::named_enum;
use crate::Result;

named_enum! {
    /// How token losses are reduced (TRL's `loss_type`).
    pub enum LossType {
        /// Mean over each sequence's tokens, then over sequences.
        Grpo = "grpo",
        /// Sum over tokens / active tokens of the micro-batch.
        Bnpo = "bnpo",
        /// Sum over tokens / (sequences x max_completion_length).
        DrGrpo = "dr_grpo",
        /// Sum over tokens / active tokens of the accumulation window (TRL 1.x default).
        Dapo = "dapo",
        /// CISPO (MiniMax-M1): the importance weight, clipped from above at `epsilon_high` and
        /// detached, times the advantage and the token's log-prob; reduced as `dapo`.
        Cispo = "cispo",
        /// SAPO: a smooth sigmoid gate on the ratio instead of hard clipping, its temperature
        /// set by the advantage's sign; reduced as `grpo`.
        Sapo = "sapo",
        /// LUSPO: the clipped surrogate summed over each sequence's tokens (so a sequence
        /// weighs by its length), then the mean over sequences; meant for sequence-level ratios.
        Luspo = "luspo",
        /// VESPO: a detached Gamma weight of the sequence's importance ratio (asymmetric by the
        /// advantage's sign) times the advantage and the token's log-prob; reduced as `dapo`.
        Vespo = "vespo",
    }
}

named_enum! {
    /// Importance-sampling granularity (TRL's `importance_sampling_level`).
    pub enum IsLevel {
        Token = "token",
        /// GSPO: one ratio per sequence (mean of token log-ratios).
        Sequence = "sequence",
    }
}

/// Adaptive KL controller settings (KL in the reward).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveKlCfg {
    pub target: f64,
    pub horizon: f64,
}

/// Where the KL to the reference model goes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KlMode {
    /// No reference model.
    None,
    /// k3 estimator in the loss, weighted by `beta` (TRL).
    Loss { beta: f64 },
    /// `reward - coef * sum_t (logp - ref_logp)`, optionally with an adaptive coefficient.
    Reward {
        coef: f64,
        adaptive: Option<AdaptiveKlCfg>,
    },
}

/// Loss options, resolved from the config once.
#[derive(Debug, Clone, PartialEq)]
pub struct LossOptions {
    pub loss_type: LossType,
    pub importance_sampling_level: IsLevel,
    /// Lower clip: ratios below `1 - epsilon_low` stop contributing for negative advantages.
    pub epsilon_low: f64,
    /// Upper clip: ratios above `1 + epsilon_high` stop contributing for positive advantages.
    pub epsilon_high: f64,
    /// Two-sided clipping: cap the unclipped ratio at `delta` as well.
    pub delta: Option<f64>,
    /// Weight of the k3 KL penalty to the reference model in the loss (0 = none).
    pub beta: f64,
    /// Weight of the entropy bonus (0 = none).
    pub entropy_coef: f64,
    /// Multiply the per-token KL by the (differentiable) importance ratio, which makes its
    /// gradient the unbiased reverse-KL gradient (TRL's default; changes the gradient even
    /// on-policy, where the ratio's value is 1).
    pub use_bias_correction_kl: bool,
    /// `sapo`: the gate's temperature for tokens with positive / non-positive advantage.
    pub sapo_temperature_pos: f64,
    pub sapo_temperature_neg: f64,
    /// `vespo`: the Gamma weight's shape `k` and rate `lambda` for non-negative / negative
    /// advantages.
    pub vespo: VespoParams,
    /// Keep in the policy term only the tokens whose entropy is at or above this quantile of the
    /// micro-batch's active-token entropies, taken from the top (1 = every token; TRL's
    /// `top_entropy_quantile`).
    pub top_entropy_quantile: f64,
    /// DeepSeek-V3.2's off-policy sequence mask: drop sequences with a negative advantage whose
    /// mean `old - current` log-prob gap exceeds this (None: off).
    pub off_policy_mask_threshold: Option<f64>,
}

/// The shape and rate of VESPO's Gamma weight `phi(w) = exp(lambda) w^k exp(-lambda w)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VespoParams {
    pub k_pos: f64,
    pub lambda_pos: f64,
    pub k_neg: f64,
    pub lambda_neg: f64,
}

impl Default for VespoParams {
    /// TRL 1.16's defaults.
    fn default() -> Self {
        VespoParams {
            k_pos: 2.0,
            lambda_pos: 3.0,
            k_neg: 3.0,
            lambda_neg: 2.0,
        }
    }
}

/// How a micro-batch's summed token losses are normalized. All but `dapo` also divide by the
/// number of micro-batches accumulated into one optimizer step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reduction {
    /// Micro-batches accumulated into one optimizer step.
    pub accumulation_steps: usize,
    /// `max_completion_length`, for `dr_grpo`'s constant normalizer.
    pub max_completion_length: usize,
    /// `dapo`: active completion tokens per accumulation window (TRL: tokens in the generation
    /// batch x accumulation steps / steps per generation).
    pub dapo_tokens: f64,
    /// When the loss is computed on a part of a micro-batch (a forward chunk), the whole
    /// micro-batch's sizes, so that the parts' losses sum to the micro-batch's. `None`: the
    /// tensors given are the whole micro-batch.
    pub micro: Option<MicroTotals>,
}

/// Sizes of a whole micro-batch, for the normalizers of its parts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MicroTotals {
    /// Completions in the micro-batch.
    pub rows: usize,
    /// Completion tokens that count in the loss.
    pub active_tokens: f64,
}

impl Reduction {
    /// Completions and active tokens of the micro-batch that `mask` [N, T] belongs to.
    fn totals(&self, mask: &Tensor) -> Result<MicroTotals> {
        Ok(match self.micro {
            Some(t) => t,
            None => MicroTotals {
                rows: mask.dim(0)?,
                active_tokens: mask.sum_all()?.to_scalar::<f32>()? as f64,
            },
        })
    }
}

/// The loss of a micro-batch and its detached statistics.
#[derive(Debug)]
pub struct LossOutput {
    /// Scalar loss to differentiate.
    pub loss: Tensor,
    /// The policy part (before KL and entropy are added, after reduction), for logging.
    pub policy_loss: f32,
    /// Mean k3 KL over active tokens (0 when beta = 0).
    pub kl: f32,
    /// Share of active tokens whose ratio was clipped from below (negative advantage).
    pub clip_low: f32,
    /// Share of active tokens whose ratio was clipped from above (positive advantage).
    pub clip_high: f32,
    /// Share clipped either way.
    pub clip_region: f32,
    /// Mean entropy over active tokens (when entropies were given).
    pub entropy: Option<f32>,
    /// Entropy summed over the tokens the entropy bonus acts on (the active tokens, or the
    /// high-entropy ones with `top_entropy_quantile` < 1), and their count: the adaptive entropy
    /// controller's measurement.
    pub bonus_entropy_sum: f32,
    pub bonus_tokens: f32,
}

/// Inputs of one micro-batch.
#[derive(Debug)]
pub struct LossInputs<'a> {
    /// [N, T] f32 log-probs of the completion tokens under the policy (with graph).
    pub logps: &'a Tensor,
    /// [N, T] f32 log-probs under the policy that sampled the completions; `None` when on-policy
    /// (then the current log-probs, detached, are used: ratio 1 with the right gradient).
    pub old_logps: Option<&'a Tensor>,
    /// [N, T] f32 log-probs under the reference model (needed when beta > 0).
    pub ref_logps: Option<&'a Tensor>,
    /// [N] f32 advantages.
    pub advantages: &'a Tensor,
    /// [N, T] f32, 1 for tokens that count.
    pub mask: &'a Tensor,
    /// [N, T] f32 per-token entropies (with graph when `entropy_coef` > 0).
    pub entropies: Option<&'a Tensor>,
    /// `top_entropy_quantile`'s entropy threshold taken over the world's micro-batch (None:
    /// over these rows' `entropies`; and when no token counts anywhere).
    pub entropy_threshold: Option<f32>,
}

/// k3 estimator of KL(policy || ref) per token: `exp(ref - logp) - (ref - logp) - 1` (>= 0).
pub fn k3_kl(logps: &Tensor, ref_logps: &Tensor) -> Result<Tensor> {
    let d = (ref_logps - logps)?; // [N, T]
    Ok(((d.exp()? - &d)? - 1.0)?)
}

/// Log importance weights: per token (`[N, T]`), or per sequence as the masked mean of the token
/// log-ratios (`[N, 1]`, GSPO).
pub fn log_importance_weights(
    logps: &Tensor,
    old_logps: &Tensor,
    mask: &Tensor,
    level: IsLevel,
) -> Result<Tensor> {
    let log_ratio = (logps - old_logps)?; // [N, T]
    Ok(match level {
        IsLevel::Token => log_ratio,
        IsLevel::Sequence => {
            let num = (log_ratio * mask)?.sum_keepdim(D::Minus1)?; // [N, 1]
            let den = mask.sum_keepdim(D::Minus1)?.clamp(1.0, f64::INFINITY)?; // [N, 1]
            (num / den)?
        }
    })
}

/// The clipped surrogate per token: `-min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)`, with
/// `r` optionally capped at `delta` first. `log_w` [N, T] or [N, 1], `adv` [N] -> [N, T or 1].
pub fn clipped_surrogate(log_w: &Tensor, adv: &Tensor, opts: &LossOptions) -> Result<Tensor> {
    let coef1 = log_w.exp()?;
    let coef2 = coef1.clamp(1.0 - opts.epsilon_low, 1.0 + opts.epsilon_high)?;
    let coef1 = match opts.delta {
        Some(d) => coef1.clamp(f64::NEG_INFINITY, d)?,
        None => coef1,
    };
    let adv = adv.unsqueeze(1)?; // [N, 1]
    let l1 = coef1.broadcast_mul(&adv)?;
    let l2 = coef2.broadcast_mul(&adv)?;
    Ok(l1.minimum(&l2)?.neg()?)
}

/// CISPO per token: `-min(r, eps_high).detach() * A * logp`. `log_w` [N, T] or [N, 1], `logps`
/// [N, T], `adv` [N] -> [N, T].
pub fn cispo_surrogate(
    log_w: &Tensor,
    logps: &Tensor,
    adv: &Tensor,
    epsilon_high: f64,
) -> Result<Tensor> {
    let w = log_w
        .exp()?
        .clamp(f64::NEG_INFINITY, epsilon_high)?
        .detach();
    let wa = w.broadcast_mul(&adv.unsqueeze(1)?)?; // [N, T or 1]
    Ok(wa.broadcast_mul(logps)?.neg()?)
}

/// Per sequence, `pos` where `is_pos(advantage)`, else `neg`: `adv` [N] -> [N, 1] f32.
fn per_sign(adv: &Tensor, is_pos: impl Fn(f32) -> bool, pos: f64, neg: f64) -> Result<Tensor> {
    let v: Vec<f32> = adv
        .to_vec1::<f32>()?
        .into_iter()
        .map(|a| if is_pos(a) { pos } else { neg } as f32)
        .collect();
    let n = v.len();
    Ok(Tensor::from_vec(v, (n, 1), adv.device())?)
}

/// SAPO per token: `-sigmoid(tau * (r - 1)) * 4 / tau * A`, `tau` = `temp_pos` where A > 0,
/// else `temp_neg`. `log_w` [N, T] or [N, 1], `adv` [N] -> [N, T or 1].
pub fn sapo_surrogate(
    log_w: &Tensor,
    adv: &Tensor,
    temp_pos: f64,
    temp_neg: f64,
) -> Result<Tensor> {
    let tau = per_sign(adv, |a| a > 0.0, temp_pos, temp_neg)?; // [N, 1]
    let z = (log_w.exp()? - 1.0)?.broadcast_mul(&tau)?; // [N, T or 1]
                                                        // sigmoid from ops that all record a backward.
    let gate = ((z.neg()?.exp()? + 1.0)?.recip()? * 4.0)?.broadcast_div(&tau)?;
    Ok(gate.broadcast_mul(&adv.unsqueeze(1)?)?.neg()?)
}

/// VESPO's detached sequence weight `phi(w) = exp(lambda + k ln w - lambda w)`, `w` the product
/// of the sequence's token ratios (log-ratios clamped to ±20, `ln w` to [ln 1e-8, 20]), `k` and
/// `lambda` by the advantage's sign (>= 0: the `pos` pair). `logps`, `old_logps`, `mask` [N, T],
/// `adv` [N] -> [N, 1].
pub fn vespo_weights(
    logps: &Tensor,
    old_logps: &Tensor,
    mask: &Tensor,
    adv: &Tensor,
    p: &VespoParams,
) -> Result<Tensor> {
    let log_ratio = (logps.detach() - old_logps.detach())?.clamp(-20.0, 20.0)?; // [N, T]
    let log_w = (log_ratio * mask)?
        .sum_keepdim(D::Minus1)?
        .clamp(1e-8f64.ln(), 20.0)?; // [N, 1]
    let nonneg = |a: f32| a >= 0.0;
    let k = per_sign(adv, nonneg, p.k_pos, p.k_neg)?; // [N, 1]
    let lambda = per_sign(adv, nonneg, p.lambda_pos.max(1e-4), p.lambda_neg.max(1e-4))?; // [N, 1]
    let log_phi = ((&lambda + (k * &log_w)?)? - (lambda * log_w.exp()?)?)?; // [N, 1]
    let phi: Vec<f32> = log_phi
        .exp()?
        .flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(|x| if x.is_finite() { x } else { 0.0 })
        .collect();
    let n = phi.len();
    Ok(Tensor::from_vec(phi, (n, 1), adv.device())?)
}

/// VESPO per token: `-phi * A * logp`, `phi` from [`vespo_weights`] ([N, 1]), `logps` [N, T],
/// `adv` [N] -> [N, T].
pub fn vespo_surrogate(phi: &Tensor, logps: &Tensor, adv: &Tensor) -> Result<Tensor> {
    let wa = (phi * adv.unsqueeze(1)?)?; // [N, 1]
    Ok(wa.broadcast_mul(logps)?.neg()?)
}

/// The `q`-quantile of `values`, interpolating linearly between order statistics (as
/// `torch.quantile` does); None when `values` is empty.
pub fn quantile(values: &[f32], q: f64) -> Option<f32> {
    let mut v: Vec<f32> = values.to_vec();
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let pos = q.clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    let frac = (pos - lo as f64) as f32;
    Some(v[lo] + (v[hi] - v[lo]) * frac)
}

/// TRL's high-entropy token mask ("Beyond the 80/20 rule"): 1 where a token counts (`mask` [N, T])
/// and its entropy (`entropies` [N, T]) is at least the `1 - top_quantile` quantile of the
/// counting tokens' entropies; all zeros when no token counts. -> [N, T] f32.
pub fn high_entropy_mask(entropies: &Tensor, mask: &Tensor, top_quantile: f64) -> Result<Tensor> {
    let threshold = quantile(&active_values(entropies, mask)?, 1.0 - top_quantile);
    entropy_mask_at(entropies, mask, threshold)
}

/// The values of `x` [N, T] where `mask` [N, T] counts (> 0), in order.
pub fn active_values(x: &Tensor, mask: &Tensor) -> Result<Vec<f32>> {
    let v: Vec<f32> = x.detach().flatten_all()?.to_vec1()?;
    let m: Vec<f32> = mask.flatten_all()?.to_vec1()?;
    Ok(v.iter()
        .zip(&m)
        .filter(|(_, &m)| m > 0.0)
        .map(|(&e, _)| e)
        .collect())
}

/// 1 where a token counts (`mask` [N, T]) and its entropy is at least `threshold`; all zeros
/// without a threshold (no token counts). -> [N, T] f32.
pub fn entropy_mask_at(
    entropies: &Tensor,
    mask: &Tensor,
    threshold: Option<f32>,
) -> Result<Tensor> {
    let ent: Vec<f32> = entropies.detach().flatten_all()?.to_vec1()?;
    let m: Vec<f32> = mask.flatten_all()?.to_vec1()?;
    let out: Vec<f32> = match threshold {
        None => vec![0.0; ent.len()],
        Some(thr) => ent
            .iter()
            .zip(&m)
            .map(|(&e, &m)| f32::from(m > 0.0 && e * m >= thr))
            .collect(),
    };
    Ok(Tensor::from_vec(out, mask.dims(), mask.device())?)
}

/// DeepSeek-V3.2's off-policy sequence mask: keep a sequence (1) when its advantage is >= 0 or
/// its mean `old - current` log-prob gap over counting tokens is <= `threshold`; drop it (0)
/// otherwise. `logps`, `old_logps`, `mask` [N, T], `adv` [N] -> [N, 1] f32.
pub fn off_policy_mask(
    logps: &Tensor,
    old_logps: &Tensor,
    mask: &Tensor,
    adv: &Tensor,
    threshold: f64,
) -> Result<Tensor> {
    let (n, t) = logps.dims2()?;
    let gap: Vec<f32> = (old_logps.detach() - logps.detach())?
        .flatten_all()?
        .to_vec1()?; // [N*T]
    let m: Vec<f32> = mask.flatten_all()?.to_vec1()?;
    let a: Vec<f32> = adv.to_vec1()?;
    let keep: Vec<f32> = (0..n)
        .map(|i| {
            let row = i * t..(i + 1) * t;
            // A token without a log-prob (NaN) is no evidence either way.
            let sum: f32 = gap[row.clone()]
                .iter()
                .zip(&m[row.clone()])
                .map(|(&g, &m)| if g.is_nan() { 0.0 } else { g * m })
                .sum();
            let count: f32 = m[row].iter().sum();
            f32::from(a[i] >= 0.0 || sum / count.max(1.0) <= threshold as f32)
        })
        .collect();
    Ok(Tensor::from_vec(keep, (a.len(), 1), adv.device())?)
}

/// Reduces masked per-token losses [N, T] to the scalar of `loss_type`.
pub fn reduce(
    per_token: &Tensor,
    mask: &Tensor,
    loss_type: LossType,
    r: &Reduction,
) -> Result<Tensor> {
    let masked = (per_token * mask)?; // [N, T]
    let accum = r.accumulation_steps.max(1) as f64;
    let micro = r.totals(mask)?;
    let rows = micro.rows.max(1) as f64;
    Ok(match loss_type {
        LossType::Grpo | LossType::Sapo => {
            let per_seq =
                (masked.sum(D::Minus1)? / mask.sum(D::Minus1)?.clamp(1.0, f64::INFINITY)?)?; // [N]
            (per_seq.sum_all()? / (rows * accum))?
        }
        LossType::Luspo => (masked.sum_all()? / (rows * accum))?,
        LossType::Bnpo => (masked.sum_all()? / (micro.active_tokens.max(1.0) * accum))?,
        LossType::DrGrpo => (masked.sum_all()? / (rows * r.max_completion_length as f64 * accum))?,
        LossType::Dapo | LossType::Cispo | LossType::Vespo => {
            (masked.sum_all()? / r.dapo_tokens.max(1.0))?
        }
    })
}

/// Masked mean of a [N, T] tensor as an f32 (detached).
fn masked_mean(x: &Tensor, mask: &Tensor) -> Result<f32> {
    let num = (x.detach() * mask)?.sum_all()?.to_scalar::<f32>()?;
    let den = mask.sum_all()?.to_scalar::<f32>()?;
    Ok(if den > 0.0 { num / den } else { 0.0 })
}

/// The GRPO loss of one micro-batch (TRL's `_compute_loss` for grpo/bnpo/dr_grpo/dapo/cispo/sapo).
pub fn grpo_loss(inp: &LossInputs, opts: &LossOptions, red: &Reduction) -> Result<LossOutput> {
    let detached;
    let old = match inp.old_logps {
        Some(o) => o,
        None => {
            detached = inp.logps.detach();
            &detached
        }
    };
    let log_w = log_importance_weights(inp.logps, old, inp.mask, opts.importance_sampling_level)?;
    let mut surrogate = policy_surrogate(inp, old, &log_w, opts)?; // [N, T]

    // TRL 1.16's token masks on the policy term: off-policy sequences, then low-entropy tokens.
    if let Some(th) = opts.off_policy_mask_threshold {
        let keep = off_policy_mask(inp.logps, old, inp.mask, inp.advantages, th)?; // [N, 1]
        surrogate = surrogate.broadcast_mul(&keep)?;
    }
    let entropy_mask = match (opts.top_entropy_quantile < 1.0, inp.entropies) {
        (false, _) => None,
        (true, Some(ent)) => Some(match inp.entropy_threshold {
            Some(thr) => entropy_mask_at(ent, inp.mask, Some(thr))?,
            None => high_entropy_mask(ent, inp.mask, opts.top_entropy_quantile)?,
        }),
        (true, None) => {
            return Err(crate::Error::config(
                "top_entropy_quantile",
                "needs per-token entropies (invariant: the update computes them)",
            ))
        }
    }; // [N, T] f32
    if let Some(em) = &entropy_mask {
        surrogate = (surrogate * em)?;
    }
    let (clip_low, clip_high, clip_region) = clip_statistics(&log_w, inp, opts)?;

    let policy = reduce(&surrogate, inp.mask, opts.loss_type, red)?;
    let policy_loss = policy.to_scalar::<f32>()?;
    let (mut per_token, mut kl) = (surrogate, 0.0);
    if opts.beta != 0.0 {
        let ref_logps = inp
            .ref_logps
            .ok_or_else(|| crate::Error::config("beta", "beta > 0 needs reference log-probs"))?;
        let k3 = k3_kl(inp.logps, ref_logps)?;
        kl = masked_mean(&k3, inp.mask)?;
        let k3 = if opts.use_bias_correction_kl {
            k3.broadcast_mul(&log_w.exp()?)?
        } else {
            k3
        };
        per_token = (per_token + (k3 * opts.beta)?)?;
    }
    let loss = if opts.beta != 0.0 {
        reduce(&per_token, inp.mask, opts.loss_type, red)?
    } else {
        policy
    };
    let bonus = entropy_bonus(loss, inp, entropy_mask.as_ref(), opts, red)?;
    Ok(LossOutput {
        loss: bonus.loss,
        policy_loss,
        kl,
        clip_low,
        clip_high,
        clip_region,
        entropy: bonus.entropy,
        bonus_entropy_sum: bonus.sum,
        bonus_tokens: bonus.tokens,
    })
}

/// The per-token policy surrogate of `opts.loss_type` (`old`: the sampling policy's
/// log-probs; `log_w`: the log importance weights), broadcast to `[N, T]`.
fn policy_surrogate(
    inp: &LossInputs,
    old: &Tensor,
    log_w: &Tensor,
    opts: &LossOptions,
) -> Result<Tensor> {
    let surrogate = match opts.loss_type {
        LossType::Cispo => cispo_surrogate(log_w, inp.logps, inp.advantages, opts.epsilon_high)?,
        LossType::Vespo => {
            let phi = vespo_weights(inp.logps, old, inp.mask, inp.advantages, &opts.vespo)?;
            vespo_surrogate(&phi, inp.logps, inp.advantages)?
        }
        LossType::Sapo => sapo_surrogate(
            log_w,
            inp.advantages,
            opts.sapo_temperature_pos,
            opts.sapo_temperature_neg,
        )?,
        _ => clipped_surrogate(log_w, inp.advantages, opts)?,
    }; // [N, T] or [N, 1]
    let (n, t) = inp.logps.dims2()?;
    Ok(surrogate.broadcast_as((n, t))?) // [N, T]
}

/// TRL's clip statistics (`clip_ratio/low_mean`, `high_mean`, `region_mean`): the masked
/// shares of tokens whose importance weight is below `1 - epsilon_low` with a negative
/// advantage, above `1 + epsilon_high` with a positive one, and either.
fn clip_statistics(
    log_w: &Tensor,
    inp: &LossInputs,
    opts: &LossOptions,
) -> Result<(f32, f32, f32)> {
    let (n, t) = inp.logps.dims2()?;
    let coef = log_w.detach().exp()?.broadcast_as((n, t))?.contiguous()?; // [N, T]
    let adv = inp
        .advantages
        .unsqueeze(1)?
        .broadcast_as((n, t))?
        .contiguous()?; // [N, T]
    let low = coef
        .lt(1.0 - opts.epsilon_low)?
        .mul(&adv.lt(0f32)?)?
        .to_dtype(candle_core::DType::F32)?;
    let high = coef
        .gt(1.0 + opts.epsilon_high)?
        .mul(&adv.gt(0f32)?)?
        .to_dtype(candle_core::DType::F32)?;
    let clip_low = masked_mean(&low, inp.mask)?;
    let clip_high = masked_mean(&high, inp.mask)?;
    let clip_region = masked_mean(&(low + high)?, inp.mask)?;
    Ok((clip_low, clip_high, clip_region))
}

/// The entropy terms of a loss.
struct EntropyBonus {
    /// The loss less the entropy bonus (when `entropy_coef` is set).
    loss: Tensor,
    /// The masked mean entropy, when entropies were taken.
    entropy: Option<f32>,
    /// Entropy summed over the tokens the bonus acts on, and their count.
    sum: f32,
    tokens: f32,
}

/// Subtracts `entropy_coef` x the mean entropy from `loss`. The bonus acts on the tokens the
/// policy term keeps (all active ones, or the high-entropy subset `entropy_mask`); its mean is
/// over the micro-batch's such tokens.
fn entropy_bonus(
    mut loss: Tensor,
    inp: &LossInputs,
    entropy_mask: Option<&Tensor>,
    opts: &LossOptions,
    red: &Reduction,
) -> Result<EntropyBonus> {
    let Some(ent) = inp.entropies else {
        return Ok(EntropyBonus {
            loss,
            entropy: None,
            sum: 0.0,
            tokens: 0.0,
        });
    };
    let entropy = Some(masked_mean(ent, inp.mask)?);
    let bonus_mask = match entropy_mask {
        Some(em) => (em * inp.mask)?,
        None => inp.mask.clone(),
    }; // [N, T]
    let ent_sum = (ent * &bonus_mask)?.sum_all()?; // []
    let sum = ent_sum.detach().to_scalar::<f32>()?;
    let tokens = bonus_mask.sum_all()?.to_scalar::<f32>()?;
    if opts.entropy_coef != 0.0 {
        let accum = red.accumulation_steps.max(1) as f64;
        let den = match entropy_mask {
            // The update takes the micro-batch in one piece when entropies are masked.
            Some(_) => tokens as f64,
            None => red.totals(inp.mask)?.active_tokens,
        }
        .max(1.0);
        let mean_ent = (ent_sum / (den * accum))?;
        loss = (loss - (mean_ent * opts.entropy_coef)?)?;
    }
    Ok(EntropyBonus {
        loss,
        entropy,
        sum,
        tokens,
    })
}

/// Adaptive entropy control (Skywork-OR1, TRL's `use_adaptive_entropy`): after each optimizer
/// step the coefficient moves by `delta` up (entropy at or below `target`) or down, within
/// [`min`, `max`]; a step applies it only while the last measured entropy is at or below the
/// target (so not before the first measurement).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdaptiveEntropy {
    pub coef: f64,
    /// The entropy measured at the last optimizer step (None: not yet).
    pub last_entropy: Option<f64>,
    pub min: f64,
    pub max: f64,
    pub delta: f64,
    pub target: f64,
}

impl AdaptiveEntropy {
    /// The coefficient the next optimizer step applies.
    pub fn apply_coef(&self) -> f64 {
        match self.last_entropy {
            Some(e) if e <= self.target => self.coef,
            _ => 0.0,
        }
    }

    /// Takes the step's mean entropy over the tokens the bonus acts on.
    pub fn update(&mut self, entropy: f64) {
        self.coef = if entropy <= self.target {
            (self.coef + self.delta).min(self.max)
        } else {
            (self.coef - self.delta).max(self.min)
        };
        self.last_entropy = Some(entropy);
    }
}

/// Adaptive KL coefficient (Ziegler et al.): moves `coef` so the observed KL approaches `target`,
/// by at most ±20% per `horizon` samples.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdaptiveKl {
    pub coef: f64,
    pub target: f64,
    pub horizon: f64,
}

impl AdaptiveKl {
    /// Updates the coefficient after a batch of `n_samples` completions with mean KL `kl`.
    pub fn update(&mut self, kl: f64, n_samples: usize) {
        let err = (kl / self.target - 1.0).clamp(-0.2, 0.2);
        self.coef *= 1.0 + err * n_samples as f64 / self.horizon;
    }
}

impl KlMode {
    /// Weight of the KL term in the loss (`beta`; 0 unless the KL is in the loss).
    pub fn loss_beta(&self) -> f64 {
        match self {
            KlMode::Loss { beta } => *beta,
            _ => 0.0,
        }
    }

    /// The adaptive controller a run starts with (KL in the reward with a `kl_target`).
    pub fn adaptive_controller(&self) -> Option<AdaptiveKl> {
        match self {
            KlMode::Reward {
                coef,
                adaptive: Some(a),
            } => Some(AdaptiveKl {
                coef: *coef,
                target: a.target,
                horizon: a.horizon,
            }),
            _ => None,
        }
    }
}

/// KL in the reward for one round: each completion's penalty `coef * sum_t (old - ref)` (the
/// sampling policy's and the reference's log-probs) and the mean sequence KL, which the adaptive
/// controller (when there is one) then learns from; its coefficient wins over `coef`.
pub fn kl_reward_penalty(
    old: &[Vec<f32>],
    refl: &[Vec<f32>],
    coef: f64,
    adaptive: Option<&mut AdaptiveKl>,
) -> (Vec<f32>, f64) {
    let coef = adaptive.as_ref().map_or(coef, |a| a.coef);
    let kls: Vec<f32> = old
        .iter()
        .zip(refl)
        .map(|(o, r)| o.iter().zip(r).map(|(a, b)| a - b).sum())
        .collect();
    let penalties = kls.iter().map(|k| coef as f32 * k).collect();
    let (sum, n) = kls
        .iter()
        .fold((0.0, 0usize), |(s, n), &k| (s + k as f64, n + 1));
    let mean_kl = if n == 0 { 0.0 } else { sum / n as f64 };
    if let Some(a) = adaptive {
        a.update(mean_kl, kls.len());
    }
    (penalties, mean_kl)
}

#[cfg(test)]
mod tests;
