//! The loader daemon's state and gRPC service: acquire/release of layers in shm slots, cyclic
//! prefetch per worker, traced reads.

use crate::pool::{Acquire, Pool};
use crate::read::read_into;
use crate::{Error, Result};
use layerstream_model::layout::{layer_file, unit_file, unit_label};
use layerstream_model::Store;
use layerstream_rpc::v1::loader_server::Loader;
use layerstream_rpc::v1::*;
use layerstream_shm::{slot_name, ShmRegion};
use layerstream_telemetry::adopt_parent;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};
use tonic::{Request, Response, Status};
use tracing::{info, info_span, warn, Instrument};

/// A file's identity and version as `stat` gives it: device, inode, size and modification time
/// (ns). A file rewritten or replaced gets another.
pub(crate) type Stamp = (u64, u64, u64, i128);

/// `path`'s stamp; None where it cannot be read (the read then fails on its own).
fn stamp(path: &std::path::Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((m.dev(), m.ino(), m.size(), m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128))
}

/// Whether a read of a file whose stamp is now `now` must be checked against the manifest's
/// checksums: always with `every_read`; else unless a read of the very same file (`passed`: its
/// stamp when a read last passed) was checked already. A file's corruption at rest shows at its
/// first read and a file changed since is checked again; each later pass's reads of the same
/// bytes skip the xxh3 that took the compute's cores (0.13 s of CPU a GB).
pub(crate) fn must_check(every_read: bool, passed: Option<Stamp>, now: Option<Stamp>) -> bool {
    every_read || now.is_none() || passed != now
}

/// A worker's cyclic layer order and where in it the worker last read.
struct Cycle {
    order: Vec<u32>,
    cursor: usize,
}

/// Everything the daemon owns. Dropping it unmaps and unlinks every slot.
pub struct Daemon {
    pub(crate) store: Store,
    pub(crate) slots: Vec<ShmRegion>,
    pub(crate) slot_size: usize,
    pub(crate) depth: usize,
    pub(crate) direct: bool,
    pool: Mutex<Pool>,
    changed: tokio::sync::Notify,
    orders: Mutex<HashMap<String, Cycle>>,
    /// Acquires served by a slot already holding the layer (hits, prefetched ones included) and
    /// layer files read from disk (misses: on demand or ahead), since start.
    hits: AtomicU64,
    misses: AtomicU64,
    /// Bytes read from disk and the nanoseconds the reads took (the disk tier's figures).
    disk_bytes: AtomicU64,
    disk_ns: AtomicU64,
    /// Wall time with at least one read in flight (the disk's rate with reads overlapped).
    busy: Mutex<crate::pool::Busy>,
    /// Check every read from disk (`--verify-every-read`), not only a file's first.
    pub(crate) verify_every_read: bool,
    /// Each unit's file as it was when a read of it last passed its check (`stamp`): a later read
    /// of the same file unchanged is not checked again (`must_check`).
    checked: Mutex<HashMap<u32, Stamp>>,
    /// Reads checked against the manifest's checksums, since start.
    checks: AtomicU64,
    /// Set when a panic interrupted an update of the pool: its pins may be wrong, so the daemon
    /// reports NOT_SERVING (and is restarted) instead of handing out slots it cannot vouch for.
    broken: AtomicBool,
    broken_reported: AtomicBool,
}

/// `n` slots under a fresh random instance id; a name found taken (someone created it first) is
/// retried under a new instance, never fatal.
fn create_slots(ns: &str, n: usize, slot_size: usize) -> crate::Result<Vec<ShmRegion>> {
    let mut tries = 0;
    'instance: loop {
        let instance = layerstream_shm::random_tag();
        let mut slots = Vec::with_capacity(n);
        for i in 0..n {
            let name = slot_name(ns, &instance, i);
            match ShmRegion::create(&name, slot_size) {
                Ok(r) => slots.push(r),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && tries < 8 => {
                    tries += 1;
                    warn!(%name, "shared-memory name already taken; retrying under a new instance id");
                    continue 'instance; // the slots made so far unlink as they drop
                }
                Err(source) => return Err(crate::Error::Shm { name, bytes: slot_size, source }),
            }
        }
        return Ok(slots);
    }
}

