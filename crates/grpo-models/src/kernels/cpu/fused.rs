//! Fused CPU f32 kernels with hand-written backward passes, for the training forward.
//!
//! candle's own fused kernels record no backward, and the differentiable compositions in
//! [`crate::kernels::portable`] keep every intermediate alive until the backward pass ends (an RMSNorm is
//! five tensors, a masked softmax seven, an LM-head log-softmax four `[rows, vocab]` copies). These
//! custom ops keep only their inputs and output, and compute the gradient in one pass:
//! - [`rms_norm`]: `w * x / sqrt(mean(x^2) + eps)`;
//! - [`masked_softmax`]: `softmax(scores * scale + mask)` for grouped-query attention;
//! - [`silu_mul`]: `silu(gate) * up` on the fused `[.., 2I]` gate/up projection;
//! - [`rope_heads`]: rotate-half RoPE from `[B, T, H*D]` straight into `[B, H, T, D]`;
//! - [`logprob_entropy`]: per-row `log softmax(z / t)[target]` and the entropy of `softmax(z / t)`.
//!
//! They apply to f32 tensors on the CPU under the fused CPU compute
//! ([`crate::kernels::Compute::fuses`]); other devices and dtypes, and every tensor under
//! `kernels = "portable"`, take the compositions. Each has a test against its composition,
//! values and gradients.

use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Storage, Tensor,
};
use rayon::prelude::*;

use crate::kernels::cpu::vmath;

/// A tensor seen as `n` rows of `cols` contiguous values, row `r` starting at
/// `offset + r * stride` (a contiguous tensor, or a narrow of its last dim).
#[derive(Debug, Clone, Copy)]
pub(super) struct Rows {
    pub(super) offset: usize,
    stride: usize,
    n: usize,
    cols: usize,
}

impl Rows {
    fn of(l: &Layout) -> Option<Rows> {
        let dims = l.dims();
        let st = l.stride();
        let r = dims.len();
        if r == 0 {
            return None;
        }
        let cols = dims[r - 1];
        if cols > 1 && st[r - 1] != 1 {
            return None;
        }
        // The leading dims that hold more than one row: a dim of size 1 has no stride that
        // matters (as for candle's `is_contiguous`), e.g. `[B, S, 1, D]` transposed to
        // `[B, 1, S, D]`, the keys of a model with one KV head.
        let lead: Vec<(usize, usize)> = dims[..r - 1]
            .iter()
            .zip(&st[..r - 1])
            .filter(|(d, _)| **d > 1)
            .map(|(&d, &s)| (d, s))
            .collect();
        let n: usize = lead.iter().map(|(d, _)| d).product();
        let stride = lead.last().map_or(cols, |&(_, s)| s);
        if lead.windows(2).any(|w| w[0].1 != w[1].1 * w[1].0) {
            return None;
        }
        if n > 1 && stride < cols {
            return None;
        }
        Some(Rows {
            offset: l.start_offset(),
            stride,
            n,
            cols,
        })
    }

    #[inline]
    fn row<'a>(&self, v: &'a [f32], r: usize) -> &'a [f32] {
        let s = self.offset + r * self.stride;
        &v[s..s + self.cols]
    }
}

pub(super) fn f32s(s: &CpuStorage) -> Result<&[f32]> {
    match s {
        CpuStorage::F32(v) => Ok(v),
        _ => bail!("fused kernel: expected f32 data"),
    }
}

/// `t` itself when it is a row view, else a contiguous copy.
fn as_rows(t: &Tensor) -> Result<Tensor> {
    if Rows::of(t.layout()).is_some() {
        Ok(t.clone())
    } else {
        t.contiguous()
    }
}

/// Runs `f` on the f32 data of `t` seen as rows.
pub(super) fn read<R>(t: &Tensor, f: impl FnOnce(&[f32], Rows) -> Result<R>) -> Result<R> {
    let t = as_rows(t)?;
    let (st, l) = t.storage_and_layout();
    let rows = match Rows::of(l) {
        Some(r) => r,
        None => bail!("fused kernel: unexpected layout"),
    };
    match &*st {
        Storage::Cpu(s) => f(f32s(s)?, rows),
        _ => bail!("fused kernel: expected a CPU tensor"),
    }
}

