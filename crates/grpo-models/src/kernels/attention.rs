//! Attention, the op: how a model's attention is masked ([`AttnMask`]) and the dispatch that
//! runs it with the kernel its [`Compute`] and the shapes call for: the fused CPU kernels (all
//! positions, or one query per row over the cache), grpo's GPU kernels (FlashAttention's plan,
//! a decoding step's kernel), or candle ops over query chunks (the portable path).

use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};

use crate::kernels::cpu::fused_attention::{self, Spans};
use crate::kernels::mask::{build_mask, SharedPrefix, MASK_VALUE};
use crate::kernels::portable::chunked_attention;
use crate::kernels::portable::softmax;
use crate::kernels::portable::tensor_ops::{matmul_operand, reduce_dtype};
use crate::kernels::{Compute, Mode};

/// How attention is masked.
#[derive(Debug, Clone)]
pub enum AttnMask {
    /// Additive `[B, 1, S, Tk]` f32 (0 or [`MASK_VALUE`]).
    Dense(Tensor),
    /// A dense mask with its key runs read once for every layer (see [`AttnMask::dense`]).
    Spanned(Tensor, Arc<Spans>),
    /// One query per row (decoding): row `b` attends key slots `pad[b]..Tk` (left padding).
    /// With a [`SharedPrefix`], rows of a group read their common prompt slots from one row.
    LeftPad(Vec<usize>, Option<SharedPrefix>),
    /// A GPU's decoding step: [`AttnMask::LeftPad`] as a dense additive `[B, 1, 1, Tk]` f32 mask
    /// (built once per step) with its [`SharedPrefix`] on the device: each row's leader `[B]`
    /// u32, and the shared slots' end (without a prefix, each row its own leader over 0 slots).
    SharedDense(Tensor, Tensor, usize),
}

impl AttnMask {
    /// A dense additive mask `[B, 1, S, Tk]`; on the CPU its key runs are read here, once, for the
    /// fused attention of every layer.
    pub fn dense(mask: Tensor) -> Result<Self> {
        Ok(match mask.device().is_cpu() {
            true => {
                let spans = Arc::new(Spans::new(&mask)?);
                AttnMask::Spanned(mask, spans)
            }
            false => AttnMask::Dense(mask),
        })
    }

    /// `self` with sliding-window attention: a key `window` or more positions before its query
    /// is masked too. Without a cache (`first_slot` None) the distance is that of the batch's
    /// `positions` [B, S] (keys are the queries), so a packed continuation counts from its own
    /// prompt as it would alone; over a cache (or without positions) it is the distance of key
    /// slots, queries at slots `first_slot..first_slot + S` (the sampler writes each row's
    /// tokens in consecutive slots).
    /// Still 0 / [`MASK_VALUE`], so the fused attention's key runs express it.
    pub fn windowed(
        &self,
        window: usize,
        positions: Option<&Tensor>,
        first_slot: Option<usize>,
    ) -> Result<AttnMask> {
        let dense = match self {
            AttnMask::LeftPad(pad, shared) => {
                // One query, at slot `first_slot`: keys from slot first_slot + 1 - window on.
                let from = (first_slot.unwrap_or(0) + 1).saturating_sub(window);
                let pad = pad.iter().map(|&p| p.max(from)).collect();
                return Ok(AttnMask::LeftPad(pad, shared.clone()));
            }
            AttnMask::Dense(m) | AttnMask::Spanned(m, _) | AttnMask::SharedDense(m, ..) => m,
        };
        let (b, _, s, tk) = dense.dims4()?;
        let dev = dense.device();
        let slots = |from: usize, n: usize| -> Result<Tensor> {
            Tensor::arange(from as u32, (from + n) as u32, dev)?
                .to_dtype(DType::F32)?
                .unsqueeze(0)?
                .broadcast_as((b, n))
        };
        let (pq, pk) = match (first_slot, positions) {
            (None, Some(p)) if tk == s => {
                let p = p.to_dtype(DType::F32)?; // [B, S]
                (p.clone(), p)
            }
            _ => (slots(first_slot.unwrap_or(0), s)?, slots(0, tk)?), // [B, S], [B, Tk]
        };
        let far = pq
            .unsqueeze(2)?
            .broadcast_sub(&pk.unsqueeze(1)?)?
            .ge(window as f64)?; // [B, S, Tk]
        let masked = Tensor::full(MASK_VALUE, (b, s, tk), dev)?;
        let extra = far
            .where_cond(&masked, &masked.zeros_like()?)?
            .unsqueeze(1)?
            .to_dtype(dense.dtype())?; // [B, 1, S, Tk]
        AttnMask::dense(dense.minimum(&extra)?)
    }

