//! `prune`: calibrate (or read saved activations), select channels per head, write the smaller
//! checkpoint, reload it, evaluate, report. Every check that can fail cheaply runs first.

use crate::arch::{Family, LoadOptions, SliceRole, StateLayout};
use crate::calib::{CalibSettings, Calibration};
use crate::checkpoint::Checkpoint;
use crate::cli::PruneArgs;
use crate::data::{windows, TextSource};
use crate::recipe::Plan;
use crate::report::{CalibrationInfo, HeadReport, LayerReport, MemoryInfo, Perplexity, PruneReport};
use crate::select::{self, HeadChoice, Method, ScoreOn};
use crate::surgery::{kept_rows, write_checkpoint, KeepSets, Staged};
use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use std::collections::BTreeMap;

/// A head's projection rows: one row-major [dk, D] block per query/key projection slice.
fn head_blocks(
    ckpt: &Checkpoint,
    layout: &StateLayout,
    layer: usize,
    cache: &mut BTreeMap<String, Vec<f32>>,
    source: Option<&BTreeMap<String, candle_core::Tensor>>,
) -> Result<Vec<Vec<Vec<f32>>>> {
    let l = layout.layer(layer).context("layer not in layout")?;
    let dk = layout.dk;
    let mut per_head = vec![Vec::new(); l.key_heads];
    for s in l.slices.iter().filter(|s| matches!(s.role, SliceRole::QueryProj | SliceRole::KeyProj)) {
        let key = format!("{}{}", if source.is_some() { "grad:" } else { "" }, s.tensor);
        if !cache.contains_key(&key) {
            let t = match source {
                Some(g) => g.get(&s.tensor).cloned().with_context(|| {
                    format!("the activations file has no gradient for {}; re-run calibration with --grad", s.tensor)
                })?,
                None => ckpt.tensor_f32(&s.tensor)?,
            };
            if t.dims() != ckpt.info(&s.tensor)?.shape {
                bail!("the activations file's gradient for {} has shape {:?}, not the weight's", s.tensor, t.dims());
            }
            cache.insert(key.clone(), t.flatten_all()?.to_vec1::<f32>()?);
        }
        let data = &cache[&key];
        let cols = ckpt.info(&s.tensor)?.shape[1..].iter().product::<usize>();
        for (h, blocks) in per_head.iter_mut().enumerate() {
            let r0 = s.offset + h * s.head_stride;
            blocks.push(data[r0 * cols..(r0 + dk) * cols].to_vec());
        }
    }
    Ok(per_head)
}

