//! Times the reference (no-graph) log-prob forward of one GRPO batch shaped like the peer
//! benchmark's (8 prompts x 4 completions, ~50 prompt and ~45 completion tokens). Not a test.
//!   cargo run --release -p grpo --example ref_forward -- /path/to/hf-model-dir
use std::time::Instant;

use candle_core::{DType, Device};
use grpo::logprobs::{completion_logprobs, Entropy, Packing};
use grpo::models::Mode;

fn main() -> anyhow::Result<()> {
    let path = std::env::args()
        .nth(1)
        .unwrap_or("/opt/peers/smollm2-135m-instruct-f32".into());
    let src = grpo::hub::resolve_model(Some(&path))?;
    let loaded = grpo::weights::load_model(&src, DType::F32, &Device::Cpu)?;
    let model = loaded.build()?;
    let mut seed = 1u64;
    let mut tok = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as u32 % 40000 + 100
    };
    let prompts: Vec<Vec<u32>> = (0..8).map(|_| (0..50).map(|_| tok()).collect()).collect();
    let comps: Vec<Vec<u32>> = (0..32).map(|_| (0..45).map(|_| tok()).collect()).collect();
    let p: Vec<&[u32]> = (0..32).map(|i| prompts[i / 4].as_slice()).collect();
    let c: Vec<&[u32]> = comps.iter().map(|c| c.as_slice()).collect();
    for rep in 0..4 {
        let t = Instant::now();
        let (lp, _) = completion_logprobs(
            &model,
            &p,
            &c,
            0,
            1.0,
            Mode::Infer,
            Entropy::Skip,
            Packing::SharedPrompt,
        )?;
        println!(
            "rep {rep}: {:.3} s (sum {:.3})",
            t.elapsed().as_secs_f64(),
            lp.sum_all()?.to_scalar::<f32>()?
        );
    }
    Ok(())
}
