//! The worker's side of the loader: acquire a layer's shm slot, hand its bytes to the copy, release
//! the slot — or, for a device that computes from host memory (the CPU), keep the slot pinned for
//! as long as the layer's weights live (`pin_file`: no second copy). Slot mappings are opened once
//! and reused (and registered with the device once).

use crate::error::{Error, Result};
use layerstream_rpc::auth::Authed;
use layerstream_rpc::v1::loader_client::LoaderClient;
use layerstream_rpc::v1::{AcquireRequest, SetOrderRequest, SlotRelease};
use layerstream_shm::ShmRegion;
use layerstream_telemetry::traced_request;
use std::collections::HashMap;
use std::sync::Arc;

/// A connection to the loader daemon plus the slot regions mapped so far.
pub struct LoaderLink {
    client: LoaderClient<Authed>,
    worker: String,
    /// The order last declared, sent again to a loader that no longer knows it (restarted).
    order: Vec<u32>,
    /// Shared with the pinned files computed from in place, which keep their mapping alive.
    regions: HashMap<String, Arc<ShmRegion>>,
    rt: tokio::runtime::Handle,
}

fn loader_err(what: &str, s: tonic::Status) -> Error {
    if s.code() == tonic::Code::DataLoss {
        return Error::Corrupt(s.message().to_owned());
    }
    Error::Loader { what: what.into(), msg: format!("{} ({:?})", s.message(), s.code()) }
}

impl LoaderLink {
    /// Wraps a channel to the loader; `worker` identifies this worker's prefetch order.
    pub fn new(channel: Authed, worker: String, rt: tokio::runtime::Handle) -> Self {
        LoaderLink {
            client: LoaderClient::new(channel),
            worker,
            order: Vec::new(),
            regions: HashMap::new(),
            rt,
        }
    }

    /// Another link to the same loader under the name `<worker>/<role>` (its own slot mappings and
    /// no cyclic order: the expert fetches of a mixture-of-experts stage).
    pub fn sibling(&self, role: &str) -> LoaderLink {
        LoaderLink {
            client: self.client.clone(),
            worker: format!("{}/{role}", self.worker),
            order: Vec::new(),
            regions: HashMap::new(),
            rt: self.rt.clone(),
        }
    }

    /// Declares the cyclic order in which this worker streams layers.
    pub fn set_order(&mut self, layers: Vec<u32>) -> Result<()> {
        self.order.clone_from(&layers);
        let req = SetOrderRequest { worker: self.worker.clone(), layers };
        let mut c = self.client.clone();
        self.rt.block_on(c.set_order(req)).map_err(|s| loader_err("set_order", s))?;
        Ok(())
    }

    /// Acquires layer `layer`'s slot under `span`'s trace context, hands `use_slot` the whole slot
    /// mapping and the layer's length (its bytes are `mapping[..len]`), then releases the slot.
    pub fn with_slot<R>(
        &mut self,
        layer: u32,
        span: &tracing::Span,
        use_slot: impl FnOnce(&[u8], usize) -> Result<R>,
    ) -> Result<R> {
        let (region, len) = self.acquire(layer, span)?;
        let out = use_slot(region.bytes(), len);
        // The copy is done: the release need not hold up the next layer's acquire and copy (a
        // round trip to the loader for every streamed layer).
        release_in_background(self.client.clone(), self.worker.clone(), layer, &self.rt);
        out
    }

    /// Acquires file `name` (unit `unit`) and keeps its slot pinned until the returned value drops
    /// (its release then goes to the loader in the background): a device that computes from host
    /// memory reads the layer where the loader put it. The length is checked against the manifest.
    pub fn pin_file(
        &mut self,
        unit: u32,
        manifest: &layerstream_model::Manifest,
        name: &str,
        span: &tracing::Span,
    ) -> Result<(layerstream_model::FileEntry, PinnedFile)> {
        let entry = manifest
            .file(name)
            .ok_or_else(|| Error::Weights(format!("no {name} in the manifest")))?
            .clone();
        let (region, len) = self.acquire(unit, span)?;
        let pinned = PinnedFile {
            region,
            len,
            release: Some((self.client.clone(), self.worker.clone(), unit, self.rt.clone())),
        };
        if len as u64 != entry.size {
            return Err(Error::Weights(format!(
                "{name}: loader delivered {len} bytes, manifest says {}",
                entry.size
            )));
        }
        Ok((entry, pinned))
    }

