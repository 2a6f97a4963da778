//! OpenAI request bodies (`/v1/chat/completions`, `/v1/completions`) and their translation into the
//! `GenerateRequest` the gRPC API queues: one request path, one scheduler. Parameters layerstream
//! does not implement get a 400 naming them rather than being ignored.

use super::error::ApiError;
use super::guided::Guided;
use super::tools::{wire_choice, wire_tools, ToolBody};
use layerstream_rpc::v1::{
    generate_request, ChatMessage, ChatMessages, GenerateRequest, Sampling, Speculative, TokenIds,
};
use serde::Deserialize;

/// A string or a list of them (`stop`).
#[derive(Debug, Deserialize, Clone)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

/// Message content: a string, or parts of which only text is understood.
#[derive(Debug, Deserialize, Clone)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

/// A content part.
#[derive(Debug, Deserialize, Clone)]
pub struct Part {
    #[serde(rename = "type")]
    pub(crate) kind: String,
    #[serde(default)]
    pub(crate) text: Option<String>,
}

/// A chat message.
#[derive(Debug, Deserialize, Clone)]
pub struct Msg {
    pub(crate) role: String,
    #[serde(default)]
    pub(crate) content: Option<Content>,
    /// An assistant's tool calls.
    #[serde(default)]
    pub(crate) tool_calls: Option<serde_json::Value>,
    /// A tool result's call id and function name.
    #[serde(default)]
    pub(crate) tool_call_id: Option<String>,
    #[serde(default)]
    pub(crate) name: Option<String>,
}

/// `stream_options`.
#[derive(Debug, Deserialize, Clone, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub(crate) include_usage: bool,
    /// vLLM's: with `include_usage`, every chunk carries the usage so far.
    #[serde(default)]
    pub(crate) continuous_usage_stats: bool,
}

/// The sampling and length fields both endpoints share (vLLM's extensions included).
#[derive(Debug, Deserialize, Clone, Default)]
pub struct Common {
    pub(crate) model: Option<String>,
    pub(crate) max_tokens: Option<i64>,
    pub(crate) temperature: Option<f32>,
    pub(crate) top_p: Option<f32>,
    pub(crate) seed: Option<i64>,
    pub(crate) stop: Option<OneOrMany>,
    pub(crate) frequency_penalty: Option<f32>,
    pub(crate) presence_penalty: Option<f32>,
    pub(crate) top_k: Option<i64>,
    pub(crate) repetition_penalty: Option<f32>,
    pub(crate) ignore_eos: Option<bool>,
    /// Speculative decoding limits, as llama-server names them: `{"n_max": 16, "n_min": 0}`
    /// (`n_max` 0 = no speculation for this request).
    pub(crate) speculative: Option<SpecBody>,
    #[serde(default)]
    pub(crate) stream: bool,
    pub(crate) stream_options: Option<StreamOptions>,
    pub(crate) n: Option<i64>,
    pub(crate) best_of: Option<i64>,
    pub(crate) logit_bias: Option<serde_json::Value>,
    /// vLLM's extensions.
    pub(crate) min_tokens: Option<i64>,
    pub(crate) stop_token_ids: Option<Vec<u32>>,
    pub(crate) prompt_logprobs: Option<i64>,
    /// vLLM's prefix-cache salt: only requests with the same salt share cached prompt blocks.
    pub(crate) cache_salt: Option<String>,
    #[serde(flatten)]
    pub(crate) guided: Guided,
}

/// Most choices one request may ask for (`n`).
pub const MAX_N: usize = 16;

/// Most prompts one `/v1/completions` request may batch.
pub const MAX_PROMPTS: usize = 256;

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize, Clone)]
pub struct ChatRequest {
    pub(crate) messages: Vec<Msg>,
    pub(crate) max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub(crate) logprobs: bool,
    pub(crate) top_logprobs: Option<i64>,
    pub(crate) tools: Option<Vec<ToolBody>>,
    pub(crate) tool_choice: Option<serde_json::Value>,
    pub(crate) parallel_tool_calls: Option<bool>,
    #[serde(flatten)]
    pub(crate) common: Common,
}

