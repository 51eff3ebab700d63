//! Which kernels run: process-wide choices, each read once, and the device seam that resolves
//! them into one value per model or optimizer ([`Compute`]).
//!
//! - [`Kernels`] (`kernels` in a run's config, `GRPO_KERNELS` in the environment): `fused` runs
//!   grpo's hand-written CPU custom ops where they apply (fused attention, RMSNorm, SiLU, RoPE,
//!   log-softmax with entropy, the packed decoding GEMM and the fused decoding step); `portable`
//!   turns them all off, so that every forward and backward is made of candle ops that have a
//!   CUDA implementation: the path a GPU runs, here run on the CPU, which is how CI tests it.
//! - [`Isa`] (`GRPO_ISA`): the instruction set the hand-written kernels are compiled for, chosen
//!   at run time from what the CPU has: AMX's bf16 tiles, AVX512_BF16, AVX-512F, AVX2 with FMA,
//!   or the baseline target (SSE2 on x86-64; NEON or none elsewhere). Forcing a lower one makes
//!   tests and benchmarks run every variant on one machine; a request above what the CPU has
//!   falls back to the best it has.
//! - [`GpuKernels`] (`GRPO_GPU_KERNELS`): whether grpo's GPU kernels run on a GPU (`off` runs
//!   candle ops only; `forward` runs attention's backward as candle ops).
//!
//! Every variant of a kernel performs the same float operations in the same order (FMAs where
//! the AVX-512 kernel has them, the same lane layout, the same reduction tree), so `avx512` and
//! `avx2` give bit-identical results; the baseline variants differ from them only where they
//! use a multiply and an add in place of an FMA (the packed GEMM), and are tested against plain
//! twins within a tolerance.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

/// An instruction-set level of the hand-written CPU kernels, lowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// The baseline target, no run-time features (SSE2 on x86-64).
    Baseline,
    /// AVX2 with FMA (x86-64).
    Avx2,
    /// AVX-512F (x86-64).
    Avx512,
    /// AVX-512F with AVX512_BF16 (`vdpbf16ps`): the f32 kernels run as at [`Isa::Avx512`]; the
    /// bf16 GEMM of CPU mixed precision ([`crate::models::gemm_bf16`]) uses the instruction.
    Avx512Bf16,
    /// [`Isa::Avx512Bf16`] with AMX's bf16 tiles (Intel Xeon since Sapphire Rapids, on Linux,
    /// where the kernel grants the process the tile state): the bf16 GEMM of CPU mixed
    /// precision multiplies 16 x 16 tiles with `tdpbf16ps` ([`crate::models::gemm_bf16::amx`]);
    /// every other kernel runs as at [`Isa::Avx512Bf16`].
    Amx,
}

impl Isa {
    /// Every level, lowest first.
    pub const ALL: [Isa; 5] = [
        Isa::Baseline,
        Isa::Avx2,
        Isa::Avx512,
        Isa::Avx512Bf16,
        Isa::Amx,
    ];

    /// The name `GRPO_ISA` takes.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Baseline => "baseline",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512bf16",
            Isa::Amx => "amx",
        }
    }

    /// Parses a `GRPO_ISA` value: `auto` (None), `amx`, `avx512bf16`, `avx512`, `avx2` or
    /// `baseline`.
    pub fn parse(s: &str) -> Result<Option<Isa>, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(None),
            "amx" | "amx_bf16" | "amx-bf16" => Ok(Some(Isa::Amx)),
            "avx512bf16" | "avx512_bf16" => Ok(Some(Isa::Avx512Bf16)),
            "avx512" | "avx512f" | "avx-512" => Ok(Some(Isa::Avx512)),
            "avx2" => Ok(Some(Isa::Avx2)),
            "baseline" | "scalar" | "generic" => Ok(Some(Isa::Baseline)),
            other => Err(format!(
                "GRPO_ISA=`{other}` is not an instruction set: use auto, amx, avx512bf16, avx512, avx2 or baseline"
            )),
        }
    }

    /// The best level this CPU runs (detected once: every kernel call lowers its level by it).
    #[inline]
    pub fn detected() -> Isa {
        static DETECTED: OnceLock<Isa> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx512f") {
                    if !std::arch::is_x86_feature_detected!("avx512bf16") {
                        return Isa::Avx512;
                    }
                    return match amx_granted() {
                        true => Isa::Amx,
                        false => Isa::Avx512Bf16,
                    };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    return Isa::Avx2;
                }
            }
            Isa::Baseline
        })
    }

    /// `self`, lowered to what this CPU runs: the level a kernel may be dispatched to.
    #[inline]
    pub fn usable(self) -> Isa {
        self.min(Isa::detected())
    }

    /// The level the kernels run at: `GRPO_ISA` (read once; `auto` or unset is the best the CPU
    /// has), lowered to what the CPU runs. An unreadable value is reported by
    /// [`check_env`] at start; here it counts as `auto`.
    #[inline]
    pub fn active() -> Isa {
        static ACTIVE: OnceLock<Isa> = OnceLock::new();
        *ACTIVE.get_or_init(|| {
            let want = std::env::var("GRPO_ISA")
                .ok()
                .and_then(|v| Isa::parse(&v).ok().flatten());
            want.unwrap_or(Isa::Amx).usable()
        })
    }
}

