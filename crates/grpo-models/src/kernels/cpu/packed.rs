//! The decoding GEMM: `y = x W^T` for the few-row products of sampling (one row per sequence
//! being decoded), on a weight packed once into column panels.
//!
//! candle's CPU GEMM (the `gemm` crate) is built for large products; with 1 to 64 rows it spends
//! most of its time packing and splitting work (`examples/decode_gemm.rs` measures both; numbers
//! in bench/README.md). This kernel keeps the weight in panels of [`PANEL`] output columns,
//! each panel `[in, PANEL]` contiguous, so a tile of up to 12 input rows times one panel streams
//! the panel once, with the 24 accumulators in AVX-512 registers. With AVX2 (16 registers of 8) a
//! tile is cut into passes of up to 6 rows times half a panel (12 accumulators); each output
//! element is the same chain of FMAs in the same order, so the two variants agree bit for bit.
//!
//! Only the forward exists: a packed projection is for detached (sampling and scoring) models,
//! built by `models::CausalLm::pack_for_decoding`. Without AVX2 (or with `kernels =
//! "portable"`) the packed layout is not used at all (`Compute::packs_for_decoding`); the plain
//! loop [`matmul_portable`] is the kernels' twin in tests and the fallback of last resort.

use candle_core::{bail, CpuStorage, DType, Device, Result, Storage, Tensor};

use crate::kernels::cpu::gemm_bf16::{Bf16Panels, Strided};
use crate::kernels::cpu::packed_quant::QuantPanels;
use crate::kernels::cpu::quant::QuantProj;
use crate::kernels::Isa;
use rayon::prelude::*;

pub(crate) use crate::kernels::cpu::panels::share;
pub use crate::kernels::cpu::panels::PANEL;
/// Input rows per register tile.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const TILE_ROWS: usize = 12;
/// Input rows per parallel task (a block of rows reuses each panel from cache).
const BLOCK_ROWS: usize = 192;

/// A weight `W` [out, in] stored as `ceil(out / PANEL)` panels, panel `p` holding
/// `W[p*PANEL .. p*PANEL+PANEL, :]^T` as `[in, PANEL]` rows (zero columns past `out`).
///
/// A frozen quantized weight keeps its codes instead ([`QuantPanels`]), and each panel is
/// dequantized as the product reaches it: the same product at about the quantized size.
#[derive(Debug)]
pub struct PackedWeight {
    data: Store,
    /// in
    k: usize,
    /// out
    n: usize,
}

/// A packed weight's panels: floats, or quantized codes dequantized panel by panel.
#[derive(Debug)]
enum Store {
    F32(Vec<f32>),
    Quant(QuantPanels),
    /// bf16 pair words, for CPU mixed precision's products ([`crate::kernels::cpu::gemm_bf16`]).
    Bf16(Bf16Panels),
}

thread_local! {
    /// A dequantized panel of a quantized weight, per thread (reused across calls).
    static PANEL_BUF: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The f32 data of a CPU tensor, made contiguous.
fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let (st, l) = t.storage_and_layout();
    match &*st {
        Storage::Cpu(CpuStorage::F32(v)) => {
            f(&v[l.start_offset()..l.start_offset() + t.elem_count()])
        }
        _ => bail!("packed weight: expected an f32 CPU tensor"),
    }
}

impl PackedWeight {
    fn panels(&self) -> usize {
        self.n.div_ceil(PANEL)
    }

    fn check(t: &Tensor) -> Result<(usize, usize)> {
        if !t.device().is_cpu() || t.dtype() != DType::F32 {
            bail!("packed weight: expected an f32 CPU tensor");
        }
        t.dims2()
    }