/// Select the kept channels of every head of every prunable layer.
pub(crate) fn select_all(
    ckpt: &Checkpoint,
    layout: &StateLayout,
    plan: &Plan,
    k: usize,
    calib: Option<&Calibration>,
    quiet: bool,
) -> Result<Vec<LayerReport>> {
    let dk = layout.dk;
    let heads: usize = layout.layers.iter().map(|l| l.key_heads).sum();
    let pb = crate::progress::bar(heads as u64, plan.method.name(), quiet);
    let mut out = Vec::new();
    for l in &layout.layers {
        let mut cache = BTreeMap::new();
        let weights = if plan.method.reads_weights() {
            head_blocks(ckpt, layout, l.layer, &mut cache, None)?
        } else {
            vec![Vec::new(); l.key_heads]
        };
        let grads = match (plan.method, calib) {
            (Method::Grad, Some(c)) => Some(head_blocks(ckpt, layout, l.layer, &mut cache, Some(&c.grad_sum))?),
            _ => None,
        };
        let lc = calib.map(|c| &c.collector.layers[&l.layer]);
        // Heads are independent: score them in parallel.
        let heads = weights
            .par_iter()
            .enumerate()
            .map(|(h, w)| -> Result<HeadReport> {
                let acts = lc.map(|lc| (lc.keys.head(h, dk), lc.queries.head(h, dk)));
                // Every activation statistic below depends on M only through MᵀM: work on R.
                let m_qk = acts.as_ref().map(|(kk, qq)| select::reduce_rows(&select::drrqr_stack(&[kk, qq], dk)));
                let choice = match plan.method {
                    Method::L1 => scored(select::l1_scores(w, dk), k),
                    Method::Swanda => {
                        let norms = lc.context("S-Wanda needs calibration")?.input_norms();
                        scored(select::swanda_scores(w, dk, &norms), k)
                    }
                    Method::Grad => {
                        scored(select::grad_scores(w, &grads.as_ref().context("Grad needs gradients")?[h], dk), k)
                    }
                    Method::Rand => scored(select::rand_scores(dk, plan.calib.seed, l.layer, h), k),
                    Method::Drrqr => {
                        let (kk, qq) = acts.as_ref().context("DRRQR needs calibration activations")?;
                        let rows = (kk.len() + qq.len()) / dk;
                        if rows < dk {
                            bail!(
                                "layer {} head {h}: fewer calibration rows ({rows}) than key channels ({dk}): the activation matrix is rank-deficient; raise --rows or calibrate on more tokens",
                                l.layer
                            );
                        }
                        let m = match plan.score_on {
                            ScoreOn::Qk => m_qk.clone().unwrap(),
                            ScoreOn::K => select::reduce_rows(&select::drrqr_stack(&[kk], dk)),
                            ScoreOn::Q => select::reduce_rows(&select::drrqr_stack(&[qq], dk)),
                        };
                        select::drrqr(&m, k, plan.rrqr_f).with_context(|| format!("layer {} head {h}", l.layer))?
                    }
                };
                let (before, after) = match &m_qk {
                    Some(m) => {
                        (Some(select::column_stats(m, None)?), Some(select::column_stats(m, Some(&choice.kept))?))
                    }
                    None => (None, None),
                };
                pb.inc(1);
                Ok(HeadReport { head: h, choice, before, after })
            })
            .collect::<Result<Vec<_>>>()?;
        out.push(LayerReport { layer: l.layer, heads });
    }
    pb.finish_and_clear();
    Ok(out)
}

/// `--recover`'s flags: whether recovery follows, after checking that its flags are only given
/// with it and make sense with pruning.
fn recovery_checks(args: &PruneArgs, plan: &Plan, ckpt: &Checkpoint, layout: &StateLayout) -> Result<bool> {
    let defaults = crate::cli::RecoveryArgs::defaults();
    if !args.recover {
        if args.recovery != defaults
            || args.train_batch_size != crate::cli::RECOVER_BATCH
            || args.train_seqlen != crate::cli::RECOVER_SEQLEN
        {
            bail!("the recovery flags (--steps, --lr, --train-seqlen, ...) take effect only with --recover; add --recover or drop them");
        }
        return Ok(false);
    }
    crate::recover::check_flags(&args.recovery)?;
    if args.recovery.save_adapters {
        bail!("--save-adapters with --recover: the adapters apply to the pruned checkpoint, which --recover does not keep; run `statecut prune`, then `statecut recover --save-adapters`");
    }
    if args.dry_run {
        return Ok(true);
    }
    let data = args.data.as_deref().context("--recover needs --data TEXT, the training text")?;
    let src = TextSource::parse(Some(data), &plan.calib.text_column)?;
    // One batch of training text must exist before calibrating and pruning.
    let tok = crate::data::TextTokenizer::load(&ckpt.dir, plan.tokenizer.as_deref(), &ckpt.config)?;
    let (b, l) = (args.train_batch_size, args.train_seqlen);
    let tokens = tok.stream(src.documents()?, b * l + 1)?;
    if windows(&tokens, l, b).len() < b {
        return Err(crate::recover::short_data(data, tokens.len(), b, l, "--train-batch-size / --train-seqlen"));
    }
    // The input has the pruned model's tensor names: what --train selects is known now.
    crate::recover::plan::plan(ckpt, layout, &args.recovery.train)?;
    Ok(true)
}

fn scored(scores: Vec<f64>, k: usize) -> HeadChoice {
    HeadChoice { kept: select::top_k(&scores, k), scores, rrqr: None }
}

