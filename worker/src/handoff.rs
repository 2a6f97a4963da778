//! Hidden states handed to the next worker on the same host through shared memory instead of gRPC
//! bytes. A worker asked to (`StepRequest.hidden_out_shm`) writes its output into its own region for
//! that micro-batch and answers with the region's name; the next worker maps it read-only and copies
//! the rows out. One region per micro-batch, so a region is rewritten only by the same micro-batch's
//! next step, which the coordinator sends only after the next worker has answered for this one.
//! Regions are `layerstream-hidden-<pid>-<random tag>` (mode 0600, unguessable, a taken name
//! retried under a new tag), replaced by a larger one under a new name
//! when a step outgrows them, unlinked when the worker stops, and removed by the next worker to start
//! on the host when their process died without doing so.

use layerstream_rpc::v1::HiddenRef;
use layerstream_shm::{self as shm, ShmRegion};
use std::collections::HashMap;
use std::sync::Mutex;

/// Smallest region created (grown to the next power of two above what a step needs).
const MIN_BYTES: usize = 1 << 20;

/// What identifies this worker's host for hand-offs: the kernel's boot id, the IPC namespace and the
/// user (regions are 0600). Empty when the boot id cannot be read: no hand-off then.
pub fn host_id() -> String {
    use std::os::unix::fs::MetadataExt;
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let ipc = std::fs::read_link("/proc/self/ns/ipc").map(|p| p.display().to_string());
    let uid = std::fs::metadata("/proc/self").map(|m| m.uid());
    match (boot.trim(), ipc, uid) {
        (b, Ok(ns), Ok(uid)) if !b.is_empty() => format!("{b}/{ns}/uid{uid}"),
        _ => String::new(),
    }
}

/// This worker's hand-off regions, one per micro-batch.
pub struct Handoff {
    regions: Mutex<HashMap<u32, ShmRegion>>,
}

impl Default for Handoff {
    fn default() -> Self {
        Self::new()
    }
}

impl Handoff {
    /// No regions yet; regions that workers which died left behind on this host are removed.
    pub fn new() -> Self {
        for name in shm::list(shm::HIDDEN_PREFIX) {
            if shm::hidden_owner(&name).is_some_and(|p| !shm::process_alive(p)) {
                let _ = shm::unlink(&name);
            }
        }
        Handoff { regions: Mutex::default() }
    }

    /// Writes `hidden` into micro-batch `lane`'s region (made or grown as needed) and names it.
    pub fn write(&self, lane: u32, hidden: &[f32]) -> Result<HiddenRef, String> {
        let len = std::mem::size_of_val(hidden);
        let mut regions = self.regions.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if regions.get(&lane).is_none_or(|r| r.len() < len) {
            // The old region (if any) is unlinked as it drops; its reader finished with it.
            regions.remove(&lane);
            let size = len.next_power_of_two().max(MIN_BYTES);
            let pid = std::process::id();
            let r =
                ShmRegion::create_unique(|tag| shm::hidden_name(pid, tag), size).map_err(|e| {
                    format!(
                        "creating a shared-memory hand-off region of {size} bytes in /dev/shm: {e}"
                    )
                })?;
            regions.insert(lane, r);
        }
        let r = &regions[&lane];
        // SAFETY: this worker is the region's only writer, and nobody reads it now: the next worker
        // read this micro-batch's previous hidden states before the coordinator sent this step.
        let dst = unsafe { r.bytes_mut() };
        for (d, v) in dst[..len].chunks_exact_mut(4).zip(hidden) {
            d.copy_from_slice(&v.to_le_bytes());
        }
        Ok(HiddenRef { name: r.name.clone(), len: len as u64 })
    }

    /// Unlinks every region (the worker is stopping).
    pub fn clear(&self) {
        self.regions.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clear();
    }
}

/// Reads the hidden states the previous worker left in `r`.
pub fn read(r: &HiddenRef) -> Result<Vec<f32>, String> {
    if shm::hidden_owner(&r.name).is_none() || r.name.contains('/') {
        return Err(format!("hidden_ref: {:?} is not a hand-off region", r.name));
    }
    let region = ShmRegion::open_readonly(&r.name)
        .map_err(|e| format!("hidden_ref: opening shared-memory region {}: {e}", r.name))?;
    let len = r.len as usize;
    if len > region.len() || !len.is_multiple_of(4) {
        return Err(format!(
            "hidden_ref: {len} bytes of region {} ({} bytes) is not a whole number of f32 values inside it",
            r.name,
            region.len()
        ));
    }
    Ok(le_f32s(&region.bytes()[..len]))
}

/// Little-endian f32 values of `bytes` (whole values; a trailing partial one is ignored: callers
/// check the length first).
pub fn le_f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hidden_states_go_through_a_region_per_micro_batch() {
        let h = Handoff::new();
        let a: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 3.0).collect();
        let ra = h.write(0, &a).unwrap();
        assert_eq!(read(&ra).unwrap(), a);
        // Another micro-batch: another region; the first keeps its contents.
        let rb = h.write(1, &[1.0, 2.0]).unwrap();
        assert_ne!(ra.name, rb.name);
        assert_eq!(read(&ra).unwrap(), a);
        assert_eq!(read(&rb).unwrap(), [1.0, 2.0]);
        // The same micro-batch again: the same region, rewritten.
        assert_eq!(h.write(0, &[7.0]).unwrap().name, ra.name);
        // Outgrowing it: a new, larger region under a new name; the old one is gone.
        let big = vec![0.25f32; MIN_BYTES / 2];
        let rc = h.write(0, &big).unwrap();
        assert_ne!(rc.name, ra.name);
        assert_eq!(read(&rc).unwrap(), big);
        assert!(read(&ra).is_err(), "the outgrown region was unlinked");
        // A reference that does not fit its region, or names something else, is refused.
        let e = read(&HiddenRef { name: rb.name.clone(), len: 1 << 40 }).unwrap_err();
        assert!(e.contains("inside it"), "{e}");
        assert!(read(&HiddenRef { name: "layerstream-x-slot-000".into(), len: 4 }).is_err());
        h.clear();
        let mine = |n: &String| shm::hidden_owner(n) == Some(std::process::id());
        assert!(!shm::list(shm::HIDDEN_PREFIX).iter().any(mine));
        assert!(!host_id().is_empty(), "Linux has a boot id and an IPC namespace");
    }

    /// The probe pre-created the names a worker would use next (as another user): with random
    /// tags no name is predictable, and a taken one is skipped.
    #[test]
    fn names_taken_by_others_do_not_stop_hand_offs() {
        let pid = std::process::id();
        let squatted: Vec<ShmRegion> = (0..40)
            .map(|_| ShmRegion::create(&shm::hidden_name(pid, &shm::random_tag()), 4096).unwrap())
            .collect();
        let h = Handoff::new();
        let r = h.write(0, &[1.0, 2.0]).unwrap();
        assert!(squatted.iter().all(|s| s.name != r.name));
        assert_eq!(read(&r).unwrap(), [1.0, 2.0]);
    }

    #[test]
    fn regions_of_dead_workers_are_removed_at_start() {
        // A pid that cannot be alive (above the kernel's maximum).
        let name = shm::hidden_name(99999999, &shm::random_tag());
        // Left behind as a killed worker leaves it: never unlinked by this value.
        std::mem::forget(ShmRegion::create(&name, 4096).unwrap());
        let _h = Handoff::new();
        assert!(!shm::list(&name).contains(&name), "a dead worker's region stays behind");
    }
}
