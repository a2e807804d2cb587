//! dense linear algebra on calibration/activation matrices, built on faer:
//! strong rank-revealing qr for channel selection and spectral statistics.

pub mod rrqr;
pub mod spectrum;

pub use rrqr::{check_bounds, pivoted_qr_order, strong_rrqr, RrqrBounds, RrqrOptions, RrqrSelection};
pub use spectrum::{condition_number, energy_entropy, singular_values, stable_rank, SpectrumStats};