/// Perplexity of a model on prepared windows.
fn ppl(model: &dyn crate::arch::CausalLm, wins: &[&[u32]], quiet: bool) -> Result<f64> {
    Ok(crate::eval::perplexity(model, wins, 1, quiet)?.ppl)
}

/// What a prune run works on, settled before any expensive step: the plan, the opened
/// checkpoint and its layout, the kept width, the edited config and the staging directory.
struct Job<'a> {
    args: &'a PruneArgs,
    plan: Plan,
    ckpt: Checkpoint,
    family: &'static dyn Family,
    layout: StateLayout,
    k: usize,
    config: serde_json::Value,
    model_type: String,
    serving: crate::serving::Serving,
    staged: Staged,
    eval_src: Option<TextSource>,
    calib_src: TextSource,
    saved: Option<Calibration>,
    calibrate_now: bool,
    /// With --recover: the final output, held while `staged` keeps the pruned checkpoint.
    recover_output: Option<Staged>,
}

pub fn run(args: &PruneArgs, quiet: bool) -> Result<()> {
    let job = Job::prepare(args, quiet)?;
    if args.dry_run {
        job.print_plan();
        return Ok(());
    }
    job.execute(quiet)
}

impl<'a> Job<'a> {
    /// Every cheap check: the checkpoint opens and matches its config, the width is reachable
    /// and expressible in the family's config, the output can be staged, the texts and saved
    /// activations parse.
    fn prepare(args: &'a PruneArgs, quiet: bool) -> Result<Self> {
        let mut plan = Plan::resolve(args)?;
        let dir = crate::hub::resolve_model(&args.model.model, &args.model.revision)?;
        let ckpt = Checkpoint::open(&dir)?;
        let family: &'static dyn Family = crate::arch::family_for(&ckpt)?;
        let layout = family.layout(&ckpt)?;
        let k = plan.kept_width(layout.dk)?;
        // The config edit first: a family that cannot express the new width says so before any work.
        let mut config = ckpt.config.clone();
        family.set_key_width(&mut config, &layout, k)?;
        let model_type = ckpt.model_type()?;
        let serving = crate::serving::notes(&model_type, layout.dk, k, layout.layers.first().map_or(0, |l| l.dv));
        // Partition pruning's limits come from the config: checked now, not after calibration.
        if let Some(count) = plan.prune_partitions {
            let keep = layout.layers.iter().map(|l| (l.layer, (0..count).collect())).collect();
            family.keep_partitions(&mut config.clone(), &keep)?;
        }
        let staged = Staged::new(&args.output, args.overwrite, &dir, &ckpt.files)?;
        let eval_src = plan.eval.as_deref().map(|e| TextSource::parse(Some(e), "text")).transpose()?;
        // With --recover the pruned checkpoint is staged under a hidden name and never committed:
        // recovery reads it and writes the output, which is checked and held from now on.
        let (staged, recover_output, eval_src) = match recovery_checks(args, &plan, &ckpt, &layout)? {
            true => {
                let hidden = staged.target.with_file_name(format!(
                    ".{}.statecut-pruned",
                    staged.target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
                ));
                (Staged::new(&hidden, true, &dir, &ckpt.files)?, Some(staged), None)
            }
            false => (staged, None, eval_src),
        };
        let saved = match plan.activations.as_ref().map(|a| a.path.clone()) {
            Some(p) => {
                let (cal, complete) = Calibration::load(&p, &layout)?;
                if !complete {
                    bail!("{} is a partial calibration; finish it with `statecut calibrate --resume`", p.display());
                }
                cal.check_weights(&p, &ckpt)?;
                if plan.method == Method::Grad && cal.grad_sum.is_empty() {
                    bail!("{} has no gradients; calibrate with --grad to use --method grad", p.display());
                }
                plan.adopt(&args.calib, &cal, quiet)?;
                Some(cal)
            }
            None => None,
        };
        // Saved activations need the calibration text again only to count partition routing (the
        // text they were made from may be gone otherwise).
        let calib_src = match (&saved, plan.prune_partitions) {
            (Some(_), None) => TextSource::Builtin,
            _ => TextSource::parse(plan.calib.source.as_deref(), &plan.calib.text_column)?,
        };
        let calibrate_now = saved.is_none() && (plan.method.needs_activations() || plan.calib.source.is_some());
        Ok(Self {
            args,
            plan,
            ckpt,
            family,
            layout,
            k,
            config,
            model_type,
            serving,
            staged,
            eval_src,
            calib_src,
            saved,
            calibrate_now,
            recover_output,
        })
    }

