//! The job journal (`--journal FILE`, a redb database): every job the coordinator accepts is
//! written — its requests, trace id and idempotency key — and committed durably (fsync) before the
//! client is told its id; the tokens each request produces follow, event by event, committed by a
//! writer thread in group commits (whatever arrived while the last commit ran, fsynced together)
//! and acknowledged, so the coordinator shows a token to clients only once it is journaled; a
//! finished job is removed. After a crash the
//! coordinator resumes every job still in the journal under its id (`unfinished`), and a client
//! resubmitting with the same idempotency key is given the same job.

use layerstream_rpc::v1::{GenerateRequest, SubmitJobRequest};
use prost::Message;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;

/// Told when an operation is durable.
type Ack = oneshot::Sender<()>;

/// job id → the job's requests (a prost-encoded `SubmitJobRequest`).
const JOBS: TableDefinition<&str, &[u8]> = TableDefinition::new("jobs");
/// job id → trace id.
const TRACES: TableDefinition<&str, &str> = TableDefinition::new("traces");
/// job id → the idempotency key it was submitted with (a resumed job answers to it again).
const KEY_OF: TableDefinition<&str, &str> = TableDefinition::new("key_of");
/// (job id, request index) → the tokens produced so far (u32 little-endian).
const TOKENS: TableDefinition<(&str, u32), &[u8]> = TableDefinition::new("tokens");
/// (job id, request index) → how many of those tokens each event carried (u32 little-endian), so
/// a resumed job shows clients the same events again.
const EVENTS: TableDefinition<(&str, u32), &[u8]> = TableDefinition::new("events");

/// How often a batch that failed is tried again (and the longest a token waits for company when
/// the disk is slow).
const FLUSH: Duration = Duration::from_millis(100);

/// What the writer thread applies.
#[derive(Debug, PartialEq)]
enum Op {
    /// `ids` are the tokens of one or more events; `events` their lengths.
    Tokens {
        job: String,
        index: u32,
        ids: Vec<u32>,
        events: Vec<u32>,
    },
    Finish {
        job: String,
    },
}

/// An open journal.
pub struct Journal {
    db: Arc<Handle>,
    /// To the writer thread (None once dropped, which ends the thread), with what to tell once
    /// the operation is committed.
    tx: Option<mpsc::Sender<(Op, Option<Ack>)>>,
    writer: Option<std::thread::JoinHandle<()>>,
}

/// The database behind a lock, closed after a failed write and opened again by the next use: redb
/// refuses every write after an I/O error ("Previous I/O error occurred"), so healing (the disk has
/// room again) needs a fresh handle.
struct Handle {
    path: PathBuf,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    db: Option<Database>,
    /// The error in force since the last write failed (None: writable).
    failing: Option<String>,
}

/// Why the journal could not be used.
#[derive(Debug)]
struct Failure {
    msg: String,
    /// The disk (full, gone, read-only): heals by itself. Otherwise the file is damaged.
    io: bool,
}

impl Handle {
    /// Runs `f` on the database (opening it again first after a failure); an error closes it and
    /// is recorded until a later use succeeds. A panic inside redb (its debug checks of a damaged
    /// file) is a damaged-file error, never this thread's end.
    fn with<T>(&self, f: impl FnOnce(&Database) -> Result<T, redb::Error>) -> Result<T, Failure> {
        let mut st = layerstream_model::sync::lock(&self.state);
        let run = std::panic::AssertUnwindSafe(|| -> Result<T, redb::Error> {
            if st.db.is_none() {
                st.db = Some(Database::create(&self.path)?);
            }
            f(st.db.as_ref().expect("opened above"))
        });
        let result = std::panic::catch_unwind(run).unwrap_or_else(|_| {
            Err(redb::Error::Corrupted("the journal's reader panicked".into()))
        });
        match result {
            Ok(v) => {
                if let Some(was) = st.failing.take() {
                    tracing::warn!(journal = %self.path.display(), error = %was, "job journal writable again");
                }
                Ok(v)
            }
            Err(e) => {
                let io = match &e {
                    redb::Error::PreviousIo => true,
                    redb::Error::Io(e) => disk_fault(e),
                    _ => false,
                };
                let msg = format!("job journal {}: {e}", self.path.display());
                if st.failing.is_none() {
                    tracing::error!(error = %msg, "job journal write failed; jobs are not durable until it heals");
                }
                st.failing = Some(msg.clone());
                st.db = None;
                Err(Failure { msg, io })
            }
        }
    }
}

