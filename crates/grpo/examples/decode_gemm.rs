//! Decoding-step projections (SmolLM2-135M shapes, 1 to 64 rows): candle's GEMM on the
//! contiguous [in, out] weight vs the packed decoding kernel (`grpo_models::kernels::cpu::packed`), plus the
//! cost of packing. Not a test.
//!   cargo run --release -p grpo --example decode_gemm
use std::time::Instant;

use candle_core::{Device, Tensor};
use grpo_models::kernels::cpu::packed::PackedWeight;

fn time(reps: usize, mut f: impl FnMut() -> candle_core::Result<()>) -> candle_core::Result<f64> {
    f()?;
    let t = Instant::now();
    for _ in 0..reps {
        f()?;
    }
    Ok(t.elapsed().as_secs_f64() / reps as f64)
}

fn main() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    println!(
        "packed kernel available: {}",
        grpo_models::kernels::Compute::resolve(&candle_core::Device::Cpu, candle_core::DType::F32)
            .packs_for_decoding()
    );
    // (out, in): q/k/v joined, o, gate/up joined, down, LM head.
    for (n, k) in [
        (960, 576),
        (576, 576),
        (3072, 576),
        (576, 1536),
        (49152, 576),
    ] {
        let w = Tensor::randn(0f32, 0.02, (n, k), &dev)?; // [out, in]
        let wt = w.t()?.contiguous()?; // [in, out], as a detached Linear keeps it
        let pack_s = time(3, || PackedWeight::from_in_out(&wt).map(|_| ()))?;
        let packed = PackedWeight::from_in_out(&wt)?;
        let ms: Vec<usize> = std::env::var("ROWS")
            .map(|v| v.split(',').filter_map(|x| x.parse().ok()).collect())
            .unwrap_or(vec![1, 8, 32, 64, 256]);
        for m in ms {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
            let reps = if n > 10_000 { 20 } else { 300 };
            let candle = time(reps, || x.matmul(&wt).map(|_| ()))?;
            let ours = time(reps, || packed.forward(&x).map(|_| ()))?;
            let gf = |s: f64| 2.0 * (m * n * k) as f64 / s / 1e9;
            println!(
                "out {n:5} in {k:4} rows {m:3}: candle {:7.3} ms ({:4.0} GFLOP/s)  packed {:7.3} ms ({:4.0} GFLOP/s)  x{:.2}",
                candle * 1e3,
                gf(candle),
                ours * 1e3,
                gf(ours),
                candle / ours
            );
        }
        println!("out {n:5} in {k:4}: packing takes {:.2} ms", pack_s * 1e3);
    }
    Ok(())
}
