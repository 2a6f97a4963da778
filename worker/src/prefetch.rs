//! The copy side of a stage: streamed layer groups go from the loader's shm slots into the
//! backend's streaming buffers in the stage's cyclic layer order.
//!
//! With prefetch on, one copy thread lives as long as the stage and runs ahead across step
//! boundaries, bounded by the streaming buffers: the first groups of the next step cross the link
//! while this step's last layers compute and while the coordinator samples. With prefetch off the
//! step fetches each group itself when it reaches it (transfer, then compute: the baseline).

use crate::error::{Error, Result};
use crate::stage::LayerTiming;
use crate::stream::LoaderLink;
use crate::weights::LayerWeights;
use layerstream_kernels::Backend;
use layerstream_model::layout::layer_file;
use layerstream_model::{ModelConfig, Store};
use layerstream_telemetry::TraceParent;
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;
use tracing::{info_span, Span};

/// What loading a layer file onto a device needs.
#[derive(Clone)]
pub struct LayerSource<B: Backend> {
    pub(crate) backend: B,
    pub(crate) cfg: ModelConfig,
    pub(crate) store: Store,
}

impl<B: Backend> LayerSource<B> {
    /// Copies layer `layer` from its loader slot (registered with the device once) to the device in
    /// one transfer: into a streaming buffer (`streamed`) or its own allocation. Returns the weights,
    /// the bytes copied and the device-timed copy milliseconds where the backend measures them.
    pub fn load_layer(
        &self,
        link: &mut LoaderLink,
        layer: u32,
        span: &Span,
        streamed: bool,
    ) -> Result<(LayerWeights<B>, u64, Option<f64>)> {
        let b = &self.backend;
        let name = layer_file(layer as usize);
        if streamed && b.maps_host() {
            // Computed where the loader put it: the slot stays pinned while the weights live.
            let (entry, pinned) = link.pin_file(layer, &self.store.manifest, &name, span)?;
            let pinned: Arc<dyn layerstream_kernels::MappedBytes> = Arc::new(pinned);
            if let Some(blob) = b.map_blob(pinned.clone()) {
                let w = LayerWeights::from_blob(b, &self.cfg, &entry, &blob, pinned.bytes())?;
                return Ok((w, entry.size, None));
            }
        }
        let (w, ms, size) =
            link.with_file(layer, &self.store.manifest, &name, span, |entry, region, bytes| {
                if !streamed && self.store.verify {
                    // Resident weights are checked once more as they are taken in (the loader checks
                    // every read from disk; this also covers a slot changed since).
                    layerstream_model::store::check_bytes(
                        &self.store.dir.join(&name),
                        entry,
                        bytes,
                    )?;
                }
                b.register_host(region)?;
                let (blob, ms) = b.upload_blob(bytes, streamed)?;
                Ok((LayerWeights::from_blob(b, &self.cfg, entry, &blob, bytes)?, ms, entry.size))
            })?;
        Ok((w, size, ms))
    }
}

/// The step now running (or the last one to run): spans the copy thread makes join its trace.
#[derive(Clone, Default)]
pub struct StepMark {
    pub(crate) number: u64,
    pub(crate) parent: TraceParent,
}

/// One streamed layer on the device. `span` is its `layer` span, opened when its copy began.
pub struct Arrived<B: Backend> {
    pub(crate) layer: u32,
    pub(crate) weights: LayerWeights<B>,
    pub(crate) span: Span,
    pub(crate) timing: LayerTiming,
}

/// A streamed group after its transfer; `step` is the step that was running when its copy began.
pub struct Group<B: Backend> {
    pub(crate) step: u64,
    pub(crate) layers: Vec<Arrived<B>>,
}

