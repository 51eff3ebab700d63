//! The shape of the code, checked: no import circles between the modules of a crate (top-level
//! modules, and the child modules of each module directory; test code aside), the math
//! modules never import the config, and only grpo-models' kernels module asks a device what it
//! is (the device seam). Crate cycles are cargo's to refuse; module cycles are only visible by
//! reading the sources, which this test does (every `crate::`, `super::` and `self::` path of
//! every file).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Source files of a crate: (module path, text). `lib.rs`/`main.rs` is the root (empty path),
/// `a/mod.rs` and `a.rs` are `a`, `a/b.rs` is `a::b`.
fn modules(src: &Path) -> Vec<(Vec<String>, String)> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut files = vec![];
    walk(src, &mut files);
    files.sort();
    files
        .into_iter()
        .map(|f| {
            let rel = f.strip_prefix(src).unwrap().with_extension("");
            let mut path: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if matches!(
                path.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                path.pop();
            }
            (
                path,
                strip_comments(&non_test_code(&std::fs::read_to_string(&f).unwrap())),
            )
        })
        .filter(|(path, _)| path.last().map(String::as_str) != Some("tests"))
        .collect()
}

/// The code before a file's `#[cfg(test)]` (test modules come last, and a test may well compare
/// a kernel with the plain code it replaces).
fn non_test_code(text: &str) -> String {
    let test_module = text.match_indices("#[cfg(test)]").find(|(i, m)| {
        let next = text[i + m.len()..].trim_start();
        next.starts_with("mod ") || next.starts_with("pub mod ")
    });
    match test_module {
        Some((i, _)) => text[..i].to_string(),
        None => text.to_string(),
    }
}

/// The text without `//` comments and string literals (paths in docs or messages are not imports).
fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let mut in_str = false;
        let mut prev = ' ';
        let mut chars = line.chars().peekable();
        while let Some(c) = chars.next() {
            if !in_str && c == '/' && chars.peek() == Some(&'/') {
                break;
            }
            if c == '"' && prev != '\\' && prev != '\'' {
                in_str = !in_str;
            } else if !in_str {
                out.push(c);
            }
            prev = if prev == '\\' && c == '\\' { ' ' } else { c };
        }
        out.push('\n');
    }
    out
}

/// Every path that starts with `crate::`, `super::` or `self::`, with `{a, b::{c}}` groups
/// expanded, as written (first segment included).
fn paths(text: &str) -> Vec<Vec<String>> {
    fn ident_at(s: &[u8], mut i: usize) -> (String, usize) {
        let start = i;
        while i < s.len() && (s[i].is_ascii_alphanumeric() || s[i] == b'_') {
            i += 1;
        }
        (String::from_utf8_lossy(&s[start..i]).into_owned(), i)
    }
    fn skip_ws(s: &[u8], mut i: usize) -> usize {
        while i < s.len() && s[i].is_ascii_whitespace() {
            i += 1;
        }
        i
    }
    /// Parses `seg::seg::{...}` at `i`, pushing every full path; returns the end.
    fn tree(s: &[u8], mut i: usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) -> usize {
        let mut cur = prefix;
        loop {
            i = skip_ws(s, i);
            if i < s.len() && s[i] == b'{' {
                i += 1;
                loop {
                    i = skip_ws(s, i);
                    if i >= s.len() || s[i] == b'}' {
                        return i + 1;
                    }
                    i = tree(s, i, cur.clone(), out);
                    i = skip_ws(s, i);
                    if i < s.len() && s[i] == b',' {
                        i += 1;
                    }
                }
            }
            let (id, j) = ident_at(s, i);
            if id.is_empty() {
                out.push(cur);
                return i;
            }
            cur.push(id);
            i = j;
            if s[i..].starts_with(b"::") {
                i += 2;
            } else {
                out.push(cur);
                return i;
            }
        }
    }
    let s = text.as_bytes();
    let mut out = vec![];
    for (i, _) in text.match_indices("::") {
        // The segment before `::` must be crate/super/self and start a path.
        let start = s[..i]
            .iter()
            .rposition(|b| !(b.is_ascii_alphanumeric() || *b == b'_'))
            .map_or(0, |p| p + 1);
        let head = &text[start..i];
        let before = if start == 0 { b' ' } else { s[start - 1] };
        if !matches!(head, "crate" | "super" | "self") || before == b':' {
            continue;
        }
        tree(s, i + 2, vec![head.to_string()], &mut out);
    }
    out
}