/// Whether this process may run AMX's bf16 tile instructions: the CPU reports AMX-TILE and
/// AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22), and Linux grants the process the tile data
/// state when asked (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`; without that grant
/// the first tile instruction is a fault). Asked once, from [`Isa::detected`]; the grant holds
/// for every thread of the process.
#[cfg(target_arch = "x86_64")]
fn amx_granted() -> bool {
    // CPUID leaf 7 exists on every CPU with AVX-512 (the caller checked AVX512_BF16).
    let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
    if edx & (1 << 24) == 0 || edx & (1 << 22) == 0 {
        return false;
    }
    #[cfg(target_os = "linux")]
    {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: a request about this process's own permissions, no memory passed.
        let r = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        };
        r == 0
    }
    #[cfg(not(target_os = "linux"))]
    false
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Which implementation of the model's layers runs on the CPU (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Kernels {
    /// grpo's fused CPU kernels where they apply (f32 on the CPU), candle ops elsewhere.
    #[default]
    Fused,
    /// candle ops only: the GPU's path, on whatever device the tensors are.
    Portable,
}

impl Kernels {
    /// Parses a `kernels` / `GRPO_KERNELS` value: `auto` or `fused`, or `portable`.
    pub fn parse(s: &str) -> Result<Kernels, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" | "fused" => Ok(Kernels::Fused),
            "portable" => Ok(Kernels::Portable),
            other => Err(format!(
                "`{other}` is not a kernel set: use auto, fused or portable"
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kernels::Fused => "fused",
            Kernels::Portable => "portable",
        }
    }
}

/// Whether `GRPO_PROFILE` asks for phase timers synchronized with the device (read once): a GPU
/// runs kernels asynchronously, so a timer without a synchronization measures only launches.
pub fn profiling() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("GRPO_PROFILE").is_ok_and(|v| !matches!(v.trim(), "" | "0" | "false"))
    })
}

/// 0: not read yet; 1: fused; 2: portable.
static KERNELS: AtomicU8 = AtomicU8::new(0);

/// The kernel set in force: the last [`set_kernels`], else `GRPO_KERNELS`, else fused.
#[inline]
pub fn kernels() -> Kernels {
    match KERNELS.load(Ordering::Relaxed) {
        1 => Kernels::Fused,
        2 => Kernels::Portable,
        _ => {
            let k = std::env::var("GRPO_KERNELS")
                .ok()
                .and_then(|v| Kernels::parse(&v).ok())
                // Unset means fused; a bad value is refused at start by `check_env`.
                .unwrap_or_default();
            set_kernels(k);
            k
        }
    }
}

/// Sets the kernel set for the whole process (a run's `kernels` key). Models built before keep
/// what they packed; set it before loading.
pub fn set_kernels(k: Kernels) {
    KERNELS.store(
        match k {
            Kernels::Fused => 1,
            Kernels::Portable => 2,
        },
        Ordering::Relaxed,
    );
}

