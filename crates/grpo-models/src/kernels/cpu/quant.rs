//! Frozen quantized projection weights (QLoRA's base) with a backward to the input.
//!
//! candle's quantized matmul (`QMatMul`, the `QTensor` custom op) records no backward: a loss
//! behind it would silently give no gradient to anything before it (earlier layers' LoRA
//! adapters). [`QuantProj`] is the same product as one custom op over the input whose backward
//! returns `dY W`, with `W` dequantized for the occasion (the weight itself is frozen and gets no
//! gradient). Nothing dequantized is kept: memory stays at the quantized size.
//!
//! The forward uses candle's quantized kernel for a few rows (decoding: it reads 4-8 bits per
//! weight instead of 32), and for many rows (training and reference forwards) dequantizes the
//! weight into a scratch buffer and runs one f32 GEMM, which is several times faster than the
//! per-row dot products of the quantized kernel at hundreds of rows.
//!
//! Besides GGML's types, QLoRA's own 4-bit NormalFloat ([`Nf4`], bitsandbytes' layout: blocks
//! of 64 values, one f32 absmax each, two codes per byte) is kept here; it has no candle kernel,
//! so every forward dequantizes.
//!
//! Off the fused CPU path (a GPU, bf16, `kernels = "portable"`) the quantized bytes are copied
//! once to the input's device and every forward dequantizes there (NF4: grpo's one-kernel
//! dequantization under [`Compute::Gpu`], else candle ops over two 256-entry byte tables and the
//! block scales; GGML: candle's dequantize kernels), then runs one matmul in the input's dtype.
//! Its backward ([`Redequantize`]) dequantizes again for `dY W` and gives the weight none: the
//! same product and backward as the custom op, with nothing kept between the two but the
//! quantized bytes (a model's dequantized weights held from forward to backward would be a
//! bf16 copy of the whole base: 15 GB at 8B).

use std::sync::{Arc, OnceLock};

use crate::kernels::portable::recompute::{attach, Backward};
use crate::kernels::Compute;
use candle_core::quantized::k_quants::{BlockQ4_0, BlockQ4_1, BlockQ8_0, GgmlType};
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// The quantization types a frozen base can be kept in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QuantType {
    Q4_0,
    Q4_1,
    Q8_0,
    /// QLoRA's 4-bit NormalFloat (bitsandbytes' `nf4`, block size 64).
    Nf4,
}

impl QuantType {
    /// The GGML type (None for NF4, which GGML does not have).
    pub fn ggml(self) -> Option<GgmlDType> {
        match self {
            QuantType::Q4_0 => Some(GgmlDType::Q4_0),
            QuantType::Q4_1 => Some(GgmlDType::Q4_1),
            QuantType::Q8_0 => Some(GgmlDType::Q8_0),
            QuantType::Nf4 => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            QuantType::Q4_0 => "q4_0",
            QuantType::Q4_1 => "q4_1",
            QuantType::Q8_0 => "q8_0",
            QuantType::Nf4 => "nf4",
        }
    }
    /// Values per block, and bytes per block.
    fn block(self) -> (usize, usize) {
        match self.ggml() {
            Some(d) => (d.block_size(), d.type_size()),
            None => (NF4_BLOCK, NF4_BLOCK / 2 + 4),
        }
    }
}

/// Values per NF4 block (bitsandbytes' QLoRA default).
pub const NF4_BLOCK: usize = 64;

impl QuantType {
    /// The value of each 4-bit code before its block's scale (and Q4_1's offset): `code - 8`
    /// (Q4_0), `code` (Q4_1), the NF4 value (NF4). Q8_0's codes are the i8 values themselves.
    pub(crate) fn table(self) -> [f32; 16] {
        std::array::from_fn(|c| match self {
            QuantType::Q4_0 => c as f32 - 8.0,
            QuantType::Q4_1 | QuantType::Q8_0 => c as f32,
            QuantType::Nf4 => NF4_CODE[c],
        })
    }
}

/// A quantized weight taken apart (the decoding GEMM's quantized panels are built from it):
/// value `(r, c)` is `table[code] * scale` (Q8_0: `code as i8 * scale`), plus Q4_1's offset,
/// with the scale and offset of the row's block `c / block`: the same two f32 operations
/// candle's and NF4's dequantization do, so rebuilding from the parts is exact.
pub(crate) struct Codes {
    pub kind: QuantType,
    pub rows: usize,
    pub cols: usize,
    /// Values per scale along a row (whole blocks per row).
    pub block: usize,
    /// One code per value, [rows, cols] row-major: a 4-bit index, or Q8_0's i8 as a byte.
    pub codes: Vec<u8>,
    /// [rows, cols / block]
    pub scales: Vec<f32>,
    /// Q4_1's offsets, [rows, cols / block]; empty for the other types.
    pub mins: Vec<f32>,
}

