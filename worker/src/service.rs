//! The worker's gRPC service: Info, Assign (budget-checked), Step (a batch through the stage),
//! Release (free sequences), Swap (KV blocks to and from the host tier).

use crate::device::{AnyStage, Device};
use crate::stage::StepSeq;
use crate::stream::LoaderLink;
use crate::Error;
use layerstream_model::Store;
use layerstream_rpc::v1::worker_server::Worker;
use layerstream_rpc::v1::*;
use layerstream_serving::plan::AssignmentExt;
use layerstream_telemetry::adopt_parent;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;
use tonic::{Request, Response, Status};
use tracing::{info, info_span, Instrument};

/// Shared state of a worker process.
pub struct WorkerState {
    pub(crate) id: String,
    pub(crate) device: String,
    /// The opened device (the CPU, or a GPU with its context and kernels).
    pub(crate) backend: Device,
    /// The decoder layers' activations (`ComputeFlags::precision`), for every stage it loads.
    pub(crate) precision: layerstream_kernels::Precision,
    /// Bytes assignments may use (for a GPU: already capped by free device memory).
    pub(crate) budget: u64,
    /// Most tokens one step may carry (None: no limit).
    pub(crate) max_step_tokens: Option<usize>,
    /// Free device memory when the worker started (GPU workers), to report what it has taken since.
    pub(crate) free_at_start: Option<u64>,
    pub(crate) store: Store,
    pub(crate) loader_socket: PathBuf,
    /// The internal token sent to the loader.
    pub(crate) loader_bearer: layerstream_rpc::auth::Bearer,
    /// gRPC health, reported NOT_SERVING when the worker can no longer be trusted (a step panicked,
    /// the device failed) so an orchestrator restarts it.
    pub(crate) health: layerstream_rpc::transport::Health,
    /// Locked only on blocking threads: a runtime thread waiting on it could starve the gRPC
    /// connections a step's copy thread needs.
    pub(crate) stage: Arc<Mutex<Option<AnyStage>>>,
    /// Live sequences, updated after every step and release (read by Info without the lock).
    pub(crate) live: Arc<AtomicU32>,
    /// `assignment_id` of the loaded stage (empty: none), read by Info without the stage lock.
    pub(crate) assignment_id: Arc<Mutex<String>>,
    /// `--concurrent-threads`' pool (when it differs from the main one): steps of a plan with
    /// micro-batches in flight run on it.
    pub(crate) concurrent: Option<layerstream_kernels::cpu::threads::ComputePool>,
    /// Hidden states for the next worker on this host, in shared memory.
    pub(crate) handoff: crate::handoff::Handoff,
    /// `handoff::host_id()`, reported by Info.
    pub(crate) host_id: String,
}

/// The loader daemon's counters, as it describes itself (None when it does not answer within a
/// second: Info must stay quick for the coordinator's health checks).
async fn loader_stats(s: &WorkerState) -> Option<LoaderStats> {
    let ask = async {
        let ch = layerstream_rpc::transport::connect_uds(&s.loader_socket).await.ok()?;
        let mut c =
            layerstream_rpc::v1::loader_client::LoaderClient::new(s.loader_bearer.clone().wrap(ch));
        let d = c.describe(DescribeRequest {}).await.ok()?.into_inner();
        // A slot's pool name names the daemon.
        let namespace =
            d.slots.first().and_then(|n| layerstream_shm::slot_pool(n)).map(str::to_owned);
        Some(LoaderStats {
            namespace: namespace.unwrap_or(d.store),
            hits: d.hits,
            misses: d.misses,
            pinned: d.pinned,
            disk_bytes: d.disk_bytes,
            disk_seconds: d.disk_seconds,
            disk_busy_seconds: d.disk_busy_seconds,
        })
    };
    tokio::time::timeout(std::time::Duration::from_secs(1), ask).await.ok().flatten()
}

/// Records which assignment the stage holds ("" = none).
fn set_assignment(id: &Mutex<String>, to: &str) {
    let mut g = id.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    to.clone_into(&mut g);
}

impl WorkerState {
    /// Device memory taken since start (0 on the CPU, or if the driver cannot be asked).
    pub fn device_bytes_used(&self) -> u64 {
        match (&self.backend, self.free_at_start) {
            (Device::Cuda(b), Some(start)) => {
                b.mem_info().map_or(0, |(free, _)| start.saturating_sub(free as u64))
            }
            _ => 0,
        }
    }

