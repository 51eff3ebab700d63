//! The loss's functions against plain-`f32` twins, and TRL's reductions.
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
        vespo: VespoParams::default(),
        top_entropy_quantile: 1.0,
        off_policy_mask_threshold: None,
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
                LossType::Vespo => {
                    // Detached: the sequence's summed log-ratio at the point `w_logp`.
                    let lw: f32 = (0..t)
                        .map(|k| (w_logp[i][k] - old[i][k]).clamp(-20.0, 20.0) * mask[i][k])
                        .sum::<f32>()
                        .clamp(1e-8f32.ln(), 20.0);
                    let p = &o.vespo;
                    let (k, lam) = if adv[i] >= 0.0 {
                        (p.k_pos, p.lambda_pos)
                    } else {
                        (p.k_neg, p.lambda_neg)
                    };
                    let (k, lam) = (k as f32, lam as f32);
                    let phi = (lam + k * lw - lam * lw.exp()).exp();
                    -phi * adv[i] * logp[i][j]
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
        LossType::Luspo => total / n as f32 / accum,
        LossType::Dapo | LossType::Cispo | LossType::Vespo => total / r.dapo_tokens as f32,
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
        LossType::Luspo,
        LossType::Vespo,
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
                        entropy_threshold: None,
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
fn token_masks_match_plain_twins() {
    // torch.quantile's linear interpolation.
    assert_eq!(quantile(&[3.0, 1.0, 2.0, 4.0], 0.5), Some(2.5));
    assert_eq!(quantile(&[3.0, 1.0, 2.0, 4.0], 1.0), Some(4.0));
    assert_eq!(quantile(&[5.0], 0.3), Some(5.0));
    assert_eq!(quantile(&[], 0.3), None);
    let ent = vec![vec![0.1f32, 2.0, 0.5, 9.0], vec![1.5, 0.2, 3.0, 0.7]];
    let mask = vec![vec![1.0f32, 1.0, 1.0, 0.0], vec![1.0, 1.0, 1.0, 1.0]];
    for q in [0.0, 0.2, 0.5, 1.0] {
        let got = high_entropy_mask(&t2(&ent), &t2(&mask), q)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        // Twin: the active entropies sorted; the threshold interpolated at 1 - q.
        let mut act: Vec<f32> = ent
            .iter()
            .flatten()
            .zip(mask.iter().flatten())
            .filter(|(_, &m)| m > 0.0)
            .map(|(&e, _)| e)
            .collect();
        act.sort_by(f32::total_cmp);
        let pos = (1.0 - q as f32) * (act.len() - 1) as f32;
        let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
        let thr = act[lo] + (act[hi] - act[lo]) * (pos - lo as f32);
        for i in 0..2 {
            for j in 0..4 {
                let want = f32::from(mask[i][j] > 0.0 && ent[i][j] >= thr);
                assert_eq!(got[i][j], want, "q {q} at ({i}, {j})");
            }
        }
    }
    // Off-policy mask: row 0 positive advantage (kept), row 1 negative with mean gap
    // (0.5 + 0.1) / 2 = 0.3, row 2 negative with mean gap -0.2.
    let logp = vec![vec![-1.0f32, -1.0], vec![-1.0, -1.0], vec![-1.0, -1.0]];
    let old = vec![vec![0.0f32, 0.0], vec![-0.5, -0.9], vec![-1.2, -1.2]];
    let m = vec![vec![1.0f32, 1.0]; 3];
    let adv = Tensor::new(&[1.0f32, -1.0, -1.0], &Device::Cpu).unwrap();
    for (th, want) in [
        (0.25, [1.0, 0.0, 1.0]),
        (0.35, [1.0, 1.0, 1.0]),
        (-0.3, [1.0, 0.0, 0.0]),
    ] {
        let got = off_policy_mask(&t2(&logp), &t2(&old), &t2(&m), &adv, th)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(got, want, "threshold {th}");
    }
}

#[test]
fn adaptive_entropy_moves_within_bounds_and_applies_below_target() {
    let mut a = AdaptiveEntropy {
        coef: 0.01,
        last_entropy: None,
        min: 0.0,
        max: 0.02,
        delta: 0.005,
        target: 1.0,
    };
    assert_eq!(a.apply_coef(), 0.0, "nothing measured yet");
    a.update(0.5);
    assert!((a.coef - 0.015).abs() < 1e-12 && a.apply_coef() == a.coef);
    a.update(0.5);
    a.update(0.5);
    assert!((a.coef - 0.02).abs() < 1e-12, "capped at max");
    a.update(2.0);
    assert!((a.coef - 0.015).abs() < 1e-12);
    assert_eq!(a.apply_coef(), 0.0, "entropy above target: no bonus");
    for _ in 0..10 {
        a.update(2.0);
    }
    assert_eq!(a.coef, 0.0, "floored at min");
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
                entropy_threshold: None,
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
            entropy_threshold: None,
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