    /// A decoding step's mask for every layer, made once: off the fused CPU path (`compute`,
    /// the layers'), left padding becomes the dense mask over `tk` key slots on `device` (so
    /// that no layer builds it on the host and uploads it), and under [`Compute::Gpu`] the
    /// prompt's shared slots go along as each row's leader, on the device. `None` where the
    /// layers take `self` as it is (not left padding, or the fused CPU kernels).
    pub fn for_every_layer(
        &self,
        s: usize,
        tk: usize,
        device: &Device,
        compute: Option<Compute>,
    ) -> Result<Option<AttnMask>> {
        let AttnMask::LeftPad(pad, shared) = self else {
            return Ok(None);
        };
        if compute.is_some_and(|c| c.is_fused()) {
            return Ok(None);
        }
        let dense = self.to_dense(s, tk, device)?;
        // (Without a prefix that fits, each row leads itself over no slots: the decoding
        // kernel then needs no leader tensor of its own in every layer.)
        Ok(Some(match compute.is_some_and(|c| c.on_gpu()) {
            true => {
                let (leader, end): (Vec<u32>, usize) = match shared {
                    Some(sp) if sp.fits(pad, tk) => {
                        (sp.leader.iter().map(|&l| l as u32).collect(), sp.end)
                    }
                    _ => ((0..pad.len() as u32).collect(), 0),
                };
                let n = leader.len();
                let leader = Tensor::from_vec(leader, n, device)?;
                AttnMask::SharedDense(dense, leader, end)
            }
            false => AttnMask::Dense(dense),
        }))
    }

    /// The additive mask `[B, 1, S, Tk]` for `s` queries over `tk` key slots.
    pub(crate) fn to_dense(&self, s: usize, tk: usize, device: &Device) -> Result<Tensor> {
        match self {
            AttnMask::Dense(m) | AttnMask::Spanned(m, _) | AttnMask::SharedDense(m, ..) => {
                Ok(m.clone())
            }
            AttnMask::LeftPad(pad, _) => {
                let valid: Vec<Vec<bool>> = pad
                    .iter()
                    .map(|&p| (0..tk).map(|j| j >= p).collect())
                    .collect();
                build_mask(&valid, tk - s, s, tk, device)
            }
        }
    }
}

/// Attention with Gemma 2's score softcapping, `cap * tanh(score * scale / cap)` before the
/// mask, as candle ops on every device: no fused kernel has the cap. `q` [B, H, S, D],
/// `k`/`v` [B, Hkv, Tk, D]; returns [B, S, H*D].
pub fn softcapped_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttnMask,
    scale: f64,
    cap: f64,
    mode: Mode,
) -> Result<Tensor> {
    let (b, h, s, d) = q.dims4()?;
    let (hkv, tk) = (k.dim(1)?, k.dim(2)?);
    let g = h / hkv;
    let dense = mask.to_dense(s, tk, q.device())?; // [B, 1, S, Tk]
                                                   // Query heads h = j*g + i all read kv head j: fold the group into the query axis.
    let q = q.contiguous()?.reshape((b, hkv, g * s, d))?; // [B, Hkv, g*S, D]
    let scores = q.matmul(&matmul_operand(k)?.t()?)?; // [B, Hkv, g*S, Tk]
    let scores = scores.to_dtype(reduce_dtype(scores.dtype()))?;
    let scores = (((scores * scale)? / cap)?.tanh()? * cap)?;
    let mask = dense.to_dtype(scores.dtype())?;
    let mask = mask
        .unsqueeze(2)?
        .broadcast_as((b, 1, g, s, tk))?
        .reshape((b, 1, g * s, tk))?;
    let probs = softmax(&scores.broadcast_add(&mask)?, mode)?.to_dtype(v.dtype())?;
    let out = probs.matmul(&matmul_operand(v)?)?; // [B, Hkv, g*S, D]
    out.reshape((b, h, s, d))?
        .transpose(1, 2)? // [B, S, H, D]
        .reshape((b, s, h * d))
}

