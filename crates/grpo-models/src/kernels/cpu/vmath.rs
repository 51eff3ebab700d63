//! Elementwise math that vectorizes: an `exp` without a libm call, and row kernels built on it
//! (softmax statistics, SiLU) compiled for AVX-512, for AVX2 + FMA and for the baseline target,
//! with the choice made at run time ([`crate::kernels::Isa`]).
//!
//! libm's `expf` is a call per element, so a loop around it never vectorizes, and a training
//! step runs it for the vocabulary softmax of every completion token, SiLU of every MLP
//! activation and attention's probabilities. [`exp`] is branch-free plain
//! arithmetic (range reduction to `|r| <= ln 2 / 2`, a degree-6 polynomial, the exponent put in
//! by bits), so a loop of it becomes 16-wide AVX-512 code (two 8-wide AVX2 registers). Its error is at most 2 ulp
//! (`exp_is_within_two_ulp_of_f64`).

use crate::kernels::isa_dispatch;

/// Below this `e^x` is 0 (f32 subnormals are not produced: the true value is under 2^-126).
const EXP_LO: f32 = -87.336_55;
/// Above this the result is infinity: where `round(x / ln 2)` reaches 128 (`e^x` itself overflows
/// f32 only above 88.72, so results between are infinite where libm's are finite, a range no
/// caller here reaches: softmax exponents are <= 0, SiLU's overflow gives the right limit).
const EXP_HI: f32 = 88.376_26;

/// `e^x` in f32 arithmetic only (no libm call, no branch), so loops over it vectorize.
/// Relative error at most 2 ulp for normal results; exactly 0 below about -87.34 (libm gives
/// subnormals there), infinity above about 88.38 (see `EXP_HI`), NaN for NaN, exactly 1 at 0.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // 1.5 * 2^23: adding it rounds to an integer, kept in the low mantissa bits.
    const SHIFT: f32 = 12_582_912.0;
    // ln 2 split in two (Cody-Waite): `n * LN2_HI` is exact for |n| <= 128.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(EXP_LO, EXP_HI);
    let t = xc * std::f32::consts::LOG2_E + SHIFT;
    let n = t - SHIFT; // round(x / ln 2)
    let r = xc - n * LN2_HI - n * LN2_LO; // |r| <= ln 2 / 2
                                          // e^r = 1 + r + r^2 * P(r), Cephes' minimax coefficients.
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let er = p * (r * r) + r + 1.0;
    // 2^n from the integer in t's mantissa: n + 127 in the exponent field.
    let ni = t.to_bits().wrapping_sub(SHIFT.to_bits()) as i32;
    let scale = f32::from_bits((ni.wrapping_add(127) as u32) << 23);
    let y = er * scale;
    if x < EXP_LO {
        0.0
    } else if x > EXP_HI {
        f32::INFINITY
    } else {
        y
    }
}

/// Lanes of the explicit accumulators below (one AVX-512 register of f32).
const LANES: usize = 16;

/// `(max, sum of e^(z - max), sum of e^(z - max) * z)` of `z = l * scale`, with 16 independent
/// partial sums (so that the loops vectorize; the summation order is fixed, so results are
/// deterministic).
#[inline(always)]
fn softmax_stats_body(l: &[f32], scale: f32) -> (f32, f32, f32) {
    let chunks = l.chunks_exact(LANES);
    let tail = chunks.remainder();
    let mut mx = [f32::NEG_INFINITY; LANES];
    for c in chunks.clone() {
        for i in 0..LANES {
            let z = c[i] * scale;
            mx[i] = if z > mx[i] { z } else { mx[i] };
        }
    }
    let mut max = mx.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    for &v in tail {
        max = max.max(v * scale);
    }
    let (mut s, mut sz) = ([0f32; LANES], [0f32; LANES]);
    for c in chunks {
        for i in 0..LANES {
            let z = c[i] * scale;
            let e = exp(z - max);
            s[i] += e;
            sz[i] += e * z;
        }
    }
    let (mut sum, mut szs) = (s.iter().sum::<f32>(), sz.iter().sum::<f32>());
    for &v in tail {
        let z = v * scale;
        let e = exp(z - max);
        sum += e;
        szs += e * z;
    }
    (max, sum, szs)
}

isa_dispatch!(
    /// `(max, sum of e^(z - max), sum of e^(z - max) * z)` of `z = l * scale`: the softmax
    /// normalizer and, through the last sum, the entropy.
    pub fn softmax_stats / softmax_stats_on(l: &[f32], scale: f32) -> (f32, f32, f32) = softmax_stats_body
);

#[inline(always)]
fn exp_sub_sum_body(z: &mut [f32], shift: f32) -> f32 {
    for v in z.iter_mut() {
        *v = exp(*v - shift);
    }
    sum(z)
}

