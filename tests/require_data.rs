//! Tests that need the reference data fail under CI when it is missing, and say that they were
//! skipped, by name, everywhere else. The test binary runs one of its own data tests again with
//! the data directory pointing nowhere.

mod common;

use std::process::Command;

/// A test that needs the reference data, as every such test does.
#[test]
fn needs_reference_data() {
    let Some(shared) = common::shared() else { return };
    assert!(shared.join("models").is_dir());
}

/// This test binary again, running only `needs_reference_data`, with no data directory.
fn probe(require: Option<&str>) -> (bool, String) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "needs_reference_data", "--test-threads", "1"])
        .env("STATECUT_TEST_DATA", "/nonexistent/statecut-data")
        .env_remove("STATECUT_REQUIRE_DATA");
    if let Some(v) = require {
        cmd.env("STATECUT_REQUIRE_DATA", v);
    }
    let out = cmd.output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

#[test]
fn missing_data_fails_under_require_data() {
    let (ok, out) = probe(Some("1"));
    assert!(!ok, "a data test passed without data under STATECUT_REQUIRE_DATA=1:\n{out}");
    assert!(out.contains("STATECUT_REQUIRE_DATA=1"), "the failure must name the variable:\n{out}");
    assert!(out.contains("/nonexistent/statecut-data"), "the failure must name the path:\n{out}");
    assert!(out.contains("1 failed"), "{out}");
}

#[test]
fn missing_data_is_skipped_by_name_otherwise() {
    let (ok, out) = probe(None);
    assert!(ok, "without STATECUT_REQUIRE_DATA a missing data directory skips the test:\n{out}");
    assert!(
        out.contains(
            "SKIPPED require_data::needs_reference_data: reference data not found at /nonexistent/statecut-data"
        ),
        "the skip line names the test and the path:\n{out}"
    );
    assert!(out.contains("1 passed"), "{out}");
}
