//! Gradients: every parameter gets one, they match finite differences, and packing and the
//! gradient sink leave them unchanged.

use super::*;

#[test]
fn every_parameter_receives_a_nonzero_gradient() {
    for name in ARCHS {
        let (m, _) = load(name, DType::F32);
        let (model, vars) = trainable(&m, DType::F32);
        let grads = loss(&model, &padded_batch()).backward().unwrap();
        for (k, v) in &vars {
            let g = grads
                .get(v)
                .unwrap_or_else(|| panic!("{name}: no gradient for {k}"));
            let n = g
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(n > 0.0 && n.is_finite(), "{name}: gradient of {k} is {n}");
        }
    }
}

#[test]
fn gradients_match_finite_differences() {
    // f64 so central differences are accurate; a few entries of every tensor of every block type.
    for name in ARCHS {
        let (m, _) = load(name, DType::F64);
        let (model, vars) = trainable(&m, DType::F64);
        let batch = padded_batch();
        let grads = loss(&model, &batch).backward().unwrap();
        let mut names: Vec<&String> = vars.keys().collect();
        names.sort();
        for k in names {
            let v = &vars[k];
            let g: Vec<f64> = grads
                .get(v)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let orig: Vec<f64> = v.flatten_all().unwrap().to_vec1().unwrap();
            let n = orig.len();
            for &idx in &[0, n / 2 + 1, n - 1] {
                let eps = 1e-5;
                let eval = |delta: f64| {
                    let mut p = orig.clone();
                    p[idx] += delta;
                    v.set(&Tensor::from_vec(p, v.shape(), &Device::Cpu).unwrap())
                        .unwrap();
                    loss(&build(&m, &vars, DType::F64), &batch)
                        .to_scalar::<f64>()
                        .unwrap()
                };
                let num = (eval(eps) - eval(-eps)) / (2.0 * eps);
                v.set(&Tensor::from_vec(orig.clone(), v.shape(), &Device::Cpu).unwrap())
                    .unwrap();
                let tol = 1e-5 + 1e-4 * num.abs().max(g[idx].abs());
                assert!(
                    (num - g[idx]).abs() < tol,
                    "{name} {k}[{idx}]: analytic {} vs numeric {num}",
                    g[idx]
                );
            }
        }
    }
}

