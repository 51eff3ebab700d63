//! A result computed outside candle's graph, recorded in it with a backward written in candle
//! ops: the memory plan of FlashAttention, of fused linear + log-softmax losses and of
//! activation checkpointing, on every device candle runs on.
//!
//! candle's autograd keeps every intermediate of a differentiable forward until the backward.
//! Where that is most of the memory (attention's `[B, H, T, T]` scores, the LM head's
//! `[tokens, vocab]` logits, a whole block's activations), a layer instead computes its result
//! without a graph, keeps the few statistics its backward needs, and records the result with
//! [`attach`] as one node over its inputs. The node's forward copies the result (on the CPU or
//! a CUDA device: no kernel of its own), its backward is the layer's [`Backward`], which
//! recomputes what it needs chunk by chunk in ordinary candle ops. So the portable path on the
//! CPU (CI) runs exactly what a GPU runs.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

/// The backward of a result recorded with [`attach`].
pub trait Backward: Send + Sync {
    /// The op's name in candle's errors.
    fn name(&self) -> &'static str;

    /// The gradients of `inputs` (detached, in the order given to [`attach`]) given `out` (the
    /// recorded result, detached) and `grad`, the gradient of `out`. `wanted[i]` says whether
    /// input `i` takes part in the graph; an unwanted gradient may be left `None` (it is
    /// dropped either way).
    fn backward(
        &self,
        inputs: &[Tensor],
        wanted: &[bool],
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>>;
}

/// `out` (computed without a graph from `inputs`, 1 to 3 of them, all on `out`'s device) as a
/// node of the graph whose backward is `bwd`. When no input tracks a gradient, `out` is returned
/// as it is.
pub fn attach(out: &Tensor, inputs: &[&Tensor], bwd: Arc<dyn Backward>) -> Result<Tensor> {
    let out = out.detach();
    if !inputs.iter().any(|t| t.track_op()) {
        return Ok(out);
    }
    let op = Recorded {
        out: std::sync::Mutex::new(Some(out.contiguous()?)),
        bwd,
    };
    match inputs {
        [a] => a.apply_op1_arc(Arc::new(Box::new(op))),
        [a, b] => a.apply_op2_arc(b, Arc::new(Box::new(op))),
        [a, b, c] => a.apply_op3_arc(b, c, Arc::new(Box::new(op))),
        _ => candle_core::bail!(
            "recompute::attach takes 1 to 3 inputs, got {}",
            inputs.len()
        ),
    }
}

struct Recorded {
    /// The result, contiguous, until the forward copies it into the node (then dropped: the
    /// graph holds the node's own copy).
    out: std::sync::Mutex<Option<Tensor>>,
    bwd: Arc<dyn Backward>,
}

impl Recorded {
    /// The result, taken: candle runs an op's forward once.
    fn take_out(&self) -> Result<Tensor> {
        let taken = match self.out.lock() {
            Ok(mut o) => o.take(),
            Err(_) => None,
        };
        taken.ok_or_else(|| {
            candle_core::Error::Msg(format!("{}: forward ran twice", self.bwd.name()))
        })
    }

    fn cpu_out(&self) -> Result<(CpuStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let out = self.take_out()?;
        let (s, l) = out.storage_and_layout();
        let candle_core::Storage::Cpu(c) = &*s else {
            candle_core::bail!("{}: the result is not on the CPU", self.bwd.name());
        };
        let (o, n) = (l.start_offset(), l.shape().elem_count());
        macro_rules! cut {
            ($($v:ident),*) => {
                match c {
                    $(CpuStorage::$v(x) => CpuStorage::$v(x[o..o + n].to_vec()),)*
                    _ => candle_core::bail!("{}: unsupported dtype {:?}", self.bwd.name(), c.dtype()),
                }
            };
        }
        Ok((cut!(F32, BF16, F16, F64, U32, U8, I64), l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_out(&self) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let out = self.take_out()?;
        let (s, l) = out.storage_and_layout();
        let candle_core::Storage::Cuda(c) = &*s else {
            candle_core::bail!("{}: the result is not on the GPU", self.bwd.name());
        };
        Ok((c.try_clone(l)?, l.shape().clone()))
    }

    fn grads(&self, args: &[&Tensor], res: &Tensor, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let inputs: Vec<Tensor> = args.iter().map(|a| a.detach()).collect();
        let wanted: Vec<bool> = args.iter().map(|a| a.track_op()).collect();
        let mut g = self
            .bwd
            .backward(&inputs, &wanted, &res.detach(), &grad.detach())?;
        if g.len() != args.len() {
            candle_core::bail!(
                "{}: {} gradients for {} inputs",
                self.bwd.name(),
                g.len(),
                args.len()
            );
        }
        for (g, w) in g.iter_mut().zip(&wanted) {
            if !w {
                *g = None;
            }
        }
        Ok(g)
    }
}

impl CustomOp1 for Recorded {
    fn name(&self) -> &'static str {
        self.bwd.name()
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.cpu_out()
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda_out()
    }
    fn bwd(&self, a: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(self.grads(&[a], res, grad)?.remove(0))
    }
}

impl CustomOp2 for Recorded {
    fn name(&self) -> &'static str {
        self.bwd.name()
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu_out()
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda_out()
    }
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let mut g = self.grads(&[a, b], res, grad)?.into_iter();
        Ok((g.next().flatten(), g.next().flatten()))
    }
}