/// The 16 NF4 values (QLoRA, appendix E): quantiles of a standard normal scaled to [-1, 1], with
/// an exact 0. bitsandbytes' table, as f32.
pub const NF4_CODE: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// An NF4 weight [rows, cols] as bitsandbytes keeps one: the values flattened row-major, in
/// blocks of 64 (the last may be shorter); per block the absmax, per value the index of the NF4
/// value nearest to `value / absmax`, two per byte (the first in the high nibble).
#[derive(Debug, Clone, PartialEq)]
pub struct Nf4 {
    pub rows: usize,
    pub cols: usize,
    /// ceil(rows * cols / 2) bytes.
    pub packed: Vec<u8>,
    /// ceil(rows * cols / 64) scales.
    pub absmax: Vec<f32>,
}

impl Nf4 {
    /// The index of the NF4 value nearest to `x` (in [-1, 1]).
    fn code_of(x: f32) -> u8 {
        let mut best = 0;
        for (i, c) in NF4_CODE.iter().enumerate().skip(1) {
            if (x - c).abs() < (x - NF4_CODE[best]).abs() {
                best = i;
            }
        }
        best as u8
    }

    /// Quantizes `w` (row-major [rows, cols]).
    pub fn quantize(w: &[f32], rows: usize, cols: usize) -> Result<Self> {
        if w.len() != rows * cols {
            candle_core::bail!("nf4: {} values for a [{rows}, {cols}] weight", w.len());
        }
        let absmax: Vec<f32> = w
            .chunks(NF4_BLOCK)
            .map(|b| b.iter().fold(0f32, |m, x| m.max(x.abs())))
            .collect();
        let mut packed = vec![0u8; w.len().div_ceil(2)];
        packed
            .par_chunks_mut(NF4_BLOCK / 2)
            .zip(w.par_chunks(NF4_BLOCK).zip(absmax.par_iter()))
            .for_each(|(out, (block, &m))| {
                let inv = if m > 0.0 { 1.0 / m } else { 0.0 };
                for (o, pair) in out.iter_mut().zip(block.chunks(2)) {
                    // A missing last value is padded with 0 (code 7), as bitsandbytes pads.
                    let lo = pair.get(1).map_or(7, |&x| Self::code_of(x * inv));
                    *o = (Self::code_of(pair[0] * inv) << 4) | lo;
                }
            });
        Ok(Nf4 {
            rows,
            cols,
            packed,
            absmax,
        })
    }

    /// Dequantizes into `out` ([rows, cols] row-major) on rayon's threads.
    pub fn dequantize_into(&self, out: &mut [f32]) {
        out.par_chunks_mut(NF4_BLOCK)
            .zip(
                self.packed
                    .par_chunks(NF4_BLOCK / 2)
                    .zip(self.absmax.par_iter()),
            )
            .for_each(|(ys, (bytes, &m))| {
                for (y, &b) in ys.chunks_mut(2).zip(bytes) {
                    y[0] = NF4_CODE[(b >> 4) as usize] * m;
                    if let Some(y1) = y.get_mut(1) {
                        *y1 = NF4_CODE[(b & 15) as usize] * m;
                    }
                }
            });
    }

    /// Whether rows can move whole (a row is whole blocks).
    fn rows_are_blocks(&self) -> bool {
        self.cols.is_multiple_of(NF4_BLOCK)
    }

    /// Row `r`'s bytes and scales.
    fn row(&self, r: usize) -> (&[u8], &[f32]) {
        let (b, s) = (self.cols / 2, self.cols / NF4_BLOCK);
        (
            &self.packed[r * b..(r + 1) * b],
            &self.absmax[r * s..(r + 1) * s],
        )
    }

    /// The rows `order` of the weights `parts` (all with the same columns), in that order.
    fn gather(parts: &[(&Nf4, usize)]) -> Nf4 {
        let cols = parts.first().map_or(0, |p| p.0.cols);
        let mut out = Nf4 {
            rows: parts.len(),
            cols,
            packed: Vec::with_capacity(parts.len() * cols / 2),
            absmax: Vec::with_capacity(parts.len() * cols / NF4_BLOCK),
        };
        for (w, r) in parts {
            let (b, s) = w.row(*r);
            out.packed.extend_from_slice(b);
            out.absmax.extend_from_slice(s);
        }
        out
    }
}

/// Where a [`QuantProj`]'s weight lives.
#[derive(Debug, Clone)]
enum QWeight {
    Ggml(Arc<QTensor>),
    Nf4(Arc<Nf4>),
}

