//! serde defaults shared by the config readers (`#[serde(default = "...")]` needs functions).

pub fn yes() -> bool {
    true
}

pub fn one() -> usize {
    1
}

pub fn four() -> usize {
    4
}

/// The norm epsilon fla, transformers' Qwen3.5 and SSE default to.
pub fn eps() -> f64 {
    1e-6
}

pub fn unit() -> f64 {
    1.0
}

/// mamba_ssm's and transformers' Mamba-2 norm epsilon.
pub fn eps5() -> f64 {
    1e-5
}

pub fn d128() -> usize {
    128
}

pub fn d256() -> usize {
    256
}

pub fn silu() -> String {
    "silu".into()
}

pub fn units<const N: usize>() -> [f64; N] {
    [1.0; N]
}