/// The CUDA source of grpo's GPU kernels (`models/cuda/kernels.cu`, run by
/// [`crate::models::fused_gpu`]; compiled at run time by NVRTC, `gpu_ptx`).
pub const GPU_KERNELS_CU: &str = include_str!("models/cuda/kernels.cu");

/// The CUDA source of attention's tensor-core kernels (`models/cuda/attention_tc.cu`: bf16
/// products as `mma.sync`, sm_80 and later), compiled after [`GPU_KERNELS_CU`], whose helpers
/// it uses, into a module of its own (`gpu_tc_ptx`).
pub const GPU_ATTENTION_TC_CU: &str = include_str!("models/cuda/attention_tc.cu");

/// Which of grpo's GPU kernels run (`GRPO_GPU_KERNELS`, read once; the third process-wide
/// choice, resolved with the others by [`Compute::resolve`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuKernels {
    /// All of them (`GRPO_GPU_KERNELS` unset, `default` or `full`): attention forward and
    /// backward, RMSNorm, RoPE, SwiGLU, the decoding step's, the LM head's, AdamW's.
    All,
    /// `forward`: attention's backward as the chunked candle ops
    /// ([`crate::models::chunked_attention`]) from the forward kernel's log-sum-exps.
    Forward,
    /// `off`, a build without CUDA, or kernels that do not compile: candle ops only.
    Off,
}

/// The GPU kernel set in force (see [`GpuKernels`]). The first call on a CUDA build compiles
/// the kernels (a failure is logged once, and turns them off).
pub fn gpu_kernels() -> GpuKernels {
    #[cfg(feature = "cuda")]
    {
        static USE: OnceLock<GpuKernels> = OnceLock::new();
        *USE.get_or_init(|| {
            let want = match std::env::var("GRPO_GPU_KERNELS").as_deref() {
                Ok("off") => GpuKernels::Off,
                Ok("forward") => GpuKernels::Forward,
                Ok("default") | Ok("full") | Ok("") | Err(_) => GpuKernels::All,
                Ok(other) => {
                    tracing::warn!(
                        "GRPO_GPU_KERNELS={other} is not default, forward or off: using the default"
                    );
                    GpuKernels::All
                }
            };
            if want == GpuKernels::Off {
                tracing::info!(
                    "GRPO_GPU_KERNELS=off: every GPU kernel of grpo's runs as candle ops"
                );
                return GpuKernels::Off;
            }
            match gpu_ptx() {
                Ok(_) => want,
                Err(e) => {
                    tracing::warn!(
                        "grpo's GPU kernels did not compile ({e}); candle ops run in their place"
                    );
                    GpuKernels::Off
                }
            }
        })
    }
    #[cfg(not(feature = "cuda"))]
    GpuKernels::Off
}

/// The GPU kernels' PTX, compiled from [`GPU_KERNELS_CU`] once per process (an error is kept
/// and reported once).
#[cfg(feature = "cuda")]
pub fn gpu_ptx() -> Result<&'static str, &'static str> {
    static PTX: OnceLock<Result<String, String>> = OnceLock::new();
    let r = PTX.get_or_init(|| {
        candle_core::cuda_backend::cudarc::nvrtc::compile_ptx(GPU_KERNELS_CU)
            .map(|p| p.to_src())
            .map_err(|e| format!("{e:?}"))
    });
    match r {
        Ok(s) => Ok(s.as_str()),
        Err(e) => Err(e.as_str()),
    }
}

/// The tensor-core attention kernels' PTX: [`GPU_KERNELS_CU`] and [`GPU_ATTENTION_TC_CU`]
/// compiled for compute_80 (the first architecture with bf16 `mma.sync`; a newer card's driver
/// compiles it for its own), once per process. A separate module, so that a card older than
/// sm_80 still loads [`gpu_ptx`]'s.
#[cfg(feature = "cuda")]
pub fn gpu_tc_ptx() -> Result<&'static str, &'static str> {
    use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
    static PTX: OnceLock<Result<String, String>> = OnceLock::new();
    let r = PTX.get_or_init(|| {
        let src = format!("{GPU_KERNELS_CU}\n{GPU_ATTENTION_TC_CU}");
        let opts = CompileOptions {
            arch: Some("compute_80"),
            ..Default::default()
        };
        compile_ptx_with_opts(src, opts)
            .map(|p| p.to_src())
            .map_err(|e| format!("{e:?}"))
    });
    match r {
        Ok(s) => Ok(s.as_str()),
        Err(e) => Err(e.as_str()),
    }
}

