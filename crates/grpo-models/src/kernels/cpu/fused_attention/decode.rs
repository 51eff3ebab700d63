//! Single-query attention for decoding on the CPU (f32): one row and kv head's query heads over
//! the KV cache's views in place, compiled per instruction set.

use candle_core::{Result, Tensor};

use super::{dot16, weighted_rows};
use crate::kernels::mask::SharedPrefix;
use crate::kernels::{Compute, Isa};

/// Single-query attention of decoding for one (row, KV head): the `g` query heads `q` `[g, d]`
/// score the keys of every segment `(k, v)` (`[n_s, d]` each, in key order), and `o` `[g, d]`
/// receives the softmax-weighted sum of their values. The cache is read in place (decoding is
/// bound by reading it); a prompt shared by a group is one segment read from one row.
#[inline(always)]
fn decode_head_body<const D: usize, const ISA: u8>(
    q: &[f32],
    segs: &[(&[f32], &[f32])],
    scale: f32,
    o: &mut [f32],
    d: usize,
) {
    let d = if D > 0 { D } else { d };
    let g = q.len() / d;
    let n: usize = segs.iter().map(|(k, _)| k.len() / d).sum();
    let mut p = vec![0f32; g * n]; // [g, n]
    let mut at = 0;
    for (k, _) in segs {
        let ns = k.len() / d;
        let mut z = vec![0f32; g * ns]; // [g, ns]
        let simd = d.is_multiple_of(16) && ISA != BASELINE;
        if simd {
            #[cfg(target_arch = "x86_64")]
            {
                // SAFETY: `ISA` is a level the CPU runs (`decode_head_on` lowers it); q holds g
                // rows of d, k ns rows of d, z g * ns scores; d % 16 == 0.
                if ISA == AVX512 {
                    unsafe { decode_scores_avx512(q, k, d, scale, &mut z) };
                } else {
                    unsafe { decode_scores_avx2(q, k, d, scale, &mut z) };
                }
            }
        }
        if !simd || cfg!(not(target_arch = "x86_64")) {
            for i in 0..g {
                let qi = &q[i * d..(i + 1) * d];
                for (t, zt) in z[i * ns..(i + 1) * ns].iter_mut().enumerate() {
                    *zt = dot16::<D>(qi, &k[t * d..(t + 1) * d]) * scale;
                }
            }
        }
        for i in 0..g {
            p[i * n + at..i * n + at + ns].copy_from_slice(&z[i * ns..(i + 1) * ns]);
        }
        at += ns;
    }
    for (i, pi) in p.chunks_exact_mut(n.max(1)).enumerate().take(g) {
        let max = crate::kernels::cpu::vmath::max(pi);
        let inv = 1.0 / crate::kernels::cpu::vmath::exp_sub_sum(pi, max);
        pi.iter_mut().for_each(|x| *x *= inv);
        let oi = &mut o[i * d..(i + 1) * d];
        oi.fill(0.0);
        let mut at = 0;
        for (_, v) in segs {
            let ns = v.len() / d;
            weighted_rows::<D>(oi, &pi[at..at + ns], v);
            at += ns;
        }
    }
}

/// [`Isa`] levels as const generic parameters of [`decode_head_body`].
const BASELINE: u8 = 0;
#[cfg(target_arch = "x86_64")]
const AVX2: u8 = 1;
#[cfg(target_arch = "x86_64")]
const AVX512: u8 = 2;