    /// Packs `wt` [in, out] (the transposed weight, as `models::layers::Linear` keeps it).
    pub fn from_in_out(wt: &Tensor) -> Result<Self> {
        let (k, n) = Self::check(wt)?;
        with_f32(wt, |src| {
            let mut data = vec![0f32; n.div_ceil(PANEL) * k * PANEL];
            data.par_chunks_mut(k * PANEL)
                .enumerate()
                .for_each(|(p, panel)| {
                    let (c0, c1) = (p * PANEL, ((p + 1) * PANEL).min(n));
                    for (kk, row) in panel.chunks_exact_mut(PANEL).enumerate() {
                        row[..c1 - c0].copy_from_slice(&src[kk * n + c0..kk * n + c1]);
                    }
                });
            Ok(Self {
                data: Store::F32(data),
                k,
                n,
            })
        })
    }

    /// Packs a frozen quantized weight ([`QuantPanels`]); `None` where that layout does not
    /// apply (NF4 rows that are not whole blocks).
    pub fn from_quant(q: &QuantProj) -> Result<Option<Self>> {
        Ok(QuantPanels::new(q)?.map(|qp| {
            let (k, n) = qp.dims();
            Self {
                data: Store::Quant(qp),
                k,
                n,
            }
        }))
    }

    /// Packs `w` [out, in] (HF layout) as bf16 for CPU mixed precision: products of bf16
    /// inputs with f32 sums ([`crate::kernels::cpu::gemm_bf16`]), the input rounded to bf16 at each call.
    pub fn from_out_in_bf16(w: &Tensor) -> Result<Self> {
        let (n, k) = Self::check(w)?;
        Self::bf16_of(w, k, n, (1, k as isize))
    }

    /// [`Self::from_out_in_bf16`] from `wt` [in, out] (the layout `models::layers::Linear` keeps).
    pub fn from_in_out_bf16(wt: &Tensor) -> Result<Self> {
        let (k, n) = Self::check(wt)?;
        Self::bf16_of(wt, k, n, (n as isize, 1))
    }

    /// bf16 panels of the `[k, n]` matrix whose element `(kk, c)` is at `kk * rs + c * cs` in
    /// `t`'s contiguous data (`t` holds `k * n` values).
    fn bf16_of(t: &Tensor, k: usize, n: usize, (rs, cs): (isize, isize)) -> Result<Self> {
        with_f32(t, |src| {
            let view = Strided {
                ptr: src.as_ptr(),
                rs,
                cs,
            };
            // SAFETY: both callers' strides address the k * n elements of `src`.
            let panels = unsafe { Bf16Panels::pack(view, k, n) };
            Ok(Self {
                data: Store::Bf16(panels),
                k,
                n,
            })
        })
    }

    /// Whether the product is in bf16 ([`Self::from_out_in_bf16`]).
    pub fn is_bf16(&self) -> bool {
        matches!(self.data, Store::Bf16(_))
    }

    /// Bytes the packed weight occupies.
    pub fn size_in_bytes(&self) -> usize {
        match &self.data {
            Store::F32(d) => 4 * d.len(),
            Store::Quant(q) => q.size_in_bytes(),
            Store::Bf16(b) => b.size_in_bytes(),
        }
    }

    /// Panel `p` as `[k, PANEL]` floats: a view of the f32 panels, or the quantized panel
    /// dequantized into `buf` (resized as needed) with the `isa` variant.
    fn panel<'a>(&'a self, isa: Isa, p: usize, buf: &'a mut Vec<f32>) -> &'a [f32] {
        let len = self.k * PANEL;
        match &self.data {
            Store::F32(d) => &d[p * len..(p + 1) * len],
            Store::Quant(q) => {
                buf.resize(len, 0.0);
                q.panel_into(isa, p, buf);
                &buf[..len]
            }
            Store::Bf16(b) => {
                buf.resize(len, 0.0);
                for (kk, row) in buf.chunks_exact_mut(PANEL).enumerate() {
                    for (c, v) in row.iter_mut().enumerate() {
                        *v = if p * PANEL + c < self.n {
                            b.get(kk, p * PANEL + c)
                        } else {
                            0.0
                        };
                    }
                }
                &buf[..len]
            }
        }
    }

