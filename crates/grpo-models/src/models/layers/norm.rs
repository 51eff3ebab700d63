//! RMSNorm (Llama's) and LayerNorm (GPT-2's), the modules; their kernels are
//! [`crate::kernels::norm`]'s.

use candle_core::{DType, Result, Tensor};
use candle_nn::VarBuilder;

use crate::kernels::portable::layer_norm_diff;
use crate::kernels::{norm, Compute, Mode};

/// RMSNorm as in HF Llama: `w * x / sqrt(mean(x^2) + eps)`.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
    compute: Compute,
}

impl RmsNorm {
    /// The weight as host floats, when it is f32.
    pub fn host_weight(&self) -> Result<Option<Vec<f32>>> {
        match self.weight.dtype() {
            DType::F32 => Ok(Some(self.weight.flatten_all()?.to_vec1()?)),
            _ => Ok(None),
        }
    }
    pub fn eps(&self) -> f64 {
        self.eps
    }
    /// The weight the norm multiplies by (in the compute dtype).
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
    pub fn new(weight: Tensor, eps: f64, compute: Compute) -> Self {
        Self {
            weight,
            eps,
            compute,
        }
    }
    pub fn load(size: usize, eps: f64, vb: VarBuilder, compute: Compute) -> Result<Self> {
        Ok(Self::new(vb.get(size, "weight")?, eps, compute))
    }
    /// Gemma's RMSNorm, which scales by `1 + w`: the same norm over the weight `w + 1` (the
    /// gradient reaches the stored `w` through the add).
    pub fn load_plus_one(size: usize, eps: f64, vb: VarBuilder, compute: Compute) -> Result<Self> {
        Ok(Self::new((vb.get(size, "weight")? + 1.0)?, eps, compute))
    }
    /// The residual sum `x + a` and this norm of it: one kernel on a GPU in inference (a
    /// decoding step's add and post-attention norm), else the add then [`Self::forward`].
    pub fn forward_added(&self, x: &Tensor, a: &Tensor, mode: Mode) -> Result<(Tensor, Tensor)> {
        norm::add_rms_norm(x, a, &self.weight, self.eps, mode, self.compute)
    }
    pub fn forward(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        norm::rms_norm(x, &self.weight, self.eps, mode, self.compute)
    }
}

/// LayerNorm with weight and bias (GPT-2).
#[derive(Debug, Clone)]
pub struct LayerNorm {
    pub(super) weight: Tensor,
    pub(super) bias: Tensor,
    pub(super) eps: f64,
}

impl LayerNorm {
    pub fn load(size: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            weight: vb.get(size, "weight")?,
            bias: vb.get(size, "bias")?,
            eps,
        })
    }
    pub fn forward(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        match mode {
            Mode::Infer => candle_nn::ops::layer_norm(
                &x.contiguous()?,
                &self.weight,
                &self.bias,
                self.eps as f32,
            ),
            Mode::Train => layer_norm_diff(x, &self.weight, &self.bias, self.eps),
        }
    }
}
