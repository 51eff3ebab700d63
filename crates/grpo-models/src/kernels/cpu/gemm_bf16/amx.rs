//! The bf16 GEMM of CPU mixed precision on AMX tiles ([`Isa::Amx`]: Intel Xeon since Sapphire
//! Rapids): `C (+)= A B` with `A` and `B` f32 in memory, rounded to bf16 as they are packed, the
//! products summed in f32, as [`super::gemm`] does with `vdpbf16ps`.
//!
//! One `tdpbf16ps` multiplies a tile of 16 rows x 32 bf16 values of `A` by a tile of 16 pair
//! rows x 16 columns of `B` into 16 x 16 f32 sums: 8192 multiply-adds, where `vdpbf16ps` does 32.
//! The operands are packed as for the AVX512_BF16 kernel (pair words along `k`; `B` in panels of
//! [`PANEL`] = 32 columns, a panel's row `j` holding the pairs `(B[2j, c], B[2j + 1, c])`, which
//! is the layout the instruction reads), with `k / 2` padded to a multiple of 16 and the rows of
//! `A` to a multiple of 16, all with zeros. A block of 32 rows times one panel keeps its four
//! C tiles in tile registers over all of `k` (two A tiles and two B tiles loaded per 32 values of
//! `k`), then stores them and adds or writes them to the output.
//!
//! Rounding: each step adds a pair's two products to the running f32 sum, in `k` order, as the
//! AVX512_BF16 kernel does; Intel does not document the rounding of the pair's two products as
//! the same, so this variant is tested against the exact product of the rounded inputs within
//! f32 summation error, not bit for bit against the others. Denormal inputs count as zero.

use std::arch::asm;

use rayon::prelude::*;

use super::{pack_rows_padded, store, Bf16Panels, Out, Strided, PACKED};
use crate::kernels::cpu::panels::{share, PANEL};
#[cfg(doc)]
use crate::kernels::Isa;

/// Rows of a tile, and pair words (32 bf16 values) of an A tile's row.
const TILE: usize = 16;

/// The tile configuration (`ldtilecfg`'s 64-byte operand): palette 1, tiles 0-7 all 16 rows of
/// 64 bytes. Tiles 0-3 hold C, 4-5 A, 6-7 B.
#[repr(C, align(64))]
struct Config([u8; 64]);

impl Config {
    fn new() -> Self {
        let mut c = [0u8; 64];
        c[0] = 1; // palette
        for t in 0..8 {
            c[16 + 2 * t] = 64; // bytes per row (u16, little-endian)
            c[48 + t] = TILE as u8; // rows
        }
        Config(c)
    }
}

/// The tile state of this thread, configured for the GEMM, released when dropped (so that the
/// thread's saved state is small again between GEMMs).
struct Tiles;

impl Tiles {
    /// # Safety
    /// The CPU must run AMX and the process must hold the tile-data permission
    /// ([`Isa::Amx`] is usable).
    unsafe fn configure() -> Tiles {
        let cfg = Config::new();
        // SAFETY: (caller) AMX runs; `cfg` is a valid 64-byte configuration.
        unsafe { asm!("ldtilecfg [{0}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly)) };
        Tiles
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: a `Tiles` exists only where AMX runs (`configure`).
        unsafe { asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
    }
}

/// `c` [`TWO` ? 32 : 16 rows, 32] (row stride 32 f32) = `a` [rows, `kh`] pair words (row
/// stride `kh`) times one panel `b` [`kh`, 32] pair words.
///
/// # Safety
/// Tiles configured on this thread ([`Tiles::configure`]); `kh` a multiple of 16; `a` valid
/// for 16 (32 when `TWO`) rows of `kh` words, `b` for `kh` rows of [`PANEL`] words, `c` for
/// writes of 16 (32) rows of 32 f32.
#[inline(never)]
unsafe fn block<const TWO: bool>(a: *const u32, kh: usize, b: *const u32, c: *mut f32) {
    let (sa, sb, sc) = (4 * kh, 4 * PANEL, 4 * PANEL);
    // SAFETY: (caller) for every load and store below; the tile registers are this function's
    // alone (the compiler emits no tile instructions of its own).
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem, preserves_flags)
        );
        let mut j = 0;
        while j < kh {
            let (ap, bp) = (a.add(j), b.add(j * PANEL));
            asm!(
                "tileloadd tmm6, [{b} + {sb}*1]",
                "tileloadd tmm7, [{b16} + {sb}*1]",
                "tileloadd tmm4, [{a} + {sa}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                b = in(reg) bp,
                b16 = in(reg) bp.add(TILE),
                a = in(reg) ap,
                sa = in(reg) sa,
                sb = in(reg) sb,
                options(nostack, readonly, preserves_flags)
            );
            if TWO {
                asm!(
                    "tileloadd tmm5, [{a} + {sa}*1]",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    a = in(reg) ap.add(TILE * kh),
                    sa = in(reg) sa,
                    options(nostack, readonly, preserves_flags)
                );
            }
            j += TILE;
        }
        asm!(
            "tilestored [{c} + {sc}*1], tmm0",
            "tilestored [{c16} + {sc}*1], tmm1",
            c = in(reg) c,
            c16 = in(reg) c.add(TILE),
            sc = in(reg) sc,
            options(nostack, preserves_flags)
        );
        if TWO {
            let c2 = c.add(TILE * PANEL);
            asm!(
                "tilestored [{c} + {sc}*1], tmm2",
                "tilestored [{c16} + {sc}*1], tmm3",
                c = in(reg) c2,
                c16 = in(reg) c2.add(TILE),
                sc = in(reg) sc,
                options(nostack, preserves_flags)
            );
        }
    }
}

