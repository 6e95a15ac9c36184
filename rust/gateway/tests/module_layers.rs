//! The gateway's modules form layers: a module may use the ones below it and
//! never one above, so there is no import circle. This test reads every
//! source file and fails on a `crate::X` path that points up (or at a module
//! the order does not name), and on an order that drifts from the one
//! `lib.rs` states.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Bottom to top. A module here may import only modules to its left.
const LAYERS: &[&str] = &[
    "util", "error", "wire", "protocol", "config", "store", "http", "metrics", "auth", "limits",
    "upstream", "state", "online", "proxy", "routes", "fuzzing", "cli",
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .filter_map(Result::ok)
        .map(|e| e.path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The top-level module a file belongs to (`None` for the crate root files).
fn module_of(file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src()).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (name != "lib" && name != "main").then(|| name.to_string())
}

/// Every `crate::X` a line of code names (comments skipped: docs may name any module).
fn crate_refs(line: &str) -> Vec<String> {
    let code = line.split("//").next().unwrap_or("");
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        // `lightning_crate::` or similar is not the crate root.
        let before = rest[..i].chars().next_back();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            out.push(name);
        }
    }
    out
}

fn rank(name: &str) -> Option<usize> {
    LAYERS.iter().position(|m| *m == name)
}

#[test]
fn no_module_imports_one_above_it() {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let mut bad = Vec::new();
    let mut arrows = BTreeSet::new();
    for file in &files {
        let Some(from) = module_of(file) else {
            continue;
        };
        let Some(from_rank) = rank(&from) else {
            bad.push(format!(
                "{}: module `{from}` is not in LAYERS; give it a place in the order (here and in lib.rs)",
                file.display()
            ));
            continue;
        };
        let text = std::fs::read_to_string(file)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
        for (n, line) in text.lines().enumerate() {
            for to in crate_refs(line) {
                if to == from {
                    continue;
                }
                match rank(&to) {
                    Some(r) if r < from_rank => {
                        arrows.insert((from.clone(), to));
                    }
                    Some(_) => bad.push(format!(
                        "{}:{}: `{from}` uses `crate::{to}`, which sits above it; move the item down or `{from}` up",
                        file.display(),
                        n + 1
                    )),
                    // Crate-root re-exports (`crate::Config`) and macros are not modules.
                    None if to.chars().next().is_some_and(char::is_uppercase) => {}
                    None => bad.push(format!(
                        "{}:{}: `crate::{to}` is not a module in LAYERS",
                        file.display(),
                        n + 1
                    )),
                }
            }
        }
    }
    println!("layers, bottom to top: {}", LAYERS.join(" < "));
    println!(
        "{} source files, {} downward module arrows:",
        files.len(),
        arrows.len()
    );
    for m in LAYERS {
        let to: Vec<_> = arrows
            .iter()
            .filter(|(f, _)| f == m)
            .map(|(_, t)| t.as_str())
            .collect();
        println!("  {m:<9} -> {}", to.join(", "));
    }
    assert!(
        bad.is_empty(),
        "upward or unknown imports:\n{}",
        bad.join("\n")
    );
}

#[test]
fn lib_rs_states_the_same_order() {
    let lib = std::fs::read_to_string(src().join("lib.rs")).unwrap_or_default();
    // The header's order, joined across its comment lines.
    let header: String = lib
        .lines()
        .take_while(|l| l.starts_with("//!"))
        .map(|l| l.trim_start_matches("//!").trim())
        .collect::<Vec<_>>()
        .join(" ");
    let stated = LAYERS
        .iter()
        .map(|m| format!("`{m}`"))
        .collect::<Vec<_>>()
        .join(" < ");
    assert!(
        header.contains(&stated),
        "lib.rs's header must state the layer order as: {stated}"
    );
    let declared: BTreeSet<&str> = lib
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub mod "))
        .map(|l| l.trim_end_matches(';'))
        .collect();
    let ordered: BTreeSet<&str> = LAYERS.iter().copied().collect();
    assert_eq!(declared, ordered, "lib.rs's modules and LAYERS differ");
}

#[test]
fn the_scanner_sees_upward_paths() {
    assert_eq!(crate_refs("use crate::store::{Store, now};"), ["store"]);
    assert_eq!(
        crate_refs("let x = crate::online::sweep(crate::util::now()); // crate::cli"),
        ["online", "util"]
    );
    assert!(crate_refs("use lightning_crate::x;").is_empty());
}
