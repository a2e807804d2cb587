//! Channel selectors: per key head, the set of key/query channels to keep, shared by K and Q.
//!
//! Score-based selectors (L1, S-Wanda, Grad, Rand) keep the top-k channels of a per-channel
//! score; DRRQR keeps the columns a strong rank-revealing QR picks from the calibration
//! activations M = [K_cal; Q_cal] (paper §3.4, Algorithm 2).

mod drrqr;
mod scores;

pub use drrqr::{column_stats, drrqr, reduce_rows, stack as drrqr_stack, ColumnStats, DrrqrInfo, ScoreOn};
pub use scores::{grad_scores, l1_scores, rand_scores, swanda_scores, top_k};

use anyhow::{bail, Result};
use serde::Serialize;
use std::str::FromStr;

/// A selection method (`--method`, or `method` in a recipe: both accept the same names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
#[value(rename_all = "lowercase")]
pub enum Method {
    L1,
    #[value(aliases = ["s-wanda", "wanda"])]
    Swanda,
    #[value(alias = "taylor")]
    Grad,
    #[value(alias = "random")]
    Rand,
    #[value(alias = "rrqr")]
    Drrqr,
}

impl FromStr for Method {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match <Self as clap::ValueEnum>::from_str(s, true) {
            Ok(m) => Ok(m),
            Err(_) => bail!("unknown method \"{s}\"; choose one of l1, swanda, grad, rand, drrqr"),
        }
    }
}

impl Method {
    /// Whether the scores read the projection weights (DRRQR and Rand do not: for them the
    /// weights, hundreds of MB per layer at 7B, are never loaded).
    pub fn reads_weights(self) -> bool {
        matches!(self, Method::L1 | Method::Swanda | Method::Grad)
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::L1 => "l1",
            Self::Swanda => "swanda",
            Self::Grad => "grad",
            Self::Rand => "rand",
            Self::Drrqr => "drrqr",
        }
    }

    /// Whether the method needs calibration activations (K/Q rows or input norms).
    pub fn needs_activations(self) -> bool {
        matches!(self, Self::Swanda | Self::Drrqr | Self::Grad)
    }
}

/// The kept channels of one key head, with what the selector saw.
#[derive(Debug, Clone, Serialize)]
pub struct HeadChoice {
    /// Sorted ascending.
    pub kept: Vec<usize>,
    /// Per-channel score (score-based methods), or the channel's rank in DRRQR's final pivot
    /// order turned into a score (d_k - position), so higher always means "kept first".
    pub scores: Vec<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rrqr: Option<DrrqrInfo>,
}
