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

use std::sync::Arc;

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
}

impl QuantType {
    pub fn ggml(self) -> GgmlDType {
        match self {
            QuantType::Q4_0 => GgmlDType::Q4_0,
            QuantType::Q4_1 => GgmlDType::Q4_1,
            QuantType::Q8_0 => GgmlDType::Q8_0,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            QuantType::Q4_0 => "q4_0",
            QuantType::Q4_1 => "q4_1",
            QuantType::Q8_0 => "q8_0",
        }
    }
    /// Values of 32 elements per block, and bytes per block.
    fn block(self) -> (usize, usize) {
        let d = self.ggml();
        (d.block_size(), d.type_size())
    }
}

/// Rows up to which the forward uses candle's quantized kernel instead of dequantize + GEMM,
/// by type (`cargo run --release -p grpo --example qmatmul`, 2 threads, a 1536 x 576 weight:
/// the kernel costs 0.05 ms per row for Q4_0 and Q8_0 and 0.22 ms for Q4_1; dequantize + GEMM
/// about 0.6-1.3 ms up to 64 rows).
fn kernel_max_rows(kind: QuantType) -> usize {
    match kind {
        QuantType::Q4_0 | QuantType::Q8_0 => 20,
        QuantType::Q4_1 => 4,
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
    w: Arc<QTensor>,
    kind: QuantType,
}

impl QuantProj {
    /// Quantizes `weight` [out, in] (HF layout, any float dtype). `in` must be a multiple of the
    /// block size (32).
    pub fn quantize(weight: &Tensor, kind: QuantType) -> Result<Self> {
        let (_, i) = weight.dims2()?;
        let (bs, _) = kind.block();
        if i % bs != 0 {
            candle_core::bail!(
                "cannot quantize a weight with {i} input features to {}: it needs a multiple of {bs}",
                kind.name()
            );
        }
        let w = weight
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .contiguous()?;
        Ok(Self {
            w: Arc::new(QTensor::quantize(&w, kind.ggml())?),
            kind,
        })
    }

    /// Stacks projections of the same input along `out` (q/k/v, gate/up) into one, exactly: the
    /// quantized rows are concatenated as they are.
    pub fn stack(parts: &[&QuantProj]) -> Result<Self> {
        let Some(first) = parts.first() else {
            candle_core::bail!("no projections to stack");
        };
        let (_, i) = first.w.shape().dims2()?;
        let mut bytes = Vec::new();
        let mut rows = 0;
        for p in parts {
            let (o, pi) = p.w.shape().dims2()?;
            if pi != i || p.kind != first.kind {
                candle_core::bail!("stacked projections must share input size and type");
            }
            bytes.extend_from_slice(&p.w.data()?);
            rows += o;
        }
        let storage = QStorage::from_data(bytes.into(), &Device::Cpu, first.kind.ggml())?;
        Ok(Self {
            w: Arc::new(QTensor::new(storage, (rows, i))?),
            kind: first.kind,
        })
    }

    /// From a GGUF tensor kept as is (no re-quantization); `None` when its type is not `kind`.
    pub fn from_qtensor(q: Arc<QTensor>, kind: QuantType) -> Option<Self> {
        (q.dtype() == kind.ggml() && q.rank() == 2).then_some(Self { w: q, kind })
    }

    /// Reorders the weight's rows: row `r` of the result is row `order[r]` (exact; each row's
    /// blocks move together). Undoes GGUF's q/k permutation without re-quantizing.
    pub fn permute_rows(&self, order: &[usize]) -> Result<Self> {
        let (o, i) = self.w.shape().dims2()?;
        if order.len() != o || order.iter().any(|&r| r >= o) {
            candle_core::bail!("row order does not match the weight's {o} rows");
        }
        let (bs, ts) = self.kind.block();
        let row = i / bs * ts;
        let data = self.w.data()?;
        let mut out = Vec::with_capacity(data.len());
        for &r in order {
            out.extend_from_slice(&data[r * row..(r + 1) * row]);
        }
        let storage = QStorage::from_data(out.into(), &Device::Cpu, self.kind.ggml())?;
        Ok(Self {
            w: Arc::new(QTensor::new(storage, (o, i))?),
            kind: self.kind,
        })
    }

    pub fn kind(&self) -> QuantType {
        self.kind
    }
    /// (out, in)
    pub fn dims(&self) -> Result<(usize, usize)> {
        self.w.shape().dims2()
    }
    /// Bytes the quantized weight occupies.
    pub fn size_in_bytes(&self) -> usize {
        self.w.storage_size_in_bytes()
    }
    /// The weight dequantized, [out, in] f32 (rows in parallel).
    pub fn dequantize(&self) -> Result<Tensor> {
        let (o, i) = self.dims()?;
        Tensor::from_vec(self.dequantize_vec()?, (o, i), &Device::Cpu)
    }

    /// The weight dequantized into a plain buffer, [out, in] row-major.
    fn dequantize_vec(&self) -> Result<Vec<f32>> {
        let (o, i) = self.dims()?;
        let data = self.w.data()?;
        let mut out = vec![0f32; o * i];
        let done = match self.kind {
            QuantType::Q4_0 => dequantize_rows::<BlockQ4_0>(&data, &mut out, i)?,
            QuantType::Q4_1 => dequantize_rows::<BlockQ4_1>(&data, &mut out, i)?,
            QuantType::Q8_0 => dequantize_rows::<BlockQ8_0>(&data, &mut out, i)?,
        };
        if done {
            return Ok(out);
        }
        self.w.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1()
    }

    /// `x` [N, in] -> [N, out] through candle's quantized kernel (benchmarks; no backward).
    pub fn forward_kernel(&self, x: &Tensor) -> Result<Tensor> {
        x.contiguous()?.apply_op1_no_bwd(self.w.as_ref())
    }

    /// `x` [N, in] -> [N, out] by dequantizing the weight (benchmarks; no backward).
    pub fn forward_dequant(&self, x: &Tensor) -> Result<Tensor> {
        x.matmul(&self.dequantize()?.t()?)
    }

    /// `x` [.., in] -> [.., out]. Records a backward to `x` when `x` tracks gradients.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (o, i) = self.dims()?;
        let dims = x.dims().to_vec();
        let rows = x.elem_count() / i;
        let x2 = x.reshape((rows, i))?.to_dtype(DType::F32)?.contiguous()?; // [N, in]
        let y = x2.apply_op1(self.clone())?; // [N, out]
        let mut shape = dims;
        if let Some(last) = shape.last_mut() {
            *last = o;
        }
        y.reshape(shape)?.to_dtype(x.dtype())
    }
}

