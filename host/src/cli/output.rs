//! `-o text|json|yaml`: the output format of a command that prints one result, for people by
//! default and for tools on request. `-o` names a format in every command; an output file is
//! always a `--output-<what>` flag.

use clap::ValueEnum;
use serde::Serialize;

/// How a command prints its result.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// For people.
    #[default]
    Text,
    /// For tools (pretty-printed JSON).
    Json,
    /// For tools and people.
    Yaml,
}

impl OutputFormat {
    /// `value` as this format asks, `text` giving the text form (only called for `text`).
    pub fn render<T: Serialize>(
        self,
        value: &T,
        text: impl FnOnce() -> String,
    ) -> anyhow::Result<String> {
        Ok(match self {
            Self::Text => text(),
            Self::Json => serde_json::to_string_pretty(value)? + "\n",
            Self::Yaml => crate::yaml::to_string(value)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_format_renders_the_same_value() -> anyhow::Result<()> {
        let value = serde_json::json!({"signers": [{"key": "sha256:0123"}]});
        let text = || "signed by key sha256:0123\n".to_owned();
        assert_eq!(
            OutputFormat::Text.render(&value, text)?,
            "signed by key sha256:0123\n"
        );
        let json: serde_json::Value =
            serde_json::from_str(&OutputFormat::Json.render(&value, text)?)?;
        assert_eq!(json, value);
        let yaml: serde_json::Value =
            serde_yaml_ng::from_str(&OutputFormat::Yaml.render(&value, text)?)?;
        assert_eq!(yaml, value);
        Ok(())
    }
}