impl Daemon {
    /// Creates `n` slots of `slot_size` bytes in namespace `ns` (stale ones removed first).
    pub fn new(
        store: Store,
        ns: &str,
        n: usize,
        slot_size: usize,
        depth: usize,
    ) -> crate::Result<Daemon> {
        let removed = layerstream_shm::remove_stale(ns);
        if removed > 0 {
            warn!(removed, ns, "removed stale shared-memory regions of a previous instance");
        }
        let slot_size = slot_size.div_ceil(4096) * 4096;
        crate::pool::check_shm_room(n, slot_size, layerstream_shm::free_bytes())?;
        let slots = create_slots(ns, n, slot_size)?;
        let first = store.dir.join(layer_file(0));
        let direct = crate::read::direct_supported(&first);
        if !direct {
            warn!(store = %store.dir.display(), "O_DIRECT unsupported on this filesystem; using buffered reads");
        }
        Ok(Daemon {
            store,
            slots,
            slot_size,
            depth,
            direct,
            pool: Mutex::new(Pool::new(n)),
            changed: tokio::sync::Notify::new(),
            orders: Mutex::new(HashMap::new()),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            disk_bytes: AtomicU64::new(0),
            disk_ns: AtomicU64::new(0),
            busy: Mutex::new(crate::pool::Busy::default()),
            verify_every_read: false,
            checked: Mutex::new(HashMap::new()),
            checks: AtomicU64::new(0),
            broken: AtomicBool::new(false),
            broken_reported: AtomicBool::new(false),
        })
    }

