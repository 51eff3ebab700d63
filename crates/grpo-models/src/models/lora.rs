//! A LoRA adapter on one projection: `y = base(x) + scale * dropout(x) A^T B^T`, with
//! `A` [r, in] and `B` [out, r] (PEFT's `lora_A` / `lora_B` weights, same layout), always f32.
//!
//! Adapters are attached to a built model ([`super::CausalLm::set_lora`]); the base weights are
//! untouched, so the same base serves as the frozen reference with adapters off.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::{DType, Result, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::kernels::portable::recompute::{attach, Backward};
use crate::seeding::mix_seed;

/// Inverted dropout on the adapter's input, seeded: the mask is a function of (seed, clock)
/// only, where `clock` is shared by all adapters of a model and advanced by the trainer once per
/// forward pass. So a resumed run draws the same masks, and a block recomputed by gradient
/// checkpointing during the same pass draws the mask its forward drew.
#[derive(Debug, Clone)]
pub struct LoraDropout {
    pub p: f32,
    pub seed: u64,
    clock: Arc<AtomicU64>,
}

impl LoraDropout {
    pub fn new(p: f32, seed: u64, clock: Arc<AtomicU64>) -> Self {
        Self { p, seed, clock }
    }
}

#[derive(Debug, Clone)]
pub struct LoraAdapter {
    /// [r, in]
    a: Tensor,
    /// [out, r]
    b: Tensor,
    scale: f64,
    dropout: Option<LoraDropout>,
}

impl LoraAdapter {
    pub fn new(a: Tensor, b: Tensor, scale: f64, dropout: Option<LoraDropout>) -> Result<Self> {
        let (r, _) = a.dims2()?;
        let (_, rb) = b.dims2()?;
        if r != rb {
            candle_core::bail!("lora_A has rank {r} but lora_B has {rb}");
        }
        Ok(Self {
            a,
            b,
            scale,
            dropout: dropout.filter(|d| d.p > 0.0),
        })
    }
    /// (in, out)
    pub fn dims(&self) -> Result<(usize, usize)> {
        Ok((self.a.dim(1)?, self.b.dim(0)?))
    }
    pub fn a(&self) -> &Tensor {
        &self.a
    }
    pub fn b(&self) -> &Tensor {
        &self.b
    }
    pub fn scale(&self) -> f64 {
        self.scale
    }
    /// Whether the adapter drops out its input (a training model's adapter).
    pub fn has_dropout(&self) -> bool {
        self.dropout.is_some()
    }

    /// `scale * B A` [out, in]: what merging adds to the base weight (HF layout).
    pub fn delta_weight(&self) -> Result<Tensor> {
        self.b.matmul(&self.a)? * self.scale
    }

    /// `x` [.., in] -> the adapter's contribution [.., out]. Under a graph and without dropout,
    /// one recorded node ([`LoraBackward`]) with the same values and gradients.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let tracked = x.track_op() || self.a.track_op() || self.b.track_op();
        if self.dropout.is_none() && tracked {
            let (a, b) = (self.a.detach(), self.b.detach());
            let y = Self::new(a, b, self.scale, None)?.forward_graph(&x.detach())?; // [.., out]
            let bwd = Arc::new(LoraBackward { scale: self.scale });
            return attach(&y, &[x, &self.a, &self.b], bwd);
        }
        self.forward_graph(x)
    }

    /// [`Self::forward`] as candle ops (autograd's graph, with dropout).
    fn forward_graph(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let (i, o) = self.dims()?;
        let rows = x.elem_count() / i;
        let mut x2 = x.reshape((rows, i))?.to_dtype(DType::F32)?; // [N, in]
        if let Some(d) = &self.dropout {
            let tick = d.clock.load(Ordering::Relaxed);
            let mut rng = ChaCha8Rng::seed_from_u64(mix_seed(d.seed, tick));
            let keep = 1.0 / (1.0 - d.p);
            let mask: Vec<f32> = (0..rows * i)
                .map(|_| if rng.random::<f32>() < d.p { 0.0 } else { keep })
                .collect();
            x2 = (x2 * Tensor::from_vec(mask, (rows, i), x.device())?)?;
        }
        let h = x2.matmul(&self.a.t()?)?; // [N, r]
        let y = (h.matmul(&self.b.t()?)? * self.scale)?; // [N, out]
        let mut shape = dims;
        if let Some(last) = shape.last_mut() {
            *last = o;
        }
        y.reshape(shape)?.to_dtype(x.dtype())
    }
}

/// An adapter's backward without dropout, recomputing `x A^T` from the input: autograd's graph
/// of [`LoraAdapter::forward`] keeps, per token, the input's f32 copy, `x A^T B^T` and its scaled
/// copy, and the f32 result, ~(in + 3 out) floats per adapted projection (an 8B model's
/// all-linear adapters, ~20 MB a token over its 32 layers); this node keeps its output alone.
/// Its products are the ones autograd forms, in the same order and layouts, so the gradients
/// are the same bits.
struct LoraBackward {
    scale: f64,
}

