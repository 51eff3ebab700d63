//! f32 GEMM rate of candle's CPU matmul at training shapes (M tokens x K -> N). Not a test.
//!   cargo run --release -p grpo --example gemm_rate [M]
use std::time::Instant;

use candle_core::{Device, Tensor};

fn main() -> candle_core::Result<()> {
    let m: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1680);
    let dev = Device::Cpu;
    for (k, n) in [(576, 960), (576, 3072), (1536, 576), (576, 49152)] {
        let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
        let w = Tensor::randn(0f32, 0.02, (n, k), &dev)?.t()?.contiguous()?;
        let _ = x.matmul(&w)?;
        let reps = 5;
        let t = Instant::now();
        for _ in 0..reps {
            let _ = x.matmul(&w)?;
        }
        let s = t.elapsed().as_secs_f64() / reps as f64;
        println!(
            "M {m} K {k} N {n}: {:.1} ms, {:.0} GFLOP/s",
            s * 1e3,
            2.0 * (m * k * n) as f64 / s / 1e9
        );
    }
    Ok(())
}
