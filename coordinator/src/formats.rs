//! Output formats (JSON schemas, regexes, Lark grammars, tool-call grammars) compiled off the async
//! runtime: on a few threads of their own with large stacks, fed through a bounded queue, each
//! compile bounded in time, a panic in a compiler caught on its thread, and results (refusals too)
//! cached by the format's hash. A hostile format can then cost one compile thread a bounded time —
//! never the runtime's threads (so `/health` and every stream keep going) and never the process.
//! The limits on a format's shape are checked first (`layerstream_serving::grammar_limits`).

use layerstream_serving::grammar::{Constraint, Format, Grammars};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;

/// Each compile thread's stack: compilers recurse through rule and `$ref` chains, and the limits
/// keep those under 64 levels, far inside this.
const COMPILE_STACK: usize = 64 << 20;
/// Longest a request waits for its format to compile (the limits keep real ones to milliseconds).
pub const COMPILE_TIMEOUT: Duration = Duration::from_secs(10);
/// Compiled formats (or their refusals) kept.
const CACHED: usize = 64;

/// Why a format did not compile.
#[derive(Debug, Clone, PartialEq)]
pub enum FormatError {
    /// The format itself: over a limit, invalid, too slow to compile (a 400).
    Invalid(String),
    /// Every compile thread busy and the queue full (a 503: retry later).
    Busy(String),
}

struct Job {
    /// Set by the compile thread when it takes the job.
    started: Arc<AtomicBool>,
    grammars: Arc<Grammars>,
    format: Format,
    reply: oneshot::Sender<Result<Constraint, String>>,
}

/// The compile threads and the cache.
pub struct FormatPool {
    tx: mpsc::SyncSender<Job>,
    /// Held here too, so the queue outlives its threads (and exists with none).
    _rx: Arc<Mutex<mpsc::Receiver<Job>>>,
    queue: usize,
    cache: Mutex<Cache>,
    timeout: Duration,
}

impl FormatPool {
    /// `threads` compile threads behind a queue of `queue` formats (no thread: nothing compiles,
    /// which the tests use to fill the queue).
    pub fn new(threads: usize, queue: usize, timeout: Duration) -> std::io::Result<FormatPool> {
        let (tx, rx) = mpsc::sync_channel::<Job>(queue);
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("format-compile-{i}"))
                .stack_size(COMPILE_STACK)
                .spawn(move || compile_loop(&rx))?;
        }
        Ok(FormatPool { tx, _rx: rx, queue, cache: Mutex::new(Cache::default()), timeout })
    }

    /// The default pool: half the cores (at least one, at most four) and 64 queued formats.
    pub fn for_host() -> std::io::Result<FormatPool> {
        let cores = std::thread::available_parallelism().map_or(2, usize::from);
        Self::new((cores / 2).clamp(1, 4), 64, COMPILE_TIMEOUT)
    }

    /// `format` compiled by `grammars` (from the cache when the same format was compiled before).
    pub async fn compile(
        &self,
        grammars: &Arc<Grammars>,
        format: &Format,
    ) -> Result<Constraint, FormatError> {
        let key = format_key(format);
        if let Some(hit) = self.cache.lock().unwrap_or_else(|p| p.into_inner()).get(key) {
            return hit.map_err(FormatError::Invalid);
        }
        let (reply, rx) = oneshot::channel();
        let started = Arc::new(AtomicBool::new(false));
        let job = Job {
            started: started.clone(),
            grammars: grammars.clone(),
            format: format.clone(),
            reply,
        };
        if self.tx.try_send(job).is_err() {
            return Err(FormatError::Busy(format!(
                "the compile queue is full ({} formats waiting); retry later",
                self.queue
            )));
        }
        let secs = self.timeout.as_secs_f32();
        let result = match tokio::time::timeout(self.timeout, rx).await {
            // Not cached: a wait in the queue says nothing of the format.
            Err(_) if !started.load(Ordering::SeqCst) => {
                return Err(FormatError::Busy(format!(
                    "no compile thread was free within {secs} s; retry later"
                )))
            }
            Err(_) => {
                return Err(FormatError::Invalid(format!(
                    "compiling it took longer than the limit of {secs} s"
                )))
            }
            Ok(Err(_)) => Err("the grammar could not be compiled (its compiler failed)".into()),
            Ok(Ok(r)) => r,
        };
        self.cache.lock().unwrap_or_else(|p| p.into_inner()).put(key, result.clone());
        result.map_err(FormatError::Invalid)
    }
}

