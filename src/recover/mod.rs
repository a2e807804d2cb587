//! `statecut recover`: train a pruned model back towards the model it was pruned from, with
//! low-rank adapters and distillation (the recovery fine-tune of *On State Reduction in Linear
//! Attention*), and write it merged in its own format.
//!
//! The teacher is the unpruned checkpoint, loaded once; the student shares every tensor stored
//! identically in both ([`shared`]), so only the pruned slices and the trained tensors exist
//! twice. The base stays frozen in the compute dtype; adapters, trained tensors and AdamW's
//! moments are float32 ([`params`], [`optim`]). Each block is recomputed in the backward pass
//! and the loss runs over chunks of tokens ([`stages`], [`loss`]).

pub mod loss;
pub mod optim;
pub mod params;
pub mod plan;
mod report;
pub mod shared;
pub mod stages;
pub mod state;

use crate::arch::{family_for, Family, LoadOptions, StateLayout};
use crate::checkpoint::Checkpoint;
use crate::cli::RecoverArgs;
use crate::data::{windows, TextSource, TextTokenizer};
use crate::staging::Staged;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use report::{RecoverPpl, RecoverReport, Trained};
use serde::Serialize;
use state::{Progress, StepLog};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// The settings of a run, as `statecut_recipe.toml` records them.
#[derive(Debug, Clone, Serialize)]
pub struct Recipe {
    pub data: String,
    pub train: String,
    pub steps: usize,
    pub batch_size: usize,
    pub seqlen: usize,
    pub grad_accum: usize,
    pub lora_rank: usize,
    pub lora_alpha: f64,
    pub lr: f64,
    pub min_lr_ratio: f64,
    pub warmup: f64,
    pub weight_decay: f64,
    pub clip: f64,
    pub kd_temperature: f64,
    pub kd_weight: f64,
    pub lm_weight: f64,
    pub adam_beta1: f64,
    pub adam_beta2: f64,
    pub adam_eps: f64,
    pub seed: u64,
    pub dtype: String,
    /// The command that repeats the run.
    pub command: String,
}

/// AdamW as the recipe's trainer (torchtitan) sets it: eps 1e-15 and betas (0.9, 0.95).
const BETAS: (f64, f64) = (0.9, 0.95);
const EPS: f64 = 1e-15;
/// Steps when neither --steps nor --tokens is given (the recipe's).
const DEFAULT_STEPS: usize = 2000;

/// A model directory, opened and checked.
struct Opened {
    ckpt: Checkpoint,
    layout: StateLayout,
}

fn open(model: &str, revision: &str) -> Result<Opened> {
    let dir = crate::hub::resolve_model(model, revision)?;
    let ckpt = Checkpoint::open(&dir)?;
    let layout = family_for(&ckpt)?.layout(&ckpt)?;
    Ok(Opened { ckpt, layout })
}

/// What `prune --recover` hands to recovery: the final output, already checked and staged, and
/// the pruning it reports alongside.
pub struct FromPrune {
    pub staged: Staged,
    pub pruning: Pruning,
}

/// The pruning a `prune --recover` run did, reported with the recovery.
pub struct Pruning {
    pub report: crate::report::PruneReport,
    /// The prune recipe (`prune --config` reads it back).
    pub prune_recipe: String,
    /// How the student is named in the report (its directory is temporary).
    pub student: String,
    pub command: String,
}

/// Everything checked before any weight is loaded.
struct Job<'a> {
    args: &'a RecoverArgs,
    student: Opened,
    teacher: Opened,
    family: &'static dyn Family,
    relation: shared::Relation,
    plan: plan::Plan,
    steps: usize,
    staged: Staged,
    state_path: PathBuf,
    recipe: Recipe,
    data: TextSource,
    eval: Option<TextSource>,
    pruning: Option<Pruning>,
}

pub fn run(args: &RecoverArgs, quiet: bool) -> Result<()> {
    Job::prepare(args, None, quiet)?.execute(quiet)
}

/// The second half of `prune --recover`: `args.model` is the freshly pruned checkpoint.
pub fn run_after_prune(args: &RecoverArgs, from: FromPrune, quiet: bool) -> Result<()> {
    Job::prepare(args, Some(from), quiet)?.execute(quiet)
}

