//! `grpo bench ...`: throughput measurements printed as JSON lines, comparable with the peer
//! scripts in `../shared/bench/peers/` (same prompts, same modes, same contention measure).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::{Args, Subcommand};
use grpo_models::sampler::{self, PromptInput, SamplingParams};

use crate::common::ModelArgs;
use crate::generate::{encode_prompt, read_prompts_jsonl, PromptSpec};

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Sampling throughput: P prompts x G samples x N new tokens.
    Generate(GenBenchArgs),
    /// f32 matrix-multiply FLOP/s of this machine (the ceiling for generation throughput).
    Gemm(GemmArgs),
    /// Device-synchronized times of a training pass's pieces (projections, norm, RoPE,
    /// attention, SwiGLU, LM-head log-probs), forward and forward + backward.
    Ops(crate::bench_ops::OpsArgs),
}

#[derive(Args, Debug)]
pub struct GenBenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// JSONL prompts ("prompt" fields), e.g. from `addition_task.py N SEED`; rendered as chat.
    #[arg(long)]
    pub prompts: PathBuf,
    /// Comma-separated PxG shapes to measure, e.g. "1x1,8x8".
    #[arg(long, default_value = "1x1,8x8")]
    pub shapes: String,
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// "fixed" suppresses EOS so exactly P*G*N tokens are generated; "natural" stops at EOS.
    #[arg(long, default_value = "fixed,natural")]
    pub modes: String,
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Before each timed rep, wait (at most 60 s) until other processes use less than this share
    /// of the CPUs.
    #[arg(long, default_value_t = 0.05)]
    pub quiet_threshold: f64,
    /// Keep candle's GEMM for the projections (do not pack weights for the decoding kernel),
    /// to compare the two.
    #[arg(long)]
    pub no_pack: bool,
}

#[derive(Args, Debug)]
pub struct GemmArgs {
    /// Square matrix size.
    #[arg(long, default_value_t = 1024)]
    pub size: usize,
    /// Rows of the skinny product (decode-like: batch x hidden times hidden x out).
    #[arg(long, default_value_t = 64)]
    pub rows: usize,
    #[arg(long, default_value_t = 10)]
    pub reps: usize,
    #[arg(long)]
    pub threads: Option<usize>,
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Generate(a) => bench_generate(a),
        BenchCommand::Gemm(a) => bench_gemm(a),
        BenchCommand::Ops(a) => crate::bench_ops::bench_ops(a),
    }
}

/// CPU use of other processes during a region, as a share of the machine (like cpuwatch.py).
struct Region {
    t0: Instant,
    machine0: u64,
    self0: u64,
}

fn machine_busy() -> Result<u64> {
    let s = read_proc("/proc/stat")?;
    let v: Vec<u64> = s
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    if v.len() < 8 {
        return Ok(0);
    }
    Ok(v[0] + v[1] + v[2] + v[5] + v[6] + v[7])
}

fn self_busy() -> Result<u64> {
    let s = read_proc("/proc/self/stat")?;
    let Some(i) = s.rfind(')') else { return Ok(0) };
    let f: Vec<&str> = s[i + 2..].split_whitespace().collect();
    let p = |k: usize| f.get(k).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    Ok(p(11) + p(12))
}

/// A `/proc` file; without it (not Linux) the foreign CPU share cannot be measured.
fn read_proc(path: &str) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| {
        format!(
            "reading {path}: `grpo bench` measures other processes' CPU use from /proc, so it \
             runs on Linux only"
        )
    })
}

const HZ: f64 = 100.0;

impl Region {
    fn start() -> Result<Self> {
        Ok(Self {
            t0: Instant::now(),
            machine0: machine_busy()?,
            self0: self_busy()?,
        })
    }
    /// (wall seconds, foreign CPU share)
    fn stop(&self) -> Result<(f64, f64)> {
        let wall = self.t0.elapsed().as_secs_f64();
        let m = machine_busy()?.saturating_sub(self.machine0) as f64;
        let s = self_busy()?.saturating_sub(self.self0) as f64;
        let ncpu = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1) as f64;
        Ok((wall, ((m - s) / HZ / wall.max(1e-9) / ncpu).max(0.0)))
    }
}