fn layout_rows(l: &Layout) -> Result<Rows> {
    match Rows::of(l) {
        Some(r) => Ok(r),
        None => bail!("fused kernel: input is not a row view; make it contiguous first"),
    }
}

/// Sum of `a[i] * b[i]` with 8 accumulators (vectorizes).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let n = a.len().min(b.len()) / 8 * 8;
    for (ca, cb) in a[..n].chunks_exact(8).zip(b[..n].chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += ca[l] * cb[l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in n..a.len().min(b.len()) {
        s += a[i] * b[i];
    }
    s
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

struct RmsNormOp {
    eps: f32,
}

fn rms_inv(x: &[f32], eps: f32) -> f32 {
    1.0 / (dot(x, x) / x.len() as f32 + eps).sqrt()
}

impl CustomOp2 for RmsNormOp {
    fn name(&self) -> &'static str {
        "fused-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w) = (f32s(s1)?, f32s(s2)?);
        let xr = layout_rows(l1)?;
        let wr = layout_rows(l2)?;
        let w = wr.row(w, 0);
        let h = xr.cols;
        let mut out = vec![0f32; xr.n * h];
        out.par_chunks_mut(h.max(1)).enumerate().for_each(|(r, o)| {
            let x = xr.row(x, r);
            let inv = rms_inv(x, self.eps);
            for j in 0..h {
                o[j] = x[j] * inv * w[j];
            }
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let h = x.dim(candle_core::D::Minus1)?;
        let (dx, dw) = read(x, |xv, xr| {
            read(w, |wv, wr| {
                read(dy, |gv, gr| {
                    let w = wr.row(wv, 0);
                    let mut dx = vec![0f32; xr.n * h];
                    // dw sums over rows: fixed blocks of rows, summed in order, so the result does
                    // not depend on how the thread pool splits the work (exact resume needs that).
                    const BLOCK: usize = 64;
                    let partials: Vec<Vec<f32>> = dx
                        .par_chunks_mut((h * BLOCK).max(1))
                        .enumerate()
                        .map(|(bi, block)| {
                            let mut acc = vec![0f32; h];
                            for (i, dxr) in block.chunks_mut(h.max(1)).enumerate() {
                                let r = bi * BLOCK + i;
                                let x = xr.row(xv, r);
                                let g = gr.row(gv, r);
                                let inv = rms_inv(x, self.eps);
                                // c = mean_k(w_k g_k xhat_k)
                                let mut c = 0f32;
                                for k in 0..h {
                                    c += w[k] * g[k] * x[k] * inv;
                                }
                                c /= h as f32;
                                for j in 0..h {
                                    let xhat = x[j] * inv;
                                    dxr[j] = inv * (w[j] * g[j] - xhat * c);
                                    acc[j] += g[j] * xhat;
                                }
                            }
                            acc
                        })
                        .collect();
                    let mut dw = vec![0f32; h];
                    for p in &partials {
                        dw.iter_mut().zip(p).for_each(|(a, b)| *a += b);
                    }
                    Ok((dx, dw))
                })
            })
        })?;
        let dx = Tensor::from_vec(dx, x.shape(), x.device())?;
        let dw = Tensor::from_vec(dw, w.shape(), w.device())?;
        Ok((Some(dx), Some(dw)))
    }
}

/// RMSNorm over the last dim: `w * x / sqrt(mean(x^2) + eps)`; `x` [.., H] f32, `w` [H].
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    as_rows(x)?.apply_op2(&w.contiguous()?, RmsNormOp { eps: eps as f32 })
}

// ---------------------------------------------------------------------------------------------
// Masked softmax for attention

struct MaskedSoftmaxOp {
    scale: f32,
    /// Query length S: score row r of a batch reads mask row `r % S`.
    s: usize,
}

impl MaskedSoftmaxOp {
    /// (rows of a batch entry, mask rows view) for `scores` [B, Hkv, R, Tk], `mask` [B, 1, S, Tk].
    fn geometry(&self, scores: &Layout) -> Result<(usize, usize)> {
        let d = scores.dims();
        if d.len() != 4 || self.s == 0 || !d[2].is_multiple_of(self.s) {
            bail!("fused softmax: scores {:?} do not fit S = {}", d, self.s);
        }
        Ok((d[1] * d[2], d[2]))
    }
}

impl CustomOp2 for MaskedSoftmaxOp {
    fn name(&self) -> &'static str {
        "fused-masked-softmax"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (z, m) = (f32s(s1)?, f32s(s2)?);
        let zr = layout_rows(l1)?;
        let mr = layout_rows(l2)?;
        let (per_b, r_len) = self.geometry(l1)?;
        let tk = zr.cols;
        if mr.cols != tk {
            bail!("fused softmax: mask has {} keys, scores {}", mr.cols, tk);
        }
        let mut out = vec![0f32; zr.n * tk];
        out.par_chunks_mut(tk.max(1))
            .enumerate()
            .for_each(|(r, o)| {
                let b = r / per_b;
                let q = (r % r_len) % self.s;
                let z = zr.row(z, r);
                let m = mr.row(m, b * self.s + q);
                for j in 0..tk {
                    o[j] = z[j] * self.scale + m[j];
                }
                let max = vmath::max(o);
                let inv = 1.0 / vmath::exp_sub_sum(o, max);
                o.iter_mut().for_each(|v| *v *= inv);
            });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        z: &Tensor,
        _mask: &Tensor,
        p: &Tensor,
        dp: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dz = read(p, |pv, pr| {
            read(dp, |gv, gr| {
                let tk = pr.cols;
                let mut dz = vec![0f32; pr.n * tk];
                dz.par_chunks_mut(tk.max(1)).enumerate().for_each(|(r, o)| {
                    let p = pr.row(pv, r);
                    let g = gr.row(gv, r);
                    let c = dot(p, g);
                    for j in 0..tk {
                        o[j] = self.scale * p[j] * (g[j] - c);
                    }
                });
                Ok(dz)
            })
        })?;
        Ok((Some(Tensor::from_vec(dz, z.shape(), z.device())?), None))
    }
}

/// `softmax(scores * scale + mask)` over the last dim, for `scores` [B, Hkv, g*S, Tk] (query
/// heads folded into rows: row `i*S + s` is query `s` of head `i` of the group) and an additive
/// `mask` [B, 1, S, Tk] shared by all heads. Gradient flows to `scores` only.
pub fn masked_softmax(scores: &Tensor, mask: &Tensor, scale: f64, s: usize) -> Result<Tensor> {
    let op = MaskedSoftmaxOp {
        scale: scale as f32,
        s,
    };
    let mask = mask.to_dtype(DType::F32)?.contiguous()?;
    if scores.track_op() {
        as_rows(scores)?.apply_op2(&mask, op)
    } else {
        as_rows(scores)?.apply_op2_no_bwd(&mask, &op)
    }
}

// ---------------------------------------------------------------------------------------------
// SiLU(gate) * up

struct SiluMulOp;

impl CustomOp1 for SiluMulOp {
    fn name(&self) -> &'static str {
        "fused-silu-mul"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32s(s)?;
        let xr = layout_rows(l)?;
        let i = xr.cols / 2;
        let mut out = vec![0f32; xr.n * i];
        out.par_chunks_mut(i.max(1)).enumerate().for_each(|(r, o)| {
            let row = xr.row(x, r);
            let (g, u) = row.split_at(i);
            vmath::silu_mul(g, u, o);
        });
        let mut dims = l.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = i;
        }
        Ok((CpuStorage::F32(out), Shape::from(dims)))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let dx = read(x, |xv, xr| {
            read(dy, |gv, gr| {
                let i = xr.cols / 2;
                let mut dx = vec![0f32; xr.n * 2 * i];
                dx.par_chunks_mut((2 * i).max(1))
                    .enumerate()
                    .for_each(|(r, o)| {
                        let row = xr.row(xv, r);
                        let (g, u) = row.split_at(i);
                        let dy = gr.row(gv, r);
                        let (dg, du) = o.split_at_mut(i);
                        vmath::silu_mul_grad(g, u, dy, dg, du);
                    });
                Ok(dx)
            })
        })?;
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}