    /// Packs `w` [out, in] (HF layout, e.g. a tied embedding used as the LM head).
    pub fn from_out_in(w: &Tensor) -> Result<Self> {
        let (n, k) = Self::check(w)?;
        with_f32(w, |src| {
            let mut data = vec![0f32; n.div_ceil(PANEL) * k * PANEL];
            data.par_chunks_mut(k * PANEL)
                .enumerate()
                .for_each(|(p, panel)| {
                    for c in 0..PANEL.min(n - p * PANEL) {
                        let col = &src[(p * PANEL + c) * k..(p * PANEL + c + 1) * k];
                        for (kk, v) in col.iter().enumerate() {
                            panel[kk * PANEL + c] = *v;
                        }
                    }
                });
            Ok(Self {
                data: Store::F32(data),
                k,
                n,
            })
        })
    }

    /// (in, out)
    pub fn dims(&self) -> (usize, usize) {
        (self.k, self.n)
    }

    /// The weight as a contiguous [in, out] tensor.
    pub fn to_in_out(&self) -> Result<Tensor> {
        let (k, n) = (self.k, self.n);
        let mut out = vec![0f32; k * n];
        let mut buf = Vec::new();
        for p in 0..self.panels() {
            let (c0, c1) = (p * PANEL, ((p + 1) * PANEL).min(n));
            let panel = self.panel(Isa::Baseline, p, &mut buf);
            for kk in 0..k {
                let row = &panel[kk * PANEL..];
                out[kk * n + c0..kk * n + c1].copy_from_slice(&row[..c1 - c0]);
            }
        }
        Tensor::from_vec(out, (k, n), &Device::Cpu)
    }

