//! Fused CPU f32 attention for all-position forwards (training, reference log-probs, prefill),
//! with a hand-written backward.
//!
//! The matmul composition in [`super::layers::attention`] scores every key slot, masked or not,
//! through batched candle matmuls (one small GEMM per batch entry and KV head), and its backward
//! adds four more matmuls and transposed copies. Packed training rows are mostly masked (a
//! completion sees its prompt and itself, not its siblings), so this kernel scores only the key
//! spans the mask lets through: for each query row it reads the unmasked runs of its mask row once,
//! and every head of the row reuses them.
//!
//! Work is split by (batch entry, KV head): each task owns its query heads' rows of the output and,
//! in the backward, the whole gradient of its K and V block, so nothing is shared between
//! threads and the summation order is fixed (exact resume needs bit-identical gradients).
//!
//! The probabilities are kept from the forward for the backward when the op is recorded for
//! autograd (the same `[B, H, S, Tk]` the composition's softmax keeps); a forward without a graph
//! keeps nothing.

use std::sync::Mutex;

use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::fused::{applies, f32s, read};
use super::layers::MASK_VALUE;

/// Mask entries at or below this are treated as masked (the mask holds 0 or [`MASK_VALUE`]).
const MASKED: f32 = MASK_VALUE * 0.5;

struct AttentionOp {
    /// Additive mask, `[B, S, Tk]` contiguous (the `[B, 1, S, Tk]` mask without its head axis).
    mask: Vec<f32>,
    /// Unmasked key runs `(start, end)` of mask row `b * S + s`. A row with no unmasked key gets
    /// the whole range, as the composition's softmax then spreads evenly over every key.
    spans: Vec<Vec<(usize, usize)>>,
    b: usize,
    h: usize,
    hkv: usize,
    s: usize,
    tk: usize,
    d: usize,
    scale: f32,
    /// Probabilities per (batch entry, KV head) task, `[g * S, Tk]` each, kept for the backward.
    probs: Mutex<Option<Vec<Vec<f32>>>>,
    keep_probs: bool,
}

/// Unmasked runs of each mask row.
fn mask_spans(mask: &[f32], rows: usize, tk: usize) -> Vec<Vec<(usize, usize)>> {
    (0..rows)
        .map(|r| {
            let m = &mask[r * tk..(r + 1) * tk];
            let mut spans = Vec::new();
            let mut j = 0;
            while j < tk {
                if m[j] > MASKED {
                    let a = j;
                    while j < tk && m[j] > MASKED {
                        j += 1;
                    }
                    spans.push((a, j));
                } else {
                    j += 1;
                }
            }
            if spans.is_empty() {
                spans.push((0, tk));
            }
            spans
        })
        .collect()
}

/// `x` [rows, cols] -> [cols, rows + 16] (zero columns at the end, so that 16-key tiles may
/// read past the last key).
fn transpose_padded(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let ld = rows + 16;
    let mut t = vec![0f32; ld * cols];
    for r in 0..rows {
        for c in 0..cols {
            t[c * ld + r] = x[r * cols + c];
        }
    }
    t
}

/// `z[j] = sum_d q[d] * kt[d, from + j]` for a run of keys (`kt` [D, ld] from
/// [`transpose_padded`]): 16 keys at a time in registers, four independent partial sums over d.
#[inline(always)]
fn scores(z: &mut [f32], q: &[f32], kt: &[f32], ld: usize, from: usize) {
    let (n, d) = (z.len(), q.len());
    let mut j = 0;
    while j < n {
        let base = from + j;
        let mut acc = [[0f32; 16]; 4];
        let mut dd = 0;
        while dd + 4 <= d {
            for (u, a) in acc.iter_mut().enumerate() {
                let qd = q[dd + u];
                let row = &kt[(dd + u) * ld + base..(dd + u) * ld + base + 16];
                for l in 0..16 {
                    a[l] += qd * row[l];
                }
            }
            dd += 4;
        }
        while dd < d {
            let qd = q[dd];
            let row = &kt[dd * ld + base..dd * ld + base + 16];
            for l in 0..16 {
                acc[0][l] += qd * row[l];
            }
            dd += 1;
        }
        let m = (n - j).min(16);
        for l in 0..m {
            z[j + l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
        }
        j += 16;
    }
}

/// `o += sum_{j in a..e} p[j] * v[j]` (`v` rows of `d`; `D` = `d` when known at compile time, so
/// the sum stays in registers).
#[inline(always)]
fn weighted_rows<const D: usize>(o: &mut [f32], p: &[f32], v: &[f32], a: usize, e: usize) {
    let d = o.len();
    if D > 0 && d == D {
        let mut acc = [0f32; D];
        for j in a..e {
            let pj = p[j];
            let vr = &v[j * D..(j + 1) * D];
            for l in 0..D {
                acc[l] += pj * vr[l];
            }
        }
        for l in 0..D {
            o[l] += acc[l];
        }
    } else {
        for j in a..e {
            axpy(o, p[j], &v[j * d..(j + 1) * d]);
        }
    }
}

/// `y += a * x`.
#[inline(always)]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// Inputs of one (batch entry, KV head) task.
struct Block<'a> {
    /// The task's query heads, `[g, S, D]`.
    q: &'a [f32],
    /// Its K and V rows, `[Tk, D]`.
    k: &'a [f32],
    v: &'a [f32],
    /// Mask rows `[S, Tk]` and their spans.
    mask: &'a [f32],
    spans: &'a [Vec<(usize, usize)>],
}

