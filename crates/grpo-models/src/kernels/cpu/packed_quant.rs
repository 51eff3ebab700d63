//! A frozen quantized weight (QLoRA's base) in the decoding GEMM's panel order, dequantized one
//! panel at a time as the GEMM reaches it.
//!
//! Sampling a QLoRA policy used to multiply each decoded token through candle's quantized kernel
//! (which also rounds the input to 8 bits, so the sampler's log-probs were not the trainer's) or,
//! for NF4, dequantize the whole weight per token: 4x LoRA's generate time. Here the codes are
//! re-laid once so that a panel's [`PANEL`] output columns sit side by side for each input `k`
//! (two 4-bit codes per byte: column `c` in the low nibble, column `c + 16` in the high one; or
//! one i8 per column for Q8_0), with the block scales (and Q4_1's offsets) as `[k / block,
//! PANEL]` per panel. Turning a panel back into `[k, PANEL]` floats is then a few vector
//! instructions per 32 values (AVX-512: a table permute, a multiply), paid once per panel and
//! block of input rows, after which the f32 tile kernel runs on it unchanged.
//!
//! Each value is `table[code] * scale` (+ offset), the same two f32 operations as candle's and
//! NF4's dequantization, so a panel equals the dequantized weight bit for bit and the product
//! equals the f32 packed product of the dequantized weight exactly (tests). The codes take 4 or
//! 8 bits per weight plus 4 bytes per block: about the quantized size again, where an f32 packed
//! copy would be 32 bits per weight.

use candle_core::Result;

use crate::kernels::cpu::panels::PANEL;
use crate::kernels::cpu::quant::{QuantProj, QuantType};
use crate::kernels::Isa;

/// A quantized [out, in] weight as panels of [`PANEL`] output columns (see the module docs).
#[derive(Debug)]
pub struct QuantPanels {
    /// in
    k: usize,
    /// out
    n: usize,
    /// Values per scale along `k`.
    block: usize,
    /// 4-bit codes (two per byte) or Q8_0's i8 (one per byte).
    nibbles: bool,
    /// A 4-bit code's value before scaling ([`QuantType::table`]).
    table: [f32; 16],
    /// Per panel `k` rows of `PANEL / 2` (nibbles) or `PANEL` bytes.
    codes: Vec<u8>,
    /// Per panel `[k / block, PANEL]`; zero past `n`.
    scales: Vec<f32>,
    /// Q4_1's offsets, laid out as `scales`; empty for the other types.
    mins: Vec<f32>,
}

impl QuantPanels {
    /// Re-lays `q`'s codes into panels; `None` where the layout does not apply (an NF4 weight
    /// whose rows are not whole blocks).
    pub fn new(q: &QuantProj) -> Result<Option<Self>> {
        let Some(c) = q.codes()? else {
            return Ok(None);
        };
        let (n, k, block) = (c.rows, c.cols, c.block);
        let nibbles = c.kind != QuantType::Q8_0;
        let (panels, nb) = (n.div_ceil(PANEL), k / block);
        let row_bytes = if nibbles { PANEL / 2 } else { PANEL };
        let mut out = QuantPanels {
            k,
            n,
            block,
            nibbles,
            table: c.kind.table(),
            codes: vec![0u8; panels * k * row_bytes],
            scales: vec![0f32; panels * nb * PANEL],
            mins: vec![
                0f32;
                if c.mins.is_empty() {
                    0
                } else {
                    panels * nb * PANEL
                }
            ],
        };
        // Columns past `n` keep code 0 with scale and offset 0: the value 0 (or -0).
        for col in 0..n {
            let (p, j) = (col / PANEL, col % PANEL);
            let src = &c.codes[col * k..(col + 1) * k];
            for (kk, &code) in src.iter().enumerate() {
                let at = (p * k + kk) * row_bytes;
                match nibbles {
                    true => out.codes[at + j % 16] |= code << (4 * (j / 16)),
                    false => out.codes[at + j] = code,
                }
            }
            for b in 0..nb {
                out.scales[(p * nb + b) * PANEL + j] = c.scales[col * nb + b];
                if !c.mins.is_empty() {
                    out.mins[(p * nb + b) * PANEL + j] = c.mins[col * nb + b];
                }
            }
        }
        Ok(Some(out))
    }

