//! The GPU kernels' twins in plain Rust: the same math as `kernels.cu`'s attention, SwiGLU,
//! RMSNorm and RoPE kernels, tested here against the candle-op path on the CPU (CI) and, in
//! `tests/gpu_kernels_emulated.rs`, against the CUDA source run on the CPU.

use super::Dims;

/// The forward kernel's twin: `q` [B, H, S, D], `k`/`v` [B, Hkv, Tk, D], `mask` [B, S, Tk]
/// additive -> (o [B, H, S, D], lse [B, H, S]).
pub fn twin_forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: &[f32],
    n: Dims,
    scale: f32,
) -> (Vec<f32>, Vec<f32>) {
    let Dims {
        b: _,
        h,
        hkv,
        s,
        tk,
        d,
    } = n;
    let mut o = vec![0f32; q.len()];
    let mut lse = vec![0f32; q.len() / d.max(1)];
    for (row, (oq, l_out)) in o.chunks_mut(d).zip(lse.iter_mut()).enumerate() {
        let (bh, i) = (row / s, row % s);
        let (bi, hi) = (bh / h, bh % h);
        let hk = hi / (h / hkv);
        let qs: Vec<f32> = q[row * d..(row + 1) * d]
            .iter()
            .map(|x| x * scale)
            .collect();
        let kv = (bi * hkv + hk) * tk * d;
        let mrow = &mask[(bi * s + i) * tk..(bi * s + i + 1) * tk];
        let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
        let mut acc = vec![0f32; d];
        for j in 0..n.end(i) {
            let kj = &k[kv + j * d..kv + (j + 1) * d];
            let z = qs.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() + mrow[j];
            let mn = m.max(z);
            let (c, p) = ((m - mn).exp(), (z - mn).exp());
            l = l * c + p;
            for (a, vv) in acc.iter_mut().zip(&v[kv + j * d..kv + (j + 1) * d]) {
                *a = *a * c + p * vv;
            }
            m = mn;
        }
        let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
        for (x, a) in oq.iter_mut().zip(&acc) {
            *x = a * inv;
        }
        *l_out = m + l.ln();
    }
    (o, lse)
}

/// The backward kernels' twin: given the forward's `o` and `lse` and the output's gradient
/// `dout`, -> (dq, dk, dv) in the inputs' shapes.
#[allow(clippy::too_many_arguments)]
pub fn twin_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: &[f32],
    o: &[f32],
    dout: &[f32],
    lse: &[f32],
    n: Dims,
    scale: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let Dims {
        b,
        h,
        hkv,
        s,
        tk,
        d,
    } = n;
    let g = h / hkv;
    let dot = |a: &[f32], c: &[f32]| a.iter().zip(c).map(|(x, y)| x * y).sum::<f32>();
    let at = |x: &[f32], r: usize| x[r * d..(r + 1) * d].to_vec();
    // Per query: delta and dQ.
    let mut delta = vec![0f32; b * h * s];
    let mut dq = vec![0f32; q.len()];
    for row in 0..b * h * s {
        let (bh, i) = (row / s, row % s);
        let (bi, hk) = (bh / h, (bh % h) / g);
        let qs: Vec<f32> = at(q, row).iter().map(|x| x * scale).collect();
        let gs = at(dout, row);
        let dl = dot(&gs, &at(o, row));
        delta[row] = dl;
        let mut acc = vec![0f32; d];
        for j in 0..n.end(i) {
            let kr = (bi * hkv + hk) * tk + j;
            let (kj, vj) = (at(k, kr), at(v, kr));
            let p = (dot(&qs, &kj) + mask[(bi * s + i) * tk + j] - lse[row]).exp();
            let ds = p * (dot(&gs, &vj) - dl);
            for (a, kk) in acc.iter_mut().zip(&kj) {
                *a += ds * kk;
            }
        }
        for (x, a) in dq[row * d..(row + 1) * d].iter_mut().zip(&acc) {
            *x = a * scale;
        }
    }
    // Per key: dK and dV over the g heads that read it and the queries that reach it.
    let (mut dk, mut dv) = (vec![0f32; k.len()], vec![0f32; v.len()]);
    for kr in 0..b * hkv * tk {
        let (bk, j) = (kr / tk, kr % tk);
        let (bi, hk) = (bk / hkv, bk % hkv);
        let ks: Vec<f32> = at(k, kr).iter().map(|x| x * scale).collect();
        let vs = at(v, kr);
        let (mut ak, mut av) = (vec![0f32; d], vec![0f32; d]);
        for hh in hk * g..(hk + 1) * g {
            for i in (j + s).saturating_sub(tk)..s {
                let row = (bi * h + hh) * s + i;
                let (qi, gi) = (at(q, row), at(dout, row));
                let p = (dot(&ks, &qi) + mask[(bi * s + i) * tk + j] - lse[row]).exp();
                let ds = p * (dot(&vs, &gi) - delta[row]);
                for dd in 0..d {
                    av[dd] += p * gi[dd];
                    ak[dd] += ds * qi[dd];
                }
            }
        }
        for dd in 0..d {
            dk[kr * d + dd] = ak[dd] * scale;
            dv[kr * d + dd] = av[dd];
        }
    }
    (dq, dk, dv)
}

