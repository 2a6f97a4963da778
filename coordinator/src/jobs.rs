//! Jobs: groups of requests with an id, their event history (for WatchJob replay), results and state,
//! and the cancel flags of their sequences.

use layerstream_rpc::v1::{generate_event, FinishReason, GenerateEvent, Job, JobState};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// One job's record.
pub struct JobRecord {
    pub(crate) trace_id: String,
    pub(crate) requests: usize,
    pub(crate) history: Vec<GenerateEvent>,
    pub(crate) cancel: Vec<Arc<AtomicBool>>,
    /// Bumped on every recorded event; watchers wait on it.
    pub(crate) live: watch::Sender<usize>,
    pub(crate) cancelled: bool,
    /// When the last request finished (set once); finished records expire after the retention.
    pub(crate) finished_at: Option<Instant>,
    /// The idempotency key it was submitted with.
    pub(crate) key: Option<String>,
}

impl JobRecord {
    fn finals(&self) -> Vec<layerstream_rpc::v1::FinalEvent> {
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

/// All jobs of this coordinator: live ones, and finished ones for `retention` (at most `cap` of
/// them, oldest dropped first), so GetJob/WatchJob work after the end without memory growing with
/// every job ever run.
#[derive(Clone)]
pub struct Jobs {
    inner: Arc<Mutex<HashMap<String, JobRecord>>>,
    retention: Duration,
    cap: usize,
}

impl Default for Jobs {
    fn default() -> Self {
        Jobs::new(Duration::from_secs(600), 10_000)
    }
}

impl Jobs {
    /// Keeps finished jobs for `retention`, at most `cap` of them.
    pub fn new(retention: Duration, cap: usize) -> Self {
        Jobs { inner: Default::default(), retention, cap }
    }

    /// The map; a panic elsewhere while it was held leaves whole records behind, so a poisoned lock
    /// is taken over rather than failing every later request.
    fn lock(&self) -> MutexGuard<'_, HashMap<String, JobRecord>> {
        layerstream_model::sync::lock(&self.inner)
    }

    /// Registers a job (and drops expired ones).
    pub fn insert(&self, id: String, rec: JobRecord) {
        let mut m = self.lock();
        sweep(&mut m, self.retention, self.cap, Instant::now());
        m.insert(id, rec);
    }

    /// Records an event of a job and forwards it to watchers; returns whether the job has now
    /// finished (every request ended).
    pub fn record(&self, id: &str, ev: GenerateEvent) -> bool {
        let mut m = self.lock();
        let Some(j) = m.get_mut(id) else { return false };
        j.history.push(ev);
        if j.finished_at.is_none() && j.finished() {
            j.finished_at = Some(Instant::now());
        }
        j.live.send_replace(j.history.len());
        j.finished_at.is_some()
    }

    /// The (job id, trace id) of the job submitted with idempotency key `key`, while it is held.
    pub fn by_key(&self, key: &str) -> Option<(String, String)> {
        let m = self.lock();
        m.iter()
            .find(|(_, r)| r.key.as_deref() == Some(key))
            .map(|(id, r)| (id.clone(), r.trace_id.clone()))
    }

    /// Runs `f` on a job.
    pub fn with<T>(&self, id: &str, f: impl FnOnce(&mut JobRecord) -> T) -> Option<T> {
        self.lock().get_mut(id).map(f)
    }

    /// Number of records held.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Drops expired records now (also done on every insert).
    pub fn sweep(&self) {
        sweep(&mut self.lock(), self.retention, self.cap, Instant::now());
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

/// Removes finished records older than `retention`, then the oldest finished ones beyond `cap`.
fn sweep(m: &mut HashMap<String, JobRecord>, retention: Duration, cap: usize, now: Instant) {
    m.retain(|_, j| j.finished_at.is_none_or(|t| now.duration_since(t) < retention));
    let mut finished: Vec<(Instant, String)> =
        m.iter().filter_map(|(id, j)| j.finished_at.map(|t| (t, id.clone()))).collect();
    if finished.len() > cap {
        finished.sort();
        for (_, id) in &finished[..finished.len() - cap] {
            m.remove(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use layerstream_rpc::v1::FinalEvent;

    fn record() -> JobRecord {
        let (live, _) = watch::channel(0);
        JobRecord {
            trace_id: String::new(),
            requests: 1,
            history: vec![],
            cancel: vec![],
            live,
            cancelled: false,
            finished_at: None,
            key: None,
        }
    }

    fn done() -> GenerateEvent {
        let d = FinalEvent { finish_reason: FinishReason::Length.into(), ..Default::default() };
        GenerateEvent { index: 0, event: Some(generate_event::Event::Done(d)) }
    }

    /// Finished jobs expire after the retention and beyond the cap (oldest first); running ones stay.
    #[test]
    fn finished_jobs_expire_and_running_ones_stay() {
        let jobs = Jobs::new(Duration::from_millis(50), 2);
        for i in 0..5 {
            jobs.insert(format!("f{i}"), record());
            jobs.record(&format!("f{i}"), done());
            std::thread::sleep(Duration::from_millis(2));
        }
        jobs.insert("running".into(), record());
        assert_eq!(jobs.len(), 3, "two finished kept by the cap, plus the running one");
        assert!(
            jobs.with("f4", |_| ()).is_some() && jobs.with("f0", |_| ()).is_none(),
            "the oldest go first"
        );
        std::thread::sleep(Duration::from_millis(60));
        jobs.sweep();
        assert_eq!(jobs.len(), 1);
        assert_eq!(jobs.with("running", |j| j.state()), Some(JobState::Queued));
    }
}