/// Rows up to which the forward uses candle's quantized kernel instead of dequantize + GEMM,
/// by type (`cargo run --release -p grpo --example qmatmul`, 2 threads, a 1536 x 576 weight:
/// the kernel costs 0.05 ms per row for Q4_0 and Q8_0 and 0.22 ms for Q4_1; dequantize + GEMM
/// about 0.6-1.3 ms up to 64 rows).
fn kernel_max_rows(kind: QuantType) -> usize {
    match kind {
        QuantType::Q4_0 | QuantType::Q8_0 => 20,
        QuantType::Q4_1 => 4,
        QuantType::Nf4 => 0,
    }
}

/// Dequantizes `bytes` (whole rows of `T` blocks) into `out` on rayon's threads.
fn dequantize_rows<T: GgmlType>(bytes: &[u8], out: &mut [f32], row_len: usize) -> Result<bool> {
    let size = std::mem::size_of::<T>();
    if bytes.as_ptr().align_offset(std::mem::align_of::<T>()) != 0
        || !bytes.len().is_multiple_of(size)
    {
        return Ok(false);
    }
    let row_bytes = row_len / T::BLCK_SIZE * size;
    const ROWS: usize = 64;
    out.par_chunks_mut(row_len * ROWS)
        .zip(bytes.par_chunks(row_bytes * ROWS))
        .for_each(|(ys, xs)| {
            // SAFETY: `xs` is aligned for `T` (checked above; chunks are whole blocks) and holds
            // `xs.len() / size` blocks of plain-old-data `T` written by candle.
            let blocks =
                unsafe { std::slice::from_raw_parts(xs.as_ptr() as *const T, xs.len() / size) };
            T::to_float(blocks, ys);
        });
    Ok(true)
}

/// `y = x W^T` with `W` [out, in] kept quantized.
#[derive(Debug, Clone)]
pub struct QuantProj {
    w: QWeight,
    kind: QuantType,
    /// The quantized weight on the device of the portable forward, copied there at its first
    /// call (shared by clones).
    on_device: Arc<OnceLock<OnDevice>>,
}

/// A quantized weight as candle tensors on one device (the portable forward's copy).
#[derive(Debug)]
enum OnDevice {
    Nf4 {
        /// [blocks * 32] u8: the codes, two per byte, padded to whole blocks with code 7 (0.0).
        packed: Tensor,
        /// [blocks, 1] f32
        absmax: Tensor,
        /// [256] f32 each: a byte's high and low nibble's NF4 value.
        high: Tensor,
        low: Tensor,
        /// [16] f32: the NF4 values (grpo's GPU kernel reads them).
        #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
        code: Tensor,
    },
    Ggml(Arc<QTensor>),
}

impl OnDevice {
    fn new(w: &QWeight, device: &Device) -> Result<Self> {
        Ok(match w {
            QWeight::Ggml(q) if device.is_cpu() => OnDevice::Ggml(q.clone()),
            QWeight::Ggml(q) => {
                let storage = QStorage::from_data(q.data()?, device, q.dtype())?;
                OnDevice::Ggml(Arc::new(QTensor::new(storage, q.shape())?))
            }
            QWeight::Nf4(w) => {
                let blocks = w.absmax.len();
                let mut packed = w.packed.clone();
                packed.resize(blocks * NF4_BLOCK / 2, 0x77);
                let table = |f: fn(u8) -> u8| -> Result<Tensor> {
                    let v: Vec<f32> = (0..=255u8).map(|b| NF4_CODE[f(b) as usize]).collect();
                    Tensor::from_vec(v, 256, device)
                };
                OnDevice::Nf4 {
                    packed: Tensor::from_vec(packed, blocks * NF4_BLOCK / 2, device)?,
                    absmax: Tensor::from_vec(w.absmax.clone(), (blocks, 1), device)?,
                    high: table(|b| b >> 4)?,
                    low: table(|b| b & 15)?,
                    code: Tensor::from_vec(NF4_CODE.to_vec(), 16, device)?,
                }
            }
        })
    }

    fn device(&self) -> Device {
        match self {
            OnDevice::Nf4 { packed, .. } => packed.device().clone(),
            OnDevice::Ggml(q) => q.device(),
        }
    }

    /// The weight [out, in] f32, dequantized on the device with candle ops.
    fn dequantize(&self, (o, i): (usize, usize)) -> Result<Tensor> {
        match self {
            OnDevice::Ggml(q) => q.dequantize(&q.device())?.reshape((o, i)),
            OnDevice::Nf4 {
                packed,
                absmax,
                high,
                low,
                ..
            } => {
                // u32 ids: candle's index_select reads a u8 id of 255 as "none" (a zero row).
                let ids = packed.to_dtype(DType::U32)?; // [blocks*32]
                let hi = high.index_select(&ids, 0)?; // [blocks*32] f32
                let lo = low.index_select(&ids, 0)?;
                let blocks = absmax.dim(0)?;
                Tensor::stack(&[hi, lo], 1)? // [blocks*32, 2]: the high nibble first
                    .reshape((blocks, NF4_BLOCK))?
                    .broadcast_mul(absmax)? // [blocks, 64]
                    .flatten_all()?
                    .narrow(0, 0, o * i)?
                    .reshape((o, i))
            }
        }
    }