/// `silu(gate) * up` where `gate_up` [.., 2I] holds gate in its first half and up in its second.
/// Returns [.., I].
pub fn silu_mul(gate_up: &Tensor) -> Result<Tensor> {
    if gate_up.dim(candle_core::D::Minus1)? % 2 != 0 {
        bail!("silu_mul: the last dim must be even");
    }
    as_rows(gate_up)?.apply_op1(SiluMulOp)
}

// ---------------------------------------------------------------------------------------------
// RoPE, [B, T, H*D] -> [B, H, T, D]

struct RopeOp {
    /// [B, T, D/2] f32, contiguous.
    cos: Tensor,
    sin: Tensor,
    b: usize,
    t: usize,
    heads: usize,
    d: usize,
}

impl CustomOp1 for RopeOp {
    fn name(&self) -> &'static str {
        "fused-rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32s(s)?;
        let xr = layout_rows(l)?;
        let (b, t, heads, d) = (self.b, self.t, self.heads, self.d);
        let half = d / 2;
        if xr.n != b * t || xr.cols != heads * d {
            bail!(
                "fused rope: input {:?} is not [{b}, {t}, {heads}*{d}]",
                l.dims()
            );
        }
        let out = read(&self.cos, |cv, _| {
            read(&self.sin, |sv, _| {
                let mut out = vec![0f32; b * heads * t * d];
                // One (batch, head) block of T x D per task.
                out.par_chunks_mut((t * d).max(1))
                    .enumerate()
                    .for_each(|(bh, o)| {
                        let (bi, h) = (bh / heads, bh % heads);
                        for ti in 0..t {
                            let row = xr.row(x, bi * t + ti);
                            let xh = &row[h * d..(h + 1) * d];
                            let cs = &cv[(bi * t + ti) * half..(bi * t + ti + 1) * half];
                            let sn = &sv[(bi * t + ti) * half..(bi * t + ti + 1) * half];
                            let od = &mut o[ti * d..(ti + 1) * d];
                            for i in 0..half {
                                let (x1, x2) = (xh[i], xh[i + half]);
                                od[i] = x1 * cs[i] - x2 * sn[i];
                                od[i + half] = x2 * cs[i] + x1 * sn[i];
                            }
                        }
                    });
                Ok(out)
            })
        })?;
        Ok((CpuStorage::F32(out), Shape::from((b, heads, t, d))))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let (b, t, heads, d) = (self.b, self.t, self.heads, self.d);
        let half = d / 2;
        let dx = read(dy, |gv, gr| {
            read(&self.cos, |cv, _| {
                read(&self.sin, |sv, _| {
                    let mut dx = vec![0f32; b * t * heads * d];
                    dx.par_chunks_mut((heads * d).max(1))
                        .enumerate()
                        .for_each(|(bt, o)| {
                            let (bi, ti) = (bt / t, bt % t);
                            let cs = &cv[bt * half..(bt + 1) * half];
                            let sn = &sv[bt * half..(bt + 1) * half];
                            for h in 0..heads {
                                let g = gr.row(gv, (bi * heads + h) * t + ti);
                                let od = &mut o[h * d..(h + 1) * d];
                                for i in 0..half {
                                    let (g1, g2) = (g[i], g[i + half]);
                                    od[i] = g1 * cs[i] + g2 * sn[i];
                                    od[i + half] = g2 * cs[i] - g1 * sn[i];
                                }
                            }
                        });
                    Ok(dx)
                })
            })
        })?;
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}

