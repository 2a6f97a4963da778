//! The public gRPC API: Generate / SubmitJob / WatchJob / GetJob / CancelJob / ListWorkers / GetPlan.
//! Requests are validated and tokenized here, then queued for the scheduler (bounded: a full queue is
//! RESOURCE_EXHAUSTED).

use crate::jobs::Jobs;
use crate::scheduler::SeqRequest;
use layerstream_model::Tokenizer;
use layerstream_rpc::auth::KeyIndex;
use layerstream_rpc::v1::coordinator_server::Coordinator;
use layerstream_rpc::v1::*;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tracing::{info, info_span, instrument, Instrument};

/// State behind the API.
pub struct CoordinatorService {
    pub(crate) jobs: Jobs,
    pub(crate) queue: mpsc::Sender<SeqRequest>,
    /// Sequences accepted and not yet running (the scheduler decrements it as they start or are
    /// cancelled while waiting).
    pub(crate) waiting: Arc<AtomicUsize>,
    /// Most waiting sequences (`--queue-size`); beyond it requests get RESOURCE_EXHAUSTED.
    pub(crate) queue_size: usize,
    pub(crate) tokenizer: Arc<Tokenizer>,
    pub(crate) vocab: usize,
    pub(crate) context: usize,
    pub(crate) kv_capacity: usize,
    /// The plan in force (the scheduler replaces it when it plans around a worker that is gone).
    pub(crate) plan: Arc<std::sync::RwLock<Plan>>,
    pub(crate) workers: Vec<crate::pipeline::RegisteredWorker>,
    pub(crate) next_seq: AtomicU64,
    /// Shared with the scheduler and served at the HTTP port's `/metrics`.
    pub(crate) metrics: Arc<crate::metrics::Metrics>,
    /// `--journal`: every accepted job, resumed after a restart.
    pub(crate) journal: Option<Arc<crate::journal::Journal>>,
    /// Held while a job with an idempotency key is looked up and admitted, so two calls with one
    /// key never make two jobs.
    pub(crate) keyed: std::sync::Mutex<()>,
    /// The model's end-of-sequence ids.
    pub(crate) eos: Vec<u32>,
    /// The grammar compiler over this tokenizer, built by the first constrained request.
    pub(crate) grammars:
        std::sync::OnceLock<Result<Arc<layerstream_serving::grammar::Grammars>, String>>,
    /// The threads output formats compile on, and their cache.
    pub(crate) formats: crate::formats::FormatPool,
    /// `--prefix-cache-scope`: whether API keys separate prefix caches.
    pub(crate) cache_scope: crate::flags::CacheScope,
}

/// The span of a job-creating call: the root of the request's trace, or a child of the trace
/// context the client sent (W3C traceparent), never of whatever context the thread last held.
fn rpc_span(name: &'static str, meta: &tonic::metadata::MetadataMap) -> tracing::Span {
    let span = info_span!(parent: None, "rpc", otel.name = name);
    layerstream_telemetry::adopt_parent(&span, meta);
    span
}

/// The `idempotency-key` metadata of a job-creating call: sent again with the same key, the call
/// gets the job it made the first time (also after a coordinator restart, with `--journal`).
fn idempotency_key(meta: &tonic::metadata::MetadataMap) -> Option<String> {
    let v = meta.get("idempotency-key")?.to_str().ok()?.trim();
    (!v.is_empty()).then(|| v.to_owned())
}

type EventStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

impl CoordinatorService {
    /// Asks every worker for its Info now: the public view of each (healthy: it answers and holds
    /// the assignment the plan gave it — a restarted worker does not until it is assigned again)
    /// with its answer. Scrapes of `/metrics` record what they see.
    pub(crate) async fn probe_workers(&self) -> Vec<(WorkerInfo, Option<InfoResponse>)> {
        let plan = self.plan.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let mut out = Vec::new();
        for reg in &self.workers {
            let addr = &reg.spec.address;
            let a = plan.assignments.iter().find(|a| &a.worker == addr);
            let info = crate::pipeline::probe(&reg.conn).await.ok();
            let healthy =
                info.as_ref().zip(a).is_some_and(|(i, a)| i.assignment_id == a.assignment_id);
            self.metrics.worker_info(addr, info.as_ref(), healthy);
            let w = WorkerInfo {
                address: addr.clone(),
                device: reg.device.clone(),
                memory_budget: reg.spec.budget,
                healthy,
                device_bytes_used: info.as_ref().map_or(0, |i| i.device_bytes_used),
            };
            out.push((w, info));
        }
        out
    }