/// `p` as an absolute module path (within the crate), from a file whose module is `m`.
/// `is_dir_module`: the file is `mod.rs`/`lib.rs` (its `super` is its parent).
fn resolve(m: &[String], p: &[String]) -> Vec<String> {
    let mut base: Vec<String> = m.to_vec();
    let mut rest = p;
    match p[0].as_str() {
        "crate" => {
            base.clear();
            rest = &p[1..];
        }
        "self" => rest = &p[1..],
        _ => {
            while rest.first().map(String::as_str) == Some("super") {
                base.pop();
                rest = &rest[1..];
            }
        }
    }
    base.extend(rest.iter().cloned());
    base
}

/// Edges between the nodes that `node_of` maps module paths to (None: not a node).
fn graph(
    mods: &[(Vec<String>, String)],
    node_of: &dyn Fn(&[String]) -> Option<String>,
) -> BTreeMap<String, BTreeSet<String>> {
    let known: BTreeSet<Option<String>> = mods.iter().map(|(m, _)| node_of(m)).collect();
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, text) in mods {
        let Some(from) = node_of(m) else { continue };
        let entry = g.entry(from.clone()).or_default();
        for p in paths(text) {
            let abs = resolve(m, &p);
            // Longest prefix of the path that is a node.
            let to = (1..=abs.len())
                .rev()
                .map(|n| node_of(&abs[..n]))
                .find(|n| n.is_some() && known.contains(n))
                .flatten();
            if let Some(to) = to.filter(|t| *t != from) {
                entry.insert(to);
            }
        }
    }
    g
}

/// The strongly connected components with more than one node (Tarjan).
fn cycles(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        let i = t.index.len();
        t.index.insert(v, i);
        t.low.insert(v, i);
        t.stack.push(v);
        t.on.insert(v);
        let g = t.g;
        for w in g.get(v).into_iter().flatten() {
            let w = w.as_str();
            if !t.index.contains_key(w) {
                visit(t, w);
                let l = t.low[w].min(t.low[v]);
                t.low.insert(v, l);
            } else if t.on.contains(w) {
                let l = t.index[w].min(t.low[v]);
                t.low.insert(v, l);
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = vec![];
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                t.out.push(comp);
            }
        }
    }
    let mut t = T {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: vec![],
        on: BTreeSet::new(),
        out: vec![],
    };
    for v in g.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

fn crate_src(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(name)
        .join("src")
}

/// Cycles among the top-level modules, and among the children of each module directory.
fn all_cycles(src: &Path) -> Vec<Vec<String>> {
    let mods = modules(src);
    let mut found = cycles(&graph(&mods, &|m| m.first().cloned()));
    let parents: BTreeSet<Vec<String>> = mods
        .iter()
        .filter(|(m, _)| m.len() >= 2)
        .map(|(m, _)| m[..m.len() - 1].to_vec())
        .collect();
    for parent in parents {
        let depth = parent.len();
        let node_of = |m: &[String]| {
            (m.len() > depth && m[..depth] == parent[..]).then(|| m[..=depth].join("::"))
        };
        found.extend(cycles(&graph(&mods, &node_of)));
    }
    found
}

#[test]
fn no_module_imports_in_a_circle() {
    for krate in ["grpo-models", "grpo", "grpo-cli"] {
        let found = all_cycles(&crate_src(krate));
        assert!(
            found.is_empty(),
            "{krate}: modules that import each other in a circle: {found:?}"
        );
    }
}

