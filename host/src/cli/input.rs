//! Reading Kubernetes objects from YAML or JSON files, with errors that say where.

use std::path::Path;

use anyhow::{Context as _, bail};
use serde::Deserialize as _;
use serde_json::Value;

/// Every object in `path`: each YAML document, and the items of any `kind: List`.
pub fn read_objects(path: &Path) -> anyhow::Result<Vec<Value>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut objects = Vec::new();
    for (index, document) in serde_yaml_ng::Deserializer::from_str(&text).enumerate() {
        let value = Value::deserialize(document).with_context(|| {
            format!(
                "invalid YAML in {} (document {})",
                path.display(),
                index + 1
            )
        })?;
        match value {
            Value::Null => {} // an empty document, e.g. after a trailing `---`
            Value::Object(ref map) if map.get("kind").and_then(Value::as_str) == Some("List") => {
                match map.get("items") {
                    Some(Value::Array(items)) => objects.extend(items.iter().cloned()),
                    _ => bail!("{}: a List without an `items` array", path.display()),
                }
            }
            Value::Object(_) => objects.push(value),
            other => bail!(
                "{}: document {} is not an object but {}",
                path.display(),
                index + 1,
                kind_of(&other)
            ),
        }
    }
    Ok(objects)
}

/// Exactly one object from `path`.
pub fn read_object(path: &Path) -> anyhow::Result<Value> {
    let mut objects = read_objects(path)?;
    match objects.len() {
        1 => Ok(objects.remove(0)),
        0 => bail!("{} holds no object", path.display()),
        n => bail!("{} holds {n} objects, expected one", path.display()),
    }
}

/// The value of `flag` split as `NAMESPACE/NAME`, neither empty.
pub fn namespace_and_name<'a>(flag: &str, value: &'a str) -> anyhow::Result<(&'a str, &'a str)> {
    value
        .split_once('/')
        .filter(|(namespace, name)| !namespace.is_empty() && !name.is_empty())
        .with_context(|| format!("{flag} {value:?} is not NAMESPACE/NAME"))
}

fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    fn file(contents: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().expect("temp file");
        f.write_all(contents.as_bytes()).expect("write temp file");
        f
    }

    #[test]
    fn reads_multi_document_yaml_and_lists() {
        let f = file("kind: A\n---\nkind: List\nitems:\n- kind: B\n- kind: C\n---\n");
        let kinds: Vec<_> = read_objects(f.path())
            .expect("read")
            .iter()
            .map(|o| o["kind"].as_str().expect("kind").to_owned())
            .collect();
        assert_eq!(kinds, ["A", "B", "C"]);
    }

    #[test]
    fn invalid_yaml_error_names_file_and_position() {
        let f = file("kind: A\nspec: [unclosed\n");
        let err = format!("{:#}", read_objects(f.path()).expect_err("invalid"));
        assert!(err.contains("invalid YAML in"), "{err}");
        assert!(err.contains("line"), "{err}");
    }

    #[test]
    fn json_is_accepted() {
        let f = file(r#"{"kind": "A", "spec": {"replicas": 3}}"#);
        let object = read_object(f.path()).expect("read");
        assert_eq!(object["spec"]["replicas"], 3);
    }
}
