//! The bf16 GEMM of CPU mixed precision (`dtype = "bf16"` on the CPU): `C (+)= A B` with `A`
//! and `B` f32 in memory, rounded to bf16 (round to nearest even) as they are packed, and the
//! products summed in f32 accumulators. Weights, gradients and optimizer state stay f32; only
//! the multiplications' inputs lose precision, as under torch's CPU autocast.
//!
//! The kernel is AVX512_BF16's `vdpbf16ps`: one instruction multiplies 16 pairs of bf16 values
//! into 16 f32 accumulators, twice the f32 FMA rate. So that a pair is one 32-bit lane, both
//! operands are packed in pairs along `k`: `B` as panels of [`PANEL`] columns, each `[k / 2,
//! PANEL]` words holding `(B[2j, c], B[2j+1, c])`, and each row of `A` as `k / 2` words (an odd
//! `k` gets a zero). A tile of up to 12 rows times one panel keeps its 24 accumulators in
//! registers, as the f32 decoding GEMM ([`crate::kernels::cpu::packed`]) does.
//!
//! Variants, by [`Isa`] (`GRPO_ISA` forces one): `avx512bf16` runs `vdpbf16ps`; `avx512` and
//! below emulate it with f32 FMAs in its order (the odd element of a pair first, then the even
//! one: each product of two bf16 values is exact in f32, so an FMA rounds it with the sum as the
//! instruction does). They agree bit for bit with the hardware except where a value is a
//! denormal, which the instruction treats as zero and the emulation does not (tests use normal
//! values). Without AVX-512 the emulation is plain Rust: a reference, not a fast path.

use rayon::prelude::*;

use crate::kernels::cpu::panels::{share, PANEL};
use crate::kernels::Isa;

#[cfg(target_arch = "x86_64")]
pub mod amx;

/// Rows per register tile.
pub(crate) const TILE_ROWS: usize = 12;
thread_local! {
    /// [`gemm_on`]'s (and the AMX GEMM's) packed operands (`B`'s panels, `A`'s rows), kept for
    /// the next call.
    pub(crate) static PACKED: std::cell::RefCell<(Vec<u32>, Vec<u32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Rows per parallel task.
pub(crate) const BLOCK_ROWS: usize = 192;

/// `x` rounded to bf16 (round to nearest, ties to even; a NaN stays a quiet NaN), as the high
/// half of its bits.
#[inline(always)]
pub fn to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        ((b >> 16) | 0x40) as u16
    } else {
        ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
    }
}

