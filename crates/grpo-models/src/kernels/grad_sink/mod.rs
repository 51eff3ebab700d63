//! Projections whose weight gradients go straight into per-parameter accumulators (CPU, f32).
//!
//! Through candle's autograd, the gradient of a projection weight is made three times per backward
//! pass: the GEMM's result, then a zero-filled buffer plus that result (candle accumulates every
//! gradient that way), then again through the transpose view and the concatenation of fused q/k/v
//! or gate/up weights, each a fresh model-sized buffer. With forward chunks this repeats per chunk,
//! and the buffers cost as much memory as the parameters.
//!
//! A projection with a [`GradSink`] attached is one custom op over its input only: the forward is
//! one GEMM per weight straight into the joined output (no concatenated weight copy), and the
//! backward returns the input's gradient and adds `dY^T X` into the parameter's accumulator with
//! one GEMM that reads and writes the accumulator in place, in the parameter's own layout. After
//! the last chunk, [`GradSink::take`] hands each accumulator over as the parameter's gradient.
//!
//! The op records a backward only when its input tracks gradients (in training the embedding is
//! trainable, so every projection's input does); a parameter whose accumulator is never written
//! is reported by the trainer's every-parameter-gets-a-gradient check, not dropped silently.
//!
//! On a GPU ([`GradSink::on_gpu`]) the same op runs on cuBLAS: the forward and the input's
//! gradient multiply in the model's dtype (bf16 or f32) with f32 sums, and each weight's gradient
//! is one GEMM that adds `dY^T X` straight into the parameter's f32 accumulator (`beta = 1`), so
//! neither the bf16 gradient, its transpose, candle's zero-plus-add, the cast back to f32 nor the
//! per-chunk sum is ever made. The CPU op above is its twin (the same math, tested in CI); the
//! GPU tests compare the two paths' gradients.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::kernels::cpu::gemm_threads;
use candle_core::{
    CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Storage, Tensor, TensorId, Var,
};

/// The gradient accumulator of one parameter, laid out like the parameter (contiguous).
#[derive(Debug)]
pub struct GradAcc {
    shape: Shape,
    /// CPU: `None` until a backward writes to it.
    data: Mutex<Option<Vec<f32>>>,
    /// GPU: an f32 tensor on the parameter's device, zeroed at the first write (`None` before).
    on_device: Mutex<Option<Tensor>>,
    device: Device,
}

impl GradAcc {
    fn new(shape: &Shape, device: &Device) -> Self {
        Self {
            shape: shape.clone(),
            data: Mutex::new(None),
            on_device: Mutex::new(None),
            device: device.clone(),
        }
    }
}

fn poisoned<T>(_: T) -> candle_core::Error {
    candle_core::Error::Msg("gradient accumulator poisoned".into())
}

/// Accumulators for a set of trainable parameters, by the id of the tensor the model holds for
/// each (the parameter itself, or on a GPU its cast to the compute dtype).
#[derive(Debug, Default)]
pub struct GradSink {
    accs: HashMap<TensorId, Arc<GradAcc>>,
    /// Parameter id -> accumulator key, where the model holds a cast of the parameter.
    keys: HashMap<TensorId, TensorId>,
    /// Whether the projections multiply in bf16 ([`crate::kernels::Compute::CpuMixed`]).
    bf16: bool,
}

impl GradSink {
    /// Accumulators for the f32, contiguous CPU parameters among `vars` (others keep candle's
    /// autograd).
    pub fn new(vars: &[Var]) -> Self {
        let accs = vars
            .iter()
            .filter(|v| {
                crate::kernels::Compute::resolve(v.device(), v.dtype()).is_fused()
                    && v.is_contiguous()
            })
            .map(|v| (v.id(), Arc::new(GradAcc::new(v.shape(), v.device()))))
            .collect();
        Self {
            accs,
            keys: HashMap::new(),
            bf16: false,
        }
    }

    /// Accumulators for each `(parameter, tensor)` pair where `tensor` is what a model is built
    /// from (the parameter or a cast of it), on the parameter's device, for [`Self::weight_grad`]
    /// (on a GPU, use [`Self::on_gpu`], whose accumulators projections also take).
    pub fn on_device(pairs: &[(&Var, &Tensor)]) -> Self {
        let mut sink = Self::default();
        for (v, t) in pairs {
            sink.accs
                .insert(t.id(), Arc::new(GradAcc::new(v.shape(), v.device())));
            if t.id() != v.id() {
                sink.keys.insert(v.id(), t.id());
            }
        }
        sink
    }