#[test]
fn math_modules_do_not_import_the_config() {
    let mods = modules(&crate_src("grpo"));
    for (m, text) in &mods {
        if !matches!(
            m.first().map(String::as_str),
            Some("advantages" | "loss" | "optim" | "logprobs" | "named")
        ) {
            continue;
        }
        for p in paths(text) {
            let abs = resolve(m, &p);
            assert!(
                abs.first().map(String::as_str) != Some("config"),
                "{} imports {}",
                m.join("::"),
                abs.join("::")
            );
        }
    }
}

/// The checker itself finds a circle, through `use` groups, `super::` and inline paths.
#[test]
fn the_checker_sees_a_circle() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    std::fs::create_dir(src.join("a")).unwrap();
    std::fs::write(src.join("lib.rs"), "pub mod a;\npub mod b;\n").unwrap();
    std::fs::write(src.join("a/mod.rs"), "pub mod x;\npub mod y;\n").unwrap();
    std::fs::write(
        src.join("a/x.rs"),
        "use crate::{b::{Thing, other}, a};\n// use crate::c; (a comment)\n",
    )
    .unwrap();
    std::fs::write(src.join("a/y.rs"), "fn f() { super::x::g(); }\n").unwrap();
    std::fs::write(src.join("b.rs"), "fn f() -> crate::a::y::T { todo!() }\n").unwrap();
    let found = all_cycles(src);
    assert_eq!(found, vec![vec!["a".to_string(), "b".to_string()]]);
    // Siblings: x -> y -> x.
    std::fs::write(src.join("a/x.rs"), "use super::y::Y;\n").unwrap();
    std::fs::write(src.join("b.rs"), "").unwrap();
    let found = all_cycles(src);
    assert_eq!(found, vec![vec!["a::x".to_string(), "a::y".to_string()]]);
}

/// Fill-in stays behind its boundary: besides `fill_in` itself, only the fill-in policy kind
/// (`train::fill_in`) and the dispatch of each kind's built-in task and rewards (`inputs`)
/// import it; the causal loop (`train`'s other modules) does not.
#[test]
fn fill_in_stays_behind_its_module() {
    let mods = modules(&crate_src("grpo"));
    let allowed = |m: &[String]| {
        matches!(m.first().map(String::as_str), Some("fill_in" | "inputs"))
            || m.starts_with(&["train".to_string(), "fill_in".to_string()])
    };
    let mut importers = BTreeSet::new();
    for (m, text) in &mods {
        for p in paths(text) {
            if resolve(m, &p).first().map(String::as_str) == Some("fill_in") {
                importers.insert(m.join("::"));
                assert!(allowed(m), "{} imports {}", m.join("::"), p.join("::"));
            }
        }
    }
    assert!(importers.contains("train::fill_in"), "{importers:?}");
}

/// The kernels never import the models: a model asks `kernels` for an op, never the other way,
/// so a kernel can change without reading model code (and `kernels/` stays a leaf below
/// `models/`).
#[test]
fn the_kernels_do_not_import_the_models() {
    let mods = modules(&crate_src("grpo-models"));
    let mut kernel_files = 0;
    for (m, text) in &mods {
        if m.first().map(String::as_str) != Some("kernels") {
            continue;
        }
        kernel_files += 1;
        for p in paths(text) {
            let target = resolve(m, &p);
            assert!(
                target.first().map(String::as_str) != Some("models"),
                "{} imports {}",
                m.join("::"),
                p.join("::")
            );
        }
    }
    assert!(
        kernel_files > 10,
        "{kernel_files} kernel files: the walk found the folder?"
    );
}

/// grpo re-exports none of grpo-models' modules: its users import them from grpo-models, so the
/// crate boundary shows. Only the shared error type is re-exported.
#[test]
fn grpo_does_not_re_export_the_model_runtime() {
    let lib = std::fs::read_to_string(crate_src("grpo").join("lib.rs")).unwrap();
    let reexports: Vec<&str> = lib
        .lines()
        .filter(|l| l.trim_start().starts_with("pub use grpo_models"))
        .collect();
    assert_eq!(
        reexports,
        ["pub use grpo_models::error::{Error, Result};"],
        "{reexports:?}"
    );
}