impl AttentionOp {
    fn g(&self) -> usize {
        self.h / self.hkv
    }

    fn block<'a>(&'a self, q: &'a [f32], k: &'a [f32], v: &'a [f32], task: usize) -> Block<'a> {
        let (s, tk, d, g) = (self.s, self.tk, self.d, self.g());
        let b = task / self.hkv;
        Block {
            q: &q[task * g * s * d..(task + 1) * g * s * d],
            k: &k[task * tk * d..(task + 1) * tk * d],
            v: &v[task * tk * d..(task + 1) * tk * d],
            mask: &self.mask[b * s * tk..(b + 1) * s * tk],
            spans: &self.spans[b * s..(b + 1) * s],
        }
    }

    /// Probabilities `[g*S, Tk]` and outputs `[g*S, D]` of one task. `D` is the head size when
    /// it is a compile-time constant (so the per-key loops unroll), else 0.
    #[inline(always)]
    fn forward_block<const D: usize>(&self, x: &Block) -> (Vec<f32>, Vec<f32>) {
        let (s, tk, g) = (self.s, self.tk, self.g());
        let d = if D > 0 { D } else { self.d };
        let mut p = vec![0f32; g * s * tk];
        let mut o = vec![0f32; g * s * d];
        let kt = transpose_padded(x.k, tk, d); // [D, Tk + 16]
        for r in 0..g * s {
            let si = r % s;
            let qr = &x.q[r * d..(r + 1) * d];
            let m = &x.mask[si * tk..(si + 1) * tk];
            let pr = &mut p[r * tk..(r + 1) * tk];
            let spans = &x.spans[si];
            let mut max = f32::NEG_INFINITY;
            for &(a, e) in spans {
                // Scores of the whole run at once: sum over d of q[d] * K^T[d, a..e].
                scores(&mut pr[a..e], qr, &kt, tk + 16, a);
                for j in a..e {
                    let z = pr[j] * self.scale + m[j];
                    pr[j] = z;
                    max = max.max(z);
                }
            }
            let mut sum = 0f32;
            for &(a, e) in spans {
                for z in &mut pr[a..e] {
                    *z = super::fused::exp_or_zero(*z - max);
                    sum += *z;
                }
            }
            let inv = 1.0 / sum;
            let or = &mut o[r * d..(r + 1) * d];
            for &(a, e) in spans {
                pr[a..e].iter_mut().for_each(|x| *x *= inv);
                weighted_rows::<D>(or, pr, x.v, a, e);
            }
        }
        (p, o)
    }

