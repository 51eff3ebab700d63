//! Group-relative advantages: each completion's reward compared with the other completions of
//! its prompt. Rewards are a handful of scalars per step, so this is plain `f32` math on slices
//! laid out `[P * G]` (group-major: completions `g = 0..G` of prompt `p` at `p * G + g`).
//!
//! Semantics follow TRL's `GRPOTrainer`:
//! - the reward of a completion is the weighted sum of its reward functions, ignoring functions
//!   that returned "missing" (NaN); when every function is missing the completion is unscorable;
//! - unscorable completions are left out of the group's mean and std, and get advantage 0;
//! - std is the unbiased (Bessel) standard deviation; a group with fewer than 2 scorable
//!   completions has no std and its advantages are 0;
//! - `scale_rewards`: `group` divides by the group's std + 1e-4, `batch` by the whole batch's
//!   std + 1e-4 (still centred on the group mean), `none` only centres (Dr. GRPO); the 1e-4 is
//!   `advantage_epsilon` (the seeds' 1e-8 where their configs set it).
//!
//! Additions of ours, off by default: a floor on the std (`reward_std_floor`), re-normalizing
//! all advantages of the batch to mean 0 / std 1, and dropping groups whose rewards are all equal.

use crate::named::named_enum;
use crate::{Error, Result};

named_enum! {
    /// Which std scales the advantages (TRL's `scale_rewards`).
    pub enum ScaleRewards {
        Group = "group",
        Batch = "batch",
        /// Dr. GRPO: centre only.
        None = "none",
    }
}

named_enum! {
    /// How several reward functions become one reward (TRL's `multi_objective_aggregation`).
    pub enum RewardAggregation {
        /// Weighted sum, then group-relative advantages as `scale_rewards` says.
        SumThenNormalize = "sum_then_normalize",
        /// GDPO: each function normalized within its group, then summed, then normalized over the batch.
        NormalizeThenSum = "normalize_then_sum",
    }
}

/// Added to the std before dividing, as in TRL (`advantage_epsilon`'s default; GDPO's
/// per-function normalization always uses it, as TRL's does).
pub const STD_EPS: f32 = 1e-4;

/// How advantages are computed; resolved from the config once.
#[derive(Debug, Clone, PartialEq)]
pub struct AdvantageOptions {
    pub scale: ScaleRewards,
    /// Clamp the std used for scaling from below (e.g. 0.1), so near-identical rewards do not
    /// turn into huge advantages.
    pub std_floor: Option<f32>,
    /// Re-normalize all advantages of the batch to mean 0 and std 1 at the end.
    pub normalize_batch: bool,
    /// Added to the std before dividing by it ([`STD_EPS`], TRL's, unless set).
    pub epsilon: f32,
}

/// Advantages and the statistics logged with them.
#[derive(Debug, Clone, PartialEq)]
pub struct Advantages {
    /// [P * G] advantage of each completion (0 for unscorable ones).
    pub advantages: Vec<f32>,
    /// [P * G] combined reward (NaN when unscorable).
    pub rewards: Vec<f32>,
    /// [P] whether the group's rewards all equal (std = 0): such a group gives no signal.
    pub zero_std: Vec<bool>,
}

impl Advantages {
    /// Share of groups whose rewards all equal (TRL's `frac_reward_zero_std`).
    pub fn frac_zero_std(&self) -> f32 {
        if self.zero_std.is_empty() {
            return 0.0;
        }
        self.zero_std.iter().filter(|&&z| z).count() as f32 / self.zero_std.len() as f32
    }
}