    /// `x` [.., in] -> `x W^T` [.., out]. `x` must not need a gradient (there is no backward).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.track_op() {
            bail!(
                "a packed (decoding) projection has no backward; build a trainable model instead"
            );
        }
        let dims = x.dims().to_vec();
        let Some((&k, lead)) = dims.split_last() else {
            bail!("packed projection: scalar input");
        };
        if k != self.k {
            bail!(
                "packed projection: input has {k} features, the weight {}",
                self.k
            );
        }
        let rows: usize = lead.iter().product();
        let y = with_f32(x, |xs| Ok(self.matmul(xs, rows)))?;
        let mut shape = lead.to_vec();
        shape.push(self.n);
        Tensor::from_vec(y, shape, &Device::Cpu)
    }

    /// `x` [rows, in] row-major -> [rows, out], at the active [`Isa`].
    pub fn matmul(&self, x: &[f32], rows: usize) -> Vec<f32> {
        self.matmul_on(Isa::active(), x, rows)
    }

    /// [`Self::matmul`] with the `isa` variant of the kernel (lowered to what this CPU runs; the
    /// baseline is [`matmul_portable`]).
    pub fn matmul_on(&self, isa: Isa, x: &[f32], rows: usize) -> Vec<f32> {
        let isa = isa.usable();
        if isa == Isa::Baseline && !self.is_bf16() {
            return matmul_portable(self, x, rows);
        }
        let (n, panels) = (self.n, self.panels());
        let mut y: Vec<f32> = Vec::with_capacity(rows * n);
        let yp = SendPtr(y.as_mut_ptr());
        // One contiguous run of panels per thread (and row block): equal shares, and each
        // thread's next panel is the one its prefetch fetches.
        let tasks = rayon::current_num_threads().clamp(1, panels.max(1));
        let blocks = rows.div_ceil(BLOCK_ROWS);
        (0..tasks * blocks).into_par_iter().for_each(|tb| {
            let (t, b) = (tb % tasks, tb / tasks);
            let (r0, r1) = (b * BLOCK_ROWS, ((b + 1) * BLOCK_ROWS).min(rows));
            // SAFETY: `isa` is AVX2 or AVX-512 and the CPU runs it (`usable`); `x` holds `rows`
            // rows; task `tb` writes rows r0..r1 of its own panels, which no other task writes.
            unsafe { self.panels_simd(isa, x, r0..r1, share(panels, t, tasks), yp.get()) };
        });
        // SAFETY: the tasks above wrote every element of the rows x n output.
        unsafe { y.set_len(rows * n) };
        y
    }

    /// Output columns `panels` (in panels of [`PANEL`]) for input rows `rows` of `x` ([.., in]
    /// row-major) into `y` ([.., out] row-major), with no threads of its own: the decoding
    /// step's thread team ([`crate::kernels::cpu::decode`]) gives each thread its share of panels.
    ///
    /// # Safety
    /// `isa` must be AVX2 or AVX-512 and the CPU must run it (see [`Isa::usable`]); `x` must
    /// hold `rows.end` rows of `in`; `y` must be valid for writes of `rows.end` rows of `out`,
    /// and no other thread may touch the rows x columns block written here meanwhile.
    pub(crate) unsafe fn panels_simd(
        &self,
        isa: Isa,
        x: &[f32],
        rows: std::ops::Range<usize>,
        panels: std::ops::Range<usize>,
        y: *mut f32,
    ) {
        if let Store::Bf16(bp) = &self.data {
            // SAFETY: (caller) as this function's.
            unsafe { self.panels_bf16(bp, isa, x, rows, panels, y) };
            return;
        }
        // Without x86-64 no SIMD level is ever usable (`Isa::detected` is the baseline).
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (isa, x, rows, panels, y);
            unreachable!("no SIMD packed kernel on this architecture");
        }
        #[cfg(target_arch = "x86_64")]
        {
            let (k, n) = (self.k, self.n);
            for blk in rows.clone().step_by(BLOCK_ROWS) {
                let (r0, r1) = (blk, (blk + BLOCK_ROWS).min(rows.end));
                let tiles = (r1 - r0).div_ceil(TILE_ROWS);
                for p in panels.clone() {
                    let cols = (n - p * PANEL).min(PANEL);
                    let mut buf = match &self.data {
                        Store::F32(_) => Vec::new(),
                        Store::Quant(_) | Store::Bf16(_) => PANEL_BUF.with(|b| b.take()),
                    };
                    let w = self.panel(isa, p, &mut buf);
                    // The next f32 panel, a share per tile, fetched while this one computes (a
                    // quantized one is small and read in order: left to the hardware).
                    let next = match &self.data {
                        Store::F32(d) => d.get((p + 1) * k * PANEL..(p + 2) * k * PANEL),
                        Store::Quant(_) | Store::Bf16(_) => None,
                    };
                    let share = (k * PANEL).div_ceil(tiles);
                    let (mut r, mut tile) = (r0, 0);
                    while r < r1 {
                        // Tiles of near-equal height (64 rows: 11,11,11,11,10,10, not 12 x 5 + 4):
                        // a short tile streams the whole panel for few rows.
                        let mr = (r1 - r0) / tiles + usize::from(tile < (r1 - r0) % tiles);
                        let xs = &x[r * k..(r + mr) * k];
                        let ahead = next.map_or(&[][..], |nx| {
                            &nx[(tile * share).min(nx.len())..((tile + 1) * share).min(nx.len())]
                        });
                        let yt = y.add(r * n + p * PANEL);
                        // SAFETY: (caller) the CPU runs `isa`; `xs` holds `mr` rows of `k`, `w` one
                        // panel of `k` rows; the tile writes rows r..r+mr, columns p*PANEL..+cols.
                        unsafe {
                            match isa {
                                Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => {
                                    avx512::tile(xs, w, k, mr, yt, n, cols, ahead)
                                }
                                _ => avx2::tile(xs, w, k, mr, yt, n, cols, ahead),
                            }
                        }
                        r += mr;
                        tile += 1;
                    }
                    if let Store::Quant(_) = &self.data {
                        PANEL_BUF.with(|b| b.replace(buf));
                    }
                }
            }
        }
    }

    /// [`Self::panels_simd`] for bf16 panels, at any `isa` ([`crate::kernels::cpu::gemm_bf16::tile_on`]):
    /// each block of input rows rounded to bf16 pair words on this thread, then tiles of up to
    /// 12 rows times one panel.
    ///
    /// # Safety
    /// As [`Self::panels_simd`], at any level.
    unsafe fn panels_bf16(
        &self,
        bp: &Bf16Panels,
        isa: Isa,
        x: &[f32],
        rows: std::ops::Range<usize>,
        panels: std::ops::Range<usize>,
        y: *mut f32,
    ) {
        use crate::kernels::cpu::gemm_bf16::{pack_rows_here, tile_on, TILE_ROWS as BF16_TILE};
        let (k, n, kh) = (self.k, self.n, bp.kh());
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Amx && crate::kernels::cpu::gemm_bf16::amx::takes(bp) {
            // SAFETY: (caller) as this function's; the CPU runs AMX (`isa` is usable).
            unsafe { crate::kernels::cpu::gemm_bf16::amx::panels(bp, k, n, x, rows, panels, y) };
            return;
        }
        let mut xw = Vec::new();
        let mut acc = [0f32; BF16_TILE * PANEL];
        for blk in rows.clone().step_by(BLOCK_ROWS) {
            let (r0, r1) = (blk, (blk + BLOCK_ROWS).min(rows.end));
            pack_rows_here(&x[r0 * k..r1 * k], r1 - r0, k, &mut xw);
            let tiles = (r1 - r0).div_ceil(BF16_TILE);
            for p in panels.clone() {
                let cols = (n - p * PANEL).min(PANEL);
                let w = bp.panel(p);
                let (mut r, mut tile) = (r0, 0);
                while r < r1 {
                    let mr = (r1 - r0) / tiles + usize::from(tile < (r1 - r0) % tiles);
                    tile_on(
                        isa,
                        &xw[(r - r0) * kh..(r - r0 + mr) * kh],
                        w,
                        kh,
                        mr,
                        &mut acc,
                    );
                    for i in 0..mr {
                        // SAFETY: (caller) row r + i, columns p * PANEL + cols of `y` are this
                        // call's to write.
                        let yr = unsafe { y.add((r + i) * n + p * PANEL) };
                        unsafe {
                            std::ptr::copy_nonoverlapping(acc[i * PANEL..].as_ptr(), yr, cols)
                        };
                    }
                    r += mr;
                    tile += 1;
                }
            }
        }
    }

    /// Number of column panels.
    pub(crate) fn panel_count(&self) -> usize {
        self.panels()
    }
}

