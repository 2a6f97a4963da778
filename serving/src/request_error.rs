//! A request a client must fix, as a value: which request of a job, which field, and why. Every
//! door reads the field from here — gRPC as a `BadRequest` field violation, OpenAI as `param` — so
//! no one finds a field by reading a message.

/// A field of `layerstream.v1.GenerateRequest` (or of the job around it) that a request got wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Field {
    /// The job's list of requests (`SubmitJobRequest.requests`).
    Requests,
    /// The `input` oneof: none of prompt, chat or token_ids was set.
    Input,
    Prompt,
    Chat,
    TokenIds,
    MaxNewTokens,
    Stop,
    Temperature,
    TopK,
    TopP,
    RepetitionPenalty,
    TopLogprobs,
    /// `speculative.max_tokens` (OpenAI `speculative.n_max`).
    SpecMax,
    /// `speculative.min_tokens` (OpenAI `speculative.n_min`).
    SpecMin,
    FrequencyPenalty,
    PresencePenalty,
    LogitBias,
    MinTokens,
    StopTokenIds,
    /// The output format (OpenAI `response_format`).
    Format,
    Tools,
    ToolChoice,
    PromptLogprobs,
}

impl Field {
    /// The name messages use (`top_p: must be in (0, 1]`).
    pub fn name(self) -> &'static str {
        match self {
            Field::Requests => "requests",
            Field::Input => "input",
            Field::Prompt => "prompt",
            Field::Chat => "chat",
            Field::TokenIds => "token_ids",
            Field::MaxNewTokens => "max_new_tokens",
            Field::Stop => "stop",
            Field::Temperature => "temperature",
            Field::TopK => "top_k",
            Field::TopP => "top_p",
            Field::RepetitionPenalty => "repetition_penalty",
            Field::TopLogprobs => "top_logprobs",
            Field::SpecMax => "speculative.max_tokens",
            Field::SpecMin => "speculative.min_tokens",
            Field::FrequencyPenalty => "frequency_penalty",
            Field::PresencePenalty => "presence_penalty",
            Field::LogitBias => "logit_bias",
            Field::MinTokens => "min_tokens",
            Field::StopTokenIds => "stop_token_ids",
            Field::Format => "format",
            Field::Tools => "tools",
            Field::ToolChoice => "tool_choice",
            Field::PromptLogprobs => "prompt_logprobs",
        }
    }

    /// The field's path inside a `GenerateRequest`, as protobuf names it (`sampling.top_p`).
    pub fn wire_path(self) -> &'static str {
        match self {
            Field::Chat => "chat.messages",
            Field::Temperature => "sampling.temperature",
            Field::TopK => "sampling.top_k",
            Field::TopP => "sampling.top_p",
            Field::RepetitionPenalty => "sampling.repetition_penalty",
            Field::TopLogprobs => "sampling.top_logprobs",
            Field::FrequencyPenalty => "sampling.frequency_penalty",
            Field::PresencePenalty => "sampling.presence_penalty",
            Field::LogitBias => "sampling.logit_bias",
            Field::MinTokens => "sampling.min_tokens",
            Field::StopTokenIds => "sampling.stop_token_ids",
            other => other.name(),
        }
    }

    /// The OpenAI request parameter that carries this field: the prompt is `messages` on the
    /// chat endpoint and `prompt` on completions (which sends it as token ids).
    pub fn openai_param(self, chat: bool) -> Option<&'static str> {
        Some(match self {
            Field::Requests => return None,
            Field::Input | Field::Prompt | Field::TokenIds if !chat => "prompt",
            Field::Input | Field::Prompt | Field::TokenIds | Field::Chat => "messages",
            Field::MaxNewTokens => "max_tokens",
            Field::SpecMax => "speculative.n_max",
            Field::SpecMin => "speculative.n_min",
            Field::Format => "response_format",
            other => other.name(),
        })
    }
}

/// A refused request: the job's request `index` (when the job has several), the field, the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestError {
    index: Option<usize>,
    field: Field,
    reason: String,
}

impl RequestError {
    /// `field` is wrong because `reason`.
    pub fn new(field: Field, reason: impl Into<String>) -> Self {
        RequestError { index: None, field, reason: reason.into() }
    }

    /// The same error, about request `index` of a job.
    pub fn in_request(self, index: usize) -> Self {
        RequestError { index: Some(index), ..self }
    }

    /// The same error about a job's only request (a door that takes one request per call).
    pub fn single(self) -> Self {
        RequestError { index: None, ..self }
    }

    pub fn index(&self) -> Option<usize> {
        self.index
    }
    pub fn field(&self) -> Field {
        self.field
    }
    pub fn reason(&self) -> &str {
        &self.reason
    }

    /// The message without the request index: `top_p: must be in (0, 1], got 0`.
    pub fn describe(&self) -> String {
        format!("{}: {}", self.field.name(), self.reason)
    }

    /// The protobuf path of the field at fault: `requests[2].sampling.top_p` inside a job,
    /// `sampling.top_p` for a single request.
    pub fn field_path(&self) -> String {
        match (self.index, self.field) {
            (_, Field::Requests) => Field::Requests.wire_path().to_owned(),
            (Some(i), f) => format!("requests[{i}].{}", f.wire_path()),
            (None, f) => f.wire_path().to_owned(),
        }
    }
}

impl std::fmt::Display for RequestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(i) = self.index {
            write!(f, "request {i}: ")?;
        }
        f.write_str(&self.describe())
    }
}

impl std::error::Error for RequestError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_params_and_messages_come_from_one_value() {
        let e = RequestError::new(Field::TopP, "must be in (0, 1], got 0");
        assert_eq!(e.to_string(), "top_p: must be in (0, 1], got 0");
        assert_eq!(e.field_path(), "sampling.top_p");
        let e = e.in_request(2);
        assert_eq!(e.to_string(), "request 2: top_p: must be in (0, 1], got 0");
        assert_eq!(e.field_path(), "requests[2].sampling.top_p");
        assert_eq!(e.describe(), "top_p: must be in (0, 1], got 0");
        assert_eq!(e.clone().single().field_path(), "sampling.top_p");
        assert_eq!(Field::MaxNewTokens.openai_param(true), Some("max_tokens"));
        assert_eq!(Field::Prompt.openai_param(true), Some("messages"));
        assert_eq!(Field::TokenIds.openai_param(false), Some("prompt"));
        assert_eq!(Field::Requests.openai_param(true), None);
        assert_eq!(
            RequestError::new(Field::Requests, "empty").in_request(0).field_path(),
            "requests"
        );
    }
}