    /// GPU accumulators, for a model under [`crate::kernels::Compute::Gpu`]: for each
    /// `(parameter, tensor)` pair, where `tensor` is what the model is built from (the
    /// parameter, or its cast to the compute dtype), an f32 accumulator when `tensor` is a 2-D
    /// contiguous f32 or bf16 CUDA tensor ([`crate::kernels::cuda::takes`]). Projections over these
    /// tensors then multiply on cuBLAS and add their weight gradients into the accumulators
    /// ([`SinkProj`]).
    pub fn on_gpu(pairs: &[(&Var, &Tensor)]) -> Self {
        let usable: Vec<(&Var, &Tensor)> = pairs
            .iter()
            .filter(|(_, t)| t.rank() == 2 && t.is_contiguous() && crate::kernels::cuda::takes(t))
            .copied()
            .collect();
        Self::on_device(&usable)
    }

    /// `self`, its projections multiplying in bf16 with f32 sums (`on`: a model under
    /// [`crate::kernels::Compute::CpuMixed`]) or in f32 (the default).
    pub fn with_bf16_matmuls(mut self, on: bool) -> Self {
        self.bf16 = on;
        self
    }

    pub(crate) fn get(&self, param: &Tensor) -> Option<Arc<GradAcc>> {
        self.accs.get(&param.id()).cloned()
    }

    /// The gradient accumulated for `var` since the last `take`, or `None` if no backward wrote
    /// one. Leaves the accumulator empty.
    pub fn take(&self, var: &Var) -> Result<Option<Tensor>> {
        let key = self.keys.get(&var.id()).copied().unwrap_or(var.id());
        let Some(acc) = self.accs.get(&key) else {
            return Ok(None);
        };
        if let Some(t) = acc.on_device.lock().map_err(poisoned)?.take() {
            return Ok(Some(t));
        }
        let data = acc.data.lock().map_err(poisoned)?.take();
        data.map(|d| Tensor::from_vec(d, acc.shape.clone(), &acc.device))
            .transpose()
    }
}

/// One weight of a (possibly fused) projection: the `[out_i, in]` view the forward multiplies
/// by, and the accumulator of the parameter it is a view of.
#[derive(Debug, Clone)]
struct Part {
    weight: Tensor,
    /// `None` for a frozen weight: the backward gives the input's gradient only.
    acc: Option<Arc<GradAcc>>,
}

/// `y = x [W_1; W_2; ...]^T` (no bias) with gradients of the `W_i` into a [`GradSink`].
#[derive(Debug, Clone)]
pub struct SinkProj {
    parts: Vec<Part>,
    in_dim: usize,
    out_dim: usize,
    /// Multiply in bf16 with f32 sums ([`crate::kernels::cpu::gemm_bf16`]) instead of f32.
    bf16: bool,
}

impl SinkProj {
    /// `parts`: (`param`, `weight`) pairs where `weight` [out_i, in] is `param` itself or a view
    /// of it (GPT-2's `[in, out]` Conv1D weights, transposed). `None` unless every `param` has an
    /// accumulator in `sink` and every weight is f32 on the CPU, or, on a GPU, every weight is
    /// contiguous (`[out_i, in]` rows) and of one dtype, f32 or bf16.
    pub fn new(sink: &GradSink, parts: &[(&Tensor, &Tensor)]) -> Result<Option<Self>> {
        let mut out = Vec::with_capacity(parts.len());
        let mut in_dim = None;
        let first = parts
            .first()
            .map(|(_, w)| (w.device().is_cuda(), w.dtype()));
        for (param, weight) in parts {
            let Some(acc) = sink.get(param) else {
                return Ok(None);
            };
            let (_, i) = weight.dims2()?;
            let usable = match first {
                Some((true, dt)) => {
                    weight.device().is_cuda()
                        && weight.is_contiguous()
                        && weight.dtype() == dt
                        && matches!(dt, DType::F32 | DType::BF16)
                }
                _ => weight.dtype() == DType::F32 && weight.device().is_cpu(),
            };
            if !usable {
                return Ok(None);
            }
            if *in_dim.get_or_insert(i) != i || weight.elem_count() != acc.shape.elem_count() {
                return Ok(None);
            }
            out.push(Part {
                weight: match weight.device().is_cuda() {
                    true => weight.detach(),
                    false => (*weight).clone(),
                },
                acc: Some(acc),
            });
        }
        let Some(in_dim) = in_dim else {
            return Ok(None);
        };
        let out_dim = out.iter().map(|p| p.weight.dim(0)).sum::<Result<usize>>()?;
        Ok(Some(Self {
            parts: out,
            in_dim,
            out_dim,
            bf16: sink.bf16,
        }))
    }

