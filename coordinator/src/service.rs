//! The public gRPC API: Generate / SubmitJob / WatchJob / GetJob / CancelJob / ListWorkers / GetPlan.
//! Requests are validated and tokenized here, then queued for the scheduler (bounded: a full queue is
//! RESOURCE_EXHAUSTED).

use crate::jobs::{JobRecord, Jobs};
use crate::scheduler::SeqRequest;
use layerstream_model::{
    check_chat, check_request, tokenizer::RenderBudget, Field, GenerateParams, Message,
    RequestError, SamplingParams, Tokenizer,
};
use layerstream_rpc::v1::coordinator_server::Coordinator;
use layerstream_rpc::v1::*;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tracing::{info, info_span, instrument};

/// A job id no other client can guess (128 random bits from the kernel), so nobody watches or
/// cancels a job they were not given.
pub fn random_job_id() -> String {
    format!("job-{}", layerstream_rpc::auth::random_hex())
}

/// Bytes of prompt text allowed per token of context before tokenizing: a BPE token rarely spans more
/// than a few dozen bytes, so anything longer cannot fit.
pub const PROMPT_BYTES_PER_TOKEN: usize = 64;

/// The most prompt bytes a request may carry for a model with `context` positions.
pub fn prompt_byte_limit(context: usize) -> usize {
    context.saturating_mul(PROMPT_BYTES_PER_TOKEN)
}

/// Default `max_new_tokens` when a request leaves it 0.
pub const DEFAULT_MAX_NEW_TOKENS: usize = 128;

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
}

/// The span of a job-creating call: the root of the request's trace, or a child of the trace
/// context the client sent (W3C traceparent), never of whatever context the thread last held.
fn rpc_span(name: &'static str, meta: &tonic::metadata::MetadataMap) -> tracing::Span {
    let span = info_span!(parent: None, "rpc", otel.name = name);
    layerstream_telemetry::adopt_parent(&span, meta);
    span
}

type EventStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

impl CoordinatorService {
    /// The request's prompt as token ids (chat rendered through the template), bounded first.
    pub(crate) fn input_ids(&self, r: &GenerateRequest) -> Result<Vec<u32>, RequestError> {
        // Bounded before tokenizing: a multi-megabyte prompt cannot fit the context anyway, and
        // tokenizing it would cost seconds of CPU and hundreds of MB.
        let bytes = match &r.input {
            Some(generate_request::Input::Prompt(p)) => p.len(),
            Some(generate_request::Input::Chat(c)) => {
                c.messages.iter().map(|m| m.content.len() + m.role.len()).sum()
            }
            _ => 0,
        };
        let most = prompt_byte_limit(self.context);
        if bytes > most {
            return Err(RequestError::new(Field::Prompt, format!(
                "{bytes} bytes exceed the {most}-byte bound ({PROMPT_BYTES_PER_TOKEN} bytes a token of the model's {}-token context)",
                self.context
            )));
        }
        let bad =
            |field| move |e: layerstream_model::Error| RequestError::new(field, e.to_string());
        match &r.input {
            Some(generate_request::Input::Prompt(p)) => {
                self.tokenizer.encode(p).map_err(bad(Field::Prompt))
            }
            Some(generate_request::Input::TokenIds(t)) => Ok(t.ids.clone()),
            Some(generate_request::Input::Chat(c)) => {
                check_chat(c.messages.iter().map(|m| m.role.as_str()))?;
                let msgs: Vec<Message> = c
                    .messages
                    .iter()
                    .map(|m| Message { role: m.role.clone(), content: m.content.clone() })
                    .collect();
                // The rendering is bounded like the prompt: a template cannot amplify a request.
                let budget = RenderBudget::bytes(most);
                let text = self
                    .tokenizer
                    .apply_chat_template_within(&msgs, budget)
                    .map_err(bad(Field::Chat))?;
                self.tokenizer.encode_chat(&text).map_err(bad(Field::Chat))
            }
            None => {
                Err(RequestError::new(Field::Input, "none given: set prompt, chat or token_ids"))
            }
        }
    }

    fn params(r: &GenerateRequest) -> GenerateParams {
        let s = r.sampling.unwrap_or_default();
        GenerateParams {
            max_new_tokens: if r.max_new_tokens == 0 {
                DEFAULT_MAX_NEW_TOKENS
            } else {
                r.max_new_tokens as usize
            },
            stop: r.stop.clone(),
            ignore_eos: r.ignore_eos,
            sampling: SamplingParams::from_wire(&s),
        }
    }

    /// Validates, registers and queues a job; returns (job id, trace id). A refusal is counted in the
    /// metrics by its code.
    pub(crate) fn submit(&self, requests: &[GenerateRequest]) -> crate::Result<(String, String)> {
        self.submit_checked(requests).inspect_err(|e| self.metrics.rejected(e.reject_reason()))
    }

    /// One request checked against the model: its token ids and parameters.
    fn prepare(&self, r: &GenerateRequest) -> Result<(Vec<u32>, GenerateParams), RequestError> {
        let ids = self.input_ids(r)?;
        let p = Self::params(r);
        check_request(&ids, &p, self.vocab, self.context)?;
        if ids.len() + p.max_new_tokens > self.kv_capacity {
            return Err(RequestError::new(
                Field::MaxNewTokens,
                format!(
                    "{} prompt + {} new tokens exceed the KV capacity of {} positions",
                    ids.len(),
                    p.max_new_tokens,
                    self.kv_capacity
                ),
            ));
        }
        Ok((ids, p))
    }

