//! Guards the crate's four layers (see `docs/design.md`): public value
//! types at the bottom, the private store layer above them, the engine above
//! the store, the HTTP adapter and the JetStream adapter (`nats`) on top. An import that runs up a layer, or a
//! cycle of imports spanning more than two files, is how a layer starts to
//! leak; this test names the file and the line of each one.
//!
//! It reads every `src/` file's `use crate::…`, `use super::…` and
//! `use self::…` lines and its inline `crate::…`/`super::…` paths (comments,
//! everything after a file's first `#[cfg(test)]` and the files of modules
//! declared `#[cfg(test)] mod name;` are left out: unit tests may reach
//! anywhere), maps each path to the file that defines the
//! module it names, and follows the crate root's `pub use` lines so that
//! `crate::Engine` counts as an import of the file that defines `Engine`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The layers, bottom to top, declared once. A file belongs to the first
/// layer whose prefix its path (relative to `src/`, without `.rs`) starts
/// with; a file matching none is a public value type (layer 0).
const LAYERS: &[(&str, &[&str])] = &[
    ("value types", &[]),
    ("store", &["store"]),
    ("engine", &["engine", "bench_fixtures"]),
    ("http", &["http"]),
    ("nats", &["nats"]),
];

/// Imports allowed to run up a layer, as (importing file, imported file).
/// At most two, each with its reason; today there are none.
const ALLOWED_UPWARD: &[(&str, &str)] = &[];

/// The most files one import cycle may span: a type and its builder (or an
/// error and the key it names) may know each other, nothing larger.
const MAX_CYCLE_FILES: usize = 2;

type Module = Vec<String>;

/// One import: the line it is on and the module it names.
struct Import {
    line: usize,
    path: String,
    target: Module,
}

struct Crate {
    src: PathBuf,
    /// Module path -> file (relative to the crate root).
    files: BTreeMap<Module, PathBuf>,
    /// Name re-exported by `lib.rs` -> the module it comes from.
    reexports: BTreeMap<String, Module>,
    /// Files of unit-test modules (declared `#[cfg(test)] mod name;`,
    /// with or without `#[path]`), canonical: left out as a whole, as
    /// the rest of a file after its first `#[cfg(test)]` is.
    test_only: BTreeSet<PathBuf>,
}

/// The files of the modules `file` declares under `#[cfg(test)]`
/// (`#[cfg(test)]`, then optionally `#[path = "…"]`, then `mod name;`),
/// canonical; those that do not exist are left out.
fn test_modules(file: &Path, text: &str) -> Vec<PathBuf> {
    let dir = file.parent().unwrap_or(Path::new("."));
    let face = file
        .file_name()
        .is_some_and(|n| n == "mod.rs" || n == "lib.rs" || n == "main.rs");
    let children = if face {
        dir.to_path_buf()
    } else {
        dir.join(file.file_stem().unwrap_or_default())
    };
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = text[from..].find("#[cfg(test)]") {
        from += at + "#[cfg(test)]".len();
        let mut rest = text[from..].trim_start();
        let mut attr_path = None;
        if let Some(after) = rest.strip_prefix("#[path") {
            let Some(open) = after.find('"') else {
                continue;
            };
            let Some(close) = after[open + 1..].find('"') else {
                continue;
            };
            attr_path = Some(after[open + 1..open + 1 + close].to_string());
            let Some(end) = after.find(']') else {
                continue;
            };
            rest = after[end + 1..].trim_start();
        }
        let Some(decl) = rest.strip_prefix("mod ") else {
            continue;
        };
        let Some(semi) = decl.find(';') else {
            continue;
        };
        let name = decl[..semi].trim();
        if name.contains(|c: char| !(c.is_alphanumeric() || c == '_')) {
            continue;
        }
        let candidates = match attr_path {
            Some(p) => vec![dir.join(p)],
            None => vec![
                children.join(format!("{name}.rs")),
                children.join(name).join("mod.rs"),
            ],
        };
        out.extend(candidates.iter().find_map(|c| fs::canonicalize(c).ok()));
    }
    out
}

fn layer_of(module: &Module) -> usize {
    let mut found = 0;
    for (i, (_, prefixes)) in LAYERS.iter().enumerate() {
        if prefixes
            .iter()
            .any(|p| module.first().is_some_and(|m| m == p))
        {
            found = i;
        }
    }
    found
}