/// The SwiGLU kernels' twin: `gu` [N, 2I] (gate then up per row) and the output's gradient `dy`
/// [N, I] -> (silu(gate) * up [N, I], d gu [N, 2I]).
pub fn twin_swiglu(gu: &[f32], dy: &[f32], inter: usize) -> (Vec<f32>, Vec<f32>) {
    let mut y = vec![0f32; dy.len()];
    let mut dgu = vec![0f32; gu.len()];
    for (idx, (yo, d)) in y.iter_mut().zip(dy).enumerate() {
        let (r, c) = (idx / inter, idx % inter);
        let (g, u) = (gu[r * 2 * inter + c], gu[r * 2 * inter + inter + c]);
        let s = 1.0 / (1.0 + (-g).exp());
        *yo = g * s * u;
        dgu[r * 2 * inter + c] = d * u * s * (1.0 + g * (1.0 - s));
        dgu[r * 2 * inter + inter + c] = d * g * s;
    }
    (y, dgu)
}

/// The RMSNorm kernels' twin (f32): rows of `x` [N, H], weight `w` [H], the output's gradient
/// `g` [N, H] -> (y, dx, dw).
pub fn twin_rms_norm(x: &[f32], w: &[f32], g: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let h = w.len();
    let (mut y, mut dx, mut dw) = (vec![0f32; x.len()], vec![0f32; x.len()], vec![0f32; h]);
    for (row, (xr, gr)) in x.chunks(h).zip(g.chunks(h)).enumerate() {
        let r = 1.0 / (xr.iter().map(|v| v * v).sum::<f32>() / h as f32 + eps).sqrt();
        let proj = (0..h).map(|i| gr[i] * w[i] * xr[i] * r).sum::<f32>() / h as f32;
        for i in 0..h {
            let n = xr[i] * r;
            y[row * h + i] = n * w[i];
            dx[row * h + i] = (gr[i] * w[i] - n * proj) * r;
            dw[i] += gr[i] * n;
        }
    }
    (y, dx, dw)
}