/// Weighted sum over reward functions: `per_func` [N, F] row-major, `weights` [F] -> [N].
/// NaN entries are skipped; a row with only NaN stays NaN (unscorable).
pub fn combine_rewards(per_func: &[f32], weights: &[f32]) -> Result<Vec<f32>> {
    let f = weights.len();
    if f == 0 || !per_func.len().is_multiple_of(f) {
        return Err(Error::Invariant(format!(
            "rewards: {} scores is not a multiple of {} reward functions",
            per_func.len(),
            f
        )));
    }
    Ok(per_func
        .chunks(f)
        .map(|row| {
            let mut sum = 0.0f32;
            let mut any = false;
            for (r, w) in row.iter().zip(weights) {
                if !r.is_nan() {
                    sum += r * w;
                    any = true;
                }
            }
            if any {
                sum
            } else {
                f32::NAN
            }
        })
        .collect())
}

/// Mean of the non-NaN values (NaN when there are none).
pub fn nan_mean(xs: &[f32]) -> f32 {
    let (s, n) = xs
        .iter()
        .filter(|x| !x.is_nan())
        .fold((0.0f64, 0usize), |(s, n), &x| (s + x as f64, n + 1));
    if n == 0 {
        f32::NAN
    } else {
        (s / n as f64) as f32
    }
}

/// Unbiased std of the non-NaN values (NaN with fewer than 2).
pub fn nan_std(xs: &[f32]) -> f32 {
    let m = nan_mean(xs) as f64;
    let (s, n) = xs
        .iter()
        .filter(|x| !x.is_nan())
        .fold((0.0f64, 0usize), |(s, n), &x| {
            (s + (x as f64 - m).powi(2), n + 1)
        });
    if n < 2 {
        f32::NAN
    } else {
        (s / (n - 1) as f64).sqrt() as f32
    }
}

/// Group-relative advantages of `rewards` [P * G] (combined rewards, NaN = unscorable).
pub fn group_advantages(
    rewards: &[f32],
    group_size: usize,
    opts: &AdvantageOptions,
) -> Result<Advantages> {
    if group_size == 0 || !rewards.len().is_multiple_of(group_size) {
        return Err(Error::Invariant(format!(
            "advantages: {} rewards do not form whole groups of {group_size}",
            rewards.len()
        )));
    }
    let batch_std = nan_std(rewards);
    let mut advantages = Vec::with_capacity(rewards.len());
    let mut zero_std = Vec::with_capacity(rewards.len() / group_size);
    for group in rewards.chunks(group_size) {
        let mean = nan_mean(group);
        let group_std = nan_std(group);
        zero_std.push(is_zero_std(group_std));
        let std = match opts.scale {
            ScaleRewards::Batch => batch_std,
            ScaleRewards::Group | ScaleRewards::None => group_std,
        };
        let std = match opts.std_floor {
            Some(floor) if !std.is_nan() => std.max(floor),
            _ => std,
        };
        for &r in group {
            let a = match opts.scale {
                ScaleRewards::None => r - mean,
                _ => (r - mean) / (std + opts.epsilon),
            };
            advantages.push(if a.is_finite() { a } else { 0.0 });
        }
    }
    if opts.normalize_batch {
        let m = nan_mean(&advantages);
        let s = nan_std(&advantages);
        if s.is_finite() {
            for a in &mut advantages {
                *a = (*a - m) / (s + opts.epsilon);
            }
        }
    }
    Ok(Advantages {
        advantages,
        rewards: rewards.to_vec(),
        zero_std,
    })
}