/// What asking a device what it is, or branching on its variant, looks like (whitespace removed):
/// the device seam's checker looks for these.
const DEVICE_BRANCHES: [&str; 11] = [
    ".is_cuda()",
    ".is_cpu()",
    "is_cuda(",
    "is_cpu(",
    "Device::Cpu=>",
    "Device::Cpu|",
    "|Device::Cpu",
    ",Device::Cpu)",
    "Device::Cuda(_)",
    "Device::Cuda(..)",
    ",Device::Cuda(",
];

/// Every place in the non-test code under `src` (comments and strings aside) that asks a device
/// what it is or branches on its variant, as `module: pattern`, outside the modules `allowed`
/// takes (by module path).
fn device_branches(src: &Path, allowed: &dyn Fn(&[String]) -> bool) -> Vec<String> {
    let mut found = vec![];
    for (m, text) in modules(src) {
        if allowed(&m) {
            continue;
        }
        let flat: String = text.chars().filter(|c| !c.is_whitespace()).collect();
        for p in DEVICE_BRANCHES {
            if flat.contains(p) {
                found.push(format!("{}: {p}", m.join("::")));
            }
        }
    }
    found
}

/// The device seam holds: no crate's code outside `grpo-models/src/kernels/` asks a device what
/// it is (`.is_cuda()`, `.is_cpu()`) or branches on its variant (`Device::Cpu =>`,
/// `Device::Cuda(_)`). What runs where is the kernels module's `Compute`, resolved once per
/// model or optimizer; what a device is, `kernels::device_kind`. (Binding a CUDA device's
/// handle, `Device::Cuda(dev)`, to hand it to NCCL, is not a question about its kind.)
#[test]
fn only_the_kernels_ask_a_device_what_it_is() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut found = vec![];
    for e in std::fs::read_dir(&crates).unwrap() {
        let dir = e.unwrap().path();
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        if !dir.join("src").is_dir() {
            continue;
        }
        let kernels = |m: &[String]| {
            name == "grpo-models" && m.first().map(String::as_str) == Some("kernels")
        };
        for f in device_branches(&dir.join("src"), &kernels) {
            found.push(format!("{name}/src {f}"));
        }
    }
    assert!(
        found.is_empty(),
        "device branches outside grpo-models/src/kernels (ask `Compute` or \
         `kernels::device_kind` instead): {found:?}"
    );
}

/// The seam's checker sees a planted branch, in a method call and a match arm, and passes
/// over the kernels, comments, strings and tests.
#[test]
fn the_checker_sees_a_device_branch() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    std::fs::create_dir(src.join("kernels")).unwrap();
    std::fs::write(src.join("lib.rs"), "pub mod kernels;\npub mod model;\n").unwrap();
    std::fs::write(
        src.join("kernels/mod.rs"),
        "pub fn f(d: &Device) -> bool { d.is_cuda() }\n",
    )
    .unwrap();
    let model = "// x.is_cuda() in a comment\nfn g() -> &'static str { \"is_cpu()\" }\n\
                 #[cfg(test)]\nmod tests { fn t(d: &Device) { d.is_cpu(); } }\n";
    std::fs::write(src.join("model.rs"), model).unwrap();
    let kernels = |m: &[String]| m.first().map(String::as_str) == Some("kernels");
    assert_eq!(device_branches(src, &kernels), Vec::<String>::new());
    let planted = "fn g(d: &Device) -> u8 {\n    if x.device().is_cuda() { 1 } else { 0 }\n}\n\
                   fn h(d: &Device) -> u8 {\n    match d {\n        Device::Cpu => 0,\n        _ => 1,\n    }\n}\n";
    std::fs::write(src.join("model.rs"), planted).unwrap();
    assert_eq!(
        device_branches(src, &kernels),
        [
            "model: .is_cuda()",
            "model: is_cuda(",
            "model: Device::Cpu=>"
        ]
    );
}
