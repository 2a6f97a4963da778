//! OpenAI's tool fields: `tools`, `tool_choice` and `parallel_tool_calls` in, assistant
//! `tool_calls` and `tool` messages in the history, and `tool_calls` out (a whole message, or
//! streamed as `delta.tool_calls`: a call's id and name first, then its arguments).

use super::bodies;
use super::error::ApiError;
use layerstream_rpc::v1::{Tool, ToolCall};
use serde::Deserialize;
use serde_json::Value;

/// One entry of `tools`.
#[derive(Debug, Deserialize, Clone)]
pub struct ToolBody {
    #[serde(rename = "type")]
    kind: String,
    function: Option<FunctionBody>,
}

/// `tools[].function`.
#[derive(Debug, Deserialize, Clone)]
pub struct FunctionBody {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    parameters: Option<Value>,
}

/// The request's tools on the wire.
pub fn wire_tools(tools: &[ToolBody]) -> Result<Vec<Tool>, ApiError> {
    tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let f = match (t.kind.as_str(), &t.function) {
                ("function", Some(f)) => f,
                (kind, _) => {
                    return Err(ApiError::bad(
                        "tools",
                        format!("tools[{i}]: type {kind:?} with a `function` is required (type \"function\")"),
                    ))
                }
            };
            Ok(Tool {
                name: f.name.clone(),
                description: f.description.clone().unwrap_or_default(),
                parameters_json: f.parameters.as_ref().map(Value::to_string).unwrap_or_default(),
            })
        })
        .collect()
}

/// `tool_choice` on the wire: "auto", "none", "required" or "function:NAME".
pub fn wire_choice(choice: Option<&Value>) -> Result<String, ApiError> {
    let bad = || {
        ApiError::bad(
            "tool_choice",
            "tool_choice: must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": …}}",
        )
    };
    match choice {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) if ["auto", "none", "required"].contains(&s.as_str()) => {
            Ok(s.clone())
        }
        Some(v @ Value::Object(_)) => match v["function"]["name"].as_str() {
            Some(name) if v["type"] == "function" => Ok(format!("function:{name}")),
            _ => Err(bad()),
        },
        _ => Err(bad()),
    }
}

/// A whole message's `tool_calls`.
pub fn message_calls(calls: &[ToolCall]) -> Vec<bodies::ToolCall> {
    let call = |c: &ToolCall| bodies::ToolCall {
        id: c.id.clone(),
        kind: "function",
        function: bodies::Function { name: c.name.clone(), arguments: c.arguments.clone() },
    };
    calls.iter().map(call).collect()
}

/// The streamed deltas of `calls`: per call, one with its index, id and name (arguments empty),
/// then one with its arguments.
pub fn delta_calls(calls: &[ToolCall]) -> Vec<bodies::Delta> {
    let delta = |d: bodies::ToolCallDelta| bodies::Delta {
        tool_calls: Some(vec![d]),
        ..Default::default()
    };
    calls
        .iter()
        .enumerate()
        .flat_map(|(index, c)| {
            let named = bodies::ToolCallDelta {
                index,
                id: Some(c.id.clone()),
                kind: Some("function"),
                function: bodies::FunctionDelta {
                    name: Some(c.name.clone()),
                    arguments: "".into(),
                },
            };
            let args = bodies::ToolCallDelta {
                index,
                id: None,
                kind: None,
                function: bodies::FunctionDelta { name: None, arguments: c.arguments.clone() },
            };
            [delta(named), delta(args)]
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn choices_and_tools_translate() {
        assert_eq!(wire_choice(None).unwrap(), "");
        assert_eq!(wire_choice(Some(&json!("required"))).unwrap(), "required");
        let named = json!({"type": "function", "function": {"name": "w"}});
        assert_eq!(wire_choice(Some(&named)).unwrap(), "function:w");
        assert_eq!(
            wire_choice(Some(&json!("always"))).unwrap_err().param.as_deref(),
            Some("tool_choice")
        );
        let t: Vec<ToolBody> = serde_json::from_value(json!([{"type": "function",
            "function": {"name": "w", "parameters": {"type": "object"}}}]))
        .unwrap();
        let w = wire_tools(&t).unwrap();
        assert_eq!(
            (w[0].name.as_str(), w[0].parameters_json.as_str()),
            ("w", "{\"type\":\"object\"}")
        );
        let t: Vec<ToolBody> =
            serde_json::from_value(json!([{"type": "code_interpreter"}])).unwrap();
        assert_eq!(wire_tools(&t).unwrap_err().param.as_deref(), Some("tools"));
        let c = ToolCall { id: "call_1".into(), name: "w".into(), arguments: "{}".into() };
        let d = serde_json::to_value(delta_calls(&[c])).unwrap();
        assert_eq!(d[0]["tool_calls"][0]["function"]["name"], "w");
        assert_eq!(d[1]["tool_calls"][0]["function"]["arguments"], "{}");
    }
}
