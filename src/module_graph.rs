//! The crate's modules import each other without a cycle: a module that a lower one imports back
//! (the configuration parser and the sections it fills in, say) can no longer be read, tested or
//! changed on its own. This test reads every source file under `src/`, takes the modules each one
//! names through `crate::` paths (`use` lines, tests and inline paths alike; comments ignored),
//! and fails naming the cycle if there is one.
//!
//! A node is a top-level module (`config`, `host`): a submodule file (`host/abi.rs`) belongs to
//! its top-level module, whose layering with its own children is its own business. `super::` and
//! `self::` paths therefore stay inside a node and are not edges.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

/// Module → the modules it imports.
type Graph = BTreeMap<String, BTreeSet<String>>;

/// This file: test-only, it imports nothing from the crate, and its own tests hold made-up
/// `crate::` paths that name no module.
const THIS_FILE: &str = "module_graph.rs";

/// The top-level module a file under `src/` belongs to (`None` for the crate root).
fn module_of(relative: &Path) -> Option<String> {
    let first = relative.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (name != "lib").then(|| name.to_string())
}

/// The code of one line, without its `//` comment (doc comments included). A `//` inside a
/// string literal also ends the line here; no `crate::` path follows one in this crate.
fn code_of(line: &str) -> &str {
    line.find("//").map_or(line, |at| &line[..at])
}

fn is_ident_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// The identifier at the start of `s` (after spaces), and what follows it.
fn ident(s: &str) -> (&str, &str) {
    let s = s.trim_start();
    let end = s.bytes().position(|b| !is_ident_byte(b)).unwrap_or(s.len());
    s.split_at(end)
}

/// The first segment of every path in `rest`, the text right after a `crate::`: one name
/// (`config::Config`), or the names of a group (`{config::Config, table}`, one level deep).
fn first_segments(rest: &str) -> Vec<&str> {
    let Some(group) = rest.trim_start().strip_prefix('{') else {
        return vec![ident(rest).0];
    };
    let mut names = Vec::new();
    let mut depth = 0usize;
    let mut item_start = true;
    for (at, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => item_start = true,
            c if item_start && !c.is_whitespace() => {
                item_start = false;
                names.push(ident(&group[at..]).0);
            }
            _ => {}
        }
    }
    names
}

/// The modules `source` names through `crate::` paths. `Err`: a path names no module of
/// `modules` (the crate root holds nothing else, so that is a misread this test must not hide).
fn imports(source: &str, modules: &BTreeSet<String>) -> Result<BTreeSet<String>, String> {
    // Joined without comments, so a `use crate::{...}` group spanning lines reads as one.
    let code: String = source.lines().map(code_of).collect::<Vec<_>>().join("\n");
    let mut found = BTreeSet::new();
    let mut from = 0;
    while let Some(at) = code[from..].find("crate::").map(|i| from + i) {
        from = at + "crate::".len();
        let before = code.as_bytes().get(at.wrapping_sub(1)).copied();
        let starts_path = before.is_none_or(|b| !is_ident_byte(b) && b != b'$');
        if !starts_path {
            continue; // `$crate::` or an identifier ending in `crate`
        }
        for name in first_segments(&code[from..]) {
            if !modules.contains(name) {
                return Err(format!("`crate::{name}` names no module of {modules:?}"));
            }
            found.insert(name.to_string());
        }
    }
    Ok(found)
}

/// Every `.rs` file under `dir`, as (path relative to `root`, contents).
fn sources(root: &Path, dir: &Path, out: &mut Vec<(String, String)>) -> std::io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            sources(root, &path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            let relative = path.strip_prefix(root).unwrap_or(&path);
            out.push((relative.display().to_string(), fs::read_to_string(&path)?));
        }
    }
    Ok(())
}

/// The crate's module graph, read from `src/`.
fn crate_graph() -> Result<Graph, String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &src, &mut files).map_err(|e| format!("reading {}: {e}", src.display()))?;
    let modules: BTreeSet<String> = files
        .iter()
        .filter_map(|(path, _)| module_of(Path::new(path)))
        .collect();
    let mut graph: Graph = modules
        .iter()
        .map(|m| (m.clone(), BTreeSet::new()))
        .collect();
    for (path, source) in &files {
        let Some(module) = module_of(Path::new(path)).filter(|_| path != THIS_FILE) else {
            continue;
        };
        let named = imports(source, &modules).map_err(|e| format!("{path}: {e}"))?;
        let edges = graph.entry(module.clone()).or_default();
        edges.extend(named.into_iter().filter(|m| *m != module));
    }
    Ok(graph)
}

