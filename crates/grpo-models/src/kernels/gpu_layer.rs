//! A plain Llama decoder layer's training forward on a GPU as one recorded op: RMSNorm, q/k/v,
//! RoPE, attention, o_proj, the residual add, RMSNorm, the MLP and the second residual add run
//! as grpo's kernels and cuBLAS GEMMs without a graph, and the whole layer is one node of
//! candle's graph ([`crate::kernels::portable::recompute::attach`]) whose backward runs the same kernels' backward
//! in reverse. Only the layer's input gradient and its two norm weights' gradients go through
//! candle's gradient store; the projections' weight gradients go into their GPU sinks
//! ([`crate::kernels::grad_sink`]), as the MLP op's do.
//!
//! Why: through candle's graph a layer's gradient plumbing costs as much again as its kernels:
//! every node's gradient is a zero-filled tensor plus an add, every view a copy, q, k and v
//! three input-gradient GEMMs summed by adds (measurements: bench/README.md, "Where the
//! kernels' numbers came from").
//!
//! It takes what the kernels take: no bias, adapter, q/k norm, softcapping, partial RoPE or
//! sandwich norm (the caller checks), SiLU gating, a dense mask, and head sizes the attention
//! kernels have.
//!
//! **On by default where its check passes; `GRPO_GPU_LAYER=graph` turns it off.** Before a
//! model's first training layer runs as the op, [`check_dtype`] compares it with candle ops on
//! a random layer of the model's own sizes in the model's dtype (once per process, shape and
//! dtype); where that fails, a warning names the tensors that differ and the layers run through
//! candle's graph. The check passes a causal mask, as training does: its reference, candle's
//! chunked attention, leaves causality inside a chunk of queries to the mask, where the kernels
//! are causal whatever the mask says. On the CPU the op's attention runs the kernels' twins
//! ([`crate::kernels::cuda::twin_forward`]), which are causal as the kernels are.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use candle_core::{DType, Device, Result, Tensor, Var};

use crate::kernels::grad_sink::{sink_backward, GradSink, SinkProj};
use crate::kernels::portable::recompute::{attach, Backward};
use crate::kernels::Compute;

/// A plain Llama layer's parts, as the op runs them.
#[derive(Clone)]
pub struct GpuLayer {
    /// q, k and v side by side ([N, H] -> [N, (heads + 2 kv_heads) D]).
    pub qkv: SinkProj,
    pub o: SinkProj,
    /// gate, then up ([N, H] -> [N, 2I]).
    pub gate_up: SinkProj,
    pub down: SinkProj,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// The score scale.
    pub scale: f64,
    /// The input norm's and the post-attention norm's epsilons.
    pub eps_in: f64,
    pub eps_post: f64,
}

