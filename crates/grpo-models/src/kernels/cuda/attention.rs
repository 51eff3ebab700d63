//! Causal attention on the GPU, forward and backward (FlashAttention's plan, 64 x 64 tiles):
//! `kernels.cu`'s CUDA-core kernels and `attention_tc.cu`'s tensor-core ones for bf16.

use std::sync::{Arc, OnceLock};

use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device, Result, Tensor};

use super::gpu_tc_ptx;
use super::launch::{cuda, dims_args, launch_from, name, output, smem_limit, Module};
use super::{takes, Dims, HEAD_DIMS};
use crate::kernels::portable::recompute::{attach, Backward};
use crate::kernels::{gpu_kernels, GpuKernels};

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
/// (`GRPO_GPU_ATTENTION`, read once with the other switches: `tensor` or unset; `cores` runs
/// kernels.cu's).
fn tensor_cores_wanted() -> bool {
    crate::kernels::gpu_switches().tensor_cores
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
        let rec = crate::kernels::portable::chunked_attention::record(
            &o,
            q,
            k,
            v,
            &saved.mask,
            scale,
            &lse,
        )?;
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
