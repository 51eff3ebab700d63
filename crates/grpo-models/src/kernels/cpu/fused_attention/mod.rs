//! Fused CPU f32 attention for all-position forwards (training, reference log-probs, prefill),
//! with a hand-written backward.
//!
//! The matmul composition in `kernels::attention::attention` scores every key slot, masked or not,
//! through batched candle matmuls (one small GEMM per batch entry and KV head), and its backward
//! adds four more matmuls and transposed copies. Packed training rows are mostly masked (a
//! completion sees its prompt and itself, not its siblings, and a row may hold several
//! independent groups), so this kernel scores only the key runs the mask lets through. The runs
//! are read from the mask once per forward ([`Spans`]) and every layer and head reuses them.
//!
//! [`Spans`] also splits each batch row into independent blocks: consecutive query rows that
//! read a key range no other block reads (each packed group of a row is one). Work is split by
//! (block, KV head): each task owns its query heads' rows of the output and, in the backward, the
//! whole gradient of its keys and values, so nothing is shared between threads and the summation
//! order is fixed (exact resume needs bit-identical gradients).
//!
//! The probabilities of the unmasked keys are kept from the forward for the backward when the op
//! is recorded for autograd; a forward without a graph keeps nothing.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::kernels::cpu::fused::{f32s, read};
pub use crate::kernels::mask::MASK_VALUE;
use crate::kernels::Isa;

/// Mask entries at or below this are treated as masked (the mask holds 0 or [`MASK_VALUE`]).
const MASKED: f32 = MASK_VALUE * 0.5;

/// Query rows of one batch entry that read only the keys in `keys`, which no other block of the
/// entry reads.
#[derive(Debug, Clone, PartialEq)]
struct SpanBlock {
    b: usize,
    rows: Range<usize>,
    keys: Range<usize>,
    /// Unmasked keys summed over the block's rows: the length of one head's probabilities.
    len: usize,
}

/// Which keys each query row of an additive `[B, 1, S, Tk]` mask (0 or [`MASK_VALUE`]) reads:
/// its unmasked runs, and the independent blocks the rows fall into. Computed once per forward.
#[derive(Debug)]
pub struct Spans {
    b: usize,
    s: usize,
    tk: usize,
    /// Unmasked key runs `(start, end)` of query row `b * S + s`. A row with no unmasked key gets
    /// the whole range, as the composition's softmax then spreads evenly over every key.
    runs: Vec<Vec<(usize, usize)>>,
    /// The mask value on a row's runs: 0, or [`MASK_VALUE`] for a row with no unmasked key.
    add: Vec<f32>,
    /// Where each row's probabilities start in its block's per-head buffer.
    off: Vec<usize>,
    blocks: Vec<SpanBlock>,
}

impl Spans {
    /// Runs and blocks of a mask `[B, S, Tk]` given as contiguous values.
    fn from_values(mask: &[f32], b: usize, s: usize, tk: usize) -> Spans {
        let mut runs = Vec::with_capacity(b * s);
        let mut add = Vec::with_capacity(b * s);
        for r in 0..b * s {
            let m = &mask[r * tk..(r + 1) * tk];
            let mut row = Vec::new();
            let mut j = 0;
            while j < tk {
                if m[j] > MASKED {
                    let a = j;
                    while j < tk && m[j] > MASKED {
                        j += 1;
                    }
                    row.push((a, j));
                } else {
                    j += 1;
                }
            }
            add.push(if row.is_empty() { MASK_VALUE } else { 0.0 });
            if row.is_empty() {
                row.push((0, tk));
            }
            runs.push(row);
        }
        // Blocks: a new one starts at row `si` when no later row reads a key at or before the
        // last key an earlier row reads.
        let mut blocks = Vec::new();
        let mut off = vec![0; b * s];
        for bi in 0..b {
            let ext = |si: usize| {
                let r = &runs[bi * s + si];
                (r[0].0, r[r.len() - 1].1)
            };
            let mut later_min = vec![usize::MAX; s + 1];
            for si in (0..s).rev() {
                later_min[si] = later_min[si + 1].min(ext(si).0);
            }
            let mut start = 0;
            let mut seen_max = 0;
            for si in 0..s {
                seen_max = seen_max.max(ext(si).1);
                if si + 1 == s || later_min[si + 1] >= seen_max {
                    let rows = start..si + 1;
                    let ka = rows.clone().map(|x| ext(x).0).min().unwrap_or(0);
                    let mut len = 0;
                    for x in rows.clone() {
                        off[bi * s + x] = len;
                        len += runs[bi * s + x].iter().map(|(a, e)| e - a).sum::<usize>();
                    }
                    blocks.push(SpanBlock {
                        b: bi,
                        rows,
                        keys: ka..seen_max,
                        len,
                    });
                    start = si + 1;
                }
            }
        }
        Spans {
            b,
            s,
            tk,
            runs,
            add,
            off,
            blocks,
        }
    }

