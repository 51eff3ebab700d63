use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublas::sys;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr, SyncOnDrop};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result, Shape, Storage, Tensor};

use super::{poisoned, GradAcc, SinkProj};

/// A row-major matrix operand of [`gemm`]: its first element's device address, element type
/// and row stride (elements), and whether the product uses its transpose.
#[derive(Clone, Copy)]
struct Mat {
    ptr: u64,
    dt: DType,
    ld: usize,
    t: bool,
}

/// The device address of element `offset` of `s` (f32 or bf16), with the guard that must
/// outlive the work launched on it.
fn addr<'a>(
    s: &'a CudaStorage,
    offset: usize,
    stream: &'a CudaStream,
) -> Result<(u64, DType, SyncOnDrop<'a>)> {
    Ok(match s.dtype() {
        DType::F32 => {
            let (p, g) = s.as_cuda_slice::<f32>()?.device_ptr(stream);
            (p + 4 * offset as u64, DType::F32, g)
        }
        DType::BF16 => {
            let (p, g) = s.as_cuda_slice::<half::bf16>()?.device_ptr(stream);
            (p + 2 * offset as u64, DType::BF16, g)
        }
        other => candle_core::bail!("sink projection: unsupported dtype {other:?} on the GPU"),
    })
}

fn cuda_type(dt: DType) -> sys::cudaDataType {
    match dt {
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        _ => sys::cudaDataType::CUDA_R_32F,
    }
}

/// Row-major `c [m, n] = op(a) [m, k] op(b) [k, n]`, plus `c` itself when `accumulate`, with
/// f32 sums (`op` transposes where the operand says so). cuBLAS is column-major, where a
/// row-major `[r, c]` matrix is its `[c, r]` transpose: so it computes `c^T = op(b)^T op(a)^T`.
///
/// # Safety
/// Each operand's address must be valid for its rows (`m`/`k` or `k`/`n` as it is used) at its
/// row stride, on `dev`'s stream; `c` must not overlap `a` or `b`.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm(
    dev: &CudaDevice,
    m: usize,
    n: usize,
    k: usize,
    a: Mat,
    b: Mat,
    c: Mat,
    accumulate: bool,
) -> Result<()> {
    let op = |t: bool| match t {
        true => sys::cublasOperation_t::CUBLAS_OP_T,
        false => sys::cublasOperation_t::CUBLAS_OP_N,
    };
    let i = |x: usize| -> Result<i32> {
        i32::try_from(x).map_err(|_| candle_core::Error::Msg(format!("gemm: {x} > i32")))
    };
    let (alpha, beta) = (1f32, if accumulate { 1f32 } else { 0f32 });
    let blas = dev.cublas_handle();
    // SAFETY: (caller) the operands; alpha and beta are f32 as CUBLAS_COMPUTE_32F requires.
    unsafe {
        candle_core::cuda_backend::cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            op(b.t),
            op(a.t),
            i(n)?,
            i(m)?,
            i(k)?,
            (&alpha) as *const f32 as *const _,
            b.ptr as *const _,
            cuda_type(b.dt),
            i(b.ld)?,
            a.ptr as *const _,
            cuda_type(a.dt),
            i(a.ld)?,
            (&beta) as *const f32 as *const _,
            c.ptr as *mut _,
            cuda_type(c.dt),
            i(c.ld)?,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
        )
    }
    .w()
}

/// How [`add_weight_gradient`] adds a bf16 product into an f32 accumulator. The sink uses
/// [`DwVia::F32Gemm`]: the faster of the two in `grpo bench ops` (bench/README.md), and it
/// rounds nothing to bf16.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DwVia {
    /// One GEMM with f32 output reading and writing the accumulator (`beta = 1`).
    F32Gemm,
    /// A GEMM into a bf16 scratch, then one kernel adding it into the accumulator.
    Bf16Add,
}