    fn print_plan(&self) {
        let (l, p) = (&self.layout, &self.plan);
        println!(
            "plan: {} d_k {} -> {} with {} (ratio {}), {} layers; calibration: {}; output {}",
            l.family,
            l.dk,
            self.k,
            p.method.name(),
            p.ratio,
            l.layers.len(),
            if self.saved.is_some() {
                "saved activations"
            } else if self.calibrate_now {
                "now"
            } else {
                "none"
            },
            self.args.output.display()
        );
        self.serving.lines().iter().for_each(|l| println!("{l}"));
    }

    /// The stages in order: load, tokenize (the evaluation and calibration texts), calibrate,
    /// select, evaluate the original, write, reload and evaluate the output, report, commit.
    fn execute(mut self, quiet: bool) -> Result<()> {
        let args = self.args;
        let mut clock = Clock::start();
        let loaded = self.load(quiet)?;
        clock.lap("load");
        // The evaluation text is tokenized before calibrating: a text too short fails first.
        let eval_tokens = match (&self.eval_src, &loaded) {
            (Some(src), Some(m)) => {
                Some(m.tokenizer.stream(src.documents()?, self.plan.eval_windows * self.plan.eval_seqlen + 1)?)
            }
            _ => None,
        };
        let wins = eval_tokens.as_ref().map(|t| windows(t, self.plan.eval_seqlen, self.plan.eval_windows));
        if wins.as_ref().is_some_and(Vec::is_empty) {
            bail!(
                "--eval {}: shorter than one window of {} tokens; use a longer text or a smaller --eval-seqlen",
                self.plan.eval.as_deref().unwrap_or_default(),
                self.plan.eval_seqlen
            );
        }
        let seqs = self.calibration_text(loaded.as_ref(), quiet)?;
        clock.lap("tokenize");
        let calibration = self.calibrate(loaded.as_ref(), seqs.as_deref(), quiet)?;
        clock.lap("calibrate");
        let layers = select_all(&self.ckpt, &self.layout, &self.plan, self.k, calibration.as_ref(), quiet)?;
        clock.lap("select");
        let keep: KeepSets =
            layers.iter().map(|l| (l.layer, l.heads.iter().map(|h| h.choice.kept.clone()).collect())).collect();

        // Baseline perplexity on the original, then the output is written, reloaded and
        // evaluated before it is committed.
        let before = match (&wins, &loaded) {
            (Some(w), Some(m)) => Some(ppl(m.model.as_ref(), w, quiet)?),
            _ => None,
        };
        let mut rows = kept_rows(&self.ckpt, &self.layout, &keep)?;
        if let (Some(count), Some(m)) = (self.plan.prune_partitions, &loaded) {
            let seqs = crate::commands::sequences(
                &m.tokenizer,
                &self.calib_src,
                self.plan.calib.nsamples,
                self.plan.calib.seqlen,
                quiet,
            )?;
            let keep_parts = most_used_partitions(m.model.as_ref(), &seqs, count)?;
            rows.extend(self.family.keep_partitions(&mut self.config, &keep_parts)?);
        }
        let mut streamed = loaded.as_ref().is_some_and(|m| m.streamed);
        // The reload runs on the same device, whose kernels are loaded already.
        let device = loaded.as_ref().map(|m| m.model.device().clone());
        drop(loaded);
        clock.lap("evaluate_before");

        let stats = write_checkpoint(&self.ckpt, &rows, &self.config, &self.staged.tmp)?;
        clock.lap("write");
        let out_ckpt = Checkpoint::open(&self.staged.tmp)?;
        let out_layout = self.family.layout(&out_ckpt).context("the pruned config does not parse")?;
        if out_layout.dk != self.k || out_layout.layers.len() != self.layout.layers.len() {
            bail!("internal error: the pruned config describes d_k {} (expected {})", out_layout.dk, self.k);
        }
        let device = match device {
            Some(d) => d,
            None => args.model.device.open()?,
        };
        let dtype = args.model.dtype.resolve(&device);
        let opts = LoadOptions { dtype, device, grad: false };
        let (reloaded, reload_streamed) = crate::commands::open_model(&out_ckpt, self.family, &opts, &args.memory)
            .context("reloading the pruned checkpoint")?;
        streamed |= reload_streamed;
        let after = match &wins {
            Some(w) => Some(ppl(reloaded.as_ref(), w, quiet)?),
            None => None,
        };

        let checked: Vec<bool> = layers
            .iter()
            .flat_map(|l| l.heads.iter().filter_map(|h| h.choice.rrqr.as_ref().map(|r| r.bounds_hold)))
            .collect();
        let (plan, layout, k) = (&self.plan, &self.layout, self.k);
        let report = PruneReport {
            tool: "statecut",
            version: env!("CARGO_PKG_VERSION"),
            model: args.model.model.clone(),
            model_type: self.model_type.clone(),
            family: layout.family.clone(),
            output: args.output.display().to_string(),
            plan: plan.clone(),
            dk_before: layout.dk,
            dk_after: k,
            layers_pruned: layout.layers.len(),
            key_heads_per_layer: layout.layers.first().map_or(0, |l| l.key_heads),
            state_elems_before: layout.state_elems(layout.dk),
            state_elems_after: out_layout.state_elems(k),
            params_before: self.ckpt.num_params(),
            params_after: stats.params,
            seconds: clock.finish(),
            calibration: calibration.as_ref().map(|c| CalibrationInfo {
                source: c.settings.source.clone(),
                sequences: c.sequences_done,
                seqlen: c.settings.seqlen,
                tokens: c.tokens,
                rows_per_layer: c.settings.rows,
            }),
            ppl: match (before, after) {
                (Some(b), Some(a)) => Some(Perplexity {
                    data: plan.eval.clone().unwrap_or_default(),
                    windows: wins.as_ref().map_or(0, Vec::len),
                    seqlen: plan.eval_seqlen,
                    before: b,
                    after: a,
                }),
                _ => None,
            },
            serving: self.serving.clone(),
            rrqr_bounds_hold: (!checked.is_empty()).then(|| (checked.iter().filter(|b| **b).count(), checked.len())),
            memory: {
                let (peak_bytes, measured) = crate::stream::peak_memory(&opts.device);
                MemoryInfo { streamed, peak_bytes, measured }
            },
            layers,
        };
        let prune_recipe = toml::to_string(&recipe_of(plan))?;
        drop(reloaded);
        report.serving.lines().iter().for_each(|l| println!("{l}"));
        println!("{}", report.summary());
        if let Some(output) = self.recover_output.take() {
            return self.recover(output, report, prune_recipe, quiet);
        }
        let tmp = &self.staged.tmp;
        std::fs::write(tmp.join("statecut_report.json"), serde_json::to_string_pretty(&report)? + "\n")?;
        std::fs::write(tmp.join("statecut_report.md"), report.markdown())?;
        std::fs::write(tmp.join("statecut_recipe.toml"), prune_recipe)?;
        self.staged.commit()?;
        if !quiet {
            eprintln!("wrote {}", args.output.display());
        }
        Ok(())
    }

