//! The valid range of every numeric setting, shared by the command-line flags (as clap value
//! parsers) and recipe files, so that a value is rejected the same way wherever it comes from.
//!
//! Upper bounds keep every product of two settings (tokens = windows × seqlen, ...) far from
//! overflowing and reject values no run could use; they are well above any real setting.

use anyhow::Result;

/// An inclusive range of whole numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound {
    pub lo: usize,
    pub hi: usize,
}

const MAX_TOKENS: usize = 1 << 20;

/// Tokens per evaluation window (the model reads L and predicts L).
pub const WINDOW_TOKENS: Bound = Bound { lo: 1, hi: MAX_TOKENS };
/// Tokens per calibration or inspection sequence (a state needs two tokens to be compared).
pub const SEQ_TOKENS: Bound = Bound { lo: 2, hi: MAX_TOKENS };
/// Prompt tokens of a benchmark.
pub const PROMPT_TOKENS: Bound = Bound { lo: 1, hi: MAX_TOKENS };
/// Windows, sequences, decode steps, iterations, save intervals.
pub const COUNT: Bound = Bound { lo: 1, hi: 1 << 20 };
/// Tokens between recall pairs and queries (none is fine).
pub const GAP_TOKENS: Bound = Bound { lo: 0, hi: MAX_TOKENS };
/// Warm-up rounds (none is fine).
pub const WARMUP: Bound = Bound { lo: 0, hi: 1 << 20 };
/// Key+query rows sampled per layer: half keys, half queries, so at least one of each.
pub const ROWS: Bound = Bound { lo: 2, hi: 1 << 24 };
/// Sequences per forward pass.
pub const BATCH: Bound = Bound { lo: 1, hi: 1 << 16 };
/// `--round-to` and `--prune-partitions`: key widths and partition counts.
pub const WIDTH: Bound = Bound { lo: 1, hi: 1 << 16 };

impl Bound {
    fn message(self) -> String {
        format!("must be a whole number from {} to {}", self.lo, self.hi)
    }

    pub fn check(self, v: usize) -> Result<usize, String> {
        if (self.lo..=self.hi).contains(&v) {
            Ok(v)
        } else {
            Err(self.message())
        }
    }

    pub fn parse(self, s: &str) -> Result<usize, String> {
        s.trim().parse::<usize>().map_err(|_| self.message()).and_then(|v| self.check(v))
    }

    /// A clap value parser for this range.
    pub fn parser(self) -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync + 'static {
        move |s| self.parse(s)
    }
}

/// `--ratio`: the fraction of key/query channels removed, strictly between 0 and 1.
pub fn check_ratio(r: f64) -> Result<f64, String> {
    if r > 0.0 && r < 1.0 {
        Ok(r)
    } else {
        Err("outside (0, 1): it is the fraction of key/query channels to remove".into())
    }
}

/// `--rrqr-f`: the strong RRQR tolerance, a finite number above 1.
pub fn check_rrqr_f(f: f64) -> Result<f64, String> {
    if f > 1.0 && f.is_finite() {
        Ok(f)
    } else {
        Err("must be a finite number > 1".into())
    }
}

fn float(s: &str) -> Result<f64, String> {
    s.trim().parse::<f64>().map_err(|_| "not a number".to_string())
}

pub fn parse_ratio(s: &str) -> Result<f64, String> {
    float(s).and_then(check_ratio)
}

pub fn parse_rrqr_f(s: &str) -> Result<f64, String> {
    float(s).and_then(check_rrqr_f)
}

/// A finite number above 0 (learning rates, temperatures, adapter scales).
pub fn parse_positive(s: &str) -> Result<f64, String> {
    float(s).and_then(|v| if v > 0.0 && v.is_finite() { Ok(v) } else { Err("must be a finite number > 0".into()) })
}

/// A finite number of at least 0 (weights, decay, clipping).
pub fn parse_non_negative(s: &str) -> Result<f64, String> {
    float(s).and_then(|v| if v >= 0.0 && v.is_finite() { Ok(v) } else { Err("must be a finite number >= 0".into()) })
}

/// A fraction in [0, 1].
pub fn parse_unit(s: &str) -> Result<f64, String> {
    float(s).and_then(|v| if (0.0..=1.0).contains(&v) { Ok(v) } else { Err("must be a number from 0 to 1".into()) })
}

/// A token budget: a positive whole number, at most 2^50.
pub fn parse_tokens(s: &str) -> Result<u64, String> {
    let v: u64 = s.trim().parse().map_err(|_| "must be a positive whole number of tokens".to_string())?;
    if (1..=1 << 50).contains(&v) {
        Ok(v)
    } else {
        Err("must be a positive whole number of tokens, at most 2^50".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_and_messages() {
        assert_eq!(COUNT.parse("3"), Ok(3));
        for bad in ["0", "-1", "", "1.5", "x", "99999999999999999999999"] {
            assert_eq!(COUNT.parse(bad), Err("must be a whole number from 1 to 1048576".into()), "{bad}");
        }
        assert_eq!(WARMUP.parse("0"), Ok(0));
        assert!(SEQ_TOKENS.parse("1").is_err());
        for bad in ["0", "1", "-0.5", "nan", "inf", "x"] {
            assert!(parse_ratio(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_ratio("0.25"), Ok(0.25));
        for bad in ["1", "0.5", "inf", "nan"] {
            assert!(parse_rrqr_f(bad).is_err(), "{bad}");
        }
    }
}