/// A bf16 value as f32 (exact).
#[inline(always)]
pub fn from_bf16(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// `src` rounded to bf16 into `dst` (same length): [`to_bf16`] of each, 16 at a time with
/// AVX-512 (the same integer rounding, so the same bits).
pub fn to_bf16_slice(src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if Isa::active() >= Isa::Avx512 {
        // SAFETY: the CPU runs AVX-512F (`active` is lowered to what it runs).
        unsafe { x86::to_bf16_slice(src, dst) };
        return;
    }
    for (d, &v) in dst.iter_mut().zip(src) {
        *d = to_bf16(v);
    }
}

/// Two values as one pair word: `lo` (the even `k`) in the low half.
#[inline(always)]
fn pair(lo: f32, hi: f32) -> u32 {
    to_bf16(lo) as u32 | ((to_bf16(hi) as u32) << 16)
}

/// The pair word at `(r, c)` and the next element along `k` (down a column when `down`, else
/// along the row), the second 0 past `k`.
///
/// # Safety
/// Both elements (the first only, at the end of `k`) must lie in the matrix.
#[inline(always)]
unsafe fn pair_at(m: Strided, r: usize, c: usize, k: usize, down: bool) -> u32 {
    let (next, at_k) = if down {
        ((r + 1, c), r + 1)
    } else {
        ((r, c + 1), c + 1)
    };
    // SAFETY: (caller)
    unsafe {
        pair(
            m.at(r, c),
            if at_k < k { m.at(next.0, next.1) } else { 0.0 },
        )
    }
}

/// A strided f32 matrix: element `(r, c)` at `ptr + r * rs + c * cs`.
#[derive(Clone, Copy)]
pub struct Strided {
    pub ptr: *const f32,
    pub rs: isize,
    pub cs: isize,
}
// SAFETY: read-only views handed to the tasks of one call, which outlives them.
unsafe impl Send for Strided {}
unsafe impl Sync for Strided {}

impl Strided {
    /// # Safety
    /// `(r, c)` must lie in the matrix the view was made from.
    #[inline(always)]
    unsafe fn at(self, r: usize, c: usize) -> f32 {
        *self.ptr.offset(r as isize * self.rs + c as isize * self.cs)
    }
}

/// `B` [k, n] packed in pair words, panels of [`PANEL`] columns (see the module docs).
#[derive(Debug)]
pub struct Bf16Panels {
    words: Vec<u32>,
    /// Rows (pair words) per panel: k / 2 rounded up, or more for the AMX GEMM, whose extra
    /// rows are zeros ([`Self::pack_padded`]).
    kh: usize,
    n: usize,
}

impl Bf16Panels {
    /// Packs `b` ([k, n]) on rayon's threads.
    ///
    /// # Safety
    /// `b` must be valid for every `(r < k, c < n)`.
    pub unsafe fn pack(b: Strided, k: usize, n: usize) -> Self {
        // SAFETY: (caller)
        unsafe { Self::pack_into(b, k, n, Vec::new()) }
    }

    /// [`Self::pack`] into `words`' storage (grown as needed; every word is written).
    ///
    /// # Safety
    /// As [`Self::pack`].
    pub unsafe fn pack_into(b: Strided, k: usize, n: usize, words: Vec<u32>) -> Self {
        // SAFETY: (caller)
        unsafe { Self::pack_padded(b, k, n, words, k.div_ceil(2)) }
    }

    /// [`Self::pack_into`] with `rows` (at least `k / 2` rounded up) pair-word rows per panel,
    /// those past `k` zeros: the AMX GEMM's tiles take 16 rows at a time.
    ///
    /// # Safety
    /// As [`Self::pack`].
    pub(crate) unsafe fn pack_padded(
        b: Strided,
        k: usize,
        n: usize,
        mut words: Vec<u32>,
        rows: usize,
    ) -> Self {
        let kh = k.div_ceil(2);
        debug_assert!(rows >= kh);
        words.resize(n.div_ceil(PANEL) * rows * PANEL, 0);
        words.truncate(n.div_ceil(PANEL) * rows * PANEL);
        words
            .par_chunks_mut(rows * PANEL)
            .enumerate()
            .for_each(|(p, panel)| {
                let (real, pad) = panel.split_at_mut(kh * PANEL);
                // SAFETY: (caller) as this function's.
                unsafe { pack_panel(b, k, n, p, real) };
                pad.fill(0);
            });
        Bf16Panels { words, kh: rows, n }
    }

    pub(crate) fn panels(&self) -> usize {
        self.n.div_ceil(PANEL)
    }

    /// The words' storage, for reuse ([`Self::pack_into`]).
    pub(crate) fn into_words(self) -> Vec<u32> {
        self.words
    }

    pub(crate) fn panel(&self, p: usize) -> &[u32] {
        &self.words[p * self.kh * PANEL..(p + 1) * self.kh * PANEL]
    }

    /// Pair-word rows per panel: `k / 2` rounded up (more when padded).
    pub(crate) fn kh(&self) -> usize {
        self.kh
    }

    /// Bytes the panels occupy.
    pub fn size_in_bytes(&self) -> usize {
        4 * self.words.len()
    }

    /// Element `(kk, c)` of the packed (bf16-rounded) matrix, as f32.
    pub(crate) fn get(&self, kk: usize, c: usize) -> f32 {
        let w = self.words[((c / PANEL) * self.kh + kk / 2) * PANEL + c % PANEL];
        from_bf16(if kk.is_multiple_of(2) {
            w as u16
        } else {
            (w >> 16) as u16
        })
    }
}

/// A contiguous run of `k` values as `k / 2` (rounded up) pair words: on little-endian x86 the
/// words' halves are the values' bf16 in order, so this is one conversion.
fn to_pair_words(src: &[f32], words: &mut [u32]) {
    let k = src.len();
    debug_assert_eq!(words.len(), k.div_ceil(2));
    let whole = k / 2;
    #[cfg(target_endian = "little")]
    {
        // SAFETY: `words[..whole]` is 2 * whole u16 of plain memory, suitably aligned.
        let halves =
            unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u16, 2 * whole) };
        to_bf16_slice(&src[..2 * whole], halves);
    }
    #[cfg(not(target_endian = "little"))]
    for (w, p) in words.iter_mut().zip(src.chunks_exact(2)) {
        *w = pair(p[0], p[1]);
    }
    if k % 2 == 1 {
        words[whole] = pair(src[k - 1], 0.0);
    }
}

