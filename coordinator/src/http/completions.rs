//! `/v1/chat/completions` and `/v1/completions`: a request is translated (`openai`), queued through
//! the same `submit` as gRPC's Generate, and its events answered as one JSON body or as Server-Sent
//! Events in OpenAI's chunk format (ending with `data: [DONE]`). A client that goes away drops the
//! event stream, which cancels the job.

use super::error::ApiError;
use super::openai::Shape;
use super::Http;
use axum::http::HeaderValue;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use layerstream_rpc::v1::{
    generate_event, generate_request, FinalEvent, FinishReason, GenerateEvent, GenerateRequest,
    TokenIds, TokenLogprobs,
};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// Which endpoint: the names and shapes of its objects differ.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Kind {
    Chat,
    Completion,
}

impl Kind {
    fn id_prefix(self) -> &'static str {
        match self {
            Kind::Chat => "chatcmpl-",
            Kind::Completion => "cmpl-",
        }
    }
    fn path(self) -> &'static str {
        match self {
            Kind::Chat => "/v1/chat/completions",
            Kind::Completion => "/v1/completions",
        }
    }
    fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }
}

fn now_s() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn finish_name(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Length => "length",
        FinishReason::Cancelled => "abort",
        _ => "stop",
    }
}

fn usage(f: &FinalEvent) -> Value {
    let (p, c) = (f.input_ids.len(), f.output_ids.len());
    let cached = f.stats.as_ref().map_or(0, |s| s.cached_tokens);
    json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
           "prompt_tokens_details": {"cached_tokens": cached}})
}

/// One request's answer being built: ids, the texts of its tokens, log-probabilities.
struct Answer {
    h: Arc<Http>,
    kind: Kind,
    id: String,
    created: u64,
    shape: Shape,
}

impl Answer {
    fn token_text(&self, id: u32) -> String {
        self.h.svc.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    /// Log-probabilities of `ids` in the endpoint's format (chat: `content` entries; completions:
    /// the legacy parallel lists), `offset` being the text length before them.
    fn logprobs(&self, ids: &[u32], lps: &[TokenLogprobs], offset: &mut usize) -> Value {
        if self.shape.logprobs.is_none() || lps.is_empty() {
            return Value::Null;
        }
        let tokens: Vec<String> = ids.iter().map(|&t| self.token_text(t)).collect();
        match self.kind {
            Kind::Chat => {
                let entry = |tok: &str, lp: f32| json!({"token": tok, "logprob": lp, "bytes": tok.as_bytes()});
                let content: Vec<Value> = tokens
                    .iter()
                    .zip(lps)
                    .map(|(tok, lp)| {
                        let mut e = entry(tok, lp.logprob);
                        let top: Vec<Value> = lp
                            .top_ids
                            .iter()
                            .zip(&lp.top_logprobs)
                            .map(|(&t, &v)| entry(&self.token_text(t), v))
                            .collect();
                        e["top_logprobs"] = Value::Array(top);
                        e
                    })
                    .collect();
                json!({"content": content})
            }
            Kind::Completion => {
                let mut offsets = Vec::new();
                for t in &tokens {
                    offsets.push(*offset);
                    *offset += t.len();
                }
                let top: Vec<Value> = lps
                    .iter()
                    .map(|lp| {
                        let m: serde_json::Map<String, Value> = lp
                            .top_ids
                            .iter()
                            .zip(&lp.top_logprobs)
                            .map(|(&t, &v)| (self.token_text(t), json!(v)))
                            .collect();
                        Value::Object(m)
                    })
                    .collect();
                json!({
                    "tokens": tokens,
                    "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
                    "top_logprobs": top,
                    "text_offset": offsets,
                })
            }
        }
    }

    fn envelope(&self, chunk: bool, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.kind.object(chunk),
            "created": self.created,
            "model": self.h.model,
            "system_fingerprint": Value::Null,
            "choices": choices,
        })
    }

    /// A streamed chunk carrying `text` (and its log-probabilities); `finish` on the last one.
    fn chunk(&self, text: &str, logprobs: Value, finish: Option<&str>, first: bool) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                let mut delta = json!({});
                if first {
                    delta["role"] = json!("assistant");
                }
                if !text.is_empty() || first {
                    delta["content"] = json!(text);
                }
                json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
            Kind::Completion => {
                json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish})
            }
        };
        let mut v = self.envelope(true, json!([choice]));
        if self.shape.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    /// The whole answer (non-streaming).
    fn whole(&self, f: &FinalEvent, logprobs: Value) -> Value {
        let choice = match self.kind {
            Kind::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": f.text},
                "logprobs": logprobs,
                "finish_reason": finish_name(f.finish_reason()),
            }),
            Kind::Completion => json!({
                "index": 0,
                "text": f.text,
                "logprobs": logprobs,
                "finish_reason": finish_name(f.finish_reason()),
            }),
        };
        let mut v = self.envelope(false, json!([choice]));
        v["usage"] = usage(f);
        v
    }
}

