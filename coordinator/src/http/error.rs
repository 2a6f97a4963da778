//! Errors in OpenAI's shape — `{"error": {"message", "type", "param", "code"}}` — with the status
//! OpenAI (and vLLM) give them, made from the coordinator's typed errors (`crate::Error`): the field of a refused request is
//! read from the error value, never from its message.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// An API error.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
    pub(crate) kind: &'static str,
    pub(crate) param: Option<String>,
    pub(crate) code: Option<&'static str>,
}

impl ApiError {
    /// 400 naming the offending parameter.
    pub fn bad(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_owned()),
            code: None,
        }
    }

    /// 401: no key, or the wrong one.
    pub fn unauthorized() -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "missing or invalid API key: send `Authorization: Bearer <key>`".into(),
            kind: "authentication_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    /// 404 for a model this server does not serve.
    pub fn unknown_model(asked: &str, served: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("the model `{asked}` does not exist; this server serves `{served}`"),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    /// 503: the workers cannot run it.
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "service_unavailable",
            param: None,
            code: None,
        }
    }

    /// From the shared request path's error: a refused request → 400 with the field it names as
    /// `param` (`chat`: the prompt is the chat endpoint's `messages`), a full queue → 429, no such
    /// job → 404, anything else → 503 (the stack cannot serve it now).
    pub fn from_error(e: &crate::Error, chat: bool) -> Self {
        let (status, kind, param) = match e {
            crate::Error::Request(r) => {
                let param = r.field().openai_param(chat).map(str::to_owned);
                (StatusCode::BAD_REQUEST, "invalid_request_error", param)
            }
            crate::Error::Busy(_) => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", None),
            crate::Error::NoJob(_) => (StatusCode::NOT_FOUND, "invalid_request_error", None),
            _ => (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", None),
        };
        // One request per HTTP call: its message names no request index.
        let message = match e {
            crate::Error::Request(r) => r.describe(),
            other => other.to_string(),
        };
        ApiError { status, message, kind, param, code: None }
    }

    /// From a request that ended in error after it was queued (a worker fault the coordinator
    /// could not recover from): 503, as the stack cannot serve it now.
    pub fn failed(message: &str) -> Self {
        ApiError::unavailable(format!("generation failed: {message}"))
    }

    /// The JSON body.
    pub fn body(&self) -> super::bodies::ErrorBody<'_> {
        super::bodies::ErrorBody {
            error: super::bodies::ErrorDetail {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        }
    }

    /// The JSON body as text (an SSE event's data).
    pub fn json(&self) -> String {
        serde_json::to_string(&self.body()).expect("the error body serializes")
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_openai_errors() {
        use layerstream_serving::{Field, RequestError};
        let r = RequestError::new(
            Field::MaxNewTokens,
            "prompt of 3 tokens + max_new_tokens 9000 exceeds the model's context of 8192",
        );
        let e = ApiError::from_error(&crate::Error::from(r.in_request(0)), true);
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(e.message.starts_with("max_new_tokens:"), "{}", e.message);
        let body = serde_json::to_value(e.body()).unwrap();
        assert_eq!(body["error"]["type"], "invalid_request_error");
        let prompt = crate::Error::from(RequestError::new(Field::Prompt, "too long"));
        assert_eq!(ApiError::from_error(&prompt, true).param.as_deref(), Some("messages"));
        assert_eq!(ApiError::from_error(&prompt, false).param.as_deref(), Some("prompt"));
        let e = ApiError::from_error(&crate::Error::Busy("queue full".into()), true);
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(e.param, None);
        assert_eq!(ApiError::unauthorized().status, StatusCode::UNAUTHORIZED);
        let unknown = serde_json::to_value(ApiError::unknown_model("x", "y").body()).unwrap();
        assert_eq!(unknown["error"]["code"], "model_not_found");
    }
}
