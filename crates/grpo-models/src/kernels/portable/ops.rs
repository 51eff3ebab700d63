//! The candle-op compositions of the layers' ops, differentiable, on every device: what the
//! portable path runs (a GPU's fallback, CI's `kernels = "portable"`), the twins the fused
//! kernels are tested against, and the inference forms (candle's fused kernels, no backward).

use std::sync::Arc;

use candle_core::{Result, Tensor, D};

use super::recompute::{attach, Backward};
use super::tensor_ops::reduce_dtype;
use crate::kernels::Mode;

/// Differentiable RMSNorm over the last dim, computed in f32 like HF.
pub fn rms_norm_diff(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let xf = x.to_dtype(reduce_dtype(dtype))?;
    let inv = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?; // [.., 1]
    let normed = xf.broadcast_mul(&inv)?.to_dtype(dtype)?;
    normed.broadcast_mul(w)
}

/// [`rms_norm_diff`]'s value, recorded in the graph with a backward written out
/// ([`super::recompute`]): the backward keeps only `x` and `w` (which the graph holds anyway),
/// not the five or so f32 intermediates of [`rms_norm_diff`] per call, the largest share of a
/// training pass's kept activations off the fused CPU path after attention and the LM head. With
/// `n = x r`, `r = 1 / sqrt(mean(x^2) + eps)` and `y = n w`: `dw = sum(g n)`,
/// `dx = r (g w - n mean(g w n))`, in f32 (f64 stays f64).
pub fn rms_norm_recomputed(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let y = rms_norm_diff(&x.detach(), &w.detach(), eps)?;
    attach(&y, &[x, w], Arc::new(RmsNormBackward { eps }))
}

struct RmsNormBackward {
    eps: f64,
}

impl Backward for RmsNormBackward {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn backward(
        &self,
        inputs: &[Tensor],
        wanted: &[bool],
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let [x, w] = inputs else {
            candle_core::bail!("rms-norm: two inputs expected");
        };
        let f = reduce_dtype(x.dtype());
        let xf = x.to_dtype(f)?; // [.., H]
        let r = (xf.sqr()?.mean_keepdim(D::Minus1)? + self.eps)?
            .sqrt()?
            .recip()?; // [.., 1]
        let n = xf.broadcast_mul(&r)?; // [.., H]
        let dw = match wanted[1] {
            true => {
                let h = w.dim(0)?;
                let gn = (grad * n.to_dtype(x.dtype())?)?.to_dtype(f)?; // [.., H]
                Some(gn.reshape(((), h))?.sum(0)?.to_dtype(w.dtype())?) // [H]
            }
            false => None,
        };
        let dn = grad.broadcast_mul(w)?.to_dtype(f)?; // [.., H]
        let proj = (&dn * &n)?.mean_keepdim(D::Minus1)?; // [.., 1]
        let dx = (dn - n.broadcast_mul(&proj)?)?.broadcast_mul(&r)?;
        Ok(vec![Some(dx.to_dtype(x.dtype())?), dw])
    }
}

/// Differentiable LayerNorm over the last dim (biased variance, like torch).
pub fn layer_norm_diff(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let xf = x.to_dtype(reduce_dtype(dtype))?;
    let mean = xf.mean_keepdim(D::Minus1)?;
    let centered = xf.broadcast_sub(&mean)?;
    let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = centered.broadcast_div(&(var + eps)?.sqrt()?)?;
    normed.to_dtype(dtype)?.broadcast_mul(w)?.broadcast_add(b)
}

/// Softmax over the last dim.
pub fn softmax(x: &Tensor, mode: Mode) -> Result<Tensor> {
    match mode {
        Mode::Infer => candle_nn::ops::softmax_last_dim(&x.contiguous()?),
        Mode::Train => {
            // The max is a constant shift: detaching it leaves the gradient exact.
            let max = x.max_keepdim(D::Minus1)?.detach();
            let e = x.broadcast_sub(&max)?.exp()?;
            e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
        }
    }
}

/// Applies rotate-half RoPE (HF / GPT-NeoX layout) to `x` [B, H, T, D] with tables [B, T, D/2].
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor, mode: Mode) -> Result<Tensor> {
    match mode {
        Mode::Infer => candle_nn::rotary_emb::rope(&x.contiguous()?, cos, sin),
        Mode::Train => {
            let d = x.dim(D::Minus1)?;
            let half = d / 2;
            let cos = cos.unsqueeze(1)?; // [B, 1, T, D/2]
            let sin = sin.unsqueeze(1)?;
            let x1 = x.narrow(D::Minus1, 0, half)?;
            let x2 = x.narrow(D::Minus1, half, half)?;
            let a = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
            let b = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
            Tensor::cat(&[a, b], D::Minus1)
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// The largest |a - b| (f32 tensors): shared by the models' and kernels' unit tests.
    pub(crate) fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// The recorded RMSNorm: the same value as the graph twin, bit for bit, and the gradients of
    /// x and w within 1e-5 (f32) through a weighted sum; no weight gradient when it is frozen;
    /// bf16 within bf16 rounding.
    #[test]
    fn recomputed_rms_norm_equals_the_graph_twin_with_gradients() {
        let dev = Device::Cpu;
        let x = candle_core::Var::randn(0f32, 1.0, (2, 3, 8), &dev).unwrap();
        let w = candle_core::Var::randn(1f32, 0.2, 8, &dev).unwrap();
        let c = Tensor::randn(0f32, 1.0, (2, 3, 8), &dev).unwrap();
        let want = rms_norm_diff(&x, &w, 1e-5).unwrap();
        let got = rms_norm_recomputed(&x, &w, 1e-5).unwrap();
        assert_eq!(
            want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            got.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
        let gw = (&want * &c).unwrap().sum_all().unwrap().backward().unwrap();
        let gg = (&got * &c).unwrap().sum_all().unwrap().backward().unwrap();
        for v in [&x, &w] {
            let d = max_abs_diff(gw.get(v).unwrap(), gg.get(v).unwrap());
            assert!(d < 1e-5, "{d}");
        }
        let frozen = w.as_tensor().detach();
        let g = rms_norm_recomputed(&x, &frozen, 1e-5)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        assert!(g.get(&x).is_some() && g.get(&frozen).is_none());
        let bf = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
        let yb = rms_norm_recomputed(&bf(&x), &bf(&w), 1e-5).unwrap();
        let gb = (yb.to_dtype(DType::F32).unwrap() * &c)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let d = max_abs_diff(gb.get(&x).unwrap(), gw.get(&x).unwrap());
        assert!(d < 5e-2, "bf16 dx {d}");
    }
}
