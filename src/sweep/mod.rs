//! `sweep`: quality against state size over a grid of selectors x ratios. One calibration
//! pass feeds every selection; each (method, ratio) is evaluated on a pruned view of the
//! weights sliced in memory ([`Checkpoint::sliced`]), so nothing is written unless asked.
//! Finished cells are saved as they finish and reused when the same sweep runs again.

mod layers;
mod report;
mod view;

pub use report::{recommend, SweepReport};
pub use view::RowMap;

use crate::arch::{Family, LoadOptions, StateLayout};
use crate::calib::Calibration;
use crate::checkpoint::Checkpoint;
use crate::cli::SweepArgs;
use crate::data::{windows, TextSource, TextTokenizer};
use crate::recall::{RecallResult, Task};
use crate::recipe::{Calib, Plan, Recipe};
use crate::select::{Method, ScoreOn};
use crate::surgery::{kept_rows, KeepSets};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Everything that changes every cell's numbers: a saved cell is reused only under the same.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Settings {
    pub model: String,
    pub revision: String,
    /// `--tokenizer`, when the model's own is not used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
    pub dtype: String,
    pub device: String,
    pub calib: Option<String>,
    pub text_column: String,
    pub nsamples: usize,
    pub seqlen: usize,
    pub seed: u64,
    pub rows: usize,
    pub round_to: usize,
    pub rrqr_f: f64,
    pub score_on: String,
    pub eval: Vec<String>,
    pub eval_windows: usize,
    pub eval_seqlen: usize,
    pub recall: Vec<Task>,
    pub recall_opts: crate::cli::RecallArgs,
}

/// How much of a layer's calibration key/query activations the kept channels cannot express:
/// ‖M − Π_S M‖_F / ‖M‖_F per head (Π_S: projection on the kept columns' span), 0 = lossless.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LayerLoss {
    pub layer: usize,
    pub mean: f64,
    pub worst: f64,
    pub worst_head: usize,
}

/// One evaluated point of the grid (method "none": the unpruned model).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Cell {
    pub method: String,
    pub ratio: f64,
    pub dk: usize,
    pub state_elems: usize,
    /// Perplexity per evaluation text, in the order of `Settings::eval`.
    pub ppl: Vec<f64>,
    pub recall: Vec<RecallResult>,
    pub layers: Vec<LayerLoss>,
    /// Wall-clock seconds: select, load, eval, recall.
    pub seconds: BTreeMap<String, f64>,
}

/// Parse "5%" or "0.05" into a fraction.
pub fn parse_budget(s: &str) -> Result<f64> {
    let t = s.trim();
    let v = match t.strip_suffix('%') {
        Some(p) => p.trim().parse::<f64>().map(|x| x / 100.0),
        None => t.parse::<f64>(),
    };
    match v {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => bail!("--budget {s}: expected a percentage (\"5%\") or a fraction (0.05), not negative"),
    }
}

/// Sum of wall-clock seconds per stage.
#[derive(Default)]
struct Stages(BTreeMap<String, f64>);

impl Stages {
    fn add(&mut self, stage: &str, since: Instant) -> f64 {
        let s = since.elapsed().as_secs_f64();
        *self.0.entry(stage.to_string()).or_default() += s;
        s
    }
}

/// The file a cell is saved in.
fn cell_path(dir: &Path, method: &str, ratio: f64) -> PathBuf {
    dir.join("cells").join(format!("{method}-{ratio}.json"))
}

fn write_atomic(path: &Path, text: &str) -> Result<()> {
    crate::staging::write_atomic(path, |tmp| {
        std::fs::write(tmp, text).with_context(|| format!("writing {}", tmp.display()))
    })
}

/// A validated sweep, before anything heavy runs.
struct Grid {
    methods: Vec<Method>,
    /// (ratio, kept width)
    ratios: Vec<(f64, usize)>,
    plans: BTreeMap<(usize, usize), Plan>,
}

