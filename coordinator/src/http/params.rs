//! One policy for the parameters of an OpenAI body that layerstream does not implement:
//! - a parameter that would change the output (`min_p`, beam search, audio, legacy `functions`…)
//!   is refused with a 400 naming it — unless its value asks for what happens anyway (`min_p: 0`,
//!   `skip_special_tokens: true`, `modalities: ["text"]`);
//! - any other unknown parameter (`user`, `metadata`, `store`, a client's own extension…) is
//!   accepted and ignored, as OpenAI and vLLM do, and named in the `x-layerstream-ignored`
//!   response header and the log, so that nothing is ignored silently.

use super::error::ApiError;
use serde_json::{Map, Value};

/// The fields both endpoints implement (`openai::Common` and `guided::Guided`).
const COMMON: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "frequency_penalty",
    "presence_penalty",
    "top_k",
    "repetition_penalty",
    "ignore_eos",
    "speculative",
    "stream",
    "stream_options",
    "n",
    "best_of",
    "logit_bias",
    "min_tokens",
    "stop_token_ids",
    "prompt_logprobs",
    "cache_salt",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_grammar",
    "guided_choice",
];

/// `/v1/chat/completions`' own fields (`openai::ChatRequest`).
pub const CHAT: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
];

/// `/v1/completions`' own fields (`openai::CompletionRequest`).
pub const COMPLETION: &[&str] = &["prompt", "logprobs", "echo", "suffix"];

/// Parameters that change the output, with the values that ask for nothing beyond what layerstream
/// does (null is always such a value).
fn harmless(name: &str, v: &Value) -> Option<bool> {
    let empty = |v: &Value| v.as_array().is_some_and(Vec::is_empty);
    Some(
        v.is_null()
            || match name {
                "functions" | "bad_words" | "logits_processors" => empty(v),
                "function_call" => v == "none",
                "min_p" => v.as_f64() == Some(0.0),
                "use_beam_search" | "include_stop_str_in_output" => v == false,
                "skip_special_tokens" => v == true,
                "modalities" => v.as_array().is_some_and(|m| m.iter().all(|x| x == "text")),
                "audio"
                | "prediction"
                | "web_search_options"
                | "allowed_token_ids"
                | "truncate_prompt_tokens"
                | "length_penalty" => false,
                _ => return None,
            },
    )
}

/// Checks a body's top-level keys against `own` (the endpoint's fields): the keys ignored, or a
/// 400 naming a parameter that is not implemented.
pub fn check(body: &Map<String, Value>, own: &[&str]) -> Result<Vec<String>, ApiError> {
    let mut ignored = Vec::new();
    for (k, v) in body {
        if COMMON.contains(&k.as_str()) || own.contains(&k.as_str()) {
            continue;
        }
        match harmless(k, v) {
            Some(true) => {}
            Some(false) => {
                return Err(ApiError::bad(
                    k,
                    format!("{k}: not supported ({v} would change the output; leave it out or give its default)"),
                ))
            }
            None => ignored.push(k.clone()),
        }
    }
    ignored.sort();
    Ok(ignored)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn keys(v: Value) -> Result<Vec<String>, ApiError> {
        check(v.as_object().unwrap(), CHAT)
    }

    #[test]
    fn unknown_parameters_are_named_and_output_changing_ones_refused() {
        let ok = keys(json!({"messages": [], "temperature": 0, "guided_choice": ["a"],
            "user": "u", "metadata": {}, "x_custom": 1}))
        .unwrap();
        assert_eq!(ok, ["metadata", "user", "x_custom"]);
        for (k, v) in [
            ("min_p", json!(0.1)),
            ("functions", json!([{"name": "f"}])),
            ("use_beam_search", json!(true)),
            ("modalities", json!(["audio"])),
            ("audio", json!({})),
        ] {
            let e = keys(json!({"messages": [], k: v})).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(k));
        }
        for (k, v) in [
            ("min_p", json!(0.0)),
            ("skip_special_tokens", json!(true)),
            ("modalities", json!(["text"])),
            ("functions", json!(null)),
        ] {
            assert_eq!(keys(json!({"messages": [], k: v})).unwrap(), Vec::<String>::new(), "{k}");
        }
        assert_eq!(
            check(json!({"prompt": "a", "echo": true}).as_object().unwrap(), COMPLETION).unwrap(),
            Vec::<String>::new()
        );
        assert_eq!(keys(json!({"prompt": "a"})).unwrap(), ["prompt"], "not a chat field");
    }
}
