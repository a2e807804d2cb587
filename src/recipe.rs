//! Prune recipes: a TOML file with the same keys as the `prune` flags (`--config`), so the
//! paper's settings live in `configs/` and runs are reproducible. Flags given on the command
//! line override the file.

use crate::bounds::{check_ratio, check_rrqr_f, COUNT, ROWS, SEQ_TOKENS, WIDTH, WINDOW_TOKENS};
use crate::cli::{CalibArgs, PruneArgs};
use crate::select::{Method, ScoreOn};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Every setting of a prune run, as written in a recipe file.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    pub method: Option<String>,
    pub ratio: Option<f64>,
    pub round_to: Option<usize>,
    pub rrqr_f: Option<f64>,
    pub score_on: Option<String>,
    pub calib: Option<String>,
    pub text_column: Option<String>,
    pub nsamples: Option<usize>,
    pub seqlen: Option<usize>,
    pub seed: Option<u64>,
    pub rows: Option<usize>,
    pub eval: Option<String>,
    pub eval_windows: Option<usize>,
    pub eval_seqlen: Option<usize>,
    /// Saved activations (`--activations`) instead of calibrating, and the sha256 they must have.
    pub activations: Option<std::path::PathBuf>,
    pub activations_sha256: Option<String>,
    /// SSE models: routed partitions kept per layer (`--prune-partitions`).
    pub prune_partitions: Option<usize>,
    /// The tokenizer.json used instead of the model's own (`--tokenizer`).
    pub tokenizer: Option<std::path::PathBuf>,
}

impl Recipe {
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading recipe {}", path.display()))?;
        let r: Self = toml::from_str(&text).map_err(|e| {
            anyhow::anyhow!("{} is not a valid statecut recipe: {}", path.display(), one_line(&e.to_string()))
        })?;
        check_recipe(&r).with_context(|| format!("recipe {}", path.display()))?;
        Ok(r)
    }
}

/// Check a recipe's numbers against the same ranges as the flags they stand for.
pub fn check_recipe(r: &Recipe) -> Result<()> {
    let whole = [
        ("nsamples", r.nsamples, COUNT),
        ("seqlen", r.seqlen, SEQ_TOKENS),
        ("rows", r.rows, ROWS),
        ("round_to", r.round_to, WIDTH),
        ("eval_windows", r.eval_windows, COUNT),
        ("eval_seqlen", r.eval_seqlen, WINDOW_TOKENS),
        ("prune_partitions", r.prune_partitions, WIDTH),
    ];
    for (key, v, bound) in whole {
        if let Some(v) = v {
            if let Err(e) = bound.check(v) {
                bail!("{key} = {v}: {e}");
            }
        }
    }
    type Check = fn(f64) -> Result<f64, String>;
    let real: [(&str, Option<f64>, Check); 2] = [("ratio", r.ratio, check_ratio), ("rrqr_f", r.rrqr_f, check_rrqr_f)];
    for (key, v, check) in real {
        if let Some(v) = v {
            if let Err(e) = check(v) {
                bail!("{key} = {v}: {e}");
            }
        }
    }
    Ok(())
}

/// A multi-line parser message (toml quotes the offending line) as one line: its last line, the
/// cause ("unknown field `frobnicate`, expected ..."), after the position.
fn one_line(msg: &str) -> String {
    let lines: Vec<&str> = msg.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    let cause = lines.last().copied().unwrap_or("");
    match lines.first().and_then(|f| f.strip_prefix("TOML parse error at ")) {
        Some(at) if lines.len() > 1 => format!("{cause} (at {at})"),
        _ => cause.to_string(),
    }
}

/// Calibration settings with defaults applied.
#[derive(Debug, Clone, Serialize)]
pub struct Calib {
    pub source: Option<String>,
    pub text_column: String,
    pub nsamples: usize,
    pub seqlen: usize,
    pub seed: u64,
    pub rows: usize,
}

impl Calib {
    pub fn resolve(a: &CalibArgs, r: &Recipe) -> Result<Self> {
        let c = Self {
            source: a.calib.clone().or(r.calib.clone()),
            text_column: a.text_column.clone().or(r.text_column.clone()).unwrap_or_else(|| "text".into()),
            nsamples: a.nsamples.or(r.nsamples).unwrap_or(128),
            seqlen: a.seqlen.or(r.seqlen).unwrap_or(2048),
            seed: a.seed.or(r.seed).unwrap_or(0),
            rows: a.rows.or(r.rows).unwrap_or(5000),
        };
        if c.nsamples == 0 || c.seqlen < 2 || c.rows < 2 {
            bail!("--nsamples, --seqlen and --rows must be positive (seqlen and rows at least 2)");
        }
        Ok(c)
    }
}