    /// Gradients `dq` `[g*S, D]`, `dk`, `dv` `[Tk, D]` of one task; `dout` holds the task's
    /// output gradient rows `[g*S, D]`.
    #[inline(always)]
    fn backward_block<const D: usize>(
        &self,
        x: &Block,
        p: &[f32],
        dout: &[f32],
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (s, tk, g) = (self.s, self.tk, self.g());
        let d = if D > 0 { D } else { self.d };
        let mut dq = vec![0f32; g * s * d];
        let mut dk = vec![0f32; tk * d];
        let mut dv = vec![0f32; tk * d];
        let mut dp = vec![0f32; tk];
        let vt = transpose_padded(x.v, tk, d); // [D, Tk + 16]
        for r in 0..g * s {
            let si = r % s;
            let qr = &x.q[r * d..(r + 1) * d];
            let gr = &dout[r * d..(r + 1) * d];
            let pr = &p[r * tk..(r + 1) * tk];
            let spans = &x.spans[si];
            let mut c = 0f32;
            for &(a, e) in spans {
                scores(&mut dp[a..e], gr, &vt, tk + 16, a); // dP = dO V^T
                for j in a..e {
                    c += pr[j] * dp[j];
                }
            }
            let dqr = &mut dq[r * d..(r + 1) * d];
            for &(a, e) in spans {
                // dS = P * (dP - c) * scale, in place of dP.
                for j in a..e {
                    dp[j] = pr[j] * (dp[j] - c) * self.scale;
                    axpy(&mut dk[j * d..(j + 1) * d], dp[j], qr);
                    axpy(&mut dv[j * d..(j + 1) * d], pr[j], gr);
                }
                weighted_rows::<D>(dqr, &dp, x.k, a, e);
            }
        }
        (dq, dk, dv)
    }

    #[inline(always)]
    fn forward_d(&self, x: &Block) -> (Vec<f32>, Vec<f32>) {
        match self.d {
            64 => self.forward_block::<64>(x),
            128 => self.forward_block::<128>(x),
            _ => self.forward_block::<0>(x),
        }
    }

    fn run_forward(&self, x: &Block) -> (Vec<f32>, Vec<f32>) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F (checked above).
            return unsafe { self.forward_avx512(x) };
        }
        self.forward_d(x)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn forward_avx512(&self, x: &Block) -> (Vec<f32>, Vec<f32>) {
        self.forward_d(x)
    }

    #[inline(always)]
    fn backward_d(&self, x: &Block, p: &[f32], dout: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        match self.d {
            64 => self.backward_block::<64>(x, p, dout),
            128 => self.backward_block::<128>(x, p, dout),
            _ => self.backward_block::<0>(x, p, dout),
        }
    }

    fn run_backward(&self, x: &Block, p: &[f32], dout: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F (checked above).
            return unsafe { self.backward_avx512(x, p, dout) };
        }
        self.backward_d(x, p, dout)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn backward_avx512(
        &self,
        x: &Block,
        p: &[f32],
        dout: &[f32],
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        self.backward_d(x, p, dout)
    }

    fn check(&self, l: &Layout, dims: [usize; 4]) -> Result<()> {
        if l.dims() != dims || !l.is_contiguous() {
            bail!(
                "fused attention: expected a contiguous {dims:?}, got {:?}",
                l.dims()
            );
        }
        Ok(())
    }
}

