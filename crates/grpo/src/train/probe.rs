//! The instrumentation seam of a step: what watches the math without being part of it. Profiling
//! laps (`GRPO_PROFILE=1`, [`super::profile`]), model FLOP counts ([`crate::flops`]), memory
//! traces, and the fault points tests fire through `GRPO_FAULTS` ([`grpo_models::faults`]: a
//! kill, a NaN, an infinite reward). The phases call one method here where a mark belongs; with
//! profiling and faults off each is a check of a flag.

use candle_core::{Device, Tensor};

use super::profile::Laps;
use crate::flops::FlopShape;
use crate::rollout::{Episode, MicroBatch};
use crate::Result;
use grpo_models::faults;

/// A point where a fault test may kill the process.
pub(super) fn kill_point(name: &str) {
    faults::kill_point(name);
}

/// End of scoring: the `train.scored` kill point, and the `rewards.inf` fault (the first reward
/// of the first completion becomes +inf, as a scorer's overflow would).
pub(super) fn scored(episodes: &mut [Episode]) {
    faults::kill_point("train.scored");
    if faults::fires("rewards.inf") {
        if let Some(x) = episodes.first_mut().and_then(|e| e.rewards.first_mut()) {
            *x = f32::INFINITY;
        }
    }
}

/// What watches one optimizer step's gradients and update: laps on the device's clock when
/// profiling is on, the model FLOPs of its passes, and its fault points.
pub(super) struct Probe {
    laps: Option<Laps>,
    flop_shape: Option<FlopShape>,
    /// Model FLOPs of the passes seen so far.
    pub flops: f64,
}

impl Probe {
    /// A probe for work on `device` (None: nothing to time); `flop_shape` counts the passes'
    /// FLOPs (None: not counted).
    pub(super) fn new(device: Option<&Device>, flop_shape: Option<FlopShape>) -> Probe {
        Probe {
            laps: device.and_then(Laps::start),
            flop_shape,
            flops: 0.0,
        }
    }

    /// Ends lap `name` when profiling is on.
    pub(super) fn lap(&mut self, name: &'static str) {
        if let Some(l) = &mut self.laps {
            l.lap(name);
        }
    }

    /// A micro-batch starts (the `update.micro_batch` kill point).
    pub(super) fn micro_batch(&self) {
        faults::kill_point("update.micro_batch");
    }

    /// A forward chunk's inputs are on the device: its FLOPs are counted, the `inputs` lap ends.
    pub(super) fn inputs(&mut self, mb: &MicroBatch) {
        if let Some(f) = &self.flop_shape {
            self.flops += f.pass(&crate::flops::pass_work(&mb.prompts, &mb.completions));
        }
        self.lap("inputs");
    }

    /// The forward's log-probs are out (`[n, Tc]`): the `forward` lap ends, and the
    /// `update.nan_logits` fault makes them NaN.
    pub(super) fn forward(&mut self, logps: &mut Tensor) -> Result<()> {
        self.lap("forward");
        if faults::fires("update.nan_logits") {
            *logps = (&*logps * f64::NAN)?;
        }
        Ok(())
    }

    /// A chunk's backward is done: the `backward` lap ends, memory is traced.
    pub(super) fn backward(&mut self, device: &Device) {
        self.lap("backward");
        super::trace_memory("a chunk's backward", device);
    }

    /// The gradients of `micro_batches` micro-batches are summed: one profile line, with the
    /// throughput of the forward, loss and backward laps.
    pub(super) fn report_gradients(&self, micro_batches: usize) {
        if let Some(l) = &self.laps {
            let passes = l.seconds(&["forward", "loss", "backward"]);
            let rate = match crate::flops::throughput(self.flops, passes, None) {
                Some((t, _)) => format!("; {t:.2} TFLOP/s over forward, loss and backward"),
                None => String::new(),
            };
            l.report(&format!("gradients ({micro_batches} micro-batches{rate})"));
        }
    }

    /// This rank's gradients are ready, before the world's sums and the optimizer step: the
    /// `update.nan_grad` and `update.nan_loss` faults (a NaN on one rank is the world's after
    /// the sums), the `update.before_step` kill point.
    pub(super) fn before_step(&mut self, grads: &mut [Tensor], loss: &mut f64) -> Result<()> {
        if faults::fires("update.nan_grad") {
            if let Some(g) = grads.first_mut() {
                *g = (&*g * f64::NAN)?;
            }
        }
        if faults::fires("update.nan_loss") {
            *loss = f64::NAN;
        }
        faults::kill_point("update.before_step");
        Ok(())
    }

    /// Logs the laps as one line headed `what` (when profiling is on).
    pub(super) fn report(&self, what: &str) {
        if let Some(l) = &self.laps {
            l.report(what);
        }
    }
}
