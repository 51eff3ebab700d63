//! `grpo bench ops`: device-synchronized times of the training pass's pieces (one decoder
//! layer's projections, norm, RoPE, attention, SwiGLU, and the LM head's log-probs), forward
//! alone and forward + backward (a random gradient fed in at the piece's output, as the layer
//! above would send it), at a batch's shape: where a GPU's step goes, piece by piece,
//! on the same code the trainer runs (grpo's GPU kernels where they apply; `GRPO_GPU_KERNELS=off`
//! for candle ops only). One JSON line per piece.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor, Var};
use clap::Args;
use grpo_models::kernels::grad_sink::{GradSink, SinkProj};
use grpo_models::kernels::Compute;
use grpo_models::kernels::{self, mask::build_mask, Mode};
use grpo_models::models::layers::{AttnMask, RmsNorm};

#[derive(Args, Debug)]
pub struct OpsArgs {
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Activations' dtype: `bf16` (weights f32, cast in the graph, as `dtype = "bf16"` trains)
    /// or `f32`.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Model shape: `135m` or `1.7b` (SmolLM2's).
    #[arg(long, default_value = "1.7b")]
    pub shape: String,
    /// Rows x tokens per row of the pass (the GPU kit's 16x8x256 batch: 128 rows of ~306, in
    /// passes of ~46 rows for the 1.7B model).
    #[arg(long, default_value_t = 46)]
    pub rows: usize,
    #[arg(long, default_value_t = 304)]
    pub seq: usize,
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Rows of the decoding step's layer (`decode_layer`: one token per row over a KV cache of
    /// `seq` slots; the kit's 16 x 8 batch decodes 128 rows).
    #[arg(long, default_value_t = 128)]
    pub decode_rows: usize,
    /// Keep freed GPU memory in CUDA's pool (release threshold = max) instead of handing it back
    /// at every synchronization.
    #[arg(long)]
    pub keep_pool: bool,
}

struct Shape {
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    inter: usize,
    vocab: usize,
    layers: usize,
}

fn shape(name: &str) -> Result<Shape> {
    Ok(match name {
        "135m" => Shape {
            hidden: 576,
            heads: 9,
            kv_heads: 3,
            inter: 1536,
            vocab: 49152,
            layers: 30,
        },
        "1.7b" => Shape {
            hidden: 2048,
            heads: 32,
            kv_heads: 32,
            inter: 8192,
            vocab: 49152,
            layers: 24,
        },
        other => bail!("--shape: unknown `{other}` (135m, 1.7b)"),
    })
}

/// Median seconds of `f` over `reps` runs after one warm-up, the device synchronized around each.
fn time(dev: &Device, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    dev.synchronize()?;
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        dev.synchronize()?;
        let t0 = Instant::now();
        f()?;
        dev.synchronize()?;
        t.push(t0.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// A trainable f32 weight [out, in] and its product with `x` in `x`'s dtype (mixed precision).
fn project(x: &Tensor, w: &Var) -> candle_core::Result<Tensor> {
    x.matmul(&w.as_tensor().to_dtype(x.dtype())?.t()?)
}

/// `w` cast to `dt` as a projection through a GPU gradient sink, or `None` where the sink does
/// not apply (off [`Compute::Gpu`]: the CPU, `GRPO_GPU_KERNELS=off`).
fn sink_proj(w: &Var, dt: DType, compute: Compute) -> candle_core::Result<Option<SinkProj>> {
    if !compute.on_gpu() {
        return Ok(None);
    }
    let cast = w.as_tensor().to_dtype(dt)?;
    let sink = GradSink::on_gpu(&[(w, &cast)]);
    SinkProj::new(&sink, &[(&cast, &cast)])
}

/// A fixed gradient for a recorded result, whatever reaches it: what a layer above would send.
struct GivenGrad(Tensor);

impl grpo_models::kernels::portable::recompute::Backward for GivenGrad {
    fn name(&self) -> &'static str {
        "given-gradient"
    }

    fn backward(
        &self,
        _inputs: &[Tensor],
        _wanted: &[bool],
        _out: &Tensor,
        _grad: &Tensor,
    ) -> candle_core::Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(self.0.clone())])
    }
}

/// Random gradients, one per shape and dtype, made once (outside the timed runs).
#[derive(Default)]
struct Grads(RefCell<HashMap<(Vec<usize>, DType), Tensor>>);