    /// The weight [out, in] in `dtype`: NF4 in one GPU kernel under [`Compute::Gpu`] (the same
    /// values), candle ops in f32 then a cast otherwise.
    fn weight(&self, (o, i): (usize, usize), dtype: DType, compute: Compute) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let (
            Compute::Gpu,
            OnDevice::Nf4 {
                packed,
                absmax,
                code,
                ..
            },
        ) = (compute, self)
        {
            let w = crate::kernels::cuda::nf4_dequantize(packed, absmax, code, o * i, dtype)?;
            return w.reshape((o, i));
        }
        let _ = compute;
        self.dequantize((o, i))?.to_dtype(dtype)
    }
}

/// The portable forward's backward: `dX = dY W`, the weight dequantized again, so that no
/// dequantized weight is kept between a forward and its backward (bitsandbytes' QLoRA does the
/// same); the frozen weight gets no gradient.
struct Redequantize {
    proj: QuantProj,
    compute: Compute,
}

impl Backward for Redequantize {
    fn name(&self) -> &'static str {
        "quant-proj"
    }

    fn backward(
        &self,
        inputs: &[Tensor],
        _wanted: &[bool],
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let [x] = inputs else {
            candle_core::bail!("quant-proj: one input expected");
        };
        let w = self.proj.weight_on(x.device(), x.dtype(), self.compute)?; // [out, in]
                                                                           // The product autograd forms for `x W^T` (W^T transposed back: the same layout).
        Ok(vec![Some(grad.matmul(&w.t()?.t()?)?)]) // [N, in]
    }
}

impl QuantProj {
    /// Quantizes `weight` [out, in] (HF layout, any float dtype). For GGML types `in` must be a
    /// multiple of the block size (32); NF4 takes any shape.
    pub fn quantize(weight: &Tensor, kind: QuantType) -> Result<Self> {
        let (_, i) = weight.dims2()?;
        let (bs, _) = kind.block();
        if kind.ggml().is_some() && i % bs != 0 {
            candle_core::bail!(
                "cannot quantize a weight with {i} input features to {}: it needs a multiple of {bs}",
                kind.name()
            );
        }
        let w = weight
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .contiguous()?;
        let q = match kind.ggml() {
            Some(d) => QWeight::Ggml(Arc::new(QTensor::quantize(&w, d)?)),
            None => {
                let (o, _) = w.dims2()?;
                QWeight::Nf4(Arc::new(Nf4::quantize(
                    &w.flatten_all()?.to_vec1::<f32>()?,
                    o,
                    i,
                )?))
            }
        };
        Ok(Self::of(q, kind))
    }

    fn of(w: QWeight, kind: QuantType) -> Self {
        Self {
            w,
            kind,
            on_device: Default::default(),
        }
    }

    /// Stacks projections of the same input along `out` (q/k/v, gate/up) into one, exactly: the
    /// quantized rows are concatenated as they are.
    pub fn stack(parts: &[&QuantProj]) -> Result<Self> {
        let Some(first) = parts.first() else {
            candle_core::bail!("no projections to stack");
        };
        let (_, i) = first.dims()?;
        for p in parts {
            if p.dims()?.1 != i || p.kind != first.kind {
                candle_core::bail!("stacked projections must share input size and type");
            }
        }
        let mut rows = vec![];
        let mut bytes = Vec::new();
        for p in parts {
            match &p.w {
                QWeight::Ggml(q) => bytes.extend_from_slice(&q.data()?),
                QWeight::Nf4(w) if w.rows_are_blocks() => {
                    rows.extend((0..w.rows).map(|r| (w.as_ref(), r)))
                }
                QWeight::Nf4(_) => candle_core::bail!(
                    "nf4 projections stack only with input sizes that are multiples of {NF4_BLOCK}"
                ),
            }
        }
        Self::from_parts(first.kind, bytes, &rows, i)
    }

    /// A projection of `kind` from GGML bytes (whole rows of `cols`) or NF4 rows.
    fn from_parts(
        kind: QuantType,
        bytes: Vec<u8>,
        nf4_rows: &[(&Nf4, usize)],
        cols: usize,
    ) -> Result<Self> {
        let w = match kind.ggml() {
            Some(d) => {
                let (bs, ts) = kind.block();
                let rows = bytes.len() / (cols / bs * ts);
                let storage = QStorage::from_data(bytes.into(), &Device::Cpu, d)?;
                QWeight::Ggml(Arc::new(QTensor::new(storage, (rows, cols))?))
            }
            None => QWeight::Nf4(Arc::new(Nf4::gather(nf4_rows))),
        };
        Ok(Self::of(w, kind))
    }