    /// The slot pool, locked. A poisoned lock (a panic mid-update) is taken over and marks the
    /// daemon broken instead of failing every later call with a poisoned lock.
    fn pool(&self) -> MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|p| {
            self.broken.store(true, Ordering::SeqCst);
            self.pool.clear_poison();
            p.into_inner()
        })
    }

    /// Files whose reads passed their check (plain data: a poisoned lock is taken over).
    fn checked(&self) -> MutexGuard<'_, HashMap<u32, Stamp>> {
        self.checked.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The disk's busy clock (plain data: a poisoned lock is taken over).
    fn busy(&self) -> MutexGuard<'_, crate::pool::Busy> {
        self.busy.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Workers' cyclic layer orders (plain data: a poisoned lock is taken over).
    fn orders(&self) -> MutexGuard<'_, HashMap<String, Cycle>> {
        self.orders.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The slot pool's eviction order, as of now: for a layer, reads until some worker needs it
    /// again, counted from where each worker last read; `usize::MAX` for a layer in no worker's
    /// order (never needed: evicted first).
    fn next_uses(&self) -> impl Fn(u32) -> usize {
        let mut next = HashMap::new();
        for c in self.orders().values() {
            let n = c.order.len();
            for (i, &l) in c.order.iter().enumerate() {
                let d = (i + n - c.cursor) % n;
                next.entry(l).and_modify(|v: &mut usize| *v = (*v).min(d)).or_insert(d);
            }
        }
        move |l| next.get(&l).copied().unwrap_or(usize::MAX)
    }

    /// Notes that `worker` read `layer` (its position in the worker's cycle).
    fn advance(&self, worker: &str, layer: u32) {
        if let Some(c) = self.orders().get_mut(worker) {
            if let Some(i) = c.order.iter().position(|&l| l == layer) {
                c.cursor = i;
            }
        }
    }

    /// Whether a panic left the pool in a state the daemon cannot vouch for.
    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::SeqCst)
    }

    /// The store file of unit `unit` (a layer, or an expert: `layout::unit_file`).
    fn unit_name(&self, unit: u32) -> Result<String> {
        unit_file(&self.store.manifest.config, unit)
            .ok_or_else(|| Error::NoUnit(format!("layer or expert {unit}")))
    }

    fn layer_len(&self, layer: u32) -> Result<u64> {
        let name = self.unit_name(layer)?;
        let f = self
            .store
            .manifest
            .file(&name)
            .ok_or_else(|| Error::NoUnit(format!("layer {layer}")))?;
        if f.size as usize > self.slot_size {
            return Err(Error::Precondition(format!(
                "{name} is {} bytes, slots hold {}",
                f.size, self.slot_size
            )));
        }
        Ok(f.size)
    }

    /// Reads `layer` into `slot` on a blocking thread, traced as `read layer N`.
    async fn load(self: &Arc<Self>, slot: usize, layer: u32) -> Result<f64> {
        let me = self.clone();
        let span = info_span!(
            "read",
            otel.name = format!("read {}", unit_label(&self.store.manifest.config, layer)),
            layer = layer as i64,
            bytes = tracing::field::Empty,
            gbps = tracing::field::Empty,
            cache = "miss"
        );
        let s2 = span.clone();
        let res = tokio::task::spawn_blocking(move || {
            let _e = s2.enter();
            let name = me.unit_name(layer)?;
            let path = me.store.dir.join(&name);
            // The file's stamp before the read, where reads are checked at all.
            let before = if me.store.verify { stamp(&path) } else { None };
            let t = Instant::now();
            me.busy().begin(t);
            // SAFETY: the pool marked this slot Loading: nobody holds a pin and no other load targets it.
            let dst = unsafe { me.slots[slot].bytes_mut() };
            let r = read_into(&path, dst, me.direct).or_else(|e| {
                if me.direct {
                    read_into(&path, dst, false)
                } else {
                    Err(e)
                }
            });
            let t1 = Instant::now();
            me.busy().end(t1);
            let ms = (t1 - t).as_secs_f64() * 1e3;
            let n = r.map_err(|e| Error::Internal(format!("reading {}: {e}", path.display())))?;
            me.disk_bytes.fetch_add(n as u64, Ordering::Relaxed);
            me.disk_ns.fetch_add((ms * 1e6) as u64, Ordering::Relaxed);
            s2.record("bytes", n as i64);
            s2.record("gbps", n as f64 / (ms / 1e3).max(1e-9) / 1e9);
            let passed = me.checked().get(&layer).copied();
            if me.store.verify && must_check(me.verify_every_read, passed, before) {
                // Checked where the bytes enter memory: a slot that fails is never handed out.
                me.checks.fetch_add(1, Ordering::Relaxed);
                let entry = me
                    .store
                    .manifest
                    .file(&name)
                    .ok_or_else(|| Error::NoUnit(format!("layer {layer}")))?;
                let _v = info_span!("verify", bytes = n as i64).entered();
                layerstream_model::store::check_bytes(&path, entry, &dst[..n]).map_err(|e| {
                    warn!(layer, error = %e, "corrupt layer file: refusing to serve it");
                    Error::Corrupt(e.to_string())
                })?;
                if let Some(b) = before.filter(|b| stamp(&path) == Some(*b)) {
                    me.checked().insert(layer, b); // unchanged while it was read and checked
                }
            }
            Ok(ms)
        })
        .instrument(span)
        .await
        .map_err(|e| Error::Internal(format!("read task: {e}")))?;
        let ok = res.is_ok();
        if ok {
            self.misses.fetch_add(1, Ordering::Relaxed);
        }
        self.pool().loaded(slot, ok);
        self.changed.notify_waiters();
        res
    }

    /// Starts background reads of the next `depth` layers after `layer` in `worker`'s order.
    fn prefetch_after(self: &Arc<Self>, worker: &str, layer: u32) {
        let next: Vec<u32> = {
            let orders = self.orders();
            let Some(order) = orders.get(worker).map(|c| &c.order) else { return };
            let Some(pos) = order.iter().position(|&l| l == layer) else { return };
            (1..=self.depth.min(order.len().saturating_sub(1)))
                .map(|d| order[(pos + d) % order.len()])
                .collect()
        };
        let next_use = self.next_uses();
        for &l in &next {
            let slot = self.pool().start_prefetch(l, &next, &next_use);
            if let Some(slot) = slot {
                let me = self.clone();
                // The read is traced under the acquire that triggered it.
                tokio::spawn(
                    async move {
                        if let Err(e) = me.load(slot, l).await {
                            warn!(layer = l, error = %e, "prefetch failed");
                        }
                    }
                    .instrument(tracing::Span::current()),
                );
            }
        }
    }

    /// Unpins `layer` for `worker`, then starts the read-ahead past the layer the worker last
    /// acquired where the slot freed allows it: the read-ahead does not wait for the worker's next
    /// acquire to use a slot.
    pub fn release(self: &Arc<Self>, worker: &str, layer: u32) -> Result<()> {
        if !self.pool().release(layer) {
            return Err(Error::Precondition(format!("layer {layer} is not pinned")));
        }
        self.changed.notify_waiters();
        let last = self.orders().get(worker).and_then(|c| c.order.get(c.cursor).copied());
        if let Some(at) = last {
            self.prefetch_after(worker, at);
        }
        Ok(())
    }

    /// Pins `layer` in a slot, reading it first if needed. The read-ahead past it starts as soon as
    /// the layer has a slot (being read or ready), not once it is ready: while a worker waits on
    /// one read, the next `depth` are in flight beside it.
    pub async fn acquire(self: &Arc<Self>, worker: &str, layer: u32) -> Result<AcquireResponse> {
        let len = self.layer_len(layer)?;
        self.advance(worker, layer);
        let mut read_ms = 0.0;
        let mut missed = false;
        loop {
            let notified = self.changed.notified();
            let next_use = self.next_uses();
            let decision = self.pool().acquire(layer, &next_use);
            match decision {
                Acquire::Hit(slot) => {
                    if !missed {
                        self.hits.fetch_add(1, Ordering::Relaxed);
                    }
                    self.prefetch_after(worker, layer);
                    if !missed {
                        info_span!(
                            "read",
                            otel.name =
                                format!("read {}", unit_label(&self.store.manifest.config, layer)),
                            layer = layer as i64,
                            bytes = len as i64,
                            cache = "hit"
                        )
                        .in_scope(|| {});
                    }
                    return Ok(AcquireResponse {
                        slot: slot as u32,
                        shm_name: self.slots[slot].name.clone(),
                        len,
                        hit: !missed,
                        read_ms,
                        order_known: self.orders().contains_key(worker),
                    });
                }
                Acquire::Load(slot) => {
                    missed = true;
                    self.prefetch_after(worker, layer);
                    read_ms = self.load(slot, layer).await?;
                }
                Acquire::Wait => {
                    self.prefetch_after(worker, layer);
                    let _ = tokio::time::timeout(Duration::from_millis(50), notified).await;
                }
                Acquire::Full => {
                    let _ = tokio::time::timeout(Duration::from_millis(50), notified).await;
                }
            }
        }
    }
}

