//! The job journal (`--journal FILE`, a redb database): every job the coordinator accepts is
//! written — its requests, trace id and idempotency key — and committed durably (fsync) before the
//! client is told its id; the tokens each request produces follow, committed by a writer thread in
//! batches at most `FLUSH` apart (each batch fsynced); a finished job is removed. After a crash the
//! coordinator resumes every job still in the journal under its id (`unfinished`), and a client
//! resubmitting with the same idempotency key is given the same job.

use layerstream_rpc::v1::{GenerateRequest, SubmitJobRequest};
use prost::Message;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use std::path::Path;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

/// job id → the job's requests (a prost-encoded `SubmitJobRequest`).
const JOBS: TableDefinition<&str, &[u8]> = TableDefinition::new("jobs");
/// job id → trace id.
const TRACES: TableDefinition<&str, &str> = TableDefinition::new("traces");
/// job id → the idempotency key it was submitted with (a resumed job answers to it again).
const KEY_OF: TableDefinition<&str, &str> = TableDefinition::new("key_of");
/// (job id, request index) → the tokens produced so far (u32 little-endian).
const TOKENS: TableDefinition<(&str, u32), &[u8]> = TableDefinition::new("tokens");

/// Longest a produced token waits before its batch is committed.
const FLUSH: Duration = Duration::from_millis(100);

/// What the writer thread applies.
enum Op {
    Tokens { job: String, index: u32, ids: Vec<u32> },
    Finish { job: String },
}

/// An open journal.
pub struct Journal {
    db: Arc<Database>,
    /// To the writer thread (None once dropped, which ends the thread).
    tx: Option<mpsc::Sender<Op>>,
    writer: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Journal {
    /// Ends the writer after its last batch, so the file is closed when the journal is.
    fn drop(&mut self) {
        self.tx = None;
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

/// A job the journal holds that did not finish.
#[derive(Debug, Clone)]
pub struct Unfinished {
    pub(crate) job_id: String,
    pub(crate) trace_id: String,
    pub(crate) key: Option<String>,
    pub(crate) requests: Vec<GenerateRequest>,
    /// Per request, the tokens it had produced when the journal last committed.
    pub(crate) tokens: Vec<Vec<u32>>,
}

fn err(what: &str, e: impl std::fmt::Display) -> crate::Error {
    crate::Error::Setup(format!("job journal: {what}: {e}"))
}

impl Journal {
    /// Opens (or creates) the journal at `path`.
    pub fn open(path: &Path) -> crate::Result<Journal> {
        let db = Database::create(path).map_err(|e| err(&path.display().to_string(), e))?;
        let db = Arc::new(db);
        let (tx, rx) = mpsc::channel();
        let writer = db.clone();
        let writer = std::thread::Builder::new()
            .name("journal".into())
            .spawn(move || write_loop(&writer, &rx))
            .map_err(|e| err("starting its writer", e))?;
        Ok(Journal { db, tx: Some(tx), writer: Some(writer) })
    }

    /// Writes a job and commits it durably before returning.
    pub fn record_job(
        &self,
        id: &str,
        trace_id: &str,
        key: Option<&str>,
        requests: &[GenerateRequest],
    ) -> crate::Result<()> {
        let bytes = SubmitJobRequest { requests: requests.to_vec() }.encode_to_vec();
        let w = self.db.begin_write().map_err(|e| err("write", e))?;
        {
            let mut jobs = w.open_table(JOBS).map_err(|e| err("jobs", e))?;
            jobs.insert(id, bytes.as_slice()).map_err(|e| err("jobs", e))?;
            let mut traces = w.open_table(TRACES).map_err(|e| err("traces", e))?;
            traces.insert(id, trace_id).map_err(|e| err("traces", e))?;
            if let Some(k) = key {
                let mut key_of = w.open_table(KEY_OF).map_err(|e| err("keys", e))?;
                key_of.insert(id, k).map_err(|e| err("keys", e))?;
            }
        }
        w.commit().map_err(|e| err("commit", e))
    }

    /// Appends tokens request `index` of `job` produced (committed with the next batch).
    pub fn tokens(&self, job: &str, index: u32, ids: &[u32]) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(Op::Tokens { job: job.into(), index, ids: ids.to_vec() });
        }
    }

    /// Removes a finished job (with the next batch).
    pub fn finish(&self, job: &str) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(Op::Finish { job: job.into() });
        }
    }

    /// Every job the journal holds: the ones that did not finish before the coordinator stopped.
    pub fn unfinished(&self) -> crate::Result<Vec<Unfinished>> {
        let r = self.db.begin_read().map_err(|e| err("read", e))?;
        let jobs = match r.open_table(JOBS) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
            Err(e) => return Err(err("jobs", e)),
        };
        let traces = r.open_table(TRACES).map_err(|e| err("traces", e))?;
        let key_of = r.open_table(KEY_OF).ok();
        let tokens = r.open_table(TOKENS).ok();
        let mut out = Vec::new();
        for row in jobs.iter().map_err(|e| err("jobs", e))? {
            let (id, bytes) = row.map_err(|e| err("jobs", e))?;
            let id = id.value().to_owned();
            let requests = SubmitJobRequest::decode(bytes.value())
                .map_err(|e| err(&format!("job {id}"), e))?
                .requests;
            let trace_id = traces
                .get(id.as_str())
                .map_err(|e| err("traces", e))?
                .map_or_else(String::new, |v| v.value().to_owned());
            let key = key_of
                .as_ref()
                .and_then(|t| t.get(id.as_str()).ok().flatten())
                .map(|v| v.value().to_owned());
            let produced = |i: u32| -> Vec<u32> {
                let Some(t) = &tokens else { return Vec::new() };
                t.get((id.as_str(), i)).ok().flatten().map_or_else(Vec::new, |v| ids_of(v.value()))
            };
            let tokens = (0..requests.len() as u32).map(produced).collect();
            out.push(Unfinished { job_id: id, trace_id, key, requests, tokens });
        }
        Ok(out)
    }
}

