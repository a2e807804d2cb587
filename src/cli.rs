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
    /// Perplexity on a text file over fixed windows, LAMBADA last-word accuracy, or recall.
    Eval(EvalArgs),
    /// Stable rank, utilization and conditioning of the recurrent state per layer and head.
    Inspect(InspectArgs),
    /// Run calibration text through a model and save key/query activations and statistics.
    Calibrate(CalibrateArgs),
    /// Remove key/query channels per head and write a smaller checkpoint.
    Prune(Box<PruneArgs>),
    /// Prefill and decode speed.
    Bench(BenchArgs),
    /// Quality against state size: prune a grid of methods x ratios in memory and evaluate each.
    Sweep(Box<SweepArgs>),
    /// Recover what pruning lost: low-rank adapters plus distillation from the unpruned model.
    Recover(Box<RecoverArgs>),
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

/// Where the weights live while a model runs.
#[derive(Debug, Clone, Default, Args)]
pub struct MemoryArgs {
    /// Device memory the weights may use (e.g. 4GiB, 512MiB, or bytes): a model larger than
    /// this runs layer-streamed, one layer's weights on the device at a time. Default: the
    /// device's free memory (on the CPU, weights are taken to fit).
    #[arg(long, value_name = "SIZE", value_parser = crate::stream::parse_size)]
    pub max_device_memory: Option<u64>,
    /// Run layer-streamed whatever the model's size: weights stay on the host and each layer is
    /// loaded once per run.
    #[arg(long)]
    pub offload: bool,
}

impl MemoryArgs {
    pub fn request(&self) -> crate::stream::Request {
        crate::stream::Request { max_device_memory: self.max_device_memory, offload: self.offload }
    }
}

#[derive(Debug, Args)]
pub struct EvalArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub memory: MemoryArgs,
    /// Evaluation text: .jsonl, .txt, .parquet, or a hub dataset id (default: built-in text;
    /// lambada needs it: one passage per document).
    #[arg(long)]
    pub data: Option<String>,
    #[arg(long, default_value = "text")]
    pub text_column: String,
    /// Tokens predicted per window; lambada: the most tokens read per document (longer contexts
    /// are cut from the left).
    #[arg(long, default_value_t = 512, value_parser = WINDOW_TOKENS.parser())]
    pub seqlen: usize,
    /// Maximum number of windows (ppl).
    #[arg(long, default_value_t = 64, value_parser = COUNT.parser())]
    pub windows: usize,
    /// lambada: score only the first N documents [default: all].
    #[arg(long, value_parser = COUNT.parser())]
    pub limit: Option<usize>,
    /// Windows (lambada: documents) per forward pass.
    #[arg(long, default_value_t = 1, value_parser = BATCH.parser())]
    pub batch_size: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// What to measure: ppl (perplexity on --data), lambada (last-word accuracy on --data, as
    /// lm-eval's lambada_openai), mqar or passkey (recall; see --pairs, --lengths).
    #[arg(long, default_value = "ppl")]
    pub task: String,
    #[command(flatten)]
    pub recall: RecallArgs,
}

#[derive(Debug, Args)]
pub struct InspectArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub memory: MemoryArgs,
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
    /// Sequences per forward pass, or `auto` (the default): 1 on the CPU; on a GPU as many as
    /// make 16384 tokens and fit the memory free (with the current layer resident when
    /// layer-streamed; with --grad, whose backward keeps every layer's activations, as many as
    /// those fit). Results do not depend on it.
    #[arg(long, value_parser = batch_size)]
    pub batch_size: Option<Auto>,
}

/// `auto` or a number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Auto {
    Auto,
    Count(usize),
}

impl CalibArgs {
    /// Sequences per pass, `None` for automatic.
    pub fn batch(&self) -> Option<usize> {
        match self.batch_size {
            Some(Auto::Count(n)) => Some(n),
            _ => None,
        }
    }
}

/// `auto`, or a count within [`BATCH`] (the same range as every other batch size).
fn batch_size(s: &str) -> Result<Auto, String> {
    match s {
        "auto" => Ok(Auto::Auto),
        _ => BATCH.parse(s).map(Auto::Count).map_err(|e| format!("{e} or auto")),
    }
}