    /// From a GGUF tensor kept as is (no re-quantization); `None` when its type is not `kind`.
    pub fn from_qtensor(q: Arc<QTensor>, kind: QuantType) -> Option<Self> {
        (Some(q.dtype()) == kind.ggml() && q.rank() == 2).then(|| Self::of(QWeight::Ggml(q), kind))
    }

    /// The weight taken apart into codes and block scales ([`Codes`]); `None` for an NF4
    /// weight whose rows are not whole blocks.
    pub(crate) fn codes(&self) -> Result<Option<Codes>> {
        let (rows, cols) = self.dims()?;
        let (block, _) = self.kind.block();
        let nb = cols / block;
        let mut out = Codes {
            kind: self.kind,
            rows,
            cols,
            block,
            codes: vec![0u8; rows * cols],
            scales: vec![0f32; rows * nb],
            mins: match self.kind {
                QuantType::Q4_1 => vec![0f32; rows * nb],
                _ => vec![],
            },
        };
        let q = match &self.w {
            QWeight::Nf4(w) if !w.rows_are_blocks() => return Ok(None),
            QWeight::Nf4(w) => {
                // Two codes per byte, the first in the high nibble; blocks never cross rows.
                for (pair, &b) in out.codes.chunks_exact_mut(2).zip(&w.packed) {
                    pair[0] = b >> 4;
                    pair[1] = b & 15;
                }
                out.scales.copy_from_slice(&w.absmax);
                return Ok(Some(out));
            }
            QWeight::Ggml(q) => q,
        };
        // GGML's block layouts (ggml-common.h): Q4_0 {f16 d; u8 qs[16]}, Q4_1 {f16 d, m;
        // u8 qs[16]}, Q8_0 {f16 d; i8 qs[32]}; a 4-bit block's value j < 16 is the low nibble
        // of qs[j], value j + 16 its high nibble.
        let data = q.data()?;
        let (_, ts) = self.kind.block();
        if data.len() != rows * nb * ts {
            candle_core::bail!(
                "quantized weight: {} bytes for [{rows}, {cols}]",
                data.len()
            );
        }
        let f16_at = |o: usize| half::f16::from_le_bytes([data[o], data[o + 1]]).to_f32();
        for (bi, blk) in data.chunks_exact(ts).enumerate() {
            let o = bi * ts;
            let codes = &mut out.codes[bi * block..(bi + 1) * block];
            out.scales[bi] = f16_at(o);
            let qs = match self.kind {
                QuantType::Q4_1 => {
                    out.mins[bi] = f16_at(o + 2);
                    &blk[4..]
                }
                _ => &blk[2..],
            };
            match self.kind {
                QuantType::Q8_0 => codes.copy_from_slice(qs),
                _ => {
                    for (j, &b) in qs.iter().enumerate() {
                        codes[j] = b & 15;
                        codes[j + 16] = b >> 4;
                    }
                }
            }
        }
        Ok(Some(out))
    }

    /// The NF4 weight, when the projection is one.
    pub fn nf4(&self) -> Option<&Nf4> {
        match &self.w {
            QWeight::Nf4(w) => Some(w),
            QWeight::Ggml(_) => None,
        }
    }

    /// Reorders the weight's rows: row `r` of the result is row `order[r]` (exact; each row's
    /// blocks move together). Undoes GGUF's q/k permutation without re-quantizing.
    pub fn permute_rows(&self, order: &[usize]) -> Result<Self> {
        let (o, i) = self.dims()?;
        if order.len() != o || order.iter().any(|&r| r >= o) {
            candle_core::bail!("row order does not match the weight's {o} rows");
        }
        match &self.w {
            QWeight::Ggml(q) => {
                let (bs, ts) = self.kind.block();
                let row = i / bs * ts;
                let data = q.data()?;
                let mut out = Vec::with_capacity(data.len());
                for &r in order {
                    out.extend_from_slice(&data[r * row..(r + 1) * row]);
                }
                Self::from_parts(self.kind, out, &[], i)
            }
            QWeight::Nf4(w) => {
                if !w.rows_are_blocks() {
                    candle_core::bail!(
                        "nf4 rows move only with input sizes that are multiples of {NF4_BLOCK}"
                    );
                }
                let rows: Vec<(&Nf4, usize)> = order.iter().map(|&r| (w.as_ref(), r)).collect();
                Self::from_parts(self.kind, vec![], &rows, i)
            }
        }
    }

    pub fn kind(&self) -> QuantType {
        self.kind
    }
    /// (out, in)
    pub fn dims(&self) -> Result<(usize, usize)> {
        match &self.w {
            QWeight::Ggml(q) => q.shape().dims2(),
            QWeight::Nf4(w) => Ok((w.rows, w.cols)),
        }
    }
    /// Bytes the quantized weight occupies.
    pub fn size_in_bytes(&self) -> usize {
        match &self.w {
            QWeight::Ggml(q) => q.storage_size_in_bytes(),
            QWeight::Nf4(w) => w.packed.len() + 4 * w.absmax.len(),
        }
    }
    /// The weight dequantized, [out, in] f32 (rows in parallel).
    pub fn dequantize(&self) -> Result<Tensor> {
        let (o, i) = self.dims()?;
        Tensor::from_vec(self.dequantize_vec()?, (o, i), &Device::Cpu)
    }