    /// `--recover`: train the pruned checkpoint staged in `self.staged` against the input model
    /// and write the result to the output; the pruned checkpoint is removed either way.
    fn recover(self, output: Staged, report: PruneReport, prune_recipe: String, quiet: bool) -> Result<()> {
        let a = self.args;
        let plan = &self.plan;
        let args = crate::cli::RecoverArgs {
            model: crate::cli::ModelArgs {
                model: self.staged.tmp.display().to_string(),
                tokenizer: plan.tokenizer.clone(),
                ..a.model.clone()
            },
            teacher: a.model.model.clone(),
            data: a.data.clone().context("--recover needs --data")?,
            text_column: plan.calib.text_column.clone(),
            output: a.output.clone(),
            overwrite: a.overwrite,
            batch_size: a.train_batch_size,
            seqlen: a.train_seqlen,
            recipe: a.recovery.clone(),
            eval: plan.eval.clone(),
            eval_windows: plan.eval_windows,
            eval_seqlen: plan.eval_seqlen,
            seed: plan.calib.seed,
            save_every: None,
            resume: false,
            stop_after: None,
            allow_unrelated_teacher: false,
        };
        let from = crate::recover::FromPrune {
            staged: output,
            pruning: crate::recover::Pruning {
                student: format!("{} pruned by {} at {}", a.model.model, plan.method.name(), plan.ratio),
                report,
                prune_recipe,
                command: std::env::args().collect::<Vec<_>>().join(" "),
            },
        };
        if !quiet {
            eprintln!("recovering the pruned model");
        }
        crate::recover::run_after_prune(&args, from, quiet)
    }