/// `acc [o, k] += dy[:, col..col + o]^T x` on the GPU: `acc` f32 contiguous (held exclusively
/// by the caller), `dy` [N, out] and `x` [N, k] contiguous, of one dtype (bf16 or f32; f32
/// inputs always take one f32 GEMM).
pub fn add_weight_gradient(
    acc: &Tensor,
    dy: &Tensor,
    col: usize,
    o: usize,
    x: &Tensor,
    via: DwVia,
) -> Result<()> {
    let (n, k) = x.dims2()?;
    let (ny, out) = dy.dims2()?;
    if ny != n || col + o > out || acc.dims2()? != (o, k) || acc.dtype() != DType::F32 {
        candle_core::bail!("weight gradient: shapes do not fit");
    }
    if !(acc.is_contiguous() && dy.is_contiguous() && x.is_contiguous()) {
        candle_core::bail!("weight gradient: tensors must be contiguous");
    }
    let dev = match x.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => candle_core::bail!("weight gradient: the input is not on the GPU"),
    };
    let stream = dev.cuda_stream();
    let scratch = match (via, x.dtype()) {
        (DwVia::Bf16Add, DType::BF16) => {
            // SAFETY: the GEMM below (not accumulating) writes all of it.
            Some(unsafe { Tensor::empty((o, k), DType::BF16, x.device())? })
        }
        _ => None,
    };
    let dst = scratch.as_ref().unwrap_or(acc);
    {
        let (xs, xl) = x.storage_and_layout();
        let (ys, yl) = dy.storage_and_layout();
        let (ds, dl) = dst.storage_and_layout();
        let (Storage::Cuda(xs), Storage::Cuda(ys), Storage::Cuda(ds)) = (&*xs, &*ys, &*ds) else {
            candle_core::bail!("weight gradient: a tensor is not on the GPU");
        };
        let (xp, xdt, _g1) = addr(xs, xl.start_offset(), &stream)?;
        let (yp, ydt, _g2) = addr(ys, yl.start_offset() + col, &stream)?;
        let (dp, ddt, _g3) = addr(ds, dl.start_offset(), &stream)?;
        // SAFETY: dy's columns col..col+o of n rows (row stride out), x [n, k], dst [o, k],
        // all contiguous views checked above; dst is the caller's or fresh.
        unsafe {
            gemm(
                &dev,
                o,
                k,
                n,
                Mat {
                    ptr: yp,
                    dt: ydt,
                    ld: out,
                    t: true,
                },
                Mat {
                    ptr: xp,
                    dt: xdt,
                    ld: k,
                    t: false,
                },
                Mat {
                    ptr: dp,
                    dt: ddt,
                    ld: k,
                    t: false,
                },
                scratch.is_none(),
            )?
        };
    }
    if let Some(s) = &scratch {
        if !crate::kernels::cuda::add_into_f32(acc, s)? {
            candle_core::bail!("weight gradient: the accumulate kernel did not run");
        }
    }
    Ok(())
}

/// `x` [N, in] -> `y` [N, out]: one GEMM per part into its columns of `y`.
pub(super) fn forward(p: &SinkProj, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
    let (n, k) = l.shape().dims2()?;
    if !l.is_contiguous() || k != p.in_dim {
        candle_core::bail!(
            "sink projection: input must be contiguous [N, {}]",
            p.in_dim
        );
    }
    let dev = s.device().clone();
    let stream = dev.cuda_stream();
    let len = n * p.out_dim;
    // SAFETY: every element is written by the parts' GEMMs (columns 0..out_dim, checked).
    let y = match s.dtype() {
        DType::BF16 => {
            CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<half::bf16>(len)? }, dev.clone())
        }
        _ => CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<f32>(len)? }, dev.clone()),
    };
    let (xp, xdt, _gx) = addr(s, l.start_offset(), &stream)?;
    let mut col = 0;
    for part in &p.parts {
        let (o, _) = part.weight.dims2()?;
        let (ws, wl) = part.weight.storage_and_layout();
        let Storage::Cuda(ws) = &*ws else {
            candle_core::bail!("sink projection: a weight is not on the GPU");
        };
        let (wp, wdt, _gw) = addr(ws, wl.start_offset(), &stream)?;
        let (yp, ydt, _gy) = addr(&y, col, &stream)?;
        if wdt != xdt {
            candle_core::bail!("sink projection: input {xdt:?}, weight {wdt:?}");
        }
        // y[:, col..col+o] = x W_i^T   (W_i [o, k] contiguous)
        // SAFETY: x is [n, k] contiguous, W_i [o, k] contiguous, y [n, out_dim] fresh.
        unsafe {
            gemm(
                &dev,
                n,
                o,
                k,
                Mat {
                    ptr: xp,
                    dt: xdt,
                    ld: k,
                    t: false,
                },
                Mat {
                    ptr: wp,
                    dt: wdt,
                    ld: k,
                    t: true,
                },
                Mat {
                    ptr: yp,
                    dt: ydt,
                    ld: p.out_dim,
                    t: false,
                },
                false,
            )?
        };
        col += o;
    }
    if col != p.out_dim {
        candle_core::bail!(
            "sink projection: parts cover {col} of {} outputs",
            p.out_dim
        );
    }
    Ok((y, Shape::from((n, p.out_dim))))
}

