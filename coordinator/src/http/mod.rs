//! The HTTP side of the coordinator (`--http-listen`, default 127.0.0.1:8000): the OpenAI API
//! (`/v1/chat/completions`, `/v1/completions`, `/v1/models`), `/health`, Prometheus `/metrics`, the
//! live page at `/` and its JSON feed `/api/stack`. Every request goes through the gRPC service's
//! own `submit`/`watch`: one queue, one scheduler, one batch.

pub mod bodies;
pub mod completions;
pub mod error;
pub mod exposition;
pub mod guided;
pub mod openai;
pub mod params;
pub mod stack;
pub mod tools;

use crate::service::CoordinatorService;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use completions::Kind;
use error::ApiError;
use layerstream_rpc::auth::RequireBearer;
use serde::de::DeserializeOwned;
use std::sync::Arc;

/// What the handlers share.
pub struct Http {
    pub(crate) svc: Arc<CoordinatorService>,
    /// The id `/v1/models` lists and requests must name (`--served-model-name`, default the store's).
    pub(crate) model: String,
    pub(crate) api_key: RequireBearer,
    /// Origins allowed to call from a browser (`*`: any); empty: no CORS headers.
    pub(crate) cors: Vec<String>,
}

/// The router.
pub fn router(h: Arc<Http>) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(complete))
        .route("/v1/models", get(models))
        .route("/api/stack", get(stack::stack))
        .route_layer(middleware::from_fn_with_state(h.clone(), auth));
    Router::new()
        .merge(api)
        .route("/health", get(stack::health))
        .route("/metrics", get(stack::metrics))
        .route("/", get(stack::page))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(h.clone(), cors))
        .layer(middleware::from_fn_with_state(h.clone(), count))
        .with_state(h)
}

/// Serves `router` on `listener` until `shutdown` resolves, through `gate` (a cap on open
/// connections; one past it is closed as it is accepted). A connection that does not send a whole
/// request header within `idle` — a fresh one, or a kept-alive one between requests — is closed.
/// On shutdown, requests in flight finish; idle connections close.
pub async fn serve(
    listener: tokio::net::TcpListener,
    h: Arc<Http>,
    gate: layerstream_rpc::limits::Gate,
    idle: std::time::Duration,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use hyper_util::server::conn::auto::Builder;
    let app = router(h);
    let mut builder = Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(idle).keep_alive(true);
    builder.http2().timer(TokioTimer::new()).keep_alive_interval(idle);
    let builder = Arc::new(builder);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (tcp, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                // Out of file descriptors and the like: wait a little rather than spin.
                Err(e) => {
                    tracing::warn!(error = %e, "accepting an HTTP connection");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Token chunks are small writes: without TCP_NODELAY, Nagle's algorithm holds each one
        // back until the client's delayed ACK (tens of milliseconds per token).
        let _ = tcp.set_nodelay(true);
        let peer = tcp.peer_addr().ok().map(|a| a.ip());
        let Some(io) = gate.admit(tcp, peer) else { continue };
        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), svc).into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "HTTP connection ended");
            }
        });
    }
    graceful.shutdown().await;
    Ok(())
}

async fn not_found() -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: "no such endpoint".into(),
        kind: "invalid_request_error",
        param: None,
        code: None,
    }
}

/// `Authorization: Bearer <--api-key>` on the API routes (health, metrics and the page stay open, as
/// in vLLM; the page sends the key the user types).
async fn auth(State(h): State<Arc<Http>>, req: Request, next: Next) -> Response {
    let header = req.headers().get(header::AUTHORIZATION).map(HeaderValue::as_bytes);
    if req.method() != Method::OPTIONS && !h.api_key.accepts(header) {
        return ApiError::unauthorized().into_response();
    }
    next.run(req).await
}

/// CORS for the configured origins, preflights included.
async fn cors(State(h): State<Arc<Http>>, req: Request, next: Next) -> Response {
    let origin = req.headers().get(header::ORIGIN).cloned();
    let allowed = origin
        .as_ref()
        .filter(|o| h.cors.iter().any(|c| c == "*" || o.to_str().is_ok_and(|o| o == c)));
    let Some(origin) = allowed.cloned() else { return next.run(req).await };
    let preflight = req.method() == Method::OPTIONS;
    let mut resp =
        if preflight { StatusCode::NO_CONTENT.into_response() } else { next.run(req).await };
    let hd = resp.headers_mut();
    let any = h.cors.iter().any(|c| c == "*");
    hd.insert(
        header::ACCESS_CONTROL_ALLOW_ORIGIN,
        if any { HeaderValue::from_static("*") } else { origin },
    );
    hd.insert(header::VARY, HeaderValue::from_static("Origin"));
    if preflight {
        hd.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        hd.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("authorization, content-type"),
        );
        hd.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
    }
    hd.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static("x-trace-id, x-layerstream-ignored"),
    );
    resp
}