/// The RoPE kernels' twin: `x` [B, T, H*D], tables `cos`/`sin` [B, T, D/2] and the output's
/// gradient `dy` [B, H, T, D] -> (y [B, H, T, D], dx [B, T, H*D]).
pub fn twin_rope(
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    dy: &[f32],
    (b, t, h, d): (usize, usize, usize, usize),
) -> (Vec<f32>, Vec<f32>) {
    let half = d / 2;
    let (mut y, mut dx) = (vec![0f32; x.len()], vec![0f32; x.len()]);
    for bi in 0..b {
        for hi in 0..h {
            for ti in 0..t {
                let bt = bi * t + ti;
                let rows = bt * h * d + hi * d;
                let heads = ((bi * h + hi) * t + ti) * d;
                for c in 0..half {
                    let (co, si) = (cos[bt * half + c], sin[bt * half + c]);
                    let (x1, x2) = (x[rows + c], x[rows + half + c]);
                    y[heads + c] = x1 * co - x2 * si;
                    y[heads + half + c] = x2 * co + x1 * si;
                    let (g1, g2) = (dy[heads + c], dy[heads + half + c]);
                    dx[rows + c] = g1 * co + g2 * si;
                    dx[rows + half + c] = g2 * co - g1 * si;
                }
            }
        }
    }
    (y, dx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor, Var};

    fn host(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    /// The largest |a - e|.
    fn err(a: &[f32], e: &[f32]) -> f32 {
        a.iter()
            .zip(e)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    }

    /// The kernels' twin equals the chunked candle-op attention (the portable path's), output
    /// and every gradient, with grouped heads, a key prefix, left padding and several chunks.
    #[test]
    fn the_kernels_twin_equals_the_chunked_path_with_its_gradients() {
        let dev = Device::Cpu;
        for &(b, h, hkv, s, tk, d) in &[(2, 6, 2, 7, 9, 8), (1, 4, 4, 12, 12, 16)] {
            let n = Dims {
                b,
                h,
                hkv,
                s,
                tk,
                d,
            };
            let q = Var::randn(0f32, 1.0, (b, h, s, d), &dev).unwrap();
            let k = Var::randn(0f32, 1.0, (b, hkv, tk, d), &dev).unwrap();
            let v = Var::randn(0f32, 1.0, (b, hkv, tk, d), &dev).unwrap();
            let gout = Tensor::randn(0f32, 1.0, (b, h, s, d), &dev).unwrap();
            // Causal (the mask callers pass is), and the last row left-padded by one slot (no
            // query sees only padding).
            let mut m = vec![0f32; b * s * tk];
            for bi in 0..b {
                for i in 0..s {
                    for j in 0..tk {
                        if j > tk - s + i || (b > 1 && bi == b - 1 && j == 0) {
                            m[(bi * s + i) * tk + j] = crate::kernels::mask::MASK_VALUE;
                        }
                    }
                }
            }
            let mask = Tensor::from_vec(m.clone(), (b, 1, s, tk), &dev).unwrap();
            let scale = 0.3f64;
            let want = crate::kernels::portable::chunked_attention::attention_ops(
                &q, &k, &v, &mask, scale, true,
            )
            .unwrap();
            let grads = (&want * &gout)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let (qh, kh, vh) = (host(&q), host(&k), host(&v));
            let (o, lse) = twin_forward(&qh, &kh, &vh, &m, n, scale as f32);
            let (dq, dk, dv) =
                twin_backward(&qh, &kh, &vh, &m, &o, &host(&gout), &lse, n, scale as f32);
            let close = |a: &[f32], e: &[f32], what: &str| {
                let worst = err(a, e);
                assert!(worst < 1e-5, "{what} ({b}x{h}/{hkv}x{s}x{tk}x{d}): {worst}");
            };
            close(&o, &host(&want), "output");
            // The twin's output and log-sum-exps recorded with the chunked backward (the GPU's
            // GRPO_GPU_KERNELS=forward) give the same gradients.
            let t = |x: Vec<f32>, shape: &[usize]| Tensor::from_vec(x, shape, &dev).unwrap();
            let rec = crate::kernels::portable::chunked_attention::record(
                &t(o.clone(), &[b, h, s, d]),
                &q,
                &k,
                &v,
                &mask,
                scale,
                &t(lse.clone(), &[b, h, s]),
            )
            .unwrap();
            let rg = (&rec * &gout)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            for (x, what) in [
                (&q, "recorded dq"),
                (&k, "recorded dk"),
                (&v, "recorded dv"),
            ] {
                close(
                    &host(rg.get(x).unwrap()),
                    &host(grads.get(x).unwrap()),
                    what,
                );
            }
            close(&dq, &host(grads.get(&q).unwrap()), "dq");
            close(&dk, &host(grads.get(&k).unwrap()), "dk");
            close(&dv, &host(grads.get(&v).unwrap()), "dv");
        }
    }

    /// The SwiGLU kernels' twin equals candle's silu(gate) * up and its autograd gradient.
    #[test]
    fn the_swiglu_twin_equals_candle_ops_with_the_gradient() {
        let dev = Device::Cpu;
        let (n, inter) = (5, 12);
        let gu = Var::randn(0f32, 2.0, (n, 2 * inter), &dev).unwrap();
        let dy = Tensor::randn(0f32, 1.0, (n, inter), &dev).unwrap();
        let want = (gu.narrow(1, 0, inter).unwrap().silu().unwrap()
            * gu.narrow(1, inter, inter).unwrap())
        .unwrap();
        let grads = (&want * &dy)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let (y, dgu) = twin_swiglu(&host(&gu), &host(&dy), inter);
        assert!(err(&y, &host(&want)) < 1e-5);
        assert!(err(&dgu, &host(grads.get(&gu).unwrap())) < 1e-5);
    }

    /// The RoPE kernels' twin equals the portable path's candle-op RoPE (reshape, transpose,
    /// rotate-half) and its gradient.
    #[test]
    fn the_rope_twin_equals_candle_ops_with_the_gradient() {
        let dev = Device::Cpu;
        let (b, t, h, d) = (2, 5, 3, 8);
        let x = Var::randn(0f32, 1.0, (b, t, h * d), &dev).unwrap();
        let ang = Tensor::rand(0f32, 6.0, (b, t, d / 2), &dev).unwrap();
        let (cos, sin) = (ang.cos().unwrap(), ang.sin().unwrap());
        let dy = Tensor::randn(0f32, 1.0, (b, h, t, d), &dev).unwrap();
        let heads = x.reshape((b, t, h, d)).unwrap().transpose(1, 2).unwrap();
        let want =
            crate::kernels::portable::apply_rope(&heads, &cos, &sin, crate::kernels::Mode::Train)
                .unwrap();
        let grads = (&want * &dy)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let (y, dx) = twin_rope(
            &host(&x),
            &host(&cos),
            &host(&sin),
            &host(&dy),
            (b, t, h, d),
        );
        assert!(err(&y, &host(&want)) < 1e-5);
        assert!(err(&dx, &host(grads.get(&x).unwrap())) < 1e-5);
    }

    /// The RMSNorm kernels' twin equals the recorded candle-op RMSNorm and its gradients.
    #[test]
    fn the_rms_norm_twin_equals_candle_ops_with_the_gradients() {
        let dev = Device::Cpu;
        let (n, h) = (4, 37);
        let x = Var::randn(0f32, 2.0, (n, h), &dev).unwrap();
        let w =
            Var::from_tensor(&(Tensor::randn(0f32, 0.1, h, &dev).unwrap() + 1.0).unwrap()).unwrap();
        let g = Tensor::randn(0f32, 1.0, (n, h), &dev).unwrap();
        let want = crate::kernels::portable::rms_norm_recomputed(&x, &w, 1e-5).unwrap();
        let grads = (&want * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let (y, dx, dw) = twin_rms_norm(&host(&x), &host(&w), &host(&g), 1e-5);
        assert!(err(&y, &host(&want)) < 1e-5);
        assert!(err(&dx, &host(grads.get(&x).unwrap())) < 1e-5);
        assert!(err(&dw, &host(grads.get(&w).unwrap())) < 1e-4);
    }
}