#[derive(Debug, Args)]
pub struct CalibrateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub memory: MemoryArgs,
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
    #[command(flatten)]
    pub memory: MemoryArgs,
    /// Recipe file (TOML) with any of the flags below; flags given on the command line win.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Channel selector.
    #[arg(long, value_enum)]
    pub method: Option<Method>,
    /// Fraction of key/query channels to remove per head, in (0, 1).
    #[arg(long, value_parser = bounds::parse_ratio)]
    pub ratio: Option<f64>,
    /// Round the kept width down to a multiple of this (kernel-friendly sizes). prune warns when
    /// the width hits a known serving-engine limit and names the --round-to that avoids it.
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
    /// Recover the pruned model before it is written: LoRA plus distillation from the input
    /// model, as `statecut recover` does, with the recovery flags below (--eval is evaluated
    /// on the original, the pruned and the recovered model).
    #[arg(long, requires = "data")]
    pub recover: bool,
    /// With --recover: the training text (.jsonl, .txt, .parquet, or a hub dataset id), read
    /// through --text-column.
    #[arg(long, requires = "recover", help_heading = "Recovery (with --recover)")]
    pub data: Option<String>,
    /// With --recover: sequences per training micro-batch.
    #[arg(long, default_value_t = RECOVER_BATCH, value_parser = BATCH.parser(), help_heading = "Recovery (with --recover)")]
    pub train_batch_size: usize,
    /// With --recover: tokens per training sequence.
    #[arg(long, default_value_t = RECOVER_SEQLEN, value_parser = SEQ_TOKENS.parser(), help_heading = "Recovery (with --recover)")]
    pub train_seqlen: usize,
    #[command(flatten, next_help_heading = "Recovery (with --recover)")]
    pub recovery: RecoveryArgs,
}

/// The recipe's micro-batch: sequences and tokens per sequence.
pub const RECOVER_BATCH: usize = 16;
pub const RECOVER_SEQLEN: usize = 2048;
/// What `--train` selects by default (the `mixers` plan of `crate::recover::plan`).
pub const RECOVER_TRAIN: &str = "mixers";

/// Flags of `recover` (the defaults are the recipe of *On State Reduction in Linear Attention*).
#[derive(Debug, Clone, Args)]
pub struct RecoverArgs {
    /// The pruned model (the student).
    #[command(flatten)]
    pub model: ModelArgs,
    /// The model the student was pruned from (local directory or hub id): the distillation
    /// teacher. Tensors it shares with the student are held once.
    #[arg(long)]
    pub teacher: String,
    /// Training text: .jsonl, .txt, .parquet, or a hub dataset id.
    #[arg(long)]
    pub data: String,
    #[arg(long, default_value = "text")]
    pub text_column: String,
    /// Output directory for the recovered checkpoint (adapters merged).
    #[arg(short, long)]
    pub output: PathBuf,
    /// Replace an existing output directory.
    #[arg(long)]
    pub overwrite: bool,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = RECOVER_BATCH, value_parser = BATCH.parser())]
    pub batch_size: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = RECOVER_SEQLEN, value_parser = SEQ_TOKENS.parser())]
    pub seqlen: usize,
    #[command(flatten)]
    pub recipe: RecoveryArgs,
    /// Evaluate perplexity of the teacher, the pruned and the recovered model on this text.
    #[arg(long)]
    pub eval: Option<String>,
    /// Number of --eval windows.
    #[arg(long, default_value_t = 64, value_parser = COUNT.parser())]
    pub eval_windows: usize,
    /// Tokens per --eval window.
    #[arg(long, default_value_t = 512, value_parser = WINDOW_TOKENS.parser())]
    pub eval_seqlen: usize,
    /// Seed of the adapters' initialisation and of the data order.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Save the training state every N steps (beside the output, for --resume).
    #[arg(long, value_parser = COUNT.parser())]
    pub save_every: Option<usize>,
    /// Continue from the saved training state of an earlier run with the same settings.
    #[arg(long)]
    pub resume: bool,
    /// End this run after step N, saving the training state for --resume (jobs with a time limit).
    #[arg(long, value_parser = COUNT.parser())]
    pub stop_after: Option<usize>,
    /// Distil from a teacher that is not the model the student was pruned from (same family
    /// and vocabulary).
    #[arg(long)]
    pub allow_unrelated_teacher: bool,
}

