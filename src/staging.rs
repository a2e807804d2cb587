//! Outputs that appear only when complete. A file or directory is built under a hidden sibling
//! name, `.NAME.statecut-tmp-PID`, and renamed into place; an existing directory is replaced in
//! one atomic exchange. A run that dies without cleaning up (SIGKILL, power loss) leaves only
//! such a sibling, and the next run to the same target removes it once process PID is gone.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// Where an output is built.
const TMP: &str = "statecut-tmp";
/// Where a replaced output waits for removal when the atomic exchange is unavailable.
const OLD: &str = "statecut-old";

fn sibling(path: &Path, kind: &str, pid: u32) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!(".{name}.{kind}-{pid}"))
}

/// `dir/.name.statecut-tmp-PID`: beside the target so the final rename stays on one filesystem.
pub fn sibling_tmp(path: &Path) -> PathBuf {
    sibling(path, TMP, std::process::id())
}

fn parent_of(path: &Path) -> &Path {
    path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// Whether process `pid` exists (conservatively true where that cannot be asked).
#[cfg(unix)]
fn alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return true };
    if pid <= 0 {
        return true;
    }
    // SAFETY: signal 0 sends nothing; it only checks that the process exists.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

#[cfg(not(unix))]
fn alive(_pid: u32) -> bool {
    true
}

fn remove_any(p: &Path) -> std::io::Result<()> {
    if p.is_dir() {
        std::fs::remove_dir_all(p)
    } else {
        std::fs::remove_file(p)
    }
}

/// Clean up what dead runs left beside `target`: staging copies are removed, and a previous
/// output that a dead run had moved aside (only where the atomic exchange is unavailable) is
/// moved back if nothing has replaced it. Siblings of running processes are left alone.
pub fn sweep(target: &Path) -> Result<()> {
    let Some(name) = target.file_name() else { return Ok(()) };
    sweep_in(parent_of(target), Some(&name.to_string_lossy()))
}

/// [`sweep`] for every target in `dir` (a folder statecut writes many outputs into).
pub fn sweep_dir(dir: &Path) -> Result<()> {
    sweep_in(dir, None)
}

fn sweep_in(dir: &Path, only: Option<&str>) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Ok(()) };
    for e in entries.flatten() {
        let file_name = e.file_name().to_string_lossy().into_owned();
        // `.NAME.KIND-PID`, NAME itself possibly holding dots.
        let Some(rest) = file_name.strip_prefix('.') else { continue };
        let Some((stem, pid)) = rest.rsplit_once('-') else { continue };
        let Some((name, kind)) = stem.rsplit_once('.') else { continue };
        if only.is_some_and(|o| o != name) {
            continue;
        }
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if (kind != TMP && kind != OLD) || pid == std::process::id() || alive(pid) {
            continue;
        }
        let p = e.path();
        let target = dir.join(name);
        if kind == OLD && !target.exists() {
            std::fs::rename(&p, &target).with_context(|| format!("restoring {}", target.display()))?;
            eprintln!(
                "restored {} from {} (a replacement by process {pid} was interrupted)",
                target.display(),
                p.display()
            );
        } else {
            remove_any(&p).with_context(|| format!("removing {}", p.display()))?;
            eprintln!("removed {} (left by interrupted process {pid})", p.display());
        }
    }
    Ok(())
}