/// Scaled dot-product attention with grouped KV heads, without copying K/V per group.
///
/// `q` [B, H, S, D], `k`/`v` [B, Hkv, Tk, D]. Returns [B, S, H*D]. Single-query decoding on CPU
/// f32 takes a fused kernel ([`decode_attention_cpu`]), several queries on CPU f32 the fused
/// kernel with a backward ([`fused_attention`]); other devices and dtypes go through matmuls.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttnMask,
    mode: Mode,
    compute: Compute,
) -> Result<Tensor> {
    let (b, h, s, d) = q.dims4()?;
    let tk = k.dim(2)?;
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    let shared_dev = match mask {
        AttnMask::SharedDense(_, leader, end) => Some((leader, *end)),
        _ => None,
    };
    let (dense, spans) = match mask {
        AttnMask::Dense(m) | AttnMask::SharedDense(m, ..) => (m.clone(), None),
        AttnMask::Spanned(m, sp) => (m.clone(), Some(sp.clone())),
        AttnMask::LeftPad(pad, shared) => {
            if mode == Mode::Infer && s == 1 {
                if let Some(out) =
                    fused_attention::decode_attention_cpu(q, k, v, pad, shared.as_ref(), compute)?
                {
                    return Ok(out);
                }
            }
            let valid: Vec<Vec<bool>> = pad
                .iter()
                .map(|&p| (0..tk).map(|j| j >= p).collect())
                .collect();
            (build_mask(&valid, tk - 1, 1, tk, q.device())?, None)
        }
    };
    let hkv = k.dim(1)?;
    let g = h / hkv;
    let scale = 1.0 / (d as f64).sqrt();
    #[cfg(feature = "cuda")]
    if s == 1 && mode == Mode::Infer && compute.on_gpu() {
        // A GPU's decoding step: one kernel over the KV cache's views.
        if let Some(out) =
            crate::kernels::cuda::decode_attention(q, k, v, &dense, scale, shared_dev)?
        {
            return Ok(out); // [B, 1, H*D]
        }
    }
    if s > 1 && compute.fuses(q) && compute.fuses(k) && compute.fuses(v) {
        let spans = match spans {
            Some(sp) if sp.dims() == (b, s, tk) => sp,
            _ => Arc::new(Spans::new(&dense.broadcast_as((b, 1, s, tk))?)?),
        };
        return fused_attention::attention(q, k, v, &spans, scale);
    }
    if s > 1 && !compute.fuses(q) {
        // The portable path (a GPU's): query chunks, no [B, H, S, Tk] kept for the backward.
        let record = mode == Mode::Train;
        let out = attention_dense(q, k, v, &dense, scale, record, compute)?;
        return out
            .transpose(1, 2)? // [B, S, H, D]
            .reshape((b, s, h * d));
    }
    // Query heads h = j*g + i all read kv head j: fold the group into the query axis.
    let q = q.contiguous()?.reshape((b, hkv, g * s, d))?; // [B, Hkv, g*S, D]
    let k = matmul_operand(k)?;
    let probs = if compute.fuses(&q) {
        let raw = q.matmul(&k.t()?)?; // [B, Hkv, g*S, Tk]
        crate::kernels::cpu::fused::masked_softmax(&raw, &dense, scale, s)?
    } else {
        let scores = (q.matmul(&k.t()?)? * scale)?; // [B, Hkv, g*S, Tk]
        let scores = scores.to_dtype(reduce_dtype(scores.dtype()))?;
        let mask = dense.to_dtype(scores.dtype())?;
        let mask = if g == 1 {
            mask
        } else {
            mask.unsqueeze(2)?
                .broadcast_as((b, 1, g, s, tk))?
                .reshape((b, 1, g * s, tk))?
        };
        let scores = scores.broadcast_add(&mask)?;
        softmax(&scores, mode)?.to_dtype(v.dtype())?
    };
    let out = probs.matmul(&matmul_operand(v)?)?; // [B, Hkv, g*S, D]
    out.reshape((b, h, s, d))?
        .transpose(1, 2)? // [B, S, H, D]
        .reshape((b, s, h * d))
}