/// Recovery flags that contradict each other (checked before `prune --recover` prunes, too).
pub fn check_flags(r: &crate::cli::RecoveryArgs) -> Result<()> {
    if r.train_memory.is_some() && r.recompute != crate::cli::Recompute::Auto {
        bail!("--train-memory bounds what --recompute auto keeps; drop it, or use --recompute auto");
    }
    // Both terms weighted 0: every step's loss and gradient would be zero and nothing would train.
    if r.kd_weight == 0.0 && r.lm_weight == 0.0 {
        bail!("--kd-weight 0 and --lm-weight 0 leave no loss to train on; give either a weight above 0");
    }
    Ok(())
}

fn steps_of(args: &RecoverArgs) -> usize {
    let per_step = (args.batch_size * args.recipe.grad_accum * args.seqlen) as u64;
    match (args.recipe.steps, args.recipe.tokens) {
        (Some(s), _) => s,
        (None, Some(t)) => t.div_ceil(per_step).max(1) as usize,
        (None, None) => DEFAULT_STEPS,
    }
}

/// The flags as a command line.
fn command_of(args: &RecoverArgs, steps: usize) -> String {
    let a = args;
    format!(
        "statecut recover -m {} --teacher {} --data {} -o {} --steps {steps} --batch-size {} --seqlen {} --grad-accum {} --lora-rank {} --lora-alpha {} --lr {} --min-lr-ratio {} --warmup {} --weight-decay {} --clip {} --kd-temperature {} --kd-weight {} --lm-weight {} --train {} --seed {} --recompute {}",
        a.model.model, a.teacher, a.data, a.output.display(), a.batch_size, a.seqlen, a.recipe.grad_accum, a.recipe.lora_rank, a.recipe.lora_alpha, a.recipe.lr, a.recipe.min_lr_ratio, a.recipe.warmup, a.recipe.weight_decay, a.recipe.clip, a.recipe.kd_temperature, a.recipe.kd_weight, a.recipe.lm_weight, a.recipe.train, a.seed,
        clap::ValueEnum::to_possible_value(&a.recipe.recompute).map_or_else(String::new, |v| v.get_name().to_string())
    ) + &a.recipe.train_memory.map_or_else(String::new, |b| format!(" --train-memory {b}"))
}

impl<'a> Job<'a> {
    fn prepare(args: &'a RecoverArgs, from: Option<FromPrune>, quiet: bool) -> Result<Self> {
        let student = open(&args.model.model, &args.model.revision).context("the student (-m)")?;
        let teacher = open(&args.teacher, &args.model.revision).context("the teacher (--teacher)")?;
        let family = family_for(&student.ckpt)?;
        let plan = plan::plan(&student.ckpt, &student.layout, &args.recipe.train)?;
        let steps = steps_of(args);
        check_flags(&args.recipe)?;
        crate::guard::check_output("-o", &args.output, &teacher.ckpt.dir, &teacher.ckpt.files)?;
        let state_path = state::path_for(&args.output);
        if args.resume && !state_path.exists() {
            bail!("--resume: no saved training state at {}; run without --resume to start", state_path.display());
        }
        if !args.resume && state_path.exists() {
            bail!(
                "a saved training state exists at {}; pass --resume to continue it, or remove it to start over",
                state_path.display()
            );
        }
        // The texts must parse before the long checks.
        let data = TextSource::parse(Some(&args.data), &args.text_column)?;
        let eval = args.eval.as_deref().map(|e| TextSource::parse(Some(e), "text")).transpose()?;
        if let Some(e) = &args.eval {
            if e == &args.data && !quiet {
                eprintln!("warning: --eval is the training text; the recovered perplexity will flatter the model");
            }
        }
        if !quiet {
            eprintln!("checking that the student is a pruned copy of the teacher (reads both checkpoints once)");
        }
        let relation = shared::relate(
            &teacher.ckpt,
            &teacher.layout,
            &student.ckpt,
            &student.layout,
            args.allow_unrelated_teacher,
        )?;
        if !quiet && !relation.differing.is_empty() {
            eprintln!(
                "warning: {} tensors differ from the teacher other than by pruning (first: {})",
                relation.differing.len(),
                relation.differing[0]
            );
        }
        let (staged, pruning) = match from {
            Some(f) => (f.staged, Some(f.pruning)),
            None => (Staged::new(&args.output, args.overwrite, &student.ckpt.dir, &student.ckpt.files)?, None),
        };
        let recipe = Recipe {
            data: args.data.clone(),
            train: args.recipe.train.clone(),
            steps,
            batch_size: args.batch_size,
            seqlen: args.seqlen,
            grad_accum: args.recipe.grad_accum,
            lora_rank: args.recipe.lora_rank,
            lora_alpha: args.recipe.lora_alpha,
            lr: args.recipe.lr,
            min_lr_ratio: args.recipe.min_lr_ratio,
            warmup: args.recipe.warmup,
            weight_decay: args.recipe.weight_decay,
            clip: args.recipe.clip,
            kd_temperature: args.recipe.kd_temperature,
            kd_weight: args.recipe.kd_weight,
            lm_weight: args.recipe.lm_weight,
            adam_beta1: BETAS.0,
            adam_beta2: BETAS.1,
            adam_eps: EPS,
            seed: args.seed,
            dtype: format!("{:?}", args.model.dtype).to_lowercase(),
            command: pruning.as_ref().map_or_else(|| command_of(args, steps), |p| p.command.clone()),
        };
        Ok(Self {
            args,
            student,
            teacher,
            family,
            relation,
            plan,
            steps,
            staged,
            state_path,
            recipe,
            data,
            eval,
            pruning,
        })
    }

