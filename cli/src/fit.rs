//! How `up` shares the host's memory among the parts of one stack: the memory ledger
//! (`mem::Ledger`: MemAvailable, the memory cgroup's room, /dev/shm) is read once, here, and each
//! part gets its share — the loader's slots (shared memory counts against the cgroup too), each
//! CPU worker's budget, the host KV tier — so that together they fit, where each used to size
//! itself from the whole host. A flag the user gives is taken as it is.

use layerstream_model::mem::{gib, Ledger};

/// What each part of the stack may use.
#[derive(Debug, Clone, PartialEq)]
pub struct Shares {
    /// Loader slots (shared memory), each `slot_size` bytes.
    pub slots: usize,
    pub slot_size: u64,
    /// Each CPU worker's memory budget (None: a GPU worker, sized by its device).
    pub worker_budget: Option<u64>,
    /// Each worker's host-RAM KV tier (every worker keeps one).
    pub kv_host_bytes: u64,
    /// Left for the processes themselves (runtimes, tokenizer, activations, page cache).
    pub margin: u64,
    /// Slots the workers pin at once (the floor less the one to read ahead into): what the
    /// read-ahead cannot use.
    pub pinned: usize,
}

/// What the user fixed (None: `up` chooses).
#[derive(Debug, Clone, Copy, Default)]
pub struct Fixed {
    pub slots: Option<usize>,
    pub worker_budget: Option<u64>,
    pub kv_host_bytes: Option<u64>,
}

/// The stack's shape: `layers` slot-sized files (layer files, and expert files where the store has
/// them), at least `floor` slots (what the workers pin at once, and one to read ahead into:
/// `slot_floor`), `workers` workers, CPU ones or not, each CPU worker needing at least
/// `worker_min` bytes of its own (the embedding and head it keeps).
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub layers: usize,
    pub slot_size: u64,
    pub floor: usize,
    pub workers: usize,
    pub cpu: bool,
    pub worker_min: u64,
}

/// The fewest slots a stack runs with: a GPU worker pins one layer group's slots while it copies
/// them (then releases them), a CPU worker computing in place pins the group it computes and the
/// groups its streaming buffers hold ahead; one more slot lets the loader read ahead. Never more
/// than the store's `units` (a slot each holds them all). More slots only add read-ahead and the
/// RAM tier: the ledger's share decides how many.
pub fn slot_floor(gpu: usize, cpu: usize, group: usize, buffers: usize, units: usize) -> usize {
    let pinned = gpu * group.max(1) + cpu * (buffers + 1) * group.max(1);
    (pinned + 1).min(units.max(1))
}

