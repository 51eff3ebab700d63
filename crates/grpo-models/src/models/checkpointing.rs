//! Activation (gradient) checkpointing per block: the forward keeps only each block's input and
//! output; the backward runs the block's forward again with a graph and back-propagates through
//! it. Memory drops from every intermediate of every block to two `[B, T, H]` tensors per
//! block, for one extra block forward each.
//!
//! candle has no checkpointing, and a custom op's backward can return gradients for its inputs
//! only. So the op is over (block input, `anchor`), and the gradients of the block's parameters
//! found by the recomputation go to a side store ([`CheckpointGrads`]) that the trainer adds to
//! candle's gradients, like the gradient sink's accumulators (projections attached to a
//! [`crate::kernels::grad_sink::GradSink`] write there directly, recomputed or not). `anchor` is a
//! tracked scalar that makes the op record a backward even when the block input does not track
//! gradients (LoRA: the first block's input comes from the frozen embedding).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Result, Tensor, TensorId, Var};

type BlockFn = dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync;

/// Where recomputed blocks put their parameters' gradients.
#[derive(Debug)]
pub struct CheckpointGrads {
    params: Vec<Var>,
    store: Mutex<HashMap<TensorId, Tensor>>,
    anchor: Var,
}

impl CheckpointGrads {
    /// For blocks whose trainable parameters are among `params`, on `device` (where the
    /// blocks run).
    pub fn new(params: &[Var], device: &candle_core::Device) -> Result<Arc<Self>> {
        Ok(Arc::new(Self {
            params: params.to_vec(),
            store: Mutex::new(HashMap::new()),
            anchor: Var::zeros((), DType::F32, device)?,
        }))
    }

    /// The gradient accumulated for `var` by recomputed blocks since the last `take`.
    pub fn take(&self, var: &Var) -> Result<Option<Tensor>> {
        let mut s = self
            .store
            .lock()
            .map_err(|_| candle_core::Error::Msg("checkpoint gradients poisoned".into()))?;
        Ok(s.remove(&var.id()))
    }

    fn add(&self, grads: &candle_core::backprop::GradStore) -> Result<()> {
        let mut s = self
            .store
            .lock()
            .map_err(|_| candle_core::Error::Msg("checkpoint gradients poisoned".into()))?;
        for p in &self.params {
            if let Some(g) = grads.get(p.as_tensor()) {
                let sum = match s.remove(&p.id()) {
                    Some(acc) => (acc + g)?,
                    None => g.clone(),
                };
                s.insert(p.id(), sum);
            }
        }
        Ok(())
    }
}

/// `block(x)`, keeping no intermediate of it for the backward (see the module doc). Any device
/// and dtype (the result is recorded with [`crate::kernels::portable::recompute::attach`]).
pub fn checkpoint(
    x: &Tensor,
    grads: &Arc<CheckpointGrads>,
    block: impl Fn(&Tensor) -> Result<Tensor> + Send + Sync + 'static,
) -> Result<Tensor> {
    // Run the block without a graph to keep: its intermediates are freed when `y` is detached.
    let y = block(&x.detach())?.detach();
    let op = Checkpointed {
        block: Arc::new(block),
        grads: grads.clone(),
    };
    crate::kernels::portable::recompute::attach(&y, &[x, grads.anchor.as_tensor()], Arc::new(op))
}

struct Checkpointed {
    block: Arc<BlockFn>,
    grads: Arc<CheckpointGrads>,
}

impl crate::kernels::portable::recompute::Backward for Checkpointed {
    fn name(&self) -> &'static str {
        "checkpointed-block"
    }

    fn backward(
        &self,
        inputs: &[Tensor],
        _wanted: &[bool],
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let xin = Var::from_tensor(&inputs[0])?;
        let y = (self.block)(xin.as_tensor())?;
        let g = (y * grad)?.sum_all()?.backward()?;
        self.grads.add(&g)?;
        Ok(vec![g.get(xin.as_tensor()).cloned(), None])
    }
}