/// [`pack_rows`] of a row-major `[m, k]` slice on the calling thread (the decoding step's
/// threads must not wait on rayon's), into `out` (resized).
pub(crate) fn pack_rows_here(x: &[f32], m: usize, k: usize, out: &mut Vec<u32>) {
    let kh = k.div_ceil(2);
    out.clear();
    out.resize(m * kh, 0);
    if kh == 0 {
        return;
    }
    for (row, words) in x[..m * k].chunks_exact(k).zip(out.chunks_exact_mut(kh)) {
        to_pair_words(row, words);
    }
}

/// The rows of `a` ([m, k]) as pair words, [m, k / 2 rounded up], on rayon's threads.
///
/// # Safety
/// `a` must be valid for every `(r < m, c < k)`.
pub unsafe fn pack_rows(a: Strided, m: usize, k: usize) -> Vec<u32> {
    // SAFETY: (caller)
    unsafe { pack_rows_into(a, m, k, Vec::new()) }
}

/// [`pack_rows`] into `words`' storage (grown as needed; every word is written).
///
/// # Safety
/// As [`pack_rows`].
pub unsafe fn pack_rows_into(a: Strided, m: usize, k: usize, words: Vec<u32>) -> Vec<u32> {
    // SAFETY: (caller)
    unsafe { pack_rows_padded(a, m, k, words, k.div_ceil(2), m) }
}

/// [`pack_rows_into`] with rows of `stride` words (at least `k / 2` rounded up) and `rows`
/// rows (at least `m`), the words past `k` and the rows past `m` zeros: the AMX GEMM's tiles
/// take 16 rows of 16 words at a time.
///
/// # Safety
/// As [`pack_rows`].
pub(crate) unsafe fn pack_rows_padded(
    a: Strided,
    m: usize,
    k: usize,
    mut words: Vec<u32>,
    stride: usize,
    rows: usize,
) -> Vec<u32> {
    // Groups of 16 rows, columns outer: a transposed view (dY^T in a weight's gradient) is
    // read 16 contiguous values at a time, a row-major one along 16 row streams.
    const GROUP: usize = 16;
    let kh = k.div_ceil(2);
    debug_assert!(stride >= kh && rows >= m);
    words.resize(rows * stride, 0);
    words.truncate(rows * stride);
    if stride == 0 {
        return words;
    }
    words
        .par_chunks_mut(GROUP * stride)
        .enumerate()
        .for_each(|(g, out)| {
            let r0 = g * GROUP;
            let count = m.saturating_sub(r0).min(out.len() / stride);
            if count > 0 {
                // SAFETY: (caller) as this function's; rows r0..r0 + count < m.
                unsafe { pack_group(a, k, r0, count, stride, out) };
            }
            for row in out[..count * stride].chunks_exact_mut(stride) {
                row[kh..].fill(0);
            }
            out[count * stride..].fill(0);
        });
    words
}

