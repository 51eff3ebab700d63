use super::*;
use crate::kernels::mask::build_mask;
use crate::kernels::portable::softmax;
use crate::kernels::Mode;
use candle_core::{Device, Var};

/// The matmul composition: repeat KV heads, scores, masked softmax, weighted values.
fn composition(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, scale: f64) -> Tensor {
    let (b, h, s, d) = q.dims4().unwrap();
    let hkv = k.dim(1).unwrap();
    let g = h / hkv;
    let rep = |t: &Tensor| {
        let (b, hk, tk, d) = t.dims4().unwrap();
        t.unsqueeze(2)
            .unwrap()
            .broadcast_as((b, hk, g, tk, d))
            .unwrap()
            .reshape((b, hk * g, tk, d))
            .unwrap()
    };
    let (k, v) = (rep(k), rep(v));
    let scores = (q.matmul(&k.t().unwrap().contiguous().unwrap()).unwrap() * scale)
        .unwrap()
        .broadcast_add(mask)
        .unwrap();
    let p = softmax(&scores, Mode::Train).unwrap();
    p.matmul(&v.contiguous().unwrap())
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .reshape((b, s, h * d))
        .unwrap()
}

/// The decoding kernel against its plain f64 twin: softmax(q k^T * scale) v per query head.
#[test]
fn decode_head_matches_plain_twin() {
    let val = |i: usize, m: usize| ((i * 7919 + m) % 97) as f32 / 48.0 - 1.0;
    for &(g, n, d) in &[(3, 1, 64), (3, 57, 64), (1, 130, 128), (2, 33, 20)] {
        let q: Vec<f32> = (0..g * d).map(|i| val(i, 1) * 3.0).collect();
        let k: Vec<f32> = (0..n * d).map(|i| val(i, 2)).collect();
        let v: Vec<f32> = (0..n * d).map(|i| val(i, 3)).collect();
        let scale = 1.0 / (d as f32).sqrt();
        let mut o = vec![f32::NAN; g * d];
        decode_head(&q, &[(&k, &v)], scale, &mut o, d);
        // Every variant gives the same bits (AVX2 mirrors AVX-512's FMAs and reduction);
        // the baseline's plain dot products differ in rounding only.
        for isa in Isa::ALL {
            let mut oi = vec![f32::NAN; g * d];
            decode_head_on(isa, &q, &[(&k, &v)], scale, &mut oi, d);
            if isa.usable() >= Isa::Avx2 && Isa::active() >= Isa::Avx2 {
                assert_eq!(oi, o, "{isa} g{g} n{n} d{d}");
            }
            for (a, b) in o.iter().zip(&oi) {
                assert!((a - b).abs() < 1e-6, "{isa} g{g} n{n} d{d}: {b} vs {a}");
            }
        }
        // The same keys in two segments (a shared prompt read from another row) give the same.
        let cut = n / 2 * d;
        let mut o2 = vec![f32::NAN; g * d];
        let segs = [(&k[..cut], &v[..cut]), (&k[cut..], &v[cut..])];
        decode_head(&q, &segs, scale, &mut o2, d);
        for (a, b) in o.iter().zip(&o2) {
            assert!((a - b).abs() < 1e-6, "g{g} n{n} d{d}: split {b} vs {a}");
        }
        for i in 0..g {
            let z: Vec<f64> = (0..n)
                .map(|t| {
                    (0..d)
                        .map(|c| q[i * d + c] as f64 * k[t * d + c] as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = z.iter().map(|x| (x - m).exp()).collect();
            let sum: f64 = e.iter().sum();
            for c in 0..d {
                let want: f64 = (0..n).map(|t| e[t] / sum * v[t * d + c] as f64).sum();
                let got = o[i * d + c] as f64;
                assert!((got - want).abs() < 1e-5, "g{g} n{n} d{d}: {got} vs {want}");
            }
        }
    }
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    let d = (a - b).and_then(|d| d.abs()).and_then(|d| d.max_all());
    d.and_then(|d| d.to_scalar::<f32>()).unwrap()
}

/// Packed rows with segments, left padding (a fully masked query row) and a ragged tail.
fn mask(b: usize, s: usize, dev: &Device) -> Tensor {
    let valid: Vec<Vec<bool>> = (0..b).map(|bi| (0..s).map(|j| j >= bi).collect()).collect();
    let causal = build_mask(&valid, 0, s, s, dev).unwrap(); // [B, 1, S, S]
                                                            // Row 0: a prompt of 3 then two segments; a key of segment 1 is hidden from segment 2.
    let mut m = causal.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for qi in 0..s {
        for j in 0..s {
            let seg = |x: usize| {
                if x < 3 {
                    0
                } else if x < 6 {
                    1
                } else {
                    2
                }
            };
            if seg(qi) != seg(j) && seg(j) != 0 {
                m[qi * s + j] = MASK_VALUE;
            }
        }
    }
    Tensor::from_vec(m, (b, 1, s, s), dev).unwrap()
}

#[test]
fn matches_the_composition_values_and_gradients() {
    let dev = Device::Cpu;
    for (b, h, hkv, s, d) in [(2, 6, 2, 9, 16), (3, 2, 2, 7, 20), (1, 4, 1, 11, 64)] {
        let q = Var::randn(0f32, 1.0, (b, h, s, d), &dev).unwrap();
        let k = Var::randn(0f32, 1.0, (b, hkv, s, d), &dev).unwrap();
        let v = Var::randn(0f32, 1.0, (b, hkv, s, d), &dev).unwrap();
        let m = mask(b, s, &dev);
        let scale = 1.0 / (d as f64).sqrt();
        let want = composition(&q, &k, &v, &m, scale);
        // A weighted sum, so every output element has its own upstream gradient.
        let w = Tensor::randn(0f32, 1.0, (b, s, h * d), &dev).unwrap();
        let gw = (&want * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let mut first: Option<Vec<Vec<f32>>> = None;
        for isa in Isa::ALL {
            let got = attention_on(isa, &q, &k, &v, &spans_of(&m), scale).unwrap();
            let diff = max_diff(&want, &got);
            assert!(diff < 1e-5, "{isa} values {diff}");
            let gg = (&got * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let mut bits = vec![got.flatten_all().unwrap().to_vec1::<f32>().unwrap()];
            for (name, x) in [("q", &q), ("k", &k), ("v", &v)] {
                let (a, c) = (gw.get(x).unwrap(), gg.get(x).unwrap());
                assert!(max_diff(a, c) < 1e-4, "{isa} {name}: {}", max_diff(a, c));
                bits.push(c.flatten_all().unwrap().to_vec1::<f32>().unwrap());
            }
            // Every variant runs the same operations in the same order: the same bits.
            match &first {
                None => first = Some(bits),
                Some(f) => assert!(f == &bits, "{isa} differs from the baseline"),
            }
        }
    }
}

#[test]
fn forward_without_a_graph_matches_and_keeps_nothing() {
    let dev = Device::Cpu;
    let (b, h, hkv, s, d) = (2, 4, 2, 8, 8);
    let q = Tensor::randn(0f32, 1.0, (b, h, s, d), &dev).unwrap();
    let k = Tensor::randn(0f32, 1.0, (b, hkv, s, d), &dev).unwrap();
    let v = Tensor::randn(0f32, 1.0, (b, hkv, s, d), &dev).unwrap();
    let m = mask(b, s, &dev);
    let want = composition(&q, &k, &v, &m, 0.3);
    let got = attention(&q, &k, &v, &spans_of(&m), 0.3).unwrap();
    assert!(max_diff(&want, &got) < 1e-5);
    assert!(!got.track_op());
}

fn spans_of(m: &Tensor) -> Arc<Spans> {
    Arc::new(Spans::new(m).unwrap())
}

#[test]
fn spans_are_the_unmasked_runs() {
    let x = MASK_VALUE;
    let m = [0.0, x, 0.0, 0.0, x, x, x, 0.0, x, x, x, x];
    let sp = Spans::from_values(&m, 1, 3, 4);
    // A fully masked row spreads over every key, as the composition's softmax does.
    assert_eq!(
        sp.runs,
        vec![vec![(0, 1), (2, 4)], vec![(3, 4)], vec![(0, 4)]]
    );
    assert_eq!(sp.add, vec![0.0, 0.0, MASK_VALUE]);
    assert_eq!(sp.blocks.len(), 1);
}

#[test]
fn independent_groups_of_a_row_are_separate_blocks() {
    // One row holding two causal groups of 3 and 2 tokens, then a query reading only key 5.
    let x = MASK_VALUE;
    #[rustfmt::skip]
    let m = [
        0.0, x, x, x, x, x,
        0.0, 0.0, x, x, x, x,
        0.0, 0.0, 0.0, x, x, x,
        x, x, x, 0.0, x, x,
        x, x, x, 0.0, 0.0, x,
        x, x, x, x, x, 0.0,
    ];
    let sp = Spans::from_values(&m, 1, 6, 6);
    let got: Vec<_> = sp
        .blocks
        .iter()
        .map(|b| (b.rows.clone(), b.keys.clone(), b.len))
        .collect();
    assert_eq!(got, vec![(0..3, 0..3, 6), (3..5, 3..5, 3), (5..6, 5..6, 1)]);
    assert_eq!(sp.off, vec![0, 1, 3, 0, 1, 0]);
    // A later query reading back into an earlier group joins the blocks.
    let mut m2 = m;
    m2[5 * 6] = 0.0;
    assert_eq!(Spans::from_values(&m2, 1, 6, 6).blocks.len(), 1);
}

#[test]
fn a_packed_row_matches_separate_rows() {
    // Two groups packed in one row give the rows' values and gradients run separately.
    let dev = Device::Cpu;
    let (h, hkv, d) = (4, 2, 16);
    let lens = [5usize, 7];
    let n: usize = lens.iter().sum();
    let q = Var::randn(0f32, 1.0, (1, h, n, d), &dev).unwrap();
    let k = Var::randn(0f32, 1.0, (1, hkv, n, d), &dev).unwrap();
    let v = Var::randn(0f32, 1.0, (1, hkv, n, d), &dev).unwrap();
    let mut m = vec![MASK_VALUE; n * n];
    let mut at = 0;
    for &l in &lens {
        for qi in 0..l {
            for kj in 0..=qi {
                m[(at + qi) * n + at + kj] = 0.0;
            }
        }
        at += l;
    }
    let mask = Tensor::from_vec(m, (1, 1, n, n), &dev).unwrap();
    let sp = spans_of(&mask);
    assert_eq!(sp.blocks.len(), 2);
    let packed = attention(&q, &k, &v, &sp, 0.25).unwrap();
    let want = composition(&q, &k, &v, &mask, 0.25);
    assert!(
        max_diff(&packed, &want) < 1e-5,
        "{}",
        max_diff(&packed, &want)
    );
    let w = Tensor::randn(0f32, 1.0, (1, n, h * d), &dev).unwrap();
    let gw = (want * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let gp = (packed * &w)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    for (name, x) in [("q", &q), ("k", &k), ("v", &v)] {
        let (a, c) = (gw.get(x).unwrap(), gp.get(x).unwrap());
        assert!(max_diff(a, c) < 1e-4, "{name}: {}", max_diff(a, c));
    }
}
