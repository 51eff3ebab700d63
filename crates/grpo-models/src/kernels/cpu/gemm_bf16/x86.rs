use super::{PANEL, TILE_ROWS};
use std::arch::x86_64::*;

/// 16 f32 (as bits) rounded to bf16, each in the low half of its lane ([`super::to_bf16`]).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn round16(b: __m512i) -> __m512i {
    let high = _mm512_srli_epi32::<16>(b);
    let lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
    let bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb);
    let r = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, bias));
    let abs = _mm512_and_si512(b, _mm512_set1_epi32(0x7fff_ffff));
    let nan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7f80_0000));
    _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40)))
}

/// The first `n` (<= 16) lanes set.
#[inline(always)]
fn first(n: usize) -> __mmask16 {
    if n >= 16 {
        0xffff
    } else {
        ((1u32 << n) - 1) as __mmask16
    }
}

/// The pair words of a panel of a row-major `B` (column stride 1): row pair `j` is rows
/// `2j`, `2j + 1` (the second 0 past `k`), columns `0..cols` (<= 32) from `b`, into
/// `panel[j * 32..]`.
///
/// # Safety
/// AVX-512F must be available; `b` must be valid for rows `0..k` (stride `rs`) of `cols`
/// values; `panel` holds `k / 2` (rounded up) rows of 32 words.
#[target_feature(enable = "avx512f")]
pub unsafe fn panel_rows(b: *const f32, rs: isize, k: usize, cols: usize, panel: &mut [u32]) {
    let (m0, m1) = (first(cols), first(cols.saturating_sub(16)));
    let zero = _mm512_setzero_si512();
    for j in 0..k.div_ceil(2) {
        let r0 = b.offset(2 * j as isize * rs) as *const i32;
        let load = |r: *const i32| {
            (
                round16(_mm512_maskz_loadu_epi32(m0, r)),
                round16(_mm512_maskz_loadu_epi32(m1, r.add(16))),
            )
        };
        let (l0, l1) = load(r0);
        let (h0, h1) = match 2 * j + 1 < k {
            true => load(r0.offset(rs)),
            false => (zero, zero),
        };
        let out = panel.as_mut_ptr().add(j * super::PANEL) as *mut i32;
        _mm512_storeu_si512(
            out as *mut _,
            _mm512_or_si512(l0, _mm512_slli_epi32::<16>(h0)),
        );
        _mm512_storeu_si512(
            out.add(16) as *mut _,
            _mm512_or_si512(l1, _mm512_slli_epi32::<16>(h1)),
        );
    }
}

/// The pair words of `rows` (<= 16) rows of a transposed `A` (row stride 1, column stride
/// `cs`) from `a`: word `j` of row `i` into `out[i * stride + j]`.
///
/// # Safety
/// AVX-512F must be available; `a` must be valid for columns `0..k` of `rows` values; `out`
/// holds `rows` rows of `stride` words, `stride` at least `k / 2` (rounded up).
#[target_feature(enable = "avx512f")]
pub unsafe fn group_cols(
    a: *const f32,
    cs: isize,
    k: usize,
    rows: usize,
    stride: usize,
    out: &mut [u32],
) {
    let kh = k.div_ceil(2);
    let m = first(rows);
    let index = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(stride as i32),
    );
    for j in 0..kh {
        let c0 = a.offset(2 * j as isize * cs) as *const i32;
        let lo = round16(_mm512_maskz_loadu_epi32(m, c0));
        let hi = match 2 * j + 1 < k {
            true => round16(_mm512_maskz_loadu_epi32(m, c0.offset(cs))),
            false => _mm512_setzero_si512(),
        };
        let w = _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi));
        _mm512_mask_i32scatter_epi32::<4>(out.as_mut_ptr().add(j) as *mut _, m, index, w);
    }
}

/// [`super::to_bf16_slice`], 16 values at a time: `(bits + 0x7fff + lsb) >> 16`, a NaN
/// quieted as `(bits >> 16) | 0x40`.
///
/// # Safety
/// AVX-512F must be available; `dst.len() == src.len()`.
#[target_feature(enable = "avx512f")]
pub unsafe fn to_bf16_slice(src: &[f32], dst: &mut [u16]) {
    let n = src.len();
    let (round, one) = (_mm512_set1_epi32(0x7fff), _mm512_set1_epi32(1));
    let (abs, inf, quiet) = (
        _mm512_set1_epi32(0x7fff_ffff),
        _mm512_set1_epi32(0x7f80_0000),
        _mm512_set1_epi32(0x40),
    );
    let mut i = 0;
    while i + 16 <= n {
        let b = _mm512_loadu_si512(src.as_ptr().add(i) as *const _);
        let high = _mm512_srli_epi32::<16>(b);
        let lsb = _mm512_and_si512(high, one);
        let r = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, _mm512_add_epi32(round, lsb)));
        let nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(b, abs), inf);
        let r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(high, quiet));
        _mm256_storeu_si256(
            dst.as_mut_ptr().add(i) as *mut __m256i,
            _mm512_cvtepi32_epi16(r),
        );
        i += 16;
    }
    for j in i..n {
        dst[j] = super::to_bf16(src[j]);
    }
}