/// TRL's `multi_objective_aggregation = "normalize_then_sum"` (GDPO): each reward function is
/// normalized within its group first, `(r - mean_k) / (std_k + 1e-4)`, the normalized scores are
/// summed with `weights` (missing ones skipped; all missing: unscorable), and the sums are
/// normalized over the whole batch. `per_func` is `[N, F]` row-major, group-major rows.
/// `scale_rewards`, the std floor and batch re-normalization do not apply in this mode (as in
/// TRL); `zero_std` marks groups whose normalized sums all equal.
pub fn decoupled_advantages(
    per_func: &[f32],
    weights: &[f32],
    group_size: usize,
) -> Result<Advantages> {
    let f = weights.len();
    if f == 0 || group_size == 0 || !per_func.len().is_multiple_of(f * group_size) {
        return Err(Error::Invariant(format!(
            "advantages: {} scores do not form whole groups of {group_size} x {f} reward functions",
            per_func.len()
        )));
    }
    let n = per_func.len() / f;
    let mut normalized = vec![f32::NAN; per_func.len()];
    for (gi, group) in per_func.chunks(f * group_size).enumerate() {
        for k in 0..f {
            let col: Vec<f32> = group.iter().skip(k).step_by(f).copied().collect();
            let mean = nan_mean(&col);
            let std = if group_size > 1 { nan_std(&col) } else { 0.0 };
            for (j, r) in col.iter().enumerate() {
                normalized[(gi * group_size + j) * f + k] = (r - mean) / (std + STD_EPS);
            }
        }
    }
    let mut rewards = combine_rewards(&normalized, weights)?;
    // A row whose functions all returned something but normalized to NaN (a group with one
    // scorable completion) sums to 0, as TRL's nansum does; only all-missing rows stay NaN.
    for (i, r) in rewards.iter_mut().enumerate() {
        if r.is_nan() && per_func[i * f..(i + 1) * f].iter().any(|x| !x.is_nan()) {
            *r = 0.0;
        }
    }
    let mean = nan_mean(&rewards);
    let std = if n > 1 { nan_std(&rewards) } else { 0.0 };
    let advantages = rewards
        .iter()
        .map(|r| {
            let a = (r - mean) / (std + STD_EPS);
            if a.is_finite() {
                a
            } else {
                0.0
            }
        })
        .collect();
    let zero_std = rewards
        .chunks(group_size)
        .map(|g| nan_std(g).abs() <= 1e-8)
        .collect();
    Ok(Advantages {
        advantages,
        rewards,
        zero_std,
    })
}

/// Whether a group's reward std counts as zero: TRL's `isclose(std, 0)`, `|std| <= 1e-8` (NaN,
/// a group with fewer than two scored completions, is never close).
pub fn is_zero_std(group_std: f32) -> bool {
    group_std.abs() <= 1e-8
}

/// Whether each group of `g` combined rewards carries a signal: a finite, non-zero std (dynamic
/// sampling keeps these).
pub fn groups_with_signal(combined: &[f32], g: usize) -> Vec<bool> {
    combined
        .chunks(g.max(1))
        .map(|grp| {
            let s = nan_std(grp);
            s.is_finite() && !is_zero_std(s)
        })
        .collect()
}

/// The advantages of one round of `P x G` completions: each completion's reward functions combined
/// with `weights` (minus `penalty[i]` when given: KL in the reward), then group-relative
/// advantages as `aggregation` says. [`Advantages::rewards`] holds the combined rewards (what is
/// logged as `reward`; with `normalize_then_sum` the penalty is not used).
pub fn round_advantages(
    per_func: &[f32],
    weights: &[f32],
    penalty: Option<&[f32]>,
    g: usize,
    aggregation: RewardAggregation,
    opts: &AdvantageOptions,
) -> Result<Advantages> {
    let mut combined = combine_rewards(per_func, weights)?;
    if let Some(p) = penalty {
        for (c, k) in combined.iter_mut().zip(p) {
            *c -= k;
        }
    }
    let mut adv = match aggregation {
        RewardAggregation::NormalizeThenSum => decoupled_advantages(per_func, weights, g)?,
        RewardAggregation::SumThenNormalize => group_advantages(&combined, g, opts)?,
    };
    adv.rewards = combined;
    Ok(adv)
}

/// One group's statistics over its scorable completions (seed 003's "validation logs": reward
/// mean and std, advantage mean and std per group), as `groups.jsonl` logs them.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupStats {
    pub reward_mean: f32,
    /// Unbiased, as the advantages use it (NaN with fewer than 2 scorable completions).
    pub reward_std: f32,
    pub advantage_mean: f32,
    pub advantage_std: f32,
    /// Completions with a reward (the others have advantage 0 and are left out of all four).
    pub scorable: usize,
}