    /// The stage, locked (see `lock_stage`); a stage a panic interrupted is dropped and forgotten.
    fn stage(&self) -> MutexGuard<'_, Option<AnyStage>> {
        lock_stage(&self.stage, || self.forget_stage())
    }

    /// Drops the loaded stage (`guard` holds the stage lock): Info then reports no assignment and
    /// no sequences, so the coordinator assigns this worker again.
    fn drop_stage(&self, guard: &mut Option<AnyStage>) {
        *guard = None;
        self.forget_stage();
    }

    /// One step through the loaded stage, on a blocking thread: frees `release` first, then runs
    /// `batch`; returns the output and its wall time in ms. A request error leaves the stage as it
    /// was; any other failure drops it (so Info shows no assignment and the coordinator assigns
    /// again). The error's flag says whether the device itself failed.
    fn step(
        &self,
        batch: &[StepSeq],
        hidden: &[f32],
        release: &[u64],
        span: &tracing::Span,
    ) -> Result<(crate::stage::StepOut, f64), (Error, bool)> {
        let t = Instant::now();
        let mut guard = self.stage();
        let st = guard
            .as_mut()
            .ok_or_else(|| (Error::Assignment("worker has no assignment yet".into()), false))?;
        st.release(release);
        let out = match &self.concurrent {
            Some(pool) if st.plan().micro_batches > 1 => pool.run(|| st.step(batch, hidden, span)),
            _ => st.step(batch, hidden, span),
        };
        self.live.store(st.kv_used().0 as u32, Ordering::Relaxed);
        match out {
            Ok(o) => Ok((o, t.elapsed().as_secs_f64() * 1e3)),
            Err(e) if e.is_request_error() => Err((e, false)),
            Err(e) => {
                // The stage may be half-way through a step (copy thread gone, a group lost).
                tracing::error!(worker = %self.id, error = %e, "step failed inside the stage; dropping the assignment");
                self.drop_stage(&mut guard);
                let device_failed = matches!(e, Error::Device { .. });
                Err((e, device_failed))
            }
        }
    }

    /// What Info reads without the lock, reset for "no stage".
    fn forget_stage(&self) {
        set_assignment(&self.assignment_id, "");
        self.live.store(0, Ordering::Relaxed);
    }
}

/// The gRPC face of a worker.
pub struct WorkerService(pub Arc<WorkerState>);

/// The worker's stage, locked. A panic while the lock was held (a bug, since requests are checked
/// before a step changes anything) leaves a stage that cannot be trusted: it is dropped and the
/// poison cleared, so the worker answers "no assignment" until it is assigned again instead of
/// failing every later request with a poisoned lock; `forget` then resets what Info reports.
fn lock_stage(
    m: &Mutex<Option<AnyStage>>,
    forget: impl FnOnce(),
) -> MutexGuard<'_, Option<AnyStage>> {
    m.lock().unwrap_or_else(|poisoned| {
        tracing::error!("a step panicked while holding the stage; dropping the assignment");
        m.clear_poison();
        let mut g = poisoned.into_inner();
        *g = None;
        forget();
        g
    })
}

#[tonic::async_trait]
impl Worker for WorkerService {
    async fn info(&self, _r: Request<InfoRequest>) -> Result<Response<InfoResponse>, Status> {
        let s = &self.0;
        let n = s.store.manifest.config.num_layers as u32;
        let live = s.live.load(Ordering::Relaxed);
        let loader = loader_stats(s).await;
        Ok(Response::new(InfoResponse {
            device: s.device.clone(),
            memory_budget: s.budget,
            num_layers: n,
            sequences: live,
            device_bytes_used: s.device_bytes_used(),
            assignment_id: s
                .assignment_id
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
            loader,
            host_id: s.host_id.clone(),
            exact: s.precision == layerstream_kernels::Precision::F32,
        }))
    }

    async fn assign(&self, r: Request<Assignment>) -> Result<Response<AssignResponse>, Status> {
        let span =
            info_span!("assign", layers = tracing::field::Empty, resident = tracing::field::Empty);
        adopt_parent(&span, r.metadata());
        let a = r.into_inner();
        span.record("layers", tracing::field::debug(a.layers()));
        span.record("resident", a.resident.len() as i64);
        let s = self.0.clone();
        let in_place = layerstream_serving::plan::streams_in_place(&s.device);
        let u = layerstream_serving::plan::usage_with(&s.store.manifest, &a, in_place);
        if u.total() > s.budget {
            return Err(Error::OverBudget(format!(
                "worker {}: assignment of layers {}..{} needs {u}, more than its memory budget of {} bytes",
                s.id, a.layer_start, a.layer_end, s.budget
            ))
            .into());
        }
        let channel =
            layerstream_rpc::transport::connect_uds(&s.loader_socket).await.map_err(|e| {
                Error::Loader {
                    what: format!("at {}", s.loader_socket.display()),
                    msg: e.to_string(),
                }
            })?;
        let rt = tokio::runtime::Handle::current();
        let bytes = u.total();
        tokio::task::spawn_blocking(move || {
            let _e = span.enter();
            let link = LoaderLink::new(s.loader_bearer.clone().wrap(channel), s.id.clone(), rt);
            let t = Instant::now();
            // Free the previous assignment's device memory before loading the new one.
            s.drop_stage(&mut s.stage());
            let id = a.assignment_id.clone();
            let stage = s.backend.load(s.store.clone(), a, link, s.precision)?;
            info!(worker = %s.id, layers = ?stage.plan().layers(), resident = ?stage.plan().resident, bytes, ms = t.elapsed().as_millis() as u64, "assignment loaded");
            *s.stage() = Some(stage);
            set_assignment(&s.assignment_id, &id);
            Ok::<_, Error>(())
        })
        .await
        .map_err(|e| Error::Internal(e.to_string()))??;
        Ok(Response::new(AssignResponse {
            bytes_used: bytes,
            max_step_tokens: self.0.max_step_tokens.map_or(0, |n| n as u32),
        }))
    }