    /// A projection by frozen weights `[out_i, in]` (views are fine): the backward computes the
    /// input's gradient only. candle's matmul backward would also compute the weight's gradient
    /// (as many FLOPs as the input's) and drop it. `None` unless every weight is f32 on the CPU.
    /// Multiplies in bf16 when `compute` says so ([`crate::kernels::Compute::bf16_matmuls`]).
    pub fn frozen(weights: &[&Tensor], compute: crate::kernels::Compute) -> Result<Option<Self>> {
        let mut in_dim = None;
        for w in weights {
            let (_, i) = w.dims2()?;
            if w.dtype() != DType::F32 || !w.device().is_cpu() || *in_dim.get_or_insert(i) != i {
                return Ok(None);
            }
        }
        let Some(in_dim) = in_dim else {
            return Ok(None);
        };
        let parts: Vec<Part> = weights
            .iter()
            .map(|w| Part {
                weight: (*w).clone(),
                acc: None,
            })
            .collect();
        let out_dim = parts
            .iter()
            .map(|p| p.weight.dim(0))
            .sum::<Result<usize>>()?;
        Ok(Some(Self {
            parts,
            in_dim,
            out_dim,
            bf16: compute.bf16_matmuls(),
        }))
    }

    /// `x` [.., in] -> [.., sum of out_i].
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let rows = x.elem_count() / self.in_dim;
        let x2 = x.reshape((rows, self.in_dim))?.contiguous()?; // [N, in]
        let y = x2.apply_op1(self.clone())?; // [N, out]
        let mut shape = dims;
        if let Some(last) = shape.last_mut() {
            *last = self.out_dim;
        }
        y.reshape(shape)
    }
}

impl SinkProj {
    /// `dst (+)= lhs rhs` ([m, k] times [k, n]; element strides as the `gemm` crate takes
    /// them: column stride, then row stride): added when `accumulate`, else overwritten. In f32
    /// with the `gemm` crate, or in bf16 with f32 sums ([`crate::kernels::cpu::gemm_bf16`]).
    ///
    /// # Safety
    /// The three views must be valid for their `[m, n]`, `[m, k]` and `[k, n]` elements, and
    /// `dst` must not overlap the others.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm(
        &self,
        m: usize,
        n: usize,
        k: usize,
        dst: *mut f32,
        dst_cs: isize,
        dst_rs: isize,
        accumulate: bool,
        lhs: *const f32,
        lhs_cs: isize,
        lhs_rs: isize,
        rhs: *const f32,
        rhs_cs: isize,
        rhs_rs: isize,
    ) {
        if self.bf16 {
            let a = crate::kernels::cpu::gemm_bf16::Strided {
                ptr: lhs,
                rs: lhs_rs,
                cs: lhs_cs,
            };
            let b = crate::kernels::cpu::gemm_bf16::Strided {
                ptr: rhs,
                rs: rhs_rs,
                cs: rhs_cs,
            };
            // SAFETY: (caller) as `gemm_bf16::gemm` requires.
            unsafe {
                crate::kernels::cpu::gemm_bf16::gemm(m, n, k, dst, dst_rs, dst_cs, accumulate, a, b)
            };
            return;
        }
        // SAFETY: (caller) as the `gemm` crate requires.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dst,
                dst_cs,
                dst_rs,
                accumulate,
                lhs,
                lhs_cs,
                lhs_rs,
                rhs,
                rhs_cs,
                rhs_rs,
                if accumulate { 1.0 } else { 0.0 },
                1.0,
                false,
                false,
                false,
                gemm_threads(),
            )
        };
    }
}

fn f32_slice(s: &CpuStorage) -> Result<&[f32]> {
    match s {
        CpuStorage::F32(v) => Ok(v),
        _ => candle_core::bail!("sink projection: f32 only"),
    }
}

