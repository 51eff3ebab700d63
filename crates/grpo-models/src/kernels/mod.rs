//! How the models run fast: grpo's own kernels, grouped by device, the dispatch that picks one
//! per op, and the device seam that decides it once per model or optimizer ([`Compute`]).
//!
//! A model (in `models`) asks for an op: [`attention::attention`], [`norm::rms_norm`]
//! and [`norm::add_rms_norm`], [`rope::rope_heads`] and [`rope::rope_append`], [`mlp::swiglu`];
//! each is a small dispatch function here that picks the implementation from the model's
//! [`Compute`]. Where each lives:
//! - [`cpu`]: hand-written CPU kernels with backward passes (fused attention, RMSNorm, SiLU,
//!   RoPE, log-softmax with entropy), the packed decoding GEMM, the fused decoding step, the
//!   bf16 GEMM of CPU mixed precision, quantized projections.
//! - [`cuda`]: grpo's GPU kernels (`cuda/*.cu`, compiled at run time by NVRTC), one launcher
//!   file per op with its plain-Rust twin in [`cuda::twins`].
//! - [`portable`]: candle-op compositions every device runs (the GPU's fallback, CI's portable
//!   path) and the device-generic recording of a result with a hand-written backward.
//! - [`grad_sink`] (weight gradients straight into accumulators, CPU and GPU) and
//!   [`gpu_layer`] (a GPU training layer as one recorded op), which span the devices.
//! - [`mask`]: the attention masks' plain data shared by the devices' kernels.
//!
//! Process-wide choices, each read once from the environment (the only readers; nothing else
//! in the workspace reads these variables):
//!
//! | Variable | Values (default first) | What it chooses | Read into |
//! |---|---|---|---|
//! | `GRPO_KERNELS` (`kernels` in a run's config) | `fused` (`auto`), `portable` | the CPU's kernel set: grpo's fused CPU kernels where they apply, or candle ops only (the GPU's path, run on the CPU, which is how CI tests it) | [`Kernels`], [`kernels`] |
//! | `GRPO_ISA` | `auto`, `amx`, `avx512bf16`, `avx512`, `avx2`, `baseline` | the instruction set the CPU kernels run at; a level above what the CPU has falls back to the best it has | [`Isa::active`] |
//! | `GRPO_GPU_KERNELS` | `default` (`full`), `forward`, `off` | whether grpo's GPU kernels run on a GPU (`forward`: attention's backward as candle ops) | [`GpuKernels`], [`gpu_kernels`] |
//! | `GRPO_GPU_LAYER` | `op`, `graph` | a GPU training layer as one recorded op ([`gpu_layer`], once its check passes) or candle's graph | [`GpuSwitches::layer_op`] |
//! | `GRPO_GPU_ATTENTION` | `tensor`, `cores` | bf16 attention on tensor cores (`cuda/attention_tc.cu`, where the card has them and its check passes) or CUDA cores (`cuda/kernels.cu`) | [`GpuSwitches::tensor_cores`] |
//! | `GRPO_GPU_DECODE` | `warp`, `kernel`, `ops` | a decoding step's attention on a GPU: the warp kernel, the block kernel, or candle's batched matmuls | [`GpuSwitches::decode`] |
//! | `GRPO_CUDA_POOL` | `keep`, `release`, `trim` | what CUDA's memory pool does with freed memory | [`pool::CudaPool`] |
//! | `GRPO_PROFILE` | unset, `1` | phase timers synchronized with the device | [`profiling`] |
//!
//! `GRPO_GPU_LAYER`, `GRPO_GPU_ATTENTION` and `GRPO_GPU_DECODE` are read together, once
//! ([`gpu_switches`], consulted through [`Compute::gpu_switches`] by model code); a value not
//! listed is logged and its default used.
//!
//! Every variant of a CPU kernel performs the same float operations in the same order (FMAs
//! where the AVX-512 kernel has them, the same lane layout, the same reduction tree), so
//! `avx512` and `avx2` give bit-identical results; the baseline variants differ from them only
//! where they use a multiply and an add in place of an FMA (the packed GEMM), and are tested
//! against plain twins within a tolerance.

pub mod attention;
pub mod cpu;
pub mod cuda;
pub mod gpu_layer;
pub mod grad_sink;
mod isa;
pub mod mask;
pub mod mlp;
pub mod norm;
pub mod pool;
pub mod portable;
pub mod rope;

pub(crate) use isa::isa_dispatch;
pub use isa::Isa;
pub use pool::{
    bf16_peak_tflops, bf16_peak_tflops_of, end_phase_of_pool, free_memory, gpu_pool_usage,
    keep_device_pool, untracked_device, CudaPool, PoolUsage,
};

