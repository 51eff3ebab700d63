//! The devices' memory: what a GPU's pool holds and frees, free memory, a card's peak rate.

use std::sync::OnceLock;

/// A GPU's dense bf16 tensor-core rate in TFLOP/s (NVIDIA's datasheets, without sparsity), by
/// the name the driver gives the card: what the update's MFU (`time/update_mfu`) divides by.
/// `None` for a card not listed here (the throughput is still logged).
pub fn bf16_peak_tflops_of(name: &str) -> Option<f64> {
    // Most specific first: an H100 PCIe or NVL is not an SXM H100, nor an A10 an A100.
    const CARDS: [(&str, f64); 10] = [
        ("H100 PCIe", 756.5),
        ("H100 NVL", 835.5),
        ("H100", 989.4),
        ("H200", 989.4),
        ("GH200", 989.4),
        ("A100", 312.0),
        ("L40S", 362.1),
        ("L40", 181.0),
        ("L4", 121.0),
        ("A10", 125.0),
    ];
    let n = name.to_ascii_uppercase();
    let named = |card: &str| {
        let c = card.to_ascii_uppercase();
        n.split(|ch: char| !ch.is_ascii_alphanumeric())
            .any(|word| word == c.split(' ').next().unwrap_or(""))
            && c.split(' ').skip(1).all(|rest| n.contains(rest))
    };
    CARDS.iter().find(|(card, _)| named(card)).map(|&(_, t)| t)
}

/// [`bf16_peak_tflops_of`] for `device`'s card; `None` on the CPU and in a build without CUDA.
pub fn bf16_peak_tflops(device: &candle_core::Device) -> Option<f64> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        return bf16_peak_tflops_of(&d.cuda_stream().context().name().ok()?);
    }
    let _ = device;
    None
}

/// Memory free on `device` now, in bytes: the CUDA driver's free memory on a GPU, the kernel's
/// `MemAvailable` on the CPU (Linux); `None` where neither answers.
pub fn free_memory(device: &candle_core::Device) -> Option<u64> {
    match device {
        candle_core::Device::Cpu => {
            let info = std::fs::read_to_string("/proc/meminfo").ok()?;
            let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
            let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kb * 1024)
        }
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(_) => {
            let stream = device.as_cuda_device().ok()?.cuda_stream();
            let (free, _total) = stream.context().mem_get_info().ok()?;
            Some(free as u64)
        }
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

/// How CUDA's memory pool treats freed memory (`GRPO_CUDA_POOL`, read once): `keep` (unset, the
/// default) keeps it for reuse ([`keep_device_pool`]); `release` hands it back to the driver at
/// every synchronization; `trim` keeps it within a phase of a step and hands back what is free
/// at the phase's end ([`end_phase_of_pool`]): the rollout's, the reference's and the update's
/// differently sized tensors then do not hold memory for each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaPool {
    Keep,
    Release,
    Trim,
}

impl CudaPool {
    /// A value of `GRPO_CUDA_POOL` (unset: keep), or the message for another.
    pub fn parse(v: Option<&str>) -> Result<CudaPool, String> {
        match v.map(str::trim) {
            None | Some("" | "keep") => Ok(CudaPool::Keep),
            Some("release") => Ok(CudaPool::Release),
            Some("trim") => Ok(CudaPool::Trim),
            Some(other) => Err(format!(
                "GRPO_CUDA_POOL={other} is not keep, release or trim: keeping"
            )),
        }
    }

    /// `GRPO_CUDA_POOL`'s choice; another value warns once and keeps.
    pub fn from_env() -> CudaPool {
        static P: OnceLock<CudaPool> = OnceLock::new();
        *P.get_or_init(|| {
            let v = std::env::var("GRPO_CUDA_POOL").ok();
            CudaPool::parse(v.as_deref()).unwrap_or_else(|e| {
                tracing::warn!("{e}");
                CudaPool::Keep
            })
        })
    }
}

/// Under `GRPO_CUDA_POOL=trim`, at the end of a phase of a step: waits for `device` and hands the
/// free memory its pool keeps back to the driver. A no-op otherwise, on the CPU and in a build
/// without CUDA.
pub fn end_phase_of_pool(device: &candle_core::Device) {
    #[cfg(feature = "cuda")]
    if let (candle_core::Device::Cuda(d), CudaPool::Trim) = (device, CudaPool::from_env()) {
        use candle_core::cuda_backend::cudarc::driver::sys;
        if device.synchronize().is_err() {
            return;
        }
        let ctx = d.cuda_stream().context().clone();
        if ctx.bind_to_thread().is_err() {
            return;
        }
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: the context is current on this thread and `pool` is a live local the driver
        // writes; trimming releases only memory no allocation uses.
        unsafe {
            if sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
                == sys::CUresult::CUDA_SUCCESS
            {
                sys::cuMemPoolTrimTo(pool, 0);
            }
        }
    }
    let _ = device;
}

/// What a CUDA device's default memory pool (where candle's allocations live) says of a
/// phase: bytes in use by tensors and bytes the pool holds from the driver (in use, plus freed
/// memory it keeps for reuse: what `nvidia-smi` counts, less the context), each at its most
/// since the last reading and now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolUsage {
    pub used_peak: u64,
    pub used_now: u64,
    pub reserved_peak: u64,
    pub reserved_now: u64,
}