/// Swap two existing paths in one step, so that each name always holds a complete directory.
#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other);
    let (a, b) = (c(a)?, c(b)?);
    // SAFETY: two NUL-terminated paths that outlive the call.
    let r = unsafe { libc::renameat2(libc::AT_FDCWD, a.as_ptr(), libc::AT_FDCWD, b.as_ptr(), libc::RENAME_EXCHANGE) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
fn exchange(_a: &Path, _b: &Path) -> std::io::Result<()> {
    Err(std::io::Error::from(std::io::ErrorKind::Unsupported))
}

/// Put the finished directory `new` in place of the existing `target`; returns where the old
/// output now is, for the caller to remove.
fn replace(new: &Path, target: &Path) -> Result<PathBuf> {
    if exchange(new, target).is_ok() {
        return Ok(new.to_path_buf());
    }
    // Two renames: a run that dies between them leaves the old output under OLD, which the
    // next run's sweep moves back.
    let old = sibling(target, OLD, std::process::id());
    std::fs::rename(target, &old).with_context(|| format!("moving {} aside", target.display()))?;
    std::fs::rename(new, target).with_context(|| format!("renaming {} to {}", new.display(), target.display()))?;
    Ok(old)
}

/// Write a file through a sibling temporary file and a rename (atomic on one filesystem).
pub fn write_atomic(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    sweep(path)?;
    let tmp = sibling_tmp(path);
    crate::signals::register(&tmp);
    if let Err(e) = write(&tmp) {
        let _ = std::fs::remove_file(&tmp);
        crate::signals::unregister(&tmp);
        return Err(e);
    }
    let mut held = crate::signals::hold();
    let renamed = std::fs::rename(&tmp, path);
    held.retain(|p| p != &tmp);
    drop(held);
    if renamed.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    renamed.with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

/// An output directory being built: a hidden sibling that becomes `target` on [`Staged::commit`],
/// and is removed if dropped uncommitted (errors), so no half-written output remains. A process
/// killed outright leaves the sibling, which the next [`Staged::new`] for the target removes.
pub struct Staged {
    pub tmp: PathBuf,
    pub target: PathBuf,
    overwrite: bool,
    committed: bool,
    /// The parent directories this run created, deepest first, removed again if it fails.
    created: Vec<PathBuf>,
}

impl Staged {
    /// Check the target up front: it must not be or hold the input model (`input`, with its
    /// weight files `weights`), and must not exist unless `overwrite` and statecut wrote it.
    pub fn new(target: &Path, overwrite: bool, input: &Path, weights: &[PathBuf]) -> Result<Self> {
        crate::guard::check_output("-o", target, input, weights)?;
        sweep(target)?;
        if target.exists() && !overwrite {
            bail!("output directory {} already exists; pass --overwrite to replace it", target.display());
        }
        if target.exists() {
            crate::guard::check_replaceable(target)?;
        }
        let parent = parent_of(target);
        let created: Vec<PathBuf> = parent
            .ancestors()
            .take_while(|a| !a.as_os_str().is_empty() && !a.exists())
            .map(Path::to_path_buf)
            .collect();
        if !created.is_empty() {
            crate::signals::register_created(&created);
            std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        }
        let tmp = sibling_tmp(target);
        if tmp.exists() {
            remove_any(&tmp)?;
        }
        crate::signals::register(&tmp);
        Ok(Self { tmp, target: target.to_path_buf(), overwrite, committed: false, created })
    }

    /// Move the finished directory into place, replacing an old one only now and in one step.
    pub fn commit(mut self) -> Result<()> {
        let mut held = crate::signals::hold();
        if self.target.exists() {
            if !self.overwrite {
                bail!("{} appeared while this run was writing; pass --overwrite to replace it", self.target.display());
            }
            crate::guard::check_replaceable(&self.target)?;
            let old = replace(&self.tmp, &self.target)?;
            self.committed = true;
            held.retain(|p| p != &self.tmp);
            drop(held);
            crate::signals::unregister_created(&self.created);
            remove_any(&old).with_context(|| format!("removing the replaced output {}", old.display()))?;
        } else {
            std::fs::rename(&self.tmp, &self.target)
                .with_context(|| format!("renaming {} to {}", self.tmp.display(), self.target.display()))?;
            self.committed = true;
            held.retain(|p| p != &self.tmp);
            drop(held);
            crate::signals::unregister_created(&self.created);
        }
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        if self.tmp.exists() {
            let _ = remove_any(&self.tmp);
        }
        crate::signals::unregister(&self.tmp);
        // Parents this run created, if nothing else was put in them.
        for d in &self.created {
            if std::fs::remove_dir(d).is_err() {
                break;
            }
        }
        crate::signals::unregister_created(&self.created);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A PID that no process has: one of a child that has exited and been reaped.
    fn dead_pid() -> u32 {
        let mut c = std::process::Command::new("true").spawn().unwrap();
        let pid = c.id();
        c.wait().unwrap();
        pid
    }

    #[test]
    fn sweep_removes_dead_runs_siblings_only() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("out");
        let dead = sibling(&target, TMP, dead_pid());
        let live = sibling(&target, TMP, std::process::id());
        let other = dir.path().join(".other.statecut-tmp-1");
        for p in [&dead, &live, &other] {
            std::fs::create_dir(p).unwrap();
        }
        sweep(&target).unwrap();
        assert!(!dead.exists() && live.exists() && other.exists());
    }

    #[test]
    fn sweep_restores_an_output_moved_aside() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("out");
        let old = sibling(&target, OLD, dead_pid());
        std::fs::create_dir(&old).unwrap();
        std::fs::write(old.join("f"), b"old").unwrap();
        sweep(&target).unwrap();
        assert_eq!(std::fs::read(target.join("f")).unwrap(), b"old");
        assert!(!old.exists());
    }

    #[test]
    fn commit_replaces_and_refuses_without_overwrite() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("out");
        let input = dir.path().join("in");
        std::fs::create_dir(&target).unwrap();
        std::fs::write(target.join("f"), b"old").unwrap();
        std::fs::write(target.join("statecut_report.json"), b"{}").unwrap();
        let s = Staged::new(&target, true, &input, &[]).unwrap();
        std::fs::create_dir(&s.tmp).unwrap();
        std::fs::write(s.tmp.join("f"), b"new").unwrap();
        let tmp = s.tmp.clone();
        s.commit().unwrap();
        assert_eq!(std::fs::read(target.join("f")).unwrap(), b"new");
        assert!(!tmp.exists());
        // A target that appears during a run without --overwrite is kept.
        std::fs::remove_dir_all(&target).unwrap();
        let s = Staged::new(&target, false, &input, &[]).unwrap();
        std::fs::create_dir(&s.tmp).unwrap();
        std::fs::create_dir(&target).unwrap();
        assert!(s.commit().is_err());
        assert!(target.exists() && !tmp.exists());
    }
}
