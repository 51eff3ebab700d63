//! grpo's own GPU kernels (`cuda/kernels.cu`, compiled at run time by NVRTC, so the build needs
//! no CUDA compiler for them): causal attention that never stores a score matrix, forward and
//! backward, in 64 x 64 tiles of scores through shared memory; single-query attention for a
//! decoding step over the KV cache's views, a block per (row, kv head); RMSNorm,
//! RoPE and SwiGLU, each forward and backward;
//! the LM head's log-softmax + gather + entropy and its backward.
//!
//! The attention plan is FlashAttention's: the forward keeps the output and one log-sum-exp per
//! query; the backward recomputes each probability from it (dQ per block of queries, dK and dV
//! per block of keys). f32 arithmetic over bf16 or f32 tensors; head sizes 16, 32, 64 and 128.
//! `GRPO_GPU_KERNELS=forward` runs attention's backward as [`super::chunked_attention`]'s candle
//! ops instead; `off` (or kernels that do not apply: another head size or dtype) runs candle ops.
//! bf16 attention runs through `cuda/attention_tc.cu` where the card has bf16 tensor cores (sm_80
//! and later): the same three kernels with their products as `mma.sync`, checked against the
//! CUDA-core ones once at start; `GRPO_GPU_ATTENTION=cores` runs the CUDA-core kernels instead.
//!
//! The kernels' twins in plain Rust ([`twin_forward`], [`twin_backward`], [`twin_swiglu`],
//! [`twin_rms_norm`], [`twin_rope`]) compute the same math and are tested against the candle-op
//! path on the CPU in CI; `scripts/check_gpu_kernels.py` runs the CUDA source itself on the CPU
//! (a block's threads as OS threads) against torch; the GPU tests (`crates/grpo/tests/cuda.rs`)
//! compare the kernels with candle ops on the GPU, and a GPU's training with the CPU's portable
//! path.

/// Head sizes the kernels are instantiated for (16 and 32: the tiny test fixtures', so that the
/// GPU tests against transformers run through the kernels).
pub const HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];

/// Shapes of one attention call: rows, query heads, kv heads, queries, key slots, head size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dims {
    pub b: usize,
    pub h: usize,
    pub hkv: usize,
    pub s: usize,
    pub tk: usize,
    pub d: usize,
}

impl Dims {
    /// Key slots query `i` reads (causal): `0 .. Tk - S + i + 1`.
    fn end(&self, i: usize) -> usize {
        (self.tk + i + 1).saturating_sub(self.s).min(self.tk)
    }
}

/// The forward kernel's twin: `q` [B, H, S, D], `k`/`v` [B, Hkv, Tk, D], `mask` [B, S, Tk]
/// additive -> (o [B, H, S, D], lse [B, H, S]).
pub fn twin_forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: &[f32],
    n: Dims,
    scale: f32,
) -> (Vec<f32>, Vec<f32>) {
    let Dims {
        b: _,
        h,
        hkv,
        s,
        tk,
        d,
    } = n;
    let mut o = vec![0f32; q.len()];
    let mut lse = vec![0f32; q.len() / d.max(1)];
    for (row, (oq, l_out)) in o.chunks_mut(d).zip(lse.iter_mut()).enumerate() {
        let (bh, i) = (row / s, row % s);
        let (bi, hi) = (bh / h, bh % h);
        let hk = hi / (h / hkv);
        let qs: Vec<f32> = q[row * d..(row + 1) * d]
            .iter()
            .map(|x| x * scale)
            .collect();
        let kv = (bi * hkv + hk) * tk * d;
        let mrow = &mask[(bi * s + i) * tk..(bi * s + i + 1) * tk];
        let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
        let mut acc = vec![0f32; d];
        for j in 0..n.end(i) {
            let kj = &k[kv + j * d..kv + (j + 1) * d];
            let z = qs.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() + mrow[j];
            let mn = m.max(z);
            let (c, p) = ((m - mn).exp(), (z - mn).exp());
            l = l * c + p;
            for (a, vv) in acc.iter_mut().zip(&v[kv + j * d..kv + (j + 1) * d]) {
                *a = *a * c + p * vv;
            }
            m = mn;
        }
        let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
        for (x, a) in oq.iter_mut().zip(&acc) {
            *x = a * inv;
        }
        *l_out = m + l.ln();
    }
    (o, lse)
}

/// The backward kernels' twin: given the forward's `o` and `lse` and the output's gradient
/// `dout`, -> (dq, dk, dv) in the inputs' shapes.
#[allow(clippy::too_many_arguments)]
pub fn twin_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: &[f32],
    o: &[f32],
    dout: &[f32],
    lse: &[f32],
    n: Dims,
    scale: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let Dims {
        b,
        h,
        hkv,
        s,
        tk,
        d,
    } = n;
    let g = h / hkv;
    let dot = |a: &[f32], c: &[f32]| a.iter().zip(c).map(|(x, y)| x * y).sum::<f32>();
    let at = |x: &[f32], r: usize| x[r * d..(r + 1) * d].to_vec();
    // Per query: delta and dQ.
    let mut delta = vec![0f32; b * h * s];
    let mut dq = vec![0f32; q.len()];
    for row in 0..b * h * s {
        let (bh, i) = (row / s, row % s);
        let (bi, hk) = (bh / h, (bh % h) / g);
        let qs: Vec<f32> = at(q, row).iter().map(|x| x * scale).collect();
        let gs = at(dout, row);
        let dl = dot(&gs, &at(o, row));
        delta[row] = dl;
        let mut acc = vec![0f32; d];
        for j in 0..n.end(i) {
            let kr = (bi * hkv + hk) * tk + j;
            let (kj, vj) = (at(k, kr), at(v, kr));
            let p = (dot(&qs, &kj) + mask[(bi * s + i) * tk + j] - lse[row]).exp();
            let ds = p * (dot(&gs, &vj) - dl);
            for (a, kk) in acc.iter_mut().zip(&kj) {
                *a += ds * kk;
            }
        }
        for (x, a) in dq[row * d..(row + 1) * d].iter_mut().zip(&acc) {
            *x = a * scale;
        }
    }
    // Per key: dK and dV over the g heads that read it and the queries that reach it.
    let (mut dk, mut dv) = (vec![0f32; k.len()], vec![0f32; v.len()]);
    for kr in 0..b * hkv * tk {
        let (bk, j) = (kr / tk, kr % tk);
        let (bi, hk) = (bk / hkv, bk % hkv);
        let ks: Vec<f32> = at(k, kr).iter().map(|x| x * scale).collect();
        let vs = at(v, kr);
        let (mut ak, mut av) = (vec![0f32; d], vec![0f32; d]);
        for hh in hk * g..(hk + 1) * g {
            for i in (j + s).saturating_sub(tk)..s {
                let row = (bi * h + hh) * s + i;
                let (qi, gi) = (at(q, row), at(dout, row));
                let p = (dot(&ks, &qi) + mask[(bi * s + i) * tk + j] - lse[row]).exp();
                let ds = p * (dot(&vs, &gi) - delta[row]);
                for dd in 0..d {
                    av[dd] += p * gi[dd];
                    ak[dd] += ds * qi[dd];
                }
            }
        }
        for dd in 0..d {
            dk[kr * d + dd] = ak[dd] * scale;
            dv[kr * d + dd] = av[dd];
        }
    }
    (dq, dk, dv)
}

/// The SwiGLU kernels' twin: `gu` [N, 2I] (gate then up per row) and the output's gradient `dy`
/// [N, I] -> (silu(gate) * up [N, I], d gu [N, 2I]).
pub fn twin_swiglu(gu: &[f32], dy: &[f32], inter: usize) -> (Vec<f32>, Vec<f32>) {
    let mut y = vec![0f32; dy.len()];
    let mut dgu = vec![0f32; gu.len()];
    for (idx, (yo, d)) in y.iter_mut().zip(dy).enumerate() {
        let (r, c) = (idx / inter, idx % inter);
        let (g, u) = (gu[r * 2 * inter + c], gu[r * 2 * inter + inter + c]);
        let s = 1.0 / (1.0 + (-g).exp());
        *yo = g * s * u;
        dgu[r * 2 * inter + c] = d * u * s * (1.0 + g * (1.0 - s));
        dgu[r * 2 * inter + inter + c] = d * g * s;
    }
    (y, dgu)
}