/// Rows `rows` of `aw` (packed rows of `kh` pair words, their count rounded up to 16 with zero
/// rows) times the panels `panels` of `bp` ([.., n]), panel by panel, in blocks of 32 rows:
/// `emit(row, panel, sums)` receives each row's sums for one panel (its columns below `n`).
///
/// # Safety
/// Tiles configured on this thread ([`Tiles::configure`]); `kh` a multiple of 16 and `bp`'s rows
/// per panel; `aw` holds `rows.end` rounded up to 16 rows.
unsafe fn multiply(
    aw: &[u32],
    kh: usize,
    bp: &Bf16Panels,
    n: usize,
    rows: std::ops::Range<usize>,
    panels: std::ops::Range<usize>,
    mut emit: impl FnMut(usize, usize, &[f32]),
) {
    debug_assert!(kh.is_multiple_of(TILE) && bp.kh() == kh);
    debug_assert!(aw.len() >= rows.end.div_ceil(TILE) * TILE * kh);
    let mut acc = [0f32; 2 * TILE * PANEL];
    for p in panels {
        let w = bp.panel(p).as_ptr();
        let cols = (n - p * PANEL).min(PANEL);
        for r in rows.clone().step_by(2 * TILE) {
            let x = aw[r * kh..].as_ptr();
            let count = (rows.end - r).min(2 * TILE);
            // SAFETY: (caller) tiles configured, `kh` a multiple of 16; `aw` holds r + 16 rows
            // (r + 32 when more than 16 are left), `w` `kh` rows of a panel, `acc` 32 rows of 32.
            unsafe {
                match count > TILE {
                    true => block::<true>(x, kh, w, acc.as_mut_ptr()),
                    false => block::<false>(x, kh, w, acc.as_mut_ptr()),
                }
            }
            for i in 0..count {
                emit(r + i, p, &acc[i * PANEL..i * PANEL + cols]);
            }
        }
    }
}

/// Rows of `A` per pass over the panels of `B` ([n] columns). Measured on an Intel Xeon with
/// AMX (2 cores, 2 MiB of L2 each): 64 rows make the LM head's product (n = 49152, k = 576)
/// 1.5x faster than 128, whose rows of `A` fall out of L1 while the many panels of `B` stream
/// through; 128 are 1.2x faster than 64 for a square 2048 product, and equal for a layer's
/// projections.
fn block_rows(n: usize) -> usize {
    if n >= 8192 {
        4 * TILE
    } else {
        8 * TILE
    }
}

/// [`super::gemm`] on AMX tiles: `dst (+)= A B` for `A` [m, k] and `B` [k, n] f32,
/// multiplied in bf16 with f32 sums.
///
/// # Safety
/// As [`super::gemm`], and the CPU must run AMX with the process's tile-data
/// permission granted ([`Isa::Amx`] usable).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: isize,
    dst_cs: isize,
    accumulate: bool,
    a: Strided,
    b: Strided,
) {
    if m == 0 || n == 0 {
        return;
    }
    let kh = k.div_ceil(2).div_ceil(TILE) * TILE;
    let (bw, aw) = PACKED.with(|c| c.take());
    // SAFETY: (caller) the views' elements are valid.
    let (bp, aw) = unsafe {
        (
            Bf16Panels::pack_padded(b, k, n, bw, kh),
            pack_rows_padded(a, m, k, aw, kh, m.div_ceil(TILE) * TILE),
        )
    };
    let panels = bp.panels();
    let tasks = rayon::current_num_threads().clamp(1, panels);
    let block_rows = block_rows(n);
    let blocks = m.div_ceil(block_rows);
    let out = Out(dst);
    (0..tasks * blocks).into_par_iter().for_each(|tb| {
        let (t, blk) = (tb % tasks, tb / tasks);
        let (r0, r1) = (blk * block_rows, ((blk + 1) * block_rows).min(m));
        // SAFETY: (caller) AMX runs with its permission.
        let _tiles = unsafe { Tiles::configure() };
        // SAFETY: tiles configured; `kh` is a multiple of 16; `aw` holds the rows up to m
        // rounded up to 16.
        unsafe {
            multiply(
                &aw,
                kh,
                &bp,
                n,
                r0..r1,
                share(panels, t, tasks),
                |r, p, sums| {
                    // SAFETY: (caller) row r < m, columns p * PANEL.. + sums.len() <= n of `dst`;
                    // this task alone writes its row block's columns of its panels.
                    let d = out
                        .get()
                        .offset(r as isize * dst_rs + (p * PANEL) as isize * dst_cs);
                    store(sums, d, dst_cs, accumulate)
                },
            )
        };
    });
    PACKED.with(|c| c.replace((bp.into_words(), aw)));
}

