//! Attention over query chunks that keeps no `[B, H, S, Tk]` tensor: the portable path's
//! attention for several queries (a GPU's too, where grpo's own kernels of
//! `kernels::cuda` do not apply).
//!
//! The forward scores a chunk of queries at a time (`[B, H, c, Tk]`, `c` sized to a byte
//! budget), softmaxes in f32 and keeps only the output and each query's log-sum-exp. In a
//! training forward the result is recorded with [`crate::kernels::portable::recompute::attach`]; the backward
//! recomputes each chunk's probabilities from the log-sum-exp (FlashAttention's plan, in candle
//! ops):
//!
//! ```text
//! P = exp(q k^T * scale + mask - lse)     dV += P^T dO
//! dP = dO v^T     D = rowsum(dO * O)     dS = P * (dP - D) * scale
//! dQ = dS k       dK += dS^T q
//! ```
//!
//! The attention is causal (a causal LM's: query `i` of `S` reads no key slot after
//! `Tk - S + i`), so a chunk of queries scores only the keys up to its last query's: about half
//! of the `[S, Tk]` scores of a row for a training forward.
//!
//! Grouped KV heads are read without copying K/V: query heads `j*g .. (j+1)*g` fold into the
//! query axis of kv head `j`. Half-precision inputs multiply in their dtype; scores, softmax and
//! the accumulated dK/dV are f32 (f64 stays f64), as in the all-at-once path this replaces.

use std::sync::Arc;

use candle_core::{DType, Result, Tensor, D};

use crate::kernels::portable::recompute::{attach, Backward};
use crate::kernels::portable::tensor_ops::{matmul_operand, reduce_dtype};

/// Bytes of f32 scores per chunk (`B * H * c * Tk * 4`): each pass holds a few tensors of it.
pub const CHUNK_BYTES: usize = 256 << 20;

/// Queries per chunk for `b` rows, `h` query heads and `tk` keys, within [`CHUNK_BYTES`].
pub fn chunk_queries(b: usize, h: usize, s: usize, tk: usize) -> usize {
    (CHUNK_BYTES / (b * h * tk * 4).max(1)).clamp(1, s.max(1))
}

/// `q` [B, H, S, D], `k`/`v` [B, Hkv, Tk, D], `mask` additive [B, 1, S, Tk] (broadcast over
/// heads) and causal: query `i` may read key slots up to `Tk - S + i` only (later ones are not
/// scored at all) -> [B, H, S, D] in `v`'s dtype. With `record`, the result takes part in the
/// graph (its backward recomputes; see the module docs). Candle ops only (grpo's GPU kernels run
/// in their place where [`crate::kernels::attention`] picks them): what the kernels are checked
/// against on a GPU.
pub fn attention_ops(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    scale: f64,
    record: bool,
) -> Result<Tensor> {
    let (b, h, s, _) = q.dims4()?;
    let tk = k.dim(2)?;
    let op = Chunked {
        mask: mask.broadcast_as((b, 1, s, tk))?.detach(),
        scale,
        chunk: chunk_queries(b, h, s, tk),
        lse: Default::default(),
    };
    let (out, lse) = op.forward(&q.detach(), &k.detach(), &v.detach())?;
    if !record {
        return Ok(out);
    }
    let op = Chunked {
        lse: std::sync::OnceLock::from(lse),
        ..op
    };
    attach(&out, &[q, k, v], Arc::new(op))
}

/// `out` (attention of `q`, `k`, `v` under `mask`, computed elsewhere with each query's
/// log-sum-exp `lse` [B, H, S] f32) recorded in the graph with this module's backward (the
/// GPU's `GRPO_GPU_KERNELS=forward`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn record(
    out: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    scale: f64,
    lse: &Tensor,
) -> Result<Tensor> {
    let (b, h, s, _) = q.dims4()?;
    let (hkv, tk) = (k.dim(1)?, k.dim(2)?);
    let op = Chunked {
        mask: mask.broadcast_as((b, 1, s, tk))?.detach(),
        scale,
        chunk: chunk_queries(b, h, s, tk),
        lse: std::sync::OnceLock::from(lse.reshape((b, hkv, h / hkv.max(1), s, 1))?),
    };
    attach(out, &[q, k, v], Arc::new(op))
}