/// The output pointer, shared by tasks that write disjoint tiles.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: tasks write disjoint elements through it (see `PackedWeight::matmul_on`).
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// The packed product in plain loops: the SIMD kernels' twin, and the path without them.
pub fn matmul_portable(w: &PackedWeight, x: &[f32], rows: usize) -> Vec<f32> {
    let (k, n) = (w.k, w.n);
    let mut y = vec![0f32; rows * n];
    y.par_chunks_mut(n).enumerate().for_each(|(r, yr)| {
        let xr = &x[r * k..(r + 1) * k];
        let mut buf = Vec::new();
        for p in 0..w.panels() {
            let panel = w.panel(Isa::Baseline, p, &mut buf);
            let mut acc = [0f32; PANEL];
            for (kk, xv) in xr.iter().enumerate() {
                let wr = &panel[kk * PANEL..(kk + 1) * PANEL];
                for (a, wv) in acc.iter_mut().zip(wr) {
                    *a += xv * wv;
                }
            }
            let c0 = p * PANEL;
            let c1 = (c0 + PANEL).min(n);
            yr[c0..c1].copy_from_slice(&acc[..c1 - c0]);
        }
    });
    y
}

/// The cache lines of `ahead` (a share of the next panel) prefetched into L2 evenly over the
/// `k` steps of a tile, so that streaming the weight from memory overlaps with the FMAs.
#[cfg(target_arch = "x86_64")]
struct Prefetch<'a> {
    ahead: &'a [f32],
    lines: usize,
    /// Lines per k step, in 1/65536ths.
    rate: usize,
    due: usize,
    line: usize,
}

