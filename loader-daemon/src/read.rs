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
    if !direct {
        advise(&f, libc::POSIX_FADV_SEQUENTIAL);
    }
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
    if !direct {
        // The bytes live in the slot now: drop the file's cached pages (charged to a memory
        // cgroup like any other memory, and a second copy of what the slot holds).
        advise(&f, libc::POSIX_FADV_DONTNEED);
    }
    Ok(len)
}

/// `posix_fadvise` over the whole file (a hint: its failure changes nothing but speed).
fn advise(f: &std::fs::File, advice: libc::c_int) {
    use std::os::fd::AsRawFd;
    // SAFETY: a valid open descriptor; the call only advises the kernel.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, advice) };
}

/// Whether O_DIRECT opens work for files in `dir` (tmpfs and some overlays refuse it).
pub fn direct_supported(file: &Path) -> bool {
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(file).is_ok()
}

/// What a store's disk delivered: GB/s over whole files (`bytes` of them, both rounds) and one
/// 4 KiB read's latency.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DiskFigures {
    pub gbps: f64,
    pub latency_ms: f64,
    pub direct: bool,
    pub bytes: u64,
    /// CPU seconds the reading threads spent per GB read (their own clocks: a buffered read copies
    /// every byte out of the page cache on the reader's core; O_DIRECT's DMA costs little).
    pub cpu_s_per_gb: f64,
    /// The file a following measurement starts at (`measure_disk`'s `start`).
    pub next: usize,
}

/// Reads the layer files as the loader does — O_DIRECT where the filesystem allows it (or,
/// `buffered`, through the page cache, each file's pages dropped once read, as `--buffered-reads`),
/// into page-aligned buffers (anonymous shared-memory regions, touched before the clock starts, as
/// the loader's slots are), `readers` files at a time as its read-ahead keeps that many reads in
/// flight — in two rounds, each a window of whole files taken in order from `files` starting at
/// `start` and wrapping round (until `max_bytes`, and at least two files a reader where there are
/// that many), the second window going on where the first stopped. The rate is both rounds' bytes
/// over their seconds; `next` is where a following measurement goes on. A calibration that carries
/// `next` along reads the store's files cyclically, as a streamed pass re-reads its disk tier:
/// each file is read again only after the others, never twice in a row from whatever cache sits
/// below this machine (a VM's host cached the few files every measurement re-read, and the
/// calibration saw 1.9 GB/s where the stack's passes got 0.8). Then times a 4 KiB read at the start
/// of the first file. Run with the page cache dropped for the disk's own figures (O_DIRECT bypasses
/// it anyway).
pub fn measure_disk(
    files: &[std::path::PathBuf],
    start: usize,
    max_bytes: u64,
    readers: usize,
    buffered: bool,
) -> io::Result<DiskFigures> {
    let first = files.first().ok_or_else(|| io::Error::other("no file to read"))?;
    let direct = !buffered && direct_supported(first);
    let largest =
        files.iter().filter_map(|f| f.metadata().ok()).map(|m| m.len()).max().unwrap_or(0);
    let len = (largest.div_ceil(4096) * 4096).max(4096) as usize;
    let readers = readers.max(1);
    let bufs = (0..readers.min(files.len()))
        .map(|i| {
            let name = format!("layerstream-calibrate-{}-{i}", std::process::id());
            let r = layerstream_shm::ShmRegion::create(&name, len)?;
            // SAFETY: the region was just created here and nothing else maps it yet.
            unsafe { r.bytes_mut() }.iter_mut().step_by(4096).for_each(|b| *b = 0);
            Ok(r)
        })
        .collect::<io::Result<Vec<_>>>()?;
    let (mut at, mut bytes, mut secs, mut cpu) = (start % files.len(), 0u64, 0.0, 0.0);
    for _ in 0..2 {
        let (take, b) = window(files, at, max_bytes, 2 * readers)?;
        at = (at + take.len()) % files.len();
        let (s, c) = read_round(&take, &bufs[..readers.min(take.len())], direct)?;
        (bytes, secs, cpu) = (bytes + b, secs + s, cpu + c);
    }
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    if direct {
        opts.custom_flags(libc::O_DIRECT);
    }
    let mut f = opts.open(first)?;
    // SAFETY: as above; the readers are done.
    let dst = unsafe { bufs[0].bytes_mut() };
    let t1 = std::time::Instant::now();
    f.read_exact(&mut dst[..4096])?;
    let latency_ms = t1.elapsed().as_secs_f64() * 1e3;
    let gb = bytes as f64 / 1e9;
    let gbps = gb / f64::max(secs, 1e-9);
    Ok(DiskFigures { gbps, latency_ms, direct, bytes, cpu_s_per_gb: cpu / gb.max(1e-9), next: at })
}