fn ids_of(bytes: &[u8]) -> Vec<u32> {
    bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// The writer thread: waits for an operation, gathers what arrives within `FLUSH`, commits it as
/// one durable transaction; ends when the journal is dropped.
fn write_loop(db: &Database, rx: &mpsc::Receiver<Op>) {
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        let deadline = std::time::Instant::now() + FLUSH;
        while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
            match rx.recv_timeout(left) {
                Ok(op) => batch.push(op),
                Err(_) => break,
            }
        }
        if let Err(e) = apply(db, batch) {
            tracing::error!(error = %e, "job journal: a batch of tokens could not be written");
        }
    }
}

fn apply(db: &Database, batch: Vec<Op>) -> Result<(), redb::Error> {
    let w = db.begin_write()?;
    {
        let mut tokens = w.open_table(TOKENS)?;
        let mut jobs = w.open_table(JOBS)?;
        let mut traces = w.open_table(TRACES)?;
        let mut key_of = w.open_table(KEY_OF)?;
        for op in batch {
            match op {
                Op::Tokens { job, index, ids } => {
                    // Only for jobs still held (a finished one's late tokens are dropped).
                    if jobs.get(job.as_str())?.is_none() {
                        continue;
                    }
                    let mut all = tokens
                        .get((job.as_str(), index))?
                        .map_or_else(Vec::new, |v| v.value().to_vec());
                    all.extend(ids.iter().flat_map(|t| t.to_le_bytes()));
                    tokens.insert((job.as_str(), index), all.as_slice())?;
                }
                Op::Finish { job } => {
                    let n = jobs.remove(job.as_str())?.map_or(0, |b| {
                        SubmitJobRequest::decode(b.value()).map_or(0, |r| r.requests.len())
                    });
                    traces.remove(job.as_str())?;
                    for i in 0..n as u32 {
                        tokens.remove((job.as_str(), i))?;
                    }
                    key_of.remove(job.as_str())?;
                }
            }
        }
    }
    w.commit()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use layerstream_rpc::v1::{generate_request, TokenIds};

    fn req(ids: &[u32]) -> GenerateRequest {
        GenerateRequest {
            input: Some(generate_request::Input::TokenIds(TokenIds { ids: ids.to_vec() })),
            max_new_tokens: 9,
            ..Default::default()
        }
    }

    /// What a coordinator wrote is there after it is gone (a new handle on the same file): the
    /// unfinished job with its requests, key and tokens; a finished job is not.
    #[test]
    fn unfinished_jobs_survive_and_finished_ones_go() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.redb");
        {
            let j = Journal::open(&path).unwrap();
            j.record_job("job-a", "trace-a", Some("key-a"), &[req(&[1, 2]), req(&[3])]).unwrap();
            j.record_job("job-b", "trace-b", None, &[req(&[4])]).unwrap();
            j.tokens("job-a", 1, &[7, 8]);
            j.tokens("job-a", 1, &[9]);
            j.tokens("job-b", 0, &[5]);
            j.finish("job-b");
        }
        let j = Journal::open(&path).unwrap();
        let u = j.unfinished().unwrap();
        assert_eq!(u.len(), 1, "{u:?}");
        assert_eq!((u[0].job_id.as_str(), u[0].trace_id.as_str()), ("job-a", "trace-a"));
        assert_eq!(u[0].key.as_deref(), Some("key-a"));
        assert_eq!(u[0].requests, vec![req(&[1, 2]), req(&[3])]);
        assert_eq!(u[0].tokens, vec![vec![], vec![7, 8, 9]]);
        j.finish("job-a");
        std::thread::sleep(FLUSH * 3);
        assert!(j.unfinished().unwrap().is_empty());
    }
}
