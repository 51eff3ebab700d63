//! grpo's GPU kernels against candle ops, with their gradients; AdamW's kernel and the
//! clipping norm against the CPU's step.

use super::*;

/// grpo's GPU kernels (attention forward and backward, on CUDA cores and, in bf16, on tensor
/// cores; RMSNorm, RoPE, SwiGLU) against the same computation in candle ops on the same GPU:
/// grouped heads, left padding, head sizes 64 and 128, several query and key tiles, f32 and bf16.
#[test]
fn gpu_kernels_equal_candle_ops_with_their_gradients() {
    use candle_core::Tensor;
    use grpo_models::kernels::cuda as fused_gpu;
    use grpo_models::kernels::portable::chunked_attention;
    use grpo_models::kernels::Compute;
    let dev = gpu();
    let rel = |a: &Tensor, e: &Tensor| -> f32 { diff::max_diff(a, e) / diff::max_abs(e).max(1.0) };
    for (dt, tol) in [(DType::F32, 1e-4f32), (DType::BF16, 3e-2)] {
        for &(b, h, hkv, s, d) in &[(3, 9, 3, 100, 64), (2, 4, 2, 37, 128)] {
            let (tk, scale) = (s, 1.0 / (d as f64).sqrt());
            let var = |shape: (usize, usize, usize, usize)| {
                Var::from_tensor(
                    &Tensor::randn(0f32, 1.0, shape, &dev)
                        .unwrap()
                        .to_dtype(dt)
                        .unwrap(),
                )
                .unwrap()
            };
            let (q, k, v) = (
                var((b, h, s, d)),
                var((b, hkv, tk, d)),
                var((b, hkv, tk, d)),
            );
            let gout = Tensor::randn(0f32, 1.0, (b, h, s, d), &dev).unwrap();
            // Causal, and row 0 left-padded by 3 slots (its first 3 queries see only padding:
            // their gradient is 0 in training, so it is here).
            let mut m = vec![0f32; b * s * tk];
            let mut live = vec![1f32; b * h * s * d];
            for bi in 0..b {
                for i in 0..s {
                    for j in 0..tk {
                        if j > i || (bi == 0 && j < 3) {
                            m[(bi * s + i) * tk + j] = -1e30;
                        }
                    }
                    if bi == 0 && i < 3 {
                        for hh in 0..h {
                            let at = ((bi * h + hh) * s + i) * d;
                            live[at..at + d].iter_mut().for_each(|x| *x = 0.0);
                        }
                    }
                }
            }
            let mask = Tensor::from_vec(m, (b, 1, s, tk), &dev).unwrap();
            let live = Tensor::from_vec(live, (b, h, s, d), &dev).unwrap();
            let gout = (gout * &live).unwrap();
            // 0: the default (the forward and backward kernels), 1: the forward kernel with
            // the chunked candle-op backward (`GRPO_GPU_KERNELS=forward`), 2: candle ops only,
            // 3 (bf16): attention_tc.cu's tensor-core kernels (the bf16 default), 4 (bf16):
            // kernels.cu's CUDA-core kernels (`GRPO_GPU_ATTENTION=cores`).
            let run = |path: usize| {
                let out = match path {
                    0 => {
                        let gpu = Compute::resolve(q.device(), q.dtype());
                        assert!(
                            gpu.on_gpu(),
                            "grpo's GPU kernels are off or did not compile"
                        );
                        grpo_models::kernels::attention::attention_dense(&q, &k, &v, &mask, scale, true, gpu).unwrap()
                    }
                    1 => fused_gpu::attention_chunked_backward(&q, &k, &v, &mask, scale)
                        .unwrap()
                        .expect("grpo's GPU kernels are off or did not compile"),
                    3 => fused_gpu::attention_tensor_cores(&q, &k, &v, &mask, scale)
                        .unwrap()
                        .expect("the tensor-core kernels need sm_80 or later, to compile and to pass their check"),
                    4 => fused_gpu::attention_cuda_cores(&q, &k, &v, &mask, scale)
                        .unwrap()
                        .expect("grpo's GPU kernels are off or did not compile"),
                    _ => chunked_attention::attention_ops(&q, &k, &v, &mask, scale, true).unwrap(),
                };
                let g = (out.to_dtype(DType::F32).unwrap() * &gout)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                let grads: Vec<Tensor> = [&q, &k, &v]
                    .iter()
                    .map(|x| g.get(x).unwrap().clone())
                    .collect();
                (out, grads)
            };
            let (co, cg) = run(2);
            let paths: &[usize] = match dt {
                DType::BF16 => &[0, 1, 3, 4],
                _ => &[0, 1],
            };
            for &path in paths {
                let (ko, kg) = run(path);
                let what = format!("{dt:?} b{b} h{h}/{hkv} s{s} d{d} path {path}");
                // Outputs compared where a query sees a real key (a padding query's output is
                // unused: the kernel averages its visible keys, the candle ops its chunk's).
                let keep = |o: &Tensor| (o.to_dtype(DType::F32).unwrap() * &live).unwrap();
                let e = rel(&keep(&ko), &keep(&co));
                println!("{what}: output {e:.2e}");
                assert!(e < tol, "{what}: output {e}");
                for (name, (a, c)) in ["dq", "dk", "dv"].iter().zip(kg.iter().zip(&cg)) {
                    let e = rel(a, c);
                    println!("{what}: {name} {e:.2e}");
                    assert!(e < tol, "{what}: {name} {e}");
                }
            }
        }
        // RMSNorm: the kernels against the candle-op norm (HF's rounding) and its gradients.
        let x = Var::from_tensor(
            &Tensor::randn(0f32, 2.0, (5, 7, 300), &dev)
                .unwrap()
                .to_dtype(dt)
                .unwrap(),
        )
        .unwrap();
        let w = Var::from_tensor(
            &(Tensor::randn(0f32, 0.1, 300, &dev).unwrap() + 1.0)
                .unwrap()
                .to_dtype(dt)
                .unwrap(),
        )
        .unwrap();
        let gy = Tensor::randn(0f32, 1.0, (5, 7, 300), &dev).unwrap();
        let norm_grads = |y: Tensor| {
            let g = (y.to_dtype(DType::F32).unwrap() * &gy)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            (y, g.get(&x).unwrap().clone(), g.get(&w).unwrap().clone())
        };
        let (ky, kx, kw) = norm_grads(fused_gpu::rms_norm(&x, &w, 1e-5).unwrap());
        let (cy, cx, cw) =
            norm_grads(grpo_models::kernels::portable::rms_norm_diff(&x, &w, 1e-5).unwrap());
        let errs = [rel(&ky, &cy), rel(&kx, &cx), rel(&kw, &cw)];
        println!("{dt:?} rms-norm: output, dx, dw {errs:?}");
        assert!(errs.iter().all(|e| *e < tol), "{dt:?} rms-norm: {errs:?}");
        // Decoding attention: one query per row over views of a KV cache (left padding in row
        // 0 and 1), both kernels (a block per kv head, a warp per query head) against the
        // portable path's candle ops on the CPU; four query heads per kv head, then one
        // (SmolLM2-1.7B's); and with a shared prompt (rows 0 and 1 one group: row 1 reads its
        // first 20 slots from row 0, whose values the expected output takes there).
        use fused_gpu::DecodeKernel;
        for (dh, dkv, kernel, share) in [
            (8, 2, DecodeKernel::Block, false),
            (4, 4, DecodeKernel::Block, false),
            (8, 2, DecodeKernel::Warp, false),
            (4, 4, DecodeKernel::Warp, false),
            (8, 2, DecodeKernel::Block, true),
            (4, 4, DecodeKernel::Warp, true),
        ] {
            let (db, dtk, dmax, dd) = (3, 150, 160, 64);
            let cache = || {
                Tensor::randn(0f32, 1.0, (db, dkv, dmax, dd), &dev)
                    .unwrap()
                    .to_dtype(dt)
                    .unwrap()
            };
            let (kc, vc) = (cache(), cache());
            let (kv_k, kv_v) = (kc.narrow(2, 0, dtk).unwrap(), vc.narrow(2, 0, dtk).unwrap());
            let dq = Tensor::randn(0f32, 1.0, (db, dh, 1, dd), &dev)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            let mut dm = vec![0f32; db * dtk];
            dm[..3].iter_mut().for_each(|x| *x = -1e30);
            dm[dtk..dtk + 3].iter_mut().for_each(|x| *x = -1e30);
            let dmask = Tensor::from_vec(dm, (db, 1, 1, dtk), &dev).unwrap();
            let scale = 1.0 / (dd as f64).sqrt();
            let (end, leader) = (20, Tensor::new(&[0u32, 0, 2], &dev).unwrap());
            let shared = share.then_some((&leader, end));
            let got =
                fused_gpu::decode_attention_with(&dq, &kv_k, &kv_v, &dmask, scale, kernel, shared)
                    .unwrap()
                    .expect("grpo's GPU kernels are off or did not compile");
            let cpu = |t: &Tensor| {
                t.to_device(&Device::Cpu)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
            };
            // What the kernel should read: row 1's first `end` slots are row 0's when shared.
            let seen = |c: &Tensor| {
                let c = cpu(c);
                if !share {
                    return c;
                }
                let lead = c.narrow(0, 0, 1).unwrap().narrow(2, 0, end).unwrap();
                let own = c
                    .narrow(0, 1, 1)
                    .unwrap()
                    .narrow(2, end, dtk - end)
                    .unwrap();
                let row1 = Tensor::cat(&[&lead, &own], 2).unwrap();
                Tensor::cat(
                    &[
                        &c.narrow(0, 0, 1).unwrap(),
                        &row1,
                        &c.narrow(0, 2, 1).unwrap(),
                    ],
                    0,
                )
                .unwrap()
            };
            let want = grpo_models::kernels::attention::attention(
                &cpu(&dq),
                &seen(&kv_k),
                &seen(&kv_v),
                &grpo_models::models::AttnMask::Dense(cpu(&dmask)),
                grpo_models::models::Mode::Infer,
                Compute::Portable,
            )
            .unwrap();
            let e = rel(&cpu(&got), &want);
            println!(
                "{dt:?} decode attention ({kernel:?}, shared {share}), {dh}/{dkv} heads: {e:.2e}"
            );
            assert!(
                e < tol,
                "{dt:?} decode attention ({kernel:?}, shared {share}), {dh}/{dkv} heads: {e}"
            );
        }
        // RoPE: the kernel on a view of a joined projection against the candle ops.
        let (rb, rt, rh, rd) = (3, 70, 4, 64);
        let joined = Var::from_tensor(
            &Tensor::randn(0f32, 1.0, (rb, rt, 2 * rh * rd), &dev)
                .unwrap()
                .to_dtype(dt)
                .unwrap(),
        )
        .unwrap();
        let view = joined.narrow(2, rh * rd, rh * rd).unwrap();
        let ang = Tensor::rand(0f32, 6.0, (rb, rt, rd / 2), &dev).unwrap();
        let (cos, sin) = (
            ang.cos().unwrap().to_dtype(dt).unwrap(),
            ang.sin().unwrap().to_dtype(dt).unwrap(),
        );
        let gr = Tensor::randn(0f32, 1.0, (rb, rh, rt, rd), &dev).unwrap();
        let rope_grads = |y: Tensor| {
            let g = (y.to_dtype(DType::F32).unwrap() * &gr)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            (y, g.get(&joined).unwrap().clone())
        };
        let (ky, kx) = rope_grads(
            fused_gpu::rope_heads(&view, &cos, &sin, rh)
                .unwrap()
                .expect("grpo's GPU kernels are off or did not compile"),
        );
        let heads = view
            .reshape((rb, rt, rh, rd))
            .unwrap()
            .transpose(1, 2)
            .unwrap();
        let (cy, cx) = rope_grads(
            grpo_models::kernels::portable::apply_rope(
                &heads,
                &cos,
                &sin,
                grpo_models::models::Mode::Train,
            )
            .unwrap(),
        );
        let errs = [rel(&ky, &cy), rel(&kx, &cx)];
        println!("{dt:?} rope: output, dx {errs:?}");
        assert!(errs.iter().all(|e| *e < tol), "{dt:?} rope: {errs:?}");
        // A decoding step's q/k/v kernel against the RoPE kernel and the cache's writes, and its
        // add + RMSNorm against candle's add and the RMSNorm kernel.
        let (sb, sh, skv, sd, slots, slot) = (3, 6, 2, 64, 12, 5);
        let row = Tensor::randn(0f32, 1.0, (sb, 1, (sh + 2 * skv) * sd), &dev)
            .unwrap()
            .to_dtype(dt)
            .unwrap();
        let sang = Tensor::rand(0f32, 6.0, (sb, 1, sd / 2), &dev).unwrap();
        let (scos, ssin) = (
            sang.cos().unwrap().to_dtype(dt).unwrap(),
            sang.sin().unwrap().to_dtype(dt).unwrap(),
        );
        let zeros = || Tensor::zeros((sb, skv, slots, sd), dt, &dev).unwrap();
        let (kc, vc) = (zeros(), zeros());
        let q = fused_gpu::rope_append(&row, &scos, &ssin, sh, skv, &kc, &vc, slot)
            .unwrap()
            .expect("grpo's GPU kernels are off or did not compile");
        let part = |from: usize, heads: usize| row.narrow(2, from * sd, heads * sd).unwrap();
        let rot = |x: &Tensor, heads: usize| {
            fused_gpu::rope_heads(x, &scos, &ssin, heads)
                .unwrap()
                .unwrap()
        };
        let want_v = part(sh + skv, skv)
            .reshape((sb, 1, skv, sd))
            .unwrap()
            .transpose(1, 2)
            .unwrap();
        let at_slot = |c: &Tensor| c.narrow(2, slot, 1).unwrap();
        let errs = [
            rel(&q, &rot(&part(0, sh), sh)),
            rel(&at_slot(&kc), &rot(&part(sh, skv), skv)),
            rel(&at_slot(&vc), &want_v),
            diff::max_abs(&kc.narrow(2, 0, slot).unwrap()),
        ];
        println!("{dt:?} decoding q/k/v: q, k, v, other slots {errs:?}");
        assert!(
            errs.iter().all(|e| *e < tol),
            "{dt:?} decoding q/k/v: {errs:?}"
        );
        let (xa, aa) = (
            Tensor::randn(0f32, 1.0, (5, 1, 300), &dev)
                .unwrap()
                .to_dtype(dt)
                .unwrap(),
            Tensor::randn(0f32, 1.0, (5, 1, 300), &dev)
                .unwrap()
                .to_dtype(dt)
                .unwrap(),
        );
        let nw = Tensor::rand(0.5f32, 1.5, 300, &dev)
            .unwrap()
            .to_dtype(dt)
            .unwrap();
        let (sum, normed) = fused_gpu::add_rms_norm(&xa, &aa, &nw, 1e-5)
            .unwrap()
            .expect("grpo's GPU kernels are off or did not compile");
        let want_sum = (&xa + &aa).unwrap();
        let want_normed = fused_gpu::rms_norm(&want_sum, &nw, 1e-5).unwrap();
        let errs = [rel(&sum, &want_sum), rel(&normed, &want_normed)];
        println!("{dt:?} add + rms-norm: sum, normed {errs:?}");
        assert!(
            errs.iter().all(|e| *e < 1e-6),
            "{dt:?} add + rms-norm: {errs:?}"
        );
        // SwiGLU: the kernel against silu(gate) * up in candle ops.
        let gu = Var::from_tensor(
            &Tensor::randn(0f32, 2.0, (7, 33, 2 * 96), &dev)
                .unwrap()
                .to_dtype(dt)
                .unwrap(),
        )
        .unwrap();
        assert!(
            Compute::resolve(gu.device(), gu.dtype()).on_gpu() && fused_gpu::takes(&gu),
            "grpo's GPU kernels are off or did not compile"
        );
        let dy = Tensor::randn(0f32, 1.0, (7, 33, 96), &dev).unwrap();
        let grad = |y: Tensor| {
            let g = (y.to_dtype(DType::F32).unwrap() * &dy)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            (y, g.get(&gu).unwrap().clone())
        };
        let (ky, kg) = grad(fused_gpu::swiglu(&gu).unwrap());
        let ops =
            (gu.narrow(2, 0, 96).unwrap().silu().unwrap() * gu.narrow(2, 96, 96).unwrap()).unwrap();
        let (cy, cg) = grad(ops);
        let (ey, eg) = (rel(&ky, &cy), rel(&kg, &cg));
        println!("{dt:?} swiglu: output {ey:.2e}, gradient {eg:.2e}");
        assert!(ey < tol && eg < tol, "{dt:?} swiglu: {ey} {eg}");
    }
}

