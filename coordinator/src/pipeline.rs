//! One forward step through the worker pipeline: StepRequest to each worker in order, hidden states
//! passed along, sampled tokens from the last; trace context in metadata; a failed or hung worker
//! ends the step with an error that names it.

use crate::error::{Error, Result};
use layerstream_proto::telemetry::traced_request;
use layerstream_proto::v1::worker_client::WorkerClient;
use layerstream_proto::v1::{LayerTiming, ReleaseRequest, StepRequest, StepSeq};
use std::time::Duration;
use tonic::transport::Channel;
use tracing::Span;

/// The workers in layer order.
#[derive(Clone)]
pub struct Pipeline {
    pub workers: Vec<(String, WorkerClient<Channel>)>,
    pub step_timeout: Duration,
}

/// The result of a step.
#[derive(Debug, Default)]
pub struct StepResult {
    pub tokens: Vec<u32>,
    pub layers: Vec<LayerTiming>,
    /// Wall time of the workers' layer passes, summed over workers.
    pub layers_ms: f64,
}

impl Pipeline {
    /// Runs `seqs` through every worker under `span`.
    pub async fn step(&self, seqs: Vec<StepSeq>, span: &Span) -> Result<StepResult> {
        let mut hidden = Vec::new();
        let mut out = StepResult::default();
        for (i, (addr, client)) in self.workers.iter().enumerate() {
            let req = traced_request(
                span,
                StepRequest { seqs: seqs.clone(), hidden: std::mem::take(&mut hidden) },
            );
            let mut c = client.clone();
            let resp = tokio::time::timeout(self.step_timeout, c.step(req))
                .await
                .map_err(|_| Error::StepTimeout {
                    worker: addr.clone(),
                    timeout: self.step_timeout,
                })?
                .map_err(|s| Error::Worker {
                    worker: addr.clone(),
                    msg: format!("failed: {} ({:?})", s.message(), s.code()),
                })?
                .into_inner();
            out.layers.extend(resp.layers);
            out.layers_ms += resp.layers_ms;
            if i + 1 == self.workers.len() {
                if resp.tokens.len() != seqs.len() {
                    return Err(Error::Worker {
                        worker: addr.clone(),
                        msg: format!(
                            "returned {} tokens for {} sequences",
                            resp.tokens.len(),
                            seqs.len()
                        ),
                    });
                }
                out.tokens = resp.tokens;
            } else {
                hidden = resp.hidden;
            }
        }
        Ok(out)
    }

    /// Frees sequences on every worker (best effort: a dead worker has nothing left to free).
    pub async fn release(&self, ids: Vec<u64>) {
        if ids.is_empty() {
            return;
        }
        for (addr, client) in &self.workers {
            let mut c = client.clone();
            if let Err(e) = tokio::time::timeout(
                Duration::from_secs(5),
                c.release(ReleaseRequest { seq_ids: ids.clone() }),
            )
            .await
            {
                tracing::warn!(worker = %addr, error = %e, "release timed out");
            }
        }
    }
}