    fn submit_checked(&self, requests: &[GenerateRequest]) -> crate::Result<(String, String)> {
        if requests.is_empty() {
            return Err(RequestError::new(Field::Requests, "a job needs at least one").into());
        }
        let mut prepared = Vec::with_capacity(requests.len());
        for (i, r) in requests.iter().enumerate() {
            prepared.push(self.prepare(r).map_err(|e| e.in_request(i))?);
        }
        let n = prepared.len();
        let before = self.waiting.fetch_add(n, Ordering::SeqCst);
        if before + n > self.queue_size {
            self.waiting.fetch_sub(n, Ordering::SeqCst);
            return Err(crate::Error::Busy(format!(
                "the queue holds {before} waiting sequences and takes at most {} (--queue-size); retry later",
                self.queue_size
            )));
        }
        let job_id = random_job_id();
        // Under the API call's span (gRPC handler or HTTP request): one request, one trace.
        let span = info_span!(parent: tracing::Span::current(), "job", job_id = %job_id, requests = requests.len() as i64);
        let trace_id = layerstream_telemetry::trace_id(&span);
        let cancels: Vec<Arc<AtomicBool>> =
            prepared.iter().map(|_| Arc::new(AtomicBool::new(false))).collect();
        let (live, _) = watch::channel(0usize);
        self.jobs.insert(
            job_id.clone(),
            JobRecord {
                trace_id: trace_id.clone(),
                requests: prepared.len(),
                history: Vec::new(),
                cancel: cancels.clone(),
                live,
                cancelled: false,
                finished_at: None,
            },
        );
        for (i, ((ids, p), cancel)) in prepared.into_iter().zip(cancels).enumerate() {
            let (tx, mut rx) = mpsc::channel(256);
            let seq = SeqRequest {
                seq_id: self.next_seq.fetch_add(1, Ordering::Relaxed),
                index: i as u32,
                input_ids: ids,
                params: p,
                events: tx,
                span: span.clone(),
                trace_id: trace_id.clone(),
                cancel,
                queued: std::time::Instant::now(),
            };
            if self.queue.try_send(seq).is_err() {
                // The ones already sent are cancelled and leave the count in the scheduler.
                self.waiting.fetch_sub(n - i, Ordering::SeqCst);
                self.jobs.cancel(&job_id);
                return Err(crate::Error::Busy("the job queue is full; retry later".into()));
            }
            let jobs = self.jobs.clone();
            let id = job_id.clone();
            tokio::spawn(async move {
                while let Some(ev) = rx.recv().await {
                    jobs.record(&id, ev);
                }
            });
        }
        info!(%job_id, %trace_id, "job queued");
        Ok((job_id, trace_id))
    }

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

    /// Streams a job's events in order until it finishes; `cancel_on_drop` cancels the job if the
    /// client goes away first. A request that ends in error is followed by an ABORTED status.
    pub(crate) fn watch(
        &self,
        job_id: &str,
        cancel_on_drop: bool,
    ) -> crate::Result<mpsc::Receiver<Result<GenerateEvent, Status>>> {
        let mut live = self
            .jobs
            .with(job_id, |j| j.live.subscribe())
            .ok_or_else(|| crate::Error::NoJob(job_id.to_owned()))?;
        let (tx, rx) = mpsc::channel(256);
        let jobs = self.jobs.clone();
        let id = job_id.to_owned();
        tokio::spawn(async move {
            let mut seen = 0usize;
            loop {
                let (new, finished) = jobs
                    .with(&id, |j| (j.history[seen..].to_vec(), j.finished()))
                    .unwrap_or_default();
                for ev in new {
                    seen += 1;
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
        // One request per call: its errors name fields of that request, not of a job.
        let (job_id, trace_id) = span
            .in_scope(|| self.submit(std::slice::from_ref(r.get_ref())))
            .map_err(crate::Error::single)?;
        let rx = self.watch(&job_id, true)?;
        let mut resp = Response::new(Box::pin(ReceiverStream::new(rx)) as Self::GenerateStream);
        if let Ok(v) = trace_id.parse() {
            resp.metadata_mut().insert("x-trace-id", v);
        }
        Ok(resp)
    }

    async fn submit_job(
        &self,
        r: Request<SubmitJobRequest>,
    ) -> Result<Response<SubmitJobResponse>, Status> {
        let span = rpc_span("submit_job", r.metadata());
        let (job_id, trace_id) = span.in_scope(|| self.submit(&r.get_ref().requests))?;
        Ok(Response::new(SubmitJobResponse { job_id, trace_id }))
    }

    #[instrument(skip(self, r))]
    async fn watch_job(
        &self,
        r: Request<JobRef>,
    ) -> Result<Response<Self::WatchJobStream>, Status> {
        let id = r.into_inner().job_id;
        let mut rx = self.watch(&id, false)?;
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
        let (a, b) = (super::random_job_id(), super::random_job_id());
        assert_ne!(a, b);
        let hex = a.strip_prefix("job-").unwrap();
        assert_eq!(hex.len(), 32);
        assert!(hex.chars().all(|c| c.is_ascii_hexdigit()));
    }
}