/// Whether an I/O error is the disk's (full, read-only, failing, busy) rather than the file's
/// content (not a redb file, cut short): the first heals by itself, the second needs a new file.
fn disk_fault(e: &std::io::Error) -> bool {
    let os = [libc::ENOSPC, libc::EDQUOT, libc::EROFS, libc::EIO, libc::EAGAIN, libc::EINTR];
    e.raw_os_error().is_some_and(|c| os.contains(&c) || c == libc::ENOMEM || c == libc::EACCES)
        || e.kind() == std::io::ErrorKind::StorageFull
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
    /// Per request, the events it had produced (their token ids) when the journal last committed.
    pub(crate) tokens: Vec<Vec<Vec<u32>>>,
}

fn err(what: &str, e: impl std::fmt::Display) -> crate::Error {
    crate::Error::Setup(format!("job journal: {what}: {e}"))
}

impl Journal {
    /// Opens (or creates) the journal at `path`. A journal that cannot be read (truncated, bits
    /// flipped, not a journal) is set aside as `<path>.damaged-<unix time>` with an error in the
    /// log naming what is lost, and a fresh one is started: a damaged file never stops the
    /// coordinator.
    pub fn open(path: &Path) -> crate::Result<Journal> {
        let handle = Arc::new(Handle { path: path.to_owned(), state: Mutex::default() });
        match handle.with(|db| read_unfinished(db).map(drop)) {
            Ok(()) => {}
            // A disk that cannot be written now (full, say): start, not durable until it heals.
            Err(e) if e.io => tracing::error!(error = %e.msg,
                "job journal cannot be opened now; jobs are not durable until it can"),
            Err(e) => {
                let aside = set_aside(path)?;
                tracing::error!(journal = %path.display(), set_aside = %aside.display(), error = %e.msg,
                    "job journal damaged: set aside, starting a fresh one; the jobs it held are not resumed");
                layerstream_model::sync::lock(&handle.state).failing = None;
                if let Err(e) = handle.with(|_| Ok(())) {
                    tracing::error!(error = %e.msg, "a fresh job journal cannot be started now");
                }
            }
        }
        let (tx, rx) = mpsc::channel();
        let writer = handle.clone();
        let writer = std::thread::Builder::new()
            .name("journal".into())
            .spawn(move || write_loop(&writer, &rx))
            .map_err(|e| err("starting its writer", e))?;
        Ok(Journal { db: handle, tx: Some(tx), writer: Some(writer) })
    }

    /// The error in force since a write failed (None: the journal is writable).
    pub fn failing(&self) -> Option<String> {
        layerstream_model::sync::lock(&self.db.state).failing.clone()
    }

    /// Writes a job and commits it durably before returning; an error names the journal and why
    /// (the next write tries again on a fresh handle).
    pub fn record_job(
        &self,
        id: &str,
        trace_id: &str,
        key: Option<&str>,
        requests: &[GenerateRequest],
    ) -> Result<(), String> {
        let bytes = SubmitJobRequest { requests: requests.to_vec() }.encode_to_vec();
        self.db
            .with(|db| {
                let w = db.begin_write()?;
                {
                    let mut jobs = w.open_table(JOBS)?;
                    jobs.insert(id, bytes.as_slice())?;
                    let mut traces = w.open_table(TRACES)?;
                    traces.insert(id, trace_id)?;
                    if let Some(k) = key {
                        let mut key_of = w.open_table(KEY_OF)?;
                        key_of.insert(id, k)?;
                    }
                }
                w.commit()?;
                Ok(())
            })
            .map_err(|f| f.msg)
    }