    /// The weight dequantized into a plain buffer, [out, in] row-major.
    fn dequantize_vec(&self) -> Result<Vec<f32>> {
        let (o, i) = self.dims()?;
        let mut out = vec![0f32; o * i];
        let q = match &self.w {
            QWeight::Nf4(w) => {
                w.dequantize_into(&mut out);
                return Ok(out);
            }
            QWeight::Ggml(q) => q,
        };
        let data = q.data()?;
        let done = match self.kind {
            QuantType::Q4_0 => dequantize_rows::<BlockQ4_0>(&data, &mut out, i)?,
            QuantType::Q4_1 => dequantize_rows::<BlockQ4_1>(&data, &mut out, i)?,
            QuantType::Q8_0 => dequantize_rows::<BlockQ8_0>(&data, &mut out, i)?,
            QuantType::Nf4 => false,
        };
        if done {
            return Ok(out);
        }
        q.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1()
    }

    /// `x` [N, in] -> [N, out] through candle's quantized kernel (benchmarks; no backward).
    pub fn forward_kernel(&self, x: &Tensor) -> Result<Tensor> {
        match &self.w {
            QWeight::Ggml(q) => x.contiguous()?.apply_op1_no_bwd(q.as_ref()),
            QWeight::Nf4(_) => self.forward_dequant(x),
        }
    }

    /// `x` [N, in] -> [N, out] by dequantizing the weight (benchmarks; no backward).
    pub fn forward_dequant(&self, x: &Tensor) -> Result<Tensor> {
        x.matmul(&self.dequantize()?.t()?)
    }

    /// The weight [out, in] f32 dequantized on `device` with candle ops (the portable path; its
    /// quantized bytes are copied there once).
    pub fn dequantize_on(&self, device: &Device) -> Result<Tensor> {
        let dims = self.dims()?;
        self.with_on_device(device, |d| d.dequantize(dims))
    }

    /// `f` of the quantized weight's copy on `device` (made at the first call; a device other
    /// than the cached one gets a copy of its own, not kept).
    fn with_on_device<R>(
        &self,
        device: &Device,
        f: impl FnOnce(&OnDevice) -> Result<R>,
    ) -> Result<R> {
        let cached = match self.on_device.get() {
            Some(d) => d,
            None => {
                let d = OnDevice::new(&self.w, device)?;
                self.on_device.get_or_init(|| d)
            }
        };
        if cached.device().same_device(device) {
            return f(cached);
        }
        f(&OnDevice::new(&self.w, device)?)
    }

    /// The weight [out, in] in `dtype` on `device`, dequantized there (see [`OnDevice::weight`]).
    fn weight_on(&self, device: &Device, dtype: DType, compute: Compute) -> Result<Tensor> {
        let dims = self.dims()?;
        self.with_on_device(device, |d| d.weight(dims, dtype, compute))
    }

    /// `x` [N, in] -> [N, out] in `x`'s dtype, on its device: the weight dequantized there, one
    /// matmul, and a backward ([`Redequantize`]) that dequantizes it again.
    fn forward_portable(&self, x: &Tensor, compute: Compute) -> Result<Tensor> {
        let w = self.weight_on(x.device(), x.dtype(), compute)?; // [out, in]
        let y = x.detach().matmul(&w.t()?)?; // [N, out]
        drop(w);
        attach(
            &y,
            &[x],
            Arc::new(Redequantize {
                proj: self.clone(),
                compute,
            }),
        )
    }

    /// `x` [.., in] -> [.., out]. Records a backward to `x` when `x` tracks gradients. With
    /// [`Compute::CpuFused`] (and `x` f32 on the CPU) grpo's custom op multiplies by the quantized
    /// bytes; otherwise the weight is dequantized where `x` is, with candle ops.
    pub fn forward(&self, x: &Tensor, compute: Compute) -> Result<Tensor> {
        let (o, i) = self.dims()?;
        let dims = x.dims().to_vec();
        let rows = x.elem_count() / i;
        let y = if compute.fuses(x) {
            let x2 = x.reshape((rows, i))?.contiguous()?; // [N, in] f32
            x2.apply_op1(self.clone())? // [N, out]
        } else {
            self.forward_portable(&x.reshape((rows, i))?, compute)? // [N, out]
        };
        let mut shape = dims;
        if let Some(last) = shape.last_mut() {
            *last = o;
        }
        y.reshape(shape)
    }
}