macro_rules! by_rows {
    ($f:ident, $x:expr, $w:expr, $kh:expr, $mr:expr, $acc:expr) => {
        match $mr {
            12 => $f::<12>($x, $w, $kh, $acc),
            11 => $f::<11>($x, $w, $kh, $acc),
            10 => $f::<10>($x, $w, $kh, $acc),
            9 => $f::<9>($x, $w, $kh, $acc),
            8 => $f::<8>($x, $w, $kh, $acc),
            7 => $f::<7>($x, $w, $kh, $acc),
            6 => $f::<6>($x, $w, $kh, $acc),
            5 => $f::<5>($x, $w, $kh, $acc),
            4 => $f::<4>($x, $w, $kh, $acc),
            3 => $f::<3>($x, $w, $kh, $acc),
            2 => $f::<2>($x, $w, $kh, $acc),
            _ => $f::<1>($x, $w, $kh, $acc),
        }
    };
}

/// # Safety
/// AVX512_BF16 must be available; `x` holds `mr` rows of `kh` words, `w` `kh` rows of
/// [`PANEL`], `acc` `mr` rows of [`PANEL`].
pub unsafe fn tile_dp(x: &[u32], w: &[u32], kh: usize, mr: usize, acc: &mut [f32]) {
    debug_assert!(mr <= TILE_ROWS);
    by_rows!(dp_n, x, w, kh, mr, acc)
}

#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dp_n<const MR: usize>(x: &[u32], w: &[u32], kh: usize, acc: &mut [f32]) {
    debug_assert!(x.len() >= MR * kh && w.len() >= kh * PANEL && acc.len() >= MR * PANEL);
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let mut lo = [_mm512_setzero_ps(); MR];
    let mut hi = [_mm512_setzero_ps(); MR];
    for j in 0..kh {
        let w0: __m512bh = std::mem::transmute(_mm512_loadu_si512(wp.add(j * PANEL) as *const _));
        let w1: __m512bh =
            std::mem::transmute(_mm512_loadu_si512(wp.add(j * PANEL + 16) as *const _));
        for i in 0..MR {
            let xv: __m512bh = std::mem::transmute(_mm512_set1_epi32(*xp.add(i * kh + j) as i32));
            lo[i] = _mm512_dpbf16_ps(lo[i], xv, w0);
            hi[i] = _mm512_dpbf16_ps(hi[i], xv, w1);
        }
    }
    for i in 0..MR {
        _mm512_storeu_ps(acc.as_mut_ptr().add(i * PANEL), lo[i]);
        _mm512_storeu_ps(acc.as_mut_ptr().add(i * PANEL + 16), hi[i]);
    }
}

/// # Safety
/// AVX-512F must be available; shapes as [`tile_dp`].
pub unsafe fn tile_fma(x: &[u32], w: &[u32], kh: usize, mr: usize, acc: &mut [f32]) {
    debug_assert!(mr <= TILE_ROWS);
    by_rows!(fma_n, x, w, kh, mr, acc)
}

/// `vdpbf16ps` emulated: per pair the odd (high) halves' product, then the even (low)
/// halves', each an FMA.
#[target_feature(enable = "avx512f")]
unsafe fn fma_n<const MR: usize>(x: &[u32], w: &[u32], kh: usize, acc: &mut [f32]) {
    debug_assert!(x.len() >= MR * kh && w.len() >= kh * PANEL && acc.len() >= MR * PANEL);
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let mask = _mm512_set1_epi32(0xffff_0000u32 as i32);
    let mut lo = [_mm512_setzero_ps(); MR];
    let mut hi = [_mm512_setzero_ps(); MR];
    for j in 0..kh {
        let w0 = _mm512_loadu_si512(wp.add(j * PANEL) as *const _);
        let w1 = _mm512_loadu_si512(wp.add(j * PANEL + 16) as *const _);
        let (w0o, w0e) = (
            _mm512_castsi512_ps(_mm512_and_si512(w0, mask)),
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w0)),
        );
        let (w1o, w1e) = (
            _mm512_castsi512_ps(_mm512_and_si512(w1, mask)),
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w1)),
        );
        for i in 0..MR {
            let v = *xp.add(i * kh + j);
            let (xo, xe) = (
                _mm512_set1_ps(f32::from_bits(v & 0xffff_0000)),
                _mm512_set1_ps(f32::from_bits(v << 16)),
            );
            lo[i] = _mm512_fmadd_ps(xe, w0e, _mm512_fmadd_ps(xo, w0o, lo[i]));
            hi[i] = _mm512_fmadd_ps(xe, w1e, _mm512_fmadd_ps(xo, w1o, hi[i]));
        }
    }
    for i in 0..MR {
        _mm512_storeu_ps(acc.as_mut_ptr().add(i * PANEL), lo[i]);
        _mm512_storeu_ps(acc.as_mut_ptr().add(i * PANEL + 16), hi[i]);
    }
}
