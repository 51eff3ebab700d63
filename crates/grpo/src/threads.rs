//! CPU thread-count control shared by candle's kernels and our own rayon loops.

/// Sizes rayon's global pool (used by candle's CPU kernels and the sampler). Call once, before any
/// tensor work; later calls are errors from rayon and are reported, not fatal.
pub fn set_global_threads(n: usize) -> Result<(), rayon::ThreadPoolBuildError> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n.max(1))
        .build_global()
}