/// The scores `p[i, t] = scale * q[i] . k[t]` of [`decode_head_body`] for `d` a multiple of 16:
/// each key row is loaded once for all query heads, the dot products in 16-wide FMAs.
///
/// # Safety
/// AVX-512F must be available; `d % 16 == 0`, `q` holds `g` rows of `d`, `k` `n` rows of `d`, and
/// `p` `g * n` floats, where g = q.len() / d and n = k.len() / d.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn decode_scores_avx512(q: &[f32], k: &[f32], d: usize, scale: f32, p: &mut [f32]) {
    use std::arch::x86_64::*;
    let (g, n, c) = (q.len() / d, k.len() / d, d / 16);
    debug_assert!(d.is_multiple_of(16) && p.len() >= g * n);
    let (qp, kp, pp) = (q.as_ptr(), k.as_ptr(), p.as_mut_ptr());
    for t in 0..n {
        let kt = kp.add(t * d);
        for i in 0..g {
            let qi = qp.add(i * d);
            let mut acc = _mm512_mul_ps(_mm512_loadu_ps(qi), _mm512_loadu_ps(kt));
            for j in 1..c {
                acc = _mm512_fmadd_ps(
                    _mm512_loadu_ps(qi.add(16 * j)),
                    _mm512_loadu_ps(kt.add(16 * j)),
                    acc,
                );
            }
            *pp.add(i * n + t) = _mm512_reduce_add_ps(acc) * scale;
        }
    }
}

/// [`decode_scores_avx512`] in AVX2: the 16 lanes as two 8-lane registers, the same FMAs, and
/// the same halving reduction tree (lanes `i + 8`, then `i + 4`, `i + 2`, `i + 1`), so the
/// scores are bit-identical.
///
/// # Safety
/// AVX2 and FMA must be available; otherwise as [`decode_scores_avx512`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn decode_scores_avx2(q: &[f32], k: &[f32], d: usize, scale: f32, p: &mut [f32]) {
    use std::arch::x86_64::*;
    let (g, n, c) = (q.len() / d, k.len() / d, d / 16);
    debug_assert!(d.is_multiple_of(16) && p.len() >= g * n);
    let (qp, kp, pp) = (q.as_ptr(), k.as_ptr(), p.as_mut_ptr());
    for t in 0..n {
        let kt = kp.add(t * d);
        for i in 0..g {
            let qi = qp.add(i * d);
            let mut lo = _mm256_mul_ps(_mm256_loadu_ps(qi), _mm256_loadu_ps(kt));
            let mut hi = _mm256_mul_ps(_mm256_loadu_ps(qi.add(8)), _mm256_loadu_ps(kt.add(8)));
            for j in 1..c {
                let (qj, kj) = (qi.add(16 * j), kt.add(16 * j));
                lo = _mm256_fmadd_ps(_mm256_loadu_ps(qj), _mm256_loadu_ps(kj), lo);
                hi = _mm256_fmadd_ps(_mm256_loadu_ps(qj.add(8)), _mm256_loadu_ps(kj.add(8)), hi);
            }
            let s8 = _mm256_add_ps(lo, hi);
            let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
            let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2));
            *pp.add(i * n + t) = _mm_cvtss_f32(s1) * scale;
        }
    }
}

#[inline(always)]
fn decode_head_d<const ISA: u8>(
    q: &[f32],
    segs: &[(&[f32], &[f32])],
    scale: f32,
    o: &mut [f32],
    d: usize,
) {
    match d {
        64 => decode_head_body::<64, ISA>(q, segs, scale, o, d),
        128 => decode_head_body::<128, ISA>(q, segs, scale, o, d),
        _ => decode_head_body::<0, ISA>(q, segs, scale, o, d),
    }
}

/// Decoding attention of one (row, KV head): `q` `[g, d]` query heads; `segs` the cached keys
/// and values `[n_s, d]`, segment after segment in key order (at least one key in all); `o`
/// `[g, d]` the output; `scale` multiplies the scores. Runs at the active [`Isa`].
#[inline]
pub fn decode_head(q: &[f32], segs: &[(&[f32], &[f32])], scale: f32, o: &mut [f32], d: usize) {
    decode_head_on(Isa::active(), q, segs, scale, o, d)
}

