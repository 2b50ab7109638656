//! The shape of the code, checked like its behaviour.
//!
//! Modules may not import each other in a circle, in the host or in the runtime: a reader must
//! be able to walk any module after the ones it uses. And the controller keeps three rooms by
//! stage, each allowed to use only the rooms below it:
//!
//! - `controller::cache` (what reconciles read) uses nothing else of `controller`;
//! - `controller::reconcile` (one parent, start to finish) may use `cache`, never `policy_run`;
//! - `controller::policy_run` (one policy, start to stop) may use both.
//!
//! An import is any path that names another module of the crate: a `use`, or a path written
//! out in code (`super::events::truncate(…)`). Each file is one module; a path leads to the
//! deepest file module it names, so a module that imports through its own folder's `mod.rs`
//! (a re-export) counts as importing that `mod.rs`. Unit tests (`#[cfg(test)]` items) and the
//! test-only `controller::testing` module are left out: test code may reach across rooms.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use syn::visit::Visit;

/// A module by its path from the crate root (`["controller", "reconcile", "writes"]`).
type ModulePath = Vec<String>;

/// Every file module of a crate and the modules each one imports.
#[derive(Debug, Default)]
struct ModuleGraph {
    imports: BTreeMap<ModulePath, BTreeSet<ModulePath>>,
}

impl ModuleGraph {
    /// The graph of the crate whose root is `src` (`lib.rs` there).
    fn of_crate(src: &Path) -> Self {
        let mut sources = BTreeMap::new();
        collect(src, src, &mut sources);
        Self::of_sources(&sources)
    }

    /// The graph of a crate given as module path → source text.
    fn of_sources(sources: &BTreeMap<ModulePath, String>) -> Self {
        let known: BTreeSet<ModulePath> = sources.keys().cloned().collect();
        let mut graph = Self::default();
        for (module, text) in sources {
            if module.iter().any(|segment| segment == "testing") {
                continue;
            }
            let file = syn::parse_file(text)
                .unwrap_or_else(|error| panic!("parsing {}: {error}", module.join("::")));
            let mut paths = PathCollector::default();
            for item in file.items.iter().filter(|item| !is_test_only(item)) {
                paths.visit_item(item);
            }
            let targets = graph.imports.entry(module.clone()).or_default();
            for path in paths.paths {
                if let Some(target) = resolve(module, &path, &known)
                    && &target != module
                    && !target.iter().any(|segment| segment == "testing")
                {
                    targets.insert(target);
                }
            }
        }
        graph
    }

    /// Every circle of imports, each as the modules on it (strongly connected components of
    /// more than one module).
    fn cycles(&self) -> Vec<Vec<ModulePath>> {
        let nodes: Vec<&ModulePath> = self.imports.keys().collect();
        let index: BTreeMap<&ModulePath, usize> =
            nodes.iter().enumerate().map(|(i, m)| (*m, i)).collect();
        let edges: Vec<Vec<usize>> = nodes
            .iter()
            .map(|m| {
                self.imports[*m]
                    .iter()
                    .filter_map(|t| index.get(t).copied())
                    .collect()
            })
            .collect();
        strongly_connected(&edges)
            .into_iter()
            .filter(|component| component.len() > 1)
            .map(|component| component.into_iter().map(|i| nodes[i].clone()).collect())
            .collect()
    }

    /// Imports from a module under `from` to one under `forbidden`.
    fn crossings(&self, from: &[&str], forbidden: &[&str]) -> Vec<String> {
        let under = |module: &ModulePath, prefix: &[&str]| {
            module.len() >= prefix.len() && module.iter().zip(prefix).all(|(a, b)| a == b)
        };
        self.imports
            .iter()
            .filter(|(module, _)| under(module, from))
            .flat_map(|(module, targets)| {
                targets
                    .iter()
                    .filter(|target| under(target, forbidden))
                    .map(move |target| format!("{} -> {}", module.join("::"), target.join("::")))
            })
            .collect()
    }
}

/// Read every `.rs` file under `dir` as a module of the crate rooted at `root`.
fn collect(root: &Path, dir: &Path, sources: &mut BTreeMap<ModulePath, String>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|error| panic!("reading {}: {error}", dir.display()))
        .map(|entry| entry.map(|e| e.path()))
        .collect::<Result<_, _>>()
        .unwrap_or_else(|error| panic!("reading {}: {error}", dir.display()));
    entries.sort();
    for path in entries {
        if path.is_dir() {
            collect(root, &path, sources);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let relative = path.strip_prefix(root).unwrap_or(&path);
            // Binaries are not modules of the library.
            if relative == Path::new("main.rs") || relative.starts_with("bin") {
                continue;
            }
            let mut module: ModulePath = relative
                .with_extension("")
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if matches!(module.last().map(String::as_str), Some("mod" | "lib")) {
                module.pop();
            }
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|error| panic!("reading {}: {error}", path.display()));
            sources.insert(module, text);
        }
    }
}