impl GpuLayer {
    /// The layer over `x` [B, S, H] (a graph input, as are the norms' weights `w_in` and
    /// `w_post` [H], in `x`'s dtype), RoPE tables `cos`/`sin` [B, S, D/2] and the additive
    /// `mask` [B, 1, S, S] f32 (causal on top) -> [B, S, H]; `None` where the kernels do not
    /// take the shapes (the caller runs candle's graph; RoPE's and attention's shapes are known
    /// only after the q/k/v product). On the CPU (f32) the same composition runs with
    /// candle ops in the kernels' places ([`prim`]): what CI checks it with.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        x: &Tensor,
        w_in: &Tensor,
        w_post: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Tensor,
    ) -> Result<Option<Tensor>> {
        match self.forward_parts(x, w_in, w_post, cos, sin, mask)? {
            Some((out, bwd)) => Ok(Some(attach(&out, &[x, w_in, w_post], Arc::new(bwd))?)),
            None => Ok(None),
        }
    }

    /// [`Self::forward`]'s output before it is recorded, with what its backward keeps.
    #[allow(clippy::too_many_arguments)]
    fn forward_parts(
        &self,
        x: &Tensor,
        w_in: &Tensor,
        w_post: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Tensor,
    ) -> Result<Option<(Tensor, LayerBackward)>> {
        let (b, s, hid) = x.dims3()?;
        let (nh, nkv, d) = (self.heads, self.kv_heads, self.head_dim);
        let dt = x.dtype();
        let n = b * s;
        let takes = prim::takes(x)
            && w_in.dtype() == dt
            && w_post.dtype() == dt
            && w_in.dims() == [hid]
            && w_post.dims() == [hid]
            && cos.dims() == [b, s, d / 2]
            && mask.dims().len() == 4
            && mask.dim(3)? == s;
        if !takes {
            return Ok(None);
        }
        let (xd, wi, wp) = (x.detach().contiguous()?, w_in.detach(), w_post.detach());
        let h1 = prim::norm(&xd, &wi, self.eps_in)?; // [B, S, H]
        let width = (nh + 2 * nkv) * d;
        let qkv = h1
            .reshape((n, hid))?
            .apply_op1_no_bwd(&self.qkv)?
            .reshape((b, s, width))?; // [B, S, (H + 2 Hkv) D]
        drop(h1);
        let Some((q, cos, sin)) = prim::rope(&qkv.narrow(2, 0, nh * d)?, cos, sin, nh)? else {
            return Ok(None);
        }; // [B, H, S, D]
        let Some((kr, _, _)) = prim::rope(&qkv.narrow(2, nh * d, nkv * d)?, &cos, &sin, nkv)?
        else {
            return Ok(None);
        }; // [B, Hkv, S, D]
        let v = qkv
            .narrow(2, (nh + nkv) * d, nkv * d)?
            .contiguous()?
            .reshape((b, s, nkv, d))?
            .transpose(1, 2)?
            .contiguous()?; // [B, Hkv, S, D]
        drop(qkv);
        let Some((o, saved)) = prim::attention(&q, &kr, &v, mask, self.scale)? else {
            return Ok(None);
        }; // [B, H, S, D]
        let y = heads_to_rows(&o)?; // [N, H*D]
        let a = y.apply_op1_no_bwd(&self.o)?; // [N, H]
        drop(y);
        let x1 = (xd.reshape((n, hid))? + a)?; // [N, H]
        let h2 = prim::norm(&x1, &wp, self.eps_post)?; // [N, H]
        let gu = h2.apply_op1_no_bwd(&self.gate_up)?; // [N, 2I]
        drop(h2);
        let m = prim::swiglu(&gu)?.apply_op1_no_bwd(&self.down)?; // [N, H]
        let out = (&x1 + m)?.reshape((b, s, hid))?;
        let bwd = LayerBackward {
            layer: self.clone(),
            cos,
            sin,
            q,
            k: kr,
            v,
            o,
            saved,
            x1,
            gu,
        };
        Ok(Some((out, bwd)))
    }
}

/// Attention's output [B, H, S, D] as rows [B*S, H*D], contiguous (a copy).
fn heads_to_rows(o: &Tensor) -> Result<Tensor> {
    let (b, h, s, d) = o.dims4()?;
    o.transpose(1, 2)?.contiguous()?.reshape((b * s, h * d))
}

/// What the layer's backward keeps from its forward: the rotated queries and keys, the values
/// and attention's output (each [B, heads, S, D]) with what attention's backward takes, the
/// residual stream after attention and the gate/up output (each [N, ..]). The two norms'
/// outputs, o_proj's input and the activation are recomputed from them (a kernel or a copy
/// each).
struct LayerBackward {
    layer: GpuLayer,
    /// [B, S, D/2], contiguous.
    cos: Tensor,
    sin: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    saved: prim::Saved,
    /// [N, H].
    x1: Tensor,
    /// [N, 2I].
    gu: Tensor,
}

