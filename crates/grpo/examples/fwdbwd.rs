//! Rough timing of the training forward+backward on SmolLM2 (not a benchmark of record).
//!   fwdbwd [ROWS [PROMPT_LEN [COMPLETION_LEN [GROUP]]]]; env: ITERS=n, SINK=1 (weight gradients
//!   through the gradient sink), ENTROPY=1 (detached entropies), INPOOL=1 (run on a rayon worker,
//!   as `grpo train` does), PER_ROW=1 (no shared prompts), SETOPT=1 (mimalloc never purges),
//!   DTYPE=bf16 (CPU mixed precision: bf16 products, f32 weights).
use std::time::Instant;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use candle_core::{DType, Device, Tensor, Var};
use grpo::logprobs::{completion_logprobs, Entropy, Packing};
use grpo_models::hub::ModelSource;
use grpo_models::models::{CausalLm, Mode};

fn main() -> anyhow::Result<()> {
    if std::env::var("INPOOL").is_ok() {
        return rayon::scope(|_| run());
    }
    run()
}

fn run() -> anyhow::Result<()> {
    if std::env::var("SETOPT").is_ok() {
        unsafe { libmimalloc_sys::mi_option_set(15, -1) };
    }
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, default: usize, what: &str| -> anyhow::Result<usize> {
        match args.get(i) {
            None => Ok(default),
            Some(s) => s.parse().map_err(|e| {
                anyhow::anyhow!("argument {i} ({what}): `{s}` is not a whole number ({e})")
            }),
        }
    };
    let n = arg(1, 32, "ROWS")?;
    let lp = arg(2, 46, "PROMPT_LEN")?;
    let lc = arg(3, 20, "COMPLETION_LEN")?;
    // Completions per prompt (rows sharing a prompt are packed) ; 1 = every row its own prompt.
    let group = arg(4, 1, "GROUP")?;
    let packing = if std::env::var("PER_ROW").is_ok() {
        Packing::PerRow
    } else {
        Packing::SharedPrompt
    };
    let dir = std::path::PathBuf::from("/opt/peers/smollm2-135m-instruct-f32");
    let m = grpo_models::weights::load_model(&ModelSource::HfDir(dir), DType::F32, &Device::Cpu)?;
    let vars = m
        .tensors
        .iter()
        .map(|(k, t)| Ok((k.clone(), Var::from_tensor(t)?)))
        .collect::<anyhow::Result<Vec<(String, Var)>>>()?;
    let prompts: Vec<Vec<u32>> = (0..n)
        .map(|i| i / group)
        .map(|i| {
            (0..lp)
                .map(|j| ((i * 7 + j * 13) % 4000 + 10) as u32)
                .collect()
        })
        .collect();
    let comps: Vec<Vec<u32>> = (0..n)
        .map(|i| {
            (0..lc)
                .map(|j| ((i * 11 + j * 3) % 4000 + 10) as u32)
                .collect()
        })
        .collect();
    let pr: Vec<&[u32]> = prompts.iter().map(|v| v.as_slice()).collect();
    let cr: Vec<&[u32]> = comps.iter().map(|v| v.as_slice()).collect();
    let iters: usize = std::env::var("ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    for it in 0..iters {
        let t0 = Instant::now();
        let tensors = vars
            .iter()
            .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
            .collect();
        let dtype = match std::env::var("DTYPE").as_deref() {
            Ok("bf16") => DType::BF16,
            _ => DType::F32,
        };
        let mut model = CausalLm::from_tensors(&m.config, tensors, dtype, &Device::Cpu)?;
        // SINK=1: projection weight gradients through the trainer's gradient sink.
        let list: Vec<Var> = vars.iter().map(|(_, v)| v.clone()).collect();
        let sink = grpo_models::kernels::grad_sink::GradSink::new(&list);
        if std::env::var("SINK").is_ok() {
            model.attach_grad_sink(&sink)?;
        }
        let t_build = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let ent = if std::env::var("ENTROPY").is_ok() {
            Entropy::Detached
        } else {
            Entropy::Skip
        };
        let (lps, _) = completion_logprobs(&model, &pr, &cr, 2, 1.0, Mode::Train, ent, packing)?;
        let loss = lps.sum_all()?;
        let _ = loss.to_scalar::<f32>()?;
        let t_fwd = t1.elapsed().as_secs_f64();
        let t2 = Instant::now();
        let g = loss.backward()?;
        let t_bwd = t2.elapsed().as_secs_f64();
        let t3 = Instant::now();
        let (lps, _) = completion_logprobs(
            &model,
            &pr,
            &cr,
            2,
            1.0,
            Mode::Infer,
            Entropy::Skip,
            packing,
        )?;
        let _ = lps.sum_all()?.to_scalar::<f32>()?;
        let t_inf = t3.elapsed().as_secs_f64();
        let mut ng = 0;
        for (_, v) in &vars {
            ng += (g.get(v).is_some() || sink.take(v)?.is_some()) as usize;
        }
        println!("it {it}: build {t_build:.2}s fwd {t_fwd:.2}s bwd {t_bwd:.2}s infer-fwd {t_inf:.2}s grads {ng}/{} tokens {}", vars.len(), n * (lp + lc));
        drop(g);
        let _ = Tensor::zeros(1, DType::F32, &Device::Cpu)?;
    }
    Ok(())
}
