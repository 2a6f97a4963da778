//! POSIX shared-memory regions, the data half of the loader contract: the loader creates them (mode
//! 0600, pre-faulted once), workers map them read-only, the loader unlinks them at exit. Names live in a
//! per-instance namespace `layerstream-<ns>-…` that both sides derive with `slot_name`
//! (`names`: every kind of name, built and read back in one place).

use std::ffi::CString;
use std::io;

mod names;
pub use names::*;

/// A mapped shared-memory region.
pub struct ShmRegion {
    pub name: String,
    ptr: *mut u8,
    len: usize,
    owner: bool,
}

// SAFETY: the mapping is plain memory shared by address; synchronisation of its contents is done by
// the slot pool's refcounts (a slot is never written while pinned), not by this type.
unsafe impl Send for ShmRegion {}
// SAFETY: as above; `&ShmRegion` only exposes raw pointers and slices whose use the pool orders.
unsafe impl Sync for ShmRegion {}

fn cname(name: &str) -> io::Result<CString> {
    CString::new(format!("/{name}"))
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in shm name"))
}

fn map(fd: i32, len: usize, writable: bool) -> io::Result<*mut u8> {
    let prot = if writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
    // SAFETY: fd is an open shm descriptor of at least `len` bytes; a null hint lets the kernel pick
    // the address; the result is checked against MAP_FAILED.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd, 0) };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(p as *mut u8)
}

impl ShmRegion {
    /// Creates a new region of `len` bytes (failing if it exists), mode 0600, allocated
    /// (`posix_fallocate`: a /dev/shm too small is an error here, not a SIGBUS later) and with every
    /// page touched so first-touch mapping happens now, not during a read.
    pub fn create(name: &str, len: usize) -> io::Result<ShmRegion> {
        let c = cname(name)?;
        // SAFETY: c is a valid NUL-terminated name; flags and mode are plain integers.
        let fd = unsafe {
            libc::shm_open(c.as_ptr(), libc::O_CREAT | libc::O_EXCL | libc::O_RDWR, 0o600)
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let res = (|| {
            // SAFETY: fd is the descriptor just opened.
            if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
                return Err(io::Error::last_os_error());
            }
            // Allocated now, so a full /dev/shm is this error (ENOSPC) and never a SIGBUS when a
            // page is first written later.
            // SAFETY: fd is open and sized; posix_fallocate returns an errno, not -1.
            let r = unsafe { libc::posix_fallocate(fd, 0, len as libc::off_t) };
            if r != 0 {
                return Err(io::Error::from_raw_os_error(r));
            }
            map(fd, len, true)
        })();
        // SAFETY: fd is ours; the mapping (if any) keeps the region alive without it.
        unsafe { libc::close(fd) };
        let ptr = match res {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: unlinking the name we created; failure is irrelevant here.
                unsafe { libc::shm_unlink(c.as_ptr()) };
                return Err(e);
            }
        };
        let region = ShmRegion { name: name.into(), ptr, len, owner: true };
        // SAFETY: ptr..ptr+len is our writable mapping; writing one byte per page pre-faults it.
        unsafe {
            for off in (0..len).step_by(4096) {
                std::ptr::write_volatile(ptr.add(off), 0);
            }
        }
        Ok(region)
    }

    /// Creates a region under the first free name `name_of(tag)` gives for a fresh unguessable tag
    /// (`random_tag`): a name someone else already holds (another user pre-creating names, say) is
    /// skipped, never fatal.
    pub fn create_unique(name_of: impl Fn(&str) -> String, len: usize) -> io::Result<ShmRegion> {
        let mut last = None;
        for _ in 0..8 {
            match ShmRegion::create(&name_of(&random_tag()), len) {
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
                other => return other,
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("no free shared-memory name")))
    }

    /// Maps an existing region read-only (worker side).
    pub fn open_readonly(name: &str) -> io::Result<ShmRegion> {
        let c = cname(name)?;
        // SAFETY: valid name; read-only open.
        let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDONLY, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a zeroed stat buffer filled by fstat on our fd.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is open; st is a valid out-pointer.
        let r = unsafe { libc::fstat(fd, &mut st) };
        let res = if r != 0 {
            Err(io::Error::last_os_error())
        } else {
            map(fd, st.st_size as usize, false)
        };
        // SAFETY: fd is ours.
        unsafe { libc::close(fd) };
        Ok(ShmRegion { name: name.into(), ptr: res?, len: st.st_size as usize, owner: false })
    }

    /// Region size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The region's bytes.
    ///
    /// Callers must hold a pin on the slot (loader refcount) so no writer runs concurrently.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: ptr..ptr+len is a live mapping owned by self; writers are excluded by the pool.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// Mutable view for the loader's reads into an unpinned slot.
    ///
    /// # Safety
    /// The caller must be the only writer and no reader may hold a pin on this slot.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self) -> &mut [u8] {
        // SAFETY: guaranteed by the caller (pool state `Loading` excludes readers and other writers).
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Raw base pointer (for host registration with a GPU driver).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }
}