#[cfg(target_arch = "x86_64")]
impl<'a> Prefetch<'a> {
    /// Floats per cache line.
    const LINE: usize = 16;

    fn new(ahead: &'a [f32], k: usize) -> Self {
        let lines = ahead.len().div_ceil(Self::LINE);
        Prefetch {
            ahead,
            lines,
            rate: (lines << 16).div_ceil(k.max(1)),
            due: 0,
            line: 0,
        }
    }

    /// One k step: the lines now due.
    #[inline(always)]
    fn step(&mut self) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        self.due += self.rate;
        while self.line < self.lines && (self.line << 16) < self.due {
            let p = self.ahead[self.line * Self::LINE..].as_ptr() as *const i8;
            // SAFETY: a prefetch is a hint; `p` points into `ahead`.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p) };
            self.line += 1;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::PANEL;
    use std::arch::x86_64::*;

    /// `mr` (1..=12) rows of `x` ([mr, k]) times one panel `w` ([k, PANEL]) into `y` (row
    /// stride `ldy`), of which the first `cols` columns are written. The cache lines of `ahead`
    /// (a share of the next panel) are prefetched into L2 along the way, so that streaming the
    /// weight from memory overlaps with the FMAs instead of following them.
    ///
    /// # Safety
    /// AVX-512F must be available; `y` must be valid for `mr` rows of `cols` columns.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tile(
        x: &[f32],
        w: &[f32],
        k: usize,
        mr: usize,
        y: *mut f32,
        ldy: usize,
        cols: usize,
        ahead: &[f32],
    ) {
        match mr {
            12 => tile_n::<12>(x, w, k, y, ldy, cols, ahead),
            11 => tile_n::<11>(x, w, k, y, ldy, cols, ahead),
            10 => tile_n::<10>(x, w, k, y, ldy, cols, ahead),
            9 => tile_n::<9>(x, w, k, y, ldy, cols, ahead),
            8 => tile_n::<8>(x, w, k, y, ldy, cols, ahead),
            7 => tile_n::<7>(x, w, k, y, ldy, cols, ahead),
            6 => tile_n::<6>(x, w, k, y, ldy, cols, ahead),
            5 => tile_n::<5>(x, w, k, y, ldy, cols, ahead),
            4 => tile_n::<4>(x, w, k, y, ldy, cols, ahead),
            3 => tile_n::<3>(x, w, k, y, ldy, cols, ahead),
            2 => tile_n::<2>(x, w, k, y, ldy, cols, ahead),
            _ => tile_n::<1>(x, w, k, y, ldy, cols, ahead),
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn tile_n<const MR: usize>(
        x: &[f32],
        w: &[f32],
        k: usize,
        y: *mut f32,
        ldy: usize,
        cols: usize,
        ahead: &[f32],
    ) {
        debug_assert!(x.len() >= MR * k && w.len() >= k * PANEL);
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        let mut lo = [_mm512_setzero_ps(); MR];
        let mut hi = [_mm512_setzero_ps(); MR];
        let mut fetch = super::Prefetch::new(ahead, k);
        for kk in 0..k {
            fetch.step();
            let w0 = _mm512_loadu_ps(wp.add(kk * PANEL));
            let w1 = _mm512_loadu_ps(wp.add(kk * PANEL + 16));
            for i in 0..MR {
                let xv = _mm512_set1_ps(*xp.add(i * k + kk));
                lo[i] = _mm512_fmadd_ps(xv, w0, lo[i]);
                hi[i] = _mm512_fmadd_ps(xv, w1, hi[i]);
            }
        }
        let mask = |c: usize| -> __mmask16 {
            match c {
                0 => 0,
                c if c >= 16 => 0xffff,
                c => ((1u32 << c) - 1) as __mmask16,
            }
        };
        let (m0, m1) = (mask(cols), mask(cols.saturating_sub(16)));
        for i in 0..MR {
            _mm512_mask_storeu_ps(y.add(i * ldy), m0, lo[i]);
            _mm512_mask_storeu_ps(y.add(i * ldy + 16), m1, hi[i]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::PANEL;
    use std::arch::x86_64::*;

    /// Rows per pass: 6 rows x 2 registers = 12 accumulators of AVX2's 16.
    const PASS_ROWS: usize = 6;

    /// The AVX-512 `tile` in AVX2: `mr` (1..=12) rows of `x` times one panel `w` into `y`, as
    /// passes of up to [`PASS_ROWS`] rows times 16 columns (a half panel), each streaming its
    /// half of the panel once. The prefetch of `ahead` is spread over the passes.
    ///
    /// # Safety
    /// AVX2 and FMA must be available; `y` must be valid for `mr` rows of `cols` columns.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tile(
        x: &[f32],
        w: &[f32],
        k: usize,
        mr: usize,
        y: *mut f32,
        ldy: usize,
        cols: usize,
        ahead: &[f32],
    ) {
        let parts = mr.div_ceil(PASS_ROWS).max(1);
        let halves = cols.div_ceil(16).max(1);
        let passes = parts * halves;
        let per = ahead.len().div_ceil(passes);
        let mut pass = 0;
        let mut r = 0;
        for part in 0..parts {
            let rows = mr / parts + usize::from(part < mr % parts);
            for h in 0..halves {
                let hc = cols.saturating_sub(16 * h).min(16);
                let ah = &ahead[(pass * per).min(ahead.len())..((pass + 1) * per).min(ahead.len())];
                let (xs, wh, yh) = (&x[r * k..], &w[16 * h..], y.add(r * ldy + 16 * h));
                match rows {
                    6 => pass_n::<6>(xs, wh, k, yh, ldy, hc, ah),
                    5 => pass_n::<5>(xs, wh, k, yh, ldy, hc, ah),
                    4 => pass_n::<4>(xs, wh, k, yh, ldy, hc, ah),
                    3 => pass_n::<3>(xs, wh, k, yh, ldy, hc, ah),
                    2 => pass_n::<2>(xs, wh, k, yh, ldy, hc, ah),
                    _ => pass_n::<1>(xs, wh, k, yh, ldy, hc, ah),
                }
                pass += 1;
            }
            r += rows;
        }
    }

    /// `MR` rows of `x` ([MR, k]) times 16 columns of a panel (`w` starts at the half's first
    /// column; rows are [`PANEL`] apart) into the first `cols` columns of `y`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn pass_n<const MR: usize>(
        x: &[f32],
        w: &[f32],
        k: usize,
        y: *mut f32,
        ldy: usize,
        cols: usize,
        ahead: &[f32],
    ) {
        debug_assert!(x.len() >= MR * k && w.len() >= k.saturating_sub(1) * PANEL + 16);
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        let mut lo = [_mm256_setzero_ps(); MR];
        let mut hi = [_mm256_setzero_ps(); MR];
        let mut fetch = super::Prefetch::new(ahead, k);
        for kk in 0..k {
            fetch.step();
            let w0 = _mm256_loadu_ps(wp.add(kk * PANEL));
            let w1 = _mm256_loadu_ps(wp.add(kk * PANEL + 8));
            for i in 0..MR {
                let xv = _mm256_set1_ps(*xp.add(i * k + kk));
                lo[i] = _mm256_fmadd_ps(xv, w0, lo[i]);
                hi[i] = _mm256_fmadd_ps(xv, w1, hi[i]);
            }
        }
        for i in 0..MR {
            let yi = y.add(i * ldy);
            if cols == 16 {
                _mm256_storeu_ps(yi, lo[i]);
                _mm256_storeu_ps(yi.add(8), hi[i]);
            } else {
                let mut buf = [0f32; 16];
                _mm256_storeu_ps(buf.as_mut_ptr(), lo[i]);
                _mm256_storeu_ps(buf.as_mut_ptr().add(8), hi[i]);
                std::ptr::copy_nonoverlapping(buf.as_ptr(), yi, cols);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// y = x W^T in f64 from [out, in] data: the reference.
    fn reference(x: &[f32], w: &[f32], rows: usize, k: usize, n: usize) -> Vec<f32> {
        let mut y = vec![0f32; rows * n];
        for r in 0..rows {
            for j in 0..n {
                let s: f64 = (0..k)
                    .map(|i| x[r * k + i] as f64 * w[j * k + i] as f64)
                    .sum();
                y[r * n + j] = s as f32;
            }
        }
        y
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    #[test]
    fn packed_product_matches_reference_for_every_tile_shape() -> Result<()> {
        let dev = Device::Cpu;
        // out not a multiple of the panel, rows covering every tile height and a second block.
        for &(rows, k, n) in &[
            (1, 7, 5),
            (13, 40, 70),
            (25, 64, 33),
            (200, 24, 96),
            (64, 576, 100),
        ] {
            let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
            let x = Tensor::randn(0f32, 1.0, (rows, k), &dev)?;
            let wv = w.flatten_all()?.to_vec1::<f32>()?;
            let xv = x.flatten_all()?.to_vec1::<f32>()?;
            let want = reference(&xv, &wv, rows, k, n);
            let tol = 1e-4 * (k as f32).sqrt();
            for pw in [
                PackedWeight::from_out_in(&w)?,
                PackedWeight::from_in_out(&w.t()?)?,
            ] {
                assert_eq!(pw.dims(), (k, n));
                assert!(
                    max_diff(&pw.matmul(&xv, rows), &want) < tol,
                    "{rows}x{k}x{n}"
                );
                // AVX2 and AVX-512 run the same FMA chains: the same bits.
                let simd: Vec<Vec<f32>> = [Isa::Avx2, Isa::Avx512]
                    .into_iter()
                    .filter(|isa| isa.usable() == *isa)
                    .map(|isa| pw.matmul_on(isa, &xv, rows))
                    .collect();
                for y in &simd {
                    assert!(max_diff(y, &want) < tol, "{rows}x{k}x{n}");
                    assert_eq!(y, &simd[0], "{rows}x{k}x{n}");
                }
                let base = pw.matmul_on(Isa::Baseline, &xv, rows);
                assert!(max_diff(&base, &want) < tol);
                assert!(max_diff(&matmul_portable(&pw, &xv, rows), &want) < tol);
                let back = pw.to_in_out()?.flatten_all()?.to_vec1::<f32>()?;
                let wt = w.t()?.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
                assert_eq!(back, wt);
            }
        }
        Ok(())
    }

    #[test]
    fn forward_keeps_leading_dims_and_refuses_a_graph() -> Result<()> {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (48, 16), &dev)?;
        let pw = PackedWeight::from_out_in(&w)?;
        let x = Tensor::randn(0f32, 1.0, (2, 3, 16), &dev)?;
        let y = pw.forward(&x)?;
        assert_eq!(y.dims(), &[2, 3, 48]);
        let want = x.matmul(
            &w.t()?
                .unsqueeze(0)?
                .broadcast_as((2, 16, 48))?
                .contiguous()?,
        )?;
        let d = (y - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(d < 1e-4, "{d}");
        let v = candle_core::Var::from_tensor(&x)?;
        assert!(pw.forward(&(v.as_tensor() * 1.0)?).is_err());
        Ok(())
    }
}