/// `prompt` of `/v1/completions`: text, token ids, or a list of either (a batch: each prompt gets
/// its own `n` choices).
#[derive(Debug, Deserialize, Clone)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<u32>>),
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize, Clone)]
pub struct CompletionRequest {
    pub(crate) prompt: Prompt,
    /// Legacy: the number of most likely tokens to return with each token (0-5 at OpenAI; ≤ 20 here).
    pub(crate) logprobs: Option<i64>,
    #[serde(default)]
    pub(crate) echo: bool,
    pub(crate) suffix: Option<String>,
    #[serde(flatten)]
    pub(crate) common: Common,
}

/// What a request asks for beyond the GenerateRequest: streaming and how to answer.
#[derive(Debug, Clone)]
pub struct Shape {
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    /// vLLM's `continuous_usage_stats`: the usage so far in every chunk.
    pub(crate) continuous_usage: bool,
    pub(crate) logprobs: Option<usize>,
    /// `max_tokens` was given (else the context that remains after the prompt is the limit).
    pub(crate) max_tokens: Option<u32>,
    /// The `Idempotency-Key` header: a request sent again with it gets the same job.
    pub(crate) idempotency_key: Option<String>,
    /// Choices to generate (`n`), each with the request's seed + its index.
    pub(crate) n: usize,
    /// `/v1/completions` `echo`: the prompt comes back before the output (with its
    /// log-probabilities when `logprobs` is set).
    pub(crate) echo: bool,
    /// vLLM's `prompt_logprobs` (returned with each choice).
    pub(crate) prompt_logprobs: Option<usize>,
    /// The request has tools: the output may come back as tool calls (streamed at the end).
    pub(crate) tools: bool,
    /// Which of the server's API keys the request presented (its tenant; None: no keys).
    pub(crate) key: Option<usize>,
    /// A streaming client reconnecting (`Last-Event-ID`, with the job's `Idempotency-Key`): the
    /// tokens of each choice it has, left out of the stream.
    pub(crate) resume: Vec<u32>,
}

fn non_negative(name: &str, v: Option<i64>) -> Result<Option<u32>, ApiError> {
    match v {
        None => Ok(None),
        Some(x) if (0..=u32::MAX as i64).contains(&x) => Ok(Some(x as u32)),
        Some(x) => Err(ApiError::bad(
            name,
            format!("{name}: must be an integer in 0..={}, got {x}", u32::MAX),
        )),
    }
}