impl Drop for ShmRegion {
    fn drop(&mut self) {
        // SAFETY: ptr/len describe a mapping created by this value and not yet unmapped.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
        if self.owner {
            let _ = unlink(&self.name);
        }
    }
}

/// Unlinks a region by name.
pub fn unlink(name: &str) -> io::Result<()> {
    let c = cname(name)?;
    // SAFETY: valid NUL-terminated name.
    if unsafe { libc::shm_unlink(c.as_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Names of existing regions in `/dev/shm` starting with `prefix`.
pub fn list(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.starts_with(prefix))
                .collect()
        })
        .unwrap_or_default()
}

/// Bytes free in `/dev/shm` (None when it cannot be read).
pub fn free_bytes() -> Option<u64> {
    layerstream_types::mem::fs_free_bytes("/dev/shm")
}

/// Removes stale regions of namespace `ns` (left by a crashed instance); returns how many.
pub fn remove_stale(ns: &str) -> usize {
    list(&format!("{PREFIX}{ns}-")).iter().filter(|n| unlink(n).is_ok()).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_share_and_unlink_on_drop() {
        let ns = format!("test{}", std::process::id());
        let name = slot_name(&ns, "i0", 0);
        let r = ShmRegion::create(&name, 8192).unwrap();
        // SAFETY: test owns the only writer, no readers pinned.
        unsafe { r.bytes_mut()[100] = 42 };
        let ro = ShmRegion::open_readonly(&name).unwrap();
        assert_eq!(ro.bytes()[100], 42);
        assert_eq!(ro.len(), 8192);
        let meta = std::fs::metadata(format!("/dev/shm/{name}")).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert!(ShmRegion::create(&name, 4096).is_err(), "exclusive create");
        drop(r);
        assert!(list(&format!("{PREFIX}{ns}-")).is_empty());
        assert_eq!(ro.bytes()[100], 42, "an existing mapping outlives the unlink");
    }

    /// A name another user already holds is skipped: `create_unique` takes a new tag.
    #[test]
    fn taken_names_are_skipped() {
        let pid = std::process::id();
        let a = ShmRegion::create_unique(|t| format!("{PREFIX}uniq{pid}-{t}"), 4096).unwrap();
        let b = ShmRegion::create_unique(|t| format!("{PREFIX}uniq{pid}-{t}"), 4096).unwrap();
        assert_ne!(a.name, b.name);
        // Every tag taken (a name that ignores the tag): an AlreadyExists error, not a panic.
        let fixed = format!("{PREFIX}uniq{pid}-fixed");
        let _held = ShmRegion::create(&fixed, 4096).unwrap();
        let e = ShmRegion::create_unique(|_| fixed.clone(), 4096).err().unwrap();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        assert!(free_bytes().is_some_and(|b| b > 0));
    }

    #[test]
    fn stale_regions_are_removed() {
        let ns = format!("stale{}", std::process::id());
        let r = ShmRegion::create(&slot_name(&ns, "i1", 1), 4096).unwrap();
        std::mem::forget(r); // simulate a crash: never unlinked
        assert_eq!(remove_stale(&ns), 1);
        assert!(list(&format!("{PREFIX}{ns}-")).is_empty());
    }
}
