//! Reading a layer file into a slot: O_DIRECT into the page-aligned mapping where the filesystem
//! allows it (store files are 4 KiB-padded), buffered reads otherwise.

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