impl Common {
    /// Checks what is not implemented and builds the sampling settings; `logprobs` is the number
    /// of alternatives asked for (None: no log-probabilities).
    fn sampling(&self, logprobs: Option<usize>) -> Result<(Sampling, Shape), ApiError> {
        for (name, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if v.is_some_and(|v| !(-2.0..=2.0).contains(&v)) {
                return Err(ApiError::bad(name, format!("{name}: must be in [-2, 2]")));
            }
        }
        let n = match self.n {
            None => 1,
            Some(n) if (1..=MAX_N as i64).contains(&n) => n as usize,
            Some(n) => {
                return Err(ApiError::bad("n", format!("n: must be in 1..={MAX_N}, got {n}")))
            }
        };
        if self.best_of.is_some_and(|b| b != n as i64) {
            return Err(ApiError::bad("best_of", "best_of: only best_of = n is supported"));
        }
        let logit_bias = self.logit_bias()?;
        let top_k = self.top_k()?;
        if self.top_p.is_some_and(|p| p == 0.0) {
            return Err(ApiError::bad("top_p", "top_p: must be in (0, 1], got 0"));
        }
        // Explicit here, unlike gRPC's proto3 field (where 0 is "unset"): 0 is refused as vLLM does.
        if let Some(r) = self.repetition_penalty.filter(|r| !(*r > 0.0 && r.is_finite())) {
            return Err(ApiError::bad(
                "repetition_penalty",
                format!("repetition_penalty: must be > 0 (1 = off), got {r}"),
            ));
        }
        // OpenAI's defaults: temperature 1, a fresh random seed per request.
        let seed = match self.seed {
            Some(s) => s as u64,
            None => {
                u64::from_str_radix(&layerstream_rpc::auth::random_hex()[..16], 16).unwrap_or(0)
            }
        };
        let sampling = Sampling {
            temperature: self.temperature.unwrap_or(1.0),
            top_k,
            top_p: self.top_p.unwrap_or(1.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            seed,
            logprobs: logprobs.is_some(),
            top_logprobs: logprobs.unwrap_or(0) as u32,
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            logit_bias,
            min_tokens: non_negative("min_tokens", self.min_tokens)?.unwrap_or(0),
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            prompt_len: 0,
            eos_ids: Vec::new(),
        };
        let prompt_logprobs = non_negative("prompt_logprobs", self.prompt_logprobs)?;
        if let Some(k) = prompt_logprobs.filter(|&k| k > 20) {
            return Err(ApiError::bad(
                "prompt_logprobs",
                format!("prompt_logprobs: must be at most 20, got {k}"),
            ));
        }
        let shape = Shape {
            stream: self.stream,
            include_usage: self.stream_options.as_ref().is_some_and(|o| o.include_usage),
            continuous_usage: self
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage && o.continuous_usage_stats),
            logprobs,
            max_tokens: non_negative("max_tokens", self.max_tokens)?,
            idempotency_key: None,
            n,
            echo: false,
            prompt_logprobs: prompt_logprobs.map(|k| k as usize),
            tools: false,
            key: None,
            resume: Vec::new(),
        };
        Ok((sampling, shape))
    }

    /// `logit_bias`: token ids (as strings) mapped to biases in [-100, 100].
    fn logit_bias(&self) -> Result<std::collections::HashMap<u32, f32>, ApiError> {
        Ok(match &self.logit_bias {
            None | Some(serde_json::Value::Null) => Default::default(),
            Some(serde_json::Value::Object(o)) => o
                .iter()
                .map(|(k, v)| match (k.parse::<u32>(), v.as_f64()) {
                    (Ok(t), Some(b)) if (-100.0..=100.0).contains(&b) => Ok((t, b as f32)),
                    _ => Err(ApiError::bad(
                        "logit_bias",
                        format!(
                            "logit_bias: {k:?}: {v} must map a token id to a bias in [-100, 100]"
                        ),
                    )),
                })
                .collect::<Result<_, _>>()?,
            Some(_) => {
                return Err(ApiError::bad("logit_bias", "logit_bias: must map token ids to biases"))
            }
        })
    }

    /// `top_k`: -1 or 0 (off, as 0), or a positive count.
    fn top_k(&self) -> Result<u32, ApiError> {
        Ok(match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 && k <= u32::MAX as i64 => k as u32,
            Some(k) => {
                return Err(ApiError::bad(
                    "top_k",
                    format!(
                        "top_k: must be -1 or 0 (off) or an integer in 1..={}, got {k}",
                        u32::MAX
                    ),
                ))
            }
        })
    }

    fn stop(&self) -> Vec<String> {
        match &self.stop {
            None => Vec::new(),
            Some(OneOrMany::One(s)) => vec![s.clone()],
            Some(OneOrMany::Many(v)) => v.clone(),
        }
    }

    fn request(
        &self,
        input: generate_request::Input,
        sampling: Sampling,
        max: Option<u32>,
    ) -> Result<GenerateRequest, ApiError> {
        Ok(GenerateRequest {
            input: Some(input),
            max_new_tokens: max.unwrap_or(0),
            sampling: Some(sampling),
            stop: self.stop(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            speculative: self
                .speculative
                .as_ref()
                .map(|s| Speculative { max_tokens: s.n_max, min_tokens: s.n_min }),
            format: self.guided.format()?,
            prompt_logprobs: self.prompt_logprobs.map(|k| k as u32),
            tools: Vec::new(),
            tool_choice: String::new(),
            parallel_tool_calls: None,
            cache_salt: self.cache_salt.clone().unwrap_or_default(),
        })
    }
}