fn grid(a: &SweepArgs, calib: &Calib, dk: usize) -> Result<Grid> {
    let mut methods: Vec<Method> = Vec::new();
    for &m in &a.methods {
        if !methods.contains(&m) {
            methods.push(m);
        }
    }
    if methods.is_empty() || a.ratios.is_empty() {
        bail!("--methods and --ratios must each name at least one value");
    }
    let score_on = a.score_on.unwrap_or(ScoreOn::Qk);
    let rrqr_f = a.rrqr_f.unwrap_or(1.5);
    if !(rrqr_f > 1.0 && rrqr_f.is_finite()) {
        bail!("--rrqr-f {rrqr_f} must be a finite number > 1");
    }
    let mut ratios: Vec<f64> = a.ratios.clone();
    ratios.sort_by(f64::total_cmp);
    ratios.dedup();
    let mut out = Grid { methods: methods.clone(), ratios: Vec::new(), plans: BTreeMap::new() };
    for &ratio in &ratios {
        if !(ratio > 0.0 && ratio < 1.0) {
            bail!("--ratios {ratio} is outside (0, 1): each ratio is the fraction of key/query channels to remove");
        }
        let plan = |method| Plan {
            method,
            ratio,
            round_to: a.round_to.unwrap_or(1),
            rrqr_f,
            score_on,
            calib: calib.clone(),
            eval: None,
            eval_windows: a.eval_windows,
            eval_seqlen: a.eval_seqlen,
            activations: None,
            prune_partitions: None,
            tokenizer: a.model.tokenizer.clone(),
            recipe: Recipe::default(),
        };
        let k = plan(methods[0])
            .kept_width(dk)
            .map_err(|e| anyhow::anyhow!("{}", e.to_string().replace("--ratio", "--ratios")))?;
        let ri = out.ratios.len();
        out.ratios.push((ratio, k));
        for (mi, m) in methods.iter().enumerate() {
            out.plans.insert((mi, ri), plan(*m));
        }
    }
    Ok(out)
}