/// Copies group `index` of `groups`; its spans join the trace of the step in `mark`.
fn fetch_group<B: Backend>(
    src: &LayerSource<B>,
    link: &mut LoaderLink,
    groups: &[Vec<u32>],
    index: usize,
    mark: &Mutex<StepMark>,
) -> Result<Group<B>> {
    let m = mark.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut layers = Vec::with_capacity(groups[index].len());
    for &l in &groups[index] {
        let span = info_span!(parent: None, "layer", otel.name = format!("layer {l}"), layer = l as i64, resident = false, next_step = tracing::field::Empty);
        m.parent.adopt(&span);
        let h2d = info_span!(parent: &span, "h2d", layer = l as i64, bytes = tracing::field::Empty, gbps = tracing::field::Empty, device_ms = tracing::field::Empty, error = tracing::field::Empty);
        // The transfer: slot → device in one copy (CUDA: event-timed on the copy stream; CPU: into
        // the weight storage, timed from acquire to usable weights).
        let t0 = Instant::now();
        // A copy that fails (the loader gone at shutdown, a corrupt file) says so in its span.
        let (weights, bytes, dev_ms) =
            h2d.in_scope(|| src.load_layer(link, l, &h2d, true)).inspect_err(|e| {
                h2d.record("error", tracing::field::display(e));
            })?;
        let paced = pace(bytes, t0);
        let transfer_ms = dev_ms.map_or(t0.elapsed().as_secs_f64() * 1e3, |ms| ms.max(paced));
        h2d.record("bytes", bytes as i64);
        h2d.record("gbps", bytes as f64 / (transfer_ms / 1e3).max(1e-9) / 1e9);
        if let Some(ms) = dev_ms {
            h2d.record("device_ms", ms);
        }
        drop(h2d);
        layers.push(Arrived {
            layer: l,
            weights,
            span,
            timing: LayerTiming { layer: l, bytes, transfer_ms, ..Default::default() },
        });
    }
    Ok(Group { step: m.number, layers })
}