struct Chunked {
    /// [B, 1, S, Tk] f32.
    mask: Tensor,
    scale: f64,
    /// Queries per chunk.
    chunk: usize,
    /// [B, Hkv, g, S, 1] f32: each query's log-sum-exp of its masked, scaled scores.
    lse: std::sync::OnceLock<Tensor>,
}

/// Query chunk `[s0, s0+n)` of `x` [B, Hkv, g, S, X] folded to [B, Hkv, g*n, X].
fn fold(x: &Tensor, s0: usize, n: usize) -> Result<Tensor> {
    let (b, hkv, g, _, w) = x.dims5()?;
    x.narrow(3, s0, n)?
        .contiguous()?
        .reshape((b, hkv, g * n, w))
}

impl Chunked {
    /// Key slots query chunk `[s0, s0+n)` reads: `0 .. Tk - S + s0 + n` (causal).
    fn keys(&self, s0: usize, n: usize) -> Result<usize> {
        let (_, _, s, tk) = self.mask.dims4()?;
        Ok((tk - s.min(tk) + s0 + n).min(tk))
    }

    /// The mask of query chunk `[s0, s0+n)` over its first `kn` keys, for `g` query heads per kv
    /// head: [B, 1, g*n, kn].
    fn mask_chunk(&self, g: usize, s0: usize, n: usize, kn: usize, f: DType) -> Result<Tensor> {
        let b = self.mask.dim(0)?;
        let m = self.mask.narrow(2, s0, n)?.narrow(3, 0, kn)?.to_dtype(f)?; // [B, 1, n, kn]
        if g == 1 {
            return m.contiguous();
        }
        m.unsqueeze(2)?
            .broadcast_as((b, 1, g, n, kn))?
            .reshape((b, 1, g * n, kn))
    }

    /// Scaled, masked scores of one folded query chunk over the keys `k` [B, Hkv, kn, D] it
    /// reads, f32 (f64 stays f64): [B, Hkv, g*n, kn].
    fn scores(&self, qc: &Tensor, k: &Tensor, g: usize, s0: usize, n: usize) -> Result<Tensor> {
        let raw = (qc.matmul(&k.t()?)? * self.scale)?; // [B, Hkv, g*n, kn]
        let f = reduce_dtype(raw.dtype());
        raw.to_dtype(f)?
            .broadcast_add(&self.mask_chunk(g, s0, n, k.dim(2)?, f)?)
    }

    fn dims(q: &Tensor, k: &Tensor) -> Result<(usize, usize, usize, usize, usize)> {
        let (b, h, s, d) = q.dims4()?;
        let hkv = k.dim(1)?;
        if hkv == 0 || h % hkv != 0 {
            candle_core::bail!("attention: {h} query heads over {hkv} kv heads");
        }
        Ok((b, hkv, h / hkv, s, d))
    }

    /// The output [B, H, S, D] and the log-sum-exps [B, Hkv, g, S, 1].
    fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, hkv, g, s, d) = Self::dims(q, k)?;
        let q5 = q.contiguous()?.reshape((b, hkv, g, s, d))?;
        let v = matmul_operand(v)?;
        let k = matmul_operand(k)?;
        let (mut outs, mut lses) = (Vec::new(), Vec::new());
        let mut s0 = 0;
        while s0 < s {
            let n = self.chunk.min(s - s0);
            let qc = fold(&q5, s0, n)?; // [B, Hkv, g*n, D]
            let kn = self.keys(s0, n)?;
            let (kc, vc) = (k.narrow(2, 0, kn)?, v.narrow(2, 0, kn)?); // [B, Hkv, kn, D]
            let z = self.scores(&qc, &kc, g, s0, n)?; // [B, Hkv, g*n, kn] f32
            let max = z.max_keepdim(D::Minus1)?; // [B, Hkv, g*n, 1]
            let e = z.broadcast_sub(&max)?.exp()?;
            let sum = e.sum_keepdim(D::Minus1)?;
            let p = e.broadcast_div(&sum)?.to_dtype(v.dtype())?;
            let o = p.matmul(&vc)?; // [B, Hkv, g*n, D]
            outs.push(o.reshape((b, hkv, g, n, d))?);
            lses.push((max + sum.log()?)?.reshape((b, hkv, g, n, 1))?);
            s0 += n;
        }
        let out = Tensor::cat(&outs, 3)?.reshape((b, hkv * g, s, d))?;
        Ok((out, Tensor::cat(&lses, 3)?))
    }
}