impl Backward for LayerBackward {
    fn name(&self) -> &'static str {
        "gpu-llama-layer"
    }

    /// The MLP block's backward (as the MLP op's), the post-attention norm's, o_proj's,
    /// attention's, RoPE's, q/k/v's as one input-gradient GEMM per part into one output, and
    /// the input norm's; the residual stream's gradient adds up along the way.
    fn backward(
        &self,
        inputs: &[Tensor],
        _wanted: &[bool],
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let [x, w_in, w_post] = inputs else {
            candle_core::bail!("gpu llama layer: three inputs expected");
        };
        let l = &self.layer;
        let (b, s, hid) = x.dims3()?;
        let (nh, nkv, d) = (l.heads, l.kv_heads, l.head_dim);
        let n = b * s;
        let dt = x.dtype();
        let dout = grad.to_dtype(dt)?.contiguous()?.reshape((n, hid))?; // [N, H]
                                                                        // The MLP block: dA = dY W_down, dGU = swiglu'(GU) dA, dH2 = dGU W_gate_up.
        let act = prim::swiglu(&self.gu)?; // [N, I], as in the forward
        let da = sink_backward(&l.down, &act, &dout)?; // [N, I]
        drop(act);
        let dgu = prim::swiglu_backward(&self.gu, &da)?; // [N, 2I]
        drop(da);
        let h2 = prim::norm(&self.x1, w_post, l.eps_post)?; // [N, H]
        let dh2 = sink_backward(&l.gate_up, &h2, &dgu)?; // [N, H]
        drop((dgu, h2));
        let (dx1_norm, dw_post) = prim::norm_backward(&self.x1, w_post, &dh2, l.eps_post)?;
        let dx1 = (dout + dx1_norm)?; // [N, H]: the residual stream after attention
                                      // o_proj, then attention.
        let dy = sink_backward(&l.o, &heads_to_rows(&self.o)?, &dx1)?; // [N, H*D]
        let d_o = dy.reshape((b, s, nh, d))?.transpose(1, 2)?.contiguous()?; // [B, H, S, D]
        drop(dy);
        let (dq, dk, dv) = self
            .saved
            .backward(&self.q, &self.k, &self.v, &self.o, &d_o)?;
        drop(d_o);
        // RoPE's backward, and q, k, v side by side as the joined projection's output.
        let dq = prim::rope_backward(&dq, &self.cos, &self.sin, dt)?; // [B, S, H*D]
        let dk = prim::rope_backward(&dk, &self.cos, &self.sin, dt)?; // [B, S, Hkv*D]
        let dv = dv.transpose(1, 2)?.contiguous()?.reshape((b, s, nkv * d))?; // [B, S, Hkv*D]
        let dqkv = Tensor::cat(&[&dq, &dk, &dv], 2)?.reshape((n, (nh + 2 * nkv) * d))?;
        drop((dq, dk, dv));
        let x = x.contiguous()?.reshape((n, hid))?; // [N, H]
        let h1 = prim::norm(&x, w_in, l.eps_in)?; // [N, H]
        let dh1 = sink_backward(&l.qkv, &h1, &dqkv)?; // [N, H]
        drop((dqkv, h1));
        let (dx_norm, dw_in) = prim::norm_backward(&x, w_in, &dh1, l.eps_in)?;
        let dx = (dx1 + dx_norm)?.reshape((b, s, hid))?;
        // (recompute::attach drops the gradient of an input that takes no part in the graph.)
        Ok(vec![Some(dx), Some(dw_in), Some(dw_post)])
    }
}

/// The op's pieces: grpo's GPU kernels on a GPU; on the CPU (f32, for checking the op's
/// composition in CI) candle ops, each backward by candle's autograd over its own forward.
mod prim {
    use candle_core::{Result, Tensor, Var};

    use crate::kernels::cuda::{twin_backward, twin_forward, Dims};
    use crate::kernels::portable::{apply_rope, rms_norm_diff};
    use crate::kernels::Mode;

    /// Whether the op runs on `x`'s device and dtype: grpo's kernels on a GPU (f32, bf16), or
    /// candle ops on the CPU (f32).
    pub fn takes(x: &Tensor) -> bool {
        crate::kernels::cuda::takes(x)
            || (x.device().is_cpu() && x.dtype() == candle_core::DType::F32)
    }

    /// The gradients of `inputs` of `f` given its output's gradient `g` (candle's autograd).
    fn grads_of(
        inputs: &[&Tensor],
        g: &Tensor,
        f: impl Fn(&[Tensor]) -> Result<Tensor>,
    ) -> Result<Vec<Tensor>> {
        let vars = inputs
            .iter()
            .map(|t| Var::from_tensor(&t.detach()))
            .collect::<Result<Vec<_>>>()?;
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = f(&ts)?;
        let grads = (y * g.to_dtype(ts[0].dtype())?)?.sum_all()?.backward()?;
        vars.iter()
            .map(|v| match grads.get(v.as_tensor()) {
                Some(t) => Ok(t.clone()),
                None => v.zeros_like(),
            })
            .collect()
    }