fn wait_quiet(threshold: f64, max_wait_s: f64) -> Result<()> {
    let t0 = Instant::now();
    while t0.elapsed().as_secs_f64() < max_wait_s {
        let r = Region::start()?;
        std::thread::sleep(std::time::Duration::from_millis(1000));
        if r.stop()?.1 < threshold {
            return Ok(());
        }
    }
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn bench_generate(a: GenBenchArgs) -> Result<()> {
    let specs = read_prompts_jsonl(&a.prompts)?;
    let loaded = a.model.load()?;
    let tok = loaded.tokenizer()?;
    let mut model = loaded.build()?;
    if !a.no_pack {
        model.pack_for_decoding()?;
    }
    let threads = std::env::var("RAYON_NUM_THREADS").ok();
    for shape in a.shapes.split(',') {
        let Some((p, g)) = shape.split_once('x') else {
            bail!("--shapes: `{shape}` is not PxG");
        };
        let (p, g): (usize, usize) = (p.trim().parse()?, g.trim().parse()?);
        if p > specs.len() {
            bail!(
                "--shapes {shape}: only {} prompts in {}",
                specs.len(),
                a.prompts.display()
            );
        }
        let inputs: Vec<PromptInput> = specs[..p]
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let s = match s {
                    PromptSpec::Text(t) => PromptSpec::Text(t.clone()),
                    PromptSpec::Messages(m) => PromptSpec::Messages(m.clone()),
                };
                Ok(PromptInput {
                    ids: encode_prompt(tok, &s, true, None)?,
                    seed: grpo_models::seeding::mix_seed(a.seed, i as u64),
                })
            })
            .collect::<Result<_>>()?;
        for mode in a.modes.split(',') {
            let fixed = match mode {
                "fixed" => true,
                "natural" => false,
                other => bail!("--modes: unknown mode `{other}` (fixed, natural)"),
            };
            let params = SamplingParams {
                max_new_tokens: a.max_new_tokens,
                min_new_tokens: if fixed { a.max_new_tokens } else { 0 },
                temperature: 1.0,
                eos_token_ids: loaded.eos_token_ids.clone(),
                ..Default::default()
            };
            // Warm-up (short).
            let warm = SamplingParams {
                max_new_tokens: 4,
                min_new_tokens: 0,
                ..params.clone()
            };
            sampler::generate(&model, Some(tok), &inputs, g, &warm)?;
            let (mut tps, mut secs, mut foreign, mut tokens) = (vec![], vec![], vec![], vec![]);
            let mut last_stats = None;
            for r in 0..a.reps {
                wait_quiet(a.quiet_threshold, 60.0)?;
                let inputs_r: Vec<PromptInput> = inputs
                    .iter()
                    .map(|x| PromptInput {
                        ids: x.ids.clone(),
                        seed: grpo_models::seeding::mix_seed(x.seed, r as u64),
                    })
                    .collect();
                let region = Region::start()?;
                let (_out, stats) = sampler::generate(&model, Some(tok), &inputs_r, g, &params)?;
                let (wall, f) = region.stop()?;
                tps.push(stats.generated_tokens as f64 / wall);
                secs.push((wall * 1000.0).round() / 1000.0);
                foreign.push((f * 1000.0).round() / 1000.0);
                tokens.push(stats.generated_tokens);
                last_stats = Some(stats);
            }
            let best = tps.iter().cloned().fold(0.0, f64::max);
            let line = serde_json::json!({
                "bench": "grpo_generate",
                "isa": grpo_models::kernels::Isa::active().name(),
                "prompts": p,
                "samples_per_prompt": g,
                "batch": p * g,
                "mode": mode,
                "max_new_tokens": a.max_new_tokens,
                "reps": a.reps,
                "seconds": secs,
                "foreign_cpu": foreign,
                "generated_tokens": tokens,
                "tokens_per_s": (median(&mut tps.clone()) * 10.0).round() / 10.0,
                "tokens_per_s_best": (best * 10.0).round() / 10.0,
                "last_rep": last_stats,
                "threads": threads,
                "dtype": a.model.dtype,
            });
            println!("{line}");
        }
    }
    Ok(())
}