isa_dispatch!(
    /// `z[i] = e^(z[i] - shift)` in place; returns the sum of the results.
    pub fn exp_sub_sum / exp_sub_sum_on(z: &mut [f32], shift: f32) -> f32 = exp_sub_sum_body
);

/// Sum with 16 partial sums (vectorizes; fixed order).
#[inline(always)]
pub fn sum(z: &[f32]) -> f32 {
    let chunks = z.chunks_exact(LANES);
    let tail = chunks.remainder();
    let mut s = [0f32; LANES];
    for c in chunks {
        for i in 0..LANES {
            s[i] += c[i];
        }
    }
    s.iter().sum::<f32>() + tail.iter().sum::<f32>()
}

#[inline(always)]
fn max_body(x: &[f32]) -> f32 {
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    let mut mx = [f32::NEG_INFINITY; LANES];
    for c in chunks {
        for i in 0..LANES {
            mx[i] = if c[i] > mx[i] { c[i] } else { mx[i] };
        }
    }
    mx.iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b))
}

isa_dispatch!(
    /// The largest element (`-inf` for an empty slice; NaNs are skipped).
    pub fn max / max_on(x: &[f32]) -> f32 = max_body
);

#[inline(always)]
fn exp_scaled_body(x: &[f32], shift: f32, t: f32, out: &mut [f32]) -> f64 {
    let out = &mut out[..x.len()];
    for (o, &v) in out.iter_mut().zip(x) {
        *o = exp((v - shift) / t);
    }
    let chunks = out.chunks_exact(8);
    let tail = chunks.remainder();
    let mut s = [0f64; 8];
    for c in chunks {
        for i in 0..8 {
            s[i] += c[i] as f64;
        }
    }
    s.iter().sum::<f64>() + tail.iter().map(|&v| v as f64).sum::<f64>()
}

isa_dispatch!(
    /// `out[i] = e^((x[i] - shift) / t)`; returns their sum in f64 (8 partial sums).
    pub fn exp_scaled / exp_scaled_on(x: &[f32], shift: f32, t: f32, out: &mut [f32]) -> f64 = exp_scaled_body
);

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

#[inline(always)]
fn silu_mul_body(g: &[f32], u: &[f32], o: &mut [f32]) {
    for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
        *o = g * sigmoid(g) * u;
    }
}

isa_dispatch!(
    /// `o = silu(g) * u`, elementwise.
    pub fn silu_mul / silu_mul_on(g: &[f32], u: &[f32], o: &mut [f32]) = silu_mul_body
);

#[inline(always)]
fn silu_mul_grad_body(g: &[f32], u: &[f32], dy: &[f32], dg: &mut [f32], du: &mut [f32]) {
    let n = g.len();
    let (u, dy, dg, du) = (&u[..n], &dy[..n], &mut dg[..n], &mut du[..n]);
    for j in 0..n {
        let sg = sigmoid(g[j]);
        dg[j] = dy[j] * u[j] * sg * (1.0 + g[j] * (1.0 - sg));
        du[j] = dy[j] * g[j] * sg;
    }
}

