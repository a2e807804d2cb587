//! serde defaults shared by the config readers (`#[serde(default = "...")]` needs functions).

pub fn yes() -> bool {
    true
}

pub fn four() -> usize {
    4
}

/// The norm epsilon fla, transformers' Qwen3.5 and SSE default to.
pub fn eps() -> f64 {
    1e-6
}
