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

/// SAPO per token: `-sigmoid(tau * (r - 1)) * 4 / tau * A`, `tau` = `temp_pos` where A > 0,
/// else `temp_neg`. `log_w` [N, T] or [N, 1], `adv` [N] -> [N, T or 1].
pub fn sapo_surrogate(
    log_w: &Tensor,
    adv: &Tensor,
    temp_pos: f64,
    temp_neg: f64,
) -> Result<Tensor> {
    let a: Vec<f32> = adv.to_vec1()?;
    let tau: Vec<f32> = a
        .iter()
        .map(|&x| if x > 0.0 { temp_pos } else { temp_neg } as f32)
        .collect();
    let tau = Tensor::from_vec(tau, (a.len(), 1), adv.device())?; // [N, 1]
    let z = (log_w.exp()? - 1.0)?.broadcast_mul(&tau)?; // [N, T or 1]
                                                        // sigmoid from ops that all record a backward.
    let gate = ((z.neg()?.exp()? + 1.0)?.recip()? * 4.0)?.broadcast_div(&tau)?;
    Ok(gate.broadcast_mul(&adv.unsqueeze(1)?)?.neg()?)
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
        LossType::Bnpo => (masked.sum_all()? / (micro.active_tokens.max(1.0) * accum))?,
        LossType::DrGrpo => (masked.sum_all()? / (rows * r.max_completion_length as f64 * accum))?,
        LossType::Dapo | LossType::Cispo => (masked.sum_all()? / r.dapo_tokens.max(1.0))?,
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
    let surrogate = match opts.loss_type {
        LossType::Cispo => cispo_surrogate(&log_w, inp.logps, inp.advantages, opts.epsilon_high)?,
        LossType::Sapo => sapo_surrogate(
            &log_w,
            inp.advantages,
            opts.sapo_temperature_pos,
            opts.sapo_temperature_neg,
        )?,
        _ => clipped_surrogate(&log_w, inp.advantages, opts)?,
    }; // [N, T] or [N, 1]
    let (n, t) = inp.logps.dims2()?;
    let surrogate = surrogate.broadcast_as((n, t))?;

    // Clip statistics (TRL's clip_ratio/low_mean, high_mean, region_mean).
    let coef = log_w.detach().exp()?.broadcast_as((n, t))?.contiguous()?;
    let adv = inp
        .advantages
        .unsqueeze(1)?
        .broadcast_as((n, t))?
        .contiguous()?;
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
    let mut loss = if opts.beta != 0.0 {
        reduce(&per_token, inp.mask, opts.loss_type, red)?
    } else {
        policy
    };
    let mut entropy = None;
    if let Some(ent) = inp.entropies {
        entropy = Some(masked_mean(ent, inp.mask)?);
        if opts.entropy_coef != 0.0 {
            let accum = red.accumulation_steps.max(1) as f64;
            let den = red.totals(inp.mask)?.active_tokens.max(1.0);
            let mean_ent = ((ent * inp.mask)?.sum_all()? / (den * accum))?;
            loss = (loss - (mean_ent * opts.entropy_coef)?)?;
        }
    }
    Ok(LossOutput {
        loss,
        policy_loss,
        kl,
        clip_low,
        clip_high,
        clip_region,
        entropy,
    })
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
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn opts(loss_type: LossType, level: IsLevel, beta: f64) -> LossOptions {
        LossOptions {
            loss_type,
            importance_sampling_level: level,
            epsilon_low: 0.2,
            epsilon_high: 0.28,
            delta: None,
            beta,
            entropy_coef: 0.0,
            use_bias_correction_kl: false,
            sapo_temperature_pos: 1.0,
            sapo_temperature_neg: 1.05,
        }
    }

    /// Plain-f32 twin of `grpo_loss` (loss value only).
    fn loss_slow(
        logp: &[Vec<f32>],
        old: &[Vec<f32>],
        refp: &[Vec<f32>],
        adv: &[f32],
        mask: &[Vec<f32>],
        o: &LossOptions,
        r: &Reduction,
    ) -> f32 {
        loss_slow_w(logp, logp, old, refp, adv, mask, o, r)
    }

    /// [`loss_slow`] with CISPO's (detached) weight taken from `w_logp`, so that central
    /// differences in `logp` give the gradient autograd computes.
    #[allow(clippy::too_many_arguments)]
    fn loss_slow_w(
        logp: &[Vec<f32>],
        w_logp: &[Vec<f32>],
        old: &[Vec<f32>],
        refp: &[Vec<f32>],
        adv: &[f32],
        mask: &[Vec<f32>],
        o: &LossOptions,
        r: &Reduction,
    ) -> f32 {
        let n = logp.len();
        let t = logp[0].len();
        let mut per_tok = vec![vec![0f32; t]; n];
        // Log importance weight of token (i, j) from log-probs `lp`.
        let log_w = |lp: &[Vec<f32>], i: usize, j: usize| match o.importance_sampling_level {
            IsLevel::Token => lp[i][j] - old[i][j],
            IsLevel::Sequence => {
                let (mut s, mut c) = (0f32, 0f32);
                for k in 0..t {
                    s += (lp[i][k] - old[i][k]) * mask[i][k];
                    c += mask[i][k];
                }
                s / c.max(1.0)
            }
        };
        for i in 0..n {
            for j in 0..t {
                let lw = log_w(logp, i, j);
                let c1 = lw.exp();
                let c2 = c1.clamp(1.0 - o.epsilon_low as f32, 1.0 + o.epsilon_high as f32);
                let mut l = match o.loss_type {
                    LossType::Cispo => {
                        let w = log_w(w_logp, i, j).exp();
                        -w.min(o.epsilon_high as f32) * adv[i] * logp[i][j]
                    }
                    LossType::Sapo => {
                        let tau = if adv[i] > 0.0 {
                            o.sapo_temperature_pos
                        } else {
                            o.sapo_temperature_neg
                        } as f32;
                        -(1.0 / (1.0 + (-tau * (c1 - 1.0)).exp())) * 4.0 / tau * adv[i]
                    }
                    _ => -(c1 * adv[i]).min(c2 * adv[i]),
                };
                if o.beta != 0.0 {
                    let d = refp[i][j] - logp[i][j];
                    l += o.beta as f32 * (d.exp() - d - 1.0);
                }
                per_tok[i][j] = l * mask[i][j];
            }
        }
        let total: f32 = per_tok.iter().flatten().sum();
        let active: f32 = mask.iter().flatten().sum();
        let accum = r.accumulation_steps as f32;
        match o.loss_type {
            LossType::Grpo | LossType::Sapo => {
                let s: f32 = (0..n)
                    .map(|i| per_tok[i].iter().sum::<f32>() / mask[i].iter().sum::<f32>().max(1.0))
                    .sum();
                s / n as f32 / accum
            }
            LossType::Bnpo => total / active.max(1.0) / accum,
            LossType::DrGrpo => total / (n * r.max_completion_length) as f32 / accum,
            LossType::Dapo | LossType::Cispo => total / r.dapo_tokens as f32,
        }
    }

    fn t2(v: &[Vec<f32>]) -> Tensor {
        Tensor::new(v.to_vec(), &Device::Cpu).unwrap()
    }

    #[test]
    fn loss_matches_plain_twin_for_every_variant() {
        let logp = vec![
            vec![-1.0, -0.5, -2.0, -0.1],
            vec![-0.3, -1.2, -0.7, -3.0],
            vec![-2.2, -0.9, -0.4, -0.6],
        ];
        let old = vec![
            vec![-1.3, -0.5, -1.5, -0.1],
            vec![-0.3, -0.9, -0.7, -2.0],
            vec![-2.0, -1.1, -0.4, -0.7],
        ];
        let refp = vec![
            vec![-1.1, -0.6, -2.5, -0.2],
            vec![-0.2, -1.0, -0.9, -2.5],
            vec![-2.1, -1.0, -0.3, -0.5],
        ];
        let mask = vec![
            vec![1.0, 1.0, 1.0, 0.0],
            vec![1.0, 1.0, 1.0, 1.0],
            vec![1.0, 1.0, 0.0, 0.0],
        ];
        let adv = [0.8f32, -1.1, 0.3];
        let red = Reduction {
            accumulation_steps: 2,
            max_completion_length: 6,
            dapo_tokens: 13.0,
            micro: None,
        };
        for lt in [
            LossType::Grpo,
            LossType::Bnpo,
            LossType::DrGrpo,
            LossType::Dapo,
            LossType::Cispo,
            LossType::Sapo,
        ] {
            for level in [IsLevel::Token, IsLevel::Sequence] {
                for beta in [0.0, 0.04] {
                    let mut o = opts(lt, level, beta);
                    if lt == LossType::Cispo {
                        o.epsilon_high = 1.1; // clips some of these ratios
                    }
                    let lp = Var::from_tensor(&t2(&logp)).unwrap();
                    let (oldt, reft, maskt) = (t2(&old), t2(&refp), t2(&mask));
                    let advt = Tensor::new(&adv, &Device::Cpu).unwrap();
                    let out = grpo_loss(
                        &LossInputs {
                            logps: lp.as_tensor(),
                            old_logps: Some(&oldt),
                            ref_logps: Some(&reft),
                            advantages: &advt,
                            mask: &maskt,
                            entropies: None,
                        },
                        &o,
                        &red,
                    )
                    .unwrap();
                    let got = out.loss.to_scalar::<f32>().unwrap();
                    let want = loss_slow(&logp, &old, &refp, &adv, &mask, &o, &red);
                    assert!(
                        (got - want).abs() < 1e-6,
                        "{lt:?} {level:?} {beta}: {got} vs {want}"
                    );
                    // Gradient by central differences on one active entry.
                    let g = out.loss.backward().unwrap();
                    let g = g.get(&lp).unwrap().to_vec2::<f32>().unwrap();
                    let h = 1e-3f32;
                    let (mut up, mut dn) = (logp.clone(), logp.clone());
                    up[1][2] += h;
                    dn[1][2] -= h;
                    let fd = (loss_slow_w(&up, &logp, &old, &refp, &adv, &mask, &o, &red)
                        - loss_slow_w(&dn, &logp, &old, &refp, &adv, &mask, &o, &red))
                        / (2.0 * h);
                    assert!(
                        (g[1][2] - fd).abs() < 2e-3,
                        "{lt:?} {level:?} {beta}: grad {} vs {fd}",
                        g[1][2]
                    );
                    assert_eq!(g[0][3], 0.0, "masked tokens get no gradient");
                }
            }
        }
    }

    #[test]
    fn parts_with_micro_totals_sum_to_the_whole_micro_batch() {
        let logp = [
            [-1.0f32, -0.5, -2.0],
            [-0.3, -1.2, -0.7],
            [-2.2, -0.9, -0.4],
        ];
        let old = [
            [-1.3f32, -0.5, -1.5],
            [-0.3, -0.9, -0.7],
            [-2.0, -1.1, -0.4],
        ];
        let refp = [
            [-1.1f32, -0.6, -2.5],
            [-0.2, -1.0, -0.9],
            [-2.1, -1.0, -0.3],
        ];
        let ent = [[1.0f32, 2.0, 0.5], [0.3, 0.2, 0.1], [2.0, 1.5, 1.0]];
        let mask = [[1.0f32, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]];
        let adv = [0.8f32, -1.1, 0.3];
        let dev = Device::Cpu;
        let rows = |x: &[[f32; 3]], r: std::ops::Range<usize>| {
            let n = r.len();
            Tensor::from_vec(x[r].concat(), (n, 3), &dev).unwrap()
        };
        for lt in [
            LossType::Grpo,
            LossType::Bnpo,
            LossType::DrGrpo,
            LossType::Dapo,
        ] {
            let mut o = opts(lt, IsLevel::Sequence, 0.04);
            o.entropy_coef = 0.01;
            let loss_of = |r: std::ops::Range<usize>, micro| {
                let (lp, oldt, reft) = (
                    rows(&logp, r.clone()),
                    rows(&old, r.clone()),
                    rows(&refp, r.clone()),
                );
                let (mt, et) = (rows(&mask, r.clone()), rows(&ent, r.clone()));
                let advt = Tensor::new(&adv[r], &dev).unwrap();
                let red = Reduction {
                    accumulation_steps: 2,
                    max_completion_length: 3,
                    dapo_tokens: 11.0,
                    micro,
                };
                let inp = LossInputs {
                    logps: &lp,
                    old_logps: Some(&oldt),
                    ref_logps: Some(&reft),
                    advantages: &advt,
                    mask: &mt,
                    entropies: Some(&et),
                };
                grpo_loss(&inp, &o, &red)
                    .unwrap()
                    .loss
                    .to_scalar::<f32>()
                    .unwrap()
            };
            let whole = loss_of(0..3, None);
            let totals = Some(MicroTotals {
                rows: 3,
                active_tokens: 6.0,
            });
            let parts = loss_of(0..1, totals) + loss_of(1..3, totals);
            assert!((whole - parts).abs() < 1e-6, "{lt:?}: {whole} vs {parts}");
        }
    }

    #[test]
    fn on_policy_ratio_is_one_and_gradient_is_advantage_weighted() {
        // With old = current (detached), the loss is -mean(A) per token and d/dlogp = -A / norm.
        let lp = Var::new(&[[-1.0f32, -2.0], [-0.5, -0.25]], &Device::Cpu).unwrap();
        let mask = Tensor::new(&[[1f32, 1.0], [1.0, 0.0]], &Device::Cpu).unwrap();
        let adv = Tensor::new(&[1.0f32, -2.0], &Device::Cpu).unwrap();
        let red = Reduction {
            accumulation_steps: 1,
            max_completion_length: 2,
            dapo_tokens: 3.0,
            micro: None,
        };
        let out = grpo_loss(
            &LossInputs {
                logps: lp.as_tensor(),
                old_logps: None,
                ref_logps: None,
                advantages: &adv,
                mask: &mask,
                entropies: None,
            },
            &opts(LossType::Dapo, IsLevel::Token, 0.0),
            &red,
        )
        .unwrap();
        assert!((out.loss.to_scalar::<f32>().unwrap() - 0.0).abs() < 1e-6); // -(1 + 1 - 2) / 3
        let g = out
            .loss
            .backward()
            .unwrap()
            .get(&lp)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        assert_eq!(g, vec![vec![-1.0 / 3.0, -1.0 / 3.0], vec![2.0 / 3.0, 0.0]]);
        assert_eq!(out.clip_region, 0.0);
    }

    #[test]
    fn k3_is_nonnegative_and_zero_at_equality() {
        let a = Tensor::new(&[-1.0f32, -2.0, -0.1], &Device::Cpu).unwrap();
        let b = Tensor::new(&[-1.0f32, -1.0, -3.0], &Device::Cpu).unwrap();
        let k = k3_kl(&a, &b).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(k[0], 0.0);
        for (i, (x, y)) in [(-2.0f32, -1.0f32), (-0.1, -3.0)].iter().enumerate() {
            let d = y - x;
            assert!((k[i + 1] - (d.exp() - d - 1.0)).abs() < 1e-6);
            assert!(k[i + 1] > 0.0);
        }
    }

    #[test]
    fn adaptive_kl_moves_towards_target() {
        let mut c = AdaptiveKl {
            coef: 0.1,
            target: 6.0,
            horizon: 10000.0,
        };
        c.update(12.0, 1000);
        assert!((c.coef - 0.1 * 1.02).abs() < 1e-12);
        c.update(0.0, 1000);
        assert!(c.coef < 0.102);
    }

    #[test]
    fn kl_reward_penalty_matches_a_plain_twin() {
        let old = vec![vec![-1.0f32, -2.0], vec![-0.5]];
        let refl = vec![vec![-1.5f32, -2.5], vec![-0.25]];
        let (p, m) = kl_reward_penalty(&old, &refl, 0.1, None);
        assert_eq!(p, vec![0.1f32 * 1.0, 0.1f32 * -0.25]);
        assert!((m - 0.375).abs() < 1e-12);
        let mut a = AdaptiveKl {
            coef: 0.2,
            target: 1.0,
            horizon: 10.0,
        };
        let (p, _) = kl_reward_penalty(&old, &refl, 0.1, Some(&mut a));
        assert_eq!(p[0], 0.2f32 * 1.0, "the controller's coefficient wins");
        // mean KL 0.375 < target: the coefficient shrinks by 20% x 2 / 10.
        assert!((a.coef - 0.2 * (1.0 - 0.2 * 2.0 / 10.0)).abs() < 1e-12);
    }
}