/// `dX = dY [W_1; W_2; ...]` (returned) and `dW_i += dY[:, part i]^T X` into each part's
/// f32 accumulator.
pub(super) fn backward(p: &SinkProj, arg: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
    let x = arg.contiguous()?; // [N, in]
    let gy = grad.to_dtype(x.dtype())?.contiguous()?; // [N, out]
    let gx = input_grad(p, &gy)?;
    add_weight_gradients(p, &gy, &x)?;
    Ok(Some(gx))
}

/// Each part's `dW_i += dY[:, part i]^T X` into its f32 accumulator (made, zeroed, at the
/// first write); `gy` [N, out] and `x` [N, in] contiguous.
pub(super) fn add_weight_gradients(p: &SinkProj, gy: &Tensor, x: &Tensor) -> Result<()> {
    let mut col = 0;
    for part in &p.parts {
        let (o, _) = part.weight.dims2()?;
        if let Some(acc) = &part.acc {
            add_into(acc, gy, col, o, x)?;
        }
        col += o;
    }
    Ok(())
}

/// `acc += dy[:, col..col + o]^T x` into a GPU accumulator, made (zeroed) at its first write,
/// as one GEMM with f32 output ([`DwVia::F32Gemm`]).
pub(super) fn add_into(acc: &GradAcc, dy: &Tensor, col: usize, o: usize, x: &Tensor) -> Result<()> {
    let mut slot = acc.on_device.lock().map_err(poisoned)?;
    let a = match slot.take() {
        Some(a) => a,
        None => Tensor::zeros(acc.shape.clone(), DType::F32, &acc.device)?,
    };
    let added = add_weight_gradient(&a, dy, col, o, x, DwVia::F32Gemm);
    *slot = Some(a);
    added
}

/// `dX = sum_i dY[:, part i] W_i` [N, in] from `gy` [N, out] (contiguous).
pub(super) fn input_grad(p: &SinkProj, gy: &Tensor) -> Result<Tensor> {
    let (n, out) = gy.dims2()?;
    let k = p.in_dim;
    if p.parts.is_empty() || out != p.out_dim || !gy.is_contiguous() {
        candle_core::bail!(
            "sink projection: gradient [{n}, {out}] for {} outputs",
            p.out_dim
        );
    }
    let dev = match gy.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => candle_core::bail!("sink projection: the gradient is not on the GPU"),
    };
    let stream = dev.cuda_stream();
    // SAFETY: the first part's GEMM (not accumulating) writes all of it.
    let gx = unsafe { Tensor::empty((n, k), gy.dtype(), gy.device())? };
    {
        let (gs, gl) = gy.storage_and_layout();
        let (gxs, gxl) = gx.storage_and_layout();
        let (Storage::Cuda(gs), Storage::Cuda(gxs)) = (&*gs, &*gxs) else {
            candle_core::bail!("sink projection: a tensor is not on the GPU");
        };
        let (gxp, gxdt, _g2) = addr(gxs, gxl.start_offset(), &stream)?;
        let mut col = 0;
        for (i, part) in p.parts.iter().enumerate() {
            let (o, _) = part.weight.dims2()?;
            let (ws, wl) = part.weight.storage_and_layout();
            let Storage::Cuda(ws) = &*ws else {
                candle_core::bail!("sink projection: a weight is not on the GPU");
            };
            let (wp, wdt, _gw) = addr(ws, wl.start_offset(), &stream)?;
            let (dyp, dydt, _gd) = addr(gs, gl.start_offset() + col, &stream)?;
            // dX (+)= dY[:, part] W_i
            // SAFETY: dY [n, out] contiguous (its columns col..col+o), W_i [o, k], dX [n, k].
            unsafe {
                gemm(
                    &dev,
                    n,
                    k,
                    o,
                    Mat {
                        ptr: dyp,
                        dt: dydt,
                        ld: out,
                        t: false,
                    },
                    Mat {
                        ptr: wp,
                        dt: wdt,
                        ld: k,
                        t: false,
                    },
                    Mat {
                        ptr: gxp,
                        dt: gxdt,
                        ld: k,
                        t: false,
                    },
                    i > 0,
                )?
            };
            col += o;
        }
    } // the storage guards end here, before `gx` is handed back
    Ok(gx)
}