    /// The model, when a stage needs it: opened once from the checkpoint already checked.
    fn load(&self, quiet: bool) -> Result<Option<crate::commands::Loaded>> {
        let need = self.calibrate_now || self.eval_src.is_some() || self.plan.prune_partitions.is_some();
        if !need {
            return Ok(None);
        }
        let grad = self.calibrate_now && self.plan.method == Method::Grad;
        let (ckpt, family, layout) = (self.ckpt.clone(), self.family, self.layout.clone());
        // The tokenizer the plan names (the flag, or the recipe's).
        let model = crate::cli::ModelArgs { tokenizer: self.plan.tokenizer.clone(), ..self.args.model.clone() };
        Ok(Some(crate::commands::load_opened(ckpt, family, layout, &model, &self.args.memory, grad, quiet)?))
    }

    /// The calibration sequences, when a calibration pass runs now.
    fn calibration_text(&self, loaded: Option<&crate::commands::Loaded>, quiet: bool) -> Result<Option<Vec<Vec<u32>>>> {
        Ok(match loaded {
            Some(m) if self.saved.is_none() && self.calibrate_now => {
                let c = &self.plan.calib;
                Some(crate::commands::sequences(&m.tokenizer, &self.calib_src, c.nsamples, c.seqlen, quiet)?)
            }
            _ => None,
        })
    }

    /// Saved activations, or a calibration pass over `seqs` now when the method needs one.
    fn calibrate(
        &mut self,
        loaded: Option<&crate::commands::Loaded>,
        seqs: Option<&[Vec<u32>]>,
        quiet: bool,
    ) -> Result<Option<Calibration>> {
        Ok(match (self.saved.take(), loaded, seqs) {
            (Some(c), _, _) => Some(c),
            (None, Some(m), Some(seqs)) => Some(calibrate_on(
                m,
                &self.plan.calib,
                self.plan.method == Method::Grad,
                seqs,
                self.args.calib.batch(),
                quiet,
            )?),
            _ => None,
        })
    }
}

/// One calibration pass of the loaded model `m` over `src` with settings `c`.
pub(crate) fn calibrate(
    m: &crate::commands::Loaded,
    c: &crate::recipe::Calib,
    grad: bool,
    src: &TextSource,
    batch: Option<usize>,
    quiet: bool,
) -> Result<Calibration> {
    let seqs = crate::commands::sequences(&m.tokenizer, src, c.nsamples, c.seqlen, quiet)?;
    calibrate_on(m, c, grad, &seqs, batch, quiet)
}