    /// Appends one event's tokens of request `index` of `job` (committed with the next group);
    /// the receiver hears `()` once they are durable, and is dropped unanswered when the journal
    /// cannot be written (they are retried; the caller need not wait for them).
    pub fn tokens(&self, job: &str, index: u32, ids: &[u32]) -> oneshot::Receiver<()> {
        let (ack, rx) = oneshot::channel();
        if let Some(tx) = &self.tx {
            let op = Op::Tokens {
                job: job.into(),
                index,
                ids: ids.to_vec(),
                events: vec![ids.len() as u32],
            };
            let _ = tx.send((op, Some(ack)));
        }
        rx
    }

    /// Removes a finished job (with the next batch).
    pub fn finish(&self, job: &str) {
        if let Some(tx) = &self.tx {
            let _ = tx.send((Op::Finish { job: job.into() }, None));
        }
    }

    /// Every job the journal holds: the ones that did not finish before the coordinator stopped.
    pub fn unfinished(&self) -> Result<Vec<Unfinished>, String> {
        self.db.with(read_unfinished).map_err(|f| f.msg)
    }
}

/// Renames a damaged journal out of the way; returns its new path.
fn set_aside(path: &Path) -> crate::Result<PathBuf> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let aside = PathBuf::from(format!("{}.damaged-{secs}", path.display()));
    std::fs::rename(path, &aside).map_err(|e| err("setting a damaged journal aside", e))?;
    Ok(aside)
}

/// The unfinished jobs in `db` (an error if any part cannot be read: the journal is damaged).
fn read_unfinished(db: &Database) -> Result<Vec<Unfinished>, redb::Error> {
    let r = db.begin_read()?;
    let jobs = match r.open_table(JOBS) {
        Ok(t) => t,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
        Err(e) => return Err(e.into()),
    };
    let traces = r.open_table(TRACES)?;
    let key_of = r.open_table(KEY_OF).ok();
    let tokens = r.open_table(TOKENS).ok();
    let mut out = Vec::new();
    for row in jobs.iter()? {
        let (id, bytes) = row?;
        let id = id.value().to_owned();
        let requests = SubmitJobRequest::decode(bytes.value())
            .map_err(|e| redb::Error::Corrupted(format!("job {id}: {e}")))?
            .requests;
        let trace_id = traces.get(id.as_str())?.map_or_else(String::new, |v| v.value().to_owned());
        let key = match &key_of {
            Some(t) => t.get(id.as_str())?.map(|v| v.value().to_owned()),
            None => None,
        };
        let events = r.open_table(EVENTS).ok();
        let mut produced = Vec::with_capacity(requests.len());
        for i in 0..requests.len() as u32 {
            let read = |t: &Option<redb::ReadOnlyTable<(&str, u32), &[u8]>>| -> Result<Vec<u32>, redb::Error> {
                Ok(match t {
                    Some(t) => t.get((id.as_str(), i))?.map_or_else(Vec::new, |v| ids_of(v.value())),
                    None => Vec::new(),
                })
            };
            produced.push(split_events(read(&tokens)?, &read(&events)?));
        }
        out.push(Unfinished { job_id: id, trace_id, key, requests, tokens: produced });
    }
    Ok(out)
}

/// `ids` cut into events of `lengths` (one event of all of them when the lengths do not add up:
/// a journal written before events were kept).
fn split_events(ids: Vec<u32>, lengths: &[u32]) -> Vec<Vec<u32>> {
    if ids.is_empty() {
        return Vec::new();
    }
    if lengths.iter().map(|&n| n as usize).sum::<usize>() != ids.len() {
        return vec![ids];
    }
    let mut at = 0;
    lengths
        .iter()
        .map(|&n| {
            at += n as usize;
            ids[at - n as usize..at].to_vec()
        })
        .collect()
}