    /// RMSNorm of `x` [.., H] by `w` [H] (no graph).
    pub fn norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return crate::kernels::cuda::rms_norm_raw(x, w, eps);
        }
        rms_norm_diff(&x.detach(), &w.detach(), eps)
    }

    /// RMSNorm's backward: the gradients of `x` and `w` from the output's `g`.
    pub fn norm_backward(x: &Tensor, w: &Tensor, g: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return crate::kernels::cuda::rms_norm_backward(x, w, g, eps);
        }
        let mut gs = grads_of(&[x, w], g, |t| rms_norm_diff(&t[0], &t[1], eps))?;
        let dw = gs.pop();
        match (gs.pop(), dw) {
            (Some(dx), Some(dw)) => Ok((dx, dw)),
            _ => candle_core::bail!("rms norm backward: two gradients expected"),
        }
    }

    /// RoPE of `x` [B, T, H*D] (a view of the joined projection) -> ([B, H, T, D], the tables
    /// contiguous), or `None` where the kernel does not take it.
    pub fn rope(
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        heads: usize,
    ) -> Result<Option<(Tensor, Tensor, Tensor)>> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return crate::kernels::cuda::rope_heads_raw(x, cos, sin, heads);
        }
        let y = rope_ops(&x.detach(), cos, sin, heads)?;
        Ok(Some((y, cos.contiguous()?, sin.contiguous()?)))
    }

    fn rope_ops(x: &Tensor, cos: &Tensor, sin: &Tensor, heads: usize) -> Result<Tensor> {
        let (b, t, hd) = x.dims3()?;
        let x = x
            .contiguous()?
            .reshape((b, t, heads, hd / heads))?
            .transpose(1, 2)?
            .contiguous()?; // [B, H, T, D]
        apply_rope(&x, cos, sin, Mode::Train)?.contiguous()
    }

    /// RoPE's backward: `g` [B, H, T, D] -> [B, T, H*D] in `dt`.
    pub fn rope_backward(
        g: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        dt: candle_core::DType,
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if g.device().is_cuda() {
            return crate::kernels::cuda::rope_backward(g, cos, sin, dt);
        }
        let (b, h, t, d) = g.dims4()?;
        let x = Tensor::zeros((b, t, h * d), dt, g.device())?;
        let mut gs = grads_of(&[&x], g, |v| rope_ops(&v[0], cos, sin, h))?;
        gs.pop()
            .ok_or_else(|| candle_core::Error::Msg("rope backward: no gradient".into()))
    }

    /// What attention's backward takes from its forward.
    pub enum Saved {
        #[cfg(feature = "cuda")]
        Gpu(crate::kernels::cuda::AttnSaved),
        /// The kernels' twins' inputs: the mask [B, S, Tk] and each query's log-sum-exp.
        Cpu {
            mask: Vec<f32>,
            lse: Vec<f32>,
            n: Dims,
            scale: f32,
        },
    }

    /// `t`'s elements in order, as f32 on the host.
    fn host(t: &Tensor) -> Result<Vec<f32>> {
        t.to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()
    }

    /// Causal attention of `q` [B, H, S, D] over `k`/`v` [B, Hkv, S, D] with the additive
    /// `mask` -> ([B, H, S, D], what the backward takes), or `None` where the kernels do not
    /// take the shapes. On the CPU the kernels' twins run ([`twin_forward`], [`twin_backward`]),
    /// not candle's chunked attention: like the kernels they are causal whatever the mask says,
    /// where the chunked attention leaves causality inside a chunk of queries to the mask.
    pub fn attention(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
        scale: f64,
    ) -> Result<Option<(Tensor, Saved)>> {
        #[cfg(feature = "cuda")]
        if q.device().is_cuda() {
            let out = crate::kernels::cuda::attention_raw(q, k, v, mask, scale)?;
            return Ok(out.map(|(o, saved)| (o, Saved::Gpu(saved))));
        }
        let (b, h, s, d) = q.dims4()?;
        let (hkv, tk) = (k.dim(1)?, k.dim(2)?);
        let n = Dims {
            b,
            h,
            hkv,
            s,
            tk,
            d,
        };
        let mask = host(&mask.broadcast_as((b, 1, s, tk))?)?; // [B, S, Tk]
        let scale = scale as f32;
        let (o, lse) = twin_forward(&host(q)?, &host(k)?, &host(v)?, &mask, n, scale);
        let o = Tensor::from_vec(o, (b, h, s, d), q.device())?.to_dtype(q.dtype())?;
        let saved = Saved::Cpu {
            mask,
            lse,
            n,
            scale,
        };
        Ok(Some((o, saved)))
    }

    impl Saved {
        /// The gradients of `q`, `k`, `v` from the output `o` and its gradient `g`.
        pub fn backward(
            &self,
            q: &Tensor,
            k: &Tensor,
            v: &Tensor,
            o: &Tensor,
            g: &Tensor,
        ) -> Result<(Tensor, Tensor, Tensor)> {
            match self {
                #[cfg(feature = "cuda")]
                Saved::Gpu(s) => s.backward(q, k, v, o, g),
                Saved::Cpu {
                    mask,
                    lse,
                    n,
                    scale,
                } => {
                    let (dq, dk, dv) = twin_backward(
                        &host(q)?,
                        &host(k)?,
                        &host(v)?,
                        mask,
                        &host(o)?,
                        &host(g)?,
                        lse,
                        *n,
                        *scale,
                    );
                    let back = |x: Vec<f32>, like: &Tensor| {
                        Tensor::from_vec(x, like.shape(), like.device())?.to_dtype(like.dtype())
                    };
                    Ok((back(dq, q)?, back(dk, k)?, back(dv, v)?))
                }
            }
        }
    }

    /// `gu` [.., 2I] (gate, then up) -> silu(gate) * up [.., I] (no graph).
    pub fn swiglu(gu: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if gu.device().is_cuda() {
            return crate::kernels::cuda::swiglu(&gu.detach());
        }
        swiglu_ops(&gu.detach())
    }

    fn swiglu_ops(gu: &Tensor) -> Result<Tensor> {
        let i = gu.dim(candle_core::D::Minus1)? / 2;
        let last = gu.rank() - 1;
        gu.narrow(last, 0, i)?.silu()? * gu.narrow(last, i, i)?
    }

    /// SwiGLU's backward: `gu` and the output's gradient `g` -> the gradient of `gu`.
    pub fn swiglu_backward(gu: &Tensor, g: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if gu.device().is_cuda() {
            return crate::kernels::cuda::swiglu_backward(gu, g);
        }
        let mut gs = grads_of(&[gu], g, |t| swiglu_ops(&t[0]))?;
        gs.pop()
            .ok_or_else(|| candle_core::Error::Msg("swiglu backward: no gradient".into()))
    }
}