/// The RMSNorm kernels' twin (f32): rows of `x` [N, H], weight `w` [H], the output's gradient
/// `g` [N, H] -> (y, dx, dw).
pub fn twin_rms_norm(x: &[f32], w: &[f32], g: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let h = w.len();
    let (mut y, mut dx, mut dw) = (vec![0f32; x.len()], vec![0f32; x.len()], vec![0f32; h]);
    for (row, (xr, gr)) in x.chunks(h).zip(g.chunks(h)).enumerate() {
        let r = 1.0 / (xr.iter().map(|v| v * v).sum::<f32>() / h as f32 + eps).sqrt();
        let proj = (0..h).map(|i| gr[i] * w[i] * xr[i] * r).sum::<f32>() / h as f32;
        for i in 0..h {
            let n = xr[i] * r;
            y[row * h + i] = n * w[i];
            dx[row * h + i] = (gr[i] * w[i] - n * proj) * r;
            dw[i] += gr[i] * n;
        }
    }
    (y, dx, dw)
}

/// The RoPE kernels' twin: `x` [B, T, H*D], tables `cos`/`sin` [B, T, D/2] and the output's
/// gradient `dy` [B, H, T, D] -> (y [B, H, T, D], dx [B, T, H*D]).
pub fn twin_rope(
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    dy: &[f32],
    (b, t, h, d): (usize, usize, usize, usize),
) -> (Vec<f32>, Vec<f32>) {
    let half = d / 2;
    let (mut y, mut dx) = (vec![0f32; x.len()], vec![0f32; x.len()]);
    for bi in 0..b {
        for hi in 0..h {
            for ti in 0..t {
                let bt = bi * t + ti;
                let rows = bt * h * d + hi * d;
                let heads = ((bi * h + hi) * t + ti) * d;
                for c in 0..half {
                    let (co, si) = (cos[bt * half + c], sin[bt * half + c]);
                    let (x1, x2) = (x[rows + c], x[rows + half + c]);
                    y[heads + c] = x1 * co - x2 * si;
                    y[heads + half + c] = x2 * co + x1 * si;
                    let (g1, g2) = (dy[heads + c], dy[heads + half + c]);
                    dx[rows + c] = g1 * co + g2 * si;
                    dx[rows + half + c] = g2 * co - g1 * si;
                }
            }
        }
    }
    (y, dx)
}

/// One AdamW step's scalars for [`adamw_step`] (torch's names; `decay` = 1 - lr * weight_decay,
/// `step_size` = lr / bias_correction1).
#[derive(Debug, Clone, Copy)]
pub struct AdamWScalars {
    pub grad_scale: f32,
    pub decay: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub bias_correction2_sqrt: f32,
    pub step_size: f32,
}

/// Whether grpo's GPU kernels take `x`: on a GPU, f32 or bf16. Whether they run at all is the
/// model's [`crate::kernels::Compute`] ([`crate::kernels::Compute::on_gpu`]); each kernel also
/// checks its shapes.
pub fn takes(x: &candle_core::Tensor) -> bool {
    x.device().is_cuda()
        && matches!(
            x.dtype(),
            candle_core::DType::F32 | candle_core::DType::BF16
        )
}

#[cfg(feature = "cuda")]
pub use gpu::{
    adamw_step, add_into_f32, add_rms_norm, attention, attention_chunked_backward,
    attention_cuda_cores, attention_raw, attention_tensor_cores, decode_attention,
    decode_attention_with, head_logprobs, head_logprobs_backward, head_takes, rms_norm,
    rms_norm_backward, rms_norm_raw, rms_norm_takes, rope_append, rope_backward, rope_heads,
    rope_heads_raw, sum_squares, swiglu, swiglu_backward, AttnSaved, DecodeKernel,
};