/// A saved calibration a plan uses (`--activations`), identified by its content.
#[derive(Debug, Clone, Serialize)]
pub struct Activations {
    pub path: std::path::PathBuf,
    /// The file's sha256; before it is read, the one the recipe expects (if any).
    pub sha256: Option<String>,
    /// Sequences and tokens it was calibrated on (once read).
    pub sequences: usize,
    pub tokens: usize,
}

/// A validated prune plan.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub method: Method,
    pub ratio: f64,
    pub round_to: usize,
    pub rrqr_f: f64,
    pub score_on: ScoreOn,
    /// The calibration the selection uses: with `activations`, the one the file was made with.
    pub calib: Calib,
    pub activations: Option<Activations>,
    pub eval: Option<String>,
    pub eval_windows: usize,
    pub eval_seqlen: usize,
    /// SSE models: routed partitions kept per layer.
    pub prune_partitions: Option<usize>,
    /// `--tokenizer`: the tokenizer.json used instead of the model's own.
    pub tokenizer: Option<std::path::PathBuf>,
    /// The recipe the plan came from, to tell given settings from defaults.
    #[serde(skip)]
    pub(crate) recipe: Recipe,
}

impl Plan {
    pub fn resolve(a: &PruneArgs) -> Result<Self> {
        let r = match &a.config {
            Some(p) => Recipe::load(p)?,
            None => Recipe::default(),
        };
        let method = match (a.method, &r.method) {
            (Some(m), _) => m,
            (None, Some(m)) => m.parse()?,
            (None, None) => bail!("--method is required (l1, swanda, grad, rand or drrqr)"),
        };
        let ratio = a
            .ratio
            .or(r.ratio)
            .context("--ratio is required: the fraction of key/query channels to remove, in (0, 1)")?;
        if !(ratio > 0.0 && ratio < 1.0) {
            bail!("--ratio {ratio} is outside (0, 1): it is the fraction of key/query channels to remove");
        }
        let rrqr_f = a.rrqr_f.or(r.rrqr_f).unwrap_or(1.5);
        if !(rrqr_f > 1.0 && rrqr_f.is_finite()) {
            bail!("--rrqr-f {rrqr_f} must be a finite number > 1");
        }
        // The recipe's checksum applies to the recipe's file, not to one given on the command line.
        let activations = match (&a.activations, &r.activations) {
            (Some(p), _) => Some((p.clone(), None)),
            (None, Some(p)) => Some((p.clone(), r.activations_sha256.clone())),
            (None, None) => None,
        };
        Ok(Self {
            activations: activations.map(|(path, sha256)| Activations { path, sha256, sequences: 0, tokens: 0 }),
            method,
            ratio,
            round_to: a.round_to.or(r.round_to).unwrap_or(1).max(1),
            rrqr_f,
            score_on: match (a.score_on, &r.score_on) {
                (Some(s), _) => s,
                (None, Some(s)) => s.parse()?,
                (None, None) => ScoreOn::Qk,
            },
            calib: Calib::resolve(&a.calib, &r)?,
            eval: a.eval.clone().or(r.eval.clone()),
            eval_windows: a.eval_windows.or(r.eval_windows).unwrap_or(64),
            eval_seqlen: a.eval_seqlen.or(r.eval_seqlen).unwrap_or(512),
            prune_partitions: a.prune_partitions.or(r.prune_partitions),
            tokenizer: a.model.tokenizer.clone().or(r.tokenizer.clone()),
            recipe: r,
        })
    }

