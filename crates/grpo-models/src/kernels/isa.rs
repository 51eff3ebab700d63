//! The instruction sets the hand-written CPU kernels are compiled for ([`Isa`]), and the macro
//! that compiles a kernel once per set and dispatches to the active one.

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
    /// bf16 GEMM of CPU mixed precision ([`crate::kernels::cpu::gemm_bf16`]) uses the instruction.
    Avx512Bf16,
    /// [`Isa::Avx512Bf16`] with AMX's bf16 tiles (Intel Xeon since Sapphire Rapids, on Linux,
    /// where the kernel grants the process the tile state): the bf16 GEMM of CPU mixed
    /// precision multiplies 16 x 16 tiles with `tdpbf16ps` ([`crate::kernels::cpu::gemm_bf16::amx`]);
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