/// The body's `speculative` object.
#[derive(Debug, Clone, Deserialize)]
pub struct SpecBody {
    pub(crate) n_max: Option<u32>,
    #[serde(default)]
    pub(crate) n_min: u32,
}

/// Message `i`'s text: its content string, or its text parts joined.
fn text_of(i: usize, m: &Msg) -> Result<String, ApiError> {
    match &m.content {
        // An assistant's message may carry tool calls instead.
        None if m.tool_calls.as_ref().is_some_and(|c| !c.is_null()) => Ok(String::new()),
        None => Err(ApiError::bad("messages", format!("messages[{i}].content is required"))),
        Some(Content::Text(t)) => Ok(t.clone()),
        Some(Content::Parts(parts)) => {
            let mut out = String::new();
            for p in parts {
                match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => out.push_str(t),
                    ("text", None) => {
                        return Err(ApiError::bad(
                            "messages",
                            format!("messages[{i}]: a content part of type `text` needs `text`"),
                        ))
                    }
                    (kind, _) => {
                        return Err(ApiError::bad(
                            "messages",
                            format!("messages: content parts of type `{kind}` are not supported (text only)"),
                        ))
                    }
                }
            }
            Ok(out)
        }
    }
}

impl ChatRequest {
    /// The GenerateRequest (max_new_tokens 0 when the request sets no limit) and its shape.
    pub fn to_generate(&self) -> Result<(GenerateRequest, Shape), ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::bad("messages", "messages: at least one message is required"));
        }
        let logprobs = match (self.logprobs, self.top_logprobs) {
            (false, Some(k)) if k > 0 => {
                return Err(ApiError::bad("top_logprobs", "top_logprobs: requires logprobs = true"))
            }
            (false, _) => None,
            (true, k) => Some(non_negative("top_logprobs", k)?.unwrap_or(0) as usize),
        };
        let (sampling, mut shape) = self.common.sampling(logprobs)?;
        if let Some(m) = non_negative("max_completion_tokens", self.max_completion_tokens)? {
            shape.max_tokens = Some(m);
        }
        let messages = self
            .messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                Ok(ChatMessage {
                    role: m.role.clone(),
                    content: text_of(i, m)?,
                    tool_calls_json: match &m.tool_calls {
                        None | Some(serde_json::Value::Null) => String::new(),
                        Some(c) => c.to_string(),
                    },
                    tool_call_id: m.tool_call_id.clone().unwrap_or_default(),
                    name: m.name.clone().unwrap_or_default(),
                })
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        let input = generate_request::Input::Chat(ChatMessages { messages });
        let mut g = self.common.request(input, sampling, shape.max_tokens)?;
        g.tools = wire_tools(self.tools.as_deref().unwrap_or_default())?;
        g.tool_choice = wire_choice(self.tool_choice.as_ref())?;
        g.parallel_tool_calls = self.parallel_tool_calls;
        shape.tools = !g.tools.is_empty() && g.tool_choice != "none";
        Ok((g, shape))
    }
}

