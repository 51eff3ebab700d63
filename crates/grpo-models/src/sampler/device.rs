//! Token choice on the logits' device: the portable path's sampler (a GPU, bf16,
//! `kernels = "portable"`).
//!
//! Every decoding step's logits stay where the model made them. The repetition penalty, EOS
//! suppression, temperature, top-k, top-p and min-p run there as candle ops; what comes back to
//! the host is a few hundred numbers per row instead of the vocabulary's logits:
//!
//! 1. the row's unnormalised probabilities are summed in blocks of [`BLOCK`] tokens on the
//!    device, and the block sums come back with the log-prob normaliser;
//! 2. the host draws the row's uniform from the row's own RNG (the same single draw per token as
//!    the host sampler, so a completion still depends only on its prompt seed and sample index),
//!    scans the block sums in f64 and picks the block the draw falls in;
//! 3. that block's probabilities and raw logits come back and the host finishes the scan.
//!
//! This is inverse-CDF sampling, exactly as [`super::choose_token`] does it, with the sums done
//! block-wise: a token of probability 0 (suppressed, truncated) is never chosen.
//!
//! top-k and top-p are thresholds found by bisection on the tempered logits shifted to 0 at the
//! row's top (candle has no sort on the GPU for a vocabulary's width): top-k keeps the logits at
//! or above the k-th largest, top-p the fewest largest whose probability mass reaches `top_p`
//! (after top-k), as HF does.
//! [`BISECT_STEPS`] halvings of a 201-nat interval end on adjacent f32 values for any logit of
//! magnitude above about 1e-5, so the kept set is exact there; where several logits tie at the
//! threshold all of them are kept (the host sampler keeps exactly k).

use std::collections::HashSet;

use candle_core::{DType, Tensor};

use super::{pick, scan, SamplingParams};
use crate::Result;

/// Tokens per block of the two-level draw (the host receives V / BLOCK + BLOCK values per row).
pub(super) const BLOCK: usize = 256;

/// Halvings of the top-k / top-p threshold interval.
const BISECT_STEPS: usize = 48;

/// Tempered logits more than this below the row's largest have probability 0 in f32
/// (`exp(-104)` underflows), so a threshold never needs to go lower (the bisection runs between
/// -FLOOR and 1 on the shifted logits).
const FLOOR: f64 = 200.0;

/// What the host knows of one row at this step.
pub(super) struct DeviceRow<'a> {
    /// Prompt and generated ids (the repetition penalty's).
    pub seen: &'a [u32],
    /// EOS is suppressed (`min_new_tokens` not reached).
    pub suppress_eos: bool,
    /// The row's uniform draw in [0, 1) (unused when greedy).
    pub u: f64,
}

