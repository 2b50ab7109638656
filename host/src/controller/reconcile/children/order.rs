//! Ordered children. A child may name, in its [`DEPENDS_ON_ANNOTATION`], other children of
//! the same answer (`Kind/name, Kind/name`) that must exist and be ready before the host
//! applies it, and may say when it is itself ready with a CEL expression in its
//! [`READY_WHEN_ANNOTATION`] (see [`super::readiness`]).
//!
//! This module decides, without touching the cluster:
//!
//! - whether an answer's order holds together: every dependency is a child of the same
//!   answer, and nothing depends on itself through any chain (checked with the rest of the
//!   answer, so a cycle refuses the whole answer with the cycle named);
//! - which children other children depend on: those get [`TEARDOWN_FINALIZER`], so that
//!   whoever deletes them (the garbage collector after the parent, the host's prune) finds
//!   them held until their dependents are gone;
//! - whether a terminating child may go now (its dependents, as they are stored in the
//!   cluster, are gone). The order lives on the children themselves, so teardown keeps it
//!   when the plugin is broken, missing or rolled back.

use std::collections::HashMap;

use serde_json::Value;

use crate::controller::labels::{DEPENDS_ON_ANNOTATION, READY_WHEN_ANNOTATION};

/// Why an answer's order cannot hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum OrderProblem {
    /// `kind`/`name` depends on a child the answer does not hold.
    Unknown {
        kind: String,
        name: String,
        dependency: String,
    },
    /// `kind`/`name`'s dependency annotation cannot be read.
    Unreadable {
        kind: String,
        name: String,
        reason: String,
    },
    /// Children depend on each other in a circle: `Kind/name → … → Kind/name`.
    Cycle { path: String },
}

/// One dependency as a child names it: the other child's kind and name.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct ChildName {
    pub kind: String,
    pub name: String,
}

impl std::fmt::Display for ChildName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.kind, self.name)
    }
}

/// The dependencies `object` declares, in the order it names them; none when it declares
/// none. Each entry is `Kind/name`; blanks around entries are ignored.
pub(crate) fn depends_on(object: &Value) -> Result<Vec<ChildName>, String> {
    annotation(object, DEPENDS_ON_ANNOTATION).map_or_else(|| Ok(Vec::new()), parse)
}

/// The dependencies a [`DEPENDS_ON_ANNOTATION`] value names.
pub(crate) fn parse(value: &str) -> Result<Vec<ChildName>, String> {
    value
        .split(',')
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .map(|entry| match entry.split_once('/') {
            Some((kind, name)) if !kind.is_empty() && !name.is_empty() && !name.contains('/') => {
                Ok(ChildName {
                    kind: kind.to_owned(),
                    name: name.to_owned(),
                })
            }
            _ => Err(format!(
                "{DEPENDS_ON_ANNOTATION} entry {entry:?} is not Kind/name"
            )),
        })
        .collect()
}

/// The CEL expression `object` says it is ready by, if it names one.
pub(crate) fn ready_when(object: &Value) -> Option<&str> {
    annotation(object, READY_WHEN_ANNOTATION).filter(|expression| !expression.trim().is_empty())
}

fn annotation<'a>(object: &'a Value, name: &str) -> Option<&'a str> {
    object["metadata"]["annotations"][name].as_str()
}

/// The order of one answer: for each child (by position), the positions of the children it
/// depends on. `children` are the answer's children as `(kind, name, object)`.
pub(crate) fn resolve<'a>(
    children: impl IntoIterator<Item = (&'a str, &'a str, &'a Value)>,
) -> Result<Vec<Vec<usize>>, Vec<OrderProblem>> {
    let children: Vec<_> = children.into_iter().collect();
    let position: HashMap<(&str, &str), usize> = children
        .iter()
        .enumerate()
        .map(|(position, (kind, name, _))| ((*kind, *name), position))
        .collect();
    let mut problems = Vec::new();
    let mut edges = Vec::with_capacity(children.len());
    for (kind, name, object) in &children {
        let mut dependencies = Vec::new();
        match depends_on(object) {
            Ok(named) => {
                for dependency in named {
                    match position.get(&(dependency.kind.as_str(), dependency.name.as_str())) {
                        Some(&at) => dependencies.push(at),
                        None => problems.push(OrderProblem::Unknown {
                            kind: (*kind).to_owned(),
                            name: (*name).to_owned(),
                            dependency: dependency.to_string(),
                        }),
                    }
                }
            }
            Err(reason) => problems.push(OrderProblem::Unreadable {
                kind: (*kind).to_owned(),
                name: (*name).to_owned(),
                reason,
            }),
        }
        dependencies.sort_unstable();
        dependencies.dedup();
        edges.push(dependencies);
    }
    if problems.is_empty()
        && let Some(cycle) = find_cycle(&edges)
    {
        let path: Vec<String> = cycle
            .iter()
            .map(|&at| format!("{}/{}", children[at].0, children[at].1))
            .collect();
        problems.push(OrderProblem::Cycle {
            path: path.join(" → "),
        });
    }
    if problems.is_empty() {
        Ok(edges)
    } else {
        Err(problems)
    }
}