impl CustomOp1 for SinkProj {
    fn name(&self) -> &'static str {
        "sink-proj"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, k) = l.shape().dims2()?;
        let Some((x0, x1)) = l.contiguous_offsets() else {
            candle_core::bail!("sink projection: input must be contiguous");
        };
        let x = &f32_slice(s)?[x0..x1];
        // Not zero-filled: the first write of every element is a GEMM that does not read it.
        let mut y: Vec<f32> = Vec::with_capacity(n * self.out_dim);
        let mut col = 0;
        for p in &self.parts {
            let (ws, wl) = p.weight.storage_and_layout();
            let Storage::Cpu(ws) = &*ws else {
                candle_core::bail!("sink projection: CPU only");
            };
            let w = f32_slice(ws)?;
            let (o, _) = wl.shape().dims2()?;
            let (s0, s1) = (wl.stride()[0] as isize, wl.stride()[1] as isize);
            // SAFETY: y is [n, out_dim] and columns col..col+o < out_dim; x is [n, k] contiguous;
            // the weight view [o, k] with strides (s0, s1) from its start offset lies inside its
            // storage (candle's layout invariant).
            unsafe {
                self.gemm(
                    n,
                    o,
                    k,
                    y.as_mut_ptr().add(col),
                    1,
                    self.out_dim as isize,
                    false,
                    x.as_ptr(),
                    1,
                    k as isize,
                    w.as_ptr().add(wl.start_offset()),
                    s0, // rhs[kk, j] = W[j, kk]: moving along j (a column of rhs) steps a row of W
                    s1,
                );
            }
            col += o;
        }
        if col != self.out_dim {
            candle_core::bail!(
                "sink projection: parts cover {col} of {} outputs",
                self.out_dim
            );
        }
        // SAFETY: the parts' GEMMs (read_dst = false) wrote columns 0..out_dim of all n rows.
        unsafe { y.set_len(n * self.out_dim) };
        Ok((CpuStorage::F32(y), Shape::from((n, self.out_dim))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        gpu::forward(self, s, l)
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        if arg.device().is_cuda() {
            #[cfg(feature = "cuda")]
            return gpu::backward(self, arg, grad_res);
            #[cfg(not(feature = "cuda"))]
            candle_core::bail!("sink projection: a GPU tensor in a build without CUDA");
        }
        let (n, k) = arg.dims2()?;
        let gy = grad_res.contiguous()?; // [N, out]
        let x = arg.contiguous()?; // [N, in]
        let (gs, gl) = gy.storage_and_layout();
        let (xs, xl) = x.storage_and_layout();
        let (Storage::Cpu(gs), Storage::Cpu(xs)) = (&*gs, &*xs) else {
            candle_core::bail!("sink projection: CPU only");
        };
        let g = &f32_slice(gs)?[gl.start_offset()..];
        let xv = &f32_slice(xs)?[xl.start_offset()..];
        if self.parts.is_empty() {
            candle_core::bail!("sink projection: no parts");
        }
        // Not zero-filled: the first part's GEMM (read_dst = false) writes all of it.
        let mut gx: Vec<f32> = Vec::with_capacity(n * k);
        let od = self.out_dim as isize;
        let mut col = 0;
        for (i, p) in self.parts.iter().enumerate() {
            let (ws, wl) = p.weight.storage_and_layout();
            let Storage::Cpu(ws) = &*ws else {
                candle_core::bail!("sink projection: CPU only");
            };
            let w = f32_slice(ws)?;
            let (o, _) = wl.shape().dims2()?;
            let (s0, s1) = (wl.stride()[0] as isize, wl.stride()[1] as isize);
            let off = wl.start_offset();
            // dX += dY[:, part] W_i   (m = n, n = k, k = o)
            // SAFETY: as in the forward; gx is [n, k], dY is [n, out_dim] contiguous.
            unsafe {
                self.gemm(
                    n,
                    k,
                    o,
                    gx.as_mut_ptr(),
                    1,
                    k as isize,
                    i > 0,
                    g.as_ptr().add(col),
                    1,
                    od,
                    w.as_ptr().add(off),
                    s1,
                    s0,
                );
            }
            // dW_i += dY[:, part]^T X, written where W_i's elements live in the parameter.
            let Some(pacc) = &p.acc else {
                col += o;
                continue;
            };
            let mut guard = pacc
                .data
                .lock()
                .map_err(|_| candle_core::Error::Msg("gradient accumulator poisoned".into()))?;
            let first = guard.is_none();
            let acc = guard.get_or_insert_with(|| vec![0f32; pacc.shape.elem_count()]);
            let max = off as isize + (o as isize - 1) * s0 + (k as isize - 1) * s1;
            if s0 < 0 || s1 < 0 || max as usize >= acc.len() {
                candle_core::bail!("sink projection: weight view outside its parameter");
            }
            // SAFETY: every index off + r*s0 + c*s1 (r < o, c < k) is within acc (checked above);
            // dY[:, part] is read as its transpose [o, n] and X as [n, k].
            unsafe {
                self.gemm(
                    o,
                    k,
                    n,
                    acc.as_mut_ptr().add(off),
                    s1,
                    s0,
                    !first,
                    g.as_ptr().add(col),
                    od,
                    1,
                    xv.as_ptr(),
                    1,
                    k as isize,
                );
            }
            col += o;
        }
        // SAFETY: the first part's GEMM wrote all n x k elements (see above).
        unsafe { gx.set_len(n * k) };
        let gx = Tensor::from_vec(gx, (n, k), arg.device())?;
        Ok(Some(gx))
    }
}