impl CustomOp3 for AttentionOp {
    fn name(&self) -> &'static str {
        "fused-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b, h, hkv, s, tk, d) = (self.b, self.h, self.hkv, self.s, self.tk, self.d);
        self.check(l1, [b, h, s, d])?;
        self.check(l2, [b, hkv, tk, d])?;
        self.check(l3, [b, hkv, tk, d])?;
        let q = &f32s(s1)?[l1.start_offset()..];
        let k = &f32s(s2)?[l2.start_offset()..];
        let v = &f32s(s3)?[l3.start_offset()..];
        let blocks: Vec<(Vec<f32>, Vec<f32>)> = (0..b * hkv)
            .into_par_iter()
            .map(|task| self.run_forward(&self.block(q, k, v, task)))
            .collect();
        // [B, S, H*D]: query head h = kv * g + i of row (b, s).
        let g = self.g();
        let mut out = vec![0f32; b * s * h * d];
        for (task, (_, o)) in blocks.iter().enumerate() {
            let (bi, kv) = (task / hkv, task % hkv);
            for i in 0..g {
                for si in 0..s {
                    let dst = ((bi * s + si) * h + kv * g + i) * d;
                    let src = (i * s + si) * d;
                    out[dst..dst + d].copy_from_slice(&o[src..src + d]);
                }
            }
        }
        if self.keep_probs {
            let probs = blocks.into_iter().map(|(p, _)| p).collect();
            match self.probs.lock() {
                Ok(mut slot) => *slot = Some(probs),
                Err(_) => bail!("fused attention: a thread panicked holding the probabilities"),
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((b, s, h * d))))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _out: &Tensor,
        dout: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (b, h, hkv, s, tk, d) = (self.b, self.h, self.hkv, self.s, self.tk, self.d);
        let g = self.g();
        let probs = match self.probs.lock() {
            Ok(mut slot) => slot.take(),
            Err(_) => bail!("fused attention: a thread panicked holding the probabilities"),
        };
        let Some(probs) = probs else {
            bail!("fused attention: backward without the forward's probabilities (run twice?)")
        };
        let dout = dout.contiguous()?;
        let (dq, dk, dv) = read(q, |qv, qr| {
            read(k, |kv, kr| {
                read(v, |vv, vr| {
                    read(&dout, |gv, gr| {
                        let (qv, kv) = (&qv[qr.offset..], &kv[kr.offset..]);
                        let (vv, gv) = (&vv[vr.offset..], &gv[gr.offset..]);
                        let blocks: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..b * hkv)
                            .into_par_iter()
                            .map(|task| {
                                let (bi, kvh) = (task / hkv, task % hkv);
                                // The task's output-gradient rows, [g*S, D].
                                let mut go = vec![0f32; g * s * d];
                                for i in 0..g {
                                    for si in 0..s {
                                        let src = ((bi * s + si) * h + kvh * g + i) * d;
                                        let dst = (i * s + si) * d;
                                        go[dst..dst + d].copy_from_slice(&gv[src..src + d]);
                                    }
                                }
                                let x = self.block(qv, kv, vv, task);
                                self.run_backward(&x, &probs[task], &go)
                            })
                            .collect();
                        let mut dq = Vec::with_capacity(b * h * s * d);
                        let mut dk = Vec::with_capacity(b * hkv * tk * d);
                        let mut dv = Vec::with_capacity(b * hkv * tk * d);
                        for (a, bk, c) in blocks {
                            dq.extend_from_slice(&a);
                            dk.extend_from_slice(&bk);
                            dv.extend_from_slice(&c);
                        }
                        Ok((dq, dk, dv))
                    })
                })
            })
        })?;
        let dev = q.device();
        Ok((
            Some(Tensor::from_vec(dq, (b, h, s, d), dev)?),
            Some(Tensor::from_vec(dk, (b, hkv, tk, d), dev)?),
            Some(Tensor::from_vec(dv, (b, hkv, tk, d), dev)?),
        ))
    }
}

/// Whether [`attention`] can run on these inputs: f32 on the CPU.
pub fn fits(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    applies(q) && applies(k) && applies(v)
}