impl CustomOp1 for QuantProj {
    fn name(&self) -> &'static str {
        "quant-proj"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, k) = l.shape().dims2()?;
        if n <= kernel_max_rows(self.kind) {
            return self.w.cpu_fwd(s, l);
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
                super::grad_sink::gemm_threads(),
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
mod tests {
    use super::*;

    fn randn(shape: (usize, usize), seed: u64) -> Tensor {
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

    #[test]
    fn forward_matches_dequantized_weight_both_paths() {
        for kind in [QuantType::Q4_0, QuantType::Q4_1, QuantType::Q8_0] {
            let w = randn((48, 64), 1);
            let q = QuantProj::quantize(&w, kind).unwrap();
            let wd = q.dequantize().unwrap();
            for rows in [3, 40] {
                let x = randn((rows, 64), 2);
                let y = q.forward(&x).unwrap();
                let want = x.matmul(&wd.t().unwrap()).unwrap();
                let d = (y - want)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
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

    #[test]
    fn input_gradient_is_through_the_dequantized_weight() {
        let w = randn((32, 64), 3);
        let q = QuantProj::quantize(&w, QuantType::Q4_0).unwrap();
        let wd = q.dequantize().unwrap();
        let x = candle_core::Var::from_tensor(&randn((20, 64), 4)).unwrap();
        let gy = randn((20, 32), 5);
        let g1 = (q.forward(x.as_tensor()).unwrap() * &gy)
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
        let a = g1.get(x.as_tensor()).unwrap();
        let b = g2.get(x.as_tensor()).unwrap();
        let d = (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(d < 1e-5, "{d}");
    }

    #[test]
    fn stack_and_permute_are_exact() {
        let a = QuantProj::quantize(&randn((32, 64), 6), QuantType::Q4_1).unwrap();
        let b = QuantProj::quantize(&randn((64, 64), 7), QuantType::Q4_1).unwrap();
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