    fn execute(self, quiet: bool) -> Result<()> {
        let args = self.args;
        let start = Instant::now();
        let device = args.model.device.open()?;
        let dtype = args.model.dtype.resolve(&device);
        let warm = crate::ops::warm_up::WarmUp::start(&device, dtype);
        let opts = LoadOptions { dtype, device: device.clone(), grad: false };
        let tok =
            TextTokenizer::load(&self.student.ckpt.dir, args.model.tokenizer.as_deref(), &self.student.ckpt.config)?;

        // Training windows of seqlen + 1 tokens: the model reads the first seqlen and predicts the last.
        let want = self.steps * args.recipe.grad_accum * args.batch_size;
        let tokens = tok.stream(self.data.documents()?, want.saturating_mul(args.seqlen).saturating_add(1))?;
        let train = windows(&tokens, args.seqlen, want);
        if train.len() < args.batch_size {
            return Err(short_data(&args.data, tokens.len(), args.batch_size, args.seqlen, "--batch-size / --seqlen"));
        }
        if train.len() < want && !quiet {
            eprintln!(
                "note: the text gives {} sequences of {} tokens; the {} steps read it {:.1} times, in a new order each time",
                train.len(),
                args.seqlen,
                self.steps,
                want as f64 / train.len() as f64
            );
        }
        let eval = self.eval_windows(&tok)?;
        let eval_wins = eval.as_ref().map(|t| windows(t, args.eval_seqlen, args.eval_windows));
        // One copy of the weights: the teacher's tensors pooled, the student reusing them.
        let pool = shared::Pool::default();
        let t_weights = pool.recording(self.teacher.ckpt.var_builder(dtype, &device)?);
        let teacher = crate::arch::layered::Resident::load(
            self.family.layers(&self.teacher.ckpt, &opts, t_weights).context("loading the teacher")?,
        )?;
        let set = crate::arch::trainable::Trainable::keeping_bases();
        let names: Arc<std::collections::BTreeSet<String>> = Arc::new(self.plan.keys().cloned().collect());
        let select: crate::arch::trainable::Selector = Arc::new(move |n: &str| names.contains(n));
        let s_weights = set.wrap(
            pool.reusing(self.student.ckpt.var_builder(dtype, &device)?, Arc::new(self.relation.same.clone())),
            select,
        );
        let student = crate::arch::layered::Resident::load(
            self.family.layers(&self.student.ckpt, &opts, s_weights).context("loading the student")?,
        )?;
        warm.finish();
        let embed = student.layers.embed_name();
        if self.plan.contains_key(&embed) {
            bail!("--train selects the embeddings ({embed}), which recovery keeps frozen");
        }
        // The training models themselves, before any step: the student's variables still hold
        // the pruned weights, and nothing is differentiated.
        let before = match &eval_wins {
            Some(w) => Some(crate::ops::without_gradients(|| -> Result<_> {
                Ok((ppl(&teacher, w, "teacher", quiet)?, ppl(&student, w, "pruned", quiet)?))
            })?),
            None => None,
        };
        let mut params =
            params::ParamSet::new(&self.plan, &set, args.recipe.lora_rank, args.recipe.lora_alpha, args.seed)?;
        let cfg =
            optim::AdamWConfig { weight_decay: args.recipe.weight_decay, beta1: BETAS.0, beta2: BETAS.1, eps: EPS };
        let mut opt = optim::AdamW::new(cfg, &params.values)?;
        let settings = serde_json::to_string(&(&self.recipe, &self.student.ckpt.dir, &self.teacher.ckpt.dir))?;
        let mut progress = if args.resume {
            state::load(&self.state_path, &mut params, &mut opt, &settings)?
        } else {
            Progress { step: 0, adam_t: 0, history: Vec::new(), settings }
        };
        if !quiet {
            eprintln!(
                "training {} parameters ({} adapted tensors, {} whole) from step {} of {}",
                params.elems(),
                self.plan.values().filter(|h| **h == plan::How::Lora).count(),
                self.plan.values().filter(|h| **h == plan::How::Full).count(),
                progress.step,
                self.steps
            );
        }
        let kd = loss::KdConfig {
            temperature: args.recipe.kd_temperature,
            kd_weight: args.recipe.kd_weight,
            lm_weight: args.recipe.lm_weight,
        };
        let order = Order::new(train.len(), args.seed);
        let vars = params.vars();
        let warmup = (args.recipe.warmup * self.steps as f64).round() as usize;
        let tokens_per_step = (args.batch_size * args.recipe.grad_accum * args.seqlen) as u64;
        let pb = crate::progress::bar(self.steps as u64, "recover", quiet);
        pb.set_position(progress.step as u64);
        let train_start = Instant::now();
        let first = progress.step;
        let mut bad_run = 0;
        let pass = stages::Pass::new(&student, &teacher, &kd, args.recipe.recompute)
            .within(args.recipe.train_memory.map(|b| b as usize));
        let mut told_fallback = false;
        let last = args.stop_after.map_or(self.steps, |s| s.min(self.steps));
        while progress.step < last {
            let step = progress.step;
            let step_start = Instant::now();
            let lr = optim::learning_rate(step, self.steps, warmup, args.recipe.lr, args.recipe.min_lr_ratio);
            params.refresh()?;
            let mut acc = HashMap::new();
            let mut parts = loss::Parts::default();
            let scale = 1.0 / tokens_per_step as f64;
            for micro in 0..args.recipe.grad_accum {
                let first_seq = (step * args.recipe.grad_accum + micro) * args.batch_size;
                let batch: Vec<&[u32]> = (0..args.batch_size).map(|i| train[order.at(first_seq + i)]).collect();
                let (ids, targets) = batch_tensors(&batch, &device)?;
                parts +=
                    pass.run(&ids, &targets, scale, &vars, &mut acc).with_context(|| format!("step {}", step + 1))?;
            }
            let grads = params.grads(&acc)?;
            drop(acc);
            let norm = optim::global_norm(&grads)?;
            let loss = parts.loss(&kd);
            let n = parts.tokens.max(1) as f64;
            let skipped = !(norm.is_finite() && loss.is_finite());
            if skipped {
                bad_run += 1;
                if bad_run >= args.recipe.max_bad_steps {
                    bail!(
                        "step {}: {bad_run} steps in a row had a non-finite loss or gradient; stopping (the last saved state, if any, is {}); try a lower --lr",
                        step + 1,
                        self.state_path.display()
                    );
                }
            } else {
                bad_run = 0;
                opt.step(&mut params.values, &grads, lr, optim::clip_scale(norm, args.recipe.clip))?;
            }
            let kd_part = kd.kd_weight * kd.temperature * kd.temperature * parts.kl / n;
            progress.history.push(StepLog {
                step: step + 1,
                loss,
                ce: parts.ce / n,
                kd: kd_part,
                lr,
                grad_norm: norm,
                skipped,
                seconds: step_start.elapsed().as_secs_f64(),
            });
            if pass.fell_back() && !told_fallback && !quiet {
                told_fallback = true;
                pb.suspend(|| {
                    eprintln!(
                        "step {}: out of device memory with blocks' activations kept; recomputing every block from here on (as --recompute all)",
                        progress.step + 1
                    )
                });
            }
            // The first step measures the blocks; the next ones keep what memory allows.
            if progress.step == first + 1 && !quiet && args.recipe.recompute == crate::cli::Recompute::Auto {
                let (kept, held) = pass.kept();
                let blocks = student.blocks.len();
                if kept > 0 {
                    pb.suspend(|| {
                        eprintln!(
                            "{kept} of {blocks} blocks keep their activations for the backward (up to {:.1} GiB each), {} are recomputed",
                            held as f64 / (1u64 << 30) as f64,
                            blocks - kept
                        )
                    });
                }
            }
            progress.step += 1;
            progress.adam_t = opt.t;
            let rate = ((progress.step - first) as u64 * tokens_per_step) as f64 / train_start.elapsed().as_secs_f64();
            pb.set_message(format!("loss {loss:.3} kd {kd_part:.3} {rate:.0} tok/s"));
            pb.inc(1);
            let save = args.save_every.is_some_and(|e| progress.step.is_multiple_of(e))
                || progress.step == last && last < self.steps;
            if save {
                state::save(&self.state_path, &params, &opt, &progress)?;
            }
        }
        pb.finish_and_clear();
        if progress.step < self.steps {
            println!(
                "stopped after step {} of {}; the training state is in {}: continue with --resume",
                progress.step,
                self.steps,
                self.state_path.display()
            );
            return Ok(());
        }
        let train_seconds = train_start.elapsed().as_secs_f64();
        let trained_tokens = (progress.step - first) as u64 * tokens_per_step;
        // The trained model as it is in memory: the merged checkpoint must reproduce it, up to
        // rounding into the stored dtypes (a check that every trained tensor reaches the output).
        let trained = match &eval_wins {
            Some(w) => {
                params.refresh()?;
                Some(crate::ops::without_gradients(|| ppl(&student, w, "trained (in memory)", quiet))?)
            }
            None => None,
        };
        drop((student, teacher, vars));

        // The merged checkpoint, reloaded and evaluated before it is committed.
        let updates = params.updates()?;
        let replaced = merged(&self.student.ckpt, &updates)?;
        crate::surgery::write_checkpoint_with(
            &self.student.ckpt,
            &BTreeMap::new(),
            &replaced,
            &self.student.ckpt.config,
            &self.staged.tmp,
        )?;
        if args.recipe.save_adapters {
            let whole = self.plan.values().filter(|h| **h == plan::How::Full).count();
            if whole > 0 && !quiet {
                eprintln!(
                    "note: OUT/adapters holds the adapters only; the {whole} tensors trained whole are in the merged checkpoint (select adapters alone with --train lora:PATTERN for a PEFT-only equivalent)"
                );
            }
            write_adapters(&self.staged.tmp.join("adapters"), &params, args, &self.student.ckpt)?;
        }
        let out = Checkpoint::open(&self.staged.tmp)?;
        let recovered = match &eval_wins {
            Some(w) => {
                let model = self.family.load(&out, &opts).context("reloading the recovered model")?;
                Some(ppl(model.as_ref(), w, "recovered", quiet)?)
            }
            None => None,
        };
        if let (Some(t), Some(r)) = (trained, recovered) {
            if (r / t - 1.0).abs() > 0.01 && !quiet {
                eprintln!(
                    "warning: the written checkpoint's perplexity ({r:.3}) differs from the trained model's ({t:.3}) by {:.1}%: updates smaller than a step of the stored dtype are lost when the tensors are rounded into it",
                    100.0 * (r / t - 1.0).abs()
                );
            }
        }
        let (peak, _) = crate::stream::peak_memory(&device);
        if let (Some(p), Some(b)) = (peak, args.recipe.train_memory) {
            if p > b && !quiet {
                eprintln!(
                    "warning: the run peaked at {:.1} GiB, above --train-memory ({:.1} GiB): the weights and a step recomputing every block need that much; lower --batch-size (with --grad-accum) to fit",
                    p as f64 / (1u64 << 30) as f64,
                    b as f64 / (1u64 << 30) as f64
                );
            }
        }
        let report = RecoverReport {
            tool: "statecut",
            version: env!("CARGO_PKG_VERSION"),
            student: self.pruning.as_ref().map_or_else(|| args.model.model.clone(), |p| p.student.clone()),
            teacher: args.teacher.clone(),
            output: args.output.display().to_string(),
            family: self.student.layout.family.clone(),
            shared_tensors: self.relation.same.len(),
            trained: Trained {
                adapted: self.plan.iter().filter(|(_, h)| **h == plan::How::Lora).map(|(n, _)| n.clone()).collect(),
                whole: self.plan.iter().filter(|(_, h)| **h == plan::How::Full).map(|(n, _)| n.clone()).collect(),
                params: params.elems(),
            },
            recipe: self.recipe.clone(),
            steps: progress.step,
            skipped_steps: progress.history.iter().filter(|s| s.skipped).count(),
            tokens: progress.step as u64 * tokens_per_step,
            seconds: start.elapsed().as_secs_f64(),
            tokens_per_second: trained_tokens as f64 / train_seconds.max(1e-9),
            peak_memory_bytes: peak,
            ppl: match (before, recovered, trained, &eval_wins) {
                (Some((teacher, pruned)), Some(recovered), Some(trained), Some(w)) => Some(RecoverPpl {
                    data: args.eval.clone().unwrap_or_default(),
                    windows: w.len(),
                    seqlen: args.eval_seqlen,
                    teacher,
                    pruned,
                    trained,
                    recovered,
                }),
                _ => None,
            },
            pruning: self.pruning.as_ref().map(|p| report::Pruning::of(&p.report)),
            history: progress.history,
        };
        let tmp = &self.staged.tmp;
        if let Some(p) = &self.pruning {
            // prune's own report, beside the recovery's, as `prune` writes it.
            std::fs::write(tmp.join("statecut_report.json"), serde_json::to_string_pretty(&p.report)? + "\n")?;
            std::fs::write(tmp.join("statecut_report.md"), p.report.markdown())?;
            std::fs::write(tmp.join("statecut_prune_recipe.toml"), &p.prune_recipe)?;
        }
        std::fs::write(tmp.join("statecut_recover.json"), serde_json::to_string_pretty(&report)? + "\n")?;
        std::fs::write(tmp.join("statecut_recover.md"), report.markdown())?;
        std::fs::write(tmp.join("statecut_recover_loss.svg"), report.loss_svg())?;
        std::fs::write(tmp.join("statecut_recipe.toml"), toml::to_string(&self.recipe)?)?;
        self.staged.commit()?;
        if self.state_path.exists() {
            std::fs::remove_file(&self.state_path)
                .with_context(|| format!("removing {}", self.state_path.display()))?;
        }
        println!("{}", report.summary());
        if !quiet {
            eprintln!("wrote {}", args.output.display());
        }
        Ok(())
    }