/// Shares of `usable` memory (`shm`: /dev/shm's free bytes, when known): a margin of 128 MiB + 5%
/// (and `GPU_WORKER_HOST_BYTES` for each GPU worker), then the slots' share of the rest
/// (`tier_share`: every layer with host KV tiers of an eighth when the model fits, else as many as
/// the share holds, at least `floor`, and no host tier); CPU workers split what remains. An error
/// names each part's bytes when even the streaming minimum does not fit.
pub fn shares(usable: u64, shm: Option<u64>, s: Shape, fixed: Fixed) -> Result<Shares, String> {
    if let Some(b) = fixed.kv_host_bytes.filter(|&b| b > usable) {
        return Err(format!(
            "--kv-host-bytes {b} is more than this host's memory allows the stack ({usable} bytes)"
        ));
    }
    let margin = (128 << 20) + usable / 20;
    let slot = s.slot_size.max(1);
    let workers = s.workers.max(1) as u64;
    // GPU workers keep their weights on the device: host memory goes to the slots (the RAM tier),
    // less what each GPU worker's process takes on the host (`GPU_WORKER_HOST_BYTES`).
    let host = if s.cpu { 0 } else { GPU_WORKER_HOST_BYTES.saturating_mul(workers) };
    let pool = usable.saturating_sub(margin + host);
    let (roomy, share) = tier_share(pool, slot.saturating_mul(s.layers as u64), s.cpu);
    let kv_host_bytes = fixed.kv_host_bytes.unwrap_or(if roomy { pool / 8 / workers } else { 0 });
    // CPU workers keep their embedding and head beside the slots: the slots leave them room.
    let worker_min = if s.cpu { s.worker_min } else { 0 };
    let floor_needs = kv_host_bytes.saturating_add(worker_min).saturating_mul(workers);
    let room = match fixed.worker_budget {
        Some(b) if s.cpu => {
            pool.saturating_sub(b.saturating_add(kv_host_bytes).saturating_mul(workers))
        }
        _ => pool.saturating_sub(floor_needs),
    };
    let fit = share.min(room).min(shm.unwrap_or(u64::MAX)) / slot;
    let slots = fixed.slots.unwrap_or((fit as usize).min(s.layers).max(s.floor));
    let slot_bytes = slots as u64 * slot;
    layerstream_loader::check_shm_room(slots, slot as usize, shm).map_err(|e| e.to_string())?;
    let left = pool.checked_sub(slot_bytes + kv_host_bytes * workers);
    let worker_budget = match (s.cpu, fixed.worker_budget, left) {
        (false, b, Some(_)) => b,
        (true, Some(b), _) => Some(b),
        (true, None, Some(left)) if left > 0 && left / workers >= worker_min => {
            Some(left / workers)
        }
        _ => {
            let rest = match s.cpu {
                true => format!(
                    "leave less than the {} worker(s) need ({} each for the embedding and head)",
                    s.workers,
                    gib(worker_min)
                ),
                false => format!(
                    "need more than the {} left beside the GPU workers' host side ({})",
                    gib(pool),
                    gib(host)
                ),
            };
            return Err(format!(
                "this host lets the stack use {}: a margin of {} for the processes, the loader's \
                 {slots} slots of {slot} bytes ({}) and host KV tiers of {} each {rest}; raise \
                 the memory limit, or give --slots / --kv-host-bytes / --memory-budget",
                gib(usable),
                gib(margin),
                gib(slot_bytes),
                gib(kv_host_bytes),
            ));
        }
    };
    let pinned = s.floor.saturating_sub(1);
    Ok(Shares {
        slots,
        slot_size: slot,
        worker_budget,
        kv_host_bytes,
        margin: margin + host,
        pinned,
    })
}

/// What a GPU worker's process holds in host memory beside the slots it reads from: the CUDA
/// runtime and cuBLAS, the tokenizer's and the embedding's host copies, a step's host buffers.
pub const GPU_WORKER_HOST_BYTES: u64 = 1 << 30;

/// Whether the model's slot-sized files (`all` bytes) fit the RAM tier whole, and the pool's share
/// the slots get. CPU workers draw their budgets from the same pool: the slots hold every layer when
/// half the pool does (else a quarter goes to slots and the workers keep the rest for resident
/// layers). GPU workers draw nothing from it: the slots hold every layer when seven eighths of the
/// pool do (an eighth left for the host KV tier), else they take the whole pool — every layer a
/// slot keeps is a layer not read from disk each pass.
fn tier_share(pool: u64, all: u64, cpu: bool) -> (bool, u64) {
    match cpu {
        true if all <= pool / 2 => (true, pool / 2),
        true => (false, pool / 4),
        false if all <= pool / 8 * 7 => (true, pool / 8 * 7),
        false => (false, pool),
    }
}

/// The ledger and the shares, for `up`'s log.
pub fn describe(l: &Ledger, s: &Shares, workers: usize) -> String {
    let budget = s.worker_budget.map_or("its device's".into(), gib);
    format!(
        "memory: {}; the loader's {} slots {}, {workers} worker(s) {budget} each, host KV tier {} \
         each, {} left to the processes",
        l.describe(),
        s.slots,
        gib(s.slots as u64 * s.slot_size),
        gib(s.kv_host_bytes),
        gib(s.margin)
    )
}