fn ids_of(bytes: &[u8]) -> Vec<u32> {
    bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// The writer thread: waits for an operation, takes every one that arrived meanwhile (a group
/// commit: one fsync for all), commits them as one durable transaction and acknowledges them; a
/// group that fails is kept (its acknowledgements dropped, so nobody waits on a full disk) and
/// retried every `FLUSH` with what follows; ends when the journal is dropped.
fn write_loop(db: &Handle, rx: &mpsc::Receiver<(Op, Option<Ack>)>) {
    let mut batch: Vec<Op> = Vec::new();
    loop {
        let first = if batch.is_empty() {
            match rx.recv() {
                Ok(x) => Some(x),
                Err(_) => return,
            }
        } else {
            match rx.recv_timeout(FLUSH) {
                Ok(x) => Some(x),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let _ = db.with(|d| apply(d, &batch));
                    return;
                }
            }
        };
        let mut acks = Vec::new();
        for (op, ack) in first.into_iter().chain(std::iter::from_fn(|| rx.try_recv().ok())) {
            batch.push(op);
            acks.extend(ack);
        }
        if db.with(|d| apply(d, &batch)).is_ok() {
            batch.clear();
            for a in acks {
                let _ = a.send(());
            }
        } else {
            batch = coalesce(batch);
        }
    }
}

/// A failed batch made as small as what it means: one token list per request in order, none for
/// jobs it also finishes (`apply` would drop them). What waits for the disk is then bounded by the
/// live jobs' tokens, however long the disk is full.
fn coalesce(batch: Vec<Op>) -> Vec<Op> {
    let finished: std::collections::HashSet<String> = batch
        .iter()
        .filter_map(|op| match op {
            Op::Finish { job } => Some(job.clone()),
            Op::Tokens { .. } => None,
        })
        .collect();
    let mut tokens: Vec<Op> = Vec::new();
    let mut at: std::collections::HashMap<(String, u32), usize> = Default::default();
    for op in batch {
        if let Op::Tokens { job, index, ids, events } = op {
            if finished.contains(&job) {
                continue;
            }
            match at.get(&(job.clone(), index)) {
                Some(&i) => {
                    if let Op::Tokens { ids: all, events: lengths, .. } = &mut tokens[i] {
                        all.extend(ids);
                        lengths.extend(events);
                    }
                }
                None => {
                    at.insert((job.clone(), index), tokens.len());
                    tokens.push(Op::Tokens { job, index, ids, events });
                }
            }
        }
    }
    tokens.extend(finished.into_iter().map(|job| Op::Finish { job }));
    tokens
}