isa_dispatch!(
    /// The gradients of `silu(g) * u` given the output's `dy`: `dg` and `du`.
    pub fn silu_mul_grad / silu_mul_grad_on(g: &[f32], u: &[f32], dy: &[f32], dg: &mut [f32], du: &mut [f32]) =
        silu_mul_grad_body
);

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f64) -> f64 {
        let ulp = (b.abs() as f32).max(f32::MIN_POSITIVE);
        let ulp = (f32::from_bits(ulp.to_bits() + 1) - ulp) as f64;
        (a as f64 - b).abs() / ulp
    }

    #[test]
    fn exp_is_within_two_ulp_of_f64() {
        let mut worst = 0f64;
        let n = 2_000_000;
        for i in 0..=n {
            let x = EXP_LO + (EXP_HI - EXP_LO) * i as f32 / n as f32;
            worst = worst.max(ulps(exp(x), (x as f64).exp()));
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-88.0), 0.0);
        assert_eq!(exp(-1e30), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    /// Every variant (AVX-512, AVX2 + FMA, baseline) of every kernel agrees with the body as
    /// compiled for the baseline target bit for bit: same operations, same order.
    #[test]
    fn every_isa_variant_equals_the_baseline_body() {
        use crate::kernels::Isa;
        let l: Vec<f32> = (0..1003)
            .map(|i| ((i * 53) % 211) as f32 * 0.07 - 7.0)
            .collect();
        let (g, u) = l.split_at(501);
        let (u, dy) = (&u[..501], &l[..501]);
        for isa in Isa::ALL {
            for n in [0usize, 1, 15, 16, 17, 31, 1003] {
                let l = &l[..n];
                assert_eq!(
                    softmax_stats_body(l, 0.9),
                    softmax_stats_on(isa, l, 0.9),
                    "{isa}"
                );
                assert_eq!(max_body(l).to_bits(), max_on(isa, l).to_bits(), "{isa}");
                let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
                assert_eq!(
                    exp_scaled_body(l, 1.0, 0.8, &mut a),
                    exp_scaled_on(isa, l, 1.0, 0.8, &mut b)
                );
                assert_eq!(a, b, "{isa}");
                let (mut a, mut b) = (l.to_vec(), l.to_vec());
                assert_eq!(
                    exp_sub_sum_body(&mut a, 0.5),
                    exp_sub_sum_on(isa, &mut b, 0.5)
                );
                assert_eq!(a, b, "{isa}");
            }
            let (mut a, mut b) = (vec![0f32; 501], vec![0f32; 501]);
            silu_mul_body(g, u, &mut a);
            silu_mul_on(isa, g, u, &mut b);
            assert_eq!(a, b, "{isa}");
            let (mut a1, mut a2) = (vec![0f32; 501], vec![0f32; 501]);
            let (mut b1, mut b2) = (vec![0f32; 501], vec![0f32; 501]);
            silu_mul_grad_body(g, u, dy, &mut a1, &mut a2);
            silu_mul_grad_on(isa, g, u, dy, &mut b1, &mut b2);
            assert_eq!((a1, a2), (b1, b2), "{isa}");
        }
    }

    /// The plain twins: the same formulas in f64 with libm's exp.
    #[test]
    fn row_kernels_match_f64_twins() {
        let l: Vec<f32> = (0..1000)
            .map(|i| ((i * 37) % 101) as f32 * 0.13 - 6.0)
            .collect();
        for n in [0usize, 1, 15, 16, 17, 1000] {
            let l = &l[..n];
            let (max, s, sz) = softmax_stats(l, 0.7);
            let zs: Vec<f64> = l.iter().map(|&v| v as f64 * 0.7).collect();
            let m = zs.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let ws: f64 = zs.iter().map(|z| (z - m).exp()).sum();
            let wz: f64 = zs.iter().map(|z| (z - m).exp() * z).sum();
            if n == 0 {
                assert_eq!((max, s, sz), (f32::NEG_INFINITY, 0.0, 0.0));
                continue;
            }
            assert!((max as f64 - m).abs() < 1e-6);
            assert!((s as f64 - ws).abs() <= 1e-5 * ws, "{n}: {s} {ws}");
            assert!(
                (sz as f64 - wz).abs() <= 1e-5 * wz.abs().max(1.0),
                "{n}: {sz} {wz}"
            );

            let mut z = l.to_vec();
            let total = exp_sub_sum(&mut z, 1.5);
            for (a, &v) in z.iter().zip(l) {
                assert!(ulps(*a, (v as f64 - 1.5).exp()) <= 3.0);
            }
            let want: f64 = l.iter().map(|&v| (v as f64 - 1.5).exp()).sum();
            assert!((total as f64 - want).abs() <= 1e-5 * want);
        }
        for n in [0usize, 5, 16, 33, 1000] {
            let x = &l[..n];
            let want = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max(x), want);
            let mut out = vec![0f32; n];
            let total = exp_scaled(x, want, 0.7, &mut out);
            let mut want_sum = 0f64;
            for (o, &v) in out.iter().zip(x) {
                // The exponent rounded to f32 as the kernel computes it; the error is exp's.
                let e = (((v - want) / 0.7) as f64).exp();
                assert!(ulps(*o, e) <= 2.0);
                want_sum += e;
            }
            assert!((total - want_sum).abs() <= 1e-6 * want_sum.max(1.0));
        }
        let g: Vec<f32> = (0..37).map(|i| i as f32 * 0.5 - 9.0).collect();
        let u: Vec<f32> = (0..37).map(|i| 1.0 - i as f32 * 0.1).collect();
        let dy: Vec<f32> = (0..37).map(|i| 0.3 + i as f32 * 0.01).collect();
        let (mut o, mut dg, mut du) = (vec![0f32; 37], vec![0f32; 37], vec![0f32; 37]);
        silu_mul(&g, &u, &mut o);
        silu_mul_grad(&g, &u, &dy, &mut dg, &mut du);
        for j in 0..37 {
            let (gj, uj) = (g[j] as f64, u[j] as f64);
            let sg = 1.0 / (1.0 + (-gj).exp());
            assert!((o[j] as f64 - gj * sg * uj).abs() < 1e-6 * (1.0 + (gj * uj).abs()));
            let want_dg = dy[j] as f64 * uj * sg * (1.0 + gj * (1.0 - sg));
            let want_du = dy[j] as f64 * gj * sg;
            assert!((dg[j] as f64 - want_dg).abs() < 1e-6 * (1.0 + want_dg.abs()));
            assert!((du[j] as f64 - want_du).abs() < 1e-6 * (1.0 + want_du.abs()));
        }
    }
}