/// A cycle in `edges` (each node's dependencies), as the nodes along it with the first
/// repeated at the end, or none. Depth-first with three colours, iterative so that a long
/// chain cannot exhaust the stack.
fn find_cycle(edges: &[Vec<usize>]) -> Option<Vec<usize>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Colour {
        Unvisited,
        OnPath,
        Done,
    }
    let mut colour = vec![Colour::Unvisited; edges.len()];
    for start in 0..edges.len() {
        if colour[start] != Colour::Unvisited {
            continue;
        }
        // (node, next edge to follow)
        let mut path = vec![(start, 0)];
        colour[start] = Colour::OnPath;
        while let Some(&mut (node, ref mut next)) = path.last_mut() {
            if let Some(&dependency) = edges[node].get(*next) {
                *next += 1;
                match colour[dependency] {
                    Colour::OnPath => {
                        let from = path.iter().position(|(n, _)| *n == dependency)?;
                        let mut cycle: Vec<usize> = path[from..].iter().map(|(n, _)| *n).collect();
                        cycle.push(dependency);
                        return Some(cycle);
                    }
                    Colour::Unvisited => {
                        colour[dependency] = Colour::OnPath;
                        path.push((dependency, 0));
                    }
                    Colour::Done => {}
                }
            } else {
                colour[node] = Colour::Done;
                path.pop();
            }
        }
    }
    None
}

/// The first of `siblings` (the other children of the same parent, as stored) that still
/// depends on the child `kind`/`name`: it must be gone before that child may go. A sibling
/// whose order cannot be read counts as depending on it: a child is never let go because
/// something could not be read.
pub(crate) fn dependent_of<'a>(
    kind: &str,
    name: &str,
    siblings: impl IntoIterator<Item = &'a Value>,
) -> Option<ChildName> {
    siblings.into_iter().find_map(|sibling| {
        let depends = depends_on(sibling)
            .map(|named| named.iter().any(|d| d.kind == kind && d.name == name))
            .unwrap_or(true);
        depends.then(|| ChildName {
            kind: sibling["kind"].as_str().unwrap_or_default().to_owned(),
            name: sibling["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        })
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn child(kind: &str, name: &str, depends: Option<&str>) -> (String, String, Value) {
        let mut object = json!({"kind": kind, "metadata": {"name": name}});
        if let Some(depends) = depends {
            object["metadata"]["annotations"] = json!({ DEPENDS_ON_ANNOTATION: depends });
        }
        (kind.to_owned(), name.to_owned(), object)
    }

    fn order(children: &[(String, String, Value)]) -> Result<Vec<Vec<usize>>, Vec<OrderProblem>> {
        resolve(children.iter().map(|(k, n, o)| (k.as_str(), n.as_str(), o)))
    }

    #[test]
    fn dependencies_resolve_to_positions_in_the_answer() {
        let stack = [
            child("Deployment", "app", Some("Job/migrate")),
            child("StatefulSet", "db", None),
            child("Job", "migrate", Some(" StatefulSet/db , Service/db")),
            child("Service", "db", None),
        ];
        let edges = order(&stack).expect("a valid order");
        assert_eq!(edges, vec![vec![2], vec![], vec![1, 3], vec![]]);
    }

    #[test]
    fn a_dependency_outside_the_answer_or_malformed_is_refused_by_name() {
        let refused = order(&[
            child("Deployment", "app", Some("Job/migrate")),
            child("Job", "other", Some("StatefulSet")),
        ])
        .expect_err("refused");
        assert_eq!(
            refused[0],
            OrderProblem::Unknown {
                kind: "Deployment".into(),
                name: "app".into(),
                dependency: "Job/migrate".into()
            }
        );
        assert!(
            matches!(&refused[1], OrderProblem::Unreadable { reason, .. } if reason.contains("\"StatefulSet\" is not Kind/name")),
            "{refused:?}"
        );
    }

    #[test]
    fn a_cycle_is_refused_with_its_path() {
        let refused = order(&[
            child("ConfigMap", "a", Some("ConfigMap/b")),
            child("ConfigMap", "b", Some("ConfigMap/c")),
            child("ConfigMap", "c", Some("ConfigMap/a")),
            child("ConfigMap", "d", None),
        ])
        .expect_err("refused");
        assert_eq!(
            refused[0],
            OrderProblem::Cycle {
                path: "ConfigMap/a → ConfigMap/b → ConfigMap/c → ConfigMap/a".into()
            }
        );
        let itself = order(&[child("ConfigMap", "a", Some("ConfigMap/a"))]).expect_err("refused");
        assert_eq!(
            itself[0],
            OrderProblem::Cycle {
                path: "ConfigMap/a → ConfigMap/a".into()
            }
        );
    }

    #[test]
    fn a_long_chain_is_no_cycle() {
        let chain: Vec<_> = (0..5000)
            .map(|i| {
                let depends = (i > 0).then(|| format!("ConfigMap/c{}", i - 1));
                child("ConfigMap", &format!("c{i}"), depends.as_deref())
            })
            .collect();
        assert!(order(&chain).is_ok());
    }

    #[test]
    fn a_child_waits_for_the_siblings_that_name_it() {
        let app = child("Deployment", "app", Some("Job/migrate")).2;
        let migrate = child("Job", "migrate", Some("StatefulSet/db")).2;
        let siblings = [app.clone(), migrate.clone()];
        assert_eq!(
            dependent_of("Job", "migrate", &siblings).map(|d| d.to_string()),
            Some("Deployment/app".to_owned())
        );
        assert_eq!(
            dependent_of("StatefulSet", "db", &siblings).map(|d| d.to_string()),
            Some("Job/migrate".to_owned())
        );
        assert_eq!(dependent_of("StatefulSet", "db", &[app]), None);
        let unreadable = child("Job", "other", Some("no-slash")).2;
        assert_eq!(
            dependent_of("StatefulSet", "db", &[unreadable]).map(|d| d.to_string()),
            Some("Job/other".to_owned()),
            "an order that cannot be read holds"
        );
    }
}