fn apply(db: &Database, batch: &[Op]) -> Result<(), redb::Error> {
    let w = db.begin_write()?;
    {
        let mut tokens = w.open_table(TOKENS)?;
        let mut jobs = w.open_table(JOBS)?;
        let mut traces = w.open_table(TRACES)?;
        let mut key_of = w.open_table(KEY_OF)?;
        let mut events_of = w.open_table(EVENTS)?;
        for op in batch {
            match op {
                Op::Tokens { job, index, ids, events } => {
                    // Only for jobs still held (a finished one's late tokens are dropped).
                    if jobs.get(job.as_str())?.is_none() {
                        continue;
                    }
                    let mut all = tokens
                        .get((job.as_str(), *index))?
                        .map_or_else(Vec::new, |v| v.value().to_vec());
                    all.extend(ids.iter().flat_map(|t| t.to_le_bytes()));
                    tokens.insert((job.as_str(), *index), all.as_slice())?;
                    let mut lengths = events_of
                        .get((job.as_str(), *index))?
                        .map_or_else(Vec::new, |v| v.value().to_vec());
                    lengths.extend(events.iter().flat_map(|n| n.to_le_bytes()));
                    events_of.insert((job.as_str(), *index), lengths.as_slice())?;
                }
                Op::Finish { job } => {
                    let n = jobs.remove(job.as_str())?.map_or(0, |b| {
                        SubmitJobRequest::decode(b.value()).map_or(0, |r| r.requests.len())
                    });
                    traces.remove(job.as_str())?;
                    for i in 0..n as u32 {
                        tokens.remove((job.as_str(), i))?;
                        events_of.remove((job.as_str(), i))?;
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
            j.tokens("job-a", 1, &[7, 8]).blocking_recv().expect("acknowledged once durable");
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
        assert_eq!(u[0].tokens, vec![vec![], vec![vec![7, 8], vec![9]]]);
        j.finish("job-a");
        std::thread::sleep(FLUSH * 3);
        assert!(j.unfinished().unwrap().is_empty());
    }

    /// A batch kept for a retry keeps each request's tokens in order, once, and nothing of the
    /// jobs it finishes.
    #[test]
    fn failed_batches_coalesce() {
        let t = |job: &str, index, ids: &[u32], events: &[u32]| Op::Tokens {
            job: job.into(),
            index,
            ids: ids.to_vec(),
            events: events.to_vec(),
        };
        let batch = vec![
            t("a", 0, &[1], &[1]),
            t("b", 0, &[5], &[1]),
            t("a", 0, &[2, 3], &[2]),
            t("a", 1, &[9], &[1]),
            Op::Finish { job: "b".into() },
            t("a", 0, &[4], &[1]),
        ];
        assert_eq!(
            coalesce(batch),
            vec![
                t("a", 0, &[1, 2, 3, 4], &[1, 2, 1]),
                t("a", 1, &[9], &[1]),
                Op::Finish { job: "b".into() }
            ]
        );
        assert_eq!(split_events(vec![1, 2, 3, 4], &[1, 2, 1]), vec![vec![1], vec![2, 3], vec![4]]);
        assert_eq!(split_events(vec![1, 2, 3], &[1]), vec![vec![1, 2, 3]], "an old journal");
    }

    /// A truncated journal, or one whose header is overwritten, is set aside and a fresh one
    /// started: the coordinator starts, with nothing to resume, and the damaged file is kept.
    #[test]
    fn damaged_journals_are_set_aside() {
        for damage in ["truncate", "header"] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("j.redb");
            {
                let j = Journal::open(&path).unwrap();
                j.record_job("job-a", "trace-a", None, &[req(&[1, 2])]).unwrap();
                j.tokens("job-a", 0, &[7]);
            }
            let len = std::fs::metadata(&path).unwrap().len();
            let mut bytes = std::fs::read(&path).unwrap();
            match damage {
                "truncate" => bytes.truncate(len as usize / 3),
                _ => bytes[..512].fill(0xa5),
            }
            std::fs::write(&path, &bytes).unwrap();
            let j = Journal::open(&path).unwrap();
            assert!(j.unfinished().unwrap().is_empty(), "{damage}");
            assert_eq!(j.failing(), None);
            let aside: Vec<_> = std::fs::read_dir(dir.path())
                .unwrap()
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.starts_with("j.redb.damaged-"))
                .collect();
            assert_eq!(aside.len(), 1, "{damage}: {aside:?}");
            j.record_job("job-b", "trace-b", None, &[req(&[3])]).unwrap();
            assert_eq!(j.unfinished().unwrap()[0].job_id, "job-b");
        }
    }

    #[test]
    fn a_full_disk_is_not_a_damaged_file() {
        assert!(disk_fault(&std::io::Error::from_raw_os_error(libc::ENOSPC)));
        assert!(!disk_fault(&std::io::Error::new(std::io::ErrorKind::InvalidData, "magic")));
        assert!(!disk_fault(&std::io::Error::from(std::io::ErrorKind::UnexpectedEof)));
    }
}
