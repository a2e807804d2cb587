//! Recall tasks that perplexity does not measure: multi-query associative recall (MQAR, as in
//! the Zoology benchmark) and passkey retrieval from natural filler text. Both are seeded, run
//! through the generic [`CausalLm`] forward, and so work for every family on every device.

mod mqar;
mod passkey;

use crate::arch::CausalLm;
use crate::cli::RecallArgs;
use crate::data::TextTokenizer;
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A recall task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Task {
    Mqar,
    Passkey,
}

impl std::str::FromStr for Task {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "mqar" => Self::Mqar,
            "passkey" | "needle" => Self::Passkey,
            _ => bail!("unknown recall task \"{s}\"; choose mqar or passkey"),
        })
    }
}

impl Task {
    pub fn name(self) -> &'static str {
        match self {
            Self::Mqar => "mqar",
            Self::Passkey => "passkey",
        }
    }

    /// The longest sequence the task feeds the model.
    fn tokens(self, a: &RecallArgs) -> usize {
        match self {
            Self::Mqar => a.context_len,
            Self::Passkey => a.lengths.iter().copied().max().unwrap_or(0),
        }
    }
}

/// Accuracy of one slice of a task (a query position, a length and depth).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Bucket {
    pub name: String,
    pub correct: usize,
    pub total: usize,
    pub accuracy: f64,
}

impl Bucket {
    fn new(name: String, correct: usize, total: usize) -> Self {
        Self { name, correct, total, accuracy: correct as f64 / total.max(1) as f64 }
    }
}

/// What a recall task measured.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RecallResult {
    pub task: Task,
    /// Correct answers / questions over the whole task.
    pub accuracy: f64,
    pub correct: usize,
    pub total: usize,
    /// mqar: by query position in the query section (`query 1`, ...) and by the asked pair's
    /// position in the context (`pair 1`, ...); passkey: by context length and depth.
    pub buckets: Vec<Bucket>,
    pub seconds: f64,
}

/// The most float32 logits one recall sequence may produce (64 GiB).
const MAX_LOGITS_BYTES: u128 = 64 << 30;

/// Check the settings of `tasks` against a model before anything runs: one clear error.
///
/// A model with rotary position embeddings cannot read past `max_position_embeddings`; purely
/// recurrent models have no position limit (their config value is the training length), so for
/// them it is not enforced.
pub fn check(tasks: &[Task], a: &RecallArgs, config: &Value, vocab: usize) -> Result<()> {
    for t in tasks {
        match t {
            Task::Mqar => mqar::check(a, vocab)?,
            Task::Passkey => passkey::check(a)?,
        }
        // The forward returns logits for every position: refuse what no memory holds (instead
        // of an allocation abort).
        let logits = t.tokens(a) as u128 * vocab.max(1) as u128 * 4;
        if logits > MAX_LOGITS_BYTES {
            bail!(
                "{} with {} tokens needs {} GiB of logits ({} tokens x vocabulary {vocab}), more than the {} GiB statecut allows; {}",
                t.name(),
                t.tokens(a),
                logits >> 30,
                t.tokens(a),
                MAX_LOGITS_BYTES >> 30,
                match t {
                    Task::Mqar => "use a smaller --context-len",
                    Task::Passkey => "use smaller --lengths",
                }
            );
        }
        if let Some(limit) = position_limit(config) {
            let n = t.tokens(a);
            if n > limit {
                bail!(
                    "{} needs {n} tokens but the model's context is {limit} (max_position_embeddings in config.json); {}",
                    t.name(),
                    match t {
                        Task::Mqar => format!("use --context-len {limit} or less"),
                        Task::Passkey => format!("use --lengths of {limit} or less"),
                    }
                );
            }
        }
    }
    if a.samples == 0 {
        bail!("--samples must be positive");
    }
    Ok(())
}

/// `max_position_embeddings` of a model whose attention uses rotary positions.
fn position_limit(config: &Value) -> Option<usize> {
    let scopes = [Some(config), config.get("text_config")];
    let rotary = scopes.iter().flatten().any(|c| {
        ["rope_theta", "rope_parameters", "rope_scaling", "partial_rotary_factor"]
            .iter()
            .any(|k| c.get(*k).is_some_and(|v| !v.is_null()))
    });
    if !rotary {
        return None;
    }
    scopes.iter().flatten().find_map(|c| c.get("max_position_embeddings").and_then(Value::as_u64)).map(|v| v as usize)
}

/// The vocabulary size a config declares (top level or `text_config`).
pub fn vocab_size(config: &Value) -> Option<usize> {
    config
        .get("vocab_size")
        .or_else(|| config.pointer("/text_config/vocab_size"))
        .and_then(Value::as_u64)
        .map(|v| v as usize)
}

/// Run `task` on `model`.
pub fn run(
    task: Task,
    a: &RecallArgs,
    model: &dyn CausalLm,
    tok: &TextTokenizer,
    vocab: usize,
    quiet: bool,
) -> Result<RecallResult> {
    let start = std::time::Instant::now();
    let (correct, total, buckets) = match task {
        Task::Mqar => mqar::run(a, model, vocab, quiet)?,
        Task::Passkey => passkey::run(a, model, tok, quiet)?,
    };
    Ok(RecallResult {
        task,
        accuracy: correct as f64 / total.max(1) as f64,
        correct,
        total,
        buckets,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Arg-max token of each row of logits [B, V] (float32 on the host).
fn argmax_rows(logits: &candle_core::Tensor) -> Result<Vec<u32>> {
    let l = logits.to_dtype(candle_core::DType::F32)?.argmax(candle_core::D::Minus1)?;
    Ok(l.to_dtype(candle_core::DType::U32)?.flatten_all()?.to_vec1::<u32>()?)
}
