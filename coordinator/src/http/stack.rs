//! The stack's state over HTTP: `/health` (200 when every worker holds its assignment, else 503),
//! Prometheus `/metrics`, the live page's feed `/api/stack` (plan, workers, queue, the last steps'
//! per-layer transfer and compute), and the page itself at `/` (one HTML file compiled in).

use super::Http;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use serde_json::json;
use std::sync::Arc;

/// The page: chat and live view, no build step.
const PAGE: &str = include_str!("page.html");

pub async fn page() -> Html<&'static str> {
    Html(PAGE)
}

pub async fn health(State(h): State<Arc<Http>>) -> Response {
    let workers = h.svc.probe_workers().await;
    let down: Vec<&str> =
        workers.iter().filter(|(w, _)| !w.healthy).map(|(w, _)| w.address.as_str()).collect();
    let journal = h.svc.journal.as_ref().and_then(|j| j.failing());
    if down.is_empty() && !workers.is_empty() {
        // Serving, but jobs are not durable while the journal cannot be written.
        let body = match journal {
            Some(e) => json!({"status": "degraded", "workers": workers.len(), "journal": e}),
            None => json!({"status": "ok", "workers": workers.len()}),
        };
        axum::Json(body).into_response()
    } else {
        let body = json!({"status": "unavailable", "workers_down": down});
        (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response()
    }
}

pub async fn metrics(State(h): State<Arc<Http>>, headers: axum::http::HeaderMap) -> Response {
    // Liveness, device memory and the loaders' counters are read now, from every worker's Info.
    h.svc.probe_workers().await;
    let text = h.svc.metrics.encode();
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    if super::exposition::wants_openmetrics(accept) {
        ([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], text).into_response()
    } else {
        ([(header::CONTENT_TYPE, super::exposition::CLASSIC)], super::exposition::classic(&text))
            .into_response()
    }
}

pub async fn stack(State(h): State<Arc<Http>>) -> Response {
    let workers = h.svc.probe_workers().await;
    let plan = h.svc.plan.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
    let assignments: Vec<_> = plan
        .assignments
        .iter()
        .map(|a| {
            let (w, info) = workers
                .iter()
                .find(|(w, _)| w.address == a.worker)
                .map(|(w, i)| (Some(w), i.as_ref()))
                .unwrap_or((None, None));
            json!({
                "worker": a.worker,
                "device": w.map(|w| w.device.clone()),
                "healthy": w.is_some_and(|w| w.healthy),
                "layers": [a.layer_start, a.layer_end],
                "resident": a.resident,
                "group_size": a.group_size,
                "buffers": a.streaming_buffers,
                "embed": a.embed,
                "head": a.head,
                "bytes": a.bytes_needed,
                "budget": w.map(|w| w.memory_budget),
                "sequences": info.map(|i| i.sequences),
                "loader": info.and_then(|i| i.loader.as_ref()).map(tiers),
            })
        })
        .collect();
    let m = &h.svc.metrics;
    let (drafted, accepted, generated, steps) = m.spec_totals();
    axum::Json(json!({
        "spec": {"drafted": drafted, "accepted": accepted, "generated": generated, "steps": steps},
        "model": h.model,
        "num_layers": plan.num_layers,
        "micro_batches": plan.micro_batches,
        "micro_batches_reason": plan.micro_batches_reason,
        "plan": assignments,
        "queue": {"waiting": m.waiting.get(), "running": m.running.get()},
        "steps": m.recent(),
        "memory": memory(&h.svc),
    }))
    .into_response()
}

/// The loader's tiers as the page shows them: acquires served from a slot (the RAM tier) and read
/// from disk, the hit rate, and the disk's bytes, seconds and GB/s since start (per read, and with
/// the reads overlapped: over the wall time a read was in flight).
fn tiers(l: &layerstream_rpc::v1::LoaderStats) -> serde_json::Value {
    let acquires = l.hits + l.misses;
    json!({
        "hits": l.hits,
        "misses": l.misses,
        "hit_rate": (acquires > 0).then(|| l.hits as f64 / acquires as f64),
        "disk_bytes": l.disk_bytes,
        "disk_seconds": l.disk_seconds,
        "disk_gbps": (l.disk_seconds > 0.0).then(|| l.disk_bytes as f64 / l.disk_seconds / 1e9),
        "disk_busy_seconds": l.disk_busy_seconds,
        "disk_gbps_overlapped": (l.disk_busy_seconds > 0.0)
            .then(|| l.disk_bytes as f64 / l.disk_busy_seconds / 1e9),
    })
}

/// The memory ledger of the coordinator's host now (what the stack may use, and why), with the KV
/// capacity planned from it.
fn memory(svc: &crate::service::CoordinatorService) -> serde_json::Value {
    let l = layerstream_model::mem::Ledger::read();
    json!({
        "mem_available": l.mem_available,
        "cgroup_limit": l.cgroup.map(|c| c.limit),
        "cgroup_usage": l.cgroup.map(|c| c.usage),
        "shm_free": l.shm_free,
        "usable": l.usable(),
        "kv_capacity": svc.kv_capacity,
        "summary": l.describe(),
    })
}