/// An embedding lookup `weight[ids]` whose weight gradient is scattered straight into the
/// weight's accumulator: candle's `index_select` backward builds a zero-filled `[vocab, hidden]`
/// gradient per forward chunk (113 MB for SmolLM2) and then adds it to the running sum.
#[derive(Debug, Clone)]
pub struct SinkLookup {
    acc: Arc<GradAcc>,
}

impl SinkLookup {
    /// `None` unless `weight` is a 2-D f32 CPU parameter with an accumulator in `sink`.
    pub fn new(sink: &GradSink, weight: &Tensor) -> Result<Option<Self>> {
        let Some(acc) = sink.get(weight) else {
            return Ok(None);
        };
        if weight.rank() != 2 || weight.dtype() != DType::F32 || !weight.device().is_cpu() {
            return Ok(None);
        }
        Ok(Some(Self { acc }))
    }

    /// `ids` [N] u32 -> `weight[ids]` [N, H].
    pub fn forward(&self, weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
        let op = LookupOp {
            ids: ids.flatten_all()?.to_vec1::<u32>()?,
            acc: self.acc.clone(),
        };
        weight.apply_op1(op)
    }
}

struct LookupOp {
    ids: Vec<u32>,
    acc: Arc<GradAcc>,
}

impl CustomOp1 for LookupOp {
    fn name(&self) -> &'static str {
        "sink-lookup"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (v, h) = l.shape().dims2()?;
        let Some((w0, w1)) = l.contiguous_offsets() else {
            candle_core::bail!("sink lookup: the embedding must be contiguous");
        };
        let w = &f32_slice(s)?[w0..w1];
        let mut y = Vec::with_capacity(self.ids.len() * h);
        for &id in &self.ids {
            let id = id as usize;
            if id >= v {
                candle_core::bail!("token id {id} is outside the embedding's {v} rows");
            }
            y.extend_from_slice(&w[id * h..(id + 1) * h]);
        }
        Ok((CpuStorage::F32(y), Shape::from((self.ids.len(), h))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let (_, h) = arg.dims2()?;
        let gy = grad_res.contiguous()?; // [N, H]
        let (gs, gl) = gy.storage_and_layout();
        let Storage::Cpu(gs) = &*gs else {
            candle_core::bail!("sink lookup: CPU only");
        };
        let g = &f32_slice(gs)?[gl.start_offset()..];
        let mut guard = self
            .acc
            .data
            .lock()
            .map_err(|_| candle_core::Error::Msg("gradient accumulator poisoned".into()))?;
        let acc = guard.get_or_insert_with(|| vec![0f32; self.acc.shape.elem_count()]);
        // Rows in token order: the sums are the same from run to run (exact resume).
        for (i, &id) in self.ids.iter().enumerate() {
            let dst = &mut acc[id as usize * h..(id as usize + 1) * h];
            for (d, s) in dst.iter_mut().zip(&g[i * h..(i + 1) * h]) {
                *d += s;
            }
        }
        // The gradient is in the accumulator; candle's store gets none for the weight.
        Ok(None)
    }
}

#[cfg(feature = "cuda")]
pub use gpu::{add_weight_gradient, DwVia};

/// The f32 accumulator of one GPU parameter, for code outside this module that computes a
/// weight gradient itself (the LM head's recomputed log-probs): `dW += dY^T X` adds straight in.
#[derive(Debug, Clone)]
pub struct WeightGrad(Arc<GradAcc>);

impl GradSink {
    /// The accumulator of the parameter whose model tensor is `t`, when this sink holds it.
    pub fn weight_grad(&self, t: &Tensor) -> Option<WeightGrad> {
        self.get(t).map(WeightGrad)
    }
}

impl WeightGrad {
    /// `dW [o, k] += dy^T x` for `dy` [N, o] and `x` [N, k] (one dtype, bf16 or f32): on a GPU
    /// one cuBLAS GEMM into the f32 accumulator; on the CPU (tests) a candle product added in.
    pub fn add_product(&self, dy: &Tensor, x: &Tensor) -> Result<()> {
        if self.0.device.is_cpu() {
            let part = dy.t()?.matmul(x)?.to_dtype(DType::F32)?.flatten_all()?; // [o * k]
            let part = part.to_vec1::<f32>()?;
            let mut guard = self.0.data.lock().map_err(poisoned)?;
            let acc = guard.get_or_insert_with(|| vec![0f32; self.0.shape.elem_count()]);
            if acc.len() != part.len() {
                candle_core::bail!("weight gradient: {} values for {}", part.len(), acc.len());
            }
            acc.iter_mut().zip(&part).for_each(|(a, p)| *a += p);
            return Ok(());
        }
        #[cfg(feature = "cuda")]
        {
            let (dy, x) = (dy.contiguous()?, x.contiguous()?);
            gpu::add_into(&self.0, &dy, 0, dy.dim(1)?, &x)
        }
        #[cfg(not(feature = "cuda"))]
        candle_core::bail!("weight gradient: a GPU accumulator in a build without CUDA")
    }
}

impl SinkProj {
    /// The input's width.
    pub fn in_dim(&self) -> usize {
        self.in_dim
    }

