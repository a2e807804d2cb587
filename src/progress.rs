//! Progress bars that stay quiet when asked to (or when output is JSON).

use indicatif::{ProgressBar, ProgressStyle};

/// A bar over `len` steps, hidden when `quiet`.
pub fn bar(len: u64, msg: &str, quiet: bool) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{msg:>12} [{bar:30}] {pos}/{len} {per_sec} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_message(msg.to_string());
    pb
}