/// Queues `g` and answers as `shape` asks.
pub async fn run(
    h: Arc<Http>,
    kind: Kind,
    mut g: GenerateRequest,
    shape: Shape,
) -> Result<Response, ApiError> {
    if shape.max_tokens == Some(0) {
        return Err(ApiError::bad("max_tokens", "max_tokens: must be at least 1"));
    }
    let chat = kind == Kind::Chat;
    let ids = h.svc.input_ids(&g).map_err(|r| {
        let e = crate::Error::from(r);
        h.svc.metrics.rejected(e.reject_reason());
        ApiError::from_error(&e, chat)
    })?;
    // No limit given: whatever the context (and the KV cache) leaves after the prompt, as vLLM does.
    let room = h.svc.context.min(h.svc.kv_capacity).saturating_sub(ids.len()).max(1);
    g.max_new_tokens = shape.max_tokens.unwrap_or(room as u32);
    g.input = Some(generate_request::Input::TokenIds(TokenIds { ids }));
    // The request's span is the root of its trace; the job span goes under it.
    let span =
        tracing::info_span!(parent: None, "http request", method = "POST", path = kind.path());
    let (job_id, trace_id) = span
        .in_scope(|| h.svc.submit(std::slice::from_ref(&g), shape.idempotency_key.as_deref()))
        .map_err(|e| ApiError::from_error(&e, chat))?;
    let rx = h.svc.watch(&job_id, true, &[]).map_err(|e| ApiError::from_error(&e, chat))?;
    let a = Answer {
        id: format!("{}{}", kind.id_prefix(), job_id.trim_start_matches("job-")),
        h,
        kind,
        created: now_s(),
        shape,
    };
    let mut resp =
        if a.shape.stream { stream(a, rx).into_response() } else { whole(a, rx).await? };
    if let Ok(v) = HeaderValue::from_str(&trace_id) {
        resp.headers_mut().insert("x-trace-id", v);
    }
    Ok(resp)
}

type Events = mpsc::Receiver<Result<GenerateEvent, tonic::Status>>;

async fn whole(a: Answer, mut rx: Events) -> Result<Response, ApiError> {
    let (mut ids, mut lps) = (Vec::new(), Vec::new());
    while let Some(ev) = rx.recv().await {
        match ev.map_err(|s| ApiError::failed(s.message()))?.event {
            Some(generate_event::Event::Token(t)) => {
                ids.extend(t.ids);
                lps.extend(t.logprobs);
            }
            Some(generate_event::Event::Done(f)) => {
                if f.finish_reason() == FinishReason::Error {
                    return Err(ApiError::failed(&f.error));
                }
                let logprobs = a.logprobs(&ids, &lps, &mut 0);
                return Ok(axum::Json(a.whole(&f, logprobs)).into_response());
            }
            None => {}
        }
    }
    Err(ApiError::unavailable("the request ended without a result"))
}

fn stream(a: Answer, mut rx: Events) -> impl IntoResponse {
    let (tx, out) = mpsc::channel::<Result<Event, Infallible>>(64);
    tokio::spawn(async move {
        let send = |v: Value| {
            let tx = tx.clone();
            async move { tx.send(Ok(Event::default().data(v.to_string()))).await.is_ok() }
        };
        // The first chunk names the role (chat), as OpenAI's does.
        if a.kind == Kind::Chat && !send(a.chunk("", Value::Null, None, true)).await {
            return;
        }
        let mut offset = 0;
        while let Some(ev) = rx.recv().await {
            let ev = match ev {
                Ok(ev) => ev,
                Err(s) => {
                    let _ = send(ApiError::failed(s.message()).body()).await;
                    break;
                }
            };
            let ok = match ev.event {
                Some(generate_event::Event::Token(t)) => {
                    let lp = a.logprobs(&t.ids, &t.logprobs, &mut offset);
                    // Nothing to say while a stop string or a multi-byte character is pending.
                    if t.text.is_empty() && lp.is_null() {
                        true
                    } else {
                        send(a.chunk(&t.text, lp, None, false)).await
                    }
                }
                Some(generate_event::Event::Done(f)) => {
                    if f.finish_reason() == FinishReason::Error {
                        let _ = send(ApiError::failed(&f.error).body()).await;
                        break;
                    }
                    let mut ok =
                        send(a.chunk("", Value::Null, Some(finish_name(f.finish_reason())), false))
                            .await;
                    if ok && a.shape.include_usage {
                        let mut u = a.envelope(true, json!([]));
                        u["usage"] = usage(&f);
                        ok = send(u).await;
                    }
                    if ok {
                        let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
                    }
                    break;
                }
                None => true,
            };
            if !ok {
                // The client went away: dropping `rx` cancels the job.
                return;
            }
        }
    });
    Sse::new(ReceiverStream::new(out)).keep_alive(KeepAlive::default())
}