/// Whether the layers of a model of `shape` on `dev` in `dt` run as [`GpuLayer`]: under
/// [`Compute::Gpu`], unless `GRPO_GPU_LAYER=graph` (candle's graph), once its [`check_dtype`] on a random layer of this
/// shape and dtype, at its first use in the process, passed (a failure is logged once, naming
/// the tensors that differ, and the layers run through candle's graph). Asked once per shape
/// and dtype.
pub fn usable(compute: Compute, dev: &Device, shape: LayerShape, dt: DType) -> bool {
    static ASKED: OnceLock<std::sync::Mutex<HashMap<(LayerShape, DType), bool>>> = OnceLock::new();
    // GRPO_GPU_LAYER, read once with the other switches (this is asked at every training
    // layer's forward); never off a GPU.
    let wanted = compute.gpu_switches().is_some_and(|s| s.layer_op);
    if !wanted {
        return false;
    }
    let Ok(mut asked) = ASKED.get_or_init(Default::default).lock() else {
        return false;
    };
    *asked
        .entry((shape, dt))
        .or_insert_with(|| judge(check_dtype(dev, dt, shape), dt))
}

/// The check's limit in `dt`, relative to each tensor's largest value.
pub fn tolerance(dt: DType) -> f32 {
    match dt {
        DType::F32 => F32_TOL,
        _ => BF16_TOL,
    }
}

/// Whether a check's result lets the op run, logged.
fn judge(result: Result<Errors>, dt: DType) -> bool {
    let tol = tolerance(dt);
    match result {
        Ok(e) if worst(&e) < tol => {
            tracing::info!(
                "layers: each training layer as one op (gpu_layer.rs; against candle ops at \
                 start, {dt:?}: {:.1e} of the largest value)",
                worst(&e)
            );
            true
        }
        Ok(e) => {
            tracing::warn!(
                "layers: the one-op layer differs from candle ops in {dt:?} (of each tensor's \
                 largest value: {}); the layers run through candle's graph",
                describe(&e, tol)
            );
            false
        }
        Err(e) => {
            tracing::warn!(
                "layers: the one-op layer's check failed ({e}); the layers run through \
                 candle's graph"
            );
            false
        }
    }
}