/// Panel `p` of [`Bf16Panels::pack`] into `panel`.
///
/// # Safety
/// As [`Bf16Panels::pack`].
#[inline(never)]
unsafe fn pack_panel(b: Strided, k: usize, n: usize, p: usize, panel: &mut [u32]) {
    let cols = PANEL.min(n - p * PANEL);
    let c0 = p * PANEL;
    if cols < PANEL {
        // Columns past `n`: zeros (a reused buffer holds old words there).
        for row in panel.chunks_exact_mut(PANEL) {
            row[cols..].fill(0);
        }
    }
    #[cfg(target_arch = "x86_64")]
    if b.cs == 1 && Isa::active() >= Isa::Avx512 {
        // SAFETY: the CPU runs AVX-512F; (caller) rows 0..k of columns c0..c0 + cols are in `b`.
        unsafe { x86::panel_rows(b.ptr.add(c0), b.rs, k, cols, panel) };
        return;
    }
    if b.cs == 1 {
        // Row-major: rows 2j and 2j + 1 of the panel's columns, converted, then interleaved.
        let (mut lo, mut hi) = ([0u16; PANEL], [0u16; PANEL]);
        for (j, out) in panel.chunks_exact_mut(PANEL).enumerate() {
            // SAFETY: (caller) rows 2j (and 2j + 1 when < k), columns c0..c0 + cols are in `b`.
            let row = |r: usize| unsafe {
                std::slice::from_raw_parts(b.ptr.offset(r as isize * b.rs + c0 as isize), cols)
            };
            to_bf16_slice(row(2 * j), &mut lo[..cols]);
            match 2 * j + 1 < k {
                true => to_bf16_slice(row(2 * j + 1), &mut hi[..cols]),
                false => hi.fill(0),
            }
            for ((o, &l), &h) in out.iter_mut().zip(&lo[..cols]).zip(&hi[..cols]) {
                *o = l as u32 | ((h as u32) << 16);
            }
        }
        return;
    }
    if b.rs == 1 {
        // A transposed view (column c of `b` contiguous): each column as pair words, then
        // down the panel's column.
        let mut words = vec![0u32; k.div_ceil(2)];
        for c in 0..cols {
            // SAFETY: (caller) column c0 + c, rows 0..k are in `b`, contiguous.
            let col =
                unsafe { std::slice::from_raw_parts(b.ptr.offset((c0 + c) as isize * b.cs), k) };
            to_pair_words(col, &mut words);
            for (j, w) in words.iter().enumerate() {
                panel[j * PANEL + c] = *w;
            }
        }
        return;
    }
    for (j, out) in panel.chunks_exact_mut(PANEL).enumerate() {
        for (c, o) in out[..cols].iter_mut().enumerate() {
            // SAFETY: (caller) rows 2j, 2j + 1 < k and the column < n are in `b`.
            *o = unsafe { pair_at(b, 2 * j, c0 + c, k, true) };
        }
    }
}