    /// Acquires layer `layer`'s slot (pinned until released) and maps it once: the mapping and the
    /// layer's length.
    fn acquire(&mut self, layer: u32, span: &tracing::Span) -> Result<(Arc<ShmRegion>, usize)> {
        let mut c = self.client.clone();
        let req = traced_request(
            span,
            AcquireRequest { worker: self.worker.clone(), layer, prefetch_next: true },
        );
        let rpc = tracing::info_span!(parent: span, "acquire rpc", layer = layer as i64);
        let a = rpc
            .in_scope(|| self.rt.block_on(c.acquire(req)))
            .map_err(|s| loader_err("acquire", s))?
            .into_inner();
        if !a.order_known && !self.order.is_empty() {
            // A restarted daemon: declare the order again so its prefetching resumes.
            self.set_order(self.order.clone())?;
        }
        if !self.regions.contains_key(&a.shm_name) {
            let r = ShmRegion::open_readonly(&a.shm_name)
                .map_err(|e| Error::Stage(format!("mapping /dev/shm/{}: {e}", a.shm_name)))?;
            self.regions.insert(a.shm_name.clone(), Arc::new(r));
        }
        let region = self.regions[&a.shm_name].clone();
        let len = a.len as usize;
        if len > region.len() {
            let rel = SlotRelease { worker: self.worker.clone(), layer };
            let _ = self.rt.block_on(c.release(rel));
            return Err(Error::Stage(format!(
                "loader slot {} holds {} bytes, layer {layer} claims {len}",
                a.shm_name,
                region.len()
            )));
        }
        Ok((region, len))
    }

    /// `with_slot` for unit `unit` whose store file is `name`: the manifest entry is looked up and
    /// the slot's length checked against it before `use_slot` sees the entry, the whole mapping and
    /// the file's bytes.
    pub fn with_file<R>(
        &mut self,
        unit: u32,
        manifest: &layerstream_model::Manifest,
        name: &str,
        span: &tracing::Span,
        use_slot: impl FnOnce(&layerstream_model::FileEntry, &[u8], &[u8]) -> Result<R>,
    ) -> Result<R> {
        let entry = manifest
            .file(name)
            .ok_or_else(|| Error::Weights(format!("no {name} in the manifest")))?;
        self.with_slot(unit, span, |region, len| {
            if len as u64 != entry.size {
                return Err(Error::Weights(format!(
                    "{name}: loader delivered {len} bytes, manifest says {}",
                    entry.size
                )));
            }
            use_slot(entry, region, &region[..len])
        })
    }

    /// Every slot mapping opened so far.
    pub fn regions(&self) -> impl Iterator<Item = &[u8]> {
        self.regions.values().map(|r| r.bytes())
    }
}

/// A layer file in a loader slot kept pinned while this lives: its mapping stays (shared with the
/// link), the loader never rewrites the slot, and dropping it releases the pin in the background.
pub struct PinnedFile {
    region: Arc<ShmRegion>,
    len: usize,
    release: Option<(LoaderClient<Authed>, String, u32, tokio::runtime::Handle)>,
}

impl std::fmt::Debug for PinnedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedFile({}, {} bytes)", self.region.name, self.len)
    }
}

impl layerstream_kernels::MappedBytes for PinnedFile {
    fn bytes(&self) -> &[u8] {
        &self.region.bytes()[..self.len]
    }
}

impl Drop for PinnedFile {
    fn drop(&mut self) {
        if let Some((c, worker, layer, rt)) = self.release.take() {
            // Not block_on: the last holder may drop it on a runtime thread.
            release_in_background(c, worker, layer, &rt);
        }
    }
}

/// Releases `worker`'s pin on `layer`'s slot without waiting for the loader's answer (the pins are
/// counted, so a release that lands after the next acquire is still the right one); a failure is
/// logged, as the worker no longer holds the slot either way.
fn release_in_background(
    mut c: LoaderClient<Authed>,
    worker: String,
    layer: u32,
    rt: &tokio::runtime::Handle,
) {
    rt.spawn(async move {
        if let Err(e) = c.release(SlotRelease { worker, layer }).await {
            tracing::warn!(layer, error = %e, "releasing a loader slot");
        }
    });
}