/// The check's limits, relative to each tensor's largest value (f32 and bf16).
const F32_TOL: f32 = 1e-3;
const BF16_TOL: f32 = 5e-2;

/// Each compared tensor's name and its largest difference, relative to its largest value.
pub type Errors = Vec<(&'static str, f32)>;

/// The largest of `e`'s differences (infinite where one is not a number).
pub fn worst(e: &Errors) -> f32 {
    e.iter().fold(0f32, |a, &(_, x)| match x.is_nan() {
        true => f32::INFINITY,
        false => a.max(x),
    })
}

/// The tensors of `e` above `tol` with their differences ("output 1.2e0, x 3.1e-1").
fn describe(e: &Errors, tol: f32) -> String {
    let over: Vec<String> = e
        .iter()
        .filter(|(_, x)| x.is_nan() || *x >= tol)
        .map(|(n, x)| format!("{n} {x:.1e}"))
        .collect();
    match over.is_empty() {
        true => format!("all within {tol:.0e}"),
        false => over.join(", "),
    }
}

/// A layer's sizes, for [`check_dtype`]'s random layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LayerShape {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
}

impl LayerShape {
    /// A small layer: 128 wide, 4 query and 2 kv heads of 32, an MLP of 256.
    pub const SMALL: Self = Self {
        hidden: 128,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        intermediate: 256,
    };
}

/// [`check_dtype`] of [`LayerShape::SMALL`] in f32 and in bf16.
pub fn check(dev: &Device) -> Result<(Errors, Errors)> {
    Ok((
        check_dtype(dev, DType::F32, LayerShape::SMALL)?,
        check_dtype(dev, DType::BF16, LayerShape::SMALL)?,
    ))
}

/// [`GpuLayer`] against candle ops (RMSNorm, matmuls, RoPE, the chunked attention, SiLU) with
/// candle's autograd, on a random layer of `shape` over 2 rows of 40 tokens with a causal mask,
/// in `dt` (the CPU runs f32 only: the composition with candle ops and the attention kernels'
/// twins in the kernels' places): the largest difference of what the forward keeps, the
/// output, the input's gradient and every weight's gradient, relative to each tensor's largest
/// value.
pub fn check_dtype(dev: &Device, dt: DType, shape: LayerShape) -> Result<Errors> {
    let LayerShape {
        hidden: hid,
        heads: nh,
        kv_heads: nkv,
        head_dim: d,
        intermediate: inter,
    } = shape;
    let (b, s) = (2, 40);
    let eps = 1e-5;
    let randn = |shape: &[usize], scale: f64| -> Result<Var> {
        Var::from_tensor(&(Tensor::randn(0f32, 1.0, shape, dev)? * scale)?)
    };
    let proj = |o: usize, i: usize| randn(&[o, i], 1.0 / (i as f64).sqrt());
    let norm = || -> Result<Var> { Var::from_tensor(&(randn(&[hid], 0.1)?.as_tensor() + 1.0)?) };
    let vars = [
        proj(nh * d, hid)?,  // q
        proj(nkv * d, hid)?, // k
        proj(nkv * d, hid)?, // v
        proj(hid, nh * d)?,  // o
        proj(inter, hid)?,   // gate
        proj(inter, hid)?,   // up
        proj(hid, inter)?,   // down
        norm()?,             // input norm
        norm()?,             // post-attention norm
    ];
    let x = randn(&[b, s, hid], 1.0)?;
    let r = Tensor::randn(0f32, 1.0, (b, s, hid), dev)?;
    let (cos, sin) = rope_tables(b, s, d, dev)?;
    let (cos, sin) = (cos.to_dtype(dt)?, sin.to_dtype(dt)?);
    // The causal mask training passes (every key valid). It must be causal: the reference's
    // chunked attention leaves causality inside a chunk of queries to the mask, where the
    // kernels (and their twins) are causal whatever it says. (An all-zero mask was this check's
    // fault on its first GPU run: it failed by O(1) against a non-causal reference.)
    let mask = crate::kernels::mask::build_mask(&vec![vec![true; s]; b], 0, s, s, dev)?; // [B, 1, S, S]
                                                                                         // (output, the gradients of x and of every weight; the forward's intermediates), in f32.
    let run = |op: bool| -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        let w: Vec<Tensor> = vars
            .iter()
            .map(|v| v.as_tensor().to_dtype(dt))
            .collect::<Result<_>>()?;
        let xc = x.as_tensor().to_dtype(dt)?;
        let (out, sink, parts) = match op {
            true => {
                let (out, sink, parts) =
                    op_forward(&vars, &w, &xc, (&cos, &sin, &mask), shape, dev)?;
                (out, Some(sink), parts)
            }
            false => {
                let (out, parts) = reference(&xc, &w, &cos, &sin, &mask, (nh, nkv, d), eps)?;
                (out, None, parts)
            }
        };
        let out = out.to_dtype(DType::F32)?;
        let grads = (&out * &r)?.sum_all()?.backward()?;
        let mut res = vec![out];
        for (i, v) in std::iter::once(&x).chain(vars.iter()).enumerate() {
            let graph = grads.get(v.as_tensor()).cloned();
            let sunk = match (&sink, i) {
                (Some(sk), 1..=7) => sk.take(v)?,
                _ => None,
            };
            let Some(g) = graph.or(sunk) else {
                candle_core::bail!("no gradient for tensor {i} (op: {op})");
            };
            res.push(g.to_dtype(DType::F32)?);
        }
        let parts = parts
            .iter()
            .map(|t| t.to_dtype(DType::F32))
            .collect::<Result<Vec<_>>>()?;
        Ok((res, parts))
    };
    let ((got, got_parts), (want, want_parts)) = (run(true)?, run(false)?);
    compare(&got, &got_parts, &want, &want_parts)
}

