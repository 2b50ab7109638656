//! Where a plugin's complaint about its input is in the user's file.
//!
//! The CLI reads YAML, but a plugin receives JSON, so a decoding error from the plugin ("invalid
//! type: string "three", expected i32 at line 1 column 187") points into JSON the user never
//! saw. This finds the value at that position in the JSON, by path, and that path in the
//! user's YAML (or JSON) file, so the message can say `parent.yaml:9:13 (spec.replicas)`.

use std::fmt;

use granit_parser::{Event, Parser};

/// One step of a path into a document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// A mapping key.
    Key(String),
    /// A sequence index.
    Index(usize),
}

/// A path, printed as `spec.containers[0].image`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Path(pub Vec<Step>);

impl fmt::Display for Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("(the whole object)");
        }
        for (i, step) in self.0.iter().enumerate() {
            match step {
                Step::Key(key) if i == 0 => write!(f, "{key}")?,
                Step::Key(key) => write!(f, ".{key}")?,
                Step::Index(index) => write!(f, "[{index}]")?,
            }
        }
        Ok(())
    }
}

/// A container being read, and where in it the reader is.
enum Frame {
    /// An object: the key of the member being read, if any yet.
    Object {
        key: Option<String>,
        expecting_key: bool,
    },
    /// An array: the index of the element being read.
    Array { index: usize },
}

fn path_of(stack: &[Frame]) -> Path {
    Path(
        stack
            .iter()
            .filter_map(|frame| match frame {
                Frame::Object {
                    key: Some(key),
                    expecting_key: false,
                } => Some(Step::Key(key.clone())),
                Frame::Object { .. } => None,
                Frame::Array { index } => Some(Step::Index(*index)),
            })
            .collect(),
    )
}

/// The path of the value a decoder was reading at 1-based `column` of single-line JSON
/// `json`, as serde_json reports it: inside a value, that value; at the `}` or `]` that
/// closes an object or array (a missing field, a short list), that container.
pub fn json_path_at(json: &str, column: usize) -> Option<Path> {
    let bytes = json.as_bytes();
    let at = column.checked_sub(1)?.min(bytes.len().checked_sub(1)?);
    let mut stack: Vec<Frame> = Vec::new();
    let mut i = 0;
    while i < at {
        match bytes[i] {
            b'{' => stack.push(Frame::Object {
                key: None,
                expecting_key: true,
            }),
            b'[' => stack.push(Frame::Array { index: 0 }),
            b'}' | b']' => {
                stack.pop();
            }
            b',' => match stack.last_mut() {
                Some(Frame::Object { key, expecting_key }) => {
                    *key = None;
                    *expecting_key = true;
                }
                Some(Frame::Array { index }) => *index += 1,
                None => {}
            },
            b':' => {
                if let Some(Frame::Object { expecting_key, .. }) = stack.last_mut() {
                    *expecting_key = false;
                }
            }
            b'"' => {
                let start = i + 1;
                i = start;
                while i < bytes.len() && bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                if let Some(Frame::Object {
                    key,
                    expecting_key: true,
                }) = stack.last_mut()
                {
                    let raw = &json[start..i.min(json.len())];
                    *key = Some(
                        serde_json::from_str(&format!("\"{raw}\""))
                            .unwrap_or_else(|_| raw.to_owned()),
                    );
                }
            }
            _ => {}
        }
        i += 1;
    }
    match bytes[at] {
        // The container itself: drop its own frame.
        b'}' | b']' => {
            stack.pop();
        }
        // serde_json reports a misplaced array or object at the character before it: the
        // value that follows is the one meant.
        b':' => {
            if let Some(Frame::Object { expecting_key, .. }) = stack.last_mut() {
                *expecting_key = false;
            }
        }
        b',' => {
            if let Some(Frame::Array { index }) = stack.last_mut() {
                *index += 1;
            }
        }
        b'[' => stack.push(Frame::Array { index: 0 }),
        _ => {}
    }
    Some(path_of(&stack))
}

