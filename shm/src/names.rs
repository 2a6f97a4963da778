//! The one owner of layerstream's shared-memory names: how each kind is built, how it is read
//! back, and whether the process a name belongs to is still alive. Every region is
//! `layerstream-…` in `/dev/shm`:
//! - loader slots `layerstream-<ns>-<instance>-slot-NNN` (`<ns>` is `up<pid>` under `up`),
//! - hidden-state hand-offs `layerstream-hidden-<pid>-<tag>`.
//!
//! The `<instance>` and `<tag>` parts are random (64 bits from the kernel): another local user
//! cannot guess a name to take it first, and a name found taken anyway is retried under a new one.

/// Prefix of every region layerstream creates.
pub const PREFIX: &str = "layerstream-";
/// Prefix of every hidden-state hand-off region.
pub const HIDDEN_PREFIX: &str = "layerstream-hidden-";
/// What separates a slot's pool name (`layerstream-<ns>-<instance>`) from its number.
const SLOT_SEP: &str = "-slot-";
/// Namespaces of stacks `layerstream up` started: `up<pid of up>`.
const UP_NS: &str = "up";

/// The shm name of slot `i` of loader instance `instance` in namespace `ns` (no leading slash;
/// `/dev/shm/<name>`). Each daemon start picks a new instance id, so a worker that still maps a
/// slot of a daemon that died can never mistake it for a slot of its successor (same namespace,
/// different names).
pub fn slot_name(ns: &str, instance: &str, i: usize) -> String {
    format!("{PREFIX}{ns}-{instance}{SLOT_SEP}{i:03}")
}

/// The loader pool a slot name belongs to (`layerstream-<ns>-<instance>`), None for other names.
pub fn slot_pool(name: &str) -> Option<&str> {
    name.strip_prefix(PREFIX)?;
    name.rsplit_once(SLOT_SEP).map(|(pool, _)| pool)
}

/// A hand-off region of the worker with process id `pid`, `tag` from `random_tag`.
pub fn hidden_name(pid: u32, tag: &str) -> String {
    format!("{HIDDEN_PREFIX}{pid}-{tag}")
}

/// 16 hex digits from the kernel's random source: the unguessable part of a name.
pub fn random_tag() -> String {
    let mut b = [0u8; 8];
    // SAFETY: b is a valid 8-byte buffer; getrandom fills at most that many bytes.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    assert_eq!(n, 8, "reading the kernel's random source");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The process id a hand-off region's name carries (None: not a hand-off region).
pub fn hidden_owner(name: &str) -> Option<u32> {
    name.strip_prefix(HIDDEN_PREFIX)?.split('-').next()?.parse().ok()
}

/// The loader namespace of the stack `layerstream up` (process `pid`) starts.
pub fn up_namespace(pid: u32) -> String {
    format!("{UP_NS}{pid}")
}

/// The pid of the `up` whose namespace `ns` is (None: not an `up` namespace).
pub fn up_namespace_owner(ns: &str) -> Option<u32> {
    ns.strip_prefix(UP_NS)?.parse().ok()
}

/// The pid of the `up` that owns region `name` (None: not a region of an `up` stack).
pub fn up_region_owner(name: &str) -> Option<u32> {
    let ns = name.strip_prefix(PREFIX)?.split('-').next()?;
    up_namespace_owner(ns)
}

/// Whether process `pid` still runs: it exists and is not a zombie nobody reaped yet. The one
/// rule every orphan sweep (`up`'s, the workers' hand-offs) uses.
pub fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name in parentheses (which may itself hold ')').
        Ok(stat) => !stat.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_read_back_as_they_were_built() {
        let slot = slot_name(&up_namespace(42), "i7", 3);
        assert_eq!(slot, "layerstream-up42-i7-slot-003");
        assert_eq!(slot_pool(&slot), Some("layerstream-up42-i7"));
        assert_eq!(up_region_owner(&slot), Some(42));
        assert_eq!(up_region_owner(&slot_name("mine", "i7", 0)), None);
        let h = hidden_name(1234, &random_tag());
        assert_eq!(h.len(), HIDDEN_PREFIX.len() + 5 + 16);
        assert_ne!(h, hidden_name(1234, &random_tag()));
        assert_eq!(hidden_owner(&h), Some(1234));
        assert_eq!(hidden_owner(&slot), None);
        assert_eq!(slot_pool(&h), None);
        assert_eq!(up_namespace_owner("up99"), Some(99));
        assert_eq!(up_namespace_owner("upx"), None);
    }

    #[test]
    fn liveness_sees_this_process_and_not_a_reaped_child() {
        assert!(process_alive(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(!process_alive(pid), "a reaped child is gone");
    }
}
