//! The seam for data-parallel training: the processes of one run, through which gradients, token
//! counts and metrics are reduced. One process ([`SingleProcess`]) is today's only world; an MPI
//! world plugs in here without touching the loop.

use candle_core::Tensor;

use crate::Result;

/// The processes of one training run.
pub trait World {
    /// This process's rank, `0..size`.
    fn rank(&self) -> usize;
    /// How many processes train together.
    fn size(&self) -> usize;
    /// Sums `xs` element-wise over every process, in place (token counts, metric sums).
    fn sum_f64(&self, xs: &mut [f64]) -> Result<()>;
    /// Sums each gradient over every process, in place, before clipping and the optimizer step.
    fn sum_grads(&self, grads: &mut [Tensor]) -> Result<()>;
    /// Whether this process writes logs, metrics and checkpoints.
    fn is_main(&self) -> bool {
        self.rank() == 0
    }
}

/// One process: every reduction is the identity.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleProcess;

impl World for SingleProcess {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn sum_f64(&self, _xs: &mut [f64]) -> Result<()> {
        Ok(())
    }
    fn sum_grads(&self, _grads: &mut [Tensor]) -> Result<()> {
        Ok(())
    }
}
