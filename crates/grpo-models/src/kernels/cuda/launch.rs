//! What the launchers share: the device of a tensor, kernel names, fresh outputs, and one
//! launch of a kernel of either module (`kernels.cu`'s, `attention_tc.cu`'s).

use std::sync::OnceLock;

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{DType, Device, Result, Storage, Tensor};

use super::{gpu_ptx as ptx, gpu_tc_ptx, Dims};

pub(super) fn cuda(t: &Tensor) -> Result<CudaDevice> {
    match t.device() {
        Device::Cuda(d) => Ok(d.clone()),
        _ => candle_core::bail!("gpu attention: a tensor is not on the GPU"),
    }
}

pub(super) fn suffix(dt: DType) -> &'static str {
    if dt == DType::BF16 {
        "bf16"
    } else {
        "f32"
    }
}

pub(super) fn name(kernel: &str, dt: DType, d: usize) -> String {
    format!("attn_{kernel}_{}_{d}", suffix(dt))
}

/// A fresh tensor for a kernel's output, uninitialized: every kernel here writes each element
/// of its outputs (kernels.cu; the grids cover them), so no fill is launched before it.
pub(super) fn output<S: Into<candle_core::Shape>>(
    shape: S,
    dt: DType,
    dev: &Device,
) -> Result<Tensor> {
    // SAFETY: only kernel outputs that the launch right after writes in full.
    unsafe { Tensor::empty(shape, dt, dev) }
}

/// A kernel's scalar argument.
pub(super) enum Scalar {
    I32(i32),
    I64(i64),
    F32(f32),
}

/// Runs kernel `name` of kernels.cu over contiguous tensors `args` (inputs, then freshly
/// made outputs whose storage the kernel writes in place), then `scalars`.
pub(super) fn launch(
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
pub(super) enum Module {
    Main,
    TensorCores,
}

/// [`launch`] of a kernel of `module`.
pub(super) fn launch_from(
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
    let mut views_u8 = Vec::new();
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
            DType::U8 => {
                views_u8.push(c.as_cuda_slice::<u8>()?.slice(off..));
                order.push((DType::U8, views_u8.len() - 1));
            }
            other => candle_core::bail!("{name}: unsupported dtype {other:?}"),
        }
    }
    for (dt, i) in &order {
        match dt {
            DType::F32 => b.arg(&views_f32[*i]),
            DType::BF16 => b.arg(&views_bf16[*i]),
            DType::U8 => b.arg(&views_u8[*i]),
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
pub(super) fn dims_args(n: Dims, scale: f32) -> [Scalar; 5] {
    let i = |x: usize| Scalar::I32(x as i32);
    [i(n.h), i(n.hkv), i(n.s), i(n.tk), Scalar::F32(scale)]
}

pub(super) fn elementwise(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The most shared memory a block may opt into on this process's GPU (0 if unknown).
pub(super) fn smem_limit(dev: &CudaDevice) -> u32 {
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

/// A block of 256 threads per row (`NORM_THREADS` in kernels.cu) and its reduction buffer.
pub(super) fn norm_config(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 256 * 4,
    }
}