/// Rows `r0..r0 + rs` (at most 16) of [`pack_rows`] into `rows`, row `i` at `rows[i *
/// stride..]` (its first `k / 2` rounded-up words written).
///
/// # Safety
/// As [`pack_rows`]; rows `r0..r0 + rs` lie in `a`.
#[inline(never)]
unsafe fn pack_group(a: Strided, k: usize, r0: usize, rs: usize, stride: usize, rows: &mut [u32]) {
    let kh = k.div_ceil(2);
    if a.cs == 1 {
        for (i, out) in rows.chunks_mut(stride).take(rs).enumerate() {
            let out = &mut out[..kh];
            // SAFETY: (caller) row r0 + i, columns 0..k are in `a`, contiguous.
            let row =
                unsafe { std::slice::from_raw_parts(a.ptr.offset((r0 + i) as isize * a.rs), k) };
            to_pair_words(row, out);
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if a.rs == 1 && rs <= 16 && Isa::active() >= Isa::Avx512 {
        // SAFETY: the CPU runs AVX-512F; (caller) rows r0..r0 + rs of columns 0..k are in `a`.
        unsafe { x86::group_cols(a.ptr.add(r0), a.cs, k, rs, stride, rows) };
        return;
    }
    if a.rs == 1 && rs <= 16 {
        // A transposed view (dY^T): column c of the group is `rs` contiguous values.
        let (mut lo, mut hi) = ([0u16; 16], [0u16; 16]);
        for j in 0..kh {
            // SAFETY: (caller) rows r0..r0 + rs, column c (< k) are in `a`, contiguous.
            let col = |c: usize| unsafe {
                std::slice::from_raw_parts(a.ptr.offset(r0 as isize + c as isize * a.cs), rs)
            };
            to_bf16_slice(col(2 * j), &mut lo[..rs]);
            match 2 * j + 1 < k {
                true => to_bf16_slice(col(2 * j + 1), &mut hi[..rs]),
                false => hi.fill(0),
            }
            for i in 0..rs {
                rows[i * stride + j] = lo[i] as u32 | ((hi[i] as u32) << 16);
            }
        }
        return;
    }
    for j in 0..kh {
        for i in 0..rs {
            // SAFETY: (caller) row r0 + i < m, columns 2j, 2j + 1 < k.
            rows[i * stride + j] = unsafe { pair_at(a, r0 + i, 2 * j, k, false) };
        }
    }
}

/// The output pointer, shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
pub(crate) struct Out(pub(crate) *mut f32);
// SAFETY: tasks write disjoint elements (row blocks x panel shares).
unsafe impl Send for Out {}
unsafe impl Sync for Out {}
impl Out {
    /// The pointer (a method, so that closures capture the whole `Out`, which is `Sync`).
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// `dst (+)= A B` for `A` [m, k] and `B` [k, n] f32, multiplied in bf16 with f32 sums, at the
/// active [`Isa`]; `dst` element `(r, c)` at `dst + r * dst_rs + c * dst_cs`, added to when
/// `accumulate` (then `dst + (A B)`, the sum made first), overwritten otherwise.
///
/// # Safety
/// `a`, `b` must be valid for their `[m, k]` and `[k, n]` elements and `dst` for writes (and
/// reads when `accumulate`) of its `[m, n]` elements, which must not overlap `a` or `b`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm(
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
    gemm_on(
        Isa::active(),
        m,
        n,
        k,
        dst,
        dst_rs,
        dst_cs,
        accumulate,
        a,
        b,
    )
}

/// [`gemm`] with the `isa` variant (lowered to what this CPU runs).
///
/// # Safety
/// As [`gemm`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_on(
    isa: Isa,
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
    let isa = isa.usable();
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Amx {
        // SAFETY: (caller) as this function's; the CPU runs AMX (`isa` is usable).
        unsafe { amx::gemm(m, n, k, dst, dst_rs, dst_cs, accumulate, a, b) };
        return;
    }
    // The packed operands reuse this thread's buffers from call to call: fresh ones of tens of
    // megabytes (the LM head's) cost more in page faults than the packing itself.
    let (bw, aw) = PACKED.with(|c| c.take());
    let bp = Bf16Panels::pack_into(b, k, n, bw);
    let aw = pack_rows_into(a, m, k, aw);
    let kh = bp.kh;
    let panels = bp.panels();
    let tasks = rayon::current_num_threads().clamp(1, panels);
    let blocks = m.div_ceil(BLOCK_ROWS);
    let out = Out(dst);
    (0..tasks * blocks).into_par_iter().for_each(|tb| {
        let (t, blk) = (tb % tasks, tb / tasks);
        let (r0, r1) = (blk * BLOCK_ROWS, ((blk + 1) * BLOCK_ROWS).min(m));
        let tiles = (r1 - r0).div_ceil(TILE_ROWS);
        let mut acc = [0f32; TILE_ROWS * PANEL];
        for p in share(panels, t, tasks) {
            let w = bp.panel(p);
            let cols = (n - p * PANEL).min(PANEL);
            let (mut r, mut tile) = (r0, 0);
            while r < r1 {
                let mr = (r1 - r0) / tiles + usize::from(tile < (r1 - r0) % tiles);
                let x = &aw[r * kh..(r + mr) * kh];
                tile_on(isa, x, w, kh, mr, &mut acc);
                for i in 0..mr {
                    let src = &acc[i * PANEL..i * PANEL + cols];
                    // SAFETY: (caller) row r + i < m, columns p * PANEL.. + cols < n of `dst`;
                    // this task alone writes its row block's columns of its panels.
                    let d = unsafe {
                        out.get()
                            .offset((r + i) as isize * dst_rs + (p * PANEL) as isize * dst_cs)
                    };
                    unsafe { store(src, d, dst_cs, accumulate) };
                }
                r += mr;
                tile += 1;
            }
        }
    });
    PACKED.with(|c| c.replace((bp.into_words(), aw)));
}

/// `src` into `dst` (element `c` at `dst + c * cs`), added to it when `accumulate`.
///
/// # Safety
/// `dst` must be valid for reads and writes of those elements.
#[inline(always)]
pub(crate) unsafe fn store(src: &[f32], dst: *mut f32, cs: isize, accumulate: bool) {
    if cs == 1 {
        // SAFETY: (caller) `src.len()` contiguous elements.
        let d = unsafe { std::slice::from_raw_parts_mut(dst, src.len()) };
        match accumulate {
            true => d.iter_mut().zip(src).for_each(|(d, v)| *d += v),
            false => d.copy_from_slice(src),
        }
        return;
    }
    for (c, v) in src.iter().enumerate() {
        // SAFETY: (caller)
        unsafe {
            let e = dst.offset(c as isize * cs);
            *e = if accumulate { *e + v } else { *v };
        }
    }
}

/// `x W` for a detached `x` [.., k] and `w` [k, n] (any strides: a transposed weight view is
/// fine), both f32 on the CPU, multiplied in bf16 with f32 sums: CPU mixed precision's product
/// for frozen models (the reference, scoring). No backward is recorded.
pub fn matmul(
    x: &candle_core::Tensor,
    w: &candle_core::Tensor,
) -> candle_core::Result<candle_core::Tensor> {
    use candle_core::{bail, CpuStorage, DType, Storage, Tensor};
    let dims = x.dims().to_vec();
    let Some((&k, lead)) = dims.split_last() else {
        bail!("bf16 matmul: scalar input");
    };
    let (kw, n) = w.dims2()?;
    if kw != k || x.dtype() != DType::F32 || w.dtype() != DType::F32 {
        bail!("bf16 matmul: [.., {k}] f32 times [{kw}, {n}] f32 expected");
    }
    let m: usize = lead.iter().product();
    let x = x.contiguous()?;
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let (Storage::Cpu(CpuStorage::F32(xv)), Storage::Cpu(CpuStorage::F32(wv))) = (&*xs, &*ws)
    else {
        bail!("bf16 matmul: CPU f32 tensors expected");
    };
    let (rs, cs) = (wl.stride()[0] as isize, wl.stride()[1] as isize);
    let last = wl.start_offset() as isize + (kw as isize - 1) * rs + (n as isize - 1) * cs;
    if rs < 0 || cs < 0 || (k > 0 && n > 0 && last as usize >= wv.len()) {
        bail!("bf16 matmul: weight view outside its storage");
    }
    let mut y = vec![0f32; m * n];
    let a = Strided {
        ptr: xv[xl.start_offset()..].as_ptr(),
        rs: k as isize,
        cs: 1,
    };
    let b = Strided {
        ptr: wv[wl.start_offset()..].as_ptr(),
        rs,
        cs,
    };
    // SAFETY: `x` is [m, k] contiguous from its offset; every (r < k, c < n) of the weight view
    // lies in its storage (checked above); `y` is [m, n] and owned here.
    unsafe { gemm(m, n, k, y.as_mut_ptr(), n as isize, 1, false, a, b) };
    let mut shape = lead.to_vec();
    shape.push(n);
    Tensor::from_vec(y, shape, &candle_core::Device::Cpu)
}

/// This CPU's rates for a projection-sized product (256 x 576 times 576 x 1536, SmolLM2-135M's
/// MLP) in GFLOP/s, best of three each: `(bf16, f32)`, bf16 by [`gemm`] at the active level with
/// its packing, f32 by candle's GEMM. For the start-up check that `dtype = "bf16"` is not slower
/// than f32 on this CPU (it was, with `vdpbf16ps` alone, on an Intel Xeon). About 20 ms.
pub fn rates() -> candle_core::Result<(f64, f64)> {
    use candle_core::{Device, Tensor};
    let (m, k, n) = (256, 576, 1536);
    let x: Vec<f32> = (0..m * k)
        .map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5)
        .collect();
    let w: Vec<f32> = (0..k * n)
        .map(|i| ((i * 104729) % 997) as f32 * 1e-3 - 0.5)
        .collect();
    let flops = 2.0 * (m * k * n) as f64;
    let best = |f: &mut dyn FnMut() -> candle_core::Result<()>| -> candle_core::Result<f64> {
        f()?; // warm-up: buffers, pages, the thread pool
        let mut t = f64::INFINITY;
        for _ in 0..3 {
            let t0 = std::time::Instant::now();
            f()?;
            t = t.min(t0.elapsed().as_secs_f64());
        }
        Ok(flops / t.max(1e-9) / 1e9)
    };
    let mut y = vec![0f32; m * n];
    let bf16 = best(&mut || {
        let a = Strided {
            ptr: x.as_ptr(),
            rs: k as isize,
            cs: 1,
        };
        let b = Strided {
            ptr: w.as_ptr(),
            rs: n as isize,
            cs: 1,
        };
        // SAFETY: x is [m, k], w is [k, n], y is [m, n], all row-major and owned here.
        unsafe { gemm(m, n, k, y.as_mut_ptr(), n as isize, 1, false, a, b) };
        Ok(())
    })?;
    let (xt, wt) = (
        Tensor::from_slice(&x, (m, k), &Device::Cpu)?,
        Tensor::from_slice(&w, (k, n), &Device::Cpu)?,
    );
    let f32 = best(&mut || xt.matmul(&wt).map(|_| ()))?;
    Ok((bf16, f32))
}