impl CustomOp3 for Recorded {
    fn name(&self) -> &'static str {
        self.bwd.name()
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu_out()
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda_out()
    }
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut g = self.grads(&[a, b, c], res, grad)?.into_iter();
        Ok((g.next().flatten(), g.next().flatten(), g.next().flatten()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// `y = x * w` (elementwise) with its backward by hand: the recorded node gives candle's
    /// own gradients, an untracked input gets none, and no input tracking gives a plain tensor.
    struct Mul;
    impl Backward for Mul {
        fn name(&self) -> &'static str {
            "test-mul"
        }
        fn backward(
            &self,
            inputs: &[Tensor],
            _wanted: &[bool],
            _out: &Tensor,
            grad: &Tensor,
        ) -> Result<Vec<Option<Tensor>>> {
            Ok(vec![Some((grad * &inputs[1])?), Some((grad * &inputs[0])?)])
        }
    }

    #[test]
    fn a_recorded_result_back_propagates_like_candles_own_ops() {
        let dev = Device::Cpu;
        let x = Var::randn(0f32, 1.0, (3, 4), &dev).unwrap();
        let w = Var::randn(0f32, 1.0, (3, 4), &dev).unwrap();
        let want = (x.as_tensor() * w.as_tensor()).unwrap();
        let y = attach(&want.detach(), &[&x, &w], Arc::new(Mul)).unwrap();
        assert!(y.track_op());
        assert_eq!(y.to_vec2::<f32>().unwrap(), want.to_vec2::<f32>().unwrap());
        let loss = y.sqr().unwrap().sum_all().unwrap();
        let g = loss.backward().unwrap();
        let g_ref = want.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        for v in [&x, &w] {
            assert_eq!(
                g.get(v).unwrap().to_vec2::<f32>().unwrap(),
                g_ref.get(v).unwrap().to_vec2::<f32>().unwrap()
            );
        }
        // A frozen second input: no gradient for it.
        let frozen = w.as_tensor().detach();
        let y = attach(&want.detach(), &[&x, &frozen], Arc::new(Mul)).unwrap();
        let g = y.sum_all().unwrap().backward().unwrap();
        assert!(g.get(&x).is_some() && g.get(&frozen).is_none());
        // Nothing tracks: the result comes back as a plain tensor.
        let y = attach(&want.detach(), &[&frozen], Arc::new(Mul)).unwrap();
        assert!(!y.track_op());
    }

    #[test]
    fn a_view_with_an_offset_is_recorded_as_its_own_elements() {
        let dev = Device::Cpu;
        let x = Var::randn(0f32, 1.0, (6, 2), &dev).unwrap();
        let base = Tensor::arange(0f32, 12.0, &dev)
            .unwrap()
            .reshape((6, 2))
            .unwrap();
        let view = base.narrow(0, 2, 3).unwrap(); // offset 4, 6 of 12 elements
        let xs = x.as_tensor().narrow(0, 0, 3).unwrap();
        let y = attach(&view, &[&xs, &xs], Arc::new(Mul)).unwrap();
        assert_eq!(y.to_vec2::<f32>().unwrap(), view.to_vec2::<f32>().unwrap());
    }
}
