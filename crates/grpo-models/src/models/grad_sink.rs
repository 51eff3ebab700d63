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

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{
    CpuStorage, CustomOp1, DType, Layout, Result, Shape, Storage, Tensor, TensorId, Var,
};

/// The gradient accumulator of one parameter, laid out like the parameter (contiguous).
#[derive(Debug)]
pub struct GradAcc {
    shape: Shape,
    /// `None` until a backward writes to it.
    data: Mutex<Option<Vec<f32>>>,
}

/// Accumulators for a set of trainable parameters, by tensor id.
#[derive(Debug, Default)]
pub struct GradSink {
    accs: HashMap<TensorId, Arc<GradAcc>>,
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
            .map(|v| {
                let acc = GradAcc {
                    shape: v.shape().clone(),
                    data: Mutex::new(None),
                };
                (v.id(), Arc::new(acc))
            })
            .collect();
        Self { accs, bf16: false }
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
        let Some(acc) = self.accs.get(&var.id()) else {
            return Ok(None);
        };
        let data = acc
            .data
            .lock()
            .map_err(|_| candle_core::Error::Msg("gradient accumulator poisoned".into()))?
            .take();
        data.map(|d| Tensor::from_vec(d, acc.shape.clone(), var.device()))
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
    /// Multiply in bf16 with f32 sums ([`super::gemm_bf16`]) instead of f32.
    bf16: bool,
}

impl SinkProj {
    /// `parts`: (`param`, `weight`) pairs where `weight` [out_i, in] is `param` itself or a view
    /// of it (GPT-2's `[in, out]` Conv1D weights, transposed). `None` unless every `param` has an
    /// accumulator in `sink` and every weight is f32 on the CPU.
    pub fn new(sink: &GradSink, parts: &[(&Tensor, &Tensor)]) -> Result<Option<Self>> {
        let mut out = Vec::with_capacity(parts.len());
        let mut in_dim = None;
        for (param, weight) in parts {
            let Some(acc) = sink.get(param) else {
                return Ok(None);
            };
            let (_, i) = weight.dims2()?;
            if weight.dtype() != DType::F32 || !weight.device().is_cpu() {
                return Ok(None);
            }
            if *in_dim.get_or_insert(i) != i || weight.elem_count() != acc.shape.elem_count() {
                return Ok(None);
            }
            out.push(Part {
                weight: (*weight).clone(),
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
    /// with the `gemm` crate, or in bf16 with f32 sums ([`super::gemm_bf16`]).
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
            let a = super::gemm_bf16::Strided {
                ptr: lhs,
                rs: lhs_rs,
                cs: lhs_cs,
            };
            let b = super::gemm_bf16::Strided {
                ptr: rhs,
                rs: rhs_rs,
                cs: rhs_cs,
            };
            // SAFETY: (caller) as `gemm_bf16::gemm` requires.
            unsafe { super::gemm_bf16::gemm(m, n, k, dst, dst_rs, dst_cs, accumulate, a, b) };
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

pub(crate) fn gemm_threads() -> gemm::Parallelism {
    match candle_core::utils::get_num_threads() {
        0 | 1 => gemm::Parallelism::None,
        n => gemm::Parallelism::Rayon(n),
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

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
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