/// [`calibrate`] over sequences already tokenized.
fn calibrate_on(
    m: &crate::commands::Loaded,
    c: &crate::recipe::Calib,
    grad: bool,
    seqs: &[Vec<u32>],
    batch: Option<usize>,
    quiet: bool,
) -> Result<Calibration> {
    let settings = CalibSettings {
        nsamples: c.nsamples,
        seqlen: c.seqlen,
        seed: c.seed,
        rows: c.rows,
        grad,
        source: c.source.clone().unwrap_or_else(|| "builtin".into()),
    };
    let hidden = m.ckpt.hidden_size()?;
    let mut cal = Calibration::new(settings, &m.layout, hidden);
    cal.text_column = c.text_column.clone();
    cal.run(m.model.as_ref(), seqs, batch, None, quiet)?;
    Ok(cal)
}

/// Tokens routed to each partition, per layer.
struct RoutingCounts(BTreeMap<usize, Vec<f64>>);

impl crate::arch::Observer for RoutingCounts {
    fn needs_logits(&self) -> bool {
        false
    }
    fn routing(&mut self, layer: usize, selected: &candle_core::Tensor) -> Result<()> {
        let n = selected.dim(2)?;
        let c = selected.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let acc = self.0.entry(layer).or_insert_with(|| vec![0.0; n]);
        for row in c.chunks(n) {
            acc.iter_mut().zip(row).for_each(|(a, x)| *a += *x as f64);
        }
        Ok(())
    }
}

/// Per layer, the `count` routed partitions used most often on `seqs` (ascending indices).
fn most_used_partitions(
    model: &dyn crate::arch::CausalLm,
    seqs: &[Vec<u32>],
    count: usize,
) -> Result<BTreeMap<usize, Vec<usize>>> {
    let mut obs = RoutingCounts(BTreeMap::new());
    for s in seqs {
        let ids = candle_core::Tensor::from_vec(s.clone(), (1, s.len()), model.device())?;
        model.forward(&ids, &mut obs)?;
    }
    if obs.0.is_empty() {
        bail!("--prune-partitions: this model has no routed state partitions");
    }
    Ok(obs
        .0
        .into_iter()
        .map(|(l, c)| {
            let mut kept = select::top_k(&c, count.min(c.len()));
            kept.sort_unstable();
            (l, kept)
        })
        .collect())
}

/// The recipe that reproduces a plan.
pub(crate) fn recipe_of(p: &Plan) -> crate::recipe::Recipe {
    crate::recipe::Recipe {
        method: Some(p.method.name().into()),
        ratio: Some(p.ratio),
        round_to: Some(p.round_to),
        rrqr_f: Some(p.rrqr_f),
        score_on: Some(format!("{:?}", p.score_on).to_lowercase()),
        calib: p.calib.source.clone(),
        text_column: Some(p.calib.text_column.clone()),
        nsamples: Some(p.calib.nsamples),
        seqlen: Some(p.calib.seqlen),
        seed: Some(p.calib.seed),
        rows: Some(p.calib.rows),
        eval: p.eval.clone(),
        eval_windows: Some(p.eval_windows),
        eval_seqlen: Some(p.eval_seqlen),
        activations: p.activations.as_ref().map(|a| a.path.clone()),
        activations_sha256: p.activations.as_ref().and_then(|a| a.sha256.clone()),
        prune_partitions: p.prune_partitions,
        // Absolute, so that the recipe replays from another directory.
        tokenizer: p.tokenizer.as_ref().map(|t| t.canonicalize().unwrap_or_else(|_| t.clone())),
    }
}

/// Wall-clock seconds per stage of a run, for the report.
struct Clock {
    start: std::time::Instant,
    last: std::time::Instant,
    laps: std::collections::BTreeMap<String, f64>,
}

impl Clock {
    fn start() -> Self {
        let now = std::time::Instant::now();
        Self { start: now, last: now, laps: Default::default() }
    }

    fn lap(&mut self, stage: &str) {
        let now = std::time::Instant::now();
        self.laps.insert(stage.to_string(), (now - self.last).as_secs_f64());
        self.last = now;
    }

    /// Stages so far, the rest since the last lap as "reload_evaluate", and the total.
    fn finish(&mut self) -> std::collections::BTreeMap<String, f64> {
        self.lap("reload_evaluate");
        let mut laps = self.laps.clone();
        laps.insert("total".into(), self.start.elapsed().as_secs_f64());
        laps
    }
}