/// [`check_dtype`]'s op side: the layer as [`GpuLayer`] over sinks of `vars`' projections
/// (`w`, in the check's dtype), on `xc`: (its output, the sink, what its forward keeps).
fn op_forward(
    vars: &[Var],
    w: &[Tensor],
    xc: &Tensor,
    (cos, sin, mask): (&Tensor, &Tensor, &Tensor),
    shape: LayerShape,
    dev: &Device,
) -> Result<(Tensor, GradSink, Vec<Tensor>)> {
    let (nh, nkv, d) = (shape.heads, shape.kv_heads, shape.head_dim);
    let eps = 1e-5;
    let scale = 1.0 / (d as f64).sqrt();
    let pairs: Vec<(&Var, &Tensor)> = vars[..7].iter().zip(&w[..7]).collect();
    let sink = match dev.is_cuda() {
        true => GradSink::on_gpu(&pairs),
        false => GradSink::on_device(&pairs),
    };
    let sp = |ws: &[&Tensor]| -> Result<SinkProj> {
        let parts: Vec<(&Tensor, &Tensor)> = ws.iter().map(|w| (*w, *w)).collect();
        SinkProj::new(&sink, &parts)?
            .ok_or_else(|| candle_core::Error::Msg("no sink projection".into()))
    };
    let layer = GpuLayer {
        qkv: sp(&[&w[0], &w[1], &w[2]])?,
        o: sp(&[&w[3]])?,
        gate_up: sp(&[&w[4], &w[5]])?,
        down: sp(&[&w[6]])?,
        heads: nh,
        kv_heads: nkv,
        head_dim: d,
        scale,
        eps_in: eps,
        eps_post: eps,
    };
    let Some(out) = layer.forward(xc, &w[7], &w[8], cos, sin, mask)? else {
        candle_core::bail!("the op does not take the check's shapes");
    };
    // The same forward again, unrecorded, for what it keeps.
    let (xd, w7, w8) = (xc.detach(), w[7].detach(), w[8].detach());
    let Some((_, kept)) = layer.forward_parts(&xd, &w7, &w8, cos, sin, mask)? else {
        candle_core::bail!("the op does not take the check's shapes");
    };
    let parts = [kept.q, kept.k, kept.v, kept.o, kept.x1, kept.gu];
    Ok((out, sink, parts.to_vec()))
}

/// The largest relative differences of what the op's forward keeps, its output and every
/// gradient (`got`) from the reference's (`want`), by name.
fn compare(
    got: &[Tensor],
    got_parts: &[Tensor],
    want: &[Tensor],
    want_parts: &[Tensor],
) -> Result<Errors> {
    let part_names = [
        "rope(q)",
        "rope(k)",
        "v",
        "attention",
        "residual after attention",
        "gate_up",
    ];
    let mut errors = Errors::new();
    for ((a, e), name) in got_parts.iter().zip(want_parts).zip(part_names) {
        errors.push((name, rel_diff(a, e)?));
    }
    let names = [
        "output",
        "x",
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    ];
    for ((a, e), name) in got.iter().zip(want).zip(names) {
        errors.push((name, rel_diff(a, e)?));
    }
    Ok(errors)
}