impl CompletionRequest {
    /// As `ChatRequest::to_generate`, one GenerateRequest per prompt.
    pub fn to_generate(&self) -> Result<(Vec<GenerateRequest>, Shape), ApiError> {
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::bad("suffix", "suffix is not supported"));
        }
        let logprobs = non_negative("logprobs", self.logprobs)?.map(|k| k as usize);
        let (sampling, mut shape) = self.common.sampling(logprobs)?;
        shape.echo = self.echo;
        use generate_request::Input;
        let ids = |v: &Vec<u32>| Input::TokenIds(TokenIds { ids: v.clone() });
        let inputs: Vec<Input> = match &self.prompt {
            Prompt::Text(t) => vec![Input::Prompt(t.clone())],
            Prompt::Ids(v) => vec![ids(v)],
            Prompt::Texts(v) => v.iter().map(|t| Input::Prompt(t.clone())).collect(),
            Prompt::IdLists(v) => v.iter().map(ids).collect(),
        };
        if inputs.is_empty() || inputs.len() > MAX_PROMPTS {
            return Err(ApiError::bad(
                "prompt",
                format!("prompt: a list of 1..={MAX_PROMPTS} prompts, got {}", inputs.len()),
            ));
        }
        let mut out = Vec::with_capacity(inputs.len());
        for input in inputs {
            let mut g = self.common.request(input, sampling.clone(), shape.max_tokens)?;
            if self.echo && logprobs.is_some() {
                // The prompt's log-probabilities, with as many alternatives as the output's.
                g.prompt_logprobs = g.prompt_logprobs.or(logprobs.map(|k| k as u32));
            }
            out.push(g);
        }
        Ok((out, shape))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: serde_json::Value) -> Result<(GenerateRequest, Shape), ApiError> {
        serde_json::from_value::<ChatRequest>(body).unwrap().to_generate()
    }

    #[test]
    fn chat_fields_become_the_grpc_request() {
        let (g, shape) = chat(serde_json::json!({
            "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 7, "temperature": 0, "seed": 3, "stop": "x", "top_k": -1,
            "logprobs": true, "top_logprobs": 2, "stream": true, "stream_options": {"include_usage": true},
            "user": "ignored"
        }))
        .unwrap();
        assert_eq!(g.max_new_tokens, 7);
        assert_eq!(g.stop, vec!["x".to_string()]);
        let s = g.sampling.unwrap();
        assert_eq!(
            (s.temperature, s.top_k, s.seed, s.logprobs, s.top_logprobs),
            (0.0, 0, 3, true, 2)
        );
        assert!(shape.stream && shape.include_usage);
        match g.input {
            Some(generate_request::Input::Chat(c)) => assert_eq!(c.messages[0].content, "hi"),
            other => panic!("{other:?}"),
        }
        // OpenAI's default temperature is 1.
        let (g, _) =
            chat(serde_json::json!({"messages": [{"role": "user", "content": "a"}]})).unwrap();
        assert_eq!(g.sampling.unwrap().temperature, 1.0);
    }

    #[test]
    fn unsupported_parameters_are_named() {
        let m = serde_json::json!([{"role": "user", "content": "a"}]);
        for (field, v) in [
            ("n", serde_json::json!(17)),
            ("frequency_penalty", serde_json::json!(2.5)),
            ("logit_bias", serde_json::json!({"x": 1})),
            ("tool_choice", serde_json::json!("always")),
            ("best_of", serde_json::json!(3)),
        ] {
            let mut body = serde_json::json!({"messages": m});
            body[field] = v;
            let e = chat(body).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field));
        }
        let e = chat(serde_json::json!({"messages": m, "max_tokens": -1})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
    }

    /// What an outside probe found accepted or misreported: each is refused naming its field, and
    /// range errors say the range.
    #[test]
    fn probe_holes_are_refused_with_the_range() {
        let m = serde_json::json!([{"role": "user", "content": "a"}]);
        let e = chat(serde_json::json!({"messages": m, "max_tokens": 1_000_000_000_000i64}))
            .unwrap_err();
        assert!(e.message.contains("0..=4294967295"), "{}", e.message);
        let e =
            chat(serde_json::json!({"messages": m, "top_k": 1_000_000_000_000i64})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_k"));
        assert!(e.message.contains("1..=4294967295"), "{}", e.message);
        for r in [0.0, -1.0] {
            let e = chat(serde_json::json!({"messages": m, "repetition_penalty": r})).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("repetition_penalty"), "{r}");
        }
        let e =
            chat(serde_json::json!({"messages": [{"role": "user", "content": null}]})).unwrap_err();
        assert_eq!(
            (e.param.as_deref(), e.message.as_str()),
            (Some("messages"), "messages[0].content is required")
        );
        let e = chat(serde_json::json!({"messages": [{"role": "user"}]})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = chat(
            serde_json::json!({"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
        )
        .unwrap_err();
        assert!(e.message.contains("needs `text`"), "{}", e.message);
    }
}