    fn eval_windows(&self, tok: &TextTokenizer) -> Result<Option<Vec<u32>>> {
        let (Some(src), Some(e)) = (&self.eval, &self.args.eval) else { return Ok(None) };
        let (n, l) = (self.args.eval_windows, self.args.eval_seqlen);
        let tokens = tok.stream(src.documents()?, n * l + 1)?;
        if windows(&tokens, l, n).is_empty() {
            bail!("--eval {e}: shorter than one window of {l} tokens; use a longer text or a smaller --eval-seqlen");
        }
        Ok(Some(tokens))
    }
}

/// Training text `data` of `tokens` tokens is shorter than one batch of `batch` sequences of
/// `seqlen` + 1 tokens; `flags` names the flags that set the batch.
pub(crate) fn short_data(data: &str, tokens: usize, batch: usize, seqlen: usize, flags: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "--data {data}: {tokens} tokens, fewer than one batch of {batch} sequences of {} tokens; use more text or a smaller {flags}",
        seqlen + 1
    )
}

/// Perplexity of `model` on `wins`, said as `what`.
fn ppl(model: &dyn crate::arch::CausalLm, wins: &[&[u32]], what: &str, quiet: bool) -> Result<f64> {
    let r = crate::eval::perplexity(model, wins, 1, quiet).with_context(|| format!("evaluating the {what} model"))?;
    if !quiet {
        eprintln!("{what}: ppl {:.4}", r.ppl);
    }
    Ok(r.ppl)
}