/// Counts responses by route and status.
async fn count(State(h): State<Arc<Http>>, req: Request, next: Next) -> Response {
    let path = match req.uri().path() {
        p @ ("/v1/chat/completions"
        | "/v1/completions"
        | "/v1/models"
        | "/health"
        | "/metrics"
        | "/"
        | "/api/stack") => p.to_owned(),
        _ => "other".to_owned(),
    };
    let resp = next.run(req).await;
    h.svc.metrics.http_response(&path, resp.status().as_u16());
    resp
}

/// Parses a JSON body of an endpoint whose own fields are `own`, answering OpenAI's 400 when it is
/// not one or asks for what is not implemented (`params`); the parameters ignored.
fn parse<T: DeserializeOwned>(
    headers: &HeaderMap,
    body: &Bytes,
    own: &[&str],
) -> Result<(T, Vec<String>), ApiError> {
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_none_or(|v| v.starts_with("application/json"));
    if !json {
        return Err(ApiError::bad(
            "body",
            "the body must be JSON (Content-Type: application/json)",
        ));
    }
    let bad = |e: serde_json::Error| ApiError::bad("body", format!("invalid request body: {e}"));
    let v: serde_json::Value = serde_json::from_slice(body).map_err(bad)?;
    let ignored = match v.as_object() {
        Some(o) => params::check(o, own)?,
        None => return Err(ApiError::bad("body", "invalid request body: not a JSON object")),
    };
    Ok((serde_json::from_value(v).map_err(bad)?, ignored))
}

impl Http {
    fn check_model(&self, asked: Option<&str>) -> Result<(), ApiError> {
        match asked {
            Some(m) if m != self.model => Err(ApiError::unknown_model(m, &self.model)),
            _ => Ok(()),
        }
    }
}

async fn chat(
    State(h): State<Arc<Http>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let (r, ignored): (openai::ChatRequest, _) = parse(&headers, &body, params::CHAT)?;
    h.check_model(r.common.model.as_deref())?;
    let (g, shape) = r.to_generate()?;
    answer(h, Kind::Chat, vec![g], shape, &headers, ignored).await
}

async fn complete(
    State(h): State<Arc<Http>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let (r, ignored): (openai::CompletionRequest, _) = parse(&headers, &body, params::COMPLETION)?;
    h.check_model(r.common.model.as_deref())?;
    let (prompts, shape) = r.to_generate()?;
    answer(h, Kind::Completion, prompts, shape, &headers, ignored).await
}

/// Runs a translated request with what its headers add, naming the parameters it ignored.
async fn answer(
    h: Arc<Http>,
    kind: Kind,
    prompts: Vec<layerstream_rpc::v1::GenerateRequest>,
    mut shape: openai::Shape,
    headers: &HeaderMap,
    ignored: Vec<String>,
) -> Result<Response, ApiError> {
    shape.idempotency_key = idempotency_key(headers);
    shape.key = h.api_key.key_of(headers.get(header::AUTHORIZATION).map(HeaderValue::as_bytes));
    shape.resume = last_event_id(headers);
    let mut resp = completions::run(h, kind, prompts, shape).await?;
    if !ignored.is_empty() {
        let list = ignored.join(", ");
        tracing::warn!(parameters = %list, "request parameters ignored (not implemented)");
        if let Ok(v) = HeaderValue::from_str(&list) {
            resp.headers_mut().insert("x-layerstream-ignored", v);
        }
    }
    Ok(resp)
}

/// The `Idempotency-Key` header (as Stripe and OpenAI's clients send it), when it is text.
/// A reconnecting SSE client's `Last-Event-ID`: the per-choice token counts of the last chunk it
/// got (`12.9`), as the stream's `id:` lines give them; anything else is no resume.
fn last_event_id(headers: &HeaderMap) -> Vec<u32> {
    let Some(v) = headers.get("last-event-id").and_then(|v| v.to_str().ok()) else {
        return Vec::new();
    };
    v.trim().split('.').map(str::parse).collect::<Result<Vec<u32>, _>>().unwrap_or_default()
}

fn idempotency_key(headers: &HeaderMap) -> Option<String> {
    let v = headers.get("idempotency-key")?.to_str().ok()?.trim();
    (!v.is_empty()).then(|| v.to_owned())
}

async fn models(State(h): State<Arc<Http>>) -> Response {
    let card = bodies::ModelCard {
        id: &h.model,
        object: "model",
        created: 0,
        owned_by: "layerstream",
        max_model_len: h.svc.context,
    };
    axum::Json(bodies::ModelList { object: "list", data: vec![card] }).into_response()
}