/// The gRPC face of the daemon.
pub struct LoaderService {
    pub(crate) daemon: Arc<Daemon>,
    pub(crate) health: layerstream_rpc::transport::Health,
}

impl LoaderService {
    /// The gRPC face of `daemon`, reporting NOT_SERVING on `health` once the pool is broken.
    pub fn new(daemon: Arc<Daemon>, health: layerstream_rpc::transport::Health) -> Self {
        LoaderService { daemon, health }
    }

    /// Refuses calls once the pool is broken, and reports NOT_SERVING the first time.
    async fn check(&self) -> Result<()> {
        if !self.daemon.is_broken() {
            return Ok(());
        }
        let why = "a panic interrupted an update of the slot pool";
        if !self.daemon.broken_reported.swap(true, Ordering::SeqCst) {
            self.health.not_serving(why).await;
        }
        Err(Error::Broken(why.into()))
    }
}

#[tonic::async_trait]
impl Loader for LoaderService {
    async fn describe(
        &self,
        _r: Request<DescribeRequest>,
    ) -> std::result::Result<Response<DescribeResponse>, Status> {
        self.check().await?;
        let d = &self.daemon;
        Ok(Response::new(DescribeResponse {
            store: d.store.dir.display().to_string(),
            slots: d.slots.iter().map(|s| s.name.clone()).collect(),
            slot_size: d.slot_size as u64,
            prefetch_depth: d.depth as u32,
            direct_io: d.direct,
            pinned: {
                let p = d.pool();
                (0..p.len()).map(|i| p.pins(i)).sum()
            },
            hits: d.hits.load(Ordering::Relaxed),
            misses: d.misses.load(Ordering::Relaxed),
            disk_bytes: d.disk_bytes.load(Ordering::Relaxed),
            disk_seconds: d.disk_ns.load(Ordering::Relaxed) as f64 / 1e9,
            disk_busy_seconds: d.busy().seconds(Instant::now()),
        }))
    }

