//! Times a quantized projection's two forward paths (candle's quantized kernel vs dequantize +
//! f32 GEMM) by row count, to pick the switch-over point (NF4 has no kernel: both columns are
//! its dequantize + GEMM). Not a test.
//!   cargo run --release -p grpo --example qmatmul

use std::time::Instant;

use candle_core::{Device, Tensor};
use grpo_models::models::{QuantProj, QuantType};

fn main() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let w = Tensor::randn(0f32, 0.02, (1536, 576), &dev)?;
    for kind in [
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q8_0,
        QuantType::Nf4,
    ] {
        let q = QuantProj::quantize(&w, kind)?;
        for rows in [1usize, 4, 8, 16, 32, 64, 128, 256] {
            let x = Tensor::randn(0f32, 1.0, (rows, 576), &dev)?;
            let time = |f: &dyn Fn() -> candle_core::Result<Tensor>| -> candle_core::Result<f64> {
                f()?;
                let t = Instant::now();
                for _ in 0..20 {
                    f()?;
                }
                Ok(t.elapsed().as_secs_f64() / 20.0 * 1e3)
            };
            let kernel = time(&|| q.forward_kernel(&x))?;
            let gemm = time(&|| q.forward_dequant(&x))?;
            println!(
                "{} rows {rows:4}: kernel {kernel:.3} ms, dequant+gemm {gemm:.3} ms",
                kind.name()
            );
        }
    }
    Ok(())
}