    /// Streams a job's events in order until it finishes, leaving out the first `seen[i]` tokens
    /// of request `i` (a client that reconnects continues after what it saw: a job resumed after a
    /// restart continues from its journaled tokens and shows their events again as they were, so
    /// what a client saw is always a prefix of what comes); `cancel_on_drop` cancels the job if
    /// the client goes away first. A request that ends in error is followed by an ABORTED status.
    pub(crate) fn watch(
        &self,
        job_id: &str,
        cancel_on_drop: bool,
        seen: &[u32],
    ) -> crate::Result<mpsc::Receiver<Result<GenerateEvent, Status>>> {
        let mut live = self
            .jobs
            .with(job_id, |j| j.live.subscribe())
            .ok_or_else(|| crate::Error::NoJob(job_id.to_owned()))?;
        let (tx, rx) = mpsc::channel(256);
        let jobs = self.jobs.clone();
        let id = job_id.to_owned();
        let mut skip = crate::seen::Seen::new(seen, self.tokenizer.clone());
        tokio::spawn(async move {
            let mut seen = 0usize;
            loop {
                let (new, finished) = jobs
                    .with(&id, |j| {
                        (j.history.get(seen..).map_or_else(Vec::new, <[_]>::to_vec), j.finished())
                    })
                    .unwrap_or_default();
                for ev in new {
                    seen += 1;
                    let Some(ev) = skip.pass(ev) else { continue };
                    let err = match &ev.event {
                        Some(generate_event::Event::Done(d))
                            if d.finish_reason() == FinishReason::Error =>
                        {
                            Some(d.error.clone())
                        }
                        _ => None,
                    };
                    if tx.send(Ok(ev)).await.is_err() {
                        if cancel_on_drop {
                            jobs.cancel(&id);
                        }
                        return;
                    }
                    if let Some(e) = err {
                        let _ = tx.send(Err(crate::Error::Aborted(e).into())).await;
                    }
                }
                if finished {
                    return;
                }
                tokio::select! {
                    r = live.changed() => if r.is_err() { return },
                    _ = tx.closed() => {
                        if cancel_on_drop {
                            jobs.cancel(&id);
                        }
                        return;
                    }
                }
            }
        });
        Ok(rx)
    }
}

#[tonic::async_trait]
impl Coordinator for CoordinatorService {
    type GenerateStream = EventStream<GenerateEvent>;
    type WatchJobStream = EventStream<JobEvent>;

    async fn generate(
        &self,
        r: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let span = rpc_span("generate", r.metadata());
        let key = idempotency_key(r.metadata());
        let tenant = r.extensions().get::<KeyIndex>().map(|k| k.0);
        // One request per call: its errors name fields of that request, not of a job.
        let (job_id, trace_id) = self
            .submit(std::slice::from_ref(r.get_ref()), key.as_deref(), tenant)
            .instrument(span)
            .await
            .map_err(crate::Error::single)?;
        let rx = self.watch(&job_id, true, &[])?;
        let mut resp = Response::new(Box::pin(ReceiverStream::new(rx)) as Self::GenerateStream);
        for (name, value) in [("x-trace-id", &trace_id), ("x-job-id", &job_id)] {
            if let Ok(v) = value.parse() {
                resp.metadata_mut().insert(name, v);
            }
        }
        Ok(resp)
    }

    async fn submit_job(
        &self,
        r: Request<SubmitJobRequest>,
    ) -> Result<Response<SubmitJobResponse>, Status> {
        let span = rpc_span("submit_job", r.metadata());
        let key = idempotency_key(r.metadata());
        let tenant = r.extensions().get::<KeyIndex>().map(|k| k.0);
        let (job_id, trace_id) =
            self.submit(&r.get_ref().requests, key.as_deref(), tenant).instrument(span).await?;
        Ok(Response::new(SubmitJobResponse { job_id, trace_id }))
    }

    #[instrument(skip(self, r))]
    async fn watch_job(
        &self,
        r: Request<JobRef>,
    ) -> Result<Response<Self::WatchJobStream>, Status> {
        let JobRef { job_id: id, seen } = r.into_inner();
        let mut rx = self.watch(&id, false, &seen)?;
        let (tx, out) = mpsc::channel(256);
        tokio::spawn(async move {
            while let Some(ev) = rx.recv().await {
                let item = ev.map(|e| JobEvent { job_id: id.clone(), event: Some(e) });
                if tx.send(item).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(out))))
    }

    async fn get_job(&self, r: Request<JobRef>) -> Result<Response<Job>, Status> {
        let id = r.into_inner().job_id;
        self.jobs
            .with(&id, |j| j.view(&id))
            .map(Response::new)
            .ok_or_else(|| crate::Error::NoJob(id).into())
    }

    async fn cancel_job(&self, r: Request<JobRef>) -> Result<Response<Job>, Status> {
        let id = r.into_inner().job_id;
        info!(job_id = %id, "cancel requested");
        self.jobs.cancel(&id).map(Response::new).ok_or_else(|| crate::Error::NoJob(id).into())
    }

    async fn list_workers(
        &self,
        _r: Request<ListWorkersRequest>,
    ) -> Result<Response<ListWorkersResponse>, Status> {
        let workers = self.probe_workers().await.into_iter().map(|(w, _)| w).collect();
        Ok(Response::new(ListWorkersResponse { workers }))
    }

    async fn get_plan(&self, _r: Request<GetPlanRequest>) -> Result<Response<Plan>, Status> {
        Ok(Response::new(
            self.plan.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone(),
        ))
    }
}

#[cfg(test)]
mod tests {
    /// Job ids carry 128 random bits: not sequential, not guessable from one another.
    #[test]
    fn job_ids_are_random_128_bit() {
        let (a, b) = (crate::admit::random_job_id(), crate::admit::random_job_id());
        assert_ne!(a, b);
        let hex = a.strip_prefix("job-").unwrap();
        assert_eq!(hex.len(), 32);
        assert!(hex.chars().all(|c| c.is_ascii_hexdigit()));
    }
}