#[test]
fn gpu_adamw_kernel_and_clipping_equal_the_cpu_step() {
    // The GPU's one-kernel AdamW (with the clipping factor) against the CPU's fused step, over
    // three steps of a matrix and a vector.
    use candle_core::Tensor;
    use grpo::optim::{clip_factor, AdamW, AdamWConfig};
    let dev = gpu();
    let cfg = AdamWConfig {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    };
    let shapes: [&[usize]; 2] = [&[300, 70], &[5]];
    let init: Vec<Tensor> = shapes
        .iter()
        .map(|s| Tensor::randn(0f32, 1.0, *s, &Device::Cpu).unwrap())
        .collect();
    let make = |d: &Device| -> (Vec<Var>, AdamW) {
        let vars: Vec<Var> = init
            .iter()
            .map(|t| Var::from_tensor(&t.to_device(d).unwrap()).unwrap())
            .collect();
        let named = vars
            .iter()
            .enumerate()
            .map(|(i, v)| (format!("p{i}"), v.clone()))
            .collect();
        (vars, AdamW::new(named, cfg).unwrap())
    };
    let (gpu_vars, mut gpu_opt) = make(&dev);
    let (cpu_vars, mut cpu_opt) = make(&Device::Cpu);
    assert!(
        gpu_opt.compute().on_gpu(),
        "grpo's GPU kernels are off or did not compile"
    );
    for step in 0..3 {
        let grads: Vec<Tensor> = shapes
            .iter()
            .map(|s| (Tensor::randn(0f32, 1.0, *s, &Device::Cpu).unwrap() * 0.5).unwrap())
            .collect();
        let on_gpu: Vec<Tensor> = grads.iter().map(|g| g.to_device(&dev).unwrap()).collect();
        let (cn, cf) = clip_factor(&grads, 1.0, cpu_opt.compute()).unwrap();
        let (gn, gf) = clip_factor(&on_gpu, 1.0, gpu_opt.compute()).unwrap();
        assert!(
            (cn - gn).abs() < 1e-4 * cn,
            "step {step}: norm {gn} vs {cn}"
        );
        cpu_opt.step(&grads, 1e-3, cf).unwrap();
        gpu_opt.step(&on_gpu, 1e-3, gf).unwrap();
    }
    for (i, (g, c)) in gpu_vars.iter().zip(&cpu_vars).enumerate() {
        let e = diff::max_diff(
            &g.as_tensor().to_device(&Device::Cpu).unwrap(),
            c.as_tensor(),
        );
        println!("adamw parameter {i}: max |gpu - cpu| {e:.2e}");
        assert!(e < 1e-5, "adamw parameter {i}: {e}");
    }
    let (gs, cs) = (
        gpu_opt.state_tensors().unwrap(),
        cpu_opt.state_tensors().unwrap(),
    );
    for ((name, g), (_, c)) in gs.iter().zip(&cs) {
        let e = diff::max_diff(g, c);
        assert!(e < 1e-5, "adamw {name}: {e}");
    }
}