    /// Take the calibration settings from the saved activations `cal` (loaded from
    /// `self.activations`): the plan, report and recipe then describe what the selection used.
    /// A recipe's sha256 that the file does not have is an error; calibration flags that
    /// disagree with the file are ignored with a warning.
    pub fn adopt(&mut self, a: &CalibArgs, cal: &crate::calib::Calibration, quiet: bool) -> Result<()> {
        let acts = self.activations.as_mut().context("adopt needs a plan with activations")?;
        let got = cal.sha256.clone().context("the activations were not read from a file")?;
        if let Some(want) = &acts.sha256 {
            if !want.eq_ignore_ascii_case(&got) {
                bail!(
                    "{} has sha256 {got}, but the recipe was written for {want}: it is not the activations file the recipe used; restore that file, or pass --activations to use this one",
                    acts.path.display()
                );
            }
        }
        acts.path = acts.path.canonicalize().unwrap_or_else(|_| acts.path.clone());
        acts.sha256 = Some(got);
        (acts.sequences, acts.tokens) = (cal.sequences_done, cal.tokens);
        let s = &cal.settings;
        let file = Calib {
            source: Some(s.source.clone()),
            text_column: cal.text_column.clone(),
            nsamples: s.nsamples,
            seqlen: s.seqlen,
            seed: s.seed,
            rows: s.rows,
        };
        let r = &self.recipe;
        let given = [
            ("calib", a.calib.clone().or(r.calib.clone()), Some(s.source.clone())),
            ("text-column", a.text_column.clone().or(r.text_column.clone()), Some(file.text_column.clone())),
            ("nsamples", a.nsamples.or(r.nsamples).map(|x| x.to_string()), Some(s.nsamples.to_string())),
            ("seqlen", a.seqlen.or(r.seqlen).map(|x| x.to_string()), Some(s.seqlen.to_string())),
            ("seed", a.seed.or(r.seed).map(|x| x.to_string()), Some(s.seed.to_string())),
            ("rows", a.rows.or(r.rows).map(|x| x.to_string()), Some(s.rows.to_string())),
        ];
        for (flag, given, used) in given {
            if given.is_some() && given != used && !quiet {
                eprintln!(
                    "warning: --{flag} {} is ignored: {} was calibrated with {}",
                    given.unwrap_or_default(),
                    acts.path.display(),
                    used.unwrap_or_default()
                );
            }
        }
        self.calib = file;
        Ok(())
    }

    /// Kept width: floor(d_k (1 − ratio)), rounded down to a multiple of `round_to`.
    pub fn kept_width(&self, dk: usize) -> Result<usize> {
        let k = (dk as f64 * (1.0 - self.ratio) + 1e-9).floor() as usize;
        let k = k / self.round_to * self.round_to;
        if k == 0 {
            bail!(
                "--ratio {} leaves 0 of {dk} key channels per head{}; use a smaller ratio",
                self.ratio,
                if self.round_to > 1 {
                    format!(" after rounding to a multiple of {}", self.round_to)
                } else {
                    String::new()
                }
            );
        }
        Ok(k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recipe_numbers_are_bounded() {
        let r = Recipe { seqlen: Some(0), ..Recipe::default() };
        assert_eq!(check_recipe(&r).unwrap_err().to_string(), "seqlen = 0: must be a whole number from 2 to 1048576");
        assert!(check_recipe(&Recipe { ratio: Some(1.0), ..Recipe::default() }).is_err());
        assert!(check_recipe(&Recipe::default()).is_ok());
    }

    #[test]
    fn shipped_recipes_parse_and_validate() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
        let mut n = 0;
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let r = Recipe::load(&p).unwrap();
            let args = PruneArgs::for_recipe(&p);
            let plan = Plan::resolve(&args).unwrap_or_else(|e| panic!("{}: {e:#}", p.display()));
            assert_eq!(Some(plan.ratio), r.ratio);
            assert!(plan.kept_width(128).unwrap() > 0);
            n += 1;
        }
        assert!(n >= 4);
    }

    #[test]
    fn unknown_recipe_keys_are_errors() {
        let tmp = std::env::temp_dir().join(format!("statecut-recipe-{}.toml", std::process::id()));
        std::fs::write(&tmp, "method = \"drrqr\"\nratoi = 0.5\n").unwrap();
        assert!(Recipe::load(&tmp).is_err());
        std::fs::remove_file(tmp).unwrap();
    }

    #[test]
    fn kept_width_rounding() {
        let args = PruneArgs {
            method: Some(Method::L1),
            ratio: Some(0.5),
            round_to: Some(16),
            ..PruneArgs::for_recipe(Path::new(""))
        };
        let mut plan = Plan::resolve(&PruneArgs { config: None, ..args }).unwrap();
        assert_eq!(plan.kept_width(128).unwrap(), 64);
        plan.ratio = 0.6;
        assert_eq!(plan.kept_width(128).unwrap(), 48); // floor(51.2) = 51 -> 48
        plan.ratio = 0.9;
        assert!(plan.kept_width(128).is_err()); // 12 -> 0
    }
}