/// On a CUDA device: its default memory pool's [`PoolUsage`] since the last call; both peaks
/// are reset. `None` on the CPU, or where the driver does not say. The device's free memory
/// cannot show a phase's peak: the pool keeps what is freed, so it shows the run's high-water
/// mark. A reserved peak well above the used one is memory the pool could not reuse
/// (fragmentation across the phases' sizes).
pub fn gpu_pool_usage(device: &candle_core::Device) -> Option<PoolUsage> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        use candle_core::cuda_backend::cudarc::driver::sys;
        use sys::CUmemPool_attribute as A;
        let ctx = d.cuda_stream().context().clone();
        ctx.bind_to_thread().ok()?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        let ok = |r: sys::CUresult| r == sys::CUresult::CUDA_SUCCESS;
        // SAFETY: the context is current on this thread; each attribute is a u64 (cuuint64_t)
        // written to or read from a live local.
        unsafe {
            if !ok(sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())) {
                return None;
            }
            let get = |a: A| {
                let mut v = 0u64;
                ok(sys::cuMemPoolGetAttribute(
                    pool,
                    a,
                    &mut v as *mut u64 as *mut _,
                ))
                .then_some(v)
            };
            let usage = PoolUsage {
                used_peak: get(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
                used_now: get(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
                reserved_peak: get(A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
                reserved_now: get(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            };
            for a in [
                A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
            ] {
                let mut zero = 0u64;
                sys::cuMemPoolSetAttribute(pool, a, &mut zero as *mut u64 as *mut _);
            }
            return Some(usage);
        }
    }
    let _ = device;
    None
}

/// Stops cudarc from creating two CUDA events for every tensor `device` allocates from now on.
/// cudarc records and waits on them only in its multi-stream mode, which candle's device (one
/// per-thread stream, which NCCL's all-reduce also uses) never enters: there they were created
/// and destroyed with every allocation of a GPU step and never used. A no-op on the CPU, in a
/// build without CUDA, and where the context already runs several streams.
pub fn untracked_device(device: &candle_core::Device) {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        if !d.cuda_stream().context().is_in_multi_stream_mode() {
            // SAFETY: every kernel, copy and NCCL call of this device goes through its one
            // stream, so no allocation needs an event to order uses across streams.
            unsafe { d.disable_event_tracking() };
        }
    }
    let _ = device;
}

/// Makes CUDA's default memory pool of `device` keep what is freed (release threshold = max)
/// instead of returning it to the driver at every synchronization: later allocations of the
/// same sizes are then served from the pool, as PyTorch's caching allocator serves them. A no-op
/// on the CPU and in a build without CUDA.
pub fn keep_device_pool(device: &candle_core::Device) -> candle_core::Result<()> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        use candle_core::cuda_backend::cudarc::driver::sys;
        let cu_dev = d.cuda_stream().context().cu_device();
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        let mut keep: u64 = u64::MAX;
        // SAFETY: `pool` is written by the driver for a valid device; the attribute takes a
        // pointer to a u64, alive for the call.
        let ok = unsafe {
            sys::cuDeviceGetDefaultMemPool(&mut pool, cu_dev) == sys::CUresult::CUDA_SUCCESS
                && sys::cuMemPoolSetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    &mut keep as *mut u64 as *mut std::ffi::c_void,
                ) == sys::CUresult::CUDA_SUCCESS
        };
        if !ok {
            candle_core::bail!("could not set the CUDA memory pool's release threshold");
        }
    }
    let _ = device;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_pool_values_parse() {
        assert_eq!(CudaPool::parse(None), Ok(CudaPool::Keep));
        assert_eq!(CudaPool::parse(Some("keep")), Ok(CudaPool::Keep));
        assert_eq!(CudaPool::parse(Some(" release")), Ok(CudaPool::Release));
        assert_eq!(CudaPool::parse(Some("trim")), Ok(CudaPool::Trim));
        let e = CudaPool::parse(Some("shrink")).unwrap_err();
        assert!(e.contains("keep, release or trim"), "{e}");
        // Off a GPU the phase's end does nothing.
        end_phase_of_pool(&candle_core::Device::Cpu);
    }

    /// Cards by the driver's names: the most specific entry wins (an A10 is not an A100, an
    /// H100 PCIe not an SXM H100), and a card not listed has no rate.
    #[test]
    fn bf16_peaks_by_card_name() {
        let cases = [
            ("NVIDIA H200", Some(989.4)),
            ("NVIDIA GH200 480GB", Some(989.4)),
            ("NVIDIA H100 80GB HBM3", Some(989.4)),
            ("NVIDIA H100 PCIe", Some(756.5)),
            ("NVIDIA H100 NVL", Some(835.5)),
            ("NVIDIA A100-SXM4-80GB", Some(312.0)),
            ("NVIDIA A100 80GB PCIe", Some(312.0)),
            ("NVIDIA A10", Some(125.0)),
            ("NVIDIA A10G", None),
            ("NVIDIA L40S", Some(362.1)),
            ("NVIDIA L40", Some(181.0)),
            ("NVIDIA L4", Some(121.0)),
            ("NVIDIA GeForce RTX 4090", None),
        ];
        for (name, want) in cases {
            assert_eq!(bf16_peak_tflops_of(name), want, "{name}");
        }
        assert_eq!(bf16_peak_tflops(&candle_core::Device::Cpu), None);
    }
}