    /// Runs and blocks of an additive mask `[B, 1, S, Tk]` (any device; read to the host once).
    pub fn new(mask: &Tensor) -> Result<Spans> {
        let (b, one, s, tk) = mask.dims4()?;
        if one != 1 {
            bail!(
                "attention mask: expected [B, 1, S, Tk], got {:?}",
                mask.dims()
            );
        }
        let values = mask
            .to_dtype(candle_core::DType::F32)?
            .contiguous()?
            .flatten_all()?
            .to_vec1::<f32>()?;
        Ok(Spans::from_values(&values, b, s, tk))
    }

    /// `(B, S, Tk)` of the mask these spans were read from.
    pub fn dims(&self) -> (usize, usize, usize) {
        (self.b, self.s, self.tk)
    }
}

struct AttentionOp {
    spans: Arc<Spans>,
    h: usize,
    hkv: usize,
    d: usize,
    scale: f32,
    /// Probabilities per (block, KV head) task, `[g, block len]` each, kept for the backward.
    probs: Mutex<Option<Vec<Vec<f32>>>>,
    keep_probs: bool,
    /// The variant its forward and backward run (lowered to what the CPU runs).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    isa: Isa,
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

/// `o += sum_j p[j] * v[j]` over the rows of `v` (`p.len()` rows of `d`; `D` = `d` when known at
/// compile time, so the sum stays in registers).
#[inline(always)]
fn weighted_rows<const D: usize>(o: &mut [f32], p: &[f32], v: &[f32]) {
    let d = o.len();
    if D > 0 && d == D {
        let mut acc = [0f32; D];
        for (j, &pj) in p.iter().enumerate() {
            let vr = &v[j * D..(j + 1) * D];
            for l in 0..D {
                acc[l] += pj * vr[l];
            }
        }
        for l in 0..D {
            o[l] += acc[l];
        }
    } else {
        for (j, &pj) in p.iter().enumerate() {
            axpy(o, pj, &v[j * d..(j + 1) * d]);
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

/// `sum_l a[l] * b[l]` over `D` (or `a.len()` when `D` is 0) with 16 lane sums added pairwise
/// at the end, so that it compiles to a few vector FMAs and a shuffle tree.
#[inline(always)]
fn dot16<const D: usize>(a: &[f32], b: &[f32]) -> f32 {
    let d = if D > 0 { D } else { a.len() };
    let (a, b) = (&a[..d], &b[..d]);
    let mut acc = [0f32; 16];
    let mut c = 0;
    while c + 16 <= d {
        for l in 0..16 {
            acc[l] += a[c + l] * b[c + l];
        }
        c += 16;
    }
    let mut tail = 0f32;
    while c < d {
        tail += a[c] * b[c];
        c += 1;
    }
    let a8: [f32; 8] = std::array::from_fn(|l| acc[l] + acc[l + 8]);
    let a4: [f32; 4] = std::array::from_fn(|l| a8[l] + a8[l + 4]);
    (a4[0] + a4[2]) + (a4[1] + a4[3]) + tail
}

/// Inputs of one (block, KV head) task.
struct Task<'a> {
    blk: &'a SpanBlock,
    /// The KV head's query heads for the block's batch entry, `[g, S, D]`.
    q: &'a [f32],
    /// The block's key and value rows, `[keys, D]`.
    k: &'a [f32],
    v: &'a [f32],
}

impl AttentionOp {
    fn g(&self) -> usize {
        self.h / self.hkv
    }

    /// Task `t`: block `t / Hkv`, KV head `t % Hkv`.
    fn task<'a>(&'a self, q: &'a [f32], k: &'a [f32], v: &'a [f32], t: usize) -> Task<'a> {
        let sp = &*self.spans;
        let (s, tk, d, g) = (sp.s, sp.tk, self.d, self.g());
        let (blk, kvh) = (&sp.blocks[t / self.hkv], t % self.hkv);
        let bh = blk.b * self.hkv + kvh;
        let keys = (bh * tk + blk.keys.start) * d..(bh * tk + blk.keys.end) * d;
        Task {
            blk,
            q: &q[bh * g * s * d..(bh + 1) * g * s * d],
            k: &k[keys.clone()],
            v: &v[keys],
        }
    }

    /// Probabilities `[g, len]` and outputs `[g, rows, D]` of one task. `D` is the head size when
    /// it is a compile-time constant (so the per-key loops unroll), else 0.
    #[inline(always)]
    fn forward_block<const D: usize>(&self, x: &Task) -> (Vec<f32>, Vec<f32>) {
        let sp = &*self.spans;
        let (s, g, blk) = (sp.s, self.g(), x.blk);
        let d = if D > 0 { D } else { self.d };
        let (ka, nk, nr) = (blk.keys.start, blk.keys.len(), blk.rows.len());
        let mut p = vec![0f32; g * blk.len];
        let mut o = vec![0f32; g * nr * d];
        let kt = transpose_padded(x.k, nk, d); // [D, keys + 16]
        for i in 0..g {
            for si in blk.rows.clone() {
                let row = blk.b * s + si;
                let qr = &x.q[(i * s + si) * d..(i * s + si + 1) * d];
                let runs = &sp.runs[row];
                let n: usize = runs.iter().map(|(a, e)| e - a).sum();
                let at = i * blk.len + sp.off[row];
                let pr = &mut p[at..at + n];
                let add = sp.add[row];
                let mut c = 0;
                for &(a, e) in runs {
                    // Scores of the whole run at once: sum over d of q[d] * K^T[d, a..e].
                    scores(&mut pr[c..c + e - a], qr, &kt, nk + 16, a - ka);
                    c += e - a;
                }
                // Separate passes so that each vectorizes (a running max is a serial chain).
                pr.iter_mut().for_each(|z| *z = *z * self.scale + add);
                let max = crate::kernels::cpu::vmath::max(pr);
                let inv = 1.0 / crate::kernels::cpu::vmath::exp_sub_sum(pr, max);
                let r = i * nr + si - blk.rows.start;
                let or = &mut o[r * d..(r + 1) * d];
                let mut c = 0;
                for &(a, e) in runs {
                    let pw = &mut pr[c..c + e - a];
                    pw.iter_mut().for_each(|x| *x *= inv);
                    weighted_rows::<D>(or, pw, &x.v[(a - ka) * d..(e - ka) * d]);
                    c += e - a;
                }
            }
        }
        (p, o)
    }

    /// Gradients `dq` `[g, rows, D]`, `dk`, `dv` `[keys, D]` of one task; `dout` holds the
    /// task's output gradient rows `[g, rows, D]`.
    #[inline(always)]
    fn backward_block<const D: usize>(
        &self,
        x: &Task,
        p: &[f32],
        dout: &[f32],
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let sp = &*self.spans;
        let (s, g, blk) = (sp.s, self.g(), x.blk);
        let d = if D > 0 { D } else { self.d };
        let (ka, nk, nr) = (blk.keys.start, blk.keys.len(), blk.rows.len());
        let mut dq = vec![0f32; g * nr * d];
        let mut dk = vec![0f32; nk * d];
        let mut dv = vec![0f32; nk * d];
        let mut dp = vec![0f32; nk];
        let vt = transpose_padded(x.v, nk, d); // [D, keys + 16]
        for i in 0..g {
            for si in blk.rows.clone() {
                let row = blk.b * s + si;
                let r = i * nr + si - blk.rows.start;
                let qr = &x.q[(i * s + si) * d..(i * s + si + 1) * d];
                let gr = &dout[r * d..(r + 1) * d];
                let runs = &sp.runs[row];
                let n: usize = runs.iter().map(|(a, e)| e - a).sum();
                let at = i * blk.len + sp.off[row];
                let pr = &p[at..at + n];
                let mut c = 0;
                for &(a, e) in runs {
                    scores(&mut dp[c..c + e - a], gr, &vt, nk + 16, a - ka); // dP = dO V^T
                    c += e - a;
                }
                let cs = dot16::<0>(pr, &dp[..n]); // rowsum(P * dP), 16 lanes
                let dqr = &mut dq[r * d..(r + 1) * d];
                let mut c = 0;
                for &(a, e) in runs {
                    // dS = P * (dP - c) * scale, in place of dP.
                    for (jj, key) in (a - ka..e - ka).enumerate() {
                        let j = c + jj;
                        dp[j] = pr[j] * (dp[j] - cs) * self.scale;
                        axpy(&mut dk[key * d..(key + 1) * d], dp[j], qr);
                        axpy(&mut dv[key * d..(key + 1) * d], pr[j], gr);
                    }
                    weighted_rows::<D>(dqr, &dp[c..c + e - a], &x.k[(a - ka) * d..(e - ka) * d]);
                    c += e - a;
                }
            }
        }
        (dq, dk, dv)
    }

    #[inline(always)]
    fn forward_d(&self, x: &Task) -> (Vec<f32>, Vec<f32>) {
        match self.d {
            64 => self.forward_block::<64>(x),
            128 => self.forward_block::<128>(x),
            _ => self.forward_block::<0>(x),
        }
    }

    fn run_forward(&self, x: &Task) -> (Vec<f32>, Vec<f32>) {
        #[cfg(target_arch = "x86_64")]
        match self.isa {
            // SAFETY: `self.isa` was lowered to what the CPU runs when the op was made.
            Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => return unsafe { self.forward_avx512(x) },
            // SAFETY: as above.
            Isa::Avx2 => return unsafe { self.forward_avx2(x) },
            Isa::Baseline => {}
        }
        self.forward_d(x)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn forward_avx512(&self, x: &Task) -> (Vec<f32>, Vec<f32>) {
        self.forward_d(x)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn forward_avx2(&self, x: &Task) -> (Vec<f32>, Vec<f32>) {
        self.forward_d(x)
    }

    #[inline(always)]
    fn backward_d(&self, x: &Task, p: &[f32], dout: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        match self.d {
            64 => self.backward_block::<64>(x, p, dout),
            128 => self.backward_block::<128>(x, p, dout),
            _ => self.backward_block::<0>(x, p, dout),
        }
    }

    fn run_backward(&self, x: &Task, p: &[f32], dout: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        #[cfg(target_arch = "x86_64")]
        match self.isa {
            // SAFETY: `self.isa` was lowered to what the CPU runs when the op was made.
            Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => {
                return unsafe { self.backward_avx512(x, p, dout) }
            }
            // SAFETY: as above.
            Isa::Avx2 => return unsafe { self.backward_avx2(x, p, dout) },
            Isa::Baseline => {}
        }
        self.backward_d(x, p, dout)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn backward_avx512(
        &self,
        x: &Task,
        p: &[f32],
        dout: &[f32],
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        self.backward_d(x, p, dout)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn backward_avx2(
        &self,
        x: &Task,
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

    /// Row `(b, s)` of query head `kvh * g + i` in `[B, S, H*D]`, and in a task's `[g, rows, D]`.
    fn rows_of(&self, blk: &SpanBlock, kvh: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        let (s, h, d, g) = (self.spans.s, self.h, self.d, self.g());
        let (b, r0, nr) = (blk.b, blk.rows.start, blk.rows.len());
        (0..g).flat_map(move |i| {
            (r0..r0 + nr)
                .map(move |si| (((b * s + si) * h + kvh * g + i) * d, (i * nr + si - r0) * d))
        })
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
        let (b, s, tk) = self.spans.dims();
        let (h, hkv, d) = (self.h, self.hkv, self.d);
        self.check(l1, [b, h, s, d])?;
        self.check(l2, [b, hkv, tk, d])?;
        self.check(l3, [b, hkv, tk, d])?;
        let q = &f32s(s1)?[l1.start_offset()..];
        let k = &f32s(s2)?[l2.start_offset()..];
        let v = &f32s(s3)?[l3.start_offset()..];
        let tasks: Vec<(Vec<f32>, Vec<f32>)> = (0..self.spans.blocks.len() * hkv)
            .into_par_iter()
            .map(|t| self.run_forward(&self.task(q, k, v, t)))
            .collect();
        // [B, S, H*D]: query head h = kv * g + i of row (b, s). Blocks cover every row.
        let mut out = vec![0f32; b * s * h * d];
        for (t, (_, o)) in tasks.iter().enumerate() {
            let blk = &self.spans.blocks[t / hkv];
            for (dst, src) in self.rows_of(blk, t % hkv) {
                out[dst..dst + d].copy_from_slice(&o[src..src + d]);
            }
        }
        if self.keep_probs {
            let probs = tasks.into_iter().map(|(p, _)| p).collect();
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
        let (b, s, tk) = self.spans.dims();
        let (h, hkv, d) = (self.h, self.hkv, self.d);
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
                        let tasks: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> =
                            (0..self.spans.blocks.len() * hkv)
                                .into_par_iter()
                                .map(|t| {
                                    let x = self.task(qv, kv, vv, t);
                                    // The task's output-gradient rows, [g, rows, D].
                                    let mut go = vec![0f32; self.g() * x.blk.rows.len() * d];
                                    for (src, dst) in self.rows_of(x.blk, t % hkv) {
                                        go[dst..dst + d].copy_from_slice(&gv[src..src + d]);
                                    }
                                    self.run_backward(&x, &probs[t], &go)
                                })
                                .collect();
                        // Keys no block reads (padding) get zero gradients.
                        let mut dq = vec![0f32; b * h * s * d];
                        let mut dk = vec![0f32; b * hkv * tk * d];
                        let mut dv = vec![0f32; b * hkv * tk * d];
                        let g = self.g();
                        for (t, (tq, tdk, tdv)) in tasks.iter().enumerate() {
                            let (blk, kvh) = (&self.spans.blocks[t / hkv], t % hkv);
                            let nr = blk.rows.len();
                            for i in 0..g {
                                // dq is [B, H, S, D]: the block's rows of head kvh * g + i.
                                let at = ((blk.b * h + kvh * g + i) * s + blk.rows.start) * d;
                                dq[at..at + nr * d]
                                    .copy_from_slice(&tq[i * nr * d..(i + 1) * nr * d]);
                            }
                            let at = ((blk.b * hkv + kvh) * tk + blk.keys.start) * d;
                            dk[at..at + tdk.len()].copy_from_slice(tdk);
                            dv[at..at + tdv.len()].copy_from_slice(tdv);
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

/// `softmax(q k^T * scale + mask) v` with grouped KV heads, over the mask's [`Spans`]: `q`
/// [B, H, S, D], `k`/`v` [B, Hkv, Tk, D]. Query head `h` reads KV head `h / (H / Hkv)`.
/// Returns [B, S, H*D].
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spans: &Arc<Spans>,
    scale: f64,
) -> Result<Tensor> {
    attention_on(Isa::active(), q, k, v, spans, scale)
}

/// [`attention`] whose forward and backward run the `isa` variant (lowered to what this CPU
/// runs).
pub fn attention_on(
    isa: Isa,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spans: &Arc<Spans>,
    scale: f64,
) -> Result<Tensor> {
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
    if spans.dims() != (b, s, tk) {
        bail!(
            "fused attention: a mask for (B, S, Tk) = {:?} used with {:?}",
            spans.dims(),
            (b, s, tk)
        );
    }
    let keep_probs = q.track_op() || k.track_op() || v.track_op();
    let op = AttentionOp {
        spans: spans.clone(),
        h,
        hkv,
        d,
        scale: scale as f32,
        probs: Mutex::new(None),
        keep_probs,
        isa: isa.usable(),
    };
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    if keep_probs {
        q.apply_op3(&k, &v, op)
    } else {
        q.apply_op3_no_bwd(&k, &v, &op)
    }
}

mod decode;
pub use decode::{decode_attention_cpu, decode_head, decode_head_on};

#[cfg(test)]
mod tests;
