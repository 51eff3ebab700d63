//! What one training pass keeps on the CPU, counted by the allocator (not a benchmark of record):
//! the bytes held from the forward to the backward (the graph's tensors) per token, and the
//! forward's and the backward's peaks, on SmolLM2-135M (/opt/peers, `../shared/bench/peers`).
//!   pass_bytes [ROWS [PROMPT_LEN [COMPLETION_LEN [GROUP]]]]   (default 16 59 48 4)
//! env: GRPO_KERNELS=portable (the GPU's candle-op path) or fused, DTYPE=bf16, LAYERS=n (the
//! first n layers only), UNEVEN=1 (completion lengths spread 0.05-1x COMPLETION_LEN, as when most
//! completions end early and one runs to the cap).
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

/// The system allocator, counting the bytes it holds and their peak.
struct Counting;
static HELD: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

fn count(delta: isize) {
    let now = HELD.fetch_add(delta, Ordering::Relaxed) + delta;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call goes to `System` with the caller's arguments; the counters only observe.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        count(l.size() as isize);
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        count(-(l.size() as isize));
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        count(n as isize - l.size() as isize);
        System.realloc(p, l, n)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

use candle_core::{DType, Device, Var};
use grpo::logprobs::{completion_logprobs, Entropy, Packing};
use grpo_models::hub::ModelSource;
use grpo_models::models::{CausalLm, Mode};

/// Bytes in MB.
fn mb(x: isize) -> f64 {
    x as f64 / 1e6
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, default: usize, what: &str| -> anyhow::Result<usize> {
        match args.get(i) {
            None => Ok(default),
            Some(s) => s
                .parse()
                .map_err(|e| anyhow::anyhow!("argument {i} ({what}): `{s}`: {e}")),
        }
    };
    let (n, lp, lc) = (
        arg(1, 16, "ROWS")?,
        arg(2, 59, "PROMPT_LEN")?,
        arg(3, 48, "COMPLETION_LEN")?,
    );
    let group = arg(4, 4, "GROUP")?.max(1);
    let dir = std::path::PathBuf::from("/opt/peers/smollm2-135m-instruct-f32");
    let m = grpo_models::weights::load_model(&ModelSource::HfDir(dir), DType::F32, &Device::Cpu)?;
    let mut cfg = m.config.clone();
    if let Ok(l) = std::env::var("LAYERS") {
        cfg.num_layers = l.parse()?;
    }
    let spread = [1.0, 0.05, 0.1, 0.2, 0.3, 0.15, 0.5, 0.08];
    let len = |i: usize| match std::env::var("UNEVEN").is_ok() {
        true => ((lc as f64 * spread[i % spread.len()]) as usize).max(1),
        false => lc,
    };
    let ids = |i: usize, j: usize, a: usize, b: usize| ((i * a + j * b) % 4000 + 10) as u32;
    let prompts: Vec<Vec<u32>> = (0..n)
        .map(|i| (0..lp).map(|j| ids(i / group, j, 7, 13)).collect())
        .collect();
    let comps: Vec<Vec<u32>> = (0..n)
        .map(|i| (0..len(i)).map(|j| ids(i, j, 11, 3)).collect())
        .collect();
    let pr: Vec<&[u32]> = prompts.iter().map(|v| v.as_slice()).collect();
    let cr: Vec<&[u32]> = comps.iter().map(|v| v.as_slice()).collect();
    let dtype = match std::env::var("DTYPE").as_deref() {
        Ok("bf16") => DType::BF16,
        _ => DType::F32,
    };
    // Every weight a Var, so that the forward records its graph.
    let tensors = m
        .tensors
        .iter()
        .map(|(k, t)| Ok((k.clone(), Var::from_tensor(t)?.as_tensor().clone())))
        .collect::<anyhow::Result<_>>()?;
    let model = CausalLm::from_tensors(&cfg, tensors, dtype, &Device::Cpu)?;
    let t0 = std::time::Instant::now();
    let base = HELD.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let (lps, _) = completion_logprobs(
        &model,
        &pr,
        &cr,
        2,
        1.0,
        Mode::Train,
        Entropy::Skip,
        Packing::SharedPrompt,
    )?;
    let loss = lps.sum_all()?;
    let (held, fwd_peak) = (
        HELD.load(Ordering::Relaxed) - base,
        PEAK.load(Ordering::Relaxed) - base,
    );
    PEAK.store(HELD.load(Ordering::Relaxed), Ordering::Relaxed);
    let grads = loss.backward()?;
    let bwd_peak = PEAK.load(Ordering::Relaxed) - base;
    let secs = t0.elapsed().as_secs_f64();
    drop(grads);
    let tokens = n.div_ceil(group) * lp + cr.iter().map(|c| c.len()).sum::<usize>();
    println!(
        "{tokens} tokens (a group's prompt once): held {:.1} MB ({:.0} KiB a token), forward peak \
         {:.1} MB, backward peak {:.1} MB, {secs:.2} s",
        mb(held),
        held as f64 / 1024.0 / tokens as f64,
        mb(fwd_peak),
        mb(bwd_peak)
    );
    Ok(())
}