impl Backward for LoraBackward {
    fn name(&self) -> &'static str {
        "lora"
    }

    fn backward(
        &self,
        inputs: &[Tensor],
        wanted: &[bool],
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let [x, a, b] = inputs else {
            candle_core::bail!("lora backward: x, A and B expected");
        };
        let (i, o) = (a.dim(1)?, b.dim(0)?);
        let rows = x.elem_count() / i;
        let (at, bt) = (a.t()?, b.t()?); // [in, r], [r, out]
        let x2 = x.reshape((rows, i))?.to_dtype(DType::F32)?; // [N, in]
        let h = x2.matmul(&at)?; // [N, r]
        let g = grad
            .to_dtype(DType::F32)?
            .reshape((rows, o))?
            .affine(self.scale, 0.)?; // [N, out]
        let db = wanted[2].then(|| h.t()?.matmul(&g)?.t()).transpose()?; // [out, r]
        let dh = g.matmul(&bt.t()?)?; // [N, r]
        let da = wanted[1].then(|| x2.t()?.matmul(&dh)?.t()).transpose()?; // [r, in]
        let dx = match wanted[0] {
            true => Some(
                dh.matmul(&at.t()?)?
                    .to_dtype(x.dtype())?
                    .reshape(x.dims())?,
            ), // [.., in]
            false => None,
        };
        Ok(vec![dx, da, db])
    }
}

/// What the fused CPU decoding step reads of an adapter.
impl crate::kernels::cpu::decode::LowRank for LoraAdapter {
    fn a(&self) -> &Tensor {
        LoraAdapter::a(self)
    }
    fn b(&self) -> &Tensor {
        LoraAdapter::b(self)
    }
    fn scale(&self) -> f64 {
        LoraAdapter::scale(self)
    }
    fn has_dropout(&self) -> bool {
        LoraAdapter::has_dropout(self)
    }
    fn dims(&self) -> Result<(usize, usize)> {
        LoraAdapter::dims(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn recorded_backward_gives_autograds_gradients_bit_for_bit() {
        use candle_core::Var;
        let dev = Device::Cpu;
        let rnd = crate::kernels::cpu::gemm_bf16::test_values;
        for dt in [DType::F32, DType::BF16] {
            let (i, o, r, rows) = (24, 40, 4, 10);
            let a = Var::from_vec(rnd(r * i, 1), (r, i), &dev).unwrap();
            let b = Var::from_vec(rnd(o * r, 2), (o, r), &dev).unwrap();
            let x = Var::from_tensor(
                &Tensor::from_vec(rnd(rows * i, 3), (2, rows / 2, i), &dev)
                    .unwrap()
                    .to_dtype(dt)
                    .unwrap(),
            )
            .unwrap();
            let gy = Tensor::from_vec(rnd(rows * o, 4), (2, rows / 2, o), &dev)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            let ad =
                LoraAdapter::new(a.as_tensor().clone(), b.as_tensor().clone(), 1.5, None).unwrap();
            let grads = |recorded: bool| {
                let y = match recorded {
                    true => ad.forward(x.as_tensor()).unwrap(),
                    false => ad.forward_graph(x.as_tensor()).unwrap(),
                };
                let loss = (y * &gy)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .sum_all()
                    .unwrap();
                let g = loss.backward().unwrap();
                [x.as_tensor(), a.as_tensor(), b.as_tensor()].map(|t| {
                    let v = g.get(t).unwrap().to_dtype(DType::F32).unwrap();
                    v.flatten_all().unwrap().to_vec1::<f32>().unwrap()
                })
            };
            let (rec, graph) = (grads(true), grads(false));
            for (k, (p, q)) in rec.iter().zip(&graph).enumerate() {
                assert!(
                    p.iter().any(|v| *v != 0.0),
                    "{dt:?} input {k}: zero gradient"
                );
                let same = p.iter().zip(q).all(|(u, v)| u.to_bits() == v.to_bits());
                assert!(same, "{dt:?} input {k}: the gradients differ");
            }
        }
    }

    #[test]
    fn forward_is_scale_x_at_bt_and_dropout_is_seeded() {
        let dev = Device::Cpu;
        let a = Tensor::from_vec(vec![1f32, 0., 2., 0., 1., 1.], (2, 3), &dev).unwrap();
        let b = Tensor::from_vec(vec![1f32, 2., 0., 1.], (2, 2), &dev).unwrap();
        let ad = LoraAdapter::new(a.clone(), b.clone(), 0.5, None).unwrap();
        let x = Tensor::from_vec(vec![1f32, 2., 3.], (1, 1, 3), &dev).unwrap();
        // x A^T = [1 + 6, 2 + 3] = [7, 5]; (x A^T) B^T = [7 + 10, 5] = [17, 5]; x 0.5
        let y = ad
            .forward(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(y, vec![8.5, 2.5]);
        let dw = ad.delta_weight().unwrap();
        let y2 = x.reshape((1, 3)).unwrap().matmul(&dw.t().unwrap()).unwrap();
        assert_eq!(y2.flatten_all().unwrap().to_vec1::<f32>().unwrap(), y);

        let x = Tensor::ones((64, 3), DType::F32, &dev).unwrap();
        let run = |seed| {
            let clock = Arc::new(AtomicU64::new(0));
            let d = LoraDropout::new(0.5, seed, clock.clone());
            let ad = LoraAdapter::new(a.clone(), b.clone(), 1.0, Some(d)).unwrap();
            let first = ad.forward(&x).unwrap().to_vec2::<f32>().unwrap();
            let again = ad.forward(&x).unwrap().to_vec2::<f32>().unwrap();
            clock.fetch_add(1, Ordering::Relaxed);
            let next = ad.forward(&x).unwrap().to_vec2::<f32>().unwrap();
            assert_eq!(first, again, "the same tick draws the same mask");
            (first, next)
        };
        let (r1, r2) = run(7);
        assert_eq!(run(7), (r1.clone(), r2.clone()), "same seed, same masks");
        assert_ne!(r1, r2, "each tick draws a new mask");
        assert_ne!(run(8).0, r1);
    }
}