/// Rotate-half RoPE (HF / GPT-NeoX layout) of `x` [B, T, H*D] (a narrow of a fused projection is
/// fine) with tables `cos`/`sin` [B, T, D/2]; returns [B, H, T, D] contiguous, ready for attention.
pub fn rope_heads(x: &Tensor, cos: &Tensor, sin: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, t, hd) = x.dims3()?;
    if heads == 0 || hd % heads != 0 || !(hd / heads).is_multiple_of(2) {
        bail!("rope: {hd} features do not split into {heads} heads of even size");
    }
    let op = RopeOp {
        cos: cos.to_dtype(DType::F32)?.contiguous()?,
        sin: sin.to_dtype(DType::F32)?.contiguous()?,
        b,
        t,
        heads,
        d: hd / heads,
    };
    if x.track_op() {
        as_rows(x)?.apply_op1(op)
    } else {
        as_rows(x)?.apply_op1_no_bwd(&op)
    }
}

// ---------------------------------------------------------------------------------------------
// Log-prob of a target and entropy, from logits

struct LogprobEntropyOp {
    inv_t: f32,
}

fn u32s(s: &CpuStorage) -> Result<&[u32]> {
    match s {
        CpuStorage::U32(v) => Ok(v),
        _ => bail!("fused log-prob: targets must be u32"),
    }
}