/// How a model's (or an optimizer's) arithmetic runs: the device seam. Resolved once, when the
/// model or optimizer is set up ([`Compute::resolve`]: the only reader of the kernel set and of
/// whether grpo's GPU kernels are on, besides start-up logging), and handed to the layers, the
/// sampler, the log-prob code and the update, which branch on it instead of asking the device.
///
/// A kernel of grpo's own goes behind its arm: CPU code behind [`Compute::CpuFused`] (and
/// [`Compute::CpuMixed`]), GPU code behind [`Compute::Gpu`]. The portable arm is the candle-op
/// path every device runs (and CI runs on the CPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compute {
    /// grpo's own CPU code where it applies: fused ops, packed and fused decoding, gradient sinks,
    /// one-row packing, in-place AdamW (f32 on the CPU with the fused kernel set).
    CpuFused,
    /// [`Compute::CpuFused`] with the projections' GEMMs in bf16 with f32 sums: CPU mixed
    /// precision, what a bf16 model resolves to on a CPU with AVX-512 and the fused kernels.
    /// Its weights are kept in f32 ([`Compute::storage_dtype`]), as are gradients and optimizer
    /// state; only the products' inputs are rounded to bf16.
    CpuMixed,
    /// grpo's GPU kernels where they apply ([`crate::models::fused_gpu`]: attention, RMSNorm,
    /// RoPE, SwiGLU, the decoding step's attention, the LM head's log-softmax, AdamW, the
    /// gradient norm) and the weight gradients' sink ([`crate::models::grad_sink::GradSink::on_gpu`]),
    /// candle ops elsewhere: f32 or bf16 on a CUDA device, unless `GRPO_GPU_KERNELS=off` or the
    /// kernels do not compile. The `kernels` key does not change it (it is the CPU's choice).
    Gpu,
    /// candle ops only: `kernels = "portable"` on the CPU, a dtype no kernel of grpo's takes,
    /// or a GPU with `GRPO_GPU_KERNELS=off`.
    Portable,
}

impl Compute {
    /// The compute for a model or optimizer whose parameters are `dtype` on `device`, under the
    /// kernel set in force ([`kernels`]): on the CPU the fused code for f32, its mixed-precision
    /// form for bf16 where the CPU has AVX-512 ([`Compute::CpuMixed`]); on a GPU its kernels
    /// for f32 and bf16 while they are on ([`Compute::Gpu`]); candle ops otherwise.
    pub fn resolve(device: &candle_core::Device, dtype: candle_core::DType) -> Compute {
        use candle_core::DType;
        if device.is_cuda() {
            return match dtype {
                DType::F32 | DType::BF16 if gpu_kernels() != GpuKernels::Off => Compute::Gpu,
                _ => Compute::Portable,
            };
        }
        match (device.is_cpu() && kernels() == Kernels::Fused, dtype) {
            (true, DType::F32) => Compute::CpuFused,
            (true, DType::BF16) if Isa::active() >= Isa::Avx512 => Compute::CpuMixed,
            _ => Compute::Portable,
        }
    }

    /// The dtype a model of `dtype` keeps its weights in under this compute: f32 for
    /// [`Compute::CpuMixed`], else `dtype` itself.
    pub fn storage_dtype(self, dtype: candle_core::DType) -> candle_core::DType {
        match self {
            Compute::CpuMixed => candle_core::DType::F32,
            _ => dtype,
        }
    }

    /// Whether grpo's fused CPU code runs at all.
    #[inline]
    pub fn is_fused(self) -> bool {
        matches!(self, Compute::CpuFused | Compute::CpuMixed)
    }

    /// Whether the projections multiply in bf16 with f32 sums ([`Compute::CpuMixed`]).
    #[inline]
    pub fn bf16_matmuls(self) -> bool {
        self == Compute::CpuMixed
    }