impl Grads {
    /// Backpropagates a random contiguous gradient of `y`'s shape into `y`'s graph (gradients
    /// dropped), as the layer above would: not the gradient of a sum of `y`, whose reduction and
    /// broadcast would be timed with the piece.
    fn backward(&self, y: &Tensor) -> candle_core::Result<()> {
        let key = (y.dims().to_vec(), y.dtype());
        let g = match self.0.borrow().get(&key) {
            Some(g) => g.clone(),
            None => Tensor::randn(0f32, 1.0, y.shape(), y.device())?.to_dtype(y.dtype())?,
        };
        self.0.borrow_mut().insert(key, g.clone());
        // A one-number node whose backward hands `g` to `y`: no reduction over `y` is timed
        // (candle's sum of a whole tensor runs on one block, ~0.1 ns an element on an H200).
        let one = Tensor::zeros(1, DType::F32, y.device())?;
        let fed =
            grpo_models::kernels::portable::recompute::attach(&one, &[y], Arc::new(GivenGrad(g)))?;
        fed.backward().map(|_| ())
    }
}

pub fn bench_ops(a: OpsArgs) -> Result<()> {
    let dev = match a.device.as_str() {
        "cpu" => Device::Cpu,
        "cuda" => Device::new_cuda(0)?,
        d => match d.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            Some(n) => Device::new_cuda(n)?,
            None => bail!("--device: `{d}` is not cpu, cuda or cuda:N"),
        },
    };
    if a.keep_pool {
        grpo_models::kernels::keep_device_pool(&dev)?;
    }
    grpo_models::kernels::untracked_device(&dev);
    let dt = match a.dtype.as_str() {
        "bf16" => DType::BF16,
        "f32" => DType::F32,
        other => bail!("--dtype: `{other}` is not bf16 or f32"),
    };
    let s = shape(&a.shape)?;
    let (b, t) = (a.rows, a.seq);
    let n = b * t;
    let hd = s.hidden / s.heads;
    let compute = Compute::resolve(&dev, dt);
    let w = |o: usize, i: usize| -> Result<Var> {
        Ok(Var::from_tensor(
            &(Tensor::randn(0f32, 1.0, (o, i), &dev)? * (1.0 / (i as f64).sqrt()))?,
        )?)
    };
    let qkv_out = (s.heads + 2 * s.kv_heads) * hd;
    let (w_qkv, w_o) = (w(qkv_out, s.hidden)?, w(s.hidden, s.heads * hd)?);
    let (w_gu, w_down) = (w(2 * s.inter, s.hidden)?, w(s.hidden, s.inter)?);
    let norm_w = Var::from_tensor(&Tensor::ones(s.hidden, DType::F32, &dev)?)?;
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (b, t, s.hidden), &dev)?.to_dtype(dt)?)?;
    let pos: Vec<f32> = (0..b * t).map(|i| (i % t) as f32).collect();
    let pos = Tensor::from_vec(pos, (b, t, 1), &dev)?;
    let inv: Vec<f32> = (0..hd / 2)
        .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / hd as f32))
        .collect();
    let ang = pos.broadcast_mul(&Tensor::from_vec(inv, (1, 1, hd / 2), &dev)?)?; // [B, T, D/2]
    let (cos, sin) = (ang.cos()?.to_dtype(dt)?, ang.sin()?.to_dtype(dt)?);
    let valid = vec![vec![true; t]; b];
    let mask_dense = build_mask(&valid, 0, t, t, &dev)?; // [B, 1, T, T]
    let mask = AttnMask::dense(mask_dense.clone())?;
    let qkv_in = |g: bool| -> Result<(Tensor, Tensor, Tensor)> {
        let mk = |h: usize| -> Result<Tensor> {
            let r = Tensor::randn(0f32, 1.0, (b, h, t, hd), &dev)?.to_dtype(dt)?;
            Ok(match g {
                true => Var::from_tensor(&r)?.as_tensor().clone(),
                false => r,
            })
        };
        Ok((mk(s.heads)?, mk(s.kv_heads)?, mk(s.kv_heads)?))
    };
    let flat = |x: &Tensor| x.reshape((n, x.dim(2).unwrap_or(1)));
    let report = |name: &str, fwd: f64, both: f64, flops: f64| {
        let line = serde_json::json!({
            "bench": "ops", "device": a.device, "dtype": a.dtype, "shape": a.shape,
            "rows": b, "seq": t, "keep_pool": a.keep_pool, "op": name,
            "fwd_ms": (fwd * 1e5).round() / 100.0,
            "fwd_bwd_ms": (both * 1e5).round() / 100.0,
            "fwd_tflops": match flops > 0.0 { true => ((flops / fwd / 1e12) * 10.0).round() / 10.0, false => 0.0 },
            "per_model_pass_s": ((both * s.layers as f64) * 1000.0).round() / 1000.0,
        });
        println!("{line}");
    };
    let reps = a.reps;
    let grads = Grads::default();
    let backward = |y: &Tensor| grads.backward(y);
    let xt = x.as_tensor().detach();
    // Projections (x [N, in] x W^T), the weight cast from f32 in the graph.
    for (name, wv, inp) in [
        ("qkv_proj", &w_qkv, s.hidden),
        ("o_proj", &w_o, s.heads * hd),
        ("gate_up_proj", &w_gu, s.hidden),
        ("down_proj", &w_down, s.inter),
    ] {
        let xin = Var::from_tensor(&Tensor::randn(0f32, 1.0, (n, inp), &dev)?.to_dtype(dt)?)?;
        let out = wv.as_tensor().dim(0)?;
        let f = time(&dev, reps, || {
            Ok(project(&xin.as_tensor().detach(), wv).map(|_| ())?)
        })?;
        let fb = time(&dev, reps, || Ok(backward(&project(xin.as_tensor(), wv)?)?))?;
        report(name, f, fb, 2.0 * (n * inp * out) as f64);
        // The same projection through the GPU gradient sink, where it applies (what the update
        // runs on a GPU): the weight's gradient added into an f32 accumulator by cuBLAS.
        if let Some(p) = sink_proj(wv, dt, compute)? {
            let f = time(&dev, reps, || {
                Ok(p.forward(&xin.as_tensor().detach()).map(|_| ())?)
            })?;
            let fb = time(&dev, reps, || Ok(backward(&p.forward(xin.as_tensor())?)?))?;
            report(&format!("{name}_sink"), f, fb, 2.0 * (n * inp * out) as f64);
        }
    }
    // The gate/up projection's three GEMMs alone, by cuBLAS layout (row-major names: `tn` is
    // x W^T, the forward's; `nn` is dY W, the input's gradient; `nt` is dY^T X, the weight's),
    // and the backward's two as `tn` over transposed copies: whether a layout is what is slow.
    if kernels::device_kind(&dev) == kernels::DeviceKind::Gpu {
        let (o, k) = (2 * s.inter, s.hidden);
        let r = |a: usize, b: usize| Tensor::randn(0f32, 1.0, (a, b), &dev)?.to_dtype(dt);
        let (xa, wa, dy) = (r(n, k)?, r(o, k)?, r(n, o)?);
        let (wt, dyt, xt) = (
            wa.t()?.contiguous()?,
            dy.t()?.contiguous()?,
            xa.t()?.contiguous()?,
        );
        let flops = 2.0 * (n * o * k) as f64;
        let cases: [(&str, &Tensor, Tensor); 5] = [
            ("gemm_tn", &xa, wa.t()?),
            ("gemm_nn", &dy, wa.clone()),
            ("gemm_nt", &dyt, xa.clone()),
            ("gemm_nn_as_tn", &dy, wt.t()?),
            ("gemm_nt_as_tn", &dyt, xt.t()?),
        ];
        for (name, lhs, rhs) in cases {
            let lhs = match name {
                "gemm_nt" => dy.t()?,
                _ => lhs.clone(),
            };
            let f = time(&dev, reps, || Ok(lhs.matmul(&rhs).map(|_| ())?))?;
            report(name, f, f, flops);
        }
        // The weight gradient into an f32 accumulator both ways, and what candle's autograd
        // does around a gradient of these sizes (zero-fill + add, a cast, a transposed copy).
        #[cfg(feature = "cuda")]
        if dt == DType::BF16 {
            use grpo_models::kernels::grad_sink::{add_weight_gradient, DwVia};
            let acc = Tensor::zeros((o, k), DType::F32, &dev)?;
            for (name, via) in [
                ("dw_f32_gemm", DwVia::F32Gemm),
                ("dw_bf16_add", DwVia::Bf16Add),
            ] {
                let f = time(&dev, reps, || {
                    Ok(add_weight_gradient(&acc, &dy, 0, o, &xa, via)?)
                })?;
                report(name, f, f, flops);
            }
        }
        let elementwise: [(&str, &dyn Fn() -> candle_core::Result<Tensor>); 4] = [
            ("zeros_like_dy", &|| dy.zeros_like()),
            ("add_dy_dy", &|| &dy + &dy),
            ("w_to_f32", &|| wa.to_dtype(DType::F32)),
            ("w_transposed_copy", &|| wa.t()?.contiguous()),
        ];
        for (name, f) in elementwise {
            let t = time(&dev, reps, || Ok(f().map(|_| ())?))?;
            report(name, t, t, 0.0);
        }
    }
    let sinks = [&w_qkv, &w_o, &w_gu, &w_down]
        .into_iter()
        .map(|w| sink_proj(w, dt, compute))
        .collect::<candle_core::Result<Option<Vec<SinkProj>>>>()?;
    let cast = time(&dev, reps, || {
        for wv in [&w_qkv, &w_o, &w_gu, &w_down] {
            wv.as_tensor().to_dtype(dt)?;
        }
        Ok(())
    })?;
    report("cast_layer_weights", cast, cast, 0.0);
    // RMSNorm: Infer (candle's fused kernel) and Train (recorded, backward written out).
    let nf = time(&dev, reps, || {
        Ok(
            RmsNorm::new(norm_w.as_tensor().to_dtype(dt)?, 1e-5, compute)
                .forward(&xt, Mode::Infer)
                .map(|_| ())?,
        )
    })?;
    let nb = time(&dev, reps, || {
        let y = RmsNorm::new(norm_w.as_tensor().to_dtype(dt)?, 1e-5, compute)
            .forward(x.as_tensor(), Mode::Train)?;
        Ok(backward(&y)?)
    })?;
    report("rms_norm", nf, nb, 0.0);
    // RoPE of q over [B, T, H*D] -> [B, H, T, D].
    let qflat =
        Var::from_tensor(&Tensor::randn(0f32, 1.0, (b, t, s.heads * hd), &dev)?.to_dtype(dt)?)?;
    let rf = time(&dev, reps, || {
        Ok(kernels::rope::rope_heads(
            &qflat.as_tensor().detach(),
            &cos,
            &sin,
            s.heads,
            Mode::Infer,
            compute,
        )
        .map(|_| ())?)
    })?;
    let rb = time(&dev, reps, || {
        Ok(backward(&kernels::rope::rope_heads(
            qflat.as_tensor(),
            &cos,
            &sin,
            s.heads,
            Mode::Train,
            compute,
        )?)?)
    })?;
    report("rope_q", rf, rb, 0.0);
    // Attention (causal, the portable path's chunked attention).
    let (q0, k0, v0) = qkv_in(false)?;
    let af = time(&dev, reps, || {
        Ok(
            kernels::attention::attention(&q0, &k0, &v0, &mask, Mode::Infer, compute)
                .map(|_| ())?,
        )
    })?;
    let (q1, k1, v1) = qkv_in(true)?;
    let ab = time(&dev, reps, || {
        Ok(backward(&kernels::attention::attention(
            &q1,
            &k1,
            &v1,
            &mask,
            Mode::Train,
            compute,
        )?)?)
    })?;
    let att_flops = 4.0 * (b * s.heads * t * t * hd) as f64 / 2.0;
    report("attention", af, ab, att_flops);
    // Both GPU attention kernel sets, whatever GRPO_GPU_ATTENTION chose (the tensor-core set in
    // bf16 only): forward + backward, recorded.
    #[cfg(feature = "cuda")]
    if compute.on_gpu() {
        use grpo_models::kernels::cuda::{attention_cuda_cores, attention_tensor_cores};
        let scale = 1.0 / (hd as f64).sqrt();
        type Set =
            fn(&Tensor, &Tensor, &Tensor, &Tensor, f64) -> candle_core::Result<Option<Tensor>>;
        let sets: [(&str, Set); 2] = [
            ("attention_cores", attention_cuda_cores),
            ("attention_tensor", attention_tensor_cores),
        ];
        for (name, set) in sets {
            if set(&q1, &k1, &v1, &mask_dense, scale)?.is_none() {
                continue; // f32 (the tensor-core set is bf16 only), or an older card
            }
            let f = time(&dev, reps, || {
                set(&q0, &k0, &v0, &mask_dense, scale)?;
                Ok(())
            })?;
            let fb = time(&dev, reps, || {
                if let Some(o) = set(&q1, &k1, &v1, &mask_dense, scale)? {
                    backward(&o)?;
                }
                Ok(())
            })?;
            report(name, f, fb, att_flops);
        }
    }
    // A decoding step's attention: one query per row over views of a KV cache of seq + 64 slots
    // (grpo's decoding kernel on a GPU, else candle ops).
    let slots = t + 64;
    let cache = |h: usize| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 1.0, (b, h, slots, hd), &dev)?
            .to_dtype(dt)?
            .narrow(2, 0, t)?)
    };
    let (kc, vc) = (cache(s.kv_heads)?, cache(s.kv_heads)?);
    let q_one = Tensor::randn(0f32, 1.0, (b, s.heads, 1, hd), &dev)?.to_dtype(dt)?;
    let one_dense = Tensor::zeros((b, 1, 1, t), DType::F32, &dev)?;
    let one_mask = AttnMask::Dense(one_dense.clone());
    let df = time(&dev, reps, || {
        Ok(
            kernels::attention::attention(&q_one, &kc, &vc, &one_mask, Mode::Infer, compute)
                .map(|_| ())?,
        )
    })?;
    report(
        "decode_attention",
        df,
        df,
        4.0 * (b * s.heads * t * hd) as f64,
    );
    // Both decoding kernels, whatever GRPO_GPU_DECODE chose (scripts/gpu_call.sh picks the
    // fastest of these and the candle ops).
    #[cfg(feature = "cuda")]
    if compute.on_gpu() {
        use grpo_models::kernels::cuda::{decode_attention_with, DecodeKernel};
        let scale = 1.0 / (hd as f64).sqrt();
        // A shared prompt as the kit's: groups of 8 rows, a sixth of the slots (48 of 304).
        let leader: Vec<u32> = (0..b as u32).map(|r| r / 8 * 8).collect();
        let leader = Tensor::from_vec(leader, b, &dev)?;
        for (name, kernel, shared) in [
            ("decode_attention_block", DecodeKernel::Block, None),
            ("decode_attention_warp", DecodeKernel::Warp, None),
            (
                "decode_attention_block_shared",
                DecodeKernel::Block,
                Some((&leader, t / 6)),
            ),
            (
                "decode_attention_warp_shared",
                DecodeKernel::Warp,
                Some((&leader, t / 6)),
            ),
        ] {
            let f = time(&dev, reps, || {
                decode_attention_with(&q_one, &kc, &vc, &one_dense, scale, kernel, shared)?;
                Ok(())
            })?;
            report(name, f, f, 4.0 * (b * s.heads * t * hd) as f64);
        }
    }
    // SwiGLU on the joined gate/up output.
    let gu = Var::from_tensor(&Tensor::randn(0f32, 1.0, (n, 2 * s.inter), &dev)?.to_dtype(dt)?)?;
    let swiglu = |g: &Tensor| -> candle_core::Result<Tensor> {
        #[cfg(feature = "cuda")]
        if compute.on_gpu() && grpo_models::kernels::cuda::takes(g) {
            return grpo_models::kernels::cuda::swiglu(g);
        }
        let gate = g.narrow(1, 0, s.inter)?;
        let up = g.narrow(1, s.inter, s.inter)?;
        gate.silu()? * up
    };
    let sf = time(&dev, reps, || {
        Ok(swiglu(&gu.as_tensor().detach()).map(|_| ())?)
    })?;
    let sb = time(&dev, reps, || Ok(backward(&swiglu(gu.as_tensor())?)?))?;
    report("swiglu", sf, sb, 0.0);
    // One Llama layer from these pieces (Train mode: what the update's recompute runs).
    // The q, k and v projections through sinks of their own (rows of the joined weight).
    let split_qkv = match &sinks {
        Some(_) => [s.heads, s.kv_heads, s.kv_heads]
            .into_iter()
            .map(|heads| Ok(sink_proj(&w(heads * hd, s.hidden)?, dt, compute)?))
            .collect::<Result<Option<Vec<SinkProj>>>>()?,
        None => None,
    };
    // A projection by weight `i` (qkv, o, gate/up, down), through its sink when `sunk`.
    let pj = |x: &Tensor, i: usize, sunk: bool| -> Result<Tensor> {
        match (&sinks, sunk) {
            (Some(s), true) => Ok(s[i].forward(x)?),
            _ => Ok(project(x, [&w_qkv, &w_o, &w_gu, &w_down][i])?),
        }
    };
    let layer = |x: &Tensor, mode: Mode, attend: bool, sunk: bool| -> Result<Tensor> {
        let nw = norm_w.as_tensor().to_dtype(dt)?;
        let norm = |h: &Tensor| -> Result<Tensor> {
            Ok(RmsNorm::new(nw.clone(), 1e-5, compute).forward(h, mode)?)
        };
        let h = norm(x)?;
        let (q, k, v) = match (&split_qkv, sunk) {
            // As training on a GPU runs it: q, k and v each their own projection.
            (Some(p), true) => {
                let f = |i: usize| -> Result<Tensor> {
                    let y = p[i].forward(&flat(&h)?)?;
                    let w = y.dim(1)?;
                    Ok(y.reshape((b, t, w))?)
                };
                (f(0)?, f(1)?, f(2)?)
            }
            _ => {
                let qkv = pj(&flat(&h)?, 0, sunk)?.reshape((b, t, qkv_out))?;
                (
                    qkv.narrow(2, 0, s.heads * hd)?,
                    qkv.narrow(2, s.heads * hd, s.kv_heads * hd)?,
                    qkv.narrow(2, (s.heads + s.kv_heads) * hd, s.kv_heads * hd)?,
                )
            }
        };
        let q = kernels::rope::rope_heads(&q, &cos, &sin, s.heads, mode, compute)?;
        let k = kernels::rope::rope_heads(&k, &cos, &sin, s.kv_heads, mode, compute)?;
        let v = v.reshape((b, t, s.kv_heads, hd))?.transpose(1, 2)?;
        let y = match attend {
            true => kernels::attention::attention(&q, &k, &v, &mask, mode, compute)?, // [B, T, H*D]
            // Everything but attention: the queries stand in for its output.
            false => q.transpose(1, 2)?.reshape((b, t, s.heads * hd))?,
        };
        let x = (x + pj(&flat(&y)?, 1, sunk)?.reshape((b, t, s.hidden))?)?;
        let h = norm(&x)?;
        #[cfg(feature = "cuda")]
        if let (Some(sk), true) = (&sinks, sunk) {
            // As training on a GPU runs it: the MLP block as one recorded op.
            let m = grpo_models::kernels::grad_sink::sink_mlp(&flat(&h)?, &sk[2], &sk[3])?;
            return Ok((x + m.reshape((b, t, s.hidden))?)?);
        }
        let g = pj(&flat(&h)?, 2, sunk)?;
        let m = pj(&swiglu(&g)?, 3, sunk)?.reshape((b, t, s.hidden))?;
        Ok((x + m)?)
    };
    let proj_flops = 2.0 * n as f64 * (s.hidden * (qkv_out + s.heads * hd + 3 * s.inter)) as f64;
    for (name, attend, sunk, flops) in [
        ("layer", true, false, proj_flops + att_flops),
        ("layer_without_attention", false, false, proj_flops),
        ("layer_sink", true, true, proj_flops + att_flops),
    ] {
        if sunk && sinks.is_none() {
            continue;
        }
        let lf = time(&dev, reps, || {
            layer(&xt, Mode::Infer, attend, sunk).map(|_| ())
        })?;
        let lb = time(&dev, reps, || {
            Ok(backward(&layer(x.as_tensor(), Mode::Train, attend, sunk)?)?)
        })?;
        report(name, lf, lb, flops);
    }
    // The whole layer as one recorded op (what training on a GPU runs where it applies).
    #[cfg(feature = "cuda")]
    if let Some(sk) = &sinks {
        let op = grpo_models::kernels::gpu_layer::GpuLayer {
            qkv: sk[0].clone(),
            o: sk[1].clone(),
            gate_up: sk[2].clone(),
            down: sk[3].clone(),
            heads: s.heads,
            kv_heads: s.kv_heads,
            head_dim: hd,
            scale: 1.0 / (hd as f64).sqrt(),
            eps_in: 1e-5,
            eps_post: 1e-5,
        };
        let run = |x: &Tensor| -> Result<Option<Tensor>> {
            let nw = norm_w.as_tensor().to_dtype(dt)?;
            Ok(op.forward(x, &nw, &nw, &cos, &sin, &mask_dense)?)
        };
        if run(&xt)?.is_some() {
            let lf = time(&dev, reps, || run(&xt).map(|_| ()))?;
            let lb = time(&dev, reps, || match run(x.as_tensor())? {
                Some(y) => Ok(backward(&y)?),
                None => bail!("the layer op stopped applying"),
            })?;
            report("layer_op", lf, lb, proj_flops + att_flops);
        }
    }
    decode_layer(&a, &s, &dev, dt, compute)?;
    // The LM head's log-probs over the whole vocabulary, recomputed in the backward.
    let head = Var::from_tensor(&(Tensor::randn(0f32, 1.0, (s.vocab, s.hidden), &dev)? * 0.02)?)?;
    let targets = Tensor::from_vec(
        (0..n as u32)
            .map(|i| i % s.vocab as u32)
            .collect::<Vec<_>>(),
        n,
        &dev,
    )?;
    let chunk = grpo_models::kernels::portable::chunked_attention::CHUNK_BYTES / (4 * s.vocab);
    let hf = time(&dev, reps, || {
        let h = flat(&xt)?;
        // A frozen head (as the reference's): no graph, so the forward-only kernel applies.
        let w = head.as_tensor().detach().to_dtype(dt)?;
        grpo::logprobs::token_logprobs(&h, &w, &targets, 1.0, chunk)?;
        Ok(())
    })?;
    let hb = time(&dev, reps, || {
        let h = flat(x.as_tensor())?;
        let (lp, _) = grpo::logprobs::token_logprobs_entropy_recomputed(
            &h,
            &head.as_tensor().to_dtype(dt)?,
            &targets,
            1.0,
            chunk,
            grpo::logprobs::Entropy::Detached,
        )?;
        Ok(backward(&lp)?)
    })?;
    let line = serde_json::json!({
        "bench": "ops", "device": a.device, "dtype": a.dtype, "shape": a.shape, "rows": b, "seq": t,
        "keep_pool": a.keep_pool, "op": "lm_head_logprobs",
        "fwd_ms": (hf * 1e5).round() / 100.0, "fwd_bwd_ms": (hb * 1e5).round() / 100.0,
        "fwd_tflops": ((2.0 * (n * s.hidden * s.vocab) as f64 / hf / 1e12) * 10.0).round() / 10.0,
    });
    println!("{line}");
    Ok(())
}