/// Whether an item exists only in tests (`#[cfg(test)]`).
fn is_test_only(item: &syn::Item) -> bool {
    match item {
        syn::Item::Mod(m) => cfg_test(&m.attrs),
        syn::Item::Fn(f) => cfg_test(&f.attrs),
        syn::Item::Use(u) => cfg_test(&u.attrs),
        syn::Item::Impl(i) => cfg_test(&i.attrs),
        _ => false,
    }
}

/// Whether these attributes say `#[cfg(test)]`.
fn cfg_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|attr| {
        attr.path().is_ident("cfg")
            && attr
                .parse_args::<syn::Ident>()
                .is_ok_and(|ident| ident == "test")
    })
}

/// Every path written in the code, `use` trees flattened, as its segments.
#[derive(Default)]
struct PathCollector {
    paths: Vec<Vec<String>>,
}

impl PathCollector {
    fn use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(path) => {
                prefix.push(path.ident.to_string());
                self.use_tree(prefix, &path.tree);
                prefix.pop();
            }
            syn::UseTree::Name(name) => self.use_leaf(prefix, &name.ident),
            syn::UseTree::Rename(rename) => self.use_leaf(prefix, &rename.ident),
            syn::UseTree::Glob(_) => self.paths.push(prefix.clone()),
            syn::UseTree::Group(group) => {
                for tree in &group.items {
                    self.use_tree(prefix, tree);
                }
            }
        }
    }

    fn use_leaf(&mut self, prefix: &[String], ident: &syn::Ident) {
        let mut path = prefix.to_vec();
        // `use foo::{self}` names `foo` itself.
        if ident != "self" {
            path.push(ident.to_string());
        }
        self.paths.push(path);
    }
}

impl<'ast> Visit<'ast> for PathCollector {
    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        self.use_tree(&mut Vec::new(), &item.tree);
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        self.paths.push(
            path.segments
                .iter()
                .map(|segment| segment.ident.to_string())
                .collect(),
        );
        syn::visit::visit_path(self, path);
    }

    /// `pub(super)` and `pub(crate)` say who may see an item, not what it uses.
    fn visit_vis_restricted(&mut self, _: &'ast syn::VisRestricted) {}

    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        if !cfg_test(&item.attrs) {
            syn::visit::visit_item_mod(self, item);
        }
    }
}

/// The file module `path`, written in `module`, leads to: `crate::`, `super::` and `self::`
/// paths, and paths that start with a child module of `module`. `None` for anything else
/// (another crate, a local name).
fn resolve(
    module: &ModulePath,
    path: &[String],
    known: &BTreeSet<ModulePath>,
) -> Option<ModulePath> {
    let (mut base, rest): (ModulePath, &[String]) = match path.first().map(String::as_str) {
        Some("crate") => (Vec::new(), &path[1..]),
        Some("super") | Some("self") => {
            let mut base = module.clone();
            let mut rest = path;
            while let Some(first) = rest.first() {
                match first.as_str() {
                    "super" => {
                        base.pop()?;
                    }
                    "self" => {}
                    _ => break,
                }
                rest = &rest[1..];
            }
            (base, rest)
        }
        Some(first) => {
            let mut child = module.clone();
            child.push(first.to_owned());
            if !known.contains(&child) {
                return None;
            }
            (module.clone(), path)
        }
        None => return None,
    };
    let mut deepest = known.contains(&base).then(|| base.clone());
    for segment in rest {
        base.push(segment.clone());
        if known.contains(&base) {
            deepest = Some(base.clone());
        } else {
            break;
        }
    }
    deepest
}

/// Tarjan's strongly connected components of the graph given as adjacency lists.
fn strongly_connected(edges: &[Vec<usize>]) -> Vec<Vec<usize>> {
    struct State<'a> {
        edges: &'a [Vec<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        components: Vec<Vec<usize>>,
    }
    fn visit(state: &mut State<'_>, node: usize) {
        state.index[node] = Some(state.next);
        state.low[node] = state.next;
        state.next += 1;
        state.stack.push(node);
        state.on_stack[node] = true;
        for &next in &state.edges[node] {
            match state.index[next] {
                None => {
                    visit(state, next);
                    state.low[node] = state.low[node].min(state.low[next]);
                }
                Some(index) if state.on_stack[next] => {
                    state.low[node] = state.low[node].min(index);
                }
                Some(_) => {}
            }
        }
        if Some(state.low[node]) == state.index[node] {
            let mut component = Vec::new();
            while let Some(top) = state.stack.pop() {
                state.on_stack[top] = false;
                component.push(top);
                if top == node {
                    break;
                }
            }
            component.sort_unstable();
            state.components.push(component);
        }
    }
    let mut state = State {
        edges,
        index: vec![None; edges.len()],
        low: vec![0; edges.len()],
        on_stack: vec![false; edges.len()],
        stack: Vec::new(),
        next: 0,
        components: Vec::new(),
    };
    for node in 0..edges.len() {
        if state.index[node].is_none() {
            visit(&mut state, node);
        }
    }
    state.components
}

