//! The OpenAI API's response bodies, typed: the envelope of an answer or a streamed chunk, its
//! choices (a chat message, a chat delta, a completion's text), log-probabilities in both
//! endpoints' formats, vLLM's `prompt_logprobs`, tool calls and usage. Serialized as OpenAI's
//! and vLLM's clients read them (log-probabilities as f64, as the values were always written).

use serde::Serialize;
use std::collections::BTreeMap;

/// An answer (`chat.completion`, `text_completion`) or a streamed chunk of one.
#[derive(Debug, Serialize)]
pub struct Envelope<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub system_fingerprint: Option<String>,
    pub choices: Vec<Choice>,
    /// Absent, null (a chunk when `include_usage` asked for it only on the last), or the usage.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

/// Tokens counted.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

impl Usage {
    /// `prompt` and `completion` tokens, and their total.
    pub fn counted(prompt: u64, completion: u64, details: Option<PromptTokensDetails>) -> Self {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: details,
        }
    }
}

/// Prompt tokens found in the prefix cache.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: u64,
}

/// One choice of an answer or a chunk.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Choice {
    /// A whole chat answer's message.
    Message {
        index: usize,
        message: Message,
        logprobs: Option<Logprobs>,
        finish_reason: &'static str,
        #[serde(skip_serializing_if = "Option::is_none")]
        prompt_logprobs: Option<PromptLogprobs>,
    },
    /// A streamed chat chunk's delta.
    Delta {
        index: usize,
        delta: Delta,
        logprobs: Option<Logprobs>,
        finish_reason: Option<&'static str>,
    },
    /// A completion's text (whole or streamed).
    Text {
        index: usize,
        text: String,
        logprobs: Option<Logprobs>,
        finish_reason: Option<&'static str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        prompt_logprobs: Option<PromptLogprobs>,
    },
}

/// The assistant's message: its text (null when it only calls tools) and its calls.
#[derive(Debug, Serialize)]
pub struct Message {
    pub role: &'static str,
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

/// What a streamed chat chunk adds.
#[derive(Debug, Default, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

impl Delta {
    /// A delta of text.
    pub fn text(content: String) -> Self {
        Delta { content: Some(content), ..Default::default() }
    }
}

/// A tool call in a message.
#[derive(Debug, Serialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: Function,
}

/// The function a call names, and its arguments (JSON text).
#[derive(Debug, Serialize)]
pub struct Function {
    pub name: String,
    pub arguments: String,
}

/// A streamed piece of tool call `index`: its id, type and name first, then its arguments.
#[derive(Debug, Serialize)]
pub struct ToolCallDelta {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionDelta,
}

/// A streamed piece of a call's function.
#[derive(Debug, Serialize)]
pub struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

/// Log-probabilities in the endpoint's format.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Logprobs {
    /// Chat: one entry per token, with its alternatives.
    Chat { content: Vec<TokenLogprob> },
    /// Completions: the legacy parallel lists.
    Completion {
        tokens: Vec<String>,
        token_logprobs: Vec<Option<f64>>,
        top_logprobs: Vec<Option<BTreeMap<String, f64>>>,
        text_offset: Vec<usize>,
    },
}

/// A chat token's log-probability (its bytes as UTF-8 values), with its alternatives (which
/// carry none of their own).
#[derive(Debug, Serialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f64,
    pub bytes: Vec<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<Vec<TokenLogprob>>,
}

impl TokenLogprob {
    /// `token` at `logprob`, without alternatives.
    pub fn new(token: String, logprob: f32) -> Self {
        let bytes = token.as_bytes().to_vec();
        TokenLogprob { token, logprob: logprob as f64, bytes, top_logprobs: None }
    }
}

/// vLLM's `prompt_logprobs`: null for the first prompt token, then per token its id (as text)
/// mapped to its log-probability and text, the prompt's token first and its alternatives after.
pub type PromptLogprobs = Vec<Option<BTreeMap<String, PromptLogprob>>>;

/// One entry of `prompt_logprobs`.
#[derive(Debug, Serialize)]
pub struct PromptLogprob {
    pub logprob: f64,
    pub decoded_token: String,
}

/// An error body: `{"error": {message, type, param, code}}`.
#[derive(Debug, Serialize)]
pub struct ErrorBody<'a> {
    pub error: ErrorDetail<'a>,
}

/// What an error body says.
#[derive(Debug, Serialize)]
pub struct ErrorDetail<'a> {
    pub message: &'a str,
    #[serde(rename = "type")]
    pub kind: &'a str,
    pub param: Option<&'a str>,
    pub code: Option<&'a str>,
}

/// `/v1/models`.
#[derive(Debug, Serialize)]
pub struct ModelList<'a> {
    pub object: &'static str,
    pub data: Vec<ModelCard<'a>>,
}

/// One served model.
#[derive(Debug, Serialize)]
pub struct ModelCard<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub max_model_len: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The shapes OpenAI's clients read: null where a field is unset, absent where OpenAI omits
    /// it, the `type` fields named so.
    #[test]
    fn bodies_serialize_as_openai_writes_them() {
        let call = ToolCall {
            id: "call_1".into(),
            kind: "function",
            function: Function { name: "f".into(), arguments: "{}".into() },
        };
        let message = Message { role: "assistant", content: None, tool_calls: Some(vec![call]) };
        let choice = Choice::Message {
            index: 0,
            message,
            logprobs: None,
            finish_reason: "tool_calls",
            prompt_logprobs: None,
        };
        assert_eq!(
            serde_json::to_value(&choice).unwrap(),
            json!({"index": 0, "logprobs": null, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": null,
                "tool_calls": [{"id": "call_1", "type": "function",
                                "function": {"name": "f", "arguments": "{}"}}]}})
        );
        let env = Envelope {
            id: "x",
            object: "chat.completion.chunk",
            created: 1,
            model: "m",
            system_fingerprint: None,
            choices: vec![],
            usage: Some(None),
        };
        let v = serde_json::to_value(&env).unwrap();
        assert!(v["usage"].is_null() && v.as_object().unwrap().contains_key("usage"));
        let lp = TokenLogprob::new("é".into(), -0.5);
        assert_eq!(
            serde_json::to_value(&lp).unwrap(),
            json!({"token": "é", "logprob": -0.5, "bytes": [195, 169]})
        );
    }
}
