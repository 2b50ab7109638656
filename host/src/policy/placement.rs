//! Which host runs a team's policy: the one whose `--policy-selector` matches the labels of
//! the policy's namespace. Namespaces are labelled by whoever administers the cluster, so the
//! admin — not the team, which sets its NamespacedReconcilePolicy's own labels — decides which
//! host (and so which `--plugin-verify` floor and limits) a team's code runs under.
//!
//! The selector is the text a label selector takes on the command line (`shard=a`,
//! `tier in (gold,silver),!legacy`), parsed here into kube's [`Selector`] so it can be matched
//! against a namespace's labels as the API server would.

use std::collections::{BTreeMap, BTreeSet};

use kube::core::{Expression, Selector, SelectorExt as _};

/// A `--policy-selector`, parsed.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicySelector {
    text: String,
    selector: Selector,
}

impl PolicySelector {
    /// Parse a label selector: comma-separated `key=value`, `key==value`, `key!=value`,
    /// `key in (a,b)`, `key notin (a,b)`, `key` and `!key`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut expressions = Vec::new();
        for requirement in split_requirements(text)? {
            expressions.push(
                expression(requirement.trim())
                    .map_err(|e| format!("label selector {text:?}: {e}"))?,
            );
        }
        Ok(Self {
            text: text.to_owned(),
            selector: expressions.into_iter().collect(),
        })
    }

    /// Whether labels like these are selected.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.selector.matches(labels)
    }

    /// The selector as given, for the API server.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

/// The requirements of a selector: split at commas outside parentheses.
fn split_requirements(text: &str) -> Result<Vec<&str>, String> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0u32, 0);
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth = depth
                    .checked_sub(1)
                    .ok_or_else(|| format!("label selector {text:?}: unbalanced ')'"))?;
            }
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(format!("label selector {text:?}: unbalanced '('"));
    }
    parts.push(&text[start..]);
    Ok(parts.into_iter().filter(|p| !p.trim().is_empty()).collect())
}

fn expression(requirement: &str) -> Result<Expression, String> {
    let key = |k: &str| -> Result<String, String> {
        let k = k.trim();
        if k.is_empty() || k.contains(char::is_whitespace) {
            return Err(format!("{requirement:?} has no valid key"));
        }
        Ok(k.to_owned())
    };
    if let Some(rest) = requirement.strip_prefix('!') {
        return Ok(Expression::DoesNotExist(key(rest)?));
    }
    if let Some((k, v)) = requirement.split_once("!=") {
        return Ok(Expression::NotEqual(key(k)?, v.trim().to_owned()));
    }
    if let Some((k, v)) = requirement
        .split_once("==")
        .or_else(|| requirement.split_once('='))
    {
        return Ok(Expression::Equal(key(k)?, v.trim().to_owned()));
    }
    for (operator, negated) in [(" notin ", true), (" in ", false)] {
        if let Some((k, set)) = requirement.split_once(operator) {
            let values = set
                .trim()
                .strip_prefix('(')
                .and_then(|s| s.strip_suffix(')'))
                .ok_or_else(|| format!("{requirement:?}: the values go in parentheses"))?;
            let values: BTreeSet<String> = values
                .split(',')
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
                .collect();
            return Ok(if negated {
                Expression::NotIn(key(k)?, values)
            } else {
                Expression::In(key(k)?, values)
            });
        }
    }
    Ok(Expression::Exists(key(requirement)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn every_requirement_form_matches_as_the_api_server_would() {
        let gold = labels(&[("tier", "gold"), ("shard", "a")]);
        let bronze = labels(&[("tier", "bronze"), ("legacy", "")]);
        let cases = [
            ("shard=a", true, false),
            ("shard==a", true, false),
            ("tier!=gold", false, true),
            ("tier in (gold, silver)", true, false),
            ("tier notin (gold,silver)", false, true),
            ("legacy", false, true),
            ("!legacy", true, false),
            ("tier in (gold,silver),!legacy", true, false),
            ("", true, true),
        ];
        for (text, on_gold, on_bronze) in cases {
            let selector = PolicySelector::parse(text).expect(text);
            assert_eq!(selector.matches(&gold), on_gold, "{text} on gold");
            assert_eq!(selector.matches(&bronze), on_bronze, "{text} on bronze");
        }
    }

    #[test]
    fn a_malformed_selector_is_refused() {
        for text in ["tier in (gold", "tier in gold", "=a", "a b=c", "tier)"] {
            assert!(PolicySelector::parse(text).is_err(), "{text}");
        }
    }
}
