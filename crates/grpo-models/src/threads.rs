//! CPU thread-count control shared by candle's kernels and our own rayon loops, and the process
//! settings every program that trains with grpo makes at its start ([`process_setup`]).

/// mimalloc's `purge_delay` option (its index in `mi_option_t`, mimalloc v2 and v3).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
/// mimalloc's `allow_large_os_pages` option (its index in `mi_option_t`, mimalloc v2 and v3).
const MI_OPTION_LARGE_OS_PAGES: libmimalloc_sys::mi_option_t = 6;

/// How long candle's own CPU worker threads spin for the next operation before they sleep,
/// unless `CANDLE_BARRIER_POOL_SPIN_LIMIT` is set. candle runs its large elementwise ops (the
/// backward's adds and products) on a pool of its own beside rayon's, whose workers by default
/// spin 25,000 times after every op; grpo's GEMMs and kernels run on rayon's threads between
/// those ops, so on a 2-core machine the spinning worker took a core's share from them (a tenth
/// of a thread's time in a CPU GRPO step).
const CANDLE_SPIN_LIMIT: &str = "1000";

/// The process settings of a program that trains with grpo (the `grpo` binary, the Python
/// package), which declares mimalloc (`mimalloc::MiMalloc`) its global allocator; call it first,
/// before other threads of the program's own exist and before any tensor work:
/// - mimalloc never hands freed memory back to the OS: training frees and re-allocates the same
///   large activation buffers every step, and re-faulting them (the kernel zeroing fresh pages)
///   took a third of the time of a forward+backward pass. Peak RSS is unchanged; it stays there.
/// - mimalloc asks for transparent huge pages for its arenas (the kernel's default mode here is
///   `madvise`). On this VM every first touch of a 4 KiB page costs about 4 us, and the first
///   training step touches about 1.3 M of them: with 2 MiB pages the first step of the TRL
///   benchmark took 20.3 instead of 24.6 s, the whole 3-step run 59.6 instead of 65.6 s, for 60 MB
///   more peak RSS (4.80 against 4.74 GB). Later steps reuse the memory either way.
/// - candle's pool threads spin less ([`CANDLE_SPIN_LIMIT`]).
pub fn process_setup() {
    // SAFETY: process-wide allocator options, set before the program's own threads exist.
    unsafe {
        libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1);
        libmimalloc_sys::mi_option_set(MI_OPTION_LARGE_OS_PAGES, 1);
    }
    const VAR: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";
    if std::env::var_os(VAR).is_none() {
        std::env::set_var(VAR, CANDLE_SPIN_LIMIT);
    }
}

/// Sizes rayon's global pool (used by candle's CPU kernels and the sampler). Call once, before any
/// tensor work; later calls are errors from rayon and are reported, not fatal.
pub fn set_global_threads(n: usize) -> Result<(), rayon::ThreadPoolBuildError> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n.max(1))
        .build_global()
}

/// Runs `f` on a worker thread of rayon's global pool and waits for it (or runs it in place when
/// already on one). candle's GEMMs and our kernels split their work with rayon: called from
/// outside the pool, the caller sleeps while the pool's threads are woken for every operation;
/// called from a worker, the caller takes its share itself. Measured on 2 cores: the training
/// backward 10% faster.
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        return f();
    }
    rayon::scope(|_| f())
}

/// Resident memory of this process in GB: (current, peak so far), from `/proc/self/status`
/// (`VmRSS`, `VmHWM`). `None` where that file does not exist (not Linux).
pub fn rss_gb() -> Option<(f64, f64)> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb = |key: &str| -> Option<f64> {
        let line = s.lines().find(|l| l.starts_with(key))?;
        line[key.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse::<f64>()
            .ok()
    };
    Some((kb("VmRSS:")? / 1e6 * 1.024, kb("VmHWM:")? / 1e6 * 1.024))
}

/// What the process holds now (Linux; None elsewhere): long runs log it every round so that a
/// leak shows as a trend.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ProcessResources {
    /// Resident memory now and at its peak, GB.
    pub rss_gb: f64,
    pub rss_peak_gb: f64,
    /// Open file descriptors.
    pub open_fds: usize,
    /// Live child processes (scorer programs, tracker bridges).
    pub child_processes: usize,
}

pub fn process_resources() -> Option<ProcessResources> {
    let (rss_gb, rss_peak_gb) = rss_gb()?;
    let open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count();
    // Each thread lists the children it started.
    let child_processes = std::fs::read_dir("/proc/self/task")
        .ok()?
        .filter_map(|t| t.ok())
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .map(|c| c.split_whitespace().count())
        .sum();
    Some(ProcessResources {
        rss_gb,
        rss_peak_gb,
        open_fds,
        child_processes,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn rss_is_positive_and_peak_at_least_current() {
        if let Some((cur, peak)) = super::rss_gb() {
            assert!(cur > 0.0 && peak >= cur, "rss {cur} peak {peak}");
        }
    }

    #[test]
    fn resources_count_files_and_children() {
        let Some(before) = super::process_resources() else {
            return;
        };
        let f = std::fs::File::open("/proc/self/status").unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let during = super::process_resources().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        drop(f);
        assert!(during.open_fds > before.open_fds, "{before:?} {during:?}");
        assert!(
            during.child_processes > before.child_processes,
            "{before:?} {during:?}"
        );
    }
}