/// `q` [B, H, S, D], `k`/`v` [B, Hkv, Tk, D], `mask` additive [B, 1, S, Tk] (broadcast over
/// heads) and causal: query `i` may read key slots up to `Tk - S + i` only (later ones are not
/// scored at all) -> [B, H, S, D] in `v`'s dtype. With `record`, the result takes part in the
/// graph (its backward recomputes; see the module docs). Under [`Compute::Gpu`] grpo's attention
/// kernels run where they take the shapes, else the chunked candle ops.
pub fn attention_dense(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    scale: f64,
    record: bool,
    compute: Compute,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if compute.on_gpu() {
        if let Some(out) = crate::kernels::cuda::attention(q, k, v, mask, scale, record)? {
            return Ok(out);
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = compute;
    chunked_attention::attention_ops(q, k, v, mask, scale, record)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::fused_attention::decode_attention_cpu;
    use crate::kernels::portable::ops::tests::max_abs_diff;

    /// Rows 0-2 share one prompt (slots 1..5 equal, slot 0 padding), row 3 is another prompt:
    /// reading the shared slots from the leader gives what each row's own copy gives, and a
    /// leader with another padding is not used.
    #[test]
    fn decode_attention_reads_a_shared_prompt_from_its_leader() {
        if crate::kernels::kernels() == crate::kernels::Kernels::Portable {
            return; // a test of the CPU kernel, which the portable kernels do not run
        }
        let dev = Device::Cpu;
        let (b, hkv, g, tk, d) = (4, 2, 3, 9, 64);
        let prompt = Tensor::randn(0f32, 1.0, (1, hkv, 5, d), &dev).unwrap();
        let mut ks = vec![];
        let mut vs = vec![];
        for r in 0..b {
            let own = Tensor::randn(0f32, 1.0, (1, hkv, tk - 5, d), &dev).unwrap();
            let pre = match r {
                3 => Tensor::randn(0f32, 1.0, (1, hkv, 5, d), &dev).unwrap(),
                _ => prompt.clone(),
            };
            ks.push(Tensor::cat(&[&pre, &own], 2).unwrap());
            let own_v = Tensor::randn(0f32, 1.0, (1, hkv, tk - 5, d), &dev).unwrap();
            let pre_v = (&pre * 0.5).unwrap();
            vs.push(Tensor::cat(&[&pre_v, &own_v], 2).unwrap());
        }
        let k = Tensor::cat(&ks, 0).unwrap(); // [B, Hkv, Tk, D]
        let v = Tensor::cat(&vs, 0).unwrap();
        let q = Tensor::randn(0f32, 1.0, (b, hkv * g, 1, d), &dev).unwrap();
        let pad = vec![1, 1, 1, 2];
        let run = |shared: Option<(Vec<usize>, usize)>| {
            let sp = shared.map(|(leader, end)| SharedPrefix { leader, end });
            decode_attention_cpu(&q, &k, &v, &pad, sp.as_ref(), Compute::CpuFused)
                .unwrap()
                .unwrap()
        };
        let own = run(None);
        assert!(max_abs_diff(&own, &run(Some((vec![0, 0, 0, 3], 5)))) < 1e-6);
        // Row 3 named row 0 as its leader, but its padding differs: the sharing is refused.
        assert!(max_abs_diff(&own, &run(Some((vec![0, 0, 0, 0], 5)))) < 1e-6);
        // A leader whose slots differ changes the result (the leader's slots are really read).
        assert!(max_abs_diff(&own, &run(Some((vec![0, 0, 0, 3], 6)))) > 1e-3);
    }

    /// The window masks keys `window` or more positions back: by positions without a cache
    /// (a packed continuation counts from its prompt), by slots over one, as raised left padding
    /// when decoding; what the mask already masked stays masked.
    #[test]
    fn windowed_mask_masks_keys_a_window_back() {
        let dev = Device::Cpu;
        // One row: a prompt at positions 0..3, then a continuation at 3, 4 that sees the prompt
        // and itself, and a second continuation at 3 that sees only the prompt and itself.
        let pos = Tensor::new(&[[0u32, 1, 2, 3, 4, 3]], &dev).unwrap();
        let sees = [
            vec![0],
            vec![0, 1],
            vec![0, 1, 2],
            vec![0, 1, 2, 3],
            vec![0, 1, 2, 3, 4],
            vec![0, 1, 2, 5],
        ];
        let mut m = vec![MASK_VALUE; 36];
        for (q, ks) in sees.iter().enumerate() {
            ks.iter().for_each(|&k| m[q * 6 + k] = 0.0);
        }
        let mask = AttnMask::dense(Tensor::from_vec(m, (1, 1, 6, 6), &dev).unwrap()).unwrap();
        let allowed = |mask: &AttnMask| -> Vec<Vec<usize>> {
            let AttnMask::Spanned(t, _) = mask else {
                panic!("a dense mask on the CPU is spanned")
            };
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let tk = t.dim(3).unwrap();
            v.chunks(tk)
                .map(|r| (0..tk).filter(|&k| r[k] == 0.0).collect())
                .collect()
        };
        let by_pos = mask.windowed(2, Some(&pos), None).unwrap();
        let want: Vec<Vec<usize>> = vec![
            vec![0],
            vec![0, 1],
            vec![1, 2],
            vec![2, 3],
            vec![3, 4],
            vec![2, 5],
        ];
        assert_eq!(allowed(&by_pos), want);
        // Over a cache: 2 queries at slots 4, 5 of 6 key slots, all keys valid.
        let cached = AttnMask::dense(build_mask(&[vec![true; 6]], 4, 2, 6, &dev).unwrap()).unwrap();
        let by_slot = cached.windowed(3, None, Some(4)).unwrap();
        assert_eq!(allowed(&by_slot), vec![vec![2, 3, 4], vec![3, 4, 5]]);
        // Decoding at slot 6 (7 key slots) with window 3: keys from slot 4 on.
        let pads = AttnMask::LeftPad(vec![0, 5], None);
        match pads.windowed(3, None, Some(6)).unwrap() {
            AttnMask::LeftPad(p, None) => assert_eq!(p, vec![4, 5]),
            other => panic!("{other:?}"),
        }
    }

    /// Softcapped attention against a plain f32 twin (grouped heads, a masked key); a cap far
    /// above the scores gives plain attention.
    #[test]
    fn softcapped_attention_matches_plain_twin() {
        let dev = Device::Cpu;
        let (h, hkv, s, d) = (4, 2, 3, 4);
        let q = (Tensor::randn(0f32, 1.0, (1, h, s, d), &dev).unwrap() * 3.0).unwrap();
        let k = Tensor::randn(0f32, 1.0, (1, hkv, s, d), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (1, hkv, s, d), &dev).unwrap();
        let valid = vec![vec![false, true, true]];
        let mask = AttnMask::Dense(build_mask(&valid, 0, s, s, &dev).unwrap());
        let (scale, cap) = (0.4, 2.0);
        let got = softcapped_attention(&q, &k, &v, &mask, scale, cap, Mode::Train).unwrap();
        let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap(); // [S, H*D]
        let at = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (qv, kv, vv) = (at(&q), at(&k), at(&v));
        for hi in 0..h {
            let j = hi / (h / hkv);
            for si in 1..s {
                let keys: Vec<usize> = (1..=si).collect();
                let scores: Vec<f32> = keys
                    .iter()
                    .map(|&t| {
                        let dot: f32 = (0..d)
                            .map(|x| qv[(hi * s + si) * d + x] * kv[(j * s + t) * d + x])
                            .sum();
                        cap as f32 * (dot * scale as f32 / cap as f32).tanh()
                    })
                    .collect();
                let mx = scores.iter().cloned().fold(f32::MIN, f32::max);
                let e: Vec<f32> = scores.iter().map(|x| (x - mx).exp()).collect();
                let z: f32 = e.iter().sum();
                for x in 0..d {
                    let want: f32 = keys
                        .iter()
                        .zip(&e)
                        .map(|(&t, w)| w / z * vv[(j * s + t) * d + x])
                        .sum();
                    let g = got[si * h * d + hi * d + x];
                    assert!((g - want).abs() < 1e-5, "{g} vs {want}");
                }
            }
        }
        let uncapped = softcapped_attention(&q, &k, &v, &mask, 0.5, 1e9, Mode::Infer).unwrap();
        let plain = attention(&q, &k, &v, &mask, Mode::Infer, Compute::Portable).unwrap();
        assert!(max_abs_diff(&uncapped, &plain) < 1e-5);
    }
}