fn module_of(src: &Path, file: &Path) -> Module {
    let rel = file.strip_prefix(src).unwrap_or(file).with_extension("");
    let mut parts: Module = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts
        .last()
        .is_some_and(|l| l == "lib" || l == "mod" || l == "main")
    {
        parts.pop();
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            rust_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// The text with comments blanked out (newlines kept, so line numbers hold)
/// and string literals emptied, cut at the first `#[cfg(test)]`.
fn code_of(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(if b[i] == b'\n' { b'\n' } else { b' ' });
                    i += 1;
                }
            }
        } else if b[i] == b'"' && !(i > 0 && (b[i - 1] == b'\'' || b[i - 1] == b'#')) {
            out.push(b'"');
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    out.push(b' ');
                    i += 1;
                }
                if i < b.len() {
                    out.push(if b[i] == b'\n' { b'\n' } else { b' ' });
                    i += 1;
                }
            }
            if i < b.len() {
                out.push(b'"');
                i += 1;
            }
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    let code = String::from_utf8_lossy(&out).into_owned();
    match code.find("#[cfg(test)]") {
        Some(cut) => code[..cut].to_string(),
        None => code,
    }
}

/// `a::{b, c::{d, e}}` -> `a::b`, `a::c::d`, `a::c::e`.
fn expand_use(body: &str) -> Vec<String> {
    fn split_top(s: &str) -> Vec<&str> {
        let (mut depth, mut start, mut parts) = (0i32, 0, Vec::new());
        for (i, ch) in s.char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(&s[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        parts.push(&s[start..]);
        parts
    }
    fn rec(prefix: &str, s: &str, out: &mut Vec<String>) {
        for part in split_top(s) {
            if part.is_empty() {
                continue;
            }
            if let Some(open) = part.find("::{") {
                if part.ends_with('}') {
                    let head = &part[..open];
                    rec(
                        &format!("{prefix}{head}::"),
                        &part[open + 3..part.len() - 1],
                        out,
                    );
                    continue;
                }
            }
            if part.starts_with('{') && part.ends_with('}') {
                rec(prefix, &part[1..part.len() - 1], out);
            } else {
                out.push(format!("{prefix}{part}"));
            }
        }
    }
    let compact: String = body.chars().filter(|c| !c.is_whitespace()).collect();
    let mut out = Vec::new();
    rec("", &compact, &mut out);
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Every `crate::`/`super::`/`self::` path in the code, with its line.
fn paths_in(code: &str) -> Vec<(usize, String)> {
    let line_at = |offset: usize| code[..offset].matches('\n').count() + 1;
    let mut found = Vec::new();
    // `use` statements, which may list several paths in braces.
    let mut from = 0;
    while let Some(at) = code[from..].find("use ") {
        let start = from + at;
        from = start + 4;
        if start > 0 && code[..start].chars().next_back().is_some_and(is_ident) {
            continue;
        }
        let rest = code[start + 4..].trim_start();
        if !(rest.starts_with("crate::")
            || rest.starts_with("super::")
            || rest.starts_with("self::"))
        {
            continue;
        }
        let Some(end) = rest.find(';') else { continue };
        for path in expand_use(&rest[..end]) {
            let path = path.split(" as ").next().unwrap_or(&path).to_string();
            found.push((line_at(start), path));
        }
    }
    // Inline paths such as `crate::store::codec::decode(..)`.
    for root in ["crate::", "super::"] {
        let mut from = 0;
        while let Some(at) = code[from..].find(root) {
            let start = from + at;
            from = start + root.len();
            if start > 0 && code[..start].chars().next_back().is_some_and(is_ident) {
                continue;
            }
            let mut end = start;
            let bytes = code.as_bytes();
            loop {
                while end < code.len() && is_ident(bytes[end] as char) {
                    end += 1;
                }
                if code[end..].starts_with("::")
                    && code[end + 2..].chars().next().is_some_and(is_ident)
                {
                    end += 2;
                } else {
                    break;
                }
            }
            found.push((line_at(start), code[start..end].to_string()));
        }
    }
    found
}

impl Crate {
    fn load(src: &Path) -> std::io::Result<Crate> {
        let mut list = Vec::new();
        rust_files(src, &mut list)?;
        let files = list
            .into_iter()
            .map(|f| (module_of(src, &f), f))
            .collect::<BTreeMap<_, _>>();
        let mut test_only = BTreeSet::new();
        for file in files.values() {
            test_only.extend(test_modules(file, &fs::read_to_string(file)?));
        }
        let mut krate = Crate {
            src: src.to_path_buf(),
            files,
            reexports: BTreeMap::new(),
            test_only,
        };
        let lib = code_of(&fs::read_to_string(src.join("lib.rs"))?);
        let mut from = 0;
        while let Some(at) = lib[from..].find("pub use ") {
            let start = from + at + "pub use ".len();
            from = start;
            let Some(end) = lib[start..].find(';') else {
                break;
            };
            for path in expand_use(&lib[start..start + end]) {
                let segs: Vec<&str> = path.split("::").collect();
                if let Some((name, module)) = segs.split_last() {
                    let module: Module = module.iter().map(|s| (*s).to_string()).collect();
                    if let Some(target) = krate.deepest(&module) {
                        krate.reexports.insert((*name).to_string(), target);
                    }
                }
            }
        }
        Ok(krate)
    }

    /// The deepest known module that `full` starts with.
    fn deepest(&self, full: &[String]) -> Option<Module> {
        (1..=full.len())
            .rev()
            .map(|n| full[..n].to_vec())
            .find(|m| self.files.contains_key(m))
    }

    fn resolve(&self, current: &Module, path: &str) -> Option<Module> {
        let segs: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
        let (mut base, mut rest): (Module, &[&str]) = match segs.first() {
            Some(&"crate") => (Vec::new(), &segs[1..]),
            Some(&"super" | &"self") => (current.clone(), &segs[..]),
            _ => return None,
        };
        while let Some(first) = rest.first() {
            match *first {
                "super" => {
                    base.pop();
                }
                "self" => {}
                _ => break,
            }
            rest = &rest[1..];
        }
        let full: Module = base
            .into_iter()
            .chain(rest.iter().map(|s| (*s).to_string()))
            .collect();
        match self.deepest(&full) {
            Some(m) => Some(m),
            // `crate::Engine` and the like: follow the root's re-export.
            None => full
                .first()
                .and_then(|name| self.reexports.get(name).cloned()),
        }
    }

    /// Every import between two different files, folder faces (`mod.rs`,
    /// `lib.rs`) naming their own children left out.
    fn imports(&self) -> std::io::Result<BTreeMap<Module, Vec<Import>>> {
        let mut all = BTreeMap::new();
        for (module, file) in &self.files {
            if module.is_empty() {
                continue;
            }
            if fs::canonicalize(file).is_ok_and(|f| self.test_only.contains(&f)) {
                continue;
            }
            let code = code_of(&fs::read_to_string(file)?);
            let is_face = file.file_name().is_some_and(|n| n == "mod.rs");
            let mut list = Vec::new();
            for (line, path) in paths_in(&code) {
                let Some(target) = self.resolve(module, &path) else {
                    continue;
                };
                if &target == module || target.is_empty() {
                    continue;
                }
                if is_face && target.starts_with(module) {
                    continue;
                }
                list.push(Import { line, path, target });
            }
            all.insert(module.clone(), list);
        }
        Ok(all)
    }

    /// The file defining `module`, as `src/…` (relative to the crate).
    fn name(&self, module: &Module) -> String {
        self.files
            .get(module)
            .map(|f| {
                let root = self.src.parent().unwrap_or(&self.src);
                f.strip_prefix(root).unwrap_or(f).display().to_string()
            })
            .unwrap_or_else(|| module.join("::"))
    }
}

/// Strongly connected groups of modules (Tarjan), largest first.
fn cycles(edges: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<Module>> {
    struct State<'a> {
        edges: &'a BTreeMap<Module, BTreeSet<Module>>,
        index: BTreeMap<&'a Module, usize>,
        low: BTreeMap<&'a Module, usize>,
        stack: Vec<&'a Module>,
        on: BTreeSet<&'a Module>,
        out: Vec<Vec<Module>>,
    }
    fn strong<'a>(s: &mut State<'a>, v: &'a Module) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on.insert(v);
        if let Some(next) = s.edges.get(v) {
            for w in next {
                if !s.index.contains_key(w) {
                    strong(s, w);
                    let lw = s.low[w];
                    let lv = s.low[v].min(lw);
                    s.low.insert(v, lv);
                } else if s.on.contains(w) {
                    let lv = s.low[v].min(s.index[w]);
                    s.low.insert(v, lv);
                }
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on.remove(w);
                comp.push(w.clone());
                if w == v {
                    break;
                }
            }
            s.out.push(comp);
        }
    }
    let mut s = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !s.index.contains_key(v) {
            strong(&mut s, v);
        }
    }
    let mut out: Vec<_> = s.out.into_iter().filter(|c| c.len() > 1).collect();
    out.sort_by_key(|c| std::cmp::Reverse(c.len()));
    out
}

/// Every violation in the tree under `src`, one line each.
fn violations(src: &Path) -> std::io::Result<Vec<String>> {
    let krate = Crate::load(src)?;
    let imports = krate.imports()?;
    let mut found = Vec::new();
    let mut upward_allowed_used = 0;
    for (module, list) in &imports {
        for import in list {
            let (from, to) = (layer_of(module), layer_of(&import.target));
            if to <= from {
                continue;
            }
            let (file, target) = (krate.name(module), krate.name(&import.target));
            if ALLOWED_UPWARD
                .iter()
                .any(|(a, b)| file.ends_with(a) && target.ends_with(b))
            {
                upward_allowed_used += 1;
                continue;
            }
            found.push(format!(
                "{file}:{}: `{}` runs up from the {} layer to the {} layer ({target})",
                import.line, import.path, LAYERS[from].0, LAYERS[to].0
            ));
        }
    }
    assert!(
        ALLOWED_UPWARD.len() <= 2 && upward_allowed_used <= 2,
        "at most 2 upward imports may be allowed"
    );
    let edges: BTreeMap<Module, BTreeSet<Module>> = imports
        .iter()
        .map(|(m, list)| (m.clone(), list.iter().map(|i| i.target.clone()).collect()))
        .collect();
    for cycle in cycles(&edges) {
        if cycle.len() <= MAX_CYCLE_FILES {
            continue;
        }
        let members: BTreeSet<&Module> = cycle.iter().collect();
        let mut ties = Vec::new();
        for module in &cycle {
            for import in &imports[module] {
                if members.contains(&import.target) {
                    ties.push(format!(
                        "    {}:{}: `{}`",
                        krate.name(module),
                        import.line,
                        import.path
                    ));
                }
            }
        }
        ties.sort();
        ties.dedup();
        found.push(format!(
            "an import cycle spans {} files (at most {MAX_CYCLE_FILES}):\n{}",
            cycle.len(),
            ties.join("\n")
        ));
    }
    Ok(found)
}

#[test]
fn no_import_runs_up_a_layer_or_closes_a_long_cycle() -> std::io::Result<()> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let found = violations(&src)?;
    assert!(
        found.is_empty(),
        "layering violations:\n{}",
        found.join("\n")
    );
    Ok(())
}