/// A decoding step's pass through the model's layers, as the sampler runs it (frozen weights in
/// the compute dtype, one token per row, the KV cache written and read in place): device-
/// synchronized ms for all `s.layers` layers (`fwd_ms`), the host's ms to issue them
/// (`host_ms`: near `fwd_ms` when the step waits on the host, not on the GPU), and the four
/// projections' GEMMs alone.
fn decode_layer(a: &OpsArgs, s: &Shape, dev: &Device, dt: DType, compute: Compute) -> Result<()> {
    let (rows, t) = (a.decode_rows, a.seq.max(2));
    let hd = s.hidden / s.heads;
    let qkv_out = (s.heads + 2 * s.kv_heads) * hd;
    // Weights as the sampler holds them: [in, out], contiguous, in the compute dtype.
    let wt = |i: usize, o: usize| -> Result<Tensor> {
        Ok((Tensor::randn(0f32, 1.0, (i, o), dev)? * (1.0 / (i as f64).sqrt()))?.to_dtype(dt)?)
    };
    let (w_qkv, w_o) = (wt(s.hidden, qkv_out)?, wt(s.heads * hd, s.hidden)?);
    let (w_gu, w_down) = (wt(s.hidden, 2 * s.inter)?, wt(s.inter, s.hidden)?);
    let nw = Tensor::ones(s.hidden, dt, dev)?;
    let cache = || -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 1.0, (rows, s.kv_heads, t + 64, hd), dev)?.to_dtype(dt)?)
    };
    let (kc, vc) = (cache()?, cache()?);
    let x1 = Tensor::randn(0f32, 1.0, (rows, 1, s.hidden), dev)?.to_dtype(dt)?;
    let ang = Tensor::randn(0f32, 1.0, (rows, 1, hd / 2), dev)?;
    let (cos, sin) = (ang.cos()?.to_dtype(dt)?, ang.sin()?.to_dtype(dt)?);
    let mask = AttnMask::Dense(Tensor::zeros((rows, 1, 1, t), DType::F32, dev)?);
    let norm = RmsNorm::new(nw, 1e-5, compute);
    let mm = |x: &Tensor, w: &Tensor| -> candle_core::Result<Tensor> {
        let (i, o) = w.dims2()?;
        x.reshape((rows, i))?.matmul(w)?.reshape((rows, 1, o))
    };
    let swiglu = |g: &Tensor| -> candle_core::Result<Tensor> {
        #[cfg(feature = "cuda")]
        if compute.on_gpu() && grpo_models::kernels::cuda::takes(g) {
            return grpo_models::kernels::cuda::swiglu(g);
        }
        g.narrow(2, 0, s.inter)?.silu()? * g.narrow(2, s.inter, s.inter)?
    };
    let layer = |x: &Tensor| -> Result<Tensor> {
        let h = norm.forward(x, Mode::Infer)?;
        let qkv = mm(&h, &w_qkv)?; // [R, 1, (H + 2 Hkv) D]
        let q = qkv.narrow(2, 0, s.heads * hd)?;
        let k = qkv.narrow(2, s.heads * hd, s.kv_heads * hd)?;
        let v = qkv.narrow(2, (s.heads + s.kv_heads) * hd, s.kv_heads * hd)?;
        let q = kernels::rope::rope_heads(&q, &cos, &sin, s.heads, Mode::Infer, compute)?;
        let k = kernels::rope::rope_heads(&k, &cos, &sin, s.kv_heads, Mode::Infer, compute)?;
        let v = v.reshape((rows, 1, s.kv_heads, hd))?.transpose(1, 2)?;
        kc.slice_set(&k.contiguous()?, 2, t - 1)?;
        vc.slice_set(&v.contiguous()?, 2, t - 1)?;
        let (kk, vv) = (kc.narrow(2, 0, t)?, vc.narrow(2, 0, t)?);
        let y = kernels::attention::attention(&q, &kk, &vv, &mask, Mode::Infer, compute)?; // [R, 1, H*D]
        let x = (x + mm(&y, &w_o)?)?;
        let h = norm.forward(&x, Mode::Infer)?;
        let m = mm(&swiglu(&mm(&h, &w_gu)?)?, &w_down)?;
        Ok((x + m)?)
    };
    let step = |gemms_only: bool| -> Result<(f64, f64)> {
        let mut host = Vec::new();
        let synced = time(dev, a.reps, || {
            let t0 = Instant::now();
            let mut x = x1.clone();
            for _ in 0..s.layers {
                x = match gemms_only {
                    true => {
                        let h = mm(&x, &w_qkv)?;
                        let y = mm(&h.narrow(2, 0, s.heads * hd)?, &w_o)?;
                        mm(&mm(&y, &w_gu)?.narrow(2, 0, s.inter)?, &w_down)?
                    }
                    false => layer(&x)?,
                };
            }
            host.push(t0.elapsed().as_secs_f64());
            Ok(())
        })?;
        host.sort_by(f64::total_cmp);
        Ok((synced, host[host.len() / 2]))
    };
    for (name, gemms_only) in [("decode_step_layers", false), ("decode_step_gemms", true)] {
        let (synced, host) = step(gemms_only)?;
        let line = serde_json::json!({
            "bench": "ops", "device": a.device, "dtype": a.dtype, "shape": a.shape,
            "rows": rows, "seq": t, "keep_pool": a.keep_pool, "op": name, "layers": s.layers,
            "fwd_ms": (synced * 1e5).round() / 100.0, "fwd_bwd_ms": (synced * 1e5).round() / 100.0,
            "host_ms": (host * 1e5).round() / 100.0,
        });
        println!("{line}");
    }
    Ok(())
}
