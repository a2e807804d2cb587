//! The input is never written: every command that writes checks its output paths against the
//! input model before any work, through symlinks, and replaces only outputs statecut wrote.

use anyhow::{bail, Result};
use std::path::{Component, Path, PathBuf};

/// `path` made absolute with symlinks resolved as far as it exists; the rest (not yet created)
/// is appended with `.` and `..` applied.
pub fn resolve(path: &Path) -> PathBuf {
    let abs =
        if path.is_absolute() { path.to_path_buf() } else { std::env::current_dir().unwrap_or_default().join(path) };
    if let Ok(p) = abs.canonicalize() {
        return p;
    }
    // The deepest existing ancestor, canonical, then the missing components.
    let mut missing = Vec::new();
    let mut base = abs.as_path();
    let mut resolved = loop {
        match base.canonicalize() {
            Ok(p) => break p,
            Err(_) => match (base.parent(), base.components().next_back()) {
                // The last component may be `..`: it is applied once its parent is resolved.
                (Some(parent), Some(last)) => {
                    missing.push(last.as_os_str().to_os_string());
                    base = parent;
                }
                _ => break base.to_path_buf(),
            },
        }
    };
    for name in missing.into_iter().rev() {
        match Path::new(&name).components().next() {
            Some(Component::ParentDir) => {
                resolved.pop();
            }
            Some(Component::CurDir) => {}
            _ => resolved.push(name),
        }
    }
    resolved
}

/// Refuse an output `out` (named by `flag`) that is, contains or lies inside the input model
/// directory `model`, or that is one of its weight files (which may live elsewhere: hub caches
/// link them from a blob store).
pub fn check_output(flag: &str, out: &Path, model: &Path, weights: &[PathBuf]) -> Result<()> {
    let o = resolve(out);
    let m = resolve(model);
    let how = if o == m {
        "is"
    } else if o.starts_with(&m) {
        "is inside"
    } else if m.starts_with(&o) {
        "contains"
    } else if weights.iter().any(|w| resolve(w) == o) {
        "is a weights file of"
    } else {
        return Ok(());
    };
    bail!(
        "{flag} {} {how} the input model {}; statecut never writes into its input: choose an {flag} outside it",
        out.display(),
        model.display()
    )
}

/// Files that mark a directory as a previous statecut output (prune's report and recipe, a sweep
/// cell's recipe, a sweep's settings).
const MARKS: [&str; 3] = ["statecut_report.json", "statecut_recipe.toml", "sweep_settings.json"];

/// Whether `dir` is a directory statecut wrote.
pub fn is_statecut_dir(dir: &Path) -> bool {
    dir.is_dir() && MARKS.iter().any(|m| dir.join(m).is_file())
}

/// `--overwrite` of `target`: only a directory statecut wrote may be replaced.
pub fn check_replaceable(target: &Path) -> Result<()> {
    if !is_statecut_dir(target) {
        let what = if target.is_dir() { "directory" } else { "file" };
        bail!(
            "{} is a {what} statecut did not write (no statecut_report.json); --overwrite replaces only a previous statecut output: remove it yourself or choose another -o",
            target.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_around_the_input_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("p/model");
        std::fs::create_dir_all(&model).unwrap();
        let w = model.join("model.safetensors");
        std::fs::write(&w, b"x").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&model, &link).unwrap();
        let ws = [w.clone()];
        for bad in [model.clone(), dir.path().join("p"), w.clone(), model.join("out"), link.join("a/../b"), link] {
            assert!(check_output("-o", &bad, &model, &ws).is_err(), "{}", bad.display());
        }
        for good in [dir.path().join("out"), dir.path().join("p/model2"), model.join("../other")] {
            check_output("-o", &good, &model, &ws).unwrap();
        }
    }
}
