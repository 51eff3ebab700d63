//! `GRPO_PROFILE=1`: where an optimizer step's time goes, measured with the device synchronized
//! at each boundary (a GPU runs its kernels asynchronously: without the synchronization a lap
//! would measure only the launches). Off by default, and then nothing is synchronized or timed.
//! The laps are logged at `info` once per optimizer step.

use std::time::Instant;

use candle_core::Device;
use grpo_models::kernels::profiling;

/// Named laps since the last one, summed over repeats (the chunks of a step).
pub(super) struct Laps {
    device: Device,
    t: Instant,
    laps: Vec<(&'static str, f64)>,
}

impl Laps {
    /// Laps on `device`'s clock, or `None` when profiling is off.
    pub(super) fn start(device: &Device) -> Option<Laps> {
        profiling().then(|| Laps {
            device: device.clone(),
            t: Instant::now(),
            laps: Vec::new(),
        })
    }

    /// Ends the lap `name`: waits for the device, adds the time since the last lap.
    pub(super) fn lap(&mut self, name: &'static str) {
        if let Err(e) = self.device.synchronize() {
            tracing::warn!("profile: synchronizing the device failed: {e}");
        }
        let dt = self.t.elapsed().as_secs_f64();
        match self.laps.iter_mut().find(|(n, _)| *n == name) {
            Some((_, s)) => *s += dt,
            None => self.laps.push((name, dt)),
        }
        self.t = Instant::now();
    }

    /// Logs the laps as one line headed `what`.
    pub(super) fn report(&self, what: &str) {
        let laps: Vec<String> = self
            .laps
            .iter()
            .map(|(n, s)| format!("{n} {s:.3}s"))
            .collect();
        tracing::info!("profile {what}: {}", laps.join(", "));
    }
}

/// Ends lap `name` when profiling is on.
pub(super) fn lap(laps: &mut Option<Laps>, name: &'static str) {
    if let Some(l) = laps {
        l.lap(name);
    }
}