    /// Whether a fused CPU kernel runs on `x`: [`Compute::CpuFused`] and `x` f32 on the CPU (a
    /// fused model still meets other tensors: f64 in tests, u32 ids).
    #[inline]
    pub fn fuses(self, x: &candle_core::Tensor) -> bool {
        self.fuses_on(x.device(), x.dtype())
    }

    /// [`Compute::fuses`] for tensors of `dtype` on `device`.
    #[inline]
    pub fn fuses_on(self, device: &candle_core::Device, dtype: candle_core::DType) -> bool {
        self.is_fused() && device.is_cpu() && dtype == candle_core::DType::F32
    }

    /// Whether grpo's GPU kernels run ([`Compute::Gpu`]); each still checks the shapes and
    /// dtypes it is handed, and declines (candle ops run) where they do not fit.
    #[inline]
    pub fn on_gpu(self) -> bool {
        self == Compute::Gpu
    }

    /// Whether decoding models pack their projections for the decoding GEMM: fused, and the CPU
    /// runs an AVX2 or AVX-512 variant of it.
    pub fn packs_for_decoding(self) -> bool {
        self.is_fused() && Isa::active() >= Isa::Avx2
    }

    pub fn name(self) -> &'static str {
        match self {
            Compute::CpuFused => "fused CPU kernels",
            Compute::CpuMixed => "fused CPU kernels, bf16 matmuls",
            Compute::Gpu => "grpo's GPU kernels",
            Compute::Portable => "portable (candle ops)",
        }
    }
}

/// What kind of processor a device is. Code outside the kernels that must know (a default
/// dtype, a log line's wording, whether a profile's timers wait for the device) asks here, never
/// the device itself; what runs where is [`Compute`]'s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// This machine's CPU: host memory, synchronous.
    Cpu,
    /// A CUDA GPU: its own memory, kernels run asynchronously.
    Gpu,
    /// Another candle device (Metal).
    Other,
}

/// The kind of `device`.
pub fn device_kind(device: &candle_core::Device) -> DeviceKind {
    match device {
        candle_core::Device::Cpu => DeviceKind::Cpu,
        candle_core::Device::Cuda(_) => DeviceKind::Gpu,
        _ => DeviceKind::Other,
    }
}

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

/// Checks `GRPO_ISA` and `GRPO_KERNELS`: an error naming the variable and its accepted values,
/// for a program to report at start (the kernels themselves treat a bad value as `auto`).
pub fn check_env() -> Result<(), String> {
    if let Ok(v) = std::env::var("GRPO_ISA") {
        if let Some(isa) = Isa::parse(&v)? {
            if isa.usable() != isa {
                tracing::warn!(
                    "GRPO_ISA={isa}: this CPU does not run it; the kernels use {}",
                    isa.usable()
                );
            }
        }
    }
    if let Ok(v) = std::env::var("GRPO_KERNELS") {
        Kernels::parse(&v).map_err(|e| format!("GRPO_KERNELS: {e}"))?;
    }
    Ok(())
}