/// One compile thread: takes jobs until the pool is dropped; a panic in a compile is that job's
/// error (the thread goes on).
fn compile_loop(rx: &Mutex<mpsc::Receiver<Job>>) {
    loop {
        let job = match rx.lock().unwrap_or_else(|p| p.into_inner()).recv() {
            Ok(j) => j,
            Err(_) => return,
        };
        // The waiter may have given up (timed out, client gone): nothing to compile for it.
        if job.reply.is_closed() {
            continue;
        }
        job.started.store(true, Ordering::SeqCst);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            job.grammars.compile(&job.format)
        }))
        .unwrap_or_else(|_| Err("the grammar could not be compiled (its compiler failed)".into()));
        let _ = job.reply.send(r);
    }
}

/// A format's identity: its kind and its text (a schema as serialized, keys in their order).
fn format_key(f: &Format) -> u64 {
    let text = match f {
        Format::JsonObject => "o".to_owned(),
        Format::JsonSchema(s) => format!("s{s}"),
        Format::Regex(r) => format!("r{r}"),
        Format::Lark(g) => format!("l{g}"),
    };
    xxhash_rust::xxh3::xxh3_64(text.as_bytes())
}

/// The last `CACHED` results by key, oldest evicted first.
#[derive(Default)]
struct Cache {
    map: HashMap<u64, Result<Constraint, String>>,
    order: VecDeque<u64>,
}

impl Cache {
    fn get(&self, key: u64) -> Option<Result<Constraint, String>> {
        self.map.get(&key).cloned()
    }

    fn put(&mut self, key: u64, v: Result<Constraint, String>) {
        if self.map.insert(key, v).is_none() {
            self.order.push_back(key);
        }
        while self.order.len() > CACHED {
            if let Some(old) = self.order.pop_front() {
                self.map.remove(&old);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grammars() -> Arc<Grammars> {
        Arc::new(Grammars::new(crate::test_tokenizer(), &[0]).unwrap())
    }

    /// A chain of 700 rules (the probe's crash) is a named refusal; the same format again comes
    /// from the cache; a good format compiles; the pool keeps serving after each.
    #[tokio::test]
    async fn hostile_formats_are_refused_and_the_pool_goes_on() {
        let pool = FormatPool::new(1, 4, COMPILE_TIMEOUT).unwrap();
        let g = grammars();
        let mut lark = String::from("start: r0\n");
        for i in 0..700 {
            lark.push_str(&format!("r{i}: r{}\n", i + 1));
        }
        lark.push_str("r700: \"end\"\n");
        let bad = Format::Lark(lark);
        let e = pool.compile(&g, &bad).await.err().unwrap();
        assert!(matches!(&e, FormatError::Invalid(m) if m.contains("chain of rules")), "{e:?}");
        assert_eq!(pool.compile(&g, &bad).await.err(), Some(e));
        assert_eq!(pool.cache.lock().unwrap().order.len(), 1);
        let good = Format::Regex("(yes|no)".into());
        let mut c = pool.compile(&g, &good).await.unwrap();
        assert!(c.mask().unwrap().iter().any(|&w| w != 0));
    }

    /// A full queue is Busy, not a wait, and so is a format no thread took in time (a pool with
    /// no thread: nothing is ever taken from its queue of one).
    #[tokio::test]
    async fn a_full_queue_is_busy() {
        let pool = FormatPool::new(0, 1, Duration::from_millis(20)).unwrap();
        let g = grammars();
        let e = pool.compile(&g, &Format::Regex("a".into())).await.err().unwrap();
        assert!(matches!(&e, FormatError::Busy(m) if m.contains("no compile thread")), "{e:?}");
        let e = pool.compile(&g, &Format::Regex("b".into())).await.err().unwrap();
        assert!(matches!(&e, FormatError::Busy(m) if m.contains("retry later")), "{e:?}");
    }
}