/// A cycle of `graph` (its modules in order, the first repeated at the end), if it has one.
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Seen {
        OnPath,
        Done,
    }
    fn visit(
        graph: &Graph,
        at: &str,
        seen: &mut BTreeMap<String, Seen>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        seen.insert(at.to_string(), Seen::OnPath);
        path.push(at.to_string());
        for next in graph.get(at).into_iter().flatten() {
            match seen.get(next.as_str()) {
                Some(Seen::OnPath) => {
                    let start = path.iter().position(|m| m == next).unwrap_or(0);
                    let mut cycle = path[start..].to_vec();
                    cycle.push(next.clone());
                    return Some(cycle);
                }
                Some(Seen::Done) => {}
                None => {
                    if let Some(cycle) = visit(graph, next, seen, path) {
                        return Some(cycle);
                    }
                }
            }
        }
        path.pop();
        seen.insert(at.to_string(), Seen::Done);
        None
    }
    let mut seen = BTreeMap::new();
    for module in graph.keys() {
        if !seen.contains_key(module) {
            if let Some(cycle) = visit(graph, module, &mut seen, &mut Vec::new()) {
                return Some(cycle);
            }
        }
    }
    None
}

/// One line per module: `config -> assign, chain, ...`.
fn render(graph: &Graph) -> String {
    graph
        .iter()
        .map(|(m, to)| {
            format!(
                "{m} -> {}",
                to.iter().cloned().collect::<Vec<_>>().join(", ")
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_crate_has_no_import_cycle() {
    let graph = crate_graph().unwrap_or_else(|e| panic!("{e}"));
    // The scan saw the crate: every module lib.rs declares, and the imports this test guards.
    let lib = include_str!("lib.rs");
    for line in lib.lines().map(str::trim) {
        if let Some(name) = line
            .strip_prefix("pub mod ")
            .or_else(|| line.strip_prefix("mod "))
        {
            let name = name.trim_end_matches(';');
            assert!(
                graph.contains_key(name),
                "module {name} not found under src/"
            );
        }
    }
    for (from, to) in [("config", "config_sections"), ("table", "config_sections")] {
        assert!(
            graph[from].contains(to),
            "{from} -> {to} not seen:\n{}",
            render(&graph)
        );
    }
    if let Some(cycle) = find_cycle(&graph) {
        panic!(
            "import cycle: {}\nthe graph:\n{}",
            cycle.join(" -> "),
            render(&graph)
        );
    }
}

#[test]
fn imports_are_read_from_every_path_form() {
    let modules: BTreeSet<String> = ["alpha", "beta", "gamma", "delta", "host"]
        .map(String::from)
        .into();
    let source = "use crate::alpha::{A, B};\n\
                  use crate::{beta::Beta, gamma};\n\
                  use crate::host::abi::HeaderMap;\n\
                  // use crate::delta::Gone;\n\
                  /// [`X`](crate::delta::X)\n\
                  mod tests {\n    use super::*;\n    fn f() { $crate::nothing; crate::alpha::f(); }\n}\n";
    let found = imports(source, &modules).unwrap();
    assert_eq!(
        found,
        ["alpha", "beta", "gamma", "host"].map(String::from).into()
    );
    assert!(imports("use crate::omega::X;", &modules).is_err());
    assert_eq!(module_of(Path::new("host/abi.rs")).as_deref(), Some("host"));
    assert_eq!(module_of(Path::new("config.rs")).as_deref(), Some("config"));
    assert_eq!(module_of(Path::new("lib.rs")), None);
}

#[test]
fn a_cycle_is_found_and_named() {
    let graph = |edges: &[(&str, &str)]| {
        let mut g = Graph::new();
        for (from, to) in edges {
            g.entry(from.to_string())
                .or_default()
                .insert(to.to_string());
            g.entry(to.to_string()).or_default();
        }
        g
    };
    let layered = graph(&[
        ("config", "sections"),
        ("table", "sections"),
        ("config", "table"),
    ]);
    assert_eq!(find_cycle(&layered), None);
    let cyclic = graph(&[
        ("config", "prefix"),
        ("prefix", "table"),
        ("table", "config"),
        ("a", "config"),
    ]);
    let cycle = find_cycle(&cyclic).expect("a cycle");
    assert_eq!(cycle.first(), cycle.last());
    assert_eq!(cycle.len(), 4, "{cycle:?}");
    for pair in cycle.windows(2) {
        assert!(cyclic[&pair[0]].contains(&pair[1]), "{cycle:?}");
    }
}