impl Backward for Chunked {
    fn name(&self) -> &'static str {
        "chunked-attention"
    }

    fn backward(
        &self,
        inputs: &[Tensor],
        _wanted: &[bool],
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let [q, k, v] = inputs else {
            candle_core::bail!("chunked attention: three inputs expected");
        };
        let Some(lse) = self.lse.get() else {
            candle_core::bail!("chunked attention: backward without a recorded forward");
        };
        let (b, hkv, g, s, d) = Self::dims(q, k)?;
        let tk = k.dim(2)?;
        let fold5 = |x: &Tensor| x.contiguous()?.reshape((b, hkv, g, s, d));
        let (q5, o5, do5) = (fold5(q)?, fold5(out)?, fold5(grad)?);
        let k = matmul_operand(k)?;
        let v = matmul_operand(v)?;
        let f = reduce_dtype(q.dtype());
        let mut dk = Tensor::zeros((b, hkv, tk, d), f, q.device())?;
        let mut dv = Tensor::zeros((b, hkv, tk, d), f, q.device())?;
        let mut dqs = Vec::new();
        let mut s0 = 0;
        while s0 < s {
            let n = self.chunk.min(s - s0);
            let qc = fold(&q5, s0, n)?; // [B, Hkv, g*n, D]
            let doc = fold(&do5, s0, n)?;
            let oc = fold(&o5, s0, n)?;
            let lc = fold(lse, s0, n)?; // [B, Hkv, g*n, 1]
            let kn = self.keys(s0, n)?;
            let (kc, vc) = (k.narrow(2, 0, kn)?, v.narrow(2, 0, kn)?); // [B, Hkv, kn, D]
                                                                       // A chunk's dK / dV cover its kn keys; the rest of the Tk slots get zeros.
            let to_tk = |x: Tensor| x.to_dtype(f)?.pad_with_zeros(2, 0, tk - kn);
            let p = self.scores(&qc, &kc, g, s0, n)?.broadcast_sub(&lc)?.exp()?; // f32
            let doc_v = doc.to_dtype(v.dtype())?;
            dv = (dv + to_tk(p.to_dtype(v.dtype())?.t()?.matmul(&doc_v)?)?)?;
            let dp = doc_v.matmul(&vc.t()?)?.to_dtype(f)?; // [B, Hkv, g*n, kn]
            let rows = (doc.to_dtype(f)? * oc.to_dtype(f)?)?.sum_keepdim(D::Minus1)?; // [B, Hkv, g*n, 1]
            let ds = ((p * dp.broadcast_sub(&rows)?)? * self.scale)?.to_dtype(q.dtype())?;
            dqs.push(ds.matmul(&kc)?.reshape((b, hkv, g, n, d))?);
            dk = (dk + to_tk(ds.t()?.matmul(&qc)?)?)?;
            s0 += n;
        }
        let dq = Tensor::cat(&dqs, 3)?.reshape((b, hkv * g, s, d))?;
        Ok(vec![
            Some(dq),
            Some(dk.to_dtype(k.dtype())?),
            Some(dv.to_dtype(v.dtype())?),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The all-at-once twin through candle's autograd: softmax(q k^T * scale + mask) v.
    fn plain(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, scale: f64) -> Tensor {
        let (b, h, s, d) = q.dims4().unwrap();
        let g = h / k.dim(1).unwrap();
        let rep = |x: &Tensor| {
            let (b, hkv, t, d) = x.dims4().unwrap();
            x.unsqueeze(2)
                .unwrap()
                .broadcast_as((b, hkv, g, t, d))
                .unwrap()
                .reshape((b, hkv * g, t, d))
                .unwrap()
        };
        let z = (q.matmul(&rep(k).t().unwrap()).unwrap() * scale)
            .unwrap()
            .broadcast_add(mask)
            .unwrap();
        let e = z
            .broadcast_sub(&z.max_keepdim(D::Minus1).unwrap())
            .unwrap()
            .exp()
            .unwrap();
        let p = e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap();
        let _ = (b, s, d);
        p.matmul(&rep(v)).unwrap()
    }

    fn causal_mask(b: usize, s: usize, tk: usize, dev: &Device) -> Tensor {
        // Queries sit at the last s of tk slots; row 1 also has its first two slots padded.
        let mut m = vec![0f32; b * s * tk];
        for bi in 0..b {
            for i in 0..s {
                for j in 0..tk {
                    if j > tk - s + i || (bi == 1 && j < 2) {
                        m[(bi * s + i) * tk + j] = crate::kernels::mask::MASK_VALUE;
                    }
                }
            }
        }
        Tensor::from_vec(m, (b, 1, s, tk), dev).unwrap()
    }

    use crate::kernels::portable::ops::tests::max_abs_diff as max_diff;

    /// Output and every input's gradient equal the all-at-once twin's, for grouped heads, one
    /// query per chunk and whole-row chunks, with keys before the queries (a prefix).
    #[test]
    fn chunked_attention_matches_the_all_at_once_twin_with_its_gradients() {
        let dev = Device::Cpu;
        let (b, h, hkv, s, tk, d) = (2, 6, 2, 7, 9, 4);
        let q = Var::randn(0f32, 1.0, (b, h, s, d), &dev).unwrap();
        let k = Var::randn(0f32, 1.0, (b, hkv, tk, d), &dev).unwrap();
        let v = Var::randn(0f32, 1.0, (b, hkv, tk, d), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, (b, h, s, d), &dev).unwrap();
        let mask = causal_mask(b, s, tk, &dev);
        let want = plain(&q, &k, &v, &mask, 0.4);
        let gw = (&want * &w).unwrap().sum_all().unwrap().backward().unwrap();
        for chunk in [1, 3, s] {
            let op = Chunked {
                mask: mask.clone(),
                scale: 0.4,
                chunk,
                lse: Default::default(),
            };
            let (out, lse) = op.forward(&q, &k, &v).unwrap();
            assert!(max_diff(&out, &want) < 1e-5, "chunk {chunk}");
            let op = Chunked {
                lse: std::sync::OnceLock::from(lse),
                ..op
            };
            let got = attach(&out, &[&q, &k, &v], Arc::new(op)).unwrap();
            let g = (&got * &w).unwrap().sum_all().unwrap().backward().unwrap();
            for (name, x) in [("q", &q), ("k", &k), ("v", &v)] {
                let (a, e) = (g.get(x).unwrap(), gw.get(x).unwrap());
                assert!(
                    max_diff(a, e) < 1e-5,
                    "d{name}, chunk {chunk}: {}",
                    max_diff(a, e)
                );
            }
        }
    }

    /// bf16 inputs: within bf16's rounding of the f32 twin, gradients in bf16.
    #[test]
    fn chunked_attention_in_bf16_stays_near_f32() {
        let dev = Device::Cpu;
        let (b, h, hkv, s, d) = (1, 4, 2, 6, 8);
        let q = Var::randn(0f32, 1.0, (b, h, s, d), &dev).unwrap();
        let k = Var::randn(0f32, 1.0, (b, hkv, s, d), &dev).unwrap();
        let v = Var::randn(0f32, 1.0, (b, hkv, s, d), &dev).unwrap();
        let mask = causal_mask(b, s, s, &dev);
        let want = plain(&q, &k, &v, &mask, 0.35);
        let bf = |x: &Var| x.as_tensor().to_dtype(DType::BF16).unwrap();
        let got = attention_ops(&bf(&q), &bf(&k), &bf(&v), &mask, 0.35, true).unwrap();
        assert_eq!(got.dtype(), DType::BF16);
        assert!(max_diff(&got.to_dtype(DType::F32).unwrap(), &want) < 3e-2);
        let g = got
            .to_dtype(DType::F32)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let gw = want.sum_all().unwrap().backward().unwrap();
        for x in [&q, &k, &v] {
            assert!(max_diff(g.get(x).unwrap(), gw.get(x).unwrap()) < 6e-2);
        }
    }

    #[test]
    fn chunks_fit_the_budget() {
        assert_eq!(chunk_queries(1, 1, 10, 4), 10);
        let c = chunk_queries(16, 9, 2100, 2100);
        assert!(c >= 1 && 16 * 9 * c * 2100 * 4 <= CHUNK_BYTES);
        assert_eq!(chunk_queries(64, 64, 8192, 1 << 20), 1);
    }
}