/// 1-based line and column of the value at `path` in the YAML (or JSON) text, pointing at
/// its key when it has one.
pub fn yaml_location(text: &str, path: &Path) -> Option<(usize, usize)> {
    let mut stack: Vec<Frame> = Vec::new();
    // Where the key of the member being read starts, per mapping.
    let mut key_marks: Vec<Option<(usize, usize)>> = Vec::new();
    let found = |stack: &[Frame], marks: &[Option<(usize, usize)>], start: (usize, usize)| {
        (path_of(stack) == *path).then(|| marks.last().copied().flatten().unwrap_or(start))
    };
    for event in Parser::new_from_str(text) {
        let (event, span) = event.ok()?;
        let start = (span.start.line(), span.start.col() + 1);
        match event {
            Event::Scalar(value, ..) => {
                if let Some(Frame::Object { key, expecting_key }) = stack.last_mut()
                    && *expecting_key
                {
                    *key = Some(value.into_owned());
                    *expecting_key = false;
                    if let Some(mark) = key_marks.last_mut() {
                        *mark = Some(start);
                    }
                    continue;
                }
                if let Some(location) = found(&stack, &key_marks, start) {
                    return Some(location);
                }
                value_done(&mut stack, &mut key_marks);
            }
            Event::MappingStart(..) | Event::SequenceStart(..) => {
                if let Some(location) = found(&stack, &key_marks, start) {
                    return Some(location);
                }
                if matches!(event, Event::MappingStart(..)) {
                    stack.push(Frame::Object {
                        key: None,
                        expecting_key: true,
                    });
                } else {
                    stack.push(Frame::Array { index: 0 });
                }
                key_marks.push(None);
            }
            Event::MappingEnd | Event::SequenceEnd => {
                stack.pop();
                key_marks.pop();
                value_done(&mut stack, &mut key_marks);
            }
            Event::DocumentEnd => break,
            _ => {}
        }
    }
    None
}

/// A value finished: the enclosing mapping expects a key next, the sequence its next item.
fn value_done(stack: &mut [Frame], key_marks: &mut [Option<(usize, usize)>]) {
    match stack.last_mut() {
        Some(Frame::Object { key, expecting_key }) => {
            *key = None;
            *expecting_key = true;
            if let Some(mark) = key_marks.last_mut() {
                *mark = None;
            }
        }
        Some(Frame::Array { index }) => *index += 1,
        None => {}
    }
}