/// A warning when the sizes the user fixed (`--memory-budget`, `--slots`, `--kv-host-bytes`) add up
/// to more than `usable` — the slots, each CPU worker's budget and host KV tier, the margin — which
/// the ledger would not have chosen: the kernel may kill a part under a memory limit. None when they
/// fit (or a GPU worker's budget is its device's).
pub fn overcommitted(usable: u64, s: &Shares, workers: usize) -> Option<String> {
    let each = s.worker_budget?.saturating_add(s.kv_host_bytes);
    let total = (s.slots as u64 * s.slot_size)
        .saturating_add(each.saturating_mul(workers as u64))
        .saturating_add(s.margin);
    (total > usable).then(|| {
        format!(
            "the sizes given add up to {} (slots {}, {workers} worker(s) {} each, margin {}), more \
             than the {} this host lets the stack use: under a memory limit the kernel may kill a \
             part (drop the size flags to let the memory ledger choose)",
            gib(total),
            gib(s.slots as u64 * s.slot_size),
            gib(each),
            gib(s.margin),
            gib(usable)
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sizes the ledger chose never warn; a budget given past the limit does, naming the totals.
    #[test]
    fn sizes_given_past_the_limit_are_warned_of() {
        let usable = 3584 * MIB;
        let s = shares(usable, Some(64 << 30), llama8b(1), Fixed::default()).unwrap();
        assert_eq!(overcommitted(usable, &s, 1), None);
        let big = Fixed { worker_budget: Some(4 << 30), ..Fixed::default() };
        let s = shares(usable, Some(64 << 30), llama8b(1), big).unwrap();
        let w = overcommitted(usable, &s, 1).unwrap();
        assert!(w.contains("4.00 GiB each") && w.contains("3.50 GiB this host"), "{w}");
        let gpu = Shares { worker_budget: None, ..s };
        assert_eq!(overcommitted(usable, &gpu, 1), None, "a GPU's budget is its device's");
    }

    const MIB: u64 = 1 << 20;

    fn llama8b(workers: usize) -> Shape {
        // 32 layers of ~131 MB Q4_K, 4 slots a worker at least.
        Shape {
            layers: 32,
            slot_size: 131 * MIB,
            floor: 4 * workers,
            workers,
            cpu: true,
            worker_min: 0,
        }
    }

    #[test]
    fn a_cgroup_smaller_than_the_model_gets_a_streaming_plan_that_fits() {
        let usable = 3584 * MIB;
        let s = shares(usable, Some(64 << 30), llama8b(1), Fixed::default()).unwrap();
        let total =
            s.slots as u64 * s.slot_size + s.kv_host_bytes + s.worker_budget.unwrap() + s.margin;
        assert!(total <= usable, "{s:?}");
        assert!(s.slots >= 4 && s.slots < 8, "{s:?}");
        assert_eq!(s.kv_host_bytes, 0, "past RAM: no host KV tier");
        assert!(s.worker_budget.unwrap() > 2 << 30, "{s:?}");
    }

    #[test]
    fn a_roomy_host_keeps_every_layer_in_slots_and_splits_the_rest() {
        let s = shares(20 << 30, Some(10 << 30), llama8b(2), Fixed::default()).unwrap();
        assert_eq!(s.slots, 32);
        let left = (20u64 << 30) - s.margin - 32 * 131 * MIB - 2 * s.kv_host_bytes;
        assert_eq!(s.worker_budget, Some(left / 2));
    }

    #[test]
    fn flags_are_kept_and_impossible_shares_name_their_parts() {
        let fixed = Fixed { slots: Some(6), worker_budget: Some(MIB), kv_host_bytes: Some(0) };
        let s = shares(4 << 30, None, llama8b(1), fixed).unwrap();
        assert_eq!((s.slots, s.worker_budget, s.kv_host_bytes), (6, Some(MIB), 0));
        let e = shares(600 * MIB, Some(64 << 30), llama8b(1), Fixed::default()).unwrap_err();
        assert!(e.contains("4 slots") && e.contains("leave less than"), "{e}");
        let huge = Fixed { kv_host_bytes: Some(100 << 30), ..Fixed::default() };
        let e = shares(8 << 30, None, llama8b(1), huge).unwrap_err();
        assert!(e.contains("--kv-host-bytes") && e.contains("more than this host's memory"), "{e}");
        let e = shares(8 << 30, Some(256 * MIB), llama8b(1), Fixed::default()).unwrap_err();
        assert!(e.contains("/dev/shm") && e.contains("shm_size"), "{e}");
        let gpu = Shape { cpu: false, ..llama8b(1) };
        assert_eq!(shares(8 << 30, None, gpu, Fixed::default()).unwrap().worker_budget, None);
        let e = shares(1536 * MIB, None, gpu, Fixed::default()).unwrap_err();
        assert!(e.contains("4 slots") && e.contains("GPU workers' host side"), "{e}");
    }

    /// A GPU stack's workers hold their layers on the device, so the host's memory is the RAM
    /// tier: past half of it the slots still take all they can (a CPU stack gives its workers
    /// three quarters), and a model that fits keeps every layer in a slot with a host KV tier.
    #[test]
    fn a_gpu_stack_gives_the_host_to_the_ram_tier() {
        let gpu = |workers| Shape { cpu: false, ..llama8b(workers) };
        let usable = 3584 * MIB;
        let s = shares(usable, None, gpu(1), Fixed::default()).unwrap();
        let c = shares(usable, None, llama8b(1), Fixed::default()).unwrap();
        assert!(s.slots > 2 * c.slots, "GPU {} slots, CPU {}", s.slots, c.slots);
        assert_eq!((s.worker_budget, s.kv_host_bytes), (None, 0));
        let used = s.slots as u64 * s.slot_size + s.margin;
        assert!(used <= usable && usable - used < s.slot_size, "{s:?}");
        assert!(s.margin >= GPU_WORKER_HOST_BYTES, "the worker's host side is kept: {s:?}");
        let roomy = shares(16 << 30, Some(16 << 30), gpu(2), Fixed::default()).unwrap();
        assert_eq!(roomy.slots, 32);
        assert!(roomy.kv_host_bytes > 0, "{roomy:?}");
        let total = 32 * roomy.slot_size + 2 * roomy.kv_host_bytes + roomy.margin;
        assert!(total <= 16 << 30, "{roomy:?}");
        // /dev/shm caps the tier as it does a CPU stack's.
        let shm = shares(16 << 30, Some(2 << 30), gpu(1), Fixed::default()).unwrap();
        assert_eq!(shm.slots as u64, (2u64 << 30) / (131 * MIB));
    }

    /// The fewest slots: what the workers pin at once and one to read ahead into, never more
    /// than the store has units.
    #[test]
    fn the_slot_floor_is_what_the_workers_pin_and_one_more() {
        assert_eq!(slot_floor(1, 0, 1, 2, 80), 2, "a GPU worker pins the group it copies");
        assert_eq!(slot_floor(0, 1, 1, 2, 80), 4, "a CPU worker pins its group and two ahead");
        assert_eq!(slot_floor(2, 1, 2, 2, 80), 11);
        assert_eq!(slot_floor(0, 1, 1, 2, 1), 1, "one unit needs one slot");
    }

    /// A 70B-shaped store (layers of 0.48 GB) in a 3.5 GiB cgroup on a GPU: the stack streams
    /// through the slots the pool holds (4) rather than asking for its comfortable read-ahead (5,
    /// which did not fit and was refused, measured on an H200 2026-11-28).
    #[test]
    fn a_gpu_stack_past_ram_streams_through_the_slots_that_fit() {
        let s70 = |floor, cpu, worker_min| Shape {
            layers: 12,
            slot_size: 481_361_920,
            floor,
            workers: 1,
            cpu,
            worker_min,
        };
        let usable = 3584 * MIB;
        let s = shares(usable, None, s70(slot_floor(1, 0, 1, 2, 12), false, 0), Fixed::default())
            .unwrap();
        assert_eq!(s.slots, 4, "{s:?}");
        assert!(s.slots as u64 * s.slot_size + s.margin <= usable, "{s:?}");
        // A CPU worker keeps its embedding and head (1.18 GB here): the slots leave it that.
        let cpu = s70(slot_floor(0, 1, 1, 2, 12), true, 1_180_000_000);
        let c = shares(usable, None, cpu, Fixed::default()).unwrap();
        assert!(c.worker_budget.unwrap() >= 1_180_000_000, "{c:?}");
        assert!(c.slots >= cpu.floor, "{c:?}");
        let total = c.slots as u64 * c.slot_size + c.worker_budget.unwrap() + c.margin;
        assert!(total <= usable, "{c:?}");
        // Where even the floor leaves the worker less than that, the error says so.
        let e = shares(2560 * MIB, None, cpu, Fixed::default()).unwrap_err();
        assert!(e.contains("embedding and head") && e.contains("4 slots"), "{e}");
    }
}