/// `o = d(g_lp * lp + g_h * H) / d logits` without the target's one-hot term, for one row:
/// `z = l * inv_t`, `logp = z - lse`, `p = e^logp`; d lp / dz = onehot - p and
/// d H / dz = -p (logp + H). `c` = [inv_t, lse, g_lp, g_h, H].
#[inline(always)]
fn logprob_entropy_grad_body(l: &[f32], c: [f32; 5], o: &mut [f32]) {
    let [inv_t, lse, g_lp, g_h, h] = c;
    for (o, &v) in o.iter_mut().zip(l) {
        let logp = v * inv_t - lse;
        let p = vmath::exp(logp);
        *o = (-g_lp * p - g_h * p * (logp + h)) * inv_t;
    }
}

crate::kernels::isa_dispatch!(
    fn logprob_entropy_grad / logprob_entropy_grad_on(l: &[f32], c: [f32; 5], o: &mut [f32]) =
        logprob_entropy_grad_body
);

impl CustomOp2 for LogprobEntropyOp {
    fn name(&self) -> &'static str {
        "fused-logprob-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let logits = f32s(s1)?;
        let lr = layout_rows(l1)?;
        let targets = &u32s(s2)?[l2.start_offset()..];
        if !l2.is_contiguous() || l2.shape().elem_count() != lr.n {
            bail!("fused log-prob: targets must be [rows], contiguous");
        }
        let v = lr.cols;
        if let Some(&bad) = targets[..lr.n].iter().find(|&&y| y as usize >= v) {
            bail!("fused log-prob: target id {bad} is outside the vocabulary of {v}");
        }
        let mut out = vec![0f32; lr.n * 2];
        out.par_chunks_mut(2).enumerate().for_each(|(r, o)| {
            let l = lr.row(logits, r);
            let (max, sum, sz) = vmath::softmax_stats(l, self.inv_t);
            let lse = max + sum.ln();
            o[0] = l[targets[r] as usize] * self.inv_t - lse;
            o[1] = lse - sz / sum;
        });
        Ok((CpuStorage::F32(out), Shape::from((lr.n, 2))))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        out: &Tensor,
        dout: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let ys = targets.to_vec1::<u32>()?;
        let ov = out.to_vec2::<f32>()?;
        let gv = dout.to_vec2::<f32>()?;
        let inv_t = self.inv_t;
        let dl = read(logits, |lv, lr| {
            let v = lr.cols;
            let mut dl = vec![0f32; lr.n * v];
            dl.par_chunks_mut(v.max(1)).enumerate().for_each(|(r, o)| {
                let l = lr.row(lv, r);
                let (max, sum, _) = vmath::softmax_stats(l, inv_t);
                let lse = max + sum.ln();
                let (g_lp, g_h, h) = (gv[r][0], gv[r][1], ov[r][1]);
                logprob_entropy_grad(l, [inv_t, lse, g_lp, g_h, h], o);
                o[ys[r] as usize] += g_lp * inv_t;
            });
            Ok(dl)
        })?;
        Ok((
            Some(Tensor::from_vec(dl, logits.shape(), logits.device())?),
            None,
        ))
    }
}