/// The largest difference of `a` from `e`, relative to `e`'s largest value.
fn rel_diff(a: &Tensor, e: &Tensor) -> Result<f32> {
    if a.dims() != e.dims() {
        candle_core::bail!("shapes {:?} and {:?} differ", a.dims(), e.dims());
    }
    let diff = (a - e)?.abs()?.max_all()?.to_scalar::<f32>()?;
    let top = e.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-6);
    Ok(diff / top)
}

/// RoPE tables [B, S, D/2] f32 for positions 0..S (base 10000).
fn rope_tables(b: usize, s: usize, d: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
    let half = d / 2;
    let angles: Vec<f32> = (0..b * s * half)
        .map(|i| {
            let (p, j) = ((i / half) % s, i % half);
            p as f32 * 10000f32.powf(-((2 * j) as f32) / d as f32)
        })
        .collect();
    let a = Tensor::from_vec(angles, (b, s, half), dev)?;
    Ok((a.cos()?, a.sin()?))
}

/// The layer in candle ops with candle's autograd: weights `w` q, k, v, o, gate, up, down [out,
/// in], then the two norms' [H]. Returns the output and, detached, what the op keeps: the
/// rotated q and k, v, attention's output ([B, heads, S, D]), the residual stream after
/// attention and the gate/up output ([N, ..]).
fn reference(
    x: &Tensor,
    w: &[Tensor],
    cos: &Tensor,
    sin: &Tensor,
    mask: &Tensor,
    (nh, nkv, d): (usize, usize, usize),
    eps: f64,
) -> Result<(Tensor, Vec<Tensor>)> {
    use crate::kernels::portable::{apply_rope, rms_norm_diff};
    use crate::kernels::Mode;
    let (b, s, hid) = x.dims3()?;
    let n = b * s;
    let lin = |t: &Tensor, w: &Tensor| t.matmul(&w.t()?); // [N, in] -> [N, out]
    let heads = |t: Tensor, h: usize| t.reshape((b, s, h, d))?.transpose(1, 2)?.contiguous();
    let h1 = rms_norm_diff(x, &w[7], eps)?.reshape((n, hid))?;
    let q = apply_rope(&heads(lin(&h1, &w[0])?, nh)?, cos, sin, Mode::Train)?;
    let k = apply_rope(&heads(lin(&h1, &w[1])?, nkv)?, cos, sin, Mode::Train)?;
    let v = heads(lin(&h1, &w[2])?, nkv)?;
    let scale = 1.0 / (d as f64).sqrt();
    let o =
        crate::kernels::portable::chunked_attention::attention_ops(&q, &k, &v, mask, scale, true)?;
    let y = o.transpose(1, 2)?.contiguous()?.reshape((n, nh * d))?;
    let x1 = (x.reshape((n, hid))? + lin(&y, &w[3])?)?;
    let h2 = rms_norm_diff(&x1, &w[8], eps)?;
    let (gate, up) = (lin(&h2, &w[4])?, lin(&h2, &w[5])?);
    let gu = Tensor::cat(&[&gate, &up], 1)?.detach();
    let m = lin(&(gate.silu()? * up)?, &w[6])?;
    let out = (&x1 + m)?.reshape((b, s, hid))?;
    let kept = [q, k, v, o, x1, gu].iter().map(|t| t.detach()).collect();
    Ok((out, kept))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The op's composition (its forward, and its backward by hand through every piece, the
    /// projections' weight gradients into a sink) equals candle's autograd over the same layer,
    /// with candle ops in the GPU kernels' places: the output, the input's gradient and every
    /// weight's, in f32 on the CPU.
    #[test]
    fn the_layer_op_equals_candle_autograd_on_the_cpu() {
        let smollm2_135m = LayerShape {
            hidden: 576,
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            intermediate: 1536,
        };
        for shape in [LayerShape::SMALL, smollm2_135m] {
            let errors = check_dtype(&Device::Cpu, DType::F32, shape).unwrap();
            assert_eq!(errors.len(), 17, "{errors:?}");
            assert!(worst(&errors) < 1e-4, "{shape:?}: {errors:?}");
        }
    }
}