/// The training recipe, shared by `recover` and `prune --recover`.
#[derive(Debug, Clone, PartialEq, Args)]
pub struct RecoveryArgs {
    /// Optimizer steps [default: 2000].
    #[arg(long, value_parser = COUNT.parser(), conflicts_with = "tokens")]
    pub steps: Option<usize>,
    /// Training tokens instead of --steps (rounded up to whole steps).
    #[arg(long, value_parser = bounds::parse_tokens)]
    pub tokens: Option<u64>,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1, value_parser = COUNT.parser())]
    pub grad_accum: usize,
    /// Rank r of the low-rank adapters.
    #[arg(long, default_value_t = 32, value_parser = WIDTH.parser())]
    pub lora_rank: usize,
    /// Adapter scale numerator: updates are (alpha / r)·B·A.
    #[arg(long, default_value_t = 64.0, value_parser = bounds::parse_positive)]
    pub lora_alpha: f64,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-4, value_parser = bounds::parse_positive)]
    pub lr: f64,
    /// Final learning rate as a fraction of --lr (cosine decay).
    #[arg(long, default_value_t = 0.1, value_parser = bounds::parse_unit)]
    pub min_lr_ratio: f64,
    /// Warm-up as a fraction of the steps.
    #[arg(long, default_value_t = 0.05, value_parser = bounds::parse_unit)]
    pub warmup: f64,
    #[arg(long, default_value_t = 0.1, value_parser = bounds::parse_non_negative)]
    pub weight_decay: f64,
    /// Clip the global gradient norm to this (0: no clipping).
    #[arg(long, default_value_t = 1.0, value_parser = bounds::parse_non_negative)]
    pub clip: f64,
    /// Distillation temperature T.
    #[arg(long, default_value_t = 2.0, value_parser = bounds::parse_positive)]
    pub kd_temperature: f64,
    /// Weight of the distillation term T²·KL (0: cross-entropy only).
    #[arg(long, default_value_t = 1.0, value_parser = bounds::parse_non_negative)]
    pub kd_weight: f64,
    /// Weight of the next-token cross-entropy.
    #[arg(long, default_value_t = 1.0, value_parser = bounds::parse_non_negative)]
    pub lm_weight: f64,
    /// What trains, comma-separated: mixers (adapters on the pruned mixers' q/k/v projections,
    /// their convs, norms and biases whole), lora:PATTERN, full:PATTERN.
    #[arg(long, default_value = RECOVER_TRAIN)]
    pub train: String,
    /// Stop after this many non-finite steps in a row (each is skipped).
    #[arg(long, default_value_t = 10, value_parser = COUNT.parser())]
    pub max_bad_steps: usize,
    /// Also write the adapters in PEFT's layout (adapter_model.safetensors, adapter_config.json)
    /// under OUTPUT/adapters.
    #[arg(long)]
    pub save_adapters: bool,
    /// Which blocks the backward recomputes from their inputs: auto (on a GPU, blocks keep
    /// their activations from the forward while the free memory allows; on the CPU, all are
    /// recomputed), all (the least memory), none (the most).
    #[arg(long, value_enum, default_value_t = Recompute::Auto)]
    pub recompute: Recompute,
    /// Device memory a training step may use under --recompute auto (e.g. 45GiB): blocks keep
    /// their activations only while the step, recomputing the rest, stays within it. Default:
    /// the device's memory.
    #[arg(long, value_name = "SIZE", value_parser = crate::stream::parse_size)]
    pub train_memory: Option<u64>,
}

/// Which blocks a training step recomputes in its backward (see `RecoveryArgs::recompute`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Recompute {
    Auto,
    All,
    None,
}

impl RecoveryArgs {
    /// The flags' defaults, as clap sets them.
    pub fn defaults() -> Self {
        use clap::{FromArgMatches, Parser};
        #[derive(Parser)]
        struct Only {
            #[command(flatten)]
            r: RecoveryArgs,
        }
        let m = <Only as clap::CommandFactory>::command().get_matches_from(["statecut"]);
        Only::from_arg_matches(&m).expect("the defaults parse").r
    }
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
    /// Time the decoding step launched op by op. By default a CUDA device replays it from a
    /// CUDA graph where the model's step allows (every layer recurrent).
    #[arg(long)]
    pub eager: bool,
    #[arg(long)]
    pub json: bool,
}