    /// (in, out)
    pub fn dims(&self) -> (usize, usize) {
        (self.k, self.n)
    }

    /// Bytes the panels occupy.
    pub fn size_in_bytes(&self) -> usize {
        self.codes.len() + 4 * (self.scales.len() + self.mins.len())
    }

    /// Panel `p` as floats into `out` (`[k, PANEL]`), with the `isa` variant (AVX-512, or the
    /// plain loop for every other level: both give the same bits).
    pub fn panel_into(&self, isa: Isa, p: usize, out: &mut [f32]) {
        assert!(out.len() >= self.k * PANEL && p < self.n.div_ceil(PANEL));
        #[cfg(target_arch = "x86_64")]
        if isa.usable() >= Isa::Avx512 {
            // SAFETY: the CPU runs AVX-512F (`usable`); `out` holds a panel (asserted above).
            unsafe { avx512::panel(self, p, out) };
            return;
        }
        let _ = isa;
        self.panel_portable(p, out);
    }

    /// [`Self::panel_into`] in plain loops.
    fn panel_portable(&self, p: usize, out: &mut [f32]) {
        let (k, nb) = (self.k, self.k / self.block);
        let row_bytes = if self.nibbles { PANEL / 2 } else { PANEL };
        for kk in 0..k {
            let b = (p * nb + kk / self.block) * PANEL;
            let codes = &self.codes[(p * k + kk) * row_bytes..][..row_bytes];
            for (j, o) in out[kk * PANEL..(kk + 1) * PANEL].iter_mut().enumerate() {
                let v = match self.nibbles {
                    true => self.table[((codes[j % 16] >> (4 * (j / 16))) & 15) as usize],
                    false => codes[j] as i8 as f32,
                };
                let v = v * self.scales[b + j];
                *o = match self.mins.is_empty() {
                    true => v,
                    false => v + self.mins[b + j],
                };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{QuantPanels, PANEL};
    use std::arch::x86_64::*;

    /// [`QuantPanels::panel_into`]: per `k`, 32 codes to two registers of floats (a 16-entry
    /// table permute, or i8 widening), times the block's scales (plus offsets).
    ///
    /// # Safety
    /// AVX-512F must be available; `out` must hold `k * PANEL` floats and `p` be a panel.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn panel(q: &QuantPanels, p: usize, out: &mut [f32]) {
        let (k, bs) = (q.k, q.block);
        let nb = k / bs;
        let table = _mm512_loadu_ps(q.table.as_ptr());
        let low = _mm512_set1_epi32(15);
        let row_bytes = if q.nibbles { PANEL / 2 } else { PANEL };
        let codes = q.codes.as_ptr().add(p * k * row_bytes);
        let o = out.as_mut_ptr();
        for b in 0..nb {
            let at = (p * nb + b) * PANEL;
            let s0 = _mm512_loadu_ps(q.scales.as_ptr().add(at));
            let s1 = _mm512_loadu_ps(q.scales.as_ptr().add(at + 16));
            let offsets = (!q.mins.is_empty()).then(|| {
                (
                    _mm512_loadu_ps(q.mins.as_ptr().add(at)),
                    _mm512_loadu_ps(q.mins.as_ptr().add(at + 16)),
                )
            });
            for kk in b * bs..(b + 1) * bs {
                let c = codes.add(kk * row_bytes) as *const __m128i;
                let (v0, v1) = if q.nibbles {
                    let idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(c)); // [16] i32
                    let lo = _mm512_and_si512(idx, low);
                    let hi = _mm512_srli_epi32::<4>(idx);
                    (
                        _mm512_permutexvar_ps(lo, table),
                        _mm512_permutexvar_ps(hi, table),
                    )
                } else {
                    (
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(c))),
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(c.add(1)))),
                    )
                };
                let (mut v0, mut v1) = (_mm512_mul_ps(v0, s0), _mm512_mul_ps(v1, s1));
                if let Some((m0, m1)) = offsets {
                    v0 = _mm512_add_ps(v0, m0);
                    v1 = _mm512_add_ps(v1, m1);
                }
                _mm512_storeu_ps(o.add(kk * PANEL), v0);
                _mm512_storeu_ps(o.add(kk * PANEL + 16), v1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::packed::PackedWeight;
    use crate::kernels::cpu::quant::tests::randn;

    const KINDS: [QuantType; 4] = [
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q8_0,
        QuantType::Nf4,
    ];

    /// Every panel, at every ISA level, is the dequantized weight bit for bit (columns past
    /// `out` zero), for every type; NF4 rows that are not whole blocks are not re-laid.
    #[test]
    fn panels_are_the_dequantized_weight_bit_for_bit() {
        for kind in KINDS {
            for (o, i) in [(40, 64), (96, 128), (7, 192)] {
                let q = QuantProj::quantize(&randn((o, i), o as u64), kind).unwrap();
                let want: Vec<f32> = q
                    .dequantize()
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                let qp = QuantPanels::new(&q).unwrap().unwrap();
                assert_eq!(qp.dims(), (i, o));
                for isa in Isa::ALL {
                    for p in 0..o.div_ceil(PANEL) {
                        let mut got = vec![f32::NAN; i * PANEL];
                        qp.panel_into(isa, p, &mut got);
                        for kk in 0..i {
                            for j in 0..PANEL {
                                let col = p * PANEL + j;
                                let g = got[kk * PANEL + j];
                                let at =
                                    format!("{kind:?} [{o}, {i}] {isa:?} panel {p} k {kk} col {j}");
                                match col < o {
                                    true => assert_eq!(
                                        g.to_bits(),
                                        want[col * i + kk].to_bits(),
                                        "{at}"
                                    ),
                                    // Padding: a zero (of either sign), never stored.
                                    false => assert_eq!(g, 0.0, "{at}"),
                                }
                            }
                        }
                    }
                }
            }
        }
        let odd = QuantProj::quantize(&randn((4, 96), 1), QuantType::Nf4).unwrap();
        assert!(QuantPanels::new(&odd).unwrap().is_none());
    }

    /// The packed product over quantized panels equals the f32 packed product of the dequantized
    /// weight exactly, at every ISA level and for row counts past a tile and a row block.
    #[test]
    fn quantized_packed_product_equals_the_dequantized_one() {
        for kind in KINDS {
            let q = QuantProj::quantize(&randn((72, 128), 3), kind).unwrap();
            let dense = PackedWeight::from_out_in(&q.dequantize().unwrap()).unwrap();
            let packed = PackedWeight::from_quant(&q).unwrap().unwrap();
            assert_eq!(packed.dims(), dense.dims());
            assert!(packed.size_in_bytes() < dense.size_in_bytes() / 3);
            for rows in [1, 13, 200] {
                let x: Vec<f32> = randn((rows, 128), rows as u64)
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                for isa in Isa::ALL {
                    let (a, b) = (
                        packed.matmul_on(isa, &x, rows),
                        dense.matmul_on(isa, &x, rows),
                    );
                    assert!(
                        a.iter().zip(&b).all(|(u, v)| u.to_bits() == v.to_bits()),
                        "{kind:?} rows {rows} {isa:?}"
                    );
                }
            }
            let host = |p: &PackedWeight| -> Vec<f32> {
                p.to_in_out()
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            };
            assert_eq!(host(&packed), host(&dense), "{kind:?}");
        }
    }
}
