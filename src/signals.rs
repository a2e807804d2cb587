//! SIGINT and SIGTERM end a run without leaving its staging behind: the binary blocks both
//! signals in every thread and one thread waits for them ([`install`]). On a signal it removes
//! every staging path registered here and exits with 128 + the signal (130, 143). While a
//! resumable stage runs ([`Resumable`]) the signal is only recorded: the stage saves its partial
//! state at the next step, then calls [`exit`].

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Mutex, MutexGuard};

/// Staging paths of this process that are not yet in place.
static STAGING: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
static RESUMABLE: AtomicBool = AtomicBool::new(false);
/// The signal received while a resumable stage ran (0: none).
static PENDING: AtomicI32 = AtomicI32::new(0);

fn staging() -> MutexGuard<'static, Vec<PathBuf>> {
    STAGING.lock().unwrap_or_else(|e| e.into_inner())
}

/// Remember `path` as staging to remove on a signal.
pub fn register(path: &Path) {
    staging().push(path.to_path_buf());
}

/// Forget `path` (moved into place or removed).
pub fn unregister(path: &Path) {
    staging().retain(|p| p != path);
}

/// Directories a run created for its output, deepest first: removed on a signal if empty.
static CREATED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

fn created() -> MutexGuard<'static, Vec<PathBuf>> {
    CREATED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Remember directories this run created (deepest first), to remove on a signal if empty.
pub fn register_created(dirs: &[PathBuf]) {
    created().extend_from_slice(dirs);
}

/// Forget them (the output is in place, or they were removed).
pub fn unregister_created(dirs: &[PathBuf]) {
    created().retain(|d| !dirs.contains(d));
}

/// Hold while moving staging into place, so that a signal does not remove it halfway: the
/// signal's cleanup waits for the lock, and the path is unregistered under it.
pub fn hold() -> MutexGuard<'static, Vec<PathBuf>> {
    staging()
}

/// The signal to stop for, once a resumable stage has saved its state.
pub fn pending() -> Option<i32> {
    match PENDING.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// A stage that saves its partial state before a signal ends the run; dropping it while a
/// signal is pending ends the run at once.
pub struct Resumable(());

impl Resumable {
    pub fn start() -> Self {
        RESUMABLE.store(true, Ordering::SeqCst);
        Self(())
    }
}

impl Drop for Resumable {
    fn drop(&mut self) {
        RESUMABLE.store(false, Ordering::SeqCst);
        if let Some(sig) = pending() {
            exit(sig, None);
        }
    }
}

fn name(sig: i32) -> &'static str {
    if sig == libc::SIGTERM {
        "SIGTERM"
    } else {
        "SIGINT"
    }
}

/// Remove this process's staging and exit with 128 + `sig`; `saved` names a partial state kept.
pub fn exit(sig: i32, saved: Option<&Path>) -> ! {
    let paths = staging();
    // The other threads write on until the process ends: a file created in a directory while it
    // is being removed makes the removal fail, leaving it. So remove until nothing is left (a
    // writer whose directory is gone fails to create files in it and stops adding any).
    for _ in 0..200 {
        for p in paths.iter() {
            let _ = if p.is_dir() { std::fs::remove_dir_all(p) } else { std::fs::remove_file(p) };
        }
        if !paths.iter().any(|p| p.exists()) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    for d in created().iter() {
        let _ = std::fs::remove_dir(d);
    }
    match saved {
        Some(p) => eprintln!(
            "error: interrupted by {}; the partial state is saved in {}: continue with --resume",
            name(sig),
            p.display()
        ),
        None => eprintln!("error: interrupted by {}; unfinished outputs were removed", name(sig)),
    }
    // Exits while holding the lock: nothing is moved into place after the cleanup.
    std::process::exit(128 + sig)
}

/// Block SIGINT and SIGTERM in this thread and every thread it starts later, and wait for them
/// on a thread of their own. Call first thing in `main`, before any thread exists.
#[cfg(unix)]
pub fn install() {
    // SAFETY: plain libc signal-set calls on a local set; sigwait runs on its own thread.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        if libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
            return;
        }
        std::thread::spawn(move || loop {
            let mut sig = 0;
            if libc::sigwait(&set, &mut sig) != 0 {
                continue;
            }
            // A second signal while the partial state is saved does not wait for it.
            if RESUMABLE.load(Ordering::SeqCst) && PENDING.swap(sig, Ordering::SeqCst) == 0 {
                continue;
            }
            exit(sig, None);
        });
    }
}

#[cfg(not(unix))]
pub fn install() {}