fn describe(cycles: &[Vec<ModulePath>]) -> String {
    cycles
        .iter()
        .map(|cycle| {
            cycle
                .iter()
                .map(|m| m.join("::"))
                .collect::<Vec<_>>()
                .join(" <-> ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn crate_src(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

/// Fail with every circle of imports in the crate whose sources are at `relative`.
fn assert_acyclic(relative: &str) {
    let cycles = ModuleGraph::of_crate(&crate_src(relative)).cycles();
    assert!(
        cycles.is_empty(),
        "modules that import each other in a circle:\n{}",
        describe(&cycles)
    );
}

#[test]
fn the_host_has_no_import_cycles() {
    assert_acyclic("src");
}

#[test]
fn the_runtime_has_no_import_cycles() {
    assert_acyclic("../runtime/src");
}

#[test]
fn each_controller_room_uses_only_the_rooms_below_it() {
    let graph = ModuleGraph::of_crate(&crate_src("src"));
    let mut crossings: Vec<String> = graph
        .crossings(&["controller", "cache"], &["controller"])
        .into_iter()
        .filter(|crossing| {
            let target = crossing.rsplit(" -> ").next().unwrap_or_default();
            target != "controller::cache" && !target.starts_with("controller::cache::")
        })
        .collect();
    crossings.extend(graph.crossings(&["controller", "reconcile"], &["controller", "policy_run"]));
    assert!(
        crossings.is_empty(),
        "imports against the rooms' order (cache <- reconcile <- policy_run):\n{}",
        crossings.join("\n")
    );
}

// The checker itself, on small crates made up here: it must see what it is for.

fn sources(files: &[(&str, &str)]) -> BTreeMap<ModulePath, String> {
    files
        .iter()
        .map(|(path, text)| {
            let module = if path.is_empty() {
                Vec::new()
            } else {
                path.split("::").map(str::to_owned).collect()
            };
            (module, (*text).to_owned())
        })
        .collect()
}

#[test]
fn the_checker_sees_a_cycle_through_a_use_and_a_written_out_path() {
    let graph = ModuleGraph::of_sources(&sources(&[
        ("", "mod a; mod b;"),
        ("a", "use crate::b::B; pub struct A;"),
        ("b", "pub struct B; fn f() { let _ = super::a::A; }"),
    ]));
    assert_eq!(
        graph.cycles(),
        [vec![vec!["a".to_owned()], vec!["b".to_owned()]]]
    );
}

#[test]
fn the_checker_counts_a_re_export_through_the_folder_face_as_an_import_of_it() {
    let graph = ModuleGraph::of_sources(&sources(&[
        ("", "mod room;"),
        ("room", "mod inner; mod other; pub use inner::Thing;"),
        ("room::inner", "pub struct Thing;"),
        ("room::other", "use super::Thing;"),
    ]));
    assert!(graph.cycles().is_empty(), "{:?}", graph.cycles());
    let graph = ModuleGraph::of_sources(&sources(&[
        ("", "mod room;"),
        ("room", "mod inner; pub use inner::Thing; pub struct Face;"),
        ("room::inner", "pub struct Thing; use super::Face;"),
    ]));
    assert_eq!(graph.cycles().len(), 1);
}

#[test]
fn the_checker_ignores_tests_and_sees_crossings_between_rooms() {
    let graph = ModuleGraph::of_sources(&sources(&[
        ("", "mod controller;"),
        ("controller", "mod cache; mod reconcile;"),
        (
            "controller::cache",
            "#[cfg(test)] mod tests { use crate::controller::reconcile::R; }",
        ),
        (
            "controller::reconcile",
            "use crate::controller::cache; pub struct R;",
        ),
    ]));
    assert!(
        graph
            .crossings(&["controller", "cache"], &["controller", "reconcile"])
            .is_empty()
    );
    assert_eq!(
        graph.crossings(&["controller", "reconcile"], &["controller", "cache"]),
        ["controller::reconcile -> controller::cache"]
    );
}
