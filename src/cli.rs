//! Command-line interface (clap derive): one struct of flags per subcommand, shared groups flattened.

use crate::bounds::{self, BATCH, COUNT, PROMPT_TOKENS, ROWS, SEQ_TOKENS, WARMUP, WIDTH, WINDOW_TOKENS};
use crate::device::{DeviceSpec, Dtype};
use crate::select::{Method, ScoreOn};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "statecut",
    version,
    about = "Shrink and inspect the recurrent state of linear-attention language models"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Hide progress bars.
    #[arg(short, long, global = true)]
    pub quiet: bool,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Perplexity on a text file over fixed windows.
    Eval(EvalArgs),
    /// Stable rank, utilization and conditioning of the recurrent state per layer and head.
    Inspect(InspectArgs),
    /// Run calibration text through a model and save key/query activations and statistics.
    Calibrate(CalibrateArgs),
    /// Remove key/query channels per head and write a smaller checkpoint.
    Prune(Box<PruneArgs>),
    /// Prefill and decode speed.
    Bench(BenchArgs),
}

/// Which model to load and where.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// Local model directory or Hugging Face hub id (org/name).
    #[arg(short, long)]
    pub model: String,
    /// Hub revision (branch, tag or commit) when --model is a hub id.
    #[arg(long, default_value = "main")]
    pub revision: String,
    /// tokenizer.json to use instead of the model's own.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Compute dtype: auto (f32 on CPU, bf16 on GPU), f32, bf16 or f16.
    #[arg(long, value_enum, default_value_t = Dtype::Auto)]
    pub dtype: Dtype,
    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: DeviceSpec,
}

#[derive(Debug, Args)]
pub struct EvalArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Evaluation text: .jsonl, .txt, .parquet, or a hub dataset id (default: built-in text).
    #[arg(long)]
    pub data: Option<String>,
    #[arg(long, default_value = "text")]
    pub text_column: String,
    /// Tokens predicted per window.
    #[arg(long, default_value_t = 512, value_parser = WINDOW_TOKENS.parser())]
    pub seqlen: usize,
    /// Maximum number of windows.
    #[arg(long, default_value_t = 64, value_parser = COUNT.parser())]
    pub windows: usize,
    /// Windows per forward pass.
    #[arg(long, default_value_t = 1, value_parser = BATCH.parser())]
    pub batch_size: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct InspectArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Calibration text: .jsonl, .txt, .parquet, or a hub dataset id (default: built-in text).
    #[arg(long)]
    pub data: Option<String>,
    #[arg(long, default_value = "text")]
    pub text_column: String,
    /// Number of sequences.
    #[arg(long, default_value_t = 16, value_parser = COUNT.parser())]
    pub nsamples: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 512, value_parser = SEQ_TOKENS.parser())]
    pub seqlen: usize,
    /// Key+query rows sampled per layer for the activation statistics.
    #[arg(long, default_value_t = 5000, value_parser = ROWS.parser())]
    pub rows: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Write SVG spectrum plots (one per layer) into this directory.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

/// Calibration data and sampling.
#[derive(Debug, Clone, Default, Args)]
pub struct CalibArgs {
    /// Calibration text: .jsonl, .txt, .parquet, or a hub dataset `org/name[:subset[:split]]`
    /// (default: built-in text).
    #[arg(long)]
    pub calib: Option<String>,
    /// Field holding the text in jsonl/parquet files [default: text].
    #[arg(long)]
    pub text_column: Option<String>,
    /// Number of calibration sequences [default: 128].
    #[arg(long, value_parser = COUNT.parser())]
    pub nsamples: Option<usize>,
    /// Tokens per calibration sequence [default: 2048].
    #[arg(long, value_parser = SEQ_TOKENS.parser())]
    pub seqlen: Option<usize>,
    /// Seed for row sampling and the rand selector [default: 0].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Key+query rows kept per layer, half keys and half queries, uniform over tokens [default: 5000].
    #[arg(long, value_parser = ROWS.parser())]
    pub rows: Option<usize>,
    /// Also accumulate dL/dW for the key/query projections (needed by --method grad).
    #[arg(long)]
    pub grad: bool,
    /// Sequences per forward pass. Default: 1 on the CPU; on a GPU as many as make 16384 tokens
    /// (1 with --grad, whose backward keeps every layer's activations). Results do not depend on it.
    #[arg(long, value_parser = BATCH.parser())]
    pub batch_size: Option<usize>,
}

#[derive(Debug, Args)]
pub struct CalibrateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub calib: CalibArgs,
    /// Output activations file (.safetensors).
    #[arg(short, long)]
    pub output: PathBuf,
    /// Continue an interrupted run from the partial output file.
    #[arg(long)]
    pub resume: bool,
    /// Save partial results every N sequences.
    #[arg(long, default_value_t = 16, value_parser = COUNT.parser())]
    pub save_every: usize,
}