#[cfg(feature = "cuda")]
pub use cuda::{gpu_ptx, gpu_tc_ptx};
pub use cuda::{GPU_ATTENTION_TC_CU, GPU_KERNELS_CU};

/// Which kernels a forward pass uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Only ops with a backward: gradients reach every parameter.
    Train,
    /// Fused kernels without backward: faster, for tensors that need no gradient.
    Infer,
}

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

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

/// Which of grpo's GPU kernels run (`GRPO_GPU_KERNELS`, read once; the third process-wide
/// choice, resolved with the others by [`Compute::resolve`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuKernels {
    /// All of them (`GRPO_GPU_KERNELS` unset, `default` or `full`): attention forward and
    /// backward, RMSNorm, RoPE, SwiGLU, the decoding step's, the LM head's, AdamW's.
    All,
    /// `forward`: attention's backward as the chunked candle ops
    /// ([`crate::kernels::portable::chunked_attention`]) from the forward kernel's log-sum-exps.
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

/// A decoding step's attention kernel on a GPU (`GRPO_GPU_DECODE`).
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

/// The GPU switches besides [`GpuKernels`] (see the table in the module docs), read together
/// once ([`gpu_switches`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuSwitches {
    /// `GRPO_GPU_LAYER`: `op` or unset (true) runs each training layer as [`gpu_layer`]'s one
    /// op where its check passes; `graph` (false) runs candle's graph.
    pub layer_op: bool,
    /// `GRPO_GPU_ATTENTION`: `tensor` or unset (true) runs bf16 attention on tensor cores
    /// where the card can; `cores` (false) runs `kernels.cu`'s.
    pub tensor_cores: bool,
    /// `GRPO_GPU_DECODE`: `warp` (unset) the warp kernel, `kernel` the block kernel, `ops`
    /// candle's batched matmuls.
    pub decode: DecodeKernel,
}

impl GpuSwitches {
    /// The switches from the three variables' values (`None`: unset); a value not listed is
    /// logged and its default (the graph, for `GRPO_GPU_LAYER`) used.
    pub fn parse(layer: Option<&str>, attention: Option<&str>, decode: Option<&str>) -> Self {
        let layer_op = match layer {
            Some("op") | Some("") | None => true,
            Some("graph") => false,
            Some(other) => {
                tracing::warn!("GRPO_GPU_LAYER={other} is not op or graph: using the graph");
                false
            }
        };
        let tensor_cores = match attention {
            Some("tensor") | Some("") | None => true,
            Some("cores") => false,
            Some(other) => {
                tracing::warn!(
                    "GRPO_GPU_ATTENTION={other} is not tensor or cores: using the tensor cores"
                );
                true
            }
        };
        let decode = match decode {
            Some("ops") => DecodeKernel::Ops,
            Some("kernel") => DecodeKernel::Block,
            Some("warp") | Some("") | None => DecodeKernel::Warp,
            Some(other) => {
                tracing::warn!(
                    "GRPO_GPU_DECODE={other} is not warp, kernel or ops: using the warp kernel"
                );
                DecodeKernel::Warp
            }
        };
        GpuSwitches {
            layer_op,
            tensor_cores,
            decode,
        }
    }
}

/// `GRPO_GPU_LAYER`, `GRPO_GPU_ATTENTION` and `GRPO_GPU_DECODE`, read once.
pub fn gpu_switches() -> GpuSwitches {
    static S: OnceLock<GpuSwitches> = OnceLock::new();
    *S.get_or_init(|| {
        let var = |k: &str| std::env::var(k).ok();
        GpuSwitches::parse(
            var("GRPO_GPU_LAYER").as_deref(),
            var("GRPO_GPU_ATTENTION").as_deref(),
            var("GRPO_GPU_DECODE").as_deref(),
        )
    })
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
    /// grpo's GPU kernels where they apply ([`crate::kernels::cuda`]: attention, RMSNorm,
    /// RoPE, SwiGLU, the decoding step's attention, the LM head's log-softmax, AdamW, the
    /// gradient norm) and the weight gradients' sink ([`crate::kernels::grad_sink::GradSink::on_gpu`]),
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

    /// The GPU switches ([`gpu_switches`]) under [`Compute::Gpu`]; `None` elsewhere.
    pub fn gpu_switches(self) -> Option<GpuSwitches> {
        self.on_gpu().then(gpu_switches)
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

#[cfg(test)]
mod tests {
    use super::*;

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
                .args(["models::", "kernels::", "sampler::", "--test-threads=2"])
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
