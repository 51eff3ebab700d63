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
//!
//! ZeRO-3 ([`checkpoint_sharded`]): a block whose parameters live elsewhere ([`BlockParams`],
//! sharded over ranks) is fetched whole for its forward and again for its recomputation, and
//! the recomputation's parameter gradients are handed back right away, so that one block's
//! whole parameters are alive at a time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Result, Tensor, TensorId, Var};

use crate::kernels::grad_sink::GradSink;
use crate::kernels::Compute;

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

    /// The tracked scalar every checkpointed op is recorded over (see the module doc).
    pub(crate) fn anchor(&self) -> &Var {
        &self.anchor
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

/// The parameters of a model's blocks when they live elsewhere (sharded over ranks: ZeRO-3):
/// fetched whole for each use, their gradients handed back after each block's backward.
pub trait BlockParams: Send + Sync + std::fmt::Debug {
    /// Block `i`'s parameters, whole, by checkpoint name
    /// (`model.layers.{i}.self_attn.q_proj.weight`, ...), f32, not tracking gradients. Every
    /// rank calls it at the same points (it may be a collective).
    fn gather(&self, i: usize) -> Result<HashMap<String, Tensor>>;
    /// The gradients of block `i`'s parameters from one recomputed backward, by the names
    /// `gather` gave (f32; every name present). Every rank calls it at the same points.
    fn gradients(&self, i: usize, grads: HashMap<String, Tensor>) -> Result<()>;
}

/// The block index of a Llama-family checkpoint name `model.layers.{i}.…`, else `None`.
pub fn block_of(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("model.layers.")?;
    let (i, tail) = rest.split_once('.')?;
    let digits = !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit());
    if !digits || tail.is_empty() {
        return None;
    }
    i.parse().ok()
}

/// Runs a block built from its parameters (by checkpoint name, in the model's storage dtype) on
/// its input; projection weights' gradients go to the sink where one is given and holds them.
type ShardedFn =
    dyn Fn(HashMap<String, Tensor>, Option<&GradSink>, &Tensor) -> Result<Tensor> + Send + Sync;

/// Block `i` of a model whose blocks' parameters come from `params` (ZeRO-3), checkpointed: the
/// forward gathers the parameters, runs `block` over them (detached, no graph) and drops them;
/// the backward gathers them again as fresh `Var`s, recomputes with a graph (the cast to `dtype`,
/// the model's storage dtype, part of it) and hands every parameter's f32 gradient to
/// [`BlockParams::gradients`]. `compute` is the model's: under the fused CPU code (or a GPU's
/// kernels) the recomputed projections put their weight gradients into a gradient sink of
/// their own, which is read here, so the trainer needs none for the blocks.
pub fn checkpoint_sharded(
    x: &Tensor,
    grads: &Arc<CheckpointGrads>,
    params: &Arc<dyn BlockParams>,
    i: usize,
    compute: Compute,
    dtype: DType,
    block: impl Fn(HashMap<String, Tensor>, Option<&GradSink>, &Tensor) -> Result<Tensor>
        + Send
        + Sync
        + 'static,
) -> Result<Tensor> {
    let y = {
        let cast = params
            .gather(i)?
            .into_iter()
            .map(|(n, t)| Ok((n, t.detach().to_dtype(dtype)?)))
            .collect::<Result<HashMap<_, _>>>()?;
        block(cast, None, &x.detach())?.detach() // [B, T, H]; the parameters dropped here
    };
    let op = ShardedBlock {
        block: Arc::new(block),
        params: params.clone(),
        i,
        compute,
        dtype,
    };
    crate::kernels::portable::recompute::attach(&y, &[x, grads.anchor().as_tensor()], Arc::new(op))
}

struct ShardedBlock {
    block: Arc<ShardedFn>,
    params: Arc<dyn BlockParams>,
    i: usize,
    compute: Compute,
    dtype: DType,
}

impl ShardedBlock {
    /// A sink for the recomputed block's projections, over `vars` and the tensors the block is
    /// built from (`cast`, parallel to `vars`); `None` where the compute has none.
    fn sink(&self, vars: &[Var], cast: &[Tensor]) -> Option<GradSink> {
        match self.compute {
            Compute::CpuFused | Compute::CpuMixed => {
                Some(GradSink::new(vars).with_bf16_matmuls(self.compute.bf16_matmuls()))
            }
            Compute::Gpu => {
                let pairs: Vec<(&Var, &Tensor)> = vars.iter().zip(cast).collect();
                Some(GradSink::on_gpu(&pairs))
            }
            Compute::Portable => None,
        }
    }

    /// The gradient of every parameter (the graph's plus the sink's), by name.
    fn collect(
        &self,
        names: &[String],
        vars: &[Var],
        g: &candle_core::backprop::GradStore,
        sink: Option<&GradSink>,
    ) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::with_capacity(names.len());
        for (n, v) in names.iter().zip(vars) {
            let sunk = match sink {
                Some(s) => s.take(v)?,
                None => None,
            };
            let grad = match (g.get(v.as_tensor()).cloned(), sunk) {
                (Some(a), Some(b)) => (a.to_dtype(DType::F32)? + b.to_dtype(DType::F32)?)?,
                (Some(a), None) | (None, Some(a)) => a.to_dtype(DType::F32)?,
                (None, None) => candle_core::bail!(
                    "block {}: the recomputed backward gave `{n}` no gradient (an op without a \
                     backward on its path?)",
                    self.i
                ),
            };
            out.insert(n.clone(), grad);
        }
        Ok(out)
    }
}

impl crate::kernels::portable::recompute::Backward for ShardedBlock {
    fn name(&self) -> &'static str {
        "sharded-checkpointed-block"
    }

    fn backward(
        &self,
        inputs: &[Tensor],
        _wanted: &[bool],
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let mut names = Vec::new();
        let mut vars = Vec::new();
        for (n, t) in self.params.gather(self.i)? {
            vars.push(Var::from_tensor(&t.detach().to_dtype(DType::F32)?)?);
            names.push(n);
        }
        let cast = vars
            .iter()
            .map(|v| v.as_tensor().to_dtype(self.dtype))
            .collect::<Result<Vec<_>>>()?;
        let sink = self.sink(&vars, &cast);
        let map: HashMap<String, Tensor> = names.iter().cloned().zip(cast).collect();
        let xin = Var::from_tensor(&inputs[0])?;
        let y = (self.block)(map, sink.as_ref(), xin.as_tensor())?; // [B, T, H]
        let g = (y * grad)?.sum_all()?.backward()?;
        let found = self.collect(&names, &vars, &g, sink.as_ref())?;
        self.params.gradients(self.i, found)?;
        Ok(vec![g.get(xin.as_tensor()).cloned(), None])
    }
}

#[cfg(test)]
mod tests {
    use super::block_of;

    #[test]
    fn block_of_reads_the_layer_index() {
        assert_eq!(block_of("model.layers.0.self_attn.q_proj.weight"), Some(0));
        assert_eq!(block_of("model.layers.17.mlp.down_proj.weight"), Some(17));
        for n in [
            "model.embed_tokens.weight",
            "model.norm.weight",
            "lm_head.weight",
            "model.layers.x.mlp.down_proj.weight",
            "model.layers.3",
            "model.layers..w",
            "transformer.h.0.attn.c_attn.weight",
        ] {
            assert_eq!(block_of(n), None, "{n}");
        }
    }
}