impl CustomOp1 for QuantProj {
    fn name(&self) -> &'static str {
        "quant-proj"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, k) = l.shape().dims2()?;
        if let QWeight::Ggml(q) = &self.w {
            if n <= kernel_max_rows(self.kind) {
                return q.cpu_fwd(s, l);
            }
        }
        let (o, _) = self.dims()?;
        let Some((x0, x1)) = l.contiguous_offsets() else {
            candle_core::bail!("quantized projection: input must be contiguous");
        };
        let CpuStorage::F32(xs) = s else {
            candle_core::bail!("quantized projection: f32 input only");
        };
        let x = &xs[x0..x1];
        let w = self.dequantize_vec()?; // [o, k]
        let mut y = vec![0f32; n * o];
        // SAFETY: y is [n, o], x is [n, k], w is [o, k], all contiguous and sized as stated.
        unsafe {
            gemm::gemm(
                n,
                o,
                k,
                y.as_mut_ptr(),
                1,
                o as isize,
                false,
                x.as_ptr(),
                1,
                k as isize,
                w.as_ptr(),
                k as isize, // rhs[kk, j] = W[j, kk]
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                crate::kernels::cpu::gemm_threads(),
            );
        }
        Ok((CpuStorage::F32(y), Shape::from((n, o))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        // dX = dY W, W dequantized; the frozen weight gets no gradient.
        let w = self.dequantize()?; // [out, in]
        let gy = grad_res.to_dtype(DType::F32)?.contiguous()?; // [N, out]
        Ok(Some(gy.matmul(&w)?.to_dtype(arg.dtype())?)) // [N, in]
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn randn(shape: (usize, usize), seed: u64) -> Tensor {
        let n = shape.0 * shape.1;
        let mut s = seed;
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 33) as f32 / (1u64 << 31) as f32) - 0.5
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// bitsandbytes' NF4 (scripts/make_nf4_fixtures.py): the same codes, scales and
    /// dequantized values for every fixture weight.
    #[test]
    fn nf4_equals_bitsandbytes() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/nf4/nf4.safetensors");
        let f = candle_core::safetensors::load(path, &Device::Cpu).unwrap();
        let code: Vec<f32> = f["code"].to_vec1().unwrap();
        assert_eq!(code, NF4_CODE.to_vec());
        for name in ["small", "wide", "outliers", "partial"] {
            let w = &f[&format!("weight_{name}")];
            let (o, i) = w.dims2().unwrap();
            let q = QuantProj::quantize(w, QuantType::Nf4).unwrap();
            let nf4 = q.nf4().unwrap();
            let packed: Vec<u8> = f[&format!("packed_{name}")].to_vec1().unwrap();
            let absmax: Vec<f32> = f[&format!("absmax_{name}")].to_vec1().unwrap();
            assert_eq!(nf4.absmax, absmax, "{name}: scales");
            let differ = nf4
                .packed
                .iter()
                .zip(&packed)
                .filter(|(a, b)| a != b)
                .count();
            assert_eq!(
                differ,
                0,
                "{name}: {differ} of {} bytes differ",
                packed.len()
            );
            let want: Vec<f32> = f[&format!("dequant_{name}")]
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let got: Vec<f32> = q
                .dequantize()
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert_eq!(got, want, "{name}: dequantized");
            assert_eq!(
                q.size_in_bytes(),
                (o * i).div_ceil(2) + 4 * (o * i).div_ceil(64)
            );
        }
        // Rows of partial blocks quantize (blocks run across rows) but do not move.
        let odd = QuantProj::quantize(&randn((4, 96), 1), QuantType::Nf4).unwrap();
        assert!(odd.permute_rows(&[1, 0, 2, 3]).is_err());
    }

    #[test]
    fn forward_matches_dequantized_weight_both_paths() {
        for kind in [
            QuantType::Q4_0,
            QuantType::Q4_1,
            QuantType::Q8_0,
            QuantType::Nf4,
        ] {
            let w = randn((48, 64), 1);
            let q = QuantProj::quantize(&w, kind).unwrap();
            let wd = q.dequantize().unwrap();
            for rows in [3, 40] {
                let x = randn((rows, 64), 2);
                let y = q
                    .forward(&x, Compute::resolve(x.device(), x.dtype()))
                    .unwrap();
                let want = x.matmul(&wd.t().unwrap()).unwrap();
                let d = max_diff(&y, &want);
                // The few-row path quantizes x to 8 bits as well (candle's kernel).
                let tol = if rows <= kernel_max_rows(kind) {
                    5e-2
                } else {
                    1e-5
                };
                assert!(d < tol, "{kind:?} rows {rows}: {d}");
            }
        }
    }

    /// The portable path's dequantization (candle ops on the device) gives the host's weight bit
    /// for bit, for every type and for NF4 shapes that end inside a block or inside a byte; its
    /// forward and input gradient equal the custom op's, and a bf16 input stays bf16.
    #[test]
    fn portable_path_equals_the_custom_op() {
        for (kind, (o, i)) in [
            (QuantType::Q4_0, (48, 64)),
            (QuantType::Q4_1, (16, 96)),
            (QuantType::Q8_0, (24, 64)),
            (QuantType::Nf4, (48, 64)),
            (QuantType::Nf4, (5, 13)),
        ] {
            let q = QuantProj::quantize(&randn((o, i), 11), kind).unwrap();
            let host = q.dequantize().unwrap().flatten_all().unwrap();
            let dev = q.dequantize_on(&Device::Cpu).unwrap();
            assert_eq!(dev.dims2().unwrap(), (o, i));
            let (a, b) = (
                host.to_vec1::<f32>().unwrap(),
                dev.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            let bad = a
                .iter()
                .zip(&b)
                .position(|(x, y)| x.to_bits() != y.to_bits());
            assert!(
                bad.is_none(),
                "{kind:?} [{o}, {i}] at {bad:?}: {:?}",
                bad.map(|k| (a[k], b[k]))
            );
            let x = candle_core::Var::from_tensor(&randn((40, i), 12)).unwrap();
            let gy = randn((40, o), 13);
            let run = |portable: bool| {
                let y = match portable {
                    true => q
                        .forward_portable(x.as_tensor(), Compute::Portable)
                        .unwrap(),
                    false => x.as_tensor().apply_op1(q.clone()).unwrap(),
                };
                let g = (&y * &gy).unwrap().sum_all().unwrap().backward().unwrap();
                (y, g.get(x.as_tensor()).unwrap().clone())
            };
            let ((y1, g1), (y2, g2)) = (run(true), run(false));
            let (dy, dg) = (max_diff(&y1, &y2), max_diff(&g1, &g2));
            assert!(dy < 1e-5, "{kind:?} forward {dy}");
            assert!(dg < 1e-5, "{kind:?} gradient {dg}");
            let yb = q
                .forward(
                    &x.as_tensor().to_dtype(DType::BF16).unwrap(),
                    Compute::CpuFused,
                )
                .unwrap();
            assert_eq!(yb.dtype(), DType::BF16);
            let yb = yb.to_dtype(DType::F32).unwrap();
            assert!(
                max_diff(&yb, &y2) < 0.05 * (1.0 + max_abs(&y2)),
                "{kind:?} bf16"
            );
        }
    }

    fn max_abs(t: &Tensor) -> f32 {
        t.abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        max_abs(&(a - b).unwrap())
    }

    #[test]
    fn input_gradient_is_through_the_dequantized_weight() {
        let w = randn((32, 64), 3);
        let q = QuantProj::quantize(&w, QuantType::Q4_0).unwrap();
        let wd = q.dequantize().unwrap();
        let x = candle_core::Var::from_tensor(&randn((20, 64), 4)).unwrap();
        let gy = randn((20, 32), 5);
        let g1 = (q
            .forward(x.as_tensor(), Compute::resolve(&Device::Cpu, DType::F32))
            .unwrap()
            * &gy)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let g2 = (x.as_tensor().matmul(&wd.t().unwrap()).unwrap() * &gy)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let d = max_diff(
            g1.get(x.as_tensor()).unwrap(),
            g2.get(x.as_tensor()).unwrap(),
        );
        assert!(d < 1e-5, "{d}");
    }

    #[test]
    fn stack_and_permute_are_exact() {
        for kind in [QuantType::Q4_1, QuantType::Nf4] {
            stack_and_permute_are_exact_for(kind);
        }
    }

    fn stack_and_permute_are_exact_for(kind: QuantType) {
        let a = QuantProj::quantize(&randn((32, 64), 6), kind).unwrap();
        let b = QuantProj::quantize(&randn((64, 64), 7), kind).unwrap();
        let s = QuantProj::stack(&[&a, &b]).unwrap();
        let want = Tensor::cat(&[a.dequantize().unwrap(), b.dequantize().unwrap()], 0).unwrap();
        let got = s.dequantize().unwrap();
        assert_eq!(
            got.to_vec2::<f32>().unwrap(),
            want.to_vec2::<f32>().unwrap()
        );
        let order: Vec<usize> = (0..32).rev().collect();
        let p = a.permute_rows(&order).unwrap().dequantize().unwrap();
        let idx =
            Tensor::from_vec(order.iter().map(|&r| r as u32).collect(), 32, &Device::Cpu).unwrap();
        let want = a.dequantize().unwrap().index_select(&idx, 0).unwrap();
        assert_eq!(p.to_vec2::<f32>().unwrap(), want.to_vec2::<f32>().unwrap());
        assert!(QuantProj::quantize(&randn((4, 40), 8), QuantType::Q8_0).is_err());
    }
}
