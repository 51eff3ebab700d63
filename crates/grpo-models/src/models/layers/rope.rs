//! Rotary position embedding tables (HF's inverse frequencies, Llama 3 scaling, linear scaling,
//! Phi-3's LongRoPE); the rotation itself is [`crate::kernels::rope`]'s.

use candle_core::{DType, Device, Result, Tensor};

use crate::models::config::{Llama3RopeScaling, ModelConfig};

/// Rotary position embedding tables, `[max_pos, head_dim / 2]` each, f32 (HF computes RoPE in f32).
#[derive(Debug, Clone)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
}

/// HF's inverse frequencies, with Llama 3 scaling when configured.
pub fn rope_inv_freq(head_dim: usize, theta: f64, scaling: Option<Llama3RopeScaling>) -> Vec<f64> {
    let inv: Vec<f64> = (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64))
        .collect();
    let Some(s) = scaling else { return inv };
    let old = s.original_max_position_embeddings as f64;
    let low_wavelen = old / s.low_freq_factor;
    let high_wavelen = old / s.high_freq_factor;
    inv.into_iter()
        .map(|f| {
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen < high_wavelen {
                f
            } else if wavelen > low_wavelen {
                f / s.factor
            } else {
                let smooth =
                    (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * f / s.factor + smooth * f
            }
        })
        .collect()
}

impl Rope {
    /// The model's tables (its global layers', with linear scaling where it has one).
    pub fn new(cfg: &ModelConfig, device: &Device) -> Result<Self> {
        Self::with_theta(cfg, cfg.rope_theta, cfg.extras.rope_linear_factor, device)
    }

    /// The tables for base `theta` (Gemma 3's local layers have their own, unscaled) over the
    /// rotated dims (`rotary_dim`, all of the head unless partial), positions divided by
    /// `linear` when given.
    pub fn with_theta(
        cfg: &ModelConfig,
        theta: f64,
        linear: Option<f64>,
        device: &Device,
    ) -> Result<Self> {
        let dim = cfg.extras.rotary_dim.unwrap_or(cfg.head_dim);
        let half = dim / 2;
        let mut inv = rope_inv_freq(dim, theta, cfg.rope_scaling);
        if let Some(f) = linear {
            inv.iter_mut().for_each(|x| *x /= f);
        }
        if let Some(factors) = &cfg.rope_freq_factors {
            if factors.len() != inv.len() {
                candle_core::bail!(
                    "rope_freqs has {} factors, expected head_dim / 2 = {}",
                    factors.len(),
                    inv.len()
                );
            }
            inv.iter_mut().zip(factors).for_each(|(f, d)| *f /= d);
        }
        // Phi-3's LongRoPE within its pretraining length: frequencies divided by the short
        // factors, cos and sin scaled.
        let mut gain = 1f32;
        if let Some(l) = &cfg.extras.long_rope {
            if l.short_factor.len() != inv.len() {
                candle_core::bail!(
                    "longrope has {} short factors, expected {}",
                    l.short_factor.len(),
                    inv.len()
                );
            }
            inv.iter_mut()
                .zip(&l.short_factor)
                .for_each(|(f, s)| *f /= s);
            gain = l.attention_factor as f32;
        }
        // HF multiplies f32 positions by f32 inverse frequencies.
        let inv32: Vec<f32> = inv.iter().map(|&x| x as f32).collect();
        let n = cfg.max_position_embeddings;
        let mut cos = Vec::with_capacity(n * half);
        let mut sin = Vec::with_capacity(n * half);
        for p in 0..n {
            for &f in &inv32 {
                let a = p as f32 * f;
                cos.push(a.cos() * gain);
                sin.push(a.sin() * gain);
            }
        }
        Ok(Self {
            cos: Tensor::from_vec(cos, (n, half), device)?,
            sin: Tensor::from_vec(sin, (n, half), device)?,
        })
    }

    pub fn max_positions(&self) -> usize {
        self.cos.dims()[0]
    }

    /// The tables `[max_pos, head_dim / 2]` (cos, sin).
    pub fn tables_all(&self) -> (&Tensor, &Tensor) {
        (&self.cos, &self.sin)
    }

    /// cos and sin for `positions` [B, T] u32: each [B, T, head_dim / 2] in `dtype`.
    pub fn tables(&self, positions: &Tensor, dtype: DType) -> Result<(Tensor, Tensor)> {
        let (b, t) = positions.dims2()?;
        let flat = positions.flatten_all()?;
        let half = self.cos.dim(1)?;
        let cos = self.cos.index_select(&flat, 0)?.reshape((b, t, half))?;
        let sin = self.sin.index_select(&flat, 0)?.reshape((b, t, half))?;
        Ok((cos.to_dtype(dtype)?, sin.to_dtype(dtype)?))
    }
}