/// `--link-gbps` as f64 bits (0: off).
static LINK_GBPS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Paces every streamed copy of this process to `gbps` GB/s (a simulated slower link).
pub fn set_link_gbps(gbps: f64) -> std::result::Result<(), String> {
    if !(gbps > 0.0 && gbps.is_finite()) {
        return Err(format!("must be a positive number of GB/s, got {gbps}"));
    }
    LINK_GBPS.store(gbps.to_bits(), std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// Under `--link-gbps`, waits until a copy of `bytes` begun at `t0` has taken as long as that link
/// would take; returns the copy's milliseconds so paced (0 when off).
fn pace(bytes: u64, t0: Instant) -> f64 {
    let gbps = f64::from_bits(LINK_GBPS.load(std::sync::atomic::Ordering::Relaxed));
    if gbps <= 0.0 {
        return 0.0;
    }
    let want = std::time::Duration::from_secs_f64(bytes as f64 / (gbps * 1e9));
    if let Some(rest) = want.checked_sub(t0.elapsed()) {
        std::thread::sleep(rest);
    }
    t0.elapsed().as_secs_f64() * 1e3
}

fn copy_thread_lost() -> Error {
    Error::Stage("the copy thread panicked; the stage must be reloaded".into())
}

enum Mode<B: Backend> {
    /// Prefetch off: the step fetches each group when it needs it.
    Inline(Box<LoaderLink>),
    /// Prefetch on: a copy thread runs ahead; it hands the link back when it ends.
    /// Each message is a group index and its copy (or the error that ended the thread).
    Ahead { rx: Receiver<(usize, Result<Group<B>>)>, thread: JoinHandle<LoaderLink> },
    /// The copy thread died and took the link with it.
    Lost,
}

/// Delivers a stage's streamed groups, in order, to its steps.
pub struct Fetcher<B: Backend> {
    src: LayerSource<B>,
    groups: Arc<Vec<Vec<u32>>>,
    mark: Arc<Mutex<StepMark>>,
    /// Groups the copy thread may hold finished beyond the one it hands over next (prefetch on).
    queue: Option<usize>,
    mode: Mode<B>,
}

impl<B: Backend + 'static> Fetcher<B> {
    /// Starts delivering `groups` from the first; `queue` = Some(extra groups buffered ahead) runs a
    /// copy thread, None fetches inline.
    pub fn new(
        src: LayerSource<B>,
        groups: Vec<Vec<u32>>,
        link: LoaderLink,
        queue: Option<usize>,
        mark: StepMark,
    ) -> Self {
        let mut f = Fetcher {
            src,
            groups: Arc::new(groups),
            mark: Arc::new(Mutex::new(mark)),
            queue,
            mode: Mode::Inline(Box::new(link)),
        };
        if let (Some(q), false) = (queue, f.groups.is_empty()) {
            let Mode::Inline(link) = std::mem::replace(&mut f.mode, Mode::Lost) else {
                unreachable!("just built inline")
            };
            f.mode = f.spawn(*link, 0, q);
        }
        f
    }

    fn spawn(&self, mut link: LoaderLink, start: usize, queue: usize) -> Mode<B> {
        let (tx, rx) = sync_channel(queue);
        let (src, groups, mark) = (self.src.clone(), self.groups.clone(), self.mark.clone());
        let thread = std::thread::Builder::new()
            .name("layerstream-copy".into())
            .spawn(move || {
                let mut i = start;
                loop {
                    let g = fetch_group(&src, &mut link, &groups, i, &mark);
                    let failed = g.is_err();
                    // A closed channel means the stage is going away; an error ends the thread so
                    // the next step restarts it where that step begins.
                    if tx.send((i, g)).is_err() || failed {
                        return link;
                    }
                    i = (i + 1) % groups.len();
                }
            })
            .expect("spawning the copy thread");
        Mode::Ahead { rx, thread }
    }

    /// Marks the start of the next step (one past the last marked) under `span`: copies begun from
    /// now on are traced in it. Returns its number.
    pub fn begin_step(&self, span: &Span) -> u64 {
        let mut mark = self.mark.lock().unwrap_or_else(|e| e.into_inner());
        *mark = StepMark { number: mark.number + 1, parent: TraceParent::of(span) };
        mark.number
    }

    /// Group `index`, waiting for its copy. Groups copied for an earlier step that ended early are
    /// dropped; a copy thread that ended on an error is restarted at `index`.
    pub fn next(&mut self, index: usize) -> Result<Group<B>> {
        let n = self.groups.len();
        if index >= n {
            return Err(Error::Stage(format!(
                "streamed group {index} does not exist ({n} groups)"
            )));
        }
        // At most one lap of stale groups, one restart, then the wanted group.
        for _ in 0..n + 2 {
            match &mut self.mode {
                Mode::Inline(link) => {
                    return fetch_group(&self.src, link, &self.groups, index, &self.mark)
                }
                Mode::Lost => return Err(copy_thread_lost()),
                Mode::Ahead { rx, .. } => match rx.recv() {
                    Ok((i, r)) if i == index => return r,
                    // Copied (or failed) for an earlier step that ended early; after a failure the
                    // thread has ended, and the next receive restarts it.
                    Ok(_stale) => continue,
                    Err(_) => {
                        // The thread has ended (after an error it reported): start it again here.
                        let link = self.stop().ok_or_else(copy_thread_lost)?;
                        self.mode = self.spawn(link, index, self.queue.unwrap_or(0));
                    }
                },
            }
        }
        Err(Error::Stage(format!("streamed group {index} never arrived from the copy thread")))
    }
}

impl<B: Backend> Fetcher<B> {
    /// Stops the copy thread (dropping what it buffered) and returns the loader link.
    pub fn stop(&mut self) -> Option<LoaderLink> {
        match std::mem::replace(&mut self.mode, Mode::Lost) {
            Mode::Inline(link) => Some(*link),
            Mode::Lost => None,
            Mode::Ahead { rx, thread } => {
                // Dropping the receiver frees the buffered groups (and their streaming buffers), so a
                // thread waiting for a buffer or to hand a group over returns.
                drop(rx);
                thread.join().ok()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use layerstream_kernels::CpuBackend;
    use layerstream_loader::{Daemon, LoaderService};
    use layerstream_rpc::v1::loader_server::LoaderServer;

    /// A loader daemon serving `store` on a Unix socket in `rt`, and a link to it.
    fn loader(rt: &tokio::runtime::Runtime, store: &Store, dir: &std::path::Path) -> LoaderLink {
        let ns = format!("prefetch-test-{}", std::process::id());
        let daemon = Arc::new(
            Daemon::new(store.clone(), &ns, 3, store.manifest.max_unit_bytes() as usize, 1)
                .unwrap(),
        );
        let sock = dir.join("loader.sock");
        let listener = rt.block_on(async { tokio::net::UnixListener::bind(&sock) }).unwrap();
        let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
        let (health, _) =
            rt.block_on(layerstream_rpc::transport::health::<LoaderServer<LoaderService>>());
        rt.spawn(
            tonic::transport::Server::builder()
                .add_service(LoaderServer::new(LoaderService::new(daemon, health)))
                .serve_with_incoming(incoming),
        );
        let channel = rt.block_on(layerstream_rpc::transport::connect_uds(&sock)).unwrap();
        let channel = layerstream_rpc::auth::Bearer::default().wrap(channel);
        LoaderLink::new(channel, "w0".into(), rt.handle().clone())
    }

    /// Real loader, real shm slots, CPU backend: groups arrive in order and cycle; a copy that fails
    /// (a layer file missing on disk) reaches the step as an error naming the file, and the next
    /// request restarts the copy thread there; groups copied, or failed, ahead for a step that ended
    /// early are skipped.
    #[test]
    fn copy_thread_runs_ahead_restarts_after_an_error_and_skips_stale_groups() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("store");
        layerstream_model::synth::synth("tiny", layerstream_model::DType::Q8_0, Some(4), 7, &dir)
            .unwrap();
        let store = Store::open(&dir).unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let mut link = loader(&rt, &store, tmp.path());
        link.set_order(vec![0, 1, 2, 3]).unwrap();
        // Layer 2 is missing before anything is read, so neither a prefetch nor a cache can hide it.
        let f2 = dir.join(layer_file(2));
        let aside = tmp.path().join("aside.bin");
        std::fs::rename(&f2, &aside).unwrap();
        let src = LayerSource {
            backend: CpuBackend::default(),
            cfg: store.manifest.config.clone(),
            store: store.clone(),
        };
        let groups = vec![vec![0], vec![1], vec![2], vec![3]];
        let mut f = Fetcher::new(src, groups, link, Some(0), StepMark::default());
        for i in 0..2 {
            let g = f.next(i).unwrap();
            assert_eq!((g.layers.len(), g.layers[0].layer), (1, i as u32));
            assert_eq!(g.layers[0].timing.bytes, store.manifest.file(&layer_file(i)).unwrap().size);
        }
        let err = f.next(2).err().expect("layer 2's file is missing").to_string();
        assert!(err.contains("layer_002") || err.contains(&layer_file(2)), "{err}");
        // Layer 2 back, layer 3 gone: the restarted thread delivers group 2, then fails on group 3
        // while nobody waits for it.
        std::fs::rename(&aside, &f2).unwrap();
        let f3 = dir.join(layer_file(3));
        std::fs::rename(&f3, &aside).unwrap();
        let g = f.next(2).expect("the copy thread restarts at group 2");
        assert_eq!(g.layers[0].layer, 2);
        drop(g);
        // A step that starts over wants group 0: the failure of group 3 belonged to the step that
        // ended, so the thread is restarted at group 0 instead of failing this step.
        let g = f.next(0).unwrap();
        assert_eq!(g.layers[0].layer, 0);
        assert!(f.next(9).is_err(), "no group 9");
        drop(g);
        std::fs::rename(&aside, &f3).unwrap();
        let link = f.stop().expect("the link comes back from the copy thread");
        assert!(link.regions().count() > 0, "slot mappings were opened");
    }
}
