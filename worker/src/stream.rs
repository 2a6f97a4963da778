//! The worker's side of the loader: acquire a layer's shm slot, hand its bytes to the copy, release
//! the slot. Slot mappings are opened once and reused (and registered with the device once).

use crate::error::{Error, Result};
use layerstream_rpc::auth::Authed;
use layerstream_rpc::v1::loader_client::LoaderClient;
use layerstream_rpc::v1::{AcquireRequest, SetOrderRequest, SlotRelease};
use layerstream_shm::ShmRegion;
use layerstream_telemetry::traced_request;
use std::collections::HashMap;

/// A connection to the loader daemon plus the slot regions mapped so far.
pub struct LoaderLink {
    client: LoaderClient<Authed>,
    worker: String,
    /// The order last declared, sent again to a loader that no longer knows it (restarted).
    order: Vec<u32>,
    regions: HashMap<String, ShmRegion>,
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
        let mut c = self.client.clone();
        let req = traced_request(
            span,
            AcquireRequest { worker: self.worker.clone(), layer, prefetch_next: true },
        );
        let a =
            self.rt.block_on(c.acquire(req)).map_err(|s| loader_err("acquire", s))?.into_inner();
        if !a.order_known && !self.order.is_empty() {
            // A restarted daemon: declare the order again so its prefetching resumes.
            self.set_order(self.order.clone())?;
        }
        if !self.regions.contains_key(&a.shm_name) {
            let r = ShmRegion::open_readonly(&a.shm_name)
                .map_err(|e| Error::Stage(format!("mapping /dev/shm/{}: {e}", a.shm_name)))?;
            self.regions.insert(a.shm_name.clone(), r);
        }
        let region = self.regions[&a.shm_name].bytes();
        let len = a.len as usize;
        if len > region.len() {
            return Err(Error::Stage(format!(
                "loader slot {} holds {} bytes, layer {layer} claims {len}",
                a.shm_name,
                region.len()
            )));
        }
        let out = use_slot(region, len);
        let rel = SlotRelease { worker: self.worker.clone(), layer };
        self.rt.block_on(c.release(rel)).map_err(|s| loader_err("release", s))?;
        out
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
        self.regions.values().map(ShmRegion::bytes)
    }
}