/// Settings of the recall tasks (`eval --task`, `sweep --recall`).
#[derive(Debug, Clone, PartialEq, Args, serde::Serialize, serde::Deserialize)]
pub struct RecallArgs {
    /// mqar: key-value pairs per sequence.
    #[arg(long, default_value_t = 16, value_parser = COUNT.parser())]
    pub pairs: usize,
    /// mqar: random tokens between the key-value pairs and the first query.
    #[arg(long, default_value_t = 0, value_parser = bounds::GAP_TOKENS.parser())]
    pub gap: usize,
    /// mqar: tokens per sequence (pairs, gap and the query section).
    #[arg(long, default_value_t = 256, value_parser = WINDOW_TOKENS.parser())]
    pub context_len: usize,
    /// mqar: keys and values are drawn from token ids below this [default: the model's vocabulary].
    #[arg(long)]
    pub mqar_vocab: Option<usize>,
    /// passkey: comma-separated context lengths in tokens.
    #[arg(long, value_delimiter = ',', default_value = "2048,4096,8192", value_parser = WINDOW_TOKENS.parser())]
    pub lengths: Vec<usize>,
    /// passkey: comma-separated depths of the passkey in the filler, fractions in [0, 1].
    #[arg(long, value_delimiter = ',', default_value = "0,0.25,0.5,0.75,1")]
    pub depths: Vec<f64>,
    /// passkey: filler text (.jsonl/.txt/.parquet) [default: built-in text].
    #[arg(long)]
    pub filler: Option<String>,
    /// Sequences per task (mqar) or per length and depth (passkey).
    #[arg(long, default_value_t = 32, value_parser = COUNT.parser())]
    pub samples: usize,
    /// Seed of the generated recall sequences.
    #[arg(long, default_value_t = 0)]
    pub task_seed: u64,
}

#[derive(Debug, Args)]
pub struct SweepArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Comma-separated channel selectors.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "drrqr,grad,l1")]
    pub methods: Vec<Method>,
    /// Comma-separated fractions of key/query channels to remove, each in (0, 1).
    #[arg(long, value_delimiter = ',', default_value = "0.25,0.5,0.625,0.75", value_parser = bounds::parse_ratio)]
    pub ratios: Vec<f64>,
    /// Round the kept width down to a multiple of this.
    #[arg(long, value_parser = WIDTH.parser())]
    pub round_to: Option<usize>,
    /// DRRQR tolerance f > 1.
    #[arg(long, value_parser = bounds::parse_rrqr_f)]
    pub rrqr_f: Option<f64>,
    /// Which activations DRRQR scores: qk (keys and queries stacked), k or q.
    #[arg(long, value_enum)]
    pub score_on: Option<ScoreOn>,
    #[command(flatten)]
    pub calib: CalibArgs,
    /// Comma-separated evaluation texts (.jsonl/.txt/.parquet or hub dataset ids).
    #[arg(long, value_delimiter = ',', required = true)]
    pub eval: Vec<String>,
    /// Windows per evaluation text.
    #[arg(long, default_value_t = 64, value_parser = COUNT.parser())]
    pub eval_windows: usize,
    /// Tokens per evaluation window.
    #[arg(long, default_value_t = 512, value_parser = WINDOW_TOKENS.parser())]
    pub eval_seqlen: usize,
    /// Comma-separated recall tasks to run on every cell: mqar, passkey.
    #[arg(long, value_delimiter = ',')]
    pub recall: Vec<String>,
    #[command(flatten)]
    pub recall_opts: RecallArgs,
    /// Largest acceptable relative loss for the recommendation: perplexity increase and recall
    /// drop, as a percentage ("5%") or a fraction (0.05).
    #[arg(long, default_value = "5%")]
    pub budget: String,
    /// Output directory for sweep.json, sweep.md, the curves and the finished cells.
    #[arg(short, long)]
    pub output: PathBuf,
    /// Also write every cell's pruned checkpoint under the output directory.
    #[arg(long)]
    pub write: bool,
    /// Discard the results of an earlier sweep in the output directory instead of reusing them.
    #[arg(long)]
    pub fresh: bool,
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
            "a subcommand is required: eval, inspect, calibrate, prune, sweep or bench; see --help".into()
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
            memory: MemoryArgs::default(),
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
            recover: false,
            data: None,
            train_batch_size: RECOVER_BATCH,
            train_seqlen: RECOVER_SEQLEN,
            recovery: RecoveryArgs::defaults(),
        }
    }
}
