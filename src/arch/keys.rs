//! Typed reads of config.json values, each error naming the key.

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// An integer key, or `default` when absent (an error when absent without one).
pub fn usize_of(c: &Value, key: &str, default: Option<usize>) -> Result<usize> {
    match c.get(key) {
        Some(v) => v.as_u64().map(|v| v as usize).with_context(|| format!("config key {key} is not an integer: {v}")),
        None => default.with_context(|| format!("config.json has no {key}")),
    }
}

/// The first of `keys` present (aliases), or `default`.
pub fn usize_any(c: &Value, keys: &[&str], default: Option<usize>) -> Result<usize> {
    match keys.iter().find(|k| c.get(**k).is_some_and(|v| !v.is_null())) {
        Some(k) => usize_of(c, k, None),
        None => default.with_context(|| format!("config.json has no {}", keys.join(" or "))),
    }
}

pub fn bool_of(c: &Value, key: &str, default: bool) -> bool {
    c.get(key).and_then(Value::as_bool).unwrap_or(default)
}

/// A number key (null or absent: `default`).
pub fn f64_of(c: &Value, key: &str, default: f64) -> Result<f64> {
    match c.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v.as_f64().with_context(|| format!("config key {key} is not a number: {v}")),
    }
}

/// A list of `n` numbers (null or absent: `default`).
pub fn f64s_of<const N: usize>(c: &Value, key: &str, default: [f64; N]) -> Result<[f64; N]> {
    match c.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Array(a)) if a.len() == N && a.iter().all(Value::is_number) => {
            Ok(std::array::from_fn(|i| a[i].as_f64().unwrap_or_default()))
        }
        Some(v) => bail!("config key {key} is {v}, expected a list of {N} numbers"),
    }
}

/// RoPE theta at the top level (released configs) or in transformers 5's `rope_parameters`.
pub fn rope_theta(c: &Value, default: f64) -> f64 {
    c.get("rope_parameters")
        .and_then(|r| r.get("rope_theta"))
        .and_then(Value::as_f64)
        .or_else(|| c.get("rope_theta").and_then(Value::as_f64))
        .unwrap_or(default)
}