pub fn run(a: &SweepArgs, quiet: bool) -> Result<()> {
    let total = Instant::now();
    let mut stages = Stages::default();
    // Every cheap check first.
    let budget = parse_budget(&a.budget)?;
    let calib = Calib::resolve(&a.calib, &Recipe::default())?;
    let calib_src = TextSource::parse(calib.source.as_deref(), &calib.text_column)?;
    let eval_srcs = a.eval.iter().map(|e| TextSource::parse(Some(e), "text")).collect::<Result<Vec<_>>>()?;
    let tasks = a.recall.iter().map(|t| t.parse()).collect::<Result<Vec<Task>>>()?;
    let dir = crate::hub::resolve_model(&a.model.model, &a.model.revision)?;
    let ckpt = Checkpoint::open(&dir)?;
    let family: &dyn Family = crate::arch::family_for(&ckpt)?;
    let layout = family.layout(&ckpt)?;
    let g = grid(a, &calib, layout.dk)?;
    let vocab = crate::recall::vocab_size(&ckpt.config).unwrap_or(0);
    crate::recall::check(&tasks, &a.recall_opts, &ckpt.config, vocab)?;
    let tokenizer = TextTokenizer::load(&dir, a.model.tokenizer.as_deref(), &ckpt.config)?;
    let device = a.model.device.open()?;
    let dtype = a.model.dtype.resolve(&device);
    let opts = LoadOptions { dtype, device, grad: false };
    let settings = Settings {
        model: a.model.model.clone(),
        revision: a.model.revision.clone(),
        tokenizer: a.model.tokenizer.as_ref().map(|t| t.display().to_string()),
        dtype: a.model.dtype.to_string(),
        device: a.model.device.to_string(),
        calib: calib.source.clone(),
        text_column: calib.text_column.clone(),
        nsamples: calib.nsamples,
        seqlen: calib.seqlen,
        seed: calib.seed,
        rows: calib.rows,
        round_to: a.round_to.unwrap_or(1),
        rrqr_f: g.plans.values().next().map_or(1.5, |p| p.rrqr_f),
        score_on: format!("{:?}", g.plans.values().next().map_or(ScoreOn::Qk, |p| p.score_on)).to_lowercase(),
        eval: a.eval.clone(),
        eval_windows: a.eval_windows,
        eval_seqlen: a.eval_seqlen,
        recall: tasks.clone(),
        recall_opts: a.recall_opts.clone(),
    };
    let out = &a.output;
    crate::guard::check_output("-o", out, &dir, &ckpt.files)?;
    // The evaluation windows, tokenized before anything heavy: a text too short fails now.
    let t = Instant::now();
    let streams = eval_srcs
        .iter()
        .map(|s| tokenizer.stream(s.documents()?, a.eval_windows * a.eval_seqlen + 1))
        .collect::<Result<Vec<_>>>()?;
    let wins: Vec<Vec<&[u32]>> = streams.iter().map(|t| windows(t, a.eval_seqlen, a.eval_windows)).collect();
    if let Some(i) = wins.iter().position(Vec::is_empty) {
        bail!(
            "--eval {}: shorter than one window of {} tokens; use a longer text or a smaller --eval-seqlen",
            a.eval[i],
            a.eval_seqlen
        );
    }
    stages.add("tokenize", t);
    prepare_dir(out, &settings, a.fresh)?;

    // What is left to do.
    let todo: Vec<(usize, usize)> = g
        .plans
        .keys()
        .copied()
        .filter(|(mi, ri)| {
            let (m, r) = (g.methods[*mi].name(), g.ratios[*ri].0);
            // with --write, a finished cell whose checkpoint is missing is done again
            !cell_path(out, m, r).exists() || (a.write && !cell_model_dir(out, m, r).exists())
        })
        .collect();
    let base_done = cell_path(out, "none", 0.0).exists();
    let n_todo = todo.len() + usize::from(!base_done);
    if !quiet && n_todo < g.plans.len() + 1 {
        eprintln!("reusing {} finished cells from {}", g.plans.len() + 1 - n_todo, out.display());
    }

    // One calibration (with gradients only when a gradient method still has cells to do).
    let calibration = if todo.is_empty() {
        None
    } else {
        let grad = todo.iter().any(|(mi, _)| g.methods[*mi] == Method::Grad);
        Some(calibration(a, out, &calib, &calib_src, &ckpt, &layout, grad, quiet, &mut stages)?)
    };
    let factors = calibration.as_ref().map(|c| layers::Factors::of(c, &layout));

    let pb = crate::progress::bar(n_todo as u64, "sweep", quiet);
    let ev =
        Evaluator { family, opts: &opts, wins: &wins, tasks: &tasks, recall: &a.recall_opts, tok: &tokenizer, vocab };
    if !base_done {
        pb.set_message("unpruned");
        let mut cell = ev.cell(&ckpt, "none", 0.0, layout.dk, layout.state_elems(layout.dk), &mut stages)?;
        cell.layers = Vec::new();
        save_cell(out, &cell)?;
        pb.inc(1);
    }
    for (mi, ri) in &todo {
        let plan = &g.plans[&(*mi, *ri)];
        let (ratio, k) = g.ratios[*ri];
        pb.set_message(format!("{} {ratio}", plan.method.name()));
        let t = Instant::now();
        let chosen = crate::prune::select_all(&ckpt, &layout, plan, k, calibration.as_ref(), true)?;
        let keep: KeepSets =
            chosen.iter().map(|l| (l.layer, l.heads.iter().map(|h| h.choice.kept.clone()).collect())).collect();
        let rows = kept_rows(&ckpt, &layout, &keep)?;
        let mut config = ckpt.config.clone();
        family.set_key_width(&mut config, &layout, k)?;
        let select_s = stages.add("select", t);
        if a.write {
            let t = Instant::now();
            write_cell(out, &ckpt, &rows, &config, plan)?;
            stages.add("write", t);
        }
        let view = ckpt.sliced(rows, config)?;
        let mut cell = ev.cell(&view, plan.method.name(), ratio, k, layout.state_elems(k), &mut stages)?;
        cell.seconds.insert("select".into(), select_s);
        if let Some(f) = &factors {
            cell.layers = f.losses(&keep)?;
        }
        save_cell(out, &cell)?;
        pb.inc(1);
    }
    pb.finish_and_clear();

    // The report over every requested cell (fresh or reused).
    let load = |m: &str, r: f64| -> Result<Cell> {
        let p = cell_path(out, m, r);
        let text = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{} is not a sweep cell; rerun with --fresh", p.display()))
    };
    let base = load("none", 0.0)?;
    let mut cells = Vec::new();
    for m in &g.methods {
        for (r, _) in &g.ratios {
            cells.push(load(m.name(), *r)?);
        }
    }
    stages.0.insert("total".into(), total.elapsed().as_secs_f64());
    let report = SweepReport::new(&settings, &layout, budget, base, cells, stages.0, n_todo);
    write_atomic(&out.join("sweep.json"), &(serde_json::to_string_pretty(&report)? + "\n"))?;
    write_atomic(&out.join("sweep.md"), &report.markdown())?;
    for (name, svg) in report.plots() {
        write_atomic(&out.join(name), &svg)?;
    }
    println!("{}", report.summary());
    if !quiet {
        eprintln!("wrote {}", out.display());
    }
    Ok(())
}

/// Create the output directory, or check that the sweep saved in it ran with `settings`. A
/// folder that holds no finished cell keeps nothing worth resuming: its settings are replaced.
/// Staging that dead runs left in it is removed.
fn prepare_dir(out: &Path, settings: &Settings, fresh: bool) -> Result<()> {
    let path = out.join("sweep_settings.json");
    if out.exists() && !out.is_dir() {
        bail!("{} is a file; -o names the sweep's output directory", out.display());
    }
    for d in [out.to_path_buf(), out.join("cells"), out.join("models")] {
        crate::staging::sweep_dir(&d)?;
    }
    if out.is_dir() && !path.exists() && std::fs::read_dir(out)?.next().is_some() {
        bail!(
            "{} is a non-empty directory that holds no sweep (no sweep_settings.json); statecut writes only into its own outputs: choose a new or empty -o",
            out.display()
        );
    }
    let saved: Option<Settings> = std::fs::read_to_string(&path).ok().and_then(|t| serde_json::from_str(&t).ok());
    let differs = path.exists() && saved.as_ref() != Some(settings);
    let finished = std::fs::read_dir(out.join("cells")).is_ok_and(|mut d| d.next().is_some());
    if differs && finished && !fresh {
        bail!(
            "{} holds a sweep with other settings (model, calibration, evaluation or recall flags differ); pass the same flags to resume it, --fresh to discard it, or choose another -o",
            out.display()
        );
    }
    if fresh || differs {
        for sub in ["cells", "activations.safetensors"] {
            let p = out.join(sub);
            if p.is_dir() {
                std::fs::remove_dir_all(&p)?;
            } else if p.exists() {
                std::fs::remove_file(&p)?;
            }
        }
    }
    std::fs::create_dir_all(out.join("cells")).with_context(|| format!("creating {}", out.display()))?;
    write_atomic(&path, &(serde_json::to_string_pretty(settings)? + "\n"))
}

