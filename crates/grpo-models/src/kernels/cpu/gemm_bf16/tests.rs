use super::test_values as values;
use super::*;

/// The start-up rate check measures two positive, finite rates.
#[test]
fn rates_are_measured() {
    let (bf16, f32) = rates().unwrap();
    assert!(bf16.is_finite() && bf16 > 0.0 && f32.is_finite() && f32 > 0.0);
}

#[test]
fn rounding_is_nearest_even_like_half() {
    for x in values(10_000, 1)
        .into_iter()
        .chain([0.0, -0.0, 1e30, -3.0e-39, f32::INFINITY])
    {
        assert_eq!(to_bf16(x), half::bf16::from_f32(x).to_bits(), "{x}");
    }
    assert!(from_bf16(to_bf16(f32::NAN)).is_nan());
    // The vector conversion (16 at a time, and a tail) gives the same bits.
    let v: Vec<f32> = values(1000, 5)
        .into_iter()
        .chain([
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            3.0e-39,
            -0.0,
            65504.0,
            1.0e38,
        ])
        .collect();
    let mut d = vec![0u16; v.len()];
    to_bf16_slice(&v, &mut d);
    assert!(d.iter().zip(&v).all(|(h, x)| *h == to_bf16(*x)));
}

/// `rows x cols` values laid out with strides `(rs, cs)` in a buffer (gaps hold NaN, which
/// must never be read), and the view of them.
fn laid_out(v: &[f32], rows: usize, cols: usize, layout: usize) -> (Vec<f32>, isize, isize) {
    let (rs, cs) = match layout {
        0 => (cols, 1),         // row-major
        1 => (1, rows),         // column-major (a transposed view)
        _ => (2 * cols + 1, 2), // neither stride 1
    };
    let mut buf = vec![f32::NAN; (rows - 1) * rs + (cols - 1) * cs + 1];
    for r in 0..rows {
        for c in 0..cols {
            buf[r * rs + c * cs] = v[r * cols + c];
        }
    }
    (buf, rs as isize, cs as isize)
}

/// Every variant equals the plain twin bit for bit, and the product is the f64 product of the
/// bf16-rounded inputs within f32 summation error; every layout of both inputs (row-major,
/// transposed, neither), accumulation into a contiguous or strided output, odd `k`, a
/// ragged last panel and a second row block.
#[test]
fn every_variant_equals_the_twin_and_the_rounded_product() {
    for &(m, n, k) in &[(1, 5, 7), (13, 40, 64), (200, 33, 129), (12, 64, 2)] {
        let a = values(m * k, 2); // [m, k]
        let b = values(k * n, 3); // [k, n]
        let c0 = values(m * n, 4);
        for (la, lb) in [(0, 1), (1, 0), (0, 0), (1, 1), (2, 2)] {
            let (abuf, ars, acs) = laid_out(&a, m, k, la);
            let (bbuf, brs, bcs) = laid_out(&b, k, n, lb);
            let av = Strided {
                ptr: abuf.as_ptr(),
                rs: ars,
                cs: acs,
            };
            let bv = Strided {
                ptr: bbuf.as_ptr(),
                rs: brs,
                cs: bcs,
            };
            for (acc, dst_t) in [(false, false), (true, true), (true, false)] {
                // dst row-major, or stored transposed ([n, m]) to exercise its strides.
                let (drs, dcs) = if dst_t { (1, m) } else { (n, 1) };
                let run = |isa: Isa| {
                    let mut d = vec![0f32; m * n];
                    for r in 0..m {
                        for c in 0..n {
                            d[r * drs + c * dcs] = c0[r * n + c];
                        }
                    }
                    unsafe {
                        gemm_on(
                            isa,
                            m,
                            n,
                            k,
                            d.as_mut_ptr(),
                            drs as isize,
                            dcs as isize,
                            acc,
                            av,
                            bv,
                        )
                    };
                    (0..m * n)
                        .map(|i| d[(i / n) * drs + (i % n) * dcs])
                        .collect::<Vec<f32>>()
                };
                let want = run(Isa::Baseline);
                let at = format!("[{m},{n},{k}] layouts {la}/{lb} acc {acc} dst_t {dst_t}");
                let near_exact = |got: &[f32], isa: Isa| {
                    for r in 0..m {
                        for c in 0..n {
                            let exact: f64 = (0..k)
                                .map(|i| {
                                    from_bf16(to_bf16(a[r * k + i])) as f64
                                        * from_bf16(to_bf16(b[i * n + c])) as f64
                                })
                                .sum::<f64>()
                                + if acc { c0[r * n + c] as f64 } else { 0.0 };
                            let got = got[r * n + c] as f64;
                            assert!(
                                (got - exact).abs() < 1e-5 * (k as f64),
                                "{isa:?} {at} ({r},{c}): {got} against {exact}"
                            );
                        }
                    }
                };
                near_exact(&want, Isa::Baseline);
                for isa in Isa::ALL {
                    if isa.usable() != isa {
                        continue;
                    }
                    let got = run(isa);
                    if isa == Isa::Amx {
                        // AMX's rounding of a pair's products is its own (module docs).
                        near_exact(&got, isa);
                        continue;
                    }
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{isa:?} {at}"
                    );
                }
            }
        }
    }
}