    async fn set_order(
        &self,
        r: Request<SetOrderRequest>,
    ) -> std::result::Result<Response<SetOrderResponse>, Status> {
        self.check().await?;
        let r = r.into_inner();
        info!(worker = %r.worker, layers = r.layers.len(), "worker layer order set");
        self.daemon.orders().insert(r.worker, Cycle { order: r.layers, cursor: 0 });
        Ok(Response::new(SetOrderResponse {}))
    }

    async fn acquire(
        &self,
        r: Request<AcquireRequest>,
    ) -> std::result::Result<Response<AcquireResponse>, Status> {
        self.check().await?;
        let span = info_span!("acquire", layer = r.get_ref().layer as i64);
        adopt_parent(&span, r.metadata());
        let r = r.into_inner();
        Ok(Response::new(self.daemon.acquire(&r.worker, r.layer).instrument(span).await?))
    }

    async fn release(
        &self,
        r: Request<SlotRelease>,
    ) -> std::result::Result<Response<SlotReleaseResponse>, Status> {
        self.check().await?;
        let r = r.into_inner();
        self.daemon.release(&r.worker, r.layer)?;
        Ok(Response::new(SlotReleaseResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use layerstream_model::DType;

    /// Waits (up to 10 s) until `layer` is ready in a slot of `d`.
    async fn ready(d: &Daemon, layer: u32) -> bool {
        for _ in 0..1000 {
            let ready = {
                let p = d.pool();
                p.find(layer).is_some_and(|i| p.is_ready(i))
            };
            if ready {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    /// The check's decision: the first read, a changed file (any part of its stamp), an unknown
    /// stamp and `--verify-every-read` check; the same file read again does not.
    #[test]
    fn a_read_is_checked_unless_the_same_file_passed_before() {
        let a: Stamp = (1, 7, 4096, 1_700_000_000_000_000_000);
        assert!(must_check(false, None, Some(a)), "first read");
        assert!(!must_check(false, Some(a), Some(a)), "the same file again");
        for changed in [(2, 7, 4096, a.3), (1, 8, 4096, a.3), (1, 7, 4095, a.3), (1, 7, 4096, 1)] {
            assert!(must_check(false, Some(a), Some(changed)), "{changed:?}");
        }
        assert!(must_check(false, Some(a), None), "no stamp: checked");
        assert!(must_check(true, Some(a), Some(a)), "--verify-every-read");
    }

    /// A daemon of `slots` slots over a fresh two-layer store in `dir`, no worker order (no
    /// read-ahead: only what is acquired is read).
    fn daemon(dir: &std::path::Path, slots: usize, every_read: bool) -> Arc<Daemon> {
        let dst = dir.join("s");
        layerstream_model::synth::synth("tiny", DType::Q4K, Some(2), 1, &dst).unwrap();
        let store = Store::open(&dst).unwrap();
        let size = store.manifest.max_unit_bytes() as usize;
        let ns = format!("lstest{}{}", std::process::id(), every_read as u8);
        let mut d = Daemon::new(store, &ns, slots, size, 2).unwrap();
        d.verify_every_read = every_read;
        Arc::new(d)
    }

    /// Acquires and releases `layer`; the error's text where the acquire fails.
    async fn take(d: &Arc<Daemon>, layer: u32) -> std::result::Result<(), String> {
        d.acquire("w", layer).await.map_err(|e| e.to_string())?;
        d.release("w", layer).map_err(|e| e.to_string())
    }

    /// One slot, so each acquire below reads its layer from disk: a file is checked at its first
    /// read, not again while it stays the same file, and again once rewritten (a flipped byte then
    /// fails the read, naming the tensor); `--verify-every-read` checks every read.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_file_is_checked_at_its_first_read_and_again_once_changed() {
        let dir = tempfile::tempdir().unwrap();
        let d = daemon(dir.path(), 1, false);
        for l in [0, 1, 0, 1, 0] {
            take(&d, l).await.unwrap();
        }
        let reads = d.misses.load(Ordering::Relaxed);
        assert_eq!(
            (reads, d.checks.load(Ordering::Relaxed)),
            (5, 2),
            "two files, each checked once"
        );
        let path = d.store.dir.join(layer_file(1));
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[4096 + 17] ^= 0x40;
        std::fs::write(&path, &bytes).unwrap();
        let later = std::time::SystemTime::now() + Duration::from_secs(5);
        std::fs::File::options().write(true).open(&path).unwrap().set_modified(later).unwrap();
        let e = take(&d, 1).await.unwrap_err();
        assert!(e.contains("checksum mismatch"), "{e}");
        take(&d, 0).await.unwrap();
        assert_eq!(d.checks.load(Ordering::Relaxed), 3, "the changed file only");

        let every = tempfile::tempdir().unwrap();
        let d = daemon(every.path(), 1, true);
        for l in [0, 1, 0] {
            take(&d, l).await.unwrap();
        }
        assert_eq!(d.checks.load(Ordering::Relaxed), 3, "--verify-every-read");
    }

    /// Three slots, two layers read ahead, a worker holding layers 0 and 1: no slot is left for
    /// layer 3 (2 is read ahead, needed sooner). Releasing layer 0 starts layer 3's read with no
    /// further acquire — before, a freed slot sat empty until the worker's next acquire, and a
    /// streamed pass had fewer reads in flight than the read-ahead depth promised.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_release_starts_the_read_ahead_it_made_room_for() {
        let dir = tempfile::tempdir().unwrap();
        let dst = dir.path().join("s");
        layerstream_model::synth::synth("tiny", DType::Q4K, Some(6), 1, &dst).unwrap();
        let store = Store::open(&dst).unwrap();
        let size = (0..6).map(|l| store.manifest.file(&layer_file(l)).unwrap().size).max();
        let ns = format!("lstest{}", std::process::id());
        let d = Arc::new(Daemon::new(store, &ns, 3, size.unwrap() as usize, 2).unwrap());
        d.orders().insert("w".into(), Cycle { order: (0..6).collect(), cursor: 0 });
        assert!(!d.acquire("w", 0).await.unwrap().hit, "a cold pool reads layer 0");
        assert!(ready(&d, 1).await && ready(&d, 2).await, "read ahead: 1 and 2");
        assert!(d.acquire("w", 1).await.unwrap().hit);
        assert!(d.pool().find(3).is_none(), "no slot for layer 3 while 0, 1 are pinned");
        d.release("w", 0).unwrap();
        assert!(ready(&d, 3).await, "the release made room and the read-ahead took it");
        assert!(d.release("w", 0).is_err(), "layer 0 is no longer pinned");
        assert_eq!(d.misses.load(Ordering::Relaxed), 4);
        // The disk's clocks: each read's own seconds, and the wall time a read was in flight —
        // no more than their sum (reads overlapped), above 0, and nothing left open.
        let (per_read, busy) =
            (d.disk_ns.load(Ordering::Relaxed) as f64 / 1e9, d.busy().seconds(Instant::now()));
        assert!(busy > 0.0 && busy <= per_read + 1e-6, "busy {busy} s, reads {per_read} s");
        assert_eq!(d.busy().seconds(Instant::now()), busy, "no read in flight");
    }
}