fn save_cell(out: &Path, cell: &Cell) -> Result<()> {
    write_atomic(&cell_path(out, &cell.method, cell.ratio), &(serde_json::to_string_pretty(cell)? + "\n"))
}

/// The calibration of this sweep: saved in the output directory by an earlier run, or made now
/// (and saved, so that a resumed sweep does not repeat it).
#[allow(clippy::too_many_arguments)]
fn calibration(
    a: &SweepArgs,
    out: &Path,
    calib: &Calib,
    src: &TextSource,
    ckpt: &Checkpoint,
    layout: &StateLayout,
    grad: bool,
    quiet: bool,
    stages: &mut Stages,
) -> Result<Calibration> {
    let path = out.join("activations.safetensors");
    if path.exists() {
        let (cal, complete) = Calibration::load(&path, layout)?;
        if complete && (!grad || !cal.grad_sum.is_empty()) && cal.check_weights(&path, ckpt).is_ok() {
            return Ok(cal);
        }
    }
    let t = Instant::now();
    let m = crate::commands::load(&a.model, grad, quiet)?;
    stages.add("load", t);
    let t = Instant::now();
    let mut cal = crate::prune::calibrate(&m, calib, grad, src, a.calib.batch(), quiet)?;
    stages.add("calibrate", t);
    // Saved for the next run of this sweep, which checks that the model is the same.
    cal.fingerprint_weights(ckpt)?;
    cal.save(&path, true)?;
    Ok(cal)
}

/// Evaluates one model of the grid.
struct Evaluator<'a> {
    family: &'a dyn Family,
    opts: &'a LoadOptions,
    wins: &'a [Vec<&'a [u32]>],
    tasks: &'a [Task],
    recall: &'a crate::cli::RecallArgs,
    tok: &'a TextTokenizer,
    vocab: usize,
}

impl Evaluator<'_> {
    fn cell(
        &self,
        ckpt: &Checkpoint,
        method: &str,
        ratio: f64,
        dk: usize,
        state_elems: usize,
        stages: &mut Stages,
    ) -> Result<Cell> {
        let mut seconds = BTreeMap::new();
        let t = Instant::now();
        let model = self.family.load(ckpt, self.opts).with_context(|| format!("loading the {method} {ratio} model"))?;
        seconds.insert("load".into(), stages.add("load", t));
        let t = Instant::now();
        let ppl = self
            .wins
            .iter()
            .map(|w| Ok(crate::eval::perplexity(model.as_ref(), w, 1, true)?.ppl))
            .collect::<Result<Vec<f64>>>()?;
        seconds.insert("eval".into(), stages.add("eval", t));
        let t = Instant::now();
        let recall = self
            .tasks
            .iter()
            .map(|task| crate::recall::run(*task, self.recall, model.as_ref(), self.tok, self.vocab, true))
            .collect::<Result<Vec<_>>>()?;
        seconds.insert("recall".into(), stages.add("recall", t));
        Ok(Cell { method: method.into(), ratio, dk, state_elems, ppl, recall, layers: Vec::new(), seconds })
    }
}

/// Where `--write` puts the checkpoint of the cell (method, ratio).
fn cell_model_dir(out: &Path, method: &str, ratio: f64) -> PathBuf {
    out.join("models").join(format!("{method}-{ratio}"))
}

/// `--write`: the cell's pruned checkpoint under `out/models/`, written as `prune` writes it.
fn write_cell(out: &Path, ckpt: &Checkpoint, rows: &RowMap, config: &serde_json::Value, plan: &Plan) -> Result<()> {
    let target = cell_model_dir(out, plan.method.name(), plan.ratio);
    let staged = crate::surgery::Staged::new(&target, true, &ckpt.dir, &ckpt.files)?;
    crate::surgery::write_checkpoint(ckpt, rows, config, &staged.tmp)?;
    std::fs::write(staged.tmp.join("statecut_recipe.toml"), toml::to_string(&crate::prune::recipe_of(plan))?)?;
    staged.commit()
}
