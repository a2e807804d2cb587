//! The module layering of `src/`: every top-level module has a tier, and a module may import
//! only from its own tier or the tiers below it, never from one above. Modules of one tier may
//! import each other only without a circle. See docs/ARCHITECTURE.md for the diagram.
//!
//! Pure file reading: every `crate::module` reference (and, in the binary, `statecut::module`)
//! outside comments and string literals counts as an import.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The tiers, lowest first. A module missing here fails the test, so that new modules are placed.
const TIERS: &[(&str, &[&str])] = &[
    (
        "support",
        &[
            "profile",
            "device",
            "checkpoint",
            "hub",
            "data",
            "config_text",
            "guard",
            "signals",
            "staging",
            "progress",
            "linalg",
            "bounds",
            "torch_save",
        ],
    ),
    ("ops", &["ops"]),
    ("model", &["model"]),
    ("layers", &["layers"]),
    ("arch", &["arch"]),
    ("running", &["stream", "graph_decode"]),
    ("measuring and pruning", &["select", "serving", "plot", "surgery", "calib", "eval", "lambada", "inspect"]),
    ("flags", &["cli"]),
    ("runs", &["recipe", "report", "recall", "recover"]),
    ("commands", &["commands"]),
    ("pipelines", &["prune", "bench"]),
    ("sweep", &["sweep"]),
    ("binary", &["main"]),
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file belongs to (`src/arch/fla/mod.rs` -> `arch`); `None` for lib.rs.
fn module_of(rel: &Path) -> Option<String> {
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (name != "lib").then(|| name.to_string())
}

/// The source with comments and the contents of string and char literals blanked out.
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        let rest = &text[i..];
        if rest.starts_with("//") {
            let end = rest.find('\n').map_or(b.len(), |n| i + n);
            i = end;
        } else if rest.starts_with("/*") {
            // Block comments nest in Rust.
            let (mut depth, mut j) = (0usize, i);
            while j < b.len() {
                if text[j..].starts_with("/*") {
                    depth += 1;
                    j += 2;
                } else if text[j..].starts_with("*/") {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            out.push(' ');
            i = j;
        } else if let Some(hashes) = raw_string_start(rest) {
            let open = 1 + hashes + 1 + usize::from(rest.starts_with("br"));
            let close = format!("\"{}", "#".repeat(hashes));
            let end = rest[open..].find(&close).map_or(b.len(), |n| i + open + n + close.len());
            out.push_str("\"\"");
            i = end;
        } else if b[i] == b'"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            out.push_str("\"\"");
            i = j + 1;
        } else if b[i] == b'\'' {
            // A char literal ('x', '\n', '\u{..}'), or a lifetime, which is kept.
            let lit = if rest[1..].starts_with('\\') {
                rest[2..].find('\'').map(|n| n + 3)
            } else {
                rest[1..]
                    .chars()
                    .next()
                    .filter(|c| rest[1 + c.len_utf8()..].starts_with('\''))
                    .map(|c| c.len_utf8() + 2)
            };
            match lit {
                Some(n) => {
                    out.push_str("' '");
                    i += n;
                }
                None => {
                    out.push('\'');
                    i += 1;
                }
            }
        } else {
            let c = rest.chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// The number of `#`s of a raw string literal starting here (`r"`, `r#"`, `br"`, ...).
fn raw_string_start(s: &str) -> Option<usize> {
    let s = s.strip_prefix('b').unwrap_or(s).strip_prefix('r')?;
    let hashes = s.len() - s.trim_start_matches('#').len();
    s[hashes..].starts_with('"').then_some(hashes)
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The top-level modules that `code` names after `root::`, including `root::{a, b::c}` lists.
fn imports(code: &str, root: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let pat = format!("{root}::");
    let mut from = 0;
    while let Some(n) = code[from..].find(&pat) {
        let at = from + n;
        from = at + pat.len();
        // `foo_crate::` or `$crate::` is not this crate.
        if code[..at].chars().next_back().is_some_and(|c| is_ident(c) || c == '$') {
            continue;
        }
        let rest = code[from..].trim_start();
        if let Some(list) = rest.strip_prefix('{') {
            // The first name of each item of the list (items split at commas outside braces).
            let (mut depth, mut item) = (0usize, String::new());
            for c in list.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        found.insert(first_name(&item));
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                item.push(c);
            }
            found.insert(first_name(&item));
        } else {
            found.insert(first_name(rest));
        }
    }
    found.remove("self");
    found.remove("");
    found
}

fn first_name(s: &str) -> String {
    s.trim_start().chars().take_while(|&c| is_ident(c)).collect()
}

/// Every top-level module's imports of other top-level modules: module -> (imported -> files).
fn graph() -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    let root = src();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    let mut graph: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for file in files {
        let rel = file.strip_prefix(&root).unwrap().to_path_buf();
        let Some(module) = module_of(&rel) else { continue };
        let code = code_only(&std::fs::read_to_string(&file).unwrap());
        let roots: &[&str] = if module == "main" { &["crate", "statecut"] } else { &["crate"] };
        let entry = graph.entry(module.clone()).or_default();
        for r in roots {
            for target in imports(&code, r) {
                if target != module {
                    entry.entry(target).or_default().insert(format!("src/{}", rel.display()));
                }
            }
        }
    }
    graph
}

fn tier_of(module: &str) -> Option<usize> {
    TIERS.iter().position(|(_, modules)| modules.contains(&module))
}

/// The problems of a module graph against [`TIERS`], one line each.
fn violations(graph: &BTreeMap<String, BTreeMap<String, BTreeSet<String>>>) -> Vec<String> {
    let mut bad = Vec::new();
    let known: BTreeSet<&str> = TIERS.iter().flat_map(|(_, m)| m.iter().copied()).collect();
    for module in graph.keys() {
        if !known.contains(module.as_str()) {
            bad.push(format!("src/{module}: a top-level module with no tier in tests/layering.rs"));
        }
    }
    for (module, targets) in graph {
        let Some(mine) = tier_of(module) else { continue };
        for (target, files) in targets {
            let Some(theirs) = tier_of(target) else {
                // Not a module of this crate (a macro or a path such as `crate::Foo` at the root).
                continue;
            };
            if theirs > mine {
                for file in files {
                    bad.push(format!(
                        "{file} imports crate::{target} (tier {}) from {module} (tier {}): a lower tier must not import from a higher one",
                        TIERS[theirs].0, TIERS[mine].0
                    ));
                }
            }
        }
    }
    // Circles inside one tier: a depth-first search over the imports within the tier.
    for (name, modules) in TIERS {
        let within = |m: &str| -> Vec<String> {
            graph
                .get(m)
                .map_or_else(Vec::new, |t| t.keys().filter(|t| modules.contains(&t.as_str())).cloned().collect())
        };
        let (mut done, mut circles) = (BTreeSet::new(), BTreeSet::new());
        for start in modules.iter() {
            let mut path = vec![start.to_string()];
            if let Some(mut circle) = find_circle(&within, &mut path, &mut done) {
                // One report per circle, whichever module the search started from.
                circle.pop();
                let least = (0..circle.len()).min_by_key(|&i| &circle[i]).unwrap();
                circle.rotate_left(least);
                circle.push(circle[0].clone());
                if !circles.insert(circle.clone()) {
                    continue;
                }
                let files: Vec<String> = circle
                    .windows(2)
                    .flat_map(|w| graph[&w[0]][&w[1]].iter().map(|f| format!("{f} imports crate::{}", w[1])))
                    .collect();
                bad.push(format!("circle in tier {name}: {} ({})", circle.join(" -> "), files.join("; ")));
            }
        }
    }
    bad
}

/// A circle through the last module of `path`, as the modules in order ending where it started.
fn find_circle(
    within: &dyn Fn(&str) -> Vec<String>,
    path: &mut Vec<String>,
    done: &mut BTreeSet<String>,
) -> Option<Vec<String>> {
    let here = path.last().unwrap().clone();
    if done.contains(&here) {
        return None;
    }
    for next in within(&here) {
        if let Some(i) = path.iter().position(|m| *m == next) {
            let mut circle = path[i..].to_vec();
            circle.push(next);
            return Some(circle);
        }
        path.push(next);
        let found = find_circle(within, path, done);
        path.pop();
        if found.is_some() {
            return found;
        }
    }
    done.insert(here);
    None
}

#[test]
fn no_module_imports_from_a_higher_tier() {
    let graph = graph();
    assert!(graph.len() > 20, "expected the crate's modules under {}, found {:?}", src().display(), graph.keys());
    let bad = violations(&graph);
    assert!(bad.is_empty(), "layering violations:\n{}", bad.join("\n"));
}

#[test]
fn every_tier_names_an_existing_module() {
    let graph = graph();
    for (tier, modules) in TIERS {
        for m in *modules {
            assert!(graph.contains_key(*m), "tier {tier} names {m}, which is not a module under src/");
        }
    }
}

#[test]
fn the_checker_catches_upward_imports_and_circles() {
    let edge =
        |a: &str, b: &str| (a.to_string(), BTreeMap::from([(b.to_string(), BTreeSet::from(["f.rs".to_string()]))]));
    let up = BTreeMap::from([edge("ops", "arch"), edge("arch", "ops")]);
    assert!(violations(&up).iter().any(|v| v.contains("f.rs imports crate::arch") && v.contains("from ops")));
    let circle = BTreeMap::from([edge("calib", "surgery"), edge("surgery", "calib")]);
    assert!(
        violations(&circle).iter().any(|v| v.starts_with("circle in tier measuring and pruning")),
        "{:?}",
        violations(&circle)
    );
    assert!(violations(&BTreeMap::from([edge("calib", "surgery")])).is_empty());
}

#[test]
fn imports_are_read_from_code_only() {
    let code = code_only(
        "use crate::{arch::{self, Family}, ops};\n// crate::sweep\nlet s = \"crate::prune\"; let c = '\"'; /* crate::bench */ x::<'a>(crate::model::X);\n$crate::cli\n",
    );
    let found: Vec<String> = imports(&code, "crate").into_iter().collect();
    assert_eq!(found, ["arch", "model", "ops"]);
}

/// The modules of `src/ops/` and the ones each imports (`super::x`, `crate::ops::x`): the kernels
/// and the forms that call them, which must not import each other in a circle either. A folder
/// (`src/ops/cuda/`) is one module; its files' `super::` is the folder's own module.
fn ops_graph() -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    let dir = src().join("ops");
    let mut files = Vec::new();
    rust_files(&dir, &mut files);
    let module = |f: &Path| -> String {
        let rel = f.strip_prefix(&dir).unwrap();
        let first = rel.components().next().unwrap().as_os_str().to_string_lossy().to_string();
        first.strip_suffix(".rs").unwrap_or(&first).to_string()
    };
    let names: BTreeSet<String> = files.iter().map(|f| module(f)).filter(|n| n != "mod").collect();
    let mut graph: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for file in &files {
        let me = module(file);
        if me == "mod" {
            continue;
        }
        let nested = file.parent() != Some(dir.as_path()) && !file.ends_with("mod.rs");
        let code = code_only(&std::fs::read_to_string(file).unwrap());
        let entry = graph.entry(me.clone()).or_default();
        let parents = if nested { BTreeSet::new() } else { imports(&code, "super") };
        for target in parents.into_iter().chain(imports(&code, "crate::ops")) {
            if target != me && names.contains(&target) {
                entry.entry(target).or_default().insert(file.strip_prefix(src()).unwrap().display().to_string());
            }
        }
    }
    graph
}

#[test]
fn ops_files_import_each_other_without_a_circle() {
    let graph = ops_graph();
    assert!(graph.len() > 10 && graph["chunked"].contains_key("chunk_walk"), "ops graph: {graph:?}");
    assert!(graph["conv"].contains_key("cuda") && graph["cuda"].contains_key("launch"), "ops graph: {graph:?}");
    let within = |m: &str| -> Vec<String> { graph.get(m).map_or_else(Vec::new, |t| t.keys().cloned().collect()) };
    let mut done = BTreeSet::new();
    for start in graph.keys() {
        let mut path = vec![start.clone()];
        let circle = find_circle(&within, &mut path, &mut done);
        assert!(circle.is_none(), "circle among src/ops files: {}", circle.unwrap().join(" -> "));
    }
}