/// `logits` [N, V] f32, `targets` [N] u32 -> [N, 2]: column 0 is `log softmax(logits / t)[target]`,
/// column 1 the entropy of `softmax(logits / t)`. Both are differentiable with respect to `logits`.
pub fn logprob_entropy(logits: &Tensor, targets: &Tensor, temperature: f64) -> Result<Tensor> {
    let t = if temperature > 0.0 { temperature } else { 1.0 };
    let op = LogprobEntropyOp {
        inv_t: (1.0 / t) as f32,
    };
    let targets = targets.contiguous()?;
    if logits.track_op() {
        as_rows(logits)?.apply_op2(&targets, op)
    } else {
        as_rows(logits)?.apply_op2_no_bwd(&targets, &op)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::portable::{apply_rope, rms_norm_diff};
    use crate::kernels::Mode;
    use candle_core::{Device, Var, D};

    fn max_abs(t: &Tensor) -> f32 {
        t.abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    fn close(a: &Tensor, b: &Tensor, tol: f32) {
        assert_eq!(a.dims(), b.dims());
        let d = max_abs(&(a - b).unwrap());
        let s = max_abs(b).max(1.0);
        assert!(d <= tol * s, "max diff {d} (scale {s})");
    }

    /// Fused and composed versions of `f` agree in value and in the gradient of a weighted sum.
    fn check(inputs: &[&Var], fused: &dyn Fn() -> Tensor, composed: &dyn Fn() -> Tensor, tol: f32) {
        let (a, b) = (fused(), composed());
        close(&a, &b, tol);
        let w = Tensor::rand(0f32, 1.0, a.shape(), &Device::Cpu).unwrap();
        let ga = (&a * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let gb = (&b * &w).unwrap().sum_all().unwrap().backward().unwrap();
        for v in inputs {
            close(ga.get(v).unwrap(), gb.get(v).unwrap(), tol);
        }
    }

    fn var(shape: &[usize]) -> Var {
        Var::randn(0f32, 1.0, shape, &Device::Cpu).unwrap()
    }

    #[test]
    fn rms_norm_matches_composition() {
        let x = var(&[3, 5, 24]);
        let w = var(&[24]);
        check(
            &[&x, &w],
            &|| rms_norm(&x, &w, 1e-5).unwrap(),
            &|| rms_norm_diff(&x, &w, 1e-5).unwrap(),
            1e-5,
        );
        // A narrowed (strided) input.
        let wide = var(&[4, 40]);
        let w = var(&[16]);
        check(
            &[&wide, &w],
            &|| rms_norm(&wide.narrow(1, 8, 16).unwrap(), &w, 1e-6).unwrap(),
            &|| rms_norm_diff(&wide.narrow(1, 8, 16).unwrap(), &w, 1e-6).unwrap(),
            1e-5,
        );
    }

    /// A dim of size 1 is skipped, whatever its stride: `[2, 5, 1, 24]` transposed to
    /// `[2, 1, 5, 24]` (strides 120, 24, 24, 1: contiguous to candle) is 10 rows of 24.
    #[test]
    fn a_dim_of_one_does_not_break_a_row_view() {
        let x = var(&[2, 5, 1, 24]);
        let t = x.transpose(1, 2).unwrap();
        assert!(t.is_contiguous());
        let rows = Rows::of(t.layout()).expect("a row view");
        assert_eq!((rows.n, rows.stride, rows.cols), (10, 24, 24));
        let w = var(&[24]);
        check(
            &[&x, &w],
            &|| rms_norm(&x.transpose(1, 2).unwrap(), &w, 1e-5).unwrap(),
            &|| rms_norm_diff(&x.transpose(1, 2).unwrap(), &w, 1e-5).unwrap(),
            1e-5,
        );
        // Rows that really are strided across a dim are still refused.
        let y = var(&[2, 3, 4]);
        assert!(Rows::of(y.transpose(0, 1).unwrap().layout()).is_none());
    }

    #[test]
    fn masked_softmax_matches_composition() {
        let (b, hkv, g, s, tk) = (2, 3, 2, 4, 6);
        let z = var(&[b, hkv, g * s, tk]);
        let mut m = vec![0f32; b * s * tk];
        for (i, v) in m.iter_mut().enumerate() {
            if (i * 7) % 5 == 0 {
                *v = crate::kernels::mask::MASK_VALUE;
            }
        }
        let mask = Tensor::from_vec(m, (b, 1, s, tk), &Device::Cpu).unwrap();
        let scale = 0.125;
        check(
            &[&z],
            &|| masked_softmax(&z, &mask, scale, s).unwrap(),
            &|| {
                let mb = mask
                    .unsqueeze(2)
                    .unwrap()
                    .broadcast_as((b, 1, g, s, tk))
                    .unwrap()
                    .reshape((b, 1, g * s, tk))
                    .unwrap();
                let zz = (z.as_tensor() * scale).unwrap().broadcast_add(&mb).unwrap();
                crate::kernels::portable::softmax(&zz, Mode::Train).unwrap()
            },
            1e-5,
        );
    }

    #[test]
    fn silu_mul_matches_composition() {
        let x = var(&[2, 3, 16]);
        check(
            &[&x],
            &|| silu_mul(&x).unwrap(),
            &|| {
                let g = x.narrow(D::Minus1, 0, 8).unwrap();
                let u = x.narrow(D::Minus1, 8, 8).unwrap();
                (g.silu().unwrap() * u).unwrap()
            },
            1e-5,
        );
    }

    #[test]
    fn rope_matches_composition() {
        let (b, t, h, d) = (2, 5, 3, 8);
        let wide = var(&[b, t, h * d + 7]);
        let cos = Tensor::rand(-1f32, 1.0, (b, t, d / 2), &Device::Cpu).unwrap();
        let sin = Tensor::rand(-1f32, 1.0, (b, t, d / 2), &Device::Cpu).unwrap();
        check(
            &[&wide],
            &|| rope_heads(&wide.narrow(2, 7, h * d).unwrap(), &cos, &sin, h).unwrap(),
            &|| {
                let x = wide
                    .narrow(2, 7, h * d)
                    .unwrap()
                    .reshape((b, t, h, d))
                    .unwrap()
                    .transpose(1, 2)
                    .unwrap();
                apply_rope(&x, &cos, &sin, Mode::Train).unwrap()
            },
            1e-5,
        );
    }

    #[test]
    fn logprob_entropy_matches_composition() {
        let (n, v) = (5, 37);
        let l = var(&[n, v]);
        let y = Tensor::new(&[0u32, 36, 5, 5, 20], &Device::Cpu).unwrap();
        for t in [1.0, 0.7] {
            check(
                &[&l],
                &|| logprob_entropy(&l, &y, t).unwrap(),
                &|| {
                    let z = (l.as_tensor() / t).unwrap();
                    let lsm = candle_nn::ops::log_softmax(&z, D::Minus1).unwrap();
                    let lp = lsm.gather(&y.unsqueeze(1).unwrap(), 1).unwrap(); // [n, 1]
                    let p = lsm.exp().unwrap();
                    let h = (p * &lsm)
                        .unwrap()
                        .sum_keepdim(D::Minus1)
                        .unwrap()
                        .neg()
                        .unwrap(); // [n, 1]
                    Tensor::cat(&[lp, h], 1).unwrap()
                },
                1e-5,
            );
        }
        let bad = Tensor::new(&[0u32, 99, 0, 0, 0], &Device::Cpu).unwrap();
        assert!(logprob_entropy(&l, &bad, 1.0).is_err());
    }
}
