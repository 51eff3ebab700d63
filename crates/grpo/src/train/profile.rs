//! `GRPO_PROFILE=1`: where an optimizer step's time goes, measured with the device synchronized
//! at each boundary (a GPU runs its kernels asynchronously: without the synchronization a lap
//! would measure only the launches). Off by default, and then nothing is synchronized or timed.
//! The laps are logged at `info` once per optimizer step.

use std::time::Instant;

use candle_core::Device;
use grpo_models::kernels::{device_kind, profiling, DeviceKind};

/// Named laps since the last one, summed over repeats (the chunks of a step): device-
/// synchronized seconds and, on a GPU, the host's seconds to issue the lap's work before it
/// waited for the device (near the lap: the lap waits on the host's launches; well below it: on
/// the device).
pub(super) struct Laps {
    device: Device,
    t: Instant,
    laps: Vec<(&'static str, f64, f64)>,
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

    /// Ends the lap `name`: waits for the device, adds the time since the last lap (and the
    /// time it took to get to the wait).
    pub(super) fn lap(&mut self, name: &'static str) {
        let issued = self.t.elapsed().as_secs_f64();
        if let Err(e) = self.device.synchronize() {
            tracing::warn!("profile: synchronizing the device failed: {e}");
        }
        let dt = self.t.elapsed().as_secs_f64();
        match self.laps.iter_mut().find(|(n, ..)| *n == name) {
            Some((_, s, i)) => {
                *s += dt;
                *i += issued;
            }
            None => self.laps.push((name, dt, issued)),
        }
        self.t = Instant::now();
    }

    /// Seconds of the laps `names`, summed.
    pub(super) fn seconds(&self, names: &[&str]) -> f64 {
        self.laps
            .iter()
            .filter(|(n, ..)| names.contains(n))
            .map(|(_, s, _)| s)
            .sum()
    }

    /// Logs the laps as one line headed `what` (on a GPU, each with its issue time).
    pub(super) fn report(&self, what: &str) {
        let gpu = device_kind(&self.device) == DeviceKind::Gpu;
        let laps: Vec<String> = self
            .laps
            .iter()
            .map(|(n, s, i)| match gpu {
                true => format!("{n} {s:.3}s (issued in {i:.3}s)"),
                false => format!("{n} {s:.3}s"),
            })
            .collect();
        tracing::info!("profile {what}: {}", laps.join(", "));
    }
}

/// On a GPU, when profiling is on: the most memory in use at once during the phase that just
/// ended (`phase`), and what is in use at its end, from the device's memory pool; with what the
/// pool held from the driver (in use, and freed memory kept for reuse), at most and at the end.
pub(super) fn memory(device: &Device, phase: &str) {
    if !profiling() {
        return;
    }
    if let Some(u) = grpo_models::kernels::gpu_pool_usage(device) {
        let gb = |b: u64| b as f64 / 1e9;
        tracing::info!(
            "profile memory: {phase}: peak {:.2} GB, {:.2} GB at its end (the GPU's memory pool; it held up to {:.2} GB, {:.2} GB at the end)",
            gb(u.used_peak),
            gb(u.used_now),
            gb(u.reserved_peak),
            gb(u.reserved_now)
        );
    }
}

/// The rollout's split (prefill, decoding, choosing tokens), when profiling is on. The sampler
/// synchronizes the device before it times the token choice, so decode_s - sample_s is the
/// model's decoding forward; where tokens are chosen on the device, also the host's time to
/// issue those forwards (near their time: decoding waits on the host's launches; well below:
/// on the device).
pub(super) fn rollout(g: &grpo_models::sampler::GenStats) {
    if profiling() {
        let issued = match g.issue_s > 0.0 {
            true => format!("; its forwards issued in {:.3}s of host time", g.issue_s),
            false => String::new(),
        };
        tracing::info!(
            "profile rollout: prefill {:.3}s ({} prompt tokens), decode {:.3}s ({} steps, {} tokens; choosing tokens {:.3}s of it{issued}), {} compactions",
            g.prefill_s,
            g.prompt_tokens,
            g.decode_s,
            g.decode_steps,
            g.generated_tokens,
            g.sample_s,
            g.compactions
        );
    }
}

/// The old-policy and reference log-prob passes (each ends on a host read, so it is timed
/// synchronized), when profiling is on.
pub(super) fn log_probs(old_s: f64, ref_s: f64, pairs: &[(&[u32], &[u32])], chunk: usize) {
    if profiling() {
        let tokens: usize = pairs.iter().map(|(p, c)| p.len() + c.len()).sum();
        tracing::info!(
            "profile log-probs: old {old_s:.3}s, reference {ref_s:.3}s, {tokens} tokens in chunks of {chunk}"
        );
    }
}