fn bench_gemm(a: GemmArgs) -> Result<()> {
    use grpo_models::kernels::cpu::gemm_bf16;
    if let Some(n) = a.threads {
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
        let _ = grpo_models::threads::set_global_threads(n);
    }
    let dev = Device::Cpu;
    let n = a.size;
    let shapes = [(n, n, n), (a.rows, 576, 1536), (a.rows, 576, 49152)];
    for (m, k, nn) in shapes {
        let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
        let w = Tensor::randn(0f32, 1.0, (nn, k), &dev)?; // [out, in] like a weight
        let _ = x.matmul(&w.t()?)?;
        let mut best = f64::INFINITY;
        let t_all = Instant::now();
        for _ in 0..a.reps {
            let t0 = Instant::now();
            let y = x.matmul(&w.t()?)?;
            let _ = y.to_dtype(DType::F32)?;
            best = best.min(t0.elapsed().as_secs_f64());
        }
        let gflops = 2.0 * (m * k * nn) as f64 / best / 1e9;
        // The same product with the weight stored transposed ([in, out], row-major).
        let wt = w.t()?.contiguous()?;
        let mut best_t = f64::INFINITY;
        for _ in 0..a.reps {
            let t0 = Instant::now();
            let _y = x.matmul(&wt)?;
            best_t = best_t.min(t0.elapsed().as_secs_f64());
        }
        let gflops_t = 2.0 * (m * k * nn) as f64 / best_t / 1e9;
        // CPU mixed precision's product (`dtype = "bf16"`): inputs rounded to bf16 and packed at
        // each call, f32 sums.
        let (xs, ws) = (
            x.flatten_all()?.to_vec1::<f32>()?,
            w.flatten_all()?.to_vec1::<f32>()?,
        );
        let mut y = vec![0f32; m * nn];
        let mut best_b = f64::INFINITY;
        for _ in 0..a.reps {
            let t0 = Instant::now();
            let av = gemm_bf16::Strided {
                ptr: xs.as_ptr(),
                rs: k as isize,
                cs: 1,
            };
            let bv = gemm_bf16::Strided {
                ptr: ws.as_ptr(),
                rs: 1,
                cs: k as isize,
            };
            // SAFETY: x is [m, k], w is [nn, k] read as its transpose, y is [m, nn]; all owned here.
            unsafe { gemm_bf16::gemm(m, nn, k, y.as_mut_ptr(), nn as isize, 1, false, av, bv) };
            best_b = best_b.min(t0.elapsed().as_secs_f64());
        }
        let gflops_b = 2.0 * (m * k * nn) as f64 / best_b / 1e9;
        let line = serde_json::json!({
            "bench": "gemm_f32",
            "isa": grpo_models::kernels::Isa::active().name(),
            "m": m, "k": k, "n": nn,
            "best_s": best,
            "gflops": (gflops * 10.0).round() / 10.0,
            "gflops_weight_in_out": (gflops_t * 10.0).round() / 10.0,
            "gflops_bf16": (gflops_b * 10.0).round() / 10.0,
            "total_s": t_all.elapsed().as_secs_f64(),
        });
        println!("{line}");
    }
    // A weight's gradient as training computes it: dW [out, in] = dY^T X, dY [rows, out] and X
    // [rows, in] row-major (dY read transposed), f32 (the `gemm` crate) and bf16.
    let (rows, o, i) = (a.rows, 1536, 576);
    let gy: Vec<f32> = Tensor::randn(0f32, 1.0, (rows, o), &dev)?
        .flatten_all()?
        .to_vec1()?;
    let xv: Vec<f32> = Tensor::randn(0f32, 1.0, (rows, i), &dev)?
        .flatten_all()?
        .to_vec1()?;
    let gyt = Tensor::from_slice(&gy, (rows, o), &dev)?;
    let xt = Tensor::from_slice(&xv, (rows, i), &dev)?;
    let mut dw = vec![0f32; o * i];
    let (mut best_f, mut best_b) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..a.reps {
        let t0 = Instant::now();
        // candle's matmul of the transposed view: the `gemm` crate with dY's strides.
        let _dw32 = gyt.t()?.matmul(&xt)?;
        best_f = best_f.min(t0.elapsed().as_secs_f64());
        let t0 = Instant::now();
        let av = gemm_bf16::Strided {
            ptr: gy.as_ptr(),
            rs: 1,
            cs: o as isize,
        };
        let bv = gemm_bf16::Strided {
            ptr: xv.as_ptr(),
            rs: i as isize,
            cs: 1,
        };
        // SAFETY: dw is [o, i], gy [rows, o] read as its transpose, xv [rows, i]; all owned here.
        unsafe { gemm_bf16::gemm(o, i, rows, dw.as_mut_ptr(), i as isize, 1, false, av, bv) };
        best_b = best_b.min(t0.elapsed().as_secs_f64());
    }
    let flops = 2.0 * (rows * o * i) as f64 / 1e9;
    let line = serde_json::json!({
        "bench": "gemm_weight_grad",
        "isa": grpo_models::kernels::Isa::active().name(),
        "rows": rows, "out": o, "in": i,
        "gflops": (flops / best_f * 10.0).round() / 10.0,
        "gflops_bf16": (flops / best_b * 10.0).round() / 10.0,
    });
    println!("{line}");
    Ok(())
}