/// One token and its log-prob (the module docs of [`super`]: `log softmax(raw / T)`) for each
/// row of `logits` [b, V], with the same processing as [`super::choose_token`].
pub(super) fn choose_tokens(
    logits: &Tensor,
    rows: &[DeviceRow<'_>],
    params: &SamplingParams,
) -> Result<Vec<(u32, f32)>> {
    let greedy = params.temperature <= 0.0;
    let t = if greedy { 1.0 } else { params.temperature };
    let raw = logits.to_dtype(DType::F32)?; // [b, V] f32

    // The raw logits at temperature t, shifted to 0 at each row's top: their exponentials are the
    // unprocessed probabilities, and their sum is the log-prob's normaliser.
    let m = raw.max_keepdim(1)?; // [b, 1]
    let scaled_raw = (raw.broadcast_sub(&m)? / t)?; // [b, V], <= 0
    let e = scaled_raw.exp()?; // [b, V]
    let norm = Tensor::cat(&[&m, &e.sum_keepdim(1)?], 1)?; // [b, 2]
    let logprob = |raw_tok: f32, norm: &[f32]| (raw_tok - norm[0]) / t as f32 - norm[1].ln();

    let z = processed(&raw, rows, params)?;

    if greedy {
        let tok = z.as_ref().unwrap_or(&raw).argmax_keepdim(1)?; // [b, 1] u32
        let raw_tok = raw.gather(&tok, 1)?; // [b, 1]
        let tok: Vec<u32> = tok.flatten_all()?.to_vec1()?;
        let back = Tensor::cat(&[&raw_tok, &norm], 1)?.to_vec2::<f32>()?; // [b, 3]
        return Ok(tok
            .into_iter()
            .zip(back)
            .map(|(k, r)| (k, logprob(r[0], &r[1..])))
            .collect());
    }

    // The processed logits at temperature t, 0 at each row's top, and their exponentials (the
    // unnormalised probabilities): the raw ones' when nothing was processed.
    let (s, q) = match z {
        None => (scaled_raw, e),
        Some(z) => {
            let s = (z.broadcast_sub(&z.max_keepdim(1)?)? / t)?; // [b, V], <= 0
            let q = s.exp()?;
            (s, q)
        }
    };
    let q = truncated(&s, q, params)?;
    let drawn = draw(&q, &raw, &norm, rows)?;
    Ok(drawn
        .into_iter()
        .map(|(tok, raw_tok, norm)| (tok, logprob(raw_tok, &norm)))
        .collect())
}

/// The processed logits [b, V]: the repetition penalty, then EOS suppression (HF's order); None
/// when neither applies.
fn processed(
    raw: &Tensor,
    rows: &[DeviceRow<'_>],
    params: &SamplingParams,
) -> Result<Option<Tensor>> {
    let (b, v) = raw.dims2()?;
    let device = raw.device();
    let mut z = None;
    if params.repetition_penalty != 1.0 {
        let ids = padded_ids(rows.iter().map(|r| unique_below(r.seen, v)), b);
        let ids = Tensor::from_vec(ids.0, (b, ids.1), device)?; // [b, S] u32
        let g = raw.gather(&ids, 1)?; // [b, S]
        let p = params.repetition_penalty;
        let penalised = g.lt(0.0)?.where_cond(&(&g * p)?, &(&g / p)?)?;
        z = Some(raw.scatter(&ids, &penalised, 1)?);
    }
    let eos: Vec<u32> = unique_below(&params.eos_token_ids, v);
    if !eos.is_empty() && rows.iter().any(|r| r.suppress_eos) {
        let zz = z.as_ref().unwrap_or(raw);
        let e = eos.len();
        let ids = Tensor::from_vec(eos.repeat(b), (b, e), device)?; // [b, E] u32
        let cur = zz.gather(&ids, 1)?; // [b, E]
        let flags: Vec<u8> = rows.iter().map(|r| r.suppress_eos as u8).collect();
        let off = Tensor::from_vec(flags, (b, 1), device)?.broadcast_as((b, e))?;
        let none = Tensor::full(f32::NEG_INFINITY, (b, e), device)?;
        z = Some(zz.scatter(&ids, &off.where_cond(&none, &cur)?, 1)?);
    }
    Ok(z)
}

/// The unnormalised probabilities `q` [b, V] after top-k, top-p and min-p, given the tempered
/// logits `s` [b, V] shifted to 0 at each row's top (`q = exp(s)`).
fn truncated(s: &Tensor, mut q: Tensor, params: &SamplingParams) -> Result<Tensor> {
    let (b, v) = s.dims2()?;
    let device = s.device();
    let at_least = |x: &Tensor, floor: &Tensor| x.broadcast_ge(floor)?.to_dtype(DType::F32);
    let (lo, hi) = (
        Tensor::full(-FLOOR as f32, (b, 1), device)?,
        Tensor::full(1f32, (b, 1), device)?,
    );
    if params.top_k > 0 && params.top_k < v {
        let k = params.top_k as f64;
        let keep = bisect(lo.clone(), hi.clone(), |mid| {
            at_least(s, mid)?.sum_keepdim(1)?.ge(k)
        })?;
        q = (q * at_least(s, &keep)?)?;
    }
    if params.top_p < 1.0 {
        let target = (q.sum_keepdim(1)? * params.top_p)?; // [b, 1]
        let keep = bisect(lo, hi, |mid| {
            (&q * at_least(s, mid)?)?.sum_keepdim(1)?.ge(&target)
        })?;
        q = (&q * at_least(s, &keep)?)?;
    }
    if params.min_p > 0.0 {
        let least = (q.max_keepdim(1)? * params.min_p)?; // [b, 1]
        q = (&q * at_least(&q, &least)?)?;
    }
    Ok(q)
}

/// The two-level draw from the unnormalised probabilities `q` [b, V] with each row's uniform:
/// per row the token, its raw logit (from `raw` [b, V]) and the row's log-prob normaliser (from
/// `norm` [b, 2]).
fn draw(
    q: &Tensor,
    raw: &Tensor,
    norm: &Tensor,
    rows: &[DeviceRow<'_>],
) -> Result<Vec<(u32, f32, Vec<f32>)>> {
    let (b, v) = q.dims2()?;
    let device = q.device();
    let blocks = v.div_ceil(BLOCK);
    let q = q.pad_with_zeros(1, 0, blocks * BLOCK - v)?; // [b, C*K]
    let sums = q.reshape((b, blocks, BLOCK))?.sum(2)?; // [b, C]
    let back = Tensor::cat(&[&sums, norm], 1)?.to_vec2::<f32>()?; // [b, C+2]
    let picks: Vec<(usize, f64)> = rows
        .iter()
        .zip(&back)
        .map(|(r, s)| pick(&s[..blocks], r.u))
        .collect();
    let flat: Vec<u32> = picks
        .iter()
        .enumerate()
        .map(|(i, &(c, _))| (i * blocks + c) as u32)
        .collect();
    let flat = Tensor::from_vec(flat, b, device)?;
    let raw = raw.pad_with_zeros(1, 0, blocks * BLOCK - v)?;
    let chosen = Tensor::cat(
        &[
            &q.reshape((b * blocks, BLOCK))?.index_select(&flat, 0)?,
            &raw.reshape((b * blocks, BLOCK))?.index_select(&flat, 0)?,
        ],
        1,
    )?
    .to_vec2::<f32>()?; // [b, 2K]: the block's probabilities, then its raw logits
    Ok(picks
        .iter()
        .zip(chosen)
        .zip(&back)
        .map(|((&(c, rest), blk), s)| {
            let j = scan(&blk[..BLOCK], rest).0;
            ((c * BLOCK + j) as u32, blk[BLOCK + j], s[blocks..].to_vec())
        })
        .collect())
}

/// The distinct ids of `ids` below `v`.
fn unique_below(ids: &[u32], v: usize) -> Vec<u32> {
    let mut seen = HashSet::with_capacity(ids.len());
    ids.iter()
        .copied()
        .filter(|&i| (i as usize) < v && seen.insert(i))
        .collect()
}

/// Rows of ids padded to the longest by repeating each row's first (a scatter writes the same
/// value twice); the flat ids and the width.
fn padded_ids(rows: impl Iterator<Item = Vec<u32>>, b: usize) -> (Vec<u32>, usize) {
    let rows: Vec<Vec<u32>> = rows.collect();
    let width = rows.iter().map(|r| r.len()).max().unwrap_or(0).max(1);
    let mut flat = Vec::with_capacity(b * width);
    for r in &rows {
        let pad = r.first().copied().unwrap_or(0);
        flat.extend(r.iter().copied().chain(std::iter::repeat(pad)).take(width));
    }
    (flat, width)
}

/// The largest threshold (to the bisection's precision) at which `holds` is true, per row,
/// between `lo` (where it holds, or nothing does) and `hi` (where it does not), both [b, 1].
/// `holds(mid)` returns [b, 1] u8.
fn bisect(
    mut lo: Tensor,
    mut hi: Tensor,
    holds: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
) -> Result<Tensor> {
    for _ in 0..BISECT_STEPS {
        let mid = ((&lo + &hi)? * 0.5)?;
        let ok = holds(&mid)?;
        lo = ok.where_cond(&mid, &lo)?;
        hi = ok.where_cond(&hi, &mid)?;
    }
    Ok(lo)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::choose_token;
    use candle_core::Device;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn params() -> SamplingParams {
        SamplingParams {
            eos_token_ids: vec![0],
            ..Default::default()
        }
    }

    /// Normal-ish logits (a sum of uniforms), spread like a language model's.
    fn logits(b: usize, v: usize, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..b * v)
            .map(|_| (0..4).map(|_| rng.random::<f32>()).sum::<f32>() * 4.0 - 8.0)
            .collect()
    }

    /// The device sampler picks what the host sampler picks from the same uniform draw, with the
    /// same log-prob, for every processing option; rows with different histories and EOS states
    /// share one call. The vocabulary (1000) ends inside a block.
    #[test]
    fn device_choice_equals_the_host_choice() {
        let (b, v) = (6, 1000);
        let cases = [
            params(),
            SamplingParams {
                temperature: 0.7,
                ..params()
            },
            SamplingParams {
                temperature: 0.0,
                ..params()
            },
            SamplingParams {
                top_k: 20,
                ..params()
            },
            SamplingParams {
                top_p: 0.9,
                ..params()
            },
            SamplingParams {
                top_k: 50,
                top_p: 0.8,
                min_p: 0.05,
                temperature: 1.3,
                ..params()
            },
            SamplingParams {
                min_p: 0.1,
                ..params()
            },
            SamplingParams {
                repetition_penalty: 1.5,
                eos_token_ids: vec![3, 999],
                ..params()
            },
            SamplingParams {
                repetition_penalty: 0.8,
                temperature: 0.0,
                eos_token_ids: vec![3],
                ..params()
            },
        ];
        let mut checked = 0;
        for (ci, p) in cases.iter().enumerate() {
            for step in 0..40u64 {
                let x = logits(b, v, 100 * ci as u64 + step);
                let t = Tensor::from_vec(x.clone(), (b, v), &Device::Cpu).unwrap();
                let seen: Vec<Vec<u32>> = (0..b)
                    .map(|i| {
                        (0..(3 + 7 * i as u32))
                            .map(|k| (k * 37 + i as u32) % 1000)
                            .collect()
                    })
                    .collect();
                let mut host_rngs: Vec<ChaCha8Rng> = (0..b)
                    .map(|i| ChaCha8Rng::seed_from_u64(step * 31 + i as u64))
                    .collect();
                let mut dev_rngs = host_rngs.clone();
                let rows: Vec<DeviceRow<'_>> = (0..b)
                    .map(|i| DeviceRow {
                        seen: &seen[i],
                        suppress_eos: i % 2 == 0,
                        u: dev_rngs[i].random::<f64>(),
                    })
                    .collect();
                let got = choose_tokens(&t, &rows, p).unwrap();
                let truncated = p.top_k > 0 || p.top_p < 1.0 || p.min_p > 0.0;
                for i in 0..b {
                    if truncated {
                        // The host sampler scans the kept tokens by probability, the device
                        // by id: the same distribution, another order. Against the f64 twin.
                        let u = ChaCha8Rng::seed_from_u64(step * 31 + i as u64).random::<f64>();
                        let want = twin(&x[i * v..(i + 1) * v], &seen[i], i % 2 == 0, p, u);
                        assert_eq!(got[i].0, want, "case {ci} step {step} row {i}: {p:?}");
                        checked += 1;
                        continue;
                    }
                    let (tok, lp) = choose_token(
                        &x[i * v..(i + 1) * v],
                        &seen[i],
                        i % 2 == 0,
                        p,
                        &mut host_rngs[i],
                        &mut vec![],
                    );
                    assert_eq!(got[i].0, tok, "case {ci} step {step} row {i}: {p:?}");
                    assert!((got[i].1 - lp).abs() < 1e-5, "{} vs {lp}", got[i].1);
                    if i % 2 == 0 {
                        assert!(!p.eos_token_ids.contains(&tok));
                    }
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 9 * 40 * 6);
    }

    /// The sampling distribution in f64, plainly: penalty, EOS suppression, temperature, top-k
    /// (all ties with the k-th kept), top-p on the rest (the fewest largest reaching the mass),
    /// min-p; then the token where `u` of the mass falls, scanning by id.
    fn twin(x: &[f32], seen: &[u32], suppress: bool, p: &SamplingParams, u: f64) -> u32 {
        let mut z: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let mut done = HashSet::new();
        for &s in seen {
            if done.insert(s) {
                let r = p.repetition_penalty;
                let v = &mut z[s as usize];
                *v = if *v < 0.0 { *v * r } else { *v / r };
            }
        }
        if suppress {
            p.eos_token_ids
                .iter()
                .for_each(|&e| z[e as usize] = f64::NEG_INFINITY);
        }
        let top = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let mut q: Vec<f64> = z
            .iter()
            .map(|v| ((v - top) / p.temperature).exp())
            .collect();
        let desc = |q: &[f64]| {
            let mut s = q.to_vec();
            s.sort_by(|a, b| b.total_cmp(a));
            s
        };
        if p.top_k > 0 {
            let kth = desc(&q)[p.top_k - 1];
            q.iter_mut().filter(|v| **v < kth).for_each(|v| *v = 0.0);
        }
        if p.top_p < 1.0 {
            let sorted = desc(&q);
            let target = p.top_p * sorted.iter().sum::<f64>();
            let mut acc = 0.0;
            let thr = sorted
                .iter()
                .find(|&&v| {
                    acc += v;
                    acc >= target
                })
                .copied()
                .unwrap_or(0.0);
            q.iter_mut().filter(|v| **v < thr).for_each(|v| *v = 0.0);
        }
        if p.min_p > 0.0 {
            let least = p.min_p * desc(&q)[0];
            q.iter_mut().filter(|v| **v < least).for_each(|v| *v = 0.0);
        }
        let mut left = u * q.iter().sum::<f64>();
        for (i, &v) in q.iter().enumerate() {
            if v > 0.0 {
                if left < v {
                    return i as u32;
                }
                left -= v;
            }
        }
        unreachable!("the draw ran past the mass")
    }

    /// The truncations restrict the support exactly (a vocabulary of 6, so every kept set is
    /// tried many times), and the draw follows the distribution.
    #[test]
    fn device_truncation_and_frequencies() {
        let x: Vec<f32> = vec![0.0, 5.0, 4.9, 1.0, -2.0, 4.0];
        let t = Tensor::from_vec(x.clone(), (1, 6), &Device::Cpu).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let support = |p: SamplingParams, rng: &mut ChaCha8Rng| {
            let mut got = std::collections::BTreeSet::new();
            for _ in 0..300 {
                let row = DeviceRow {
                    seen: &[],
                    suppress_eos: false,
                    u: rng.random(),
                };
                got.insert(choose_tokens(&t, &[row], &p).unwrap()[0].0);
            }
            got.into_iter().collect::<Vec<u32>>()
        };
        let with = |f: fn(&mut SamplingParams)| {
            let mut p = params();
            f(&mut p);
            p
        };
        assert_eq!(support(with(|p| p.top_k = 2), &mut rng), [1, 2]);
        assert_eq!(support(with(|p| p.top_k = 3), &mut rng), [1, 2, 5]);
        assert_eq!(support(with(|p| p.top_p = 0.7), &mut rng), [1, 2]);
        assert_eq!(support(with(|p| p.min_p = 0.5), &mut rng), [1, 2]);
        assert_eq!(support(with(|p| p.min_p = 0.3), &mut rng), [1, 2, 5]);
        // Suppressed EOS (id 0) is never drawn even when it dominates.
        let t = Tensor::from_vec(vec![20f32, 0.0, 0.0], (1, 3), &Device::Cpu).unwrap();
        for _ in 0..200 {
            let row = DeviceRow {
                seen: &[],
                suppress_eos: true,
                u: rng.random(),
            };
            assert_ne!(choose_tokens(&t, &[row], &params()).unwrap()[0].0, 0);
        }
        // p = [0.25, 0.75], in a vocabulary of three blocks with the mass in two of them.
        let mut x = vec![f32::NEG_INFINITY; 3 * BLOCK];
        x[5] = 0.0;
        x[2 * BLOCK + 7] = 3f32.ln();
        let t = Tensor::from_vec(x, (1, 3 * BLOCK), &Device::Cpu).unwrap();
        let high = (0..4000)
            .filter(|_| {
                let row = DeviceRow {
                    seen: &[],
                    suppress_eos: false,
                    u: rng.random(),
                };
                let (tok, lp) = choose_tokens(&t, &[row], &params()).unwrap()[0];
                assert!(tok == 5 || tok == 2 * BLOCK as u32 + 7, "{tok}");
                let want = if tok == 5 { 0.25f32 } else { 0.75 };
                assert!((lp - want.ln()).abs() < 1e-6);
                tok != 5
            })
            .count();
        assert!((2850..3150).contains(&high), "{high}");
    }
}