/// The MLP block `down(silu(gate) * up)` over `x` [.., H] as one recorded op (see
/// [`super::sink_mlp`]).
pub(super) fn mlp(x: &Tensor, gate_up: &SinkProj, down: &SinkProj) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let h = gate_up.in_dim;
    let x2 = x.reshape((x.elem_count() / h, h))?; // [N, H]
    let xd = x2.detach().contiguous()?;
    let gu = xd.apply_op1_no_bwd(gate_up)?; // [N, 2I]
    let a = crate::kernels::cuda::swiglu(&gu)?; // [N, I] (no graph: gu is detached)
    let y = a.apply_op1_no_bwd(down)?; // [N, H]
    let bwd = MlpBackward {
        gate_up: gate_up.clone(),
        down: down.clone(),
        gu,
    };
    let y = crate::kernels::portable::recompute::attach(&y, &[&x2], std::sync::Arc::new(bwd))?;
    let mut out = dims;
    if let Some(last) = out.last_mut() {
        *last = down.out_dim;
    }
    y.reshape(out)
}

/// The MLP block's backward: dA = dY W_down, A = swiglu(GU) again, dW_down += dY^T A,
/// dGU = swiglu'(GU) dA, dX = dGU W_gate_up, dW_gate_up += dGU^T X: no gradient of the
/// block's inside goes through candle's store (each would be a zero-filled tensor plus an
/// add). A is recomputed by the forward's kernel from the same GU (the same values, bit for
/// bit) rather than kept: one elementwise kernel instead of I floats a token per layer
/// between the forward and the backward (a third of what the block kept).
struct MlpBackward {
    gate_up: SinkProj,
    down: SinkProj,
    /// [N, 2I], kept from the forward.
    gu: Tensor,
}

impl crate::kernels::portable::recompute::Backward for MlpBackward {
    fn name(&self) -> &'static str {
        "gpu-sink-mlp"
    }

    fn backward(
        &self,
        inputs: &[Tensor],
        _wanted: &[bool],
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let [x] = inputs else {
            candle_core::bail!("gpu sink mlp: one input expected");
        };
        let x = x.contiguous()?; // [N, H]
        let dy = grad.to_dtype(x.dtype())?.contiguous()?; // [N, H]
        let da = input_grad(&self.down, &dy)?; // [N, I]
        let a = crate::kernels::cuda::swiglu(&self.gu)?; // [N, I], as in the forward
        add_weight_gradients(&self.down, &dy, &a)?;
        drop(a);
        let dgu = crate::kernels::cuda::swiglu_backward(&self.gu, &da)?; // [N, 2I]
        let dx = input_grad(&self.gate_up, &dgu)?; // [N, H]
        add_weight_gradients(&self.gate_up, &dgu, &x)?;
        Ok(vec![Some(dx)])
    }
}
