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