    async fn step(&self, r: Request<StepRequest>) -> Result<Response<StepResponse>, Status> {
        let span = info_span!("worker_step", otel.name = "worker step", worker = %self.0.id, seqs = r.get_ref().seqs.len() as i64);
        adopt_parent(&span, r.metadata());
        let mut req = r.into_inner();
        let rows: usize = req.seqs.iter().map(|s| s.token_ids.len()).sum();
        if let Some(max) = self.0.max_step_tokens.filter(|&m| rows > m) {
            let msg = format!("a step of {rows} tokens exceeds this worker's limit of {max} tokens per step (its activation memory)");
            return Err(Error::invalid("seqs", msg).into());
        }
        let hidden = crate::wire::step_hidden(&req)?;
        let batch: Vec<StepSeq> =
            std::mem::take(&mut req.seqs).into_iter().map(Into::into).collect();
        let (lane, to_shm) = (req.micro_batch, req.hidden_out_shm);
        let (s, s2) = (self.0.clone(), span.clone());
        let out = tokio::task::spawn_blocking(move || s.step(&batch, &hidden, &req.release, &s2))
            .instrument(span)
            .await;
        let (out, wall_ms) = match out {
            Ok(Ok(o)) => o,
            Ok(Err((e, device_failed))) => {
                let status = Status::from(e);
                if device_failed {
                    self.0.health.not_serving(status.message()).await;
                }
                return Err(status);
            }
            Err(join) => {
                // A panic is a bug: the stage it interrupted was dropped (lock_stage), but nothing
                // this process holds can be trusted any more; an orchestrator should restart it.
                let msg = format!("a step panicked: {join}");
                self.0.health.not_serving(&msg).await;
                return Err(Error::Internal(msg).into());
            }
        };
        let (hidden, hidden_ref) = if to_shm && !out.hidden.is_empty() {
            let r = self.0.handoff.write(lane, &out.hidden).map_err(Error::Internal)?;
            (Vec::new(), Some(r))
        } else {
            (out.hidden.iter().flat_map(|v| v.to_le_bytes()).collect(), None)
        };
        Ok(Response::new(crate::wire::step_response(out, hidden, hidden_ref, wall_ms)))
    }

    async fn swap(&self, r: Request<SwapRequest>) -> Result<Response<SwapResponse>, Status> {
        let r = r.into_inner();
        let pairs = |v: &[BlockMove], out: bool| -> Vec<(u32, u32)> {
            v.iter().map(|m| if out { (m.device, m.host) } else { (m.host, m.device) }).collect()
        };
        let (to_host, to_device) = (pairs(&r.to_host, true), pairs(&r.to_device, false));
        let s = self.0.clone();
        let moved = tokio::task::spawn_blocking(move || {
            let mut g = s.stage();
            match g.as_mut() {
                Some(st) => st.swap(&to_host, &to_device),
                None => Err(Error::Assignment("no assignment loaded: nothing to swap".into())),
            }
        })
        .await
        .map_err(|e| Error::Internal(e.to_string()))??;
        Ok(Response::new(SwapResponse { bytes_to_host: moved.0, bytes_to_device: moved.1 }))
    }

    async fn release(
        &self,
        r: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        let r = r.into_inner();
        let (ids, all) = (r.seq_ids, r.all);
        let s = self.0.clone();
        let n = tokio::task::spawn_blocking(move || {
            let mut g = s.stage();
            let n = g.as_mut().map_or(0, |st| {
                if all {
                    st.release_all();
                } else {
                    st.release(&ids);
                }
                st.kv_used().0 as u32
            });
            s.live.store(n, Ordering::Relaxed);
            n
        })
        .await
        .map_err(|e| Error::Internal(e.to_string()))?;
        Ok(Response::new(ReleaseResponse { sequences: n }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A panic while the stage was locked does not fail every later request: the next lock clears
    /// the poison, drops whatever stage the panic interrupted and forgets its assignment.
    #[test]
    fn a_panic_under_the_stage_lock_does_not_poison_later_requests() {
        let m = Arc::new(Mutex::new(None::<AnyStage>));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("a step panicked");
        })
        .join();
        assert!(m.is_poisoned());
        let mut forgotten = false;
        assert!(lock_stage(&m, || forgotten = true).is_none());
        assert!(forgotten, "what Info reports is reset with the stage");
        assert!(!m.is_poisoned(), "the poison is cleared once");
    }
}