#[cfg(feature = "cuda")]
mod gpu {
    use std::sync::{Arc, OnceLock};

    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDevice, WrapErr};
    use candle_core::{DType, Device, Result, Storage, Tensor};

    use super::super::recompute::{attach, Backward};
    use super::{takes, Dims, HEAD_DIMS};
    use crate::kernels::{gpu_kernels, gpu_ptx as ptx, gpu_tc_ptx, GpuKernels};

    fn cuda(t: &Tensor) -> Result<CudaDevice> {
        match t.device() {
            Device::Cuda(d) => Ok(d.clone()),
            _ => candle_core::bail!("gpu attention: a tensor is not on the GPU"),
        }
    }

    fn suffix(dt: DType) -> &'static str {
        if dt == DType::BF16 {
            "bf16"
        } else {
            "f32"
        }
    }

    fn name(kernel: &str, dt: DType, d: usize) -> String {
        format!("attn_{kernel}_{}_{d}", suffix(dt))
    }

    /// Queries or keys per attention block (`AT` in kernels.cu), and its threads (`ATH`).
    const AT: usize = 64;
    const ATH: u32 = 256;

    /// Shared memory of an attention kernel for head size `d`: `rows` tiles of [AT][d + 1],
    /// `squares` of [AT][AT + 1] and `red` reduction rows of [AT][16], all f32.
    fn attn_smem(d: usize, rows: usize, squares: usize, red: usize) -> u32 {
        ((rows * AT * (d + 1) + squares * AT * (AT + 1) + red * AT * 16) * 4) as u32
    }

    /// The forward's, dQ's and dK/dV's shared memory (the layouts in kernels.cu).
    fn smem_fwd(d: usize) -> u32 {
        attn_smem(d, 3, 1, 1)
    }

    fn smem_dq(d: usize) -> u32 {
        attn_smem(d, 4, 1, 1)
    }

    fn smem_dkv(d: usize) -> u32 {
        attn_smem(d, 4, 2, 0)
    }

    /// The most shared memory a block may opt into on this process's GPU (0 if unknown).
    fn smem_limit(dev: &CudaDevice) -> u32 {
        static LIMIT: OnceLock<u32> = OnceLock::new();
        *LIMIT.get_or_init(|| {
            use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
            let a = CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN;
            dev.cuda_stream()
                .context()
                .attribute(a)
                .map_or(0, |v| v.max(0) as u32)
        })
    }

    /// Which kernels run attention: kernels.cu's (f32 arithmetic on CUDA cores, over f32 or
    /// bf16 tensors), or attention_tc.cu's (bf16 only: the products on tensor cores, f32 sums).
    /// Both take the same arguments and make the same results (the log-sum-exps too), in tiles
    /// of [`AT`] queries or keys.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum AttnKernels {
        Cores,
        Tensor,
    }

    impl AttnKernels {
        fn name(self, kernel: &str, dt: DType, d: usize) -> String {
            match self {
                AttnKernels::Cores => name(kernel, dt, d),
                AttnKernels::Tensor => format!("attn_{kernel}_tc_bf16_{d}"),
            }
        }

        fn module(self) -> Module {
            match self {
                AttnKernels::Cores => Module::Main,
                AttnKernels::Tensor => Module::TensorCores,
            }
        }

        /// A grid of `items.div_ceil(AT)` x `groups` blocks: [`ATH`] threads for the CUDA-core
        /// kernels, 4 warps of 16 rows for the tensor-core ones.
        fn config(self, items: usize, groups: usize, smem: u32) -> LaunchConfig {
            let threads = match self {
                AttnKernels::Cores => ATH,
                AttnKernels::Tensor => 128,
            };
            LaunchConfig {
                grid_dim: (items.div_ceil(AT) as u32, groups as u32, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: smem,
            }
        }

        /// Shared memory of the forward, dQ and dK/dV kernels for head size `d`. The
        /// tensor-core kernels' (attention_tc.cu): two bf16 tiles of [AT][d + 8] (the forward's
        /// and dQ's keys and values, dK/dV's queries and dO), and dK/dV's two [AT] f32.
        fn smem(self, d: usize) -> [u32; 3] {
            match self {
                AttnKernels::Cores => [smem_fwd(d), smem_dq(d), smem_dkv(d)],
                AttnKernels::Tensor => {
                    let tiles = 2 * AT * (d + 8) * 2;
                    [tiles, tiles, tiles + 2 * AT * 4].map(|b| b as u32)
                }
            }
        }

        /// Launches kernel `kernel` (`fwd`, `bwd_dq`, `bwd_dkv`) of this set, for the dtype of
        /// `args[0]` (q).
        fn launch(
            self,
            dev: &CudaDevice,
            kernel: &str,
            n: Dims,
            cfg: LaunchConfig,
            args: &[&Tensor],
            scale: f32,
        ) -> Result<()> {
            let Some(q) = args.first() else {
                candle_core::bail!("attention {kernel}: no arguments");
            };
            let name = self.name(kernel, q.dtype(), n.d);
            launch_from(dev, self.module(), &name, cfg, args, &dims_args(n, scale))
        }
    }

    /// Whether bf16 attention runs attention_tc.cu's kernels where the card can
    /// (`GRPO_GPU_ATTENTION`, read once: `tensor` or unset; `cores` runs kernels.cu's).
    fn tensor_cores_wanted() -> bool {
        static ON: OnceLock<bool> = OnceLock::new();
        *ON.get_or_init(|| match std::env::var("GRPO_GPU_ATTENTION").as_deref() {
            Ok("tensor") | Ok("") | Err(_) => true,
            Ok("cores") => false,
            Ok(other) => {
                tracing::warn!(
                    "GRPO_GPU_ATTENTION={other} is not tensor or cores: using the tensor cores"
                );
                true
            }
        })
    }

    /// Whether this process's card runs attention_tc.cu: compute capability 8.0 or later (bf16
    /// `mma.sync`), the module compiled, and its kernels agree with the CUDA-core ones on a
    /// small problem ([`tensor_core_check`]; a failure is logged once, and the CUDA-core
    /// kernels run). Asked once.
    fn tensor_cores_usable(dev: &CudaDevice) -> bool {
        static OK: OnceLock<bool> = OnceLock::new();
        *OK.get_or_init(|| {
            use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
            let a = CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR;
            let major = dev.cuda_stream().context().attribute(a).unwrap_or(0);
            if major < 8 {
                tracing::info!(
                    "attention: this card (compute capability {major}.x) has no bf16 tensor cores; \
                     the CUDA-core kernels run"
                );
                return false;
            }
            if let Err(e) = gpu_tc_ptx() {
                tracing::warn!(
                    "attention's tensor-core kernels did not compile ({e}); the CUDA-core \
                     kernels run"
                );
                return false;
            }
            match tensor_core_check(dev) {
                Ok(e) if e < TENSOR_CORE_TOLERANCE => {
                    tracing::info!(
                        "attention: bf16 products on tensor cores (attention_tc.cu; against the \
                         CUDA-core kernels at start: {e:.1e})"
                    );
                    true
                }
                Ok(e) => {
                    tracing::warn!(
                        "attention's tensor-core kernels disagree with the CUDA-core ones \
                         ({e:.2e} > {TENSOR_CORE_TOLERANCE}); the CUDA-core kernels run"
                    );
                    false
                }
                Err(e) => {
                    tracing::warn!(
                        "attention's tensor-core kernels failed their check ({e}); the \
                         CUDA-core kernels run"
                    );
                    false
                }
            }
        })
    }

    /// The largest error [`tensor_core_check`] accepts, relative to each tensor's largest value
    /// (bf16 outputs, and probabilities rounded to bf16: ~5e-3 in the emulator's runs).
    const TENSOR_CORE_TOLERANCE: f32 = 3e-2;

    /// attention_tc.cu's kernels against kernels.cu's on this card, once, before either serves
    /// a model: causal attention over 100 queries (two tiles) with grouped heads, bf16, the
    /// output and the three gradients; the largest error relative to each's largest value.
    fn tensor_core_check(dev: &CudaDevice) -> Result<f32> {
        let device = Device::Cuda(dev.clone());
        let (b, h, hkv, s, d) = (2, 4, 2, 100, 64);
        let randn = |shape: (usize, usize, usize, usize)| -> Result<Tensor> {
            Tensor::randn(0f32, 1.0, shape, &device)?.to_dtype(DType::BF16)
        };
        let (q, k, v) = (
            candle_core::Var::from_tensor(&randn((b, h, s, d))?)?,
            candle_core::Var::from_tensor(&randn((b, hkv, s, d))?)?,
            candle_core::Var::from_tensor(&randn((b, hkv, s, d))?)?,
        );
        let gout = Tensor::randn(0f32, 1.0, (b, h, s, d), &device)?;
        let mask = Tensor::zeros((b, 1, s, s), DType::F32, &device)?;
        let scale = 1.0 / (d as f64).sqrt();
        let run = |kernels: AttnKernels| -> Result<Vec<Tensor>> {
            let Some(o) = attention_on(&q, &k, &v, &mask, scale, true, true, kernels)? else {
                candle_core::bail!("the {kernels:?} kernels do not apply to the check's shapes");
            };
            let grads = (o.to_dtype(DType::F32)? * &gout)?.sum_all()?.backward()?;
            let mut out = vec![o.to_dtype(DType::F32)?];
            for x in [&q, &k, &v] {
                let Some(g) = grads.get(x) else {
                    candle_core::bail!("the {kernels:?} kernels gave no gradient");
                };
                out.push(g.to_dtype(DType::F32)?);
            }
            Ok(out)
        };
        let (tc, cores) = (run(AttnKernels::Tensor)?, run(AttnKernels::Cores)?);
        let mut worst = 0f32;
        for (a, e) in tc.iter().zip(&cores) {
            let diff = (a - e)?.abs()?.max_all()?.to_scalar::<f32>()?;
            let top = e.abs()?.max_all()?.to_scalar::<f32>()?.max(1.0);
            worst = worst.max(diff / top);
        }
        Ok(worst)
    }

    /// A fresh tensor for a kernel's output, uninitialized: every kernel here writes each element
    /// of its outputs (kernels.cu; the grids cover them), so no fill is launched before it.
    fn output<S: Into<candle_core::Shape>>(shape: S, dt: DType, dev: &Device) -> Result<Tensor> {
        // SAFETY: only kernel outputs that the launch right after writes in full.
        unsafe { Tensor::empty(shape, dt, dev) }
    }

    /// A kernel's scalar argument.
    enum Scalar {
        I32(i32),
        I64(i64),
        F32(f32),
    }

    /// Runs kernel `name` of kernels.cu over contiguous tensors `args` (inputs, then freshly
    /// made outputs whose storage the kernel writes in place), then `scalars`.
    fn launch(
        dev: &CudaDevice,
        name: &str,
        cfg: LaunchConfig,
        args: &[&Tensor],
        scalars: &[Scalar],
    ) -> Result<()> {
        launch_from(dev, Module::Main, name, cfg, args, scalars)
    }

    /// The two modules of grpo's kernels: kernels.cu's, and attention_tc.cu's tensor-core
    /// attention (compiled for compute_80).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Module {
        Main,
        TensorCores,
    }

    /// [`launch`] of a kernel of `module`.
    fn launch_from(
        dev: &CudaDevice,
        module: Module,
        name: &str,
        cfg: LaunchConfig,
        args: &[&Tensor],
        scalars: &[Scalar],
    ) -> Result<()> {
        let (ptx, module) = match module {
            Module::Main => (ptx(), "grpo_kernels"),
            Module::TensorCores => (gpu_tc_ptx(), "grpo_kernels_tc"),
        };
        let f = match ptx {
            Ok(p) => dev.get_or_load_custom_func(name, module, p)?,
            Err(e) => candle_core::bail!("grpo's GPU kernels ({module}): {e}"),
        };
        if cfg.shared_mem_bytes > 48 << 10 {
            // Above 48 KiB a kernel must opt in to its dynamic shared memory.
            use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
            let a = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            f.set_attribute(a, cfg.shared_mem_bytes as i32).w()?;
        }
        let mut b = f.builder();
        // Each argument's storage guard and view live until the launch.
        let guards: Vec<_> = args.iter().map(|t| t.storage_and_layout()).collect();
        let mut views_f32 = Vec::new();
        let mut views_bf16 = Vec::new();
        let mut views_u32 = Vec::new();
        let mut order = Vec::new();
        for (g, t) in guards.iter().zip(args) {
            let Storage::Cuda(c) = &*g.0 else {
                candle_core::bail!("{name}: a tensor is not on the GPU");
            };
            let off = g.1.start_offset();
            match t.dtype() {
                DType::F32 => {
                    views_f32.push(c.as_cuda_slice::<f32>()?.slice(off..));
                    order.push((DType::F32, views_f32.len() - 1));
                }
                DType::BF16 => {
                    views_bf16.push(c.as_cuda_slice::<half::bf16>()?.slice(off..));
                    order.push((DType::BF16, views_bf16.len() - 1));
                }
                DType::U32 => {
                    views_u32.push(c.as_cuda_slice::<u32>()?.slice(off..));
                    order.push((DType::U32, views_u32.len() - 1));
                }
                other => candle_core::bail!("{name}: unsupported dtype {other:?}"),
            }
        }
        for (dt, i) in &order {
            match dt {
                DType::F32 => b.arg(&views_f32[*i]),
                DType::BF16 => b.arg(&views_bf16[*i]),
                _ => b.arg(&views_u32[*i]),
            };
        }
        for x in scalars {
            match x {
                Scalar::I32(v) => b.arg(v),
                Scalar::I64(v) => b.arg(v),
                Scalar::F32(v) => b.arg(v),
            };
        }
        // SAFETY: the arguments match the kernel's signature (kernels.cu), every tensor is
        // contiguous with the element counts its scalars imply, and the outputs are fresh
        // tensors no one else reads until the launch is done (same stream).
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }

    /// The attention kernels' scalars.
    fn dims_args(n: Dims, scale: f32) -> [Scalar; 5] {
        let i = |x: usize| Scalar::I32(x as i32);
        [i(n.h), i(n.hkv), i(n.s), i(n.tk), Scalar::F32(scale)]
    }

    fn elementwise(n: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (n.div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// `gu` [.., 2I] (gate, then up) -> silu(gate) * up [.., I] in one kernel, recorded in the
    /// graph with a one-kernel backward (where [`takes`] holds; the caller checks).
    pub fn swiglu(gu: &Tensor) -> Result<Tensor> {
        let dims = gu.dims().to_vec();
        let Some((&two_i, lead)) = dims.split_last() else {
            candle_core::bail!("swiglu: a scalar input");
        };
        if two_i % 2 != 0 {
            candle_core::bail!("swiglu: the last dim ({two_i}) must be even");
        }
        let mut out_dims = lead.to_vec();
        out_dims.push(two_i / 2);
        let x = gu.detach().contiguous()?;
        let y = output(out_dims, x.dtype(), x.device())?;
        let n = y.elem_count();
        let kernel = format!("swiglu_fwd_{}", suffix(x.dtype()));
        let scalars = [Scalar::I64(n as i64), Scalar::I32((two_i / 2) as i32)];
        launch(&cuda(&x)?, &kernel, elementwise(n), &[&x, &y], &scalars)?;
        attach(&y, &[gu], Arc::new(SwigluBackward))
    }

    struct SwigluBackward;

    impl Backward for SwigluBackward {
        fn name(&self) -> &'static str {
            "gpu-swiglu"
        }

        fn backward(
            &self,
            inputs: &[Tensor],
            _wanted: &[bool],
            out: &Tensor,
            grad: &Tensor,
        ) -> Result<Vec<Option<Tensor>>> {
            let [gu] = inputs else {
                candle_core::bail!("gpu swiglu: one input expected");
            };
            let _ = out;
            Ok(vec![Some(swiglu_backward(gu, grad)?)])
        }
    }

    /// SwiGLU's backward: `gu` [.., 2I] and the output's gradient `grad` [.., I] -> `dgu`
    /// [.., 2I] in `gu`'s dtype, one kernel.
    pub fn swiglu_backward(gu: &Tensor, grad: &Tensor) -> Result<Tensor> {
        let gu = gu.contiguous()?;
        let g = grad.to_dtype(gu.dtype())?.contiguous()?;
        let dgu = output(gu.shape(), gu.dtype(), gu.device())?;
        let (n, inter) = (g.elem_count(), g.dim(candle_core::D::Minus1)?);
        if 2 * n != gu.elem_count() {
            candle_core::bail!(
                "swiglu backward: {n} gradients for {} inputs",
                gu.elem_count()
            );
        }
        let kernel = format!("swiglu_bwd_{}", suffix(gu.dtype()));
        let scalars = [Scalar::I64(n as i64), Scalar::I32(inter as i32)];
        launch(
            &cuda(&gu)?,
            &kernel,
            elementwise(n),
            &[&gu, &g, &dgu],
            &scalars,
        )?;
        Ok(dgu)
    }

    /// Whether the RMSNorm kernels take `x` and `w` (under [`crate::kernels::Compute::Gpu`]): on
    /// an H200 they took a 1.7B layer's forward + backward from 39 to 29 ms without attention
    /// (bench/README.md).
    pub fn rms_norm_takes(x: &Tensor, w: &Tensor) -> bool {
        takes(x) && w.dtype() == x.dtype() && w.rank() == 1
    }

    /// A block of 256 threads per row (`NORM_THREADS` in kernels.cu) and its reduction buffer.
    fn norm_config(rows: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 256 * 4,
        }
    }

    /// RMSNorm of `x` [.., H] by `w` [H] as HF computes it (f32 statistics, the normalized row
    /// rounded to `x`'s dtype, then times `w`), one kernel each way; the backward keeps only `x`
    /// and `w` (where [`rms_norm_takes`] holds; the caller checks).
    pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
        let y = rms_norm_raw(x, w, eps)?;
        attach(&y, &[x, w], Arc::new(RmsNormBackward { eps }))
    }

    /// [`rms_norm`]'s forward kernel alone: no graph.
    pub fn rms_norm_raw(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
        let h = x.dim(candle_core::D::Minus1)?;
        let rows = x.elem_count() / h.max(1);
        let (xd, wd) = (x.detach().contiguous()?, w.detach().contiguous()?);
        let y = output(x.shape(), x.dtype(), x.device())?;
        let kernel = format!("rms_norm_fwd_{}", suffix(x.dtype()));
        let scalars = [Scalar::I32(h as i32), Scalar::F32(eps as f32)];
        launch(
            &cuda(x)?,
            &kernel,
            norm_config(rows),
            &[&xd, &wd, &y],
            &scalars,
        )?;
        Ok(y)
    }

    /// [`rms_norm`]'s backward: the gradients of `x` [.., H] (its dtype) and of `w` [H] (its
    /// dtype) from the output's gradient `grad`, one kernel and one GEMM (no graph).
    pub fn rms_norm_backward(
        x: &Tensor,
        w: &Tensor,
        grad: &Tensor,
        eps: f64,
    ) -> Result<(Tensor, Tensor)> {
        let h = w.dim(0)?;
        let rows = x.elem_count() / h.max(1);
        let (x, w) = (x.contiguous()?, w.contiguous()?);
        let g = grad.to_dtype(x.dtype())?.contiguous()?;
        let dx = output(x.shape(), x.dtype(), x.device())?;
        let gn = output((rows, h), DType::F32, x.device())?; // [N, H] f32
        let kernel = format!("rms_norm_bwd_{}", suffix(x.dtype()));
        let scalars = [Scalar::I32(h as i32), Scalar::F32(eps as f32)];
        launch(
            &cuda(&x)?,
            &kernel,
            norm_config(rows),
            &[&x, &w, &g, &dx, &gn],
            &scalars,
        )?;
        // dw: the column sums of gn, as one GEMM.
        let ones = Tensor::ones((1, rows), DType::F32, x.device())?;
        let dw = ones.matmul(&gn)?.reshape(h)?.to_dtype(w.dtype())?; // [H]
        Ok((dx, dw))
    }

    struct RmsNormBackward {
        eps: f64,
    }

    impl Backward for RmsNormBackward {
        fn name(&self) -> &'static str {
            "gpu-rms-norm"
        }

        fn backward(
            &self,
            inputs: &[Tensor],
            _wanted: &[bool],
            _out: &Tensor,
            grad: &Tensor,
        ) -> Result<Vec<Option<Tensor>>> {
            let [x, w] = inputs else {
                candle_core::bail!("gpu rms-norm: two inputs expected");
            };
            let (dx, dw) = rms_norm_backward(x, w, grad, self.eps)?;
            Ok(vec![Some(dx), Some(dw)])
        }
    }

    /// A decoding step's attention kernel (kernels.cu).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum DecodeKernel {
        /// A block per (row, kv head) that reads each key and value row once for the kv head's
        /// query heads, scores in shared memory, a two-pass softmax (`attn_decode`).
        Block,
        /// A warp per (row, query head), one pass with an online softmax, no shared memory and
        /// no block barrier (`attn_decode_warp`).
        Warp,
        /// Candle's batched matmuls (the caller's).
        Ops,
    }

    /// Single-query attention for a decoding step: `q` [B, H, 1, D], `k`/`v` [B, Hkv, Tk, D]
    /// views of the KV cache (rows of D contiguous elements, the same strides for both), `mask`
    /// additive [B, 1, 1, Tk] f32 -> [B, 1, H*D], one kernel reading the cache in 16-byte
    /// loads (`GRPO_GPU_DECODE` chooses which, [`DecodeKernel`]). With `shared` (each row's
    /// leader [B] u32 on the device, and an end slot), slots before the end are read from the
    /// row's leader: the rows of one prompt hold the same keys and values there, and read one
    /// copy between them. `None` where it does not apply (rows not 16-byte aligned, scores
    /// beyond the shared memory, or `GRPO_GPU_DECODE=ops`).
    pub fn decode_attention(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
        scale: f64,
        shared: Option<(&Tensor, usize)>,
    ) -> Result<Option<Tensor>> {
        decode_attention_with(q, k, v, mask, scale, decode_kernel(), shared)
    }

    /// [`decode_attention`] with the given kernel (for timing and checking both).
    pub fn decode_attention_with(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
        scale: f64,
        kernel: DecodeKernel,
        shared: Option<(&Tensor, usize)>,
    ) -> Result<Option<Tensor>> {
        let (b, h, s, d) = q.dims4()?;
        let (hkv, tk) = (k.dim(1)?, k.dim(2)?);
        let dt = q.dtype();
        let (ks, vs) = (k.stride(), v.stride());
        let vec = 16 / dt.size_in_bytes(); // elements per 16-byte load
        let aligned = |t: &Tensor| {
            t.layout().start_offset().is_multiple_of(vec)
                && t.stride()[..2].iter().all(|x| x.is_multiple_of(vec))
        };
        let g = h / hkv.max(1);
        let rows = 256 / (d / vec).max(1); // slot groups of the value pass
        let smem = match kernel {
            DecodeKernel::Warp => 0,
            _ => ((g * d + g * tk + 256 + rows * d + g) * 4) as u32,
        };
        let applies = takes(q)
            && kernel != DecodeKernel::Ops
            && s == 1
            && k.dtype() == dt
            && v.dtype() == dt
            && HEAD_DIMS.contains(&d)
            && hkv > 0
            && h % hkv == 0
            && k.dims() == v.dims()
            && ks == vs
            && ks[3] == 1
            && (tk == 1 || ks[2] == d)
            && aligned(k)
            && aligned(v)
            && mask.elem_count() == b * tk
            && shared.is_none_or(|(l, end)| {
                l.dtype() == DType::U32
                    && l.elem_count() == b
                    && end <= tk
                    && l.device().same_device(q.device())
            })
            && smem <= (48 << 10).max(smem_limit(&cuda(q)?));
        if !applies {
            return Ok(None);
        }
        let q = q.contiguous()?;
        let mask = mask
            .broadcast_as((b, 1, 1, tk))?
            .to_dtype(DType::F32)?
            .contiguous()?;
        let o = output((b, 1, h * d), dt, q.device())?;
        // Without a shared prompt, a leader tensor is still an argument: no slot is below 0.
        let (leader, end) = match shared {
            Some((l, e)) => (l.contiguous()?, e),
            None => (Tensor::zeros(1, DType::U32, q.device())?, 0),
        };
        let i = |x: usize| Scalar::I32(x as i32);
        let (ks0, ks1, sc) = (
            Scalar::I64(ks[0] as i64),
            Scalar::I64(ks[1] as i64),
            Scalar::F32(scale as f32),
        );
        let (kernel_name, cfg, scalars) = match kernel {
            DecodeKernel::Warp => (
                name("decode_warp", dt, d),
                LaunchConfig {
                    grid_dim: ((b * h).div_ceil(4) as u32, 1, 1),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                },
                vec![i(h), i(hkv), i(b), i(tk), ks0, ks1, sc, i(end)],
            ),
            _ => (
                name("decode", dt, d),
                LaunchConfig {
                    grid_dim: ((b * hkv) as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: smem,
                },
                vec![i(h), i(hkv), i(tk), ks0, ks1, sc, i(end)],
            ),
        };
        launch(
            &cuda(&q)?,
            &kernel_name,
            cfg,
            &[&q, k, v, &mask, &leader, &o],
            &scalars,
        )?;
        Ok(Some(o))
    }

    /// A decoding step's q, k and v in one kernel: `joined` [B, 1, (H + 2 Hkv) D] (the joined
    /// projection's output, unit last stride), `cos`/`sin` [B, 1, D/2] -> q [B, H, 1, D]
    /// rotated; k rotated and v written into slot `slot` of the caches `kc`/`vc`
    /// [B, Hkv, slots, D] (contiguous) in place. Replaces two RoPE launches, a copy of v and
    /// the caches' two writes. `None` (nothing written) where it does not apply.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_append(
        joined: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        heads: usize,
        kv_heads: usize,
        kc: &Tensor,
        vc: &Tensor,
        slot: usize,
    ) -> Result<Option<Tensor>> {
        let (Ok((b, t, w)), Ok((kb, hkv, slots, d))) = (joined.dims3(), kc.dims4()) else {
            return Ok(None);
        };
        let dt = joined.dtype();
        let same = |x: &Tensor| x.dtype() == dt && x.device().same_device(joined.device());
        let applies = takes(joined)
            && t == 1
            && d.is_multiple_of(2)
            && hkv == kv_heads
            && w == (heads + 2 * hkv) * d
            && kb == b
            && slot < slots
            && kc.dims() == vc.dims()
            && kc.is_contiguous()
            && vc.is_contiguous()
            && [kc, vc, cos, sin].iter().all(|x| same(x))
            && cos.dims() == [b, 1, d / 2]
            && sin.dims() == [b, 1, d / 2]
            && joined.stride()[2] == 1;
        if !applies {
            return Ok(None);
        }
        let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
        let q = output((b, heads, 1, d), dt, joined.device())?;
        let n = b * (heads + 2 * hkv) * d / 2;
        let i = |x: usize| Scalar::I32(x as i32);
        let scalars = [
            Scalar::I64(n as i64),
            i(heads),
            i(hkv),
            i(d),
            Scalar::I64(joined.stride()[0] as i64),
            Scalar::I64((slots * d) as i64),
            i(slot),
        ];
        launch(
            &cuda(joined)?,
            &format!("rope_append_{}", suffix(dt)),
            elementwise(n),
            &[&joined.detach(), &cos, &sin, &q, kc, vc],
            &scalars,
        )?;
        Ok(Some(q))
    }

    /// A decoding step's residual add and the RMSNorm after it, one kernel: `x`, `a` [.., H],
    /// weight `w` [H] -> (x + a, RMSNorm(x + a) w as [`rms_norm`] computes it). Not recorded for
    /// a backward; `None` where it does not apply.
    pub fn add_rms_norm(
        x: &Tensor,
        a: &Tensor,
        w: &Tensor,
        eps: f64,
    ) -> Result<Option<(Tensor, Tensor)>> {
        let h = x.dim(candle_core::D::Minus1)?;
        if !(rms_norm_takes(x, w) && a.dtype() == x.dtype() && a.dims() == x.dims())
            || w.dim(0)? != h
        {
            return Ok(None);
        }
        let rows = x.elem_count() / h.max(1);
        let (xd, ad, wd) = (x.contiguous()?, a.contiguous()?, w.contiguous()?);
        let (sum, y) = (
            output(x.shape(), x.dtype(), x.device())?,
            output(x.shape(), x.dtype(), x.device())?,
        );
        let scalars = [Scalar::I32(h as i32), Scalar::F32(eps as f32)];
        launch(
            &cuda(x)?,
            &format!("add_rms_norm_{}", suffix(x.dtype())),
            norm_config(rows),
            &[&xd, &ad, &wd, &sum, &y],
            &scalars,
        )?;
        Ok(Some((sum, y)))
    }

    /// What runs a decoding step's attention (`GRPO_GPU_DECODE`, read once): `warp` (unset)
    /// the warp kernel, `kernel` the block kernel, `ops` candle's batched matmuls. On an H200
    /// (2026-11-28, `grpo bench ops`, 46 rows x 304 slots of the 1.7B shape) the warp kernel
    /// took 0.04 ms against the block kernel's 0.07 (0.04 and 0.06 with a shared prompt), and
    /// the 1.7B kit's decoding fell from 1.42 to 1.15 s a step with it.
    fn decode_kernel() -> DecodeKernel {
        static K: OnceLock<DecodeKernel> = OnceLock::new();
        *K.get_or_init(|| match std::env::var("GRPO_GPU_DECODE").as_deref() {
            Ok("ops") => DecodeKernel::Ops,
            Ok("kernel") => DecodeKernel::Block,
            Ok("warp") | Ok("") | Err(_) => DecodeKernel::Warp,
            Ok(other) => {
                tracing::warn!(
                    "GRPO_GPU_DECODE={other} is not warp, kernel or ops: using the warp kernel"
                );
                DecodeKernel::Warp
            }
        })
    }

    /// AdamW in place, one kernel per parameter with its scalars as arguments (candle ops took
    /// ~20 launches and 7 scalar uploads a parameter): `p` (the parameter's storage), `m`, `v`
    /// updated; `g` read; all f32, contiguous, on the GPU. Returns false (nothing done) where it
    /// does not apply, so the caller runs its candle ops.
    pub fn adamw_step(
        p: &Tensor,
        g: &Tensor,
        m: &Tensor,
        v: &Tensor,
        s: &super::AdamWScalars,
    ) -> Result<bool> {
        let n = p.elem_count();
        let fits = |t: &Tensor| {
            t.device().is_cuda()
                && t.dtype() == DType::F32
                && t.is_contiguous()
                && t.elem_count() == n
        };
        if !(fits(p) && fits(g) && fits(m) && fits(v)) {
            return Ok(false);
        }
        let f = Scalar::F32;
        let scalars = [
            Scalar::I64(n as i64),
            f(s.grad_scale),
            f(s.decay),
            f(s.beta1),
            f(s.beta2),
            f(s.eps),
            f(s.bias_correction2_sqrt),
            f(s.step_size),
        ];
        // The kernel writes p, m and v in place: the same storage the parameter's `Var::set`
        // would have written into.
        launch(
            &cuda(p)?,
            "adamw_f32",
            elementwise(n),
            &[p, g, m, v],
            &scalars,
        )?;
        Ok(true)
    }

    /// `acc += x` in place: `acc` f32 and `x` bf16, contiguous, of one element count (one
    /// kernel). Returns whether it ran (`false`: the tensors do not fit).
    pub fn add_into_f32(acc: &Tensor, x: &Tensor) -> Result<bool> {
        let n = acc.elem_count();
        let ok = acc.device().is_cuda()
            && acc.dtype() == DType::F32
            && x.dtype() == DType::BF16
            && acc.is_contiguous()
            && x.is_contiguous()
            && x.elem_count() == n;
        if !ok {
            return Ok(false);
        }
        // The kernel writes `acc` in place (the caller owns it exclusively).
        launch(
            &cuda(acc)?,
            "acc_add_bf16",
            elementwise(n),
            &[acc, x],
            &[Scalar::I64(n as i64)],
        )?;
        Ok(true)
    }

    /// Blocks of the sums of squares' fixed grid ([`sum_squares`]).
    const SUMSQ_BLOCKS: usize = 256;

    /// Each tensor's sum of squares (f64, from f32 partial sums added in a fixed order), the
    /// gradients of a step on the GPU: one kernel per tensor over a fixed grid and one read of
    /// all the partials (candle's `sum_all` ran on one block: 0.15 s for a 1.7B model's
    /// gradients on an H200). `None` where grpo's kernels do not take them.
    pub fn sum_squares(ts: &[Tensor]) -> Result<Option<Vec<f64>>> {
        let Some(first) = ts.first() else {
            return Ok(Some(Vec::new()));
        };
        if !(takes(first) && ts.iter().all(|t| t.device().same_device(first.device()))) {
            return Ok(None);
        }
        let dev = first.device();
        let partial = output((ts.len(), SUMSQ_BLOCKS), DType::F32, dev)?; // [k, blocks] f32
        for (i, t) in ts.iter().enumerate() {
            let x = t.to_dtype(DType::F32)?.contiguous()?;
            let n = x.elem_count();
            let out = partial.narrow(0, i, 1)?;
            let cfg = LaunchConfig {
                grid_dim: (SUMSQ_BLOCKS as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 256 * 4,
            };
            launch(
                &cuda(&x)?,
                "sumsq_f32",
                cfg,
                &[&x, &out],
                &[Scalar::I64(n as i64)],
            )?;
        }
        let rows = partial.to_vec2::<f32>()?;
        Ok(Some(
            rows.iter()
                .map(|r| r.iter().fold(0f64, |a, &p| a + p as f64))
                .collect(),
        ))
    }

    /// Whether the LM head's log-softmax kernels take `logits` [c, V] (on a GPU, f32 or bf16).
    pub fn head_takes(logits: &Tensor) -> bool {
        takes(logits) && logits.rank() == 2
    }

    /// Row of `targets` [c] u32 in `logits` [c, V] -> ([c, 2] f32: log-prob and entropy of
    /// `softmax(logits * inv_t)`, [c, 1] f32 log-sum-exps), one kernel (no graph).
    pub fn head_logprobs(
        logits: &Tensor,
        targets: &Tensor,
        inv_t: f32,
    ) -> Result<(Tensor, Tensor)> {
        let (c, v) = logits.dims2()?;
        let (z, y) = (
            logits.contiguous()?,
            targets.to_dtype(DType::U32)?.contiguous()?,
        );
        let out = output((c, 2), DType::F32, z.device())?;
        let lse = output((c, 1), DType::F32, z.device())?;
        let kernel = format!("head_fwd_{}", suffix(z.dtype()));
        let scalars = [Scalar::I32(v as i32), Scalar::F32(inv_t)];
        launch(
            &cuda(&z)?,
            &kernel,
            norm_config(c),
            &[&z, &y, &out, &lse],
            &scalars,
        )?;
        Ok((out, lse))
    }

    /// The gradient of `logits` [c, V] (in their dtype) from the rows' gradients `g` [c, 2] of
    /// [`head_logprobs`]'s `out` (the entropy's only `with_entropy`), given its `out` and `lse`.
    pub fn head_logprobs_backward(
        logits: &Tensor,
        targets: &Tensor,
        lse: &Tensor,
        g: &Tensor,
        out: &Tensor,
        inv_t: f32,
        with_entropy: bool,
    ) -> Result<Tensor> {
        let (c, v) = logits.dims2()?;
        let (z, y) = (
            logits.contiguous()?,
            targets.to_dtype(DType::U32)?.contiguous()?,
        );
        let f = |t: &Tensor| t.to_dtype(DType::F32)?.contiguous();
        let (lse, g, out) = (f(lse)?, f(g)?, f(out)?);
        let dz = output((c, v), z.dtype(), z.device())?;
        let kernel = format!("head_bwd_{}", suffix(z.dtype()));
        let scalars = [
            Scalar::I32(v as i32),
            Scalar::F32(inv_t),
            Scalar::I32(with_entropy as i32),
        ];
        launch(
            &cuda(&z)?,
            &kernel,
            norm_config(c),
            &[&z, &y, &lse, &g, &out, &dz],
            &scalars,
        )?;
        Ok(dz)
    }

    /// Rotate-half RoPE of `x` [B, T, H*D] (a view of the joined projection: rows a stride
    /// apart, last dim contiguous) by tables `cos`/`sin` [B, T, D/2] -> [B, H, T, D] contiguous,
    /// one kernel each way (recorded in the graph when `x` is), or `None` where the kernel does
    /// not apply (the caller runs candle ops).
    pub fn rope_heads(
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        heads: usize,
    ) -> Result<Option<Tensor>> {
        match rope_heads_raw(x, cos, sin, heads)? {
            Some((y, cos, sin)) => Ok(Some(attach(&y, &[x], Arc::new(RopeBackward { cos, sin }))?)),
            None => Ok(None),
        }
    }

    /// [`rope_heads`]'s forward kernel alone (no graph): the result and the contiguous tables
    /// its backward ([`rope_backward`]) takes.
    pub fn rope_heads_raw(
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        heads: usize,
    ) -> Result<Option<(Tensor, Tensor, Tensor)>> {
        let Ok((b, t, hd)) = x.dims3() else {
            return Ok(None);
        };
        let d = hd / heads.max(1);
        let st = x.stride();
        let applies = takes(x)
            && heads > 0
            && d.is_multiple_of(2)
            && d * heads == hd
            && cos.dtype() == x.dtype()
            && sin.dtype() == x.dtype()
            && cos.dims() == [b, t, d / 2]
            && sin.dims() == [b, t, d / 2]
            && st[2] == 1
            && (b == 1 || t == 1 || st[0] == t * st[1]);
        if !applies {
            return Ok(None);
        }
        let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
        let y = output((b, heads, t, d), x.dtype(), x.device())?;
        let n = y.elem_count() / 2;
        let xs = if t == 1 { st[0] } else { st[1] }; // elements from one (b, t) row to the next
        let [a, b_, c, e] = rope_scalars(n, t, heads, d);
        let scalars = [a, b_, c, e, Scalar::I64(xs as i64)];
        let kernel = format!("rope_fwd_{}", suffix(x.dtype()));
        // The view is passed from its first element with its row stride (`launch` reads the
        // storage from the layout's start offset).
        launch(
            &cuda(x)?,
            &kernel,
            elementwise(n),
            &[&x.detach(), &cos, &sin, &y],
            &scalars,
        )?;
        Ok(Some((y, cos, sin)))
    }

    /// RoPE's backward: the gradient `grad` [B, H, T, D] of [`rope_heads_raw`]'s output ->
    /// the input's [B, T, H*D] (contiguous), one kernel; `cos`/`sin` as that returned them.
    pub fn rope_backward(grad: &Tensor, cos: &Tensor, sin: &Tensor, dt: DType) -> Result<Tensor> {
        let (b, h, t, d) = grad.dims4()?;
        let g = grad.to_dtype(dt)?.contiguous()?;
        let dx = output((b, t, h * d), dt, g.device())?;
        let n = g.elem_count() / 2;
        let scalars = rope_scalars(n, t, h, d);
        let kernel = format!("rope_bwd_{}", suffix(dt));
        launch(
            &cuda(&g)?,
            &kernel,
            elementwise(n),
            &[&g, cos, sin, &dx],
            &scalars,
        )?;
        Ok(dx)
    }

    /// The RoPE kernels' shared scalars: pairs, positions, heads, head size.
    fn rope_scalars(n: usize, t: usize, h: usize, d: usize) -> [Scalar; 4] {
        let i = |x: usize| Scalar::I32(x as i32);
        [Scalar::I64(n as i64), i(t), i(h), i(d)]
    }

    struct RopeBackward {
        cos: Tensor,
        sin: Tensor,
    }

    impl Backward for RopeBackward {
        fn name(&self) -> &'static str {
            "gpu-rope"
        }

        fn backward(
            &self,
            inputs: &[Tensor],
            _wanted: &[bool],
            out: &Tensor,
            grad: &Tensor,
        ) -> Result<Vec<Option<Tensor>>> {
            let [x] = inputs else {
                candle_core::bail!("gpu rope: one input expected");
            };
            let _ = out;
            Ok(vec![Some(rope_backward(
                grad,
                &self.cos,
                &self.sin,
                x.dtype(),
            )?)])
        }
    }

    /// `q` [B, H, S, D], `k`/`v` [B, Hkv, Tk, D], `mask` additive [B, 1, S, Tk] f32, causal ->
    /// [B, H, S, D], or `None` where the kernels do not apply (the caller runs candle ops).
    /// With `record`, the result is a node of the graph whose backward is the two backward
    /// kernels.
    pub fn attention(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
        scale: f64,
        record: bool,
    ) -> Result<Option<Tensor>> {
        attention_with(
            q,
            k,
            v,
            mask,
            scale,
            record,
            gpu_kernels() == GpuKernels::All,
            tensor_cores_wanted(),
        )
    }

    /// [`attention`] recorded with attention_tc.cu's kernels, forward and backward, whatever
    /// `GRPO_GPU_ATTENTION` says: `None` unless the tensors are bf16 on a card that runs them
    /// (and they passed their check at start). For checking them.
    pub fn attention_tensor_cores(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
        scale: f64,
    ) -> Result<Option<Tensor>> {
        if q.dtype() != DType::BF16 || !tensor_cores_usable(&cuda(q)?) {
            return Ok(None);
        }
        attention_with(q, k, v, mask, scale, true, true, true)
    }

    /// [`attention`] recorded with kernels.cu's CUDA-core kernels, forward and backward,
    /// whatever `GRPO_GPU_ATTENTION` says. For checking them.
    pub fn attention_cuda_cores(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
        scale: f64,
    ) -> Result<Option<Tensor>> {
        attention_with(q, k, v, mask, scale, true, true, false)
    }

    /// [`attention`] recorded with the chunked candle-op backward whatever `GRPO_GPU_KERNELS`
    /// says (unless `off`): what `forward` runs, for checking it.
    pub fn attention_chunked_backward(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
        scale: f64,
    ) -> Result<Option<Tensor>> {
        attention_with(q, k, v, mask, scale, true, false, false)
    }

    /// The attention kernels' forward (and, with `record`, their backward: the kernels' with
    /// `backward_kernels`, else the chunked candle ops). `tensor_cores`: attention_tc.cu's
    /// kernels where the tensors are bf16 and the card runs them.
    #[allow(clippy::too_many_arguments)]
    fn attention_with(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
        scale: f64,
        record: bool,
        backward_kernels: bool,
        tensor_cores: bool,
    ) -> Result<Option<Tensor>> {
        if !takes(q) {
            return Ok(None);
        }
        let kernels = kernel_set(q, tensor_cores)?;
        attention_on(q, k, v, mask, scale, record, backward_kernels, kernels)
    }

    /// The attention kernels for `q`: attention_tc.cu's where `tensor_cores` is asked, `q` is
    /// bf16 and the card runs them, else kernels.cu's.
    fn kernel_set(q: &Tensor, tensor_cores: bool) -> Result<AttnKernels> {
        let bf16 = q.dtype() == DType::BF16;
        Ok(
            match tensor_cores && bf16 && tensor_cores_usable(&cuda(q)?) {
                true => AttnKernels::Tensor,
                false => AttnKernels::Cores,
            },
        )
    }

    /// [`attention_with`] with its kernel set chosen.
    #[allow(clippy::too_many_arguments)]
    fn attention_on(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
        scale: f64,
        record: bool,
        backward_kernels: bool,
        kernels: AttnKernels,
    ) -> Result<Option<Tensor>> {
        let Some((o, saved, backward_kernels)) =
            attention_forward(q, k, v, mask, scale, backward_kernels, kernels)?
        else {
            return Ok(None);
        };
        if !record {
            return Ok(Some(o));
        }
        if !backward_kernels {
            let n = saved.n;
            let lse = saved.lse.reshape((n.b, n.hkv, n.h / n.hkv, n.s, 1))?;
            let rec =
                super::super::chunked_attention::record(&o, q, k, v, &saved.mask, scale, &lse)?;
            return Ok(Some(rec));
        }
        Ok(Some(attach(&o, &[q, k, v], Arc::new(GpuAttention(saved)))?))
    }

    /// The attention kernels' forward without a graph, for a caller that runs the backward
    /// itself ([`AttnSaved::backward`]): the output [B, H, S, D] and what the backward kernels
    /// take. `None` where the kernels (forward and backward, under `GRPO_GPU_KERNELS=all`) do
    /// not take the shapes.
    pub fn attention_raw(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
        scale: f64,
    ) -> Result<Option<(Tensor, AttnSaved)>> {
        if !takes(q) || gpu_kernels() != GpuKernels::All {
            return Ok(None);
        }
        let kernels = kernel_set(q, tensor_cores_wanted())?;
        match attention_forward(q, k, v, mask, scale, true, kernels)? {
            Some((o, saved, true)) => Ok(Some((o, saved))),
            _ => Ok(None),
        }
    }

    /// The forward kernel of `kernels`: the output, what the backward takes, and whether the
    /// backward kernels fit the card's shared memory (when `backward_kernels` is asked).
    fn attention_forward(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
        scale: f64,
        backward_kernels: bool,
        kernels: AttnKernels,
    ) -> Result<Option<(Tensor, AttnSaved, bool)>> {
        let (b, h, s, d) = q.dims4()?;
        let (hkv, tk) = (k.dim(1)?, k.dim(2)?);
        let dt = q.dtype();
        let applies = takes(q)
            && k.dtype() == dt
            && v.dtype() == dt
            && HEAD_DIMS.contains(&d)
            && hkv > 0
            && h % hkv == 0
            && s <= tk;
        if !applies {
            return Ok(None);
        }
        let dev = cuda(q)?;
        let [smem_fwd, smem_dq, smem_dkv] = kernels.smem(d);
        let limit = smem_limit(&dev);
        let backward_kernels = backward_kernels && smem_dq.max(smem_dkv) <= limit;
        if smem_fwd > limit {
            return Ok(None);
        }
        let n = Dims {
            b,
            h,
            hkv,
            s,
            tk,
            d,
        };
        let mask = mask
            .broadcast_as((b, 1, s, tk))?
            .to_dtype(DType::F32)?
            .contiguous()?;
        let (qd, kd, vd) = (
            q.detach().contiguous()?,
            k.detach().contiguous()?,
            v.detach().contiguous()?,
        );
        let o = output((b, h, s, d), dt, q.device())?;
        let lse = output((b, h, s), DType::F32, q.device())?;
        kernels.launch(
            &dev,
            "fwd",
            n,
            kernels.config(s, b * h, smem_fwd),
            &[&qd, &kd, &vd, &mask, &o, &lse],
            scale as f32,
        )?;
        let saved = AttnSaved {
            mask,
            scale: scale as f32,
            lse,
            n,
            kernels,
        };
        Ok(Some((o, saved, backward_kernels)))
    }

    /// What attention's backward kernels take from its forward.
    pub struct AttnSaved {
        /// [B, 1, S, Tk] f32, contiguous.
        mask: Tensor,
        scale: f32,
        /// [B, H, S] f32.
        lse: Tensor,
        n: Dims,
        /// The forward's kernel set, whose backward kernels run.
        kernels: AttnKernels,
    }

    impl AttnSaved {
        /// The gradients of `q`, `k` and `v` (the forward's inputs) from its output `out` and
        /// the output's gradient `grad`: the dQ kernel, then the dK/dV kernel (no graph).
        pub fn backward(
            &self,
            q: &Tensor,
            k: &Tensor,
            v: &Tensor,
            out: &Tensor,
            grad: &Tensor,
        ) -> Result<(Tensor, Tensor, Tensor)> {
            let n = self.n;
            let dt = q.dtype();
            let dev = cuda(q)?;
            let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
            let (o, g) = (out.contiguous()?, grad.to_dtype(dt)?.contiguous()?);
            let delta = output((n.b, n.h, n.s), DType::F32, q.device())?;
            let dq = output(q.shape(), dt, q.device())?;
            let dk = output(k.shape(), dt, q.device())?;
            let dv = output(v.shape(), dt, q.device())?;
            let kernels = self.kernels;
            let [_, smem_dq, smem_dkv] = kernels.smem(n.d);
            kernels.launch(
                &dev,
                "bwd_dq",
                n,
                kernels.config(n.s, n.b * n.h, smem_dq),
                &[&q, &k, &v, &self.mask, &o, &g, &self.lse, &delta, &dq],
                self.scale,
            )?;
            kernels.launch(
                &dev,
                "bwd_dkv",
                n,
                kernels.config(n.tk, n.b * n.hkv, smem_dkv),
                &[&q, &k, &v, &self.mask, &g, &self.lse, &delta, &dk, &dv],
                self.scale,
            )?;
            Ok((dq, dk, dv))
        }
    }

    /// The attention kernels' output recorded in the graph, their backward kernels its backward.
    struct GpuAttention(AttnSaved);

    impl Backward for GpuAttention {
        fn name(&self) -> &'static str {
            "gpu-attention"
        }

        fn backward(
            &self,
            inputs: &[Tensor],
            _wanted: &[bool],
            out: &Tensor,
            grad: &Tensor,
        ) -> Result<Vec<Option<Tensor>>> {
            let [q, k, v] = inputs else {
                candle_core::bail!("gpu attention: three inputs expected");
            };
            let (dq, dk, dv) = self.0.backward(q, k, v, out, grad)?;
            Ok(vec![Some(dq), Some(dk), Some(dv)])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor, Var};

    fn host(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    /// The largest |a - e|.
    fn err(a: &[f32], e: &[f32]) -> f32 {
        a.iter()
            .zip(e)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    }

    /// The kernels' twin equals the chunked candle-op attention (the portable path's), output
    /// and every gradient, with grouped heads, a key prefix, left padding and several chunks.
    #[test]
    fn the_kernels_twin_equals_the_chunked_path_with_its_gradients() {
        let dev = Device::Cpu;
        for &(b, h, hkv, s, tk, d) in &[(2, 6, 2, 7, 9, 8), (1, 4, 4, 12, 12, 16)] {
            let n = Dims {
                b,
                h,
                hkv,
                s,
                tk,
                d,
            };
            let q = Var::randn(0f32, 1.0, (b, h, s, d), &dev).unwrap();
            let k = Var::randn(0f32, 1.0, (b, hkv, tk, d), &dev).unwrap();
            let v = Var::randn(0f32, 1.0, (b, hkv, tk, d), &dev).unwrap();
            let gout = Tensor::randn(0f32, 1.0, (b, h, s, d), &dev).unwrap();
            // Causal (the mask callers pass is), and the last row left-padded by one slot (no
            // query sees only padding).
            let mut m = vec![0f32; b * s * tk];
            for bi in 0..b {
                for i in 0..s {
                    for j in 0..tk {
                        if j > tk - s + i || (b > 1 && bi == b - 1 && j == 0) {
                            m[(bi * s + i) * tk + j] = super::super::fused_attention::MASK_VALUE;
                        }
                    }
                }
            }
            let mask = Tensor::from_vec(m.clone(), (b, 1, s, tk), &dev).unwrap();
            let scale = 0.3f64;
            let want = super::super::chunked_attention::attention(
                &q,
                &k,
                &v,
                &mask,
                scale,
                true,
                crate::kernels::Compute::Portable,
            )
            .unwrap();
            let grads = (&want * &gout)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let (qh, kh, vh) = (host(&q), host(&k), host(&v));
            let (o, lse) = twin_forward(&qh, &kh, &vh, &m, n, scale as f32);
            let (dq, dk, dv) =
                twin_backward(&qh, &kh, &vh, &m, &o, &host(&gout), &lse, n, scale as f32);
            let close = |a: &[f32], e: &[f32], what: &str| {
                let worst = err(a, e);
                assert!(worst < 1e-5, "{what} ({b}x{h}/{hkv}x{s}x{tk}x{d}): {worst}");
            };
            close(&o, &host(&want), "output");
            // The twin's output and log-sum-exps recorded with the chunked backward (the GPU's
            // GRPO_GPU_KERNELS=forward) give the same gradients.
            let t = |x: Vec<f32>, shape: &[usize]| Tensor::from_vec(x, shape, &dev).unwrap();
            let rec = super::super::chunked_attention::record(
                &t(o.clone(), &[b, h, s, d]),
                &q,
                &k,
                &v,
                &mask,
                scale,
                &t(lse.clone(), &[b, h, s]),
            )
            .unwrap();
            let rg = (&rec * &gout)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            for (x, what) in [
                (&q, "recorded dq"),
                (&k, "recorded dk"),
                (&v, "recorded dv"),
            ] {
                close(
                    &host(rg.get(x).unwrap()),
                    &host(grads.get(x).unwrap()),
                    what,
                );
            }
            close(&dq, &host(grads.get(&q).unwrap()), "dq");
            close(&dk, &host(grads.get(&k).unwrap()), "dk");
            close(&dv, &host(grads.get(&v).unwrap()), "dv");
        }
    }

    /// The SwiGLU kernels' twin equals candle's silu(gate) * up and its autograd gradient.
    #[test]
    fn the_swiglu_twin_equals_candle_ops_with_the_gradient() {
        let dev = Device::Cpu;
        let (n, inter) = (5, 12);
        let gu = Var::randn(0f32, 2.0, (n, 2 * inter), &dev).unwrap();
        let dy = Tensor::randn(0f32, 1.0, (n, inter), &dev).unwrap();
        let want = (gu.narrow(1, 0, inter).unwrap().silu().unwrap()
            * gu.narrow(1, inter, inter).unwrap())
        .unwrap();
        let grads = (&want * &dy)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let (y, dgu) = twin_swiglu(&host(&gu), &host(&dy), inter);
        assert!(err(&y, &host(&want)) < 1e-5);
        assert!(err(&dgu, &host(grads.get(&gu).unwrap())) < 1e-5);
    }

    /// The RoPE kernels' twin equals the portable path's candle-op RoPE (reshape, transpose,
    /// rotate-half) and its gradient.
    #[test]
    fn the_rope_twin_equals_candle_ops_with_the_gradient() {
        let dev = Device::Cpu;
        let (b, t, h, d) = (2, 5, 3, 8);
        let x = Var::randn(0f32, 1.0, (b, t, h * d), &dev).unwrap();
        let ang = Tensor::rand(0f32, 6.0, (b, t, d / 2), &dev).unwrap();
        let (cos, sin) = (ang.cos().unwrap(), ang.sin().unwrap());
        let dy = Tensor::randn(0f32, 1.0, (b, h, t, d), &dev).unwrap();
        let heads = x.reshape((b, t, h, d)).unwrap().transpose(1, 2).unwrap();
        let want =
            super::super::layers::apply_rope(&heads, &cos, &sin, super::super::layers::Mode::Train)
                .unwrap();
        let grads = (&want * &dy)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let (y, dx) = twin_rope(
            &host(&x),
            &host(&cos),
            &host(&sin),
            &host(&dy),
            (b, t, h, d),
        );
        assert!(err(&y, &host(&want)) < 1e-5);
        assert!(err(&dx, &host(grads.get(&x).unwrap())) < 1e-5);
    }

    /// The RMSNorm kernels' twin equals the recorded candle-op RMSNorm and its gradients.
    #[test]
    fn the_rms_norm_twin_equals_candle_ops_with_the_gradients() {
        let dev = Device::Cpu;
        let (n, h) = (4, 37);
        let x = Var::randn(0f32, 2.0, (n, h), &dev).unwrap();
        let w =
            Var::from_tensor(&(Tensor::randn(0f32, 0.1, h, &dev).unwrap() + 1.0).unwrap()).unwrap();
        let g = Tensor::randn(0f32, 1.0, (n, h), &dev).unwrap();
        let want = super::super::layers::rms_norm_recomputed(&x, &w, 1e-5).unwrap();
        let grads = (&want * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let (y, dx, dw) = twin_rms_norm(&host(&x), &host(&w), &host(&g), 1e-5);
        assert!(err(&y, &host(&want)) < 1e-5);
        assert!(err(&dx, &host(grads.get(&x).unwrap())) < 1e-5);
        assert!(err(&dw, &host(grads.get(&w).unwrap())) < 1e-4);
    }
}