/// Defines `$vis fn $name(args) -> ret`, which runs `$body(args)` compiled for the active
/// [`Isa`], and `$vis fn $on(isa, args) -> ret`, which runs it compiled for `isa` (lowered to
/// what the CPU runs): for tests and benchmarks of each variant. `$body` should be
/// `#[inline(always)]` so that it is compiled into each variant.
macro_rules! isa_dispatch {
    ($(#[$m:meta])* $vis:vis fn $name:ident / $on:ident ($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? = $body:path) => {
        $(#[$m])*
        #[inline]
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            $on($crate::kernels::Isa::active(), $($arg),*)
        }

        /// The same, compiled for `isa` (lowered to what this CPU runs).
        #[allow(dead_code)]
        $vis fn $on(isa: $crate::kernels::Isa, $($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                match isa.usable() {
                    // SAFETY: `usable` lowers `isa` to what the CPU was detected to run.
                    $crate::kernels::Isa::Avx512
                    | $crate::kernels::Isa::Avx512Bf16
                    | $crate::kernels::Isa::Amx => {
                        return unsafe { avx512($($arg),*) }
                    }
                    // SAFETY: as above.
                    $crate::kernels::Isa::Avx2 => return unsafe { avx2($($arg),*) },
                    $crate::kernels::Isa::Baseline => {}
                }
            }
            let _ = isa;
            $body($($arg),*)
        }
    };
}
pub(crate) use isa_dispatch;

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

    #[test]
    fn values_parse_and_errors_name_the_choices() {
        assert_eq!(Isa::parse("AVX2"), Ok(Some(Isa::Avx2)));
        assert_eq!(Isa::parse("auto"), Ok(None));
        assert_eq!(Isa::parse("baseline"), Ok(Some(Isa::Baseline)));
        let e = Isa::parse("sse9").unwrap_err();
        assert!(
            e.contains("GRPO_ISA") && e.contains("avx512bf16, avx512, avx2 or baseline"),
            "{e}"
        );
        assert_eq!(Kernels::parse("portable"), Ok(Kernels::Portable));
        assert_eq!(Kernels::parse("auto"), Ok(Kernels::Fused));
        assert!(Kernels::parse("gpu")
            .unwrap_err()
            .contains("auto, fused or portable"));
    }

    /// The CPU's arms follow the kernel set and the dtype; the GPU's arm is never the CPU's,
    /// and off it grpo's GPU kernels are off ([`Compute::on_gpu`]) whatever the dtype.
    #[test]
    fn compute_resolves_the_cpu_arms_and_never_the_gpu_one_on_a_cpu() {
        use candle_core::{DType, Device};
        for dt in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            let c = Compute::resolve(&Device::Cpu, dt);
            assert!(!c.on_gpu(), "{dt:?}: {c:?}");
            let want = match (kernels(), dt) {
                (Kernels::Fused, DType::F32) => Compute::CpuFused,
                (Kernels::Fused, DType::BF16) if Isa::active() >= Isa::Avx512 => Compute::CpuMixed,
                _ => Compute::Portable,
            };
            assert_eq!(c, want, "{dt:?}");
            assert_eq!(c.is_fused(), c != Compute::Portable);
        }
        assert!(Compute::Gpu.on_gpu() && !Compute::Gpu.is_fused());
        assert!(!Compute::Gpu.fuses_on(&Device::Cpu, DType::F32));
        assert_eq!(Compute::Gpu.storage_dtype(DType::BF16), DType::BF16);
        #[cfg(not(feature = "cuda"))]
        assert!(
            gpu_kernels() == GpuKernels::Off,
            "no GPU kernels without CUDA"
        );
    }

    #[test]
    fn a_level_is_lowered_to_what_the_cpu_runs() {
        for isa in Isa::ALL {
            assert!(isa.usable() <= Isa::detected());
            assert!(isa.usable() <= isa);
        }
        assert_eq!(Isa::Baseline.usable(), Isa::Baseline);
        assert!(Isa::active() <= Isa::detected());
    }

    /// The model tests (every kernel against its composition or plain twin, the fused decoding
    /// step against the tensor path, the encoders against transformers) run again at each
    /// level below the CPU's best, with `GRPO_ISA` forcing it, and on the portable kernels:
    /// every variant is exercised on this machine.
    #[test]
    fn model_tests_pass_at_every_lower_isa_and_on_the_portable_kernels() {
        if std::env::var_os("GRPO_ISA").is_some() || std::env::var_os("GRPO_KERNELS").is_some() {
            return; // a rerun itself
        }
        let exe = std::env::current_exe().unwrap();
        let lower = Isa::ALL.into_iter().filter(|&i| i < Isa::detected());
        let runs = lower
            .map(|isa| ("GRPO_ISA", isa.name()))
            .chain([("GRPO_KERNELS", "portable")]);
        for (var, value) in runs {
            let out = std::process::Command::new(&exe)
                .args(["models::", "sampler::", "--test-threads=2"])
                .env(var, value)
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            let passed = text
                .lines()
                .find_map(|l| l.strip_prefix("test result: ok. "))
                .and_then(|l| l.split(' ').next()?.parse::<usize>().ok());
            assert!(
                out.status.success() && passed.is_some_and(|n| n > 20),
                "{var}={value}:\n{text}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}
