//! The compile-time checks: one trybuild case per diagnostic, grouped by what the mistake is
//! about. See tests/ui/README.md for refreshing the snapshots.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

use std::collections::BTreeSet;
use std::path::Path;

/// The compile-fail directories; every directory under tests/ui except `pass` must be here.
const COMPILE_FAIL: [&str; 4] = ["agent", "tool", "hook", "hooks"];

/// Whether this is the toolchain the compile-fail snapshots were written with. They hold
/// rustc's own words (its notes on unmet bounds, its names for async blocks), which change
/// between releases: compared on another rustc, they would fail for what rustc says, not for
/// what the macros do.
const SNAPSHOTS_TOOLCHAIN: bool = rustversion::cfg!(stable(1.95));

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    if SNAPSHOTS_TOOLCHAIN {
        for directory in COMPILE_FAIL {
            cases.compile_fail(format!("tests/ui/{directory}/*.rs"));
        }
    } else {
        // In CI the compile-fail checks must run: a toolchain update would otherwise turn them
        // off without a failing test.
        assert!(
            std::env::var_os("CI").is_none(),
            "tests/ui: the compile-fail snapshots are rustc 1.95's and CI runs another toolchain: run CI on rustc 1.95, or refresh the snapshots for this one (tests/ui/README.md) and move SNAPSHOTS_TOOLCHAIN to it"
        );
        eprintln!(
            "tests/ui: the compile-fail snapshots are rustc 1.95's; this toolchain only checks that the tests/ui/pass cases compile (run the suite with rustc 1.95 to compare them)"
        );
    }
    cases.pass("tests/ui/pass/*.rs");
}

#[test]
fn every_ui_fixture_is_registered_and_has_its_snapshot() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ui");
    let directories: BTreeSet<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|entry| entry.unwrap())
        .filter(|entry| entry.file_type().unwrap().is_dir())
        .map(|entry| entry.file_name().into_string().unwrap())
        .collect();
    let registered: BTreeSet<String> = COMPILE_FAIL
        .iter()
        .map(|name| (*name).to_owned())
        .chain(["pass".to_owned()])
        .collect();
    assert_eq!(
        directories, registered,
        "a tests/ui directory is not registered in tests/ui.rs"
    );
    let mut count = 0;
    for directory in COMPILE_FAIL {
        for entry in std::fs::read_dir(root.join(directory)).unwrap() {
            let path = entry.unwrap().path();
            match path.extension().and_then(|extension| extension.to_str()) {
                Some("rs") => {
                    count += 1;
                    assert!(
                        path.with_extension("stderr").exists(),
                        "{} has no .stderr snapshot",
                        path.display()
                    );
                }
                Some("stderr") => assert!(path.with_extension("rs").exists(), "{} has no case", path.display()),
                _ => panic!("unexpected file {}", path.display()),
            }
        }
    }
    assert!(count >= 30, "expected at least 30 compile-fail cases, found {count}");
}