#[derive(Debug, Clone, Args)]
pub struct PruneArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Recipe file (TOML) with any of the flags below; flags given on the command line win.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Channel selector.
    #[arg(long, value_enum)]
    pub method: Option<Method>,
    /// Fraction of key/query channels to remove per head, in (0, 1).
    #[arg(long, value_parser = bounds::parse_ratio)]
    pub ratio: Option<f64>,
    /// Round the kept width down to a multiple of this (kernel-friendly sizes).
    #[arg(long, value_parser = WIDTH.parser())]
    pub round_to: Option<usize>,
    /// Output directory for the pruned checkpoint.
    #[arg(short, long)]
    pub output: PathBuf,
    /// Replace an existing output directory.
    #[arg(long)]
    pub overwrite: bool,
    #[command(flatten)]
    pub calib: CalibArgs,
    /// Use activations saved by `statecut calibrate` instead of calibrating now.
    #[arg(long)]
    pub activations: Option<PathBuf>,
    /// DRRQR tolerance f > 1 of the strong rank-revealing QR.
    #[arg(long, value_parser = bounds::parse_rrqr_f)]
    pub rrqr_f: Option<f64>,
    /// Which activations DRRQR scores: qk (keys and queries stacked), k or q.
    #[arg(long, value_enum)]
    pub score_on: Option<ScoreOn>,
    /// Evaluate perplexity before and after on this text (.jsonl/.txt/.parquet).
    #[arg(long)]
    pub eval: Option<String>,
    /// Number of --eval windows [default: 64].
    #[arg(long, value_parser = COUNT.parser())]
    pub eval_windows: Option<usize>,
    /// Tokens per --eval window [default: 512].
    #[arg(long, value_parser = WINDOW_TOKENS.parser())]
    pub eval_seqlen: Option<usize>,
    /// Check everything and print the plan without calibrating or writing anything.
    #[arg(long)]
    pub dry_run: bool,
    /// Models with routed state partitions (SSE): keep this many routed partitions per layer,
    /// the ones most often routed to on the calibration text (the router's rows of the others
    /// are dropped).
    #[arg(long, value_parser = WIDTH.parser())]
    pub prune_partitions: Option<usize>,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt length for prefill and before decoding.
    #[arg(long, default_value_t = 512, value_parser = PROMPT_TOKENS.parser())]
    pub prompt_len: usize,
    /// Decode steps timed per batch size.
    #[arg(long, default_value_t = 32, value_parser = COUNT.parser())]
    pub decode_steps: usize,
    /// Comma-separated batch sizes.
    #[arg(long, default_value = "1,16,64", value_delimiter = ',', value_parser = BATCH.parser())]
    pub batch_sizes: Vec<usize>,
    /// Timed rounds per batch size (the median is reported).
    #[arg(long, default_value_t = 3, value_parser = COUNT.parser())]
    pub iterations: usize,
    /// Untimed rounds before them.
    #[arg(long, default_value_t = 1, value_parser = WARMUP.parser())]
    pub warmup: usize,
    /// A second (pruned) model to compare against.
    #[arg(long)]
    pub compare: Option<String>,
    #[arg(long)]
    pub json: bool,
}

fn parse_device(s: &str) -> Result<DeviceSpec, String> {
    s.parse()
}

/// A usage error as one line without the `error:` prefix: `--flag value: why` for a rejected
/// value, in the words statecut's own checks use; clap's first line and tips for the rest.
pub fn usage_error(e: &clap::Error) -> String {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    let text = |k| match e.get(k) {
        Some(ContextValue::String(s)) => Some(s.as_str()),
        _ => None,
    };
    // "--seqlen <SEQLEN>" names the flag as "--seqlen".
    let flag = text(ContextKind::InvalidArg).and_then(|a| a.split_whitespace().next());
    let value = text(ContextKind::InvalidValue).filter(|v| !v.is_empty());
    match (e.kind(), flag, value) {
        (ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand | ErrorKind::MissingSubcommand, _, _) => {
            "a subcommand is required: eval, inspect, calibrate, prune or bench; see --help".into()
        }
        (ErrorKind::ValueValidation, Some(f), Some(v)) => {
            let why = std::error::Error::source(e).map(|s| s.to_string()).unwrap_or_else(|| "invalid value".into());
            format!("{f} {v}: {why}")
        }
        (ErrorKind::InvalidValue, Some(f), Some(v)) => {
            let valid = match e.get(ContextKind::ValidValue) {
                Some(ContextValue::Strings(s)) => s.join(", "),
                _ => String::new(),
            };
            format!("{f} {v}: unknown {}; choose one of {valid}", f.trim_start_matches('-'))
        }
        _ => {
            // clap's message, its continuation lines (missing flags, possible values) and tips.
            let rendered = e.render().to_string();
            let lines = rendered.lines().map(str::trim).filter(|l| !l.is_empty());
            let mut msg = String::new();
            for l in lines.take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information")) {
                let l = l.strip_prefix("error: ").unwrap_or(l);
                if !msg.is_empty() {
                    msg += if l.starts_with("tip:") { "; " } else { " " };
                }
                msg += l;
            }
            msg + "; see --help"
        }
    }
}

impl PruneArgs {
    /// Arguments that take everything from a recipe file (used by tests and tooling).
    pub fn for_recipe(config: &std::path::Path) -> Self {
        Self {
            model: ModelArgs {
                model: String::new(),
                revision: "main".into(),
                tokenizer: None,
                dtype: Dtype::Auto,
                device: DeviceSpec::Cpu,
            },
            config: Some(config.to_path_buf()),
            method: None,
            ratio: None,
            round_to: None,
            output: PathBuf::new(),
            overwrite: false,
            calib: CalibArgs::default(),
            activations: None,
            rrqr_f: None,
            score_on: None,
            eval: None,
            eval_windows: None,
            eval_seqlen: None,
            dry_run: false,
            prune_partitions: None,
        }
    }
}