/// The order training reads the windows in: a new permutation per pass over them, drawn from
/// the seed, so that a step's data depends only on its index (what --resume relies on).
struct Order {
    n: usize,
    seed: u64,
    perms: std::cell::RefCell<HashMap<usize, Vec<usize>>>,
}

impl Order {
    fn new(n: usize, seed: u64) -> Self {
        Self { n, seed, perms: Default::default() }
    }

    fn at(&self, i: usize) -> usize {
        let (epoch, pos) = (i / self.n, i % self.n);
        let mut perms = self.perms.borrow_mut();
        let perm = perms.entry(epoch).or_insert_with(|| {
            let mut p: Vec<usize> = (0..self.n).collect();
            p.shuffle(&mut rand::rngs::StdRng::seed_from_u64(crate::calib::sequence_seed(self.seed, epoch)));
            p
        });
        perm[pos]
    }
}

/// Inputs and targets [B, L] of windows of L + 1 tokens.
pub fn batch_tensors(batch: &[&[u32]], device: &Device) -> Result<(Tensor, Tensor)> {
    let l = batch[0].len() - 1;
    let ids: Vec<u32> = batch.iter().flat_map(|w| w[..l].iter().copied()).collect();
    let targets: Vec<u32> = batch.iter().flat_map(|w| w[1..].iter().copied()).collect();
    Ok((Tensor::from_vec(ids, (batch.len(), l), device)?, Tensor::from_vec(targets, (batch.len(), l), device)?))
}