#[test]
fn shared_prompt_packing_equals_one_row_per_completion() {
    use grpo::logprobs::{completion_logprobs, Entropy, Packing};
    let p1 = vec![5u32, 17, 33, 2, 90];
    let p2 = vec![7u32, 8];
    let comps: Vec<Vec<u32>> = vec![
        vec![4, 9, 1],
        vec![12],
        vec![3, 3, 3, 3, 8],
        vec![6, 2],
        vec![40, 41, 42],
    ];
    let prompts: Vec<&[u32]> = vec![&p1, &p1, &p1, &p2, &p2];
    let cs: Vec<&[u32]> = comps.iter().map(|c| c.as_slice()).collect();
    for name in ARCHS {
        let (m, _) = load(name, DType::F32);
        let (model, vars) = trainable(&m, DType::F32);
        let run = |packing| {
            let (lp, ent) = completion_logprobs(
                &model,
                &prompts,
                &cs,
                0,
                0.7,
                Mode::Train,
                Entropy::WithGrad,
                packing,
            )
            .unwrap();
            let w = Tensor::arange(0f32, lp.elem_count() as f32, &Device::Cpu)
                .unwrap()
                .reshape(lp.dims())
                .unwrap();
            let loss =
                ((&lp * &w).unwrap().sum_all().unwrap() + ent.unwrap().sum_all().unwrap()).unwrap();
            let grads = loss.backward().unwrap();
            (lp.to_vec2::<f32>().unwrap(), grads)
        };
        let (packed, gp) = run(Packing::SharedPrompt);
        let (rows, gr) = run(Packing::PerRow);
        for (a, b) in packed.iter().zip(&rows) {
            assert!(
                max_diff(a, b) < 1e-5,
                "{name}: log-probs differ: {a:?} vs {b:?}"
            );
        }
        let flat = |g: &candle_core::backprop::GradStore, v: &Var| {
            g.get(v)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        for (k, v) in &vars {
            let (a, b) = (flat(&gp, v), flat(&gr, v));
            let scale = b.iter().fold(1e-3f32, |m, x| m.max(x.abs()));
            assert!(
                max_diff(&a, &b) < 1e-4 * scale,
                "{name}: gradient of {k} differs"
            );
        }
    }
}

#[test]
fn gradient_sink_equals_autograd_and_accumulates() {
    use grpo_models::kernels::grad_sink::GradSink;
    if grpo_models::kernels::kernels() == grpo_models::kernels::Kernels::Portable {
        return; // the sink is CPU code, which the portable kernels (a GPU's path) do not run
    }
    for name in ARCHS {
        let (m, _) = load(name, DType::F32);
        let (model, vars) = trainable(&m, DType::F32);
        let batch = padded_batch();
        let plain = loss(&model, &batch).backward().unwrap();
        let list: Vec<Var> = vars.values().cloned().collect();
        let sink = GradSink::new(&list);
        let mut sunk = build(&m, &vars, DType::F32);
        let attached = sunk.attach_grad_sink(&sink).unwrap();
        // Four projections per block, the token embedding and the LM head (tied or not), and
        // GPT-2's position embedding.
        let extra = if m.config.arch == grpo_models::models::Arch::Gpt2 {
            3
        } else {
            2
        };
        assert_eq!(
            attached,
            4 * m.config.num_layers + extra,
            "{name}: projections attached"
        );
        // Two backward passes: the sink must add the second into the first.
        let l1 = loss(&sunk, &batch);
        let d = (l1.to_scalar::<f32>().unwrap() - loss(&model, &batch).to_scalar::<f32>().unwrap())
            .abs();
        assert!(
            d < 1e-4,
            "{name}: loss differs by {d} with the sink attached"
        );
        let g1 = l1.backward().unwrap();
        let g2 = loss(&sunk, &batch).backward().unwrap();
        let (mut in_sink, mut in_graph) = (0, 0);
        for (k, v) in &vars {
            let want: Vec<f32> = (plain.get(v).unwrap() * 2.0)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let got = match sink.take(v).unwrap() {
                Some(g) => {
                    in_sink += 1;
                    assert!(g1.get(v).is_none(), "{name}: {k} has a graph gradient too");
                    g
                }
                None => {
                    in_graph += 1;
                    (g1.get(v).unwrap() + g2.get(v).unwrap()).unwrap()
                }
            };
            let got: Vec<f32> = got.flatten_all().unwrap().to_vec1().unwrap();
            let scale = want.iter().fold(1e-3f32, |m, x| m.max(x.abs()));
            let diff = max_diff(&got, &want);
            assert!(
                diff < 1e-5 * scale.max(1.0),
                "{name}: gradient of {k} differs by {diff}"
            );
        }
        assert!(
            in_sink > 0 && in_graph > 0,
            "{name}: {in_sink} sunk, {in_graph} through the graph"
        );
        assert!(
            sink.take(&list[0]).unwrap().is_none(),
            "take leaves the accumulator empty"
        );
    }
}

/// On the CPU in f32 all packs share one row (the fused attention reads only each pack's keys);
/// other dtypes and devices lay packs into padded rows as long as the longest, short packs
/// sharing one (here p4's behind a p1 or p2 group). Both layouts give the same log-probs: f32
/// one-row against an f64 model laid out in padded rows.
#[test]
fn one_row_packing_matches_rows_per_pack() {
    use grpo::logprobs::{completion_logprobs, Entropy, Packing};
    let p1 = vec![5u32, 17, 33, 2, 90];
    let p2 = vec![7u32, 8];
    let p3 = vec![11u32, 12, 13];
    let p4 = vec![21u32];
    let comps: Vec<Vec<u32>> = vec![
        vec![4, 9, 1],
        vec![12],
        vec![3, 3, 3, 3, 8],
        vec![6, 2],
        vec![40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51],
        vec![22, 23],
    ];
    let prompts: Vec<&[u32]> = vec![&p1, &p1, &p2, &p2, &p3, &p4];
    let cs: Vec<&[u32]> = comps.iter().map(|c| c.as_slice()).collect();
    for name in ARCHS {
        let (m, _) = load(name, DType::F32);
        let run = |dtype| {
            let (model, vars) = trainable(&m, dtype);
            let (lp, _) = completion_logprobs(
                &model,
                &prompts,
                &cs,
                0,
                0.9,
                Mode::Train,
                Entropy::Skip,
                Packing::SharedPrompt,
            )
            .unwrap();
            let w = Tensor::arange(0f32, lp.elem_count() as f32, &Device::Cpu)
                .unwrap()
                .reshape(lp.dims())
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let grads = (&lp * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let grad = |k: &str| {
                let g = grads.get(&vars[k]).unwrap().to_dtype(DType::F64).unwrap();
                g.flatten_all().unwrap().to_vec1::<f64>().unwrap()
            };
            let mut keys: Vec<&String> = vars.keys().collect();
            keys.sort();
            let gs: Vec<(String, Vec<f64>)> =
                keys.into_iter().map(|k| (k.clone(), grad(k))).collect();
            (
                lp.to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap(),
                gs,
            )
        };
        let ((one_row, g_one), (per_pack, g_rows)) = (run(DType::F32), run(DType::F64));
        for (i, (a, b)) in one_row.iter().zip(&per_pack).enumerate() {
            for j in 0..comps[i].len() {
                assert!(
                    (a[j] - b[j]).abs() < 1e-4,
                    "{name}: row {i} token {j}: {} vs {}",
                    a[j],
                    b[j]
                );
            }
        }
        for ((k, a), (_, b)) in g_one.iter().zip(&g_rows) {
            let scale = b.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
            let diff = a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs()));
            assert!(
                diff < 1e-4 * scale,
                "{name}: gradient of {k} differs by {diff}"
            );
        }
    }
}