/// The checker itself catches what it guards against: an upward import and
/// a three-file cycle planted in a copy of a small tree.
#[test]
fn a_planted_violation_is_named() -> std::io::Result<()> {
    let dir = tempfile::tempdir()?;
    let src = dir.path().join("src");
    fs::create_dir_all(src.join("store"))?;
    fs::create_dir_all(src.join("engine"))?;
    fs::write(
        src.join("lib.rs"),
        "mod a;\nmod store;\nmod engine;\npub use engine::handle::Engine;\n",
    )?;
    fs::write(src.join("a.rs"), "use crate::b::B;\n")?;
    fs::write(src.join("b.rs"), "use crate::c::C;\n")?;
    fs::write(src.join("c.rs"), "use crate::a::A;\n")?;
    // Unit-test modules may reach anywhere: one declared plainly, one
    // through `#[path]`, neither named.
    fs::write(
        src.join("store/mod.rs"),
        "mod disk;\n#[cfg(test)]\nmod disk_tests;\n#[cfg(test)]\n#[path = \"more_tests.rs\"]\nmod more;\n",
    )?;
    fs::write(src.join("store/disk_tests.rs"), "use crate::Engine;\n")?;
    fs::write(src.join("store/more_tests.rs"), "use crate::Engine;\n")?;
    fs::write(
        src.join("store/disk.rs"),
        "// use crate::Engine; is only a comment\n\nfn f() { let _ = crate::Engine::open; }\n",
    )?;
    fs::write(src.join("engine/mod.rs"), "pub mod handle;\n")?;
    fs::write(src.join("engine/handle.rs"), "use crate::store::disk;\n")?;
    let found = violations(&src)?;
    assert_eq!(found.len(), 2, "{found:#?}");
    assert!(
        found[0].contains(
            "src/store/disk.rs:3: `crate::Engine::open` runs up from the store layer to the engine layer"
        ),
        "{}",
        found[0]
    );
    assert!(found[1].contains("spans 3 files"), "{}", found[1]);
    assert!(
        found[1].contains("src/a.rs:1: `crate::b::B`"),
        "{}",
        found[1]
    );
    Ok(())
}