/// Whole files of `files` from `at` on, wrapping round, until `max_bytes` and at least `min_files`
/// (never more than every file once), and their bytes.
fn window(
    files: &[std::path::PathBuf],
    at: usize,
    max_bytes: u64,
    min_files: usize,
) -> io::Result<(Vec<std::path::PathBuf>, u64)> {
    let (mut take, mut bytes) = (Vec::new(), 0u64);
    for f in files.iter().cycle().skip(at).take(files.len()) {
        if bytes >= max_bytes && take.len() >= min_files {
            break;
        }
        bytes += f.metadata()?.len();
        take.push(f.clone());
    }
    Ok((take, bytes))
}

/// CPU seconds the calling thread has run.
fn thread_cpu_s() -> f64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `t` is a valid timespec the call writes; the clock id is a constant.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// Seconds to read every one of `take` into `bufs`, one reader thread per buffer taking the next
/// file as it finishes one, and the CPU seconds the readers spent.
fn read_round(
    take: &[std::path::PathBuf],
    bufs: &[layerstream_shm::ShmRegion],
    direct: bool,
) -> io::Result<(f64, f64)> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let t0 = std::time::Instant::now();
    std::thread::scope(|s| {
        let handles: Vec<_> = bufs
            .iter()
            .map(|buf| {
                let next = &next;
                s.spawn(move || -> io::Result<f64> {
                    // SAFETY: `measure_disk` created each region and hands each to one thread.
                    let dst = unsafe { buf.bytes_mut() };
                    let cpu0 = thread_cpu_s();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(f) = take.get(i) else { return Ok(thread_cpu_s() - cpu0) };
                        read_into(f, dst, direct)?;
                    }
                })
            })
            .collect();
        handles.into_iter().try_fold(0.0, |a, h| {
            Ok::<_, io::Error>(a + h.join().map_err(|_| io::Error::other("a reader panicked"))??)
        })
    })
    .map(|cpu| (t0.elapsed().as_secs_f64(), cpu))
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
        // Two rounds of two files (two a reader at least), the second going on where the first
        // stopped: files 0, 1 then 2, 0.
        let d = measure_disk(&files, 0, 2 << 20, 1, false).unwrap();
        assert_eq!((d.bytes, d.next), (4 << 20, 1), "stops once max_bytes are read: {d:?}");
        assert!(d.gbps > 0.0 && d.latency_ms >= 0.0);
        let two = measure_disk(&files, 2, 64 << 20, 2, false).unwrap();
        assert_eq!((two.bytes, two.next), (6 << 20, 2), "every file once a round, from file 2");
        let one = measure_disk(&files, 1, 1, 1, false).unwrap();
        assert_eq!((one.bytes, one.next), (4 << 20, 2), "two files a reader: 1, 2 then 0, 1");
        assert!(measure_disk(&[], 0, 1, 1, false).is_err());
        let b = measure_disk(&files, 0, 64 << 20, 2, true).unwrap();
        assert!(!b.direct && b.bytes == 6 << 20 && b.gbps > 0.0, "buffered: {b:?}");
        // Copying 6 MiB out of the page cache takes the readers some CPU time, and not more than
        // the round's whole wall time on every core.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let cpu = b.cpu_s_per_gb * b.bytes as f64 / 1e9;
        assert!(cpu > 0.0 && cpu <= 2.0 * cores * b.bytes as f64 / 1e9 / b.gbps, "{b:?}");
    }
}