/// `message` with its trailing ` at line 1 column N` (a position in `json`) replaced by where
/// that value is in `file` (whose text is `text`), under `prefix` when the JSON is part of the
/// file (a case's `parent`). `None` when the message has no such position or it cannot be
/// placed.
pub fn relocate(
    message: &str,
    json: &str,
    file: &std::path::Path,
    text: &str,
    prefix: &[Step],
) -> Option<String> {
    let (head, position) = message.rsplit_once(" at line 1 column ")?;
    let column: usize = position.trim().parse().ok()?;
    let mut path = json_path_at(json, column)?;
    path.0.splice(0..0, prefix.iter().cloned());
    let (line, col) = yaml_location(text, &path)?;
    let shown = Path(path.0[prefix.len()..].to_vec());
    Some(format!(
        "{head} at {}:{line}:{col} ({shown})",
        file.display()
    ))
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::*;

    #[derive(Deserialize)]
    #[allow(dead_code)]
    struct Parent {
        spec: Spec,
    }

    #[derive(Deserialize)]
    #[allow(dead_code)]
    struct Spec {
        replicas: i32,
        image: String,
        ports: Vec<u16>,
    }

    /// The column serde_json reports for `json` decoded as a `Parent`.
    fn serde_column(json: &str) -> usize {
        let err = serde_json::from_str::<Parent>(json)
            .err()
            .expect("an error");
        assert_eq!(err.line(), 1);
        err.column()
    }

    fn path(text: &str) -> Path {
        let mut steps = Vec::new();
        for part in text.split('.') {
            match part.split_once('[') {
                Some((key, index)) => {
                    steps.push(Step::Key(key.into()));
                    steps.push(Step::Index(
                        index.trim_end_matches(']').parse().expect("index"),
                    ));
                }
                None => steps.push(Step::Key(part.into())),
            }
        }
        Path(steps)
    }

    #[test]
    fn the_value_serde_json_complains_about_is_found_by_path() {
        let wrong_type =
            r#"{"metadata":{"name":"a"},"spec":{"image":"x","ports":[80],"replicas":"three"}}"#;
        assert_eq!(
            json_path_at(wrong_type, serde_column(wrong_type)),
            Some(path("spec.replicas"))
        );
        let missing = r#"{"spec":{"image":"x","ports":[]}}"#;
        assert_eq!(
            json_path_at(missing, serde_column(missing)),
            Some(path("spec"))
        );
        let in_list = r#"{"spec":{"image":"x","ports":[80,"http"],"replicas":1}}"#;
        assert_eq!(
            json_path_at(in_list, serde_column(in_list)),
            Some(path("spec.ports[1]"))
        );
        let sequence = r#"{"spec":{"image":"x","ports":[],"replicas":[1]}}"#;
        assert_eq!(
            json_path_at(sequence, serde_column(sequence)),
            Some(path("spec.replicas"))
        );
        let object_in_list = r#"{"spec":{"image":"x","ports":[80,{"a":1}],"replicas":1}}"#;
        assert_eq!(
            json_path_at(object_in_list, serde_column(object_in_list)),
            Some(path("spec.ports[1]"))
        );
        let first_in_list = r#"{"spec":{"image":"x","ports":[[1]],"replicas":1}}"#;
        assert_eq!(
            json_path_at(first_in_list, serde_column(first_in_list)),
            Some(path("spec.ports[0]"))
        );
        let escaped = r#"{"spec":{"image":"a\"b","replicas":true,"ports":[]}}"#;
        assert_eq!(
            json_path_at(escaped, serde_column(escaped)),
            Some(path("spec.replicas"))
        );
    }

    #[test]
    fn a_path_is_found_in_yaml_at_its_key() {
        let yaml =
            "apiVersion: v1\nspec:\n  image: x\n  ports:\n  - 80\n  - http\n  replicas: three\n";
        assert_eq!(yaml_location(yaml, &path("spec.replicas")), Some((7, 3)));
        assert_eq!(yaml_location(yaml, &path("spec")), Some((2, 1)));
        assert_eq!(yaml_location(yaml, &path("spec.ports[1]")), Some((6, 5)));
        assert_eq!(yaml_location(yaml, &path("spec.nothing")), None);
        let flow = "{\"spec\": {\"replicas\": \"three\"}}";
        assert_eq!(yaml_location(flow, &path("spec.replicas")), Some((1, 11)));
    }

    #[test]
    fn a_message_is_relocated_into_the_users_file() {
        let yaml = "spec:\n  image: x\n  ports: []\n  replicas: three\n";
        let json = r#"{"spec":{"image":"x","ports":[],"replicas":"three"}}"#;
        let message = format!(
            "parent does not match the plugin's type: invalid type: string \"three\", expected i32 at line 1 column {}",
            serde_column(json)
        );
        let file = std::path::Path::new("parent.yaml");
        assert_eq!(
            relocate(&message, json, file, yaml, &[]).as_deref(),
            Some(
                "parent does not match the plugin's type: invalid type: string \"three\", expected i32 at parent.yaml:4:3 (spec.replicas)"
            )
        );
        let case = "parent:\n  spec:\n    image: x\n    ports: []\n    replicas: three\n";
        assert!(
            relocate(&message, json, file, case, &[Step::Key("parent".into())])
                .is_some_and(|m| m.ends_with("parent.yaml:5:5 (spec.replicas)"))
        );
        assert_eq!(relocate("no position here", json, file, yaml, &[]), None);
    }
}