thread_local! {
    /// [`panels`]'s rows of pair words, kept for the next call.
    static ROWS: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Whether [`panels`] takes `bp`: its rows per panel a multiple of 16 (`k` a multiple of 32,
/// as every projection of the Llama shapes grpo trains is).
pub(crate) fn takes(bp: &Bf16Panels) -> bool {
    bp.kh().is_multiple_of(TILE)
}

/// The packed product ([`crate::kernels::cpu::packed::PackedWeight`]'s bf16 panels) on AMX tiles, with no
/// threads of its own: columns `panels` (in panels of [`PANEL`]) of rows `rows` of `x` ([.., k]
/// row-major) times `bp` ([k, n]) into `y` ([.., n] row-major). The rows are rounded to bf16
/// pair words on this thread, padded to 16 with zeros.
///
/// # Safety
/// [`Isa::Amx`] usable; `takes(bp)`; `x` holds `rows.end` rows of `k`; `y` is valid for writes
/// of `rows.end` rows of `n`, and no other thread touches the rows x columns block written here.
pub(crate) unsafe fn panels(
    bp: &Bf16Panels,
    k: usize,
    n: usize,
    x: &[f32],
    rows: std::ops::Range<usize>,
    panels: std::ops::Range<usize>,
    y: *mut f32,
) {
    let kh = bp.kh();
    debug_assert!(takes(bp) && kh == k.div_ceil(2));
    let m = rows.len();
    let mut xw = ROWS.with(|c| c.take());
    super::pack_rows_here(&x[rows.start * k..rows.end * k], m, k, &mut xw);
    xw.resize(m.div_ceil(TILE) * TILE * kh, 0);
    // SAFETY: (caller) AMX runs with its permission.
    let tiles = unsafe { Tiles::configure() };
    for r0 in (0..m).step_by(block_rows(n)) {
        let r1 = (r0 + block_rows(n)).min(m);
        // SAFETY: tiles configured; `kh` a multiple of 16 (`takes`); `xw` holds m rows rounded
        // up to 16.
        unsafe {
            multiply(&xw, kh, bp, n, r0..r1, panels.clone(), |r, p, sums| {
                // SAFETY: (caller) row rows.start + r, columns p * PANEL.. + sums.len() of `y`.
                let d = y.add((rows.start + r) * n + p * PANEL);
                std::ptr::copy_nonoverlapping(sums.as_ptr(), d, sums.len())
            })
        };
    }
    drop(tiles);
    ROWS.with(|c| c.replace(xw));
}

#[cfg(test)]
mod tests {
    use super::super::{from_bf16, test_values as values, to_bf16};
    use crate::kernels::Isa;

    /// `x` [m, k] times `w` [n, k] transposed, from the bf16-rounded values, in f64.
    fn exact(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
        let r = |v: f32| from_bf16(to_bf16(v)) as f64;
        let mut y = vec![0f64; m * n];
        for i in 0..m {
            for c in 0..n {
                y[i * n + c] = (0..k).map(|j| r(x[i * k + j]) * r(w[c * k + j])).sum();
            }
        }
        y
    }

    /// The decoding and reference product on AMX tiles ([`crate::kernels::cpu::panels`], through the packed
    /// weight) equals the exact product of the rounded inputs within f32 summation error, and
    /// the AVX512_BF16 kernel's result as closely: row counts that are not multiples of 16 or
    /// 32, more rows than one pass takes, a ragged last panel, the LM head's row blocks.
    #[test]
    fn amx_packed_product_equals_the_rounded_product() {
        if Isa::Amx.usable() != Isa::Amx {
            eprintln!("this CPU does not run AMX: skipped");
            return;
        }
        use crate::kernels::cpu::packed::PackedWeight;
        for &(m, k, n) in &[(1, 32, 40), (45, 64, 100), (200, 96, 33), (70, 32, 8200)] {
            let (x, w) = (values(m * k, 7), values(n * k, 8));
            let wt =
                candle_core::Tensor::from_slice(&w, (n, k), &candle_core::Device::Cpu).unwrap();
            let packed = PackedWeight::from_out_in_bf16(&wt).unwrap();
            let want = exact(&x, &w, m, k, n);
            let amx = packed.matmul_on(Isa::Amx, &x, m);
            let dp = packed.matmul_on(Isa::Avx512Bf16, &x, m);
            for (i, e) in want.iter().enumerate() {
                let tol = 1e-5 * k as f64;
                assert!(
                    (amx[i] as f64 - e).abs() < tol,
                    "[{m},{k},{n}] {i}: {} against {e}",
                    amx[i]
                );
                assert!(
                    (amx[i] - dp[i]).abs() < 2.0 * tol as f32,
                    "[{m},{k},{n}] {i}"
                );
            }
        }
    }
}