/// [`decode_head`] compiled for `isa` (lowered to what this CPU runs).
pub fn decode_head_on(
    isa: Isa,
    q: &[f32],
    segs: &[(&[f32], &[f32])],
    scale: f32,
    o: &mut [f32],
    d: usize,
) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        unsafe fn avx512(q: &[f32], s: &[(&[f32], &[f32])], sc: f32, o: &mut [f32], d: usize) {
            decode_head_d::<AVX512>(q, s, sc, o, d)
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2(q: &[f32], s: &[(&[f32], &[f32])], sc: f32, o: &mut [f32], d: usize) {
            decode_head_d::<AVX2>(q, s, sc, o, d)
        }
        match isa.usable() {
            // SAFETY: `usable` lowers `isa` to what the CPU was detected to run.
            Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => {
                return unsafe { avx512(q, segs, scale, o, d) }
            }
            // SAFETY: as above.
            Isa::Avx2 => return unsafe { avx2(q, segs, scale, o, d) },
            Isa::Baseline => {}
        }
    }
    let _ = isa;
    decode_head_d::<BASELINE>(q, segs, scale, o, d)
}

/// Fused single-query attention for decoding, reading the KV cache views in place: for each row
/// and kv head, the g query heads score the unmasked key slots, softmax, and weight the values.
/// `q` [B, H, 1, D]; `k`/`v` [B, Hkv, Tk, D] with unit last stride. With `shared`, a row reads
/// slots `pad..end` from its group's leader row (see [`SharedPrefix`]). Returns `None` (caller
/// falls back to matmuls) unless everything is f32 on the CPU.
pub fn decode_attention_cpu(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pad: &[usize],
    shared: Option<&SharedPrefix>,
    compute: Compute,
) -> Result<Option<Tensor>> {
    use candle_core::{CpuStorage, Storage};
    use rayon::prelude::*;
    if !compute.fuses(q) || !compute.fuses(k) {
        return Ok(None);
    }
    let (b, h, _, d) = q.dims4()?;
    let (_, hkv, tk, _) = k.dims4()?;
    if k.stride()[3] != 1
        || k.stride()[2] != d
        || k.stride() != v.stride()
        || v.stride()[3] != 1
        || pad.len() != b
        || pad.iter().any(|&p| p >= tk)
    {
        return Ok(None);
    }
    let shared = shared.filter(|sp| sp.fits(pad, tk));
    let g = h / hkv;
    let scale = 1.0 / (d as f32).sqrt();
    let q = q.contiguous()?;
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let (
        Storage::Cpu(CpuStorage::F32(qd)),
        Storage::Cpu(CpuStorage::F32(kd)),
        Storage::Cpu(CpuStorage::F32(vd)),
    ) = (&*qs, &*ks, &*vs)
    else {
        return Ok(None);
    };
    let qd = &qd[ql.start_offset()..];
    let (kd, vd) = (&kd[kl.start_offset()..], &vd[vl.start_offset()..]);
    let st = kl.stride();
    let (sb, sh) = (st[0], st[1]);
    let mut out = vec![0f32; b * h * d];
    out.par_chunks_mut(g * d).enumerate().for_each(|(bj, o)| {
        let (bi, j) = (bj / hkv, bj % hkv);
        let p0 = pad[bi].min(tk);
        let qg = &qd[(bi * h + j * g) * d..(bi * h + (j + 1) * g) * d];
        let slots = |row: usize, from: usize, to: usize| {
            let (a, e) = (row * sb + j * sh + from * d, row * sb + j * sh + to * d);
            (&kd[a..e], &vd[a..e])
        };
        match shared {
            Some(sp) if sp.end > p0 && sp.leader[bi] != bi => {
                let segs = [slots(sp.leader[bi], p0, sp.end), slots(bi, sp.end, tk)];
                decode_head(qg, &segs, scale, o, d);
            }
            _ => decode_head(qg, &[slots(bi, p0, tk)], scale, o, d),
        }
    });
    drop((qs, ks, vs));
    Ok(Some(Tensor::from_vec(out, (b, 1, h * d), q.device())?))
}
