//! The tiny fixtures of `tests/fixtures/tiny`: one per family, and Gemma 3 with linear RoPE
//! scaling. Shared by the test crates that go over all of them (`#[path]`-included).

/// Every tiny fixture.
#[allow(dead_code)]
pub const ARCHS: [&str; 11] = [
    "llama",
    "llama3",
    "qwen2",
    "qwen3",
    "gpt2",
    "mistral",
    "phi3",
    "phi4mini",
    "gemma2",
    "gemma3",
    "gemma3_linear",
];

/// The families after the Llama layout (sliding windows, fused projections, Gemma's norms).
#[allow(dead_code)]
pub const LATER: [&str; 6] = [
    "mistral",
    "phi3",
    "phi4mini",
    "gemma2",
    "gemma3",
    "gemma3_linear",
];