/// The candle dtype of a stored dtype.
fn dtype_of(d: safetensors::Dtype) -> Result<DType> {
    Ok(match d {
        safetensors::Dtype::F32 => DType::F32,
        safetensors::Dtype::BF16 => DType::BF16,
        safetensors::Dtype::F16 => DType::F16,
        safetensors::Dtype::F64 => DType::F64,
        d => bail!("cannot train a tensor stored as {d:?}"),
    })
}

/// The new stored tensors: W + (α/r)·B·A computed in float32 from the stored W, or the trained
/// value, each in its stored dtype.
pub fn merged(
    ckpt: &Checkpoint,
    updates: &[(String, params::Update)],
) -> Result<BTreeMap<String, crate::surgery::RawTensor<'static>>> {
    let mut out = BTreeMap::new();
    for (name, u) in updates {
        let info = ckpt.info(name)?;
        let value = match u {
            params::Update::Add(delta) => (ckpt.tensor_f32(name)? + delta)?,
            params::Update::Value(v) => v.reshape(info.shape.clone())?,
        };
        let raw = crate::surgery::raw_of(&value.to_dtype(dtype_of(info.dtype)?)?)?;
        out.insert(name.clone(), raw);
    }
    Ok(out)
}

/// The module name PEFT finds under `AutoModelForCausalLM`: multimodal wrappers (Qwen3.5) store
/// the text model under `model.language_model.`, which transformers' causal-LM class loads as
/// `model.` (its `language_model` prefix change), so the adapters are named that way too.
fn peft_module(module: &str) -> String {
    match module.strip_prefix("model.language_model.") {
        Some(rest) => format!("model.{rest}"),
        None => module.to_string(),
    }
}

/// The adapters in PEFT's layout: `base_model.model.<module>.lora_A.weight` [r, in] and
/// `lora_B.weight` [out, r] (float32), with the config PEFT reads.
fn write_adapters(
    dir: &std::path::Path,
    params: &params::ParamSet,
    args: &RecoverArgs,
    ckpt: &Checkpoint,
) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut tensors = Vec::new();
    let mut modules = Vec::new();
    for (name, a, b) in params.adapters()? {
        let module = peft_module(name.strip_suffix(".weight").unwrap_or(&name));
        tensors.push((format!("base_model.model.{module}.lora_A.weight"), a));
        tensors.push((format!("base_model.model.{module}.lora_B.weight"), b));
        modules.push(module);
    }
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    crate::surgery::write_tensors_atomic(&dir.join("adapter_model.safetensors"), &tensors, meta)?;
    let config = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": ckpt.dir.display().to_string(),
        "r": args.recipe.lora_rank,
        "lora_alpha": args.recipe.lora_alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": modules,
        "inference_mode": true,
    });
    std::fs::write(dir.join("adapter_config.json"), serde_json::to_string_pretty(&config)? + "\n")?;
    Ok(())
}
