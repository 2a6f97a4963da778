//! Jobs: groups of requests with an id, their event history (for WatchJob replay), results and state,
//! and the cancel flags of their sequences.

use layerstream_proto::v1::{generate_event, FinishReason, GenerateEvent, Job, JobState};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// One job's record.
pub struct JobRecord {
    pub trace_id: String,
    pub requests: usize,
    pub history: Vec<GenerateEvent>,
    pub cancel: Vec<Arc<AtomicBool>>,
    /// Bumped on every recorded event; watchers wait on it.
    pub live: watch::Sender<usize>,
    pub cancelled: bool,
}

impl JobRecord {
    fn finals(&self) -> Vec<layerstream_proto::v1::FinalEvent> {
        self.history
            .iter()
            .filter_map(|e| match &e.event {
                Some(generate_event::Event::Done(d)) => Some(d.clone()),
                _ => None,
            })
            .collect()
    }

    /// Where the job is.
    pub fn state(&self) -> JobState {
        let finals = self.finals();
        if finals.len() < self.requests {
            return if self.history.is_empty() { JobState::Queued } else { JobState::Running };
        }
        if finals.iter().any(|f| f.finish_reason() == FinishReason::Error) {
            JobState::Failed
        } else if self.cancelled
            || finals.iter().any(|f| f.finish_reason() == FinishReason::Cancelled)
        {
            JobState::Cancelled
        } else {
            JobState::Done
        }
    }

    /// Whether every request has finished.
    pub fn finished(&self) -> bool {
        self.finals().len() >= self.requests
    }

    /// The public view.
    pub fn view(&self, id: &str) -> Job {
        Job {
            job_id: id.into(),
            state: self.state().into(),
            results: self.finals(),
            requests: self.requests as u32,
            trace_id: self.trace_id.clone(),
        }
    }
}

/// All jobs of this coordinator.
#[derive(Default, Clone)]
pub struct Jobs {
    inner: Arc<Mutex<HashMap<String, JobRecord>>>,
}

impl Jobs {
    /// Registers a job.
    pub fn insert(&self, id: String, rec: JobRecord) {
        self.inner.lock().unwrap().insert(id, rec);
    }

    /// Records an event of a job and forwards it to watchers.
    pub fn record(&self, id: &str, ev: GenerateEvent) {
        if let Some(j) = self.inner.lock().unwrap().get_mut(id) {
            j.history.push(ev);
            j.live.send_replace(j.history.len());
        }
    }

    /// Runs `f` on a job.
    pub fn with<T>(&self, id: &str, f: impl FnOnce(&mut JobRecord) -> T) -> Option<T> {
        self.inner.lock().unwrap().get_mut(id).map(f)
    }

    /// Sets a job's cancel flags.
    pub fn cancel(&self, id: &str) -> Option<Job> {
        self.with(id, |j| {
            j.cancelled = true;
            j.cancel.iter().for_each(|c| c.store(true, Ordering::Relaxed));
            j.live.send_modify(|_| {});
            j.view(id)
        })
    }
}
