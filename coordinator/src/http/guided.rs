//! The OpenAI (and vLLM) ways of asking for a constrained output, translated into the gRPC
//! request's `format`: `response_format` (`json_object`, `json_schema` with `strict`, and
//! layerstream's `grammar` and `regex` types) and vLLM's `guided_json`, `guided_regex`,
//! `guided_grammar` and `guided_choice`.

use super::error::ApiError;
use layerstream_rpc::v1::{output_format::Kind as FormatKind, OutputFormat};
use serde::Deserialize;
use serde_json::Value;

/// `response_format`.
#[derive(Debug, Deserialize, Clone)]
pub struct ResponseFormat {
    #[serde(rename = "type")]
    kind: String,
    json_schema: Option<JsonSchemaBody>,
    /// `{"type": "grammar", "grammar": "<Lark>"}`.
    grammar: Option<String>,
    /// `{"type": "regex", "regex": "…"}`.
    regex: Option<String>,
}

/// `response_format.json_schema`.
#[derive(Debug, Deserialize, Clone)]
pub struct JsonSchemaBody {
    #[serde(default)]
    name: Option<String>,
    schema: Option<Value>,
    /// Accepted either way: the schema is always enforced.
    #[serde(default)]
    #[allow(dead_code)]
    strict: Option<bool>,
}

/// The fields of a request that may constrain its output.
#[derive(Debug, Deserialize, Clone, Default)]
pub struct Guided {
    pub(crate) response_format: Option<ResponseFormat>,
    pub(crate) guided_json: Option<Value>,
    pub(crate) guided_regex: Option<String>,
    pub(crate) guided_grammar: Option<String>,
    pub(crate) guided_choice: Option<Vec<String>>,
}

/// Escapes `s` for a regular expression.
fn escape(s: &str) -> String {
    s.chars()
        .flat_map(|c| {
            let special = "\\.+*?()|[]{}^$#&-~ ".contains(c);
            special.then_some('\\').into_iter().chain(std::iter::once(c))
        })
        .collect()
}

impl Guided {
    /// The format asked for (None: free text); more than one way at once is refused.
    pub fn format(&self) -> Result<Option<OutputFormat>, ApiError> {
        let mut found: Vec<(&str, FormatKind)> = Vec::new();
        if let Some(f) = &self.response_format {
            let bad = |m: &str| ApiError::bad("response_format", format!("response_format: {m}"));
            let kind = match f.kind.as_str() {
                "text" => None,
                "json_object" => Some(FormatKind::JsonObject(true)),
                "json_schema" => {
                    let body = f
                        .json_schema
                        .as_ref()
                        .ok_or_else(|| bad("json_schema needs `json_schema`"))?;
                    let _ = &body.name;
                    let schema = body
                        .schema
                        .as_ref()
                        .ok_or_else(|| bad("json_schema needs `json_schema.schema`"))?;
                    Some(FormatKind::JsonSchema(schema.to_string()))
                }
                "grammar" => Some(FormatKind::Lark(
                    f.grammar.clone().ok_or_else(|| bad("type grammar needs `grammar` (Lark)"))?,
                )),
                "regex" => Some(FormatKind::Regex(
                    f.regex.clone().ok_or_else(|| bad("type regex needs `regex`"))?,
                )),
                other => {
                    return Err(bad(&format!(
                        "unknown type {other:?}: text, json_object, json_schema, grammar or regex"
                    )))
                }
            };
            found.extend(kind.map(|k| ("response_format", k)));
        }
        if let Some(s) = &self.guided_json {
            // vLLM takes the schema as an object or as its text.
            let text = match s {
                Value::String(t) => t.clone(),
                other => other.to_string(),
            };
            found.push(("guided_json", FormatKind::JsonSchema(text)));
        }
        if let Some(r) = &self.guided_regex {
            found.push(("guided_regex", FormatKind::Regex(r.clone())));
        }
        if let Some(g) = &self.guided_grammar {
            found.push(("guided_grammar", FormatKind::Lark(g.clone())));
        }
        if let Some(c) = &self.guided_choice {
            if c.is_empty() {
                return Err(ApiError::bad(
                    "guided_choice",
                    "guided_choice: needs at least one choice",
                ));
            }
            let alts: Vec<String> = c.iter().map(|s| escape(s)).collect();
            found.push(("guided_choice", FormatKind::Regex(format!("({})", alts.join("|")))));
        }
        match found.len() {
            0 => Ok(None),
            1 => Ok(found.pop().map(|(_, k)| OutputFormat { kind: Some(k) })),
            _ => Err(ApiError::bad(
                found[1].0,
                format!("{}: only one of response_format and guided_* may be given", found[1].0),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn format(v: Value) -> Result<Option<OutputFormat>, ApiError> {
        serde_json::from_value::<Guided>(v).unwrap().format()
    }

    #[test]
    fn each_way_becomes_one_format() {
        let schema = serde_json::json!({"type": "object"});
        let f = format(serde_json::json!({"response_format": {"type": "json_schema",
            "json_schema": {"name": "x", "schema": schema, "strict": true}}}))
        .unwrap()
        .unwrap();
        assert_eq!(f.kind, Some(FormatKind::JsonSchema(schema.to_string())));
        assert!(format(serde_json::json!({"response_format": {"type": "text"}}))
            .unwrap()
            .is_none());
        let f = format(serde_json::json!({"guided_choice": ["a b", "c.d"]})).unwrap().unwrap();
        assert_eq!(f.kind, Some(FormatKind::Regex("(a\\ b|c\\.d)".into())));
        let e = format(serde_json::json!({"guided_regex": "a", "guided_grammar": "start: \"a\""}))
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("guided_grammar"));
        let e = format(serde_json::json!({"response_format": {"type": "xml"}})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("response_format"));
        let e =
            format(serde_json::json!({"response_format": {"type": "json_schema"}})).unwrap_err();
        assert!(e.message.contains("json_schema"), "{}", e.message);
    }
}
