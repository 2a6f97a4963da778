//! Errors in OpenAI's shape — `{"error": {"message", "type", "param", "code"}}` — with the status
//! OpenAI (and vLLM) give them, made from the gRPC statuses the shared request path returns.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An API error.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
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

    /// From the shared request path's status: INVALID_ARGUMENT → 400 (the field it names becomes
    /// `param`), RESOURCE_EXHAUSTED → 429, UNAVAILABLE → 503, NOT_FOUND → 404, anything else → 500.
    pub fn from_status(s: &tonic::Status) -> Self {
        // "request 0: " prefixes a job's request index: one request per HTTP call.
        let msg = s.message().strip_prefix("request 0: ").unwrap_or(s.message()).to_owned();
        let (status, kind) = match s.code() {
            tonic::Code::InvalidArgument => (StatusCode::BAD_REQUEST, "invalid_request_error"),
            tonic::Code::ResourceExhausted => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error"),
            tonic::Code::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable"),
            tonic::Code::NotFound => (StatusCode::NOT_FOUND, "invalid_request_error"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "server_error"),
        };
        let param = (status == StatusCode::BAD_REQUEST).then(|| param_of(&msg)).flatten();
        ApiError { status, message: msg, kind, param, code: None }
    }

    /// From a request that ended in error after it was queued (a worker fault the coordinator
    /// could not recover from): 503, as the stack cannot serve it now.
    pub fn failed(message: &str) -> Self {
        ApiError::unavailable(format!("generation failed: {message}"))
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

/// The OpenAI parameter a validation message names (`max_new_tokens: …` → `max_tokens`).
fn param_of(msg: &str) -> Option<String> {
    let field = msg.split(':').next()?.trim();
    let known = [
        ("max_new_tokens", "max_tokens"),
        ("prompt", "messages"),
        ("token_ids", "prompt"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("repetition_penalty", "repetition_penalty"),
        ("stop", "stop"),
        ("top_logprobs", "top_logprobs"),
        ("chat has no messages", "messages"),
    ];
    known.iter().find(|(k, _)| *k == field).map(|(_, p)| (*p).to_owned())
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
    fn grpc_statuses_map_to_openai_errors() {
        let e = ApiError::from_status(&tonic::Status::invalid_argument(
            "request 0: max_new_tokens: prompt of 3 tokens + max_new_tokens 9000 exceeds the model's context of 8192",
        ));
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(e.message.starts_with("max_new_tokens:"));
        let body = e.body();
        assert_eq!(body["error"]["type"], "invalid_request_error");
        let e = ApiError::from_status(&tonic::Status::resource_exhausted("queue full"));
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(e.param, None);
        assert_eq!(ApiError::unauthorized().status, StatusCode::UNAUTHORIZED);
        assert_eq!(ApiError::unknown_model("x", "y").body()["error"]["code"], "model_not_found");
    }
}
