//! YAML as wasmctrl writes it: safe for every reader it goes to.
//!
//! `kubectl` (through go-yaml), PyYAML and many other readers still follow YAML 1.1, where a
//! plain `yes`, `on`, `y`, `1:20` or `2026-11-29T02:15:00Z` is not a string but a boolean, a
//! number or a timestamp. Cases, `plugin run` output and RBAC rules are meant to be fed back to
//! those readers, so every string that any YAML version could read as something else is
//! quoted. `serde_yaml_ng` quotes only what YAML 1.2 would misread; `serde-saphyr` quotes for
//! both, which is why output goes through it while input is still read by `serde_yaml_ng`.

use serde::Serialize;

/// `value` as a YAML document.
pub fn to_string<T: Serialize>(value: &T) -> anyhow::Result<String> {
    serde_saphyr::to_string(value).map_err(|e| anyhow::anyhow!("cannot write YAML: {e}"))
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    #[test]
    fn strings_a_yaml_1_1_reader_would_take_for_something_else_are_quoted() {
        let strings = [
            "2026-11-29T02:15:00Z",
            "2026-11-29",
            "yes",
            "No",
            "on",
            "OFF",
            "y",
            "n",
            "1:20",
            "0777",
            "1_000",
            "0x1F",
            "~",
            "null",
            "true",
            "3",
            ".5",
        ];
        let value = json!({"data": strings, "yes": "key too"});
        let text = super::to_string(&value).expect("yaml");
        for s in strings {
            assert!(
                text.contains(&format!("- \"{s}\"")) || text.contains(&format!("- '{s}'")),
                "{s} is not quoted in:\n{text}"
            );
        }
        assert!(text.contains("\"yes\": key too"), "{text}");
        // And it reads back as the same strings.
        let back: Value = serde_yaml_ng::from_str(&text).expect("read back");
        assert_eq!(back, value);
    }

    #[test]
    fn plain_strings_stay_plain_and_multi_line_ones_are_blocks() {
        let value = json!({"image": "nginx:1.27", "name": "web", "script": "echo a\necho b\n"});
        let text = super::to_string(&value).expect("yaml");
        assert!(text.contains("name: web\n"), "{text}");
        assert!(text.contains("script: |\n  echo a\n  echo b\n"), "{text}");
        let back: Value = serde_yaml_ng::from_str(&text).expect("read back");
        assert_eq!(back, value);
    }

    #[test]
    fn long_and_odd_strings_read_back_exactly() {
        let long = "word ".repeat(40);
        let strings = [
            long.trim_end().to_owned(),
            format!("{long}  two  spaces   and trailing "),
            "line one\n  indented line\n\nafter a blank\n".to_owned(),
            "no final newline\nsecond".to_owned(),
            "tab\tand unicode é ü ✓ and a # hash and a: colon".to_owned(),
            " leading space".to_owned(),
            "- dash".to_owned(),
            String::new(),
        ];
        let value = json!({ "strings": strings });
        let text = super::to_string(&value).expect("yaml");
        let back: Value = serde_yaml_ng::from_str(&text).expect("read back");
        assert_eq!(back, value, "{text}");
    }
}