    /// Whether this projection multiplies on a GPU (a sink made by [`GradSink::on_gpu`]).
    pub fn on_gpu(&self) -> bool {
        self.parts
            .first()
            .is_some_and(|p| p.weight.device().is_cuda())
    }

    /// One projection per part (each `[.., out_i]` its own tensor, no views of a joined one to
    /// narrow: candle's backward of a narrow pads the gradient back to the joined width).
    pub fn split(&self) -> Vec<SinkProj> {
        self.parts
            .iter()
            .map(|p| Self {
                parts: vec![p.clone()],
                in_dim: self.in_dim,
                out_dim: p.weight.dims()[0],
                bf16: self.bf16,
            })
            .collect()
    }
}

/// The MLP block `down(silu(gate) * up)` of `x` [.., H] on a GPU, its projections through GPU
/// sinks (no biases, no adapters), as one recorded op: the forward is two cuBLAS GEMMs and the
/// SwiGLU kernel, the backward (`dY` -> `dX`) two GEMMs per projection and SwiGLU's backward
/// kernel, the weights' gradients into the sink. The block's intermediate gradients never go
/// through candle's gradient store. Keeps the gate/up output for the backward, which
/// recomputes the activation from it (candle's graph of the same block keeps both).
#[cfg(feature = "cuda")]
pub fn sink_mlp(x: &Tensor, gate_up: &SinkProj, down: &SinkProj) -> Result<Tensor> {
    gpu::mlp(x, gate_up, down)
}

/// A sink projection's backward for blocks that run their own: `dX = dY [W_1; W_2; ...]`
/// (returned, [N, in]) and each part's `dW_i += dY[:, part i]^T X` into its accumulator, from
/// `gy` [N, out] and the forward's input `x` [N, in]: cuBLAS GEMMs on a GPU, the `gemm` crate
/// on the CPU (f32).
pub(crate) fn sink_backward(p: &SinkProj, x: &Tensor, gy: &Tensor) -> Result<Tensor> {
    // The recorded op's own backward (it reads neither its result nor, on a GPU, anything but
    // these two).
    match CustomOp1::bwd(p, x, x, gy)? {
        Some(gx) => Ok(gx),
        None => candle_core::bail!("sink projection: no input gradient"),
    }
}

/// [`SinkProj`] on cuBLAS (see the module's docs).
#[cfg(feature = "cuda")]
mod gpu;

#[cfg(test)]
mod tests;
