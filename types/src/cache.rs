//! Where layerstream keeps what it fetches or compiles once (the default model, NVRTC kernels).

use std::path::PathBuf;

/// The cache root: `$LAYERSTREAM_CACHE`, else `$XDG_CACHE_HOME/layerstream`, else `~/.cache/layerstream`.
pub fn cache_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("LAYERSTREAM_CACHE") {
        return PathBuf::from(p);
    }
    if let Some(p) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(p).join("layerstream");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("layerstream")
}

/// Writes `bytes` to `path` whole or not at all: into a temporary file beside it (named for this
/// process), then renamed over it, so a reader never sees half a file and two writers leave one
/// whole file; makes the directory first.
pub fn write_whole(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_whole_write_replaces_the_file_and_leaves_nothing_beside_it() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub").join("f.json");
        super::write_whole(&p, b"one").unwrap();
        super::write_whole(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(p.parent().unwrap()).unwrap().count(), 1);
    }
}
