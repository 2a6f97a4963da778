//! Reading a layer file into a slot: O_DIRECT into the page-aligned mapping where the filesystem
//! allows it (store files are 4 KiB-padded), buffered reads otherwise; and measuring that read
//! (`measure_disk`: what the store's disk delivers, for `layerstream plan`).

use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Reads the whole file at `path` into the start of `dst`; returns bytes read.
pub fn read_into(path: &Path, dst: &mut [u8], direct: bool) -> io::Result<usize> {
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    if direct {
        opts.custom_flags(libc::O_DIRECT);
    }
    let mut f = opts.open(path)?;
    let len = f.metadata()?.len() as usize;
    if len > dst.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is {len} bytes, the slot holds {}", path.display(), dst.len()),
        ));
    }
    let mut done = 0;
    while done < len {
        // O_DIRECT needs aligned lengths: ask for whole 4 KiB pages (the slot is page-aligned and
        // sized in pages); the kernel stops at end of file.
        let want = if direct { (len - done).div_ceil(4096) * 4096 } else { len - done };
        let want = want.min(dst.len() - done);
        let n = f.read(&mut dst[done..done + want])?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{} ended at offset {done} of {len}", path.display()),
            ));
        }
        done += n;
    }
    Ok(len)
}

/// Whether O_DIRECT opens work for files in `dir` (tmpfs and some overlays refuse it).
pub fn direct_supported(file: &Path) -> bool {
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(file).is_ok()
}

/// What a store's disk delivered: GB/s over whole files and one 4 KiB read's latency.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DiskFigures {
    pub gbps: f64,
    pub latency_ms: f64,
    pub direct: bool,
    pub bytes: u64,
}

/// Reads `files` (until `max_bytes`) as the loader does — O_DIRECT where the filesystem allows it,
/// into one page-aligned buffer (an anonymous shared-memory region) — and times it; then times a
/// 4 KiB read at the start of the first file. Run with the page cache dropped for the disk's own
/// figures (O_DIRECT bypasses it anyway).
pub fn measure_disk(files: &[std::path::PathBuf], max_bytes: u64) -> io::Result<DiskFigures> {
    let first = files.first().ok_or_else(|| io::Error::other("no file to read"))?;
    let direct = direct_supported(first);
    let largest =
        files.iter().filter_map(|f| f.metadata().ok()).map(|m| m.len()).max().unwrap_or(0);
    let len = (largest.div_ceil(4096) * 4096).max(4096) as usize;
    let name = format!("layerstream-calibrate-{}", std::process::id());
    let buf = layerstream_shm::ShmRegion::create(&name, len)?;
    // SAFETY: the region was just created by this function and nobody else maps it.
    let dst = unsafe { buf.bytes_mut() };
    let (mut bytes, t0) = (0u64, std::time::Instant::now());
    for f in files {
        if bytes >= max_bytes {
            break;
        }
        bytes += read_into(f, dst, direct)? as u64;
    }
    let secs = t0.elapsed().as_secs_f64().max(1e-9);
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    if direct {
        opts.custom_flags(libc::O_DIRECT);
    }
    let mut f = opts.open(first)?;
    let t1 = std::time::Instant::now();
    f.read_exact(&mut dst[..4096])?;
    let latency_ms = t1.elapsed().as_secs_f64() * 1e3;
    Ok(DiskFigures { gbps: bytes as f64 / secs / 1e9, latency_ms, direct, bytes })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_disk_is_measured_over_whole_files() {
        let dir = tempfile::tempdir().unwrap();
        let files: Vec<_> = (0..3)
            .map(|i| {
                let p = dir.path().join(format!("f{i}"));
                std::fs::write(&p, vec![i as u8; 1 << 20]).unwrap();
                p
            })
            .collect();
        let d = measure_disk(&files, 2 << 20).unwrap();
        assert_eq!(d.bytes, 2 << 20, "stops once max_bytes are read");
        assert!(d.gbps > 0.0 && d.latency_ms >= 0.0);
        assert!(measure_disk(&[], 1).is_err());
    }
}