/// `softmax(q k^T * scale + mask) v` with grouped KV heads: `q` [B, H, S, D], `k`/`v`
/// [B, Hkv, Tk, D], `mask` [B, 1, S, Tk] additive (0 or [`MASK_VALUE`]). Query head `h` reads KV
/// head `h / (H / Hkv)`. Returns [B, S, H*D].
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    let (b, h, s, d) = q.dims4()?;
    let (bk, hkv, tk, dk) = k.dims4()?;
    if bk != b || dk != d || hkv == 0 || h % hkv != 0 || v.dims4()? != (b, hkv, tk, d) {
        bail!(
            "fused attention: q {:?}, k {:?}, v {:?} do not fit",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    let mask = mask
        .to_dtype(candle_core::DType::F32)?
        .broadcast_as((b, 1, s, tk))?
        .contiguous()?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let spans = mask_spans(&mask, b * s, tk);
    let keep_probs = q.track_op() || k.track_op() || v.track_op();
    let op = AttentionOp {
        mask,
        spans,
        b,
        h,
        hkv,
        s,
        tk,
        d,
        scale: scale as f32,
        probs: Mutex::new(None),
        keep_probs,
    };
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    if keep_probs {
        q.apply_op3(&k, &v, op)
    } else {
        q.apply_op3_no_bwd(&k, &v, &op)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::layers::{build_mask, softmax, Mode};
    use candle_core::{Device, Var};

    /// The matmul composition: repeat KV heads, scores, masked softmax, weighted values.
    fn composition(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, scale: f64) -> Tensor {
        let (b, h, s, d) = q.dims4().unwrap();
        let hkv = k.dim(1).unwrap();
        let g = h / hkv;
        let rep = |t: &Tensor| {
            let (b, hk, tk, d) = t.dims4().unwrap();
            t.unsqueeze(2)
                .unwrap()
                .broadcast_as((b, hk, g, tk, d))
                .unwrap()
                .reshape((b, hk * g, tk, d))
                .unwrap()
        };
        let (k, v) = (rep(k), rep(v));
        let scores = (q.matmul(&k.t().unwrap().contiguous().unwrap()).unwrap() * scale)
            .unwrap()
            .broadcast_add(mask)
            .unwrap();
        let p = softmax(&scores, Mode::Train).unwrap();
        p.matmul(&v.contiguous().unwrap())
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((b, s, h * d))
            .unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a - b).and_then(|d| d.abs()).and_then(|d| d.max_all());
        d.and_then(|d| d.to_scalar::<f32>()).unwrap()
    }

    /// Packed rows with segments, left padding (a fully masked query row) and a ragged tail.
    fn mask(b: usize, s: usize, dev: &Device) -> Tensor {
        let valid: Vec<Vec<bool>> = (0..b).map(|bi| (0..s).map(|j| j >= bi).collect()).collect();
        let causal = build_mask(&valid, 0, s, s, dev).unwrap(); // [B, 1, S, S]
                                                                // Row 0: a prompt of 3 then two segments; a key of segment 1 is hidden from segment 2.
        let mut m = causal.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for qi in 0..s {
            for j in 0..s {
                let seg = |x: usize| {
                    if x < 3 {
                        0
                    } else if x < 6 {
                        1
                    } else {
                        2
                    }
                };
                if seg(qi) != seg(j) && seg(j) != 0 {
                    m[qi * s + j] = MASK_VALUE;
                }
            }
        }
        Tensor::from_vec(m, (b, 1, s, s), dev).unwrap()
    }

    #[test]
    fn matches_the_composition_values_and_gradients() {
        let dev = Device::Cpu;
        for (b, h, hkv, s, d) in [(2, 6, 2, 9, 16), (3, 2, 2, 7, 20), (1, 4, 1, 11, 64)] {
            let q = Var::randn(0f32, 1.0, (b, h, s, d), &dev).unwrap();
            let k = Var::randn(0f32, 1.0, (b, hkv, s, d), &dev).unwrap();
            let v = Var::randn(0f32, 1.0, (b, hkv, s, d), &dev).unwrap();
            let m = mask(b, s, &dev);
            let scale = 1.0 / (d as f64).sqrt();
            let want = composition(&q, &k, &v, &m, scale);
            let got = attention(&q, &k, &v, &m, scale).unwrap();
            assert!(
                max_diff(&want, &got) < 1e-5,
                "values {}",
                max_diff(&want, &got)
            );
            // A weighted sum, so every output element has its own upstream gradient.
            let w = Tensor::randn(0f32, 1.0, (b, s, h * d), &dev).unwrap();
            let gw = (want * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let gg = (got * &w).unwrap().sum_all().unwrap().backward().unwrap();
            for (name, x) in [("q", &q), ("k", &k), ("v", &v)] {
                let (a, c) = (gw.get(x).unwrap(), gg.get(x).unwrap());
                assert!(max_diff(a, c) < 1e-4, "{name}: {}", max_diff(a, c));
            }
        }
    }

    #[test]
    fn forward_without_a_graph_matches_and_keeps_nothing() {
        let dev = Device::Cpu;
        let (b, h, hkv, s, d) = (2, 4, 2, 8, 8);
        let q = Tensor::randn(0f32, 1.0, (b, h, s, d), &dev).unwrap();
        let k = Tensor::randn(0f32, 1.0, (b, hkv, s, d), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (b, hkv, s, d), &dev).unwrap();
        let m = mask(b, s, &dev);
        let want = composition(&q, &k, &v, &m, 0.3);
        let got = attention(&q, &k, &v, &m, 0.3).unwrap();
        assert!(max_diff(&want, &got) < 1e-5);
        assert!(!got.track_op());
    }

    #[test]
    fn spans_are_the_unmasked_runs() {
        let x = MASK_VALUE;
        let m = [0.0, x, 0.0, 0.0, x, x, x, 0.0, x, x, x, x];
        // A fully masked row spreads over every key, as the composition's softmax does.
        assert_eq!(
            mask_spans(&m, 3, 4),
            vec![vec![(0, 1), (2, 4)], vec![(3, 4)], vec![(0, 4)]]
        );
    }
}