/// `mr` rows of pair words `x` ([mr, kh]) times one panel `w` ([kh, PANEL]) into `acc` ([mr,
/// PANEL] row-major), by `isa`.
pub(crate) fn tile_on(isa: Isa, x: &[u32], w: &[u32], kh: usize, mr: usize, acc: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if isa >= Isa::Avx512Bf16 {
            // SAFETY: the CPU runs AVX512_BF16 (`isa` is usable); shapes as documented.
            unsafe { x86::tile_dp(x, w, kh, mr, acc) };
            return;
        }
        if isa >= Isa::Avx512 {
            // SAFETY: the CPU runs AVX-512F.
            unsafe { x86::tile_fma(x, w, kh, mr, acc) };
            return;
        }
    }
    let _ = isa;
    tile_portable(x, w, kh, mr, acc);
}

/// The tile in plain Rust: per pair, the odd element's product then the even one's, each an
/// FMA into the f32 sum (the instruction's order and rounding).
fn tile_portable(x: &[u32], w: &[u32], kh: usize, mr: usize, acc: &mut [f32]) {
    let lo = |v: u32| f32::from_bits(v << 16);
    let hi = |v: u32| f32::from_bits(v & 0xffff_0000);
    for i in 0..mr {
        let a = &mut acc[i * PANEL..(i + 1) * PANEL];
        a.fill(0.0);
        for j in 0..kh {
            let xv = x[i * kh + j];
            for (s, &wv) in a.iter_mut().zip(&w[j * PANEL..(j + 1) * PANEL]) {
                *s = hi(xv).mul_add(hi(wv), *s);
                *s = lo(xv).mul_add(lo(wv), *s);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86;

/// `n` values in [-0.5, 0.5) from a fixed linear congruential sequence, for the GEMMs' tests.
#[cfg(test)]
pub(crate) fn test_values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        })
        .collect()
}

#[cfg(test)]
mod tests;
