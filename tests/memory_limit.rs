//! A stack in a container smaller than its model: `up` in a real memory cgroup (v1 or v2, made
//! here) with a 460 MB store and a 448 MiB limit answers with no size flags — the memory ledger
//! sees the limit, the loader's slots, the worker's budget and the KV capacity are drawn from it,
//! the layers are streamed — and is not OOM-killed; a limit that cannot hold even a streaming plan
//! is refused before anything loads, naming each part's bytes; `plan` shows the streamed tiers
//! first. Ignored, saying why, where the build found no memory cgroup can be made.

use layerstream_tests::*;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A memory cgroup of this test's own, removed on drop.
struct Cgroup {
    dir: PathBuf,
    v2: bool,
}

impl Cgroup {
    /// A new cgroup limited to `bytes` (v1 under /sys/fs/cgroup/memory, else v2), or why not.
    fn make(name: &str, bytes: u64) -> Result<Cgroup, String> {
        let tries = [
            (Path::new("/sys/fs/cgroup/memory"), false, "memory.limit_in_bytes"),
            (Path::new("/sys/fs/cgroup"), true, "memory.max"),
        ];
        let mut why = Vec::new();
        for (root, v2, limit) in tries {
            if !root.join(if v2 { "cgroup.controllers" } else { "memory.limit_in_bytes" }).exists()
            {
                why.push(format!("{}: not a memory cgroup hierarchy", root.display()));
                continue;
            }
            let dir = root.join(name);
            let _ = std::fs::remove_dir(&dir);
            match std::fs::create_dir(&dir)
                .and_then(|_| std::fs::write(dir.join(limit), bytes.to_string()))
            {
                Ok(()) => return Ok(Cgroup { dir, v2 }),
                Err(e) => {
                    let _ = std::fs::remove_dir(&dir);
                    why.push(format!("{}: {e}", dir.display()));
                }
            }
        }
        Err(why.join("; "))
    }

    /// `layerstream <args>` started inside this cgroup.
    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg(format!("echo $$ > {}/cgroup.procs && exec \"$0\" \"$@\"", self.dir.display()))
            .arg(bin())
            .args(args)
            .env("LAYERSTREAM_EXACT", "true");
        c
    }

    /// Whether the kernel's OOM killer acted in it.
    fn oom_killed(&self) -> bool {
        let (file, key) = if self.v2 {
            ("memory.events", "oom_kill ")
        } else {
            ("memory.oom_control", "oom_kill ")
        };
        std::fs::read_to_string(self.dir.join(file)).unwrap_or_default().lines().any(|l| {
            l.strip_prefix(key).and_then(|n| n.trim().parse::<u64>().ok()).is_some_and(|n| n > 0)
        })
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

#[test]
#[cfg_attr(
    not(have_memory_cgroup),
    ignore = "needs a memory cgroup it can make (root, cgroup v1 or v2)"
)]
fn a_model_larger_than_the_memory_limit_runs_with_no_size_flags() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("smol-f32");
    layerstream(&["synth", "--shape", "smollm2-135m", "--dtype", "f32", store.to_str().unwrap()]);
    let model_bytes: u64 =
        std::fs::read_dir(&store).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
    let limit = 448u64 << 20;
    assert!(model_bytes > limit, "the model ({model_bytes} bytes) must be larger than the limit");
    let cg = Cgroup::make(&format!("layerstream-test-{}", std::process::id()), limit)
        .expect("a memory cgroup (the build found one could be made)");
    let s = store.to_str().unwrap();
    let up =
        ["up", "--model", s, "--workers", "1", "--listen", "127.0.0.1:0", "--http-listen", "off"];
    let ask = ["--prompt", "Once upon a time", "--max-new-tokens", "4", "--ignore-eos", "--json"];
    let out = cg.command(&[&up[..], &ask[..]].concat()).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("memory cgroup limit 0.44 GiB"), "the ledger sees the limit: {err}");
    let v = last_json(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(v["output_ids"].as_array().map(Vec::len), Some(4), "{v}");
    assert!(v["stats"]["bytes_streamed"].as_u64().unwrap_or(0) > 0, "layers were streamed: {v}");
    assert!(!cg.oom_killed(), "the OOM killer acted");
    assert!(err.contains("predicted") && err.contains("batch 8:"), "up logs its prediction: {err}");
    // `plan` in the same limit says so before anything starts: layers streamed, some read from
    // disk each pass, the calibration (disk, a layer's compute at 1, 8 and 64 rows), a prediction
    // per batch size that grows with the batch, and the KV cache halved past memory.
    let out = cg.command(&["plan", "--model", s, "--workers", "1", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let p = last_json(&String::from_utf8_lossy(&out.stdout));
    assert!(p["tiers"]["disk"]["layers"].as_u64().unwrap() > 0, "{p}");
    assert!(p["calibration"]["disk_gbps"].as_f64().unwrap() > 0.0, "{p}");
    assert_eq!(p["calibration"]["cached"], true, "up calibrated this host and store: {p}");
    let rows: Vec<u64> = p["calibration"]["layer_s"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x[0].as_u64().unwrap())
        .collect();
    assert_eq!(rows, [1, 8, 64], "{p}");
    let tps = |i: usize| p["predicted"][i]["tokens_per_s"].as_f64().unwrap();
    assert!(tps(0) > 0.0 && tps(2) > tps(0), "{p}");
    assert!(p["kv_capacity"].as_u64().unwrap() >= 256, "{p}");
    assert_eq!(p["workers"][0]["kv_dtype"], "f32", "--exact keeps an f32 cache: {p}");
    drop(cg);
    // 160 MiB cannot hold even a streaming plan: refused before anything loads, naming the parts.
    let cg =
        Cgroup::make(&format!("layerstream-test-small-{}", std::process::id()), 160 << 20).unwrap();
    let out = cg.command(&[&up[..], &ask[..]].concat()).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    let named = (err.contains("embedding/head")
        && err.contains("streaming buffers")
        && err.contains("KV cache"))
        || (err.contains("slots") && err.contains("leave less than"));
    assert!(named, "{err}");
    assert!(!cg.oom_killed(), "refused, not killed: {err}");
}
