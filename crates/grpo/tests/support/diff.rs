//! Tensor comparisons shared by the test crates (`#[path]`-included).

use candle_core::{DType, Tensor};

/// The largest |a - b|, compared in f32.
#[allow(dead_code)]
pub fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    max_abs(&(f(a) - f(b)).unwrap())
}

/// The largest |a|, in f32.
#[allow(dead_code)]
pub fn max_abs(a: &Tensor) -> f32 {
    a.to_dtype(DType::F32)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}