/// [`GroupStats`] of each group of `g` in `rewards` / `advantages` (`[P * G]`, NaN = unscorable).
pub fn group_stats(rewards: &[f32], advantages: &[f32], g: usize) -> Vec<GroupStats> {
    rewards
        .chunks(g.max(1))
        .zip(advantages.chunks(g.max(1)))
        .map(|(r, a)| {
            let scored: Vec<f32> = r
                .iter()
                .zip(a)
                .filter(|(r, _)| !r.is_nan())
                .map(|(_, &a)| a)
                .collect();
            GroupStats {
                reward_mean: nan_mean(r),
                reward_std: nan_std(r),
                advantage_mean: nan_mean(&scored),
                advantage_std: nan_std(&scored),
                scorable: scored.len(),
            }
        })
        .collect()
}

/// Seed 003's second invariant: in every group whose rewards have a spread, the advantages'
/// std is the rewards' std over the divisor the options chose, `s / (max(s, floor) + eps)` for
/// `scale_rewards = group` (~1 once `s` is well above `eps`), the batch's std in its place for
/// `batch`, `s` itself for `none`. (Their mean is 0 in every mode: checked with the round.)
/// Batch re-normalization and `normalize_then_sum` scale otherwise and are not checked here.
/// The bound allows f32 rounding of `r - mean` divided by a small divisor.
pub fn check_group_spread(
    rewards: &[f32],
    advantages: &[f32],
    g: usize,
    opts: &AdvantageOptions,
) -> Result<()> {
    if opts.normalize_batch {
        return Ok(());
    }
    let batch_std = nan_std(rewards);
    for (gi, (st, r)) in group_stats(rewards, advantages, g)
        .iter()
        .zip(rewards.chunks(g.max(1)))
        .enumerate()
    {
        let s = st.reward_std;
        if !s.is_finite() || is_zero_std(s) {
            continue;
        }
        let floored = |x: f32| match opts.std_floor {
            Some(f) => x.max(f),
            None => x,
        };
        let divisor = match opts.scale {
            ScaleRewards::Group => floored(s) + opts.epsilon,
            ScaleRewards::Batch => floored(batch_std) + opts.epsilon,
            ScaleRewards::None => 1.0,
        };
        let want = s / divisor;
        let largest = r
            .iter()
            .filter(|x| !x.is_nan())
            .fold(0f32, |m, x| m.max(x.abs()));
        let bound = 1e-3 * want.max(1.0) + 8.0 * f32::EPSILON * largest / divisor;
        if (st.advantage_std - want).abs() > bound {
            return Err(Error::Invariant(format!(
                "advantages of group {gi} have std {}, not {want} (its rewards' std {s} over \
                 {divisor})",
                st.advantage_std
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(scale: ScaleRewards) -> AdvantageOptions {
        AdvantageOptions {
            scale,
            std_floor: None,
            normalize_batch: false,
            epsilon: STD_EPS,
        }
    }

    /// `advantage_epsilon`: seed 000's group std floored at 0.1 with 1e-8 added, and its batch
    /// re-normalization over `std + 1e-8`, as plain f32 twins.
    #[test]
    fn the_epsilon_is_the_configured_one() {
        let rewards = [0.0, 0.02, 0.04, 0.06, 1.0, 0.0, 1.0, 0.0];
        let o = AdvantageOptions {
            std_floor: Some(0.1),
            epsilon: 1e-8,
            ..opts(ScaleRewards::Group)
        };
        let a = group_advantages(&rewards, 4, &o).unwrap();
        // Group 1's std (0.0258) is floored at 0.1.
        assert!((a.advantages[0] - (0.0 - 0.03) / (0.1 + 1e-8)).abs() < 1e-6);
        let s = nan_std(&rewards[4..]);
        assert!((a.advantages[4] - 0.5 / (s + 1e-8)).abs() < 1e-6);
        let b = group_advantages(
            &rewards,
            4,
            &AdvantageOptions {
                normalize_batch: true,
                ..o.clone()
            },
        )
        .unwrap();
        let (m, sd) = (nan_mean(&a.advantages), nan_std(&a.advantages));
        for (x, y) in b.advantages.iter().zip(&a.advantages) {
            assert!((x - (y - m) / (sd + 1e-8)).abs() < 1e-6);
        }
    }

    /// Seed 003: a group with a spread has advantages of std ~1 (group scaling), or the rewards'
    /// std over the divisor the options chose, and the check fails, naming the group, when they
    /// do not.
    #[test]
    fn group_spread_is_checked_and_a_wrong_one_fails() {
        let rewards = [
            0.0,
            1.0,
            1.0,
            0.0,
            0.5,
            0.5,
            0.5,
            0.5,
            2.0,
            f32::NAN,
            0.0,
            1.0,
        ];
        for (scale, floor) in [
            (ScaleRewards::Group, None),
            (ScaleRewards::Group, Some(0.8)),
            (ScaleRewards::Batch, None),
            (ScaleRewards::None, None),
        ] {
            let o = AdvantageOptions {
                std_floor: floor,
                ..opts(scale)
            };
            let a = group_advantages(&rewards, 4, &o).unwrap();
            check_group_spread(&rewards, &a.advantages, 4, &o).unwrap();
            let st = group_stats(&rewards, &a.advantages, 4);
            assert_eq!(st[2].scorable, 3);
            assert!(st[0].advantage_mean.abs() < 1e-6);
            if scale == ScaleRewards::Group && floor.is_none() {
                assert!((st[0].advantage_std - 1.0).abs() < 1e-3, "{st:?}");
                assert!((st[2].advantage_std - 1.0).abs() < 1e-3, "{st:?}");
            }
            // The all-equal group has no spread: not checked, advantages 0.
            assert_eq!(st[1].advantage_std, 0.0);
            // Advantages twice what they should be fail, naming the group.
            let mut wrong = a.advantages.clone();
            for x in &mut wrong[8..] {
                *x *= 2.0;
            }
            let e = check_group_spread(&rewards, &wrong, 4, &o).unwrap_err();
            assert!(e.to_string().contains("group 2 have std"), "{e}");
        }
        // Batch re-normalization rescales every group: not checked.
        let o = AdvantageOptions {
            normalize_batch: true,
            ..opts(ScaleRewards::Group)
        };
        check_group_spread(&rewards, &[9.0; 12], 4, &o).unwrap();
    }

    #[test]
    fn combine_skips_missing_and_keeps_all_missing_nan() {
        let r =
            combine_rewards(&[1.0, 0.1, f32::NAN, 0.1, f32::NAN, f32::NAN], &[1.0, 0.5]).unwrap();
        assert_eq!(r[0], 1.05);
        assert_eq!(r[1], 0.05);
        assert!(r[2].is_nan());
        assert!(combine_rewards(&[1.0, 2.0, 3.0], &[1.0, 1.0]).is_err());
    }

    #[test]
    fn group_scaling_matches_hand_computation() {
        // Group 0: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3).
        let r = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0];
        let a = group_advantages(&r, 4, &opts(ScaleRewards::Group)).unwrap();
        let s = (1.0f32 / 3.0).sqrt();
        let want = 0.5 / (s + STD_EPS);
        assert!((a.advantages[0] - want).abs() < 1e-6);
        assert!((a.advantages[1] + want).abs() < 1e-6);
        assert_eq!(&a.advantages[4..], &[0.0; 4]);
        assert_eq!(a.zero_std, vec![false, true]);
        assert_eq!(a.frac_zero_std(), 0.5);
        let sum: f32 = a.advantages[..4].iter().sum();
        assert!(sum.abs() < 1e-6);
    }

    #[test]
    fn batch_and_none_scaling() {
        let r = [1.0, 0.0, 3.0, 3.0];
        let batch = group_advantages(&r, 2, &opts(ScaleRewards::Batch)).unwrap();
        let s = nan_std(&r);
        assert!((batch.advantages[0] - 0.5 / (s + STD_EPS)).abs() < 1e-6);
        assert_eq!(batch.advantages[2], 0.0);
        let none = group_advantages(&r, 2, &opts(ScaleRewards::None)).unwrap();
        assert_eq!(none.advantages, vec![0.5, -0.5, 0.0, 0.0]);
    }

    #[test]
    fn missing_rewards_are_left_out_and_get_zero() {
        let r = [1.0, f32::NAN, 0.0, 0.5];
        let a = group_advantages(&r, 4, &opts(ScaleRewards::Group)).unwrap();
        let m = 0.5f32;
        let s = nan_std(&[1.0, 0.0, 0.5]);
        assert_eq!(a.advantages[1], 0.0);
        assert!((a.advantages[0] - (1.0 - m) / (s + STD_EPS)).abs() < 1e-6);
        // One scorable completion: no std, no signal.
        let a = group_advantages(&[1.0, f32::NAN], 2, &opts(ScaleRewards::Group)).unwrap();
        assert_eq!(a.advantages, vec![0.0, 0.0]);
    }

    #[test]
    fn std_floor_and_batch_normalization() {
        let r = [0.01, 0.0, 1.0, 0.0];
        let mut o = opts(ScaleRewards::Group);
        o.std_floor = Some(0.1);
        let a = group_advantages(&r, 2, &o).unwrap();
        assert!((a.advantages[0] - 0.005 / (0.1 + STD_EPS)).abs() < 1e-5);
        o.normalize_batch = true;
        let a = group_advantages(&r, 2, &o).unwrap();
        assert!(nan_mean(&a.advantages).abs() < 1e-6);
        assert!((nan_std(&a.advantages) - 1.0).abs() < 1e-3);
    }

    #[test]
    fn partial_groups_are_rejected() {
        assert!(group_advantages(&[1.0, 2.0, 3.0], 2, &opts(ScaleRewards::Group)).is_err());
    }

    #[test]
    fn normalize_then_sum_decouples_the_functions() {
        // Group 0: the two functions disagree and cancel; group 1: they agree.
        let per_func = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0];
        let a = decoupled_advantages(&per_func, &[1.0, 1.0], 2).unwrap();
        let z = 0.5 / (0.5f32.sqrt() + STD_EPS); // one function's normalized score
        assert_eq!(a.rewards, vec![0.0, 0.0, 2.0 * z, -2.0 * z]);
        let std = ((2.0 * (2.0 * z).powi(2)) / 3.0).sqrt();
        let want = [
            0.0,
            0.0,
            2.0 * z / (std + STD_EPS),
            -2.0 * z / (std + STD_EPS),
        ];
        for (g, w) in a.advantages.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{g} vs {w}");
        }
        assert_eq!(a.zero_std, vec![true, false]);
        // All missing: unscorable (NaN reward, advantage 0); a lone scorable one sums to 0.
        let nan = f32::NAN;
        let b = decoupled_advantages(&[nan, nan, 1.0, nan], &[1.0, 1.0], 2).unwrap();
        assert!(b.rewards[0].is_nan());
        assert_eq!(b.rewards[1], 0.0);
        assert_eq!(b.advantages, vec![0.0, 0.0]);
        assert!(decoupled_advantages(&[1.0, 2.0, 3.0], &[1.0], 2).is_err());
    }

    #[test]
    fn groups_with_signal_need_a_finite_non_zero_std() {
        let nan = f32::NAN;
        // Differ; all equal; one scored (NaN std); none scored.
        let combined = [1.0, 1.0, 0.0, 2.0, 2.0, 2.0, nan, 1.0, nan, nan, nan, nan];
        assert_eq!(
            groups_with_signal(&combined, 3),
            vec![true, false, false, false]
        );
    }
}
