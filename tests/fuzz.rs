//! Bounded fuzzing of every parser a user's file reaches (CI runs it): a seeded mutator over a small
//! valid GGUF (imported), the manifest of the store made from it (opened, verified, loaded), and an
//! HF safetensors checkpoint (imported), and pre-quantized checkpoints' safetensors headers and
//! `quantization_config`s (imported). Every case must end in Ok or an error — a panic or a case
//! that runs past the watchdog fails the test, naming the seed that reproduces it
//! (`LAYERSTREAM_FUZZ_SEED=<seed> LAYERSTREAM_FUZZ_CASES=1`). `fuzz/` has the cargo-fuzz targets
//! for longer runs.

use layerstream_kernels::CpuBackend;
use layerstream_tests::gguf_writer::{write_gguf, Meta};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// splitmix64: small, seedable, good enough to pick mutations.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Values that break size arithmetic and validation when they land in a count, size or float.
const INTERESTING: &[u64] = &[
    0,
    1,
    3,
    255,
    u32::MAX as u64,
    u64::MAX,
    3 << 62,
    1 << 32,
    0x7FF8_0000_0000_0000, // f64 NaN
    0x7FC0_0000,           // f32 NaN
    0x7F80_0000,           // f32 inf
    i64::MAX as u64,
];

/// Where the numbers of a GGUF's header live: the two counts, every numeric metadata value, and
/// each tensor entry's dimension count, dimensions, type and offset ((position, width) pairs).
fn gguf_fields(b: &[u8], keys: &[&str], tensors: &[String]) -> Vec<(usize, usize)> {
    let find = |needle: &[u8]| b.windows(needle.len()).position(|w| w == needle);
    let mut out = vec![(8, 8), (16, 8)];
    for k in keys {
        if let Some(i) = find(k.as_bytes()) {
            let ty = i + k.len();
            out.push((ty, 4));
            let width = match u32::from_le_bytes(b[ty..ty + 4].try_into().unwrap()) {
                4..=6 => 4,
                0 | 1 | 7 => 1,
                _ => 8, // 64-bit values, a string's or an array's length
            };
            out.push((ty + 4, width));
        }
    }
    for t in tensors {
        if let Some(i) = find(t.as_bytes()) {
            let nd_at = i + t.len();
            let nd = u32::from_le_bytes(b[nd_at..nd_at + 4].try_into().unwrap()) as usize;
            out.push((nd_at, 4));
            for d in 0..nd.min(4) {
                out.push((nd_at + 4 + 8 * d, 8));
            }
            out.push((nd_at + 4 + 8 * nd.min(4), 4));
            out.push((nd_at + 8 + 8 * nd.min(4), 8));
        }
    }
    out
}

/// Overwrites one known field with an interesting value of its width.
fn mutate_field(b: &mut [u8], fields: &[(usize, usize)], r: &mut Rng) {
    let (at, width) = fields[r.below(fields.len())];
    let v = match r.below(4) {
        0 => r.next(),
        1 => r.next() % 8,
        _ => INTERESTING[r.below(INTERESTING.len())],
    };
    if at + width <= b.len() {
        b[at..at + width].copy_from_slice(&v.to_le_bytes()[..width]);
    }
}

/// Replaces one JSON number or string of a manifest with a hostile one.
fn mutate_json(m: &mut Vec<u8>, r: &mut Rng) {
    let text = String::from_utf8_lossy(m).into_owned();
    let mut spans = Vec::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'"' {
            let j = text[i + 1..].find('"').map_or(bytes.len(), |k| i + 1 + k);
            spans.push((i, (j + 1).min(bytes.len()), true));
            i = j + 1;
        } else if bytes[i].is_ascii_digit() || bytes[i] == b'-' {
            let j = i + text[i..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || ".-+".contains(c)))
                .unwrap_or(0)
                .max(1);
            spans.push((i, j, false));
            i = j;
        } else {
            i += 1;
        }
    }
    let Some(&(a, z, quoted)) = spans.get(r.below(spans.len())) else { return };
    const NUMS: &[&str] =
        &["0", "-1", "1e400", "18446744073709551615", "4097", "3", "1e-300", "2.5", "null", "[]"];
    const STRS: &[&str] = &[
        "\"\"",
        "\"../../../../etc/passwd\"",
        "\"layer_000.bin\"",
        "\"/dev/zero\"",
        "\"xxh3:0000000000000000\"",
        "\"q4_k\"",
        "\"f32\"",
        "0",
    ];
    let with = if quoted { STRS[r.below(STRS.len())] } else { NUMS[r.below(NUMS.len())] };
    *m = format!("{}{}{}", &text[..a], with, &text[z..]).into_bytes();
}

/// One mutation of `b`, mostly inside its first `hot` bytes (headers and directories).
fn mutate(b: &mut Vec<u8>, hot: usize, r: &mut Rng) {
    let at = |r: &mut Rng, len: usize| {
        if r.below(5) < 4 {
            r.below(hot.min(len))
        } else {
            r.below(len)
        }
    };
    match r.below(6) {
        0 | 1 => {
            let i = at(r, b.len());
            b[i] ^= 1 << r.below(8);
        }
        2 | 3 => {
            let v = INTERESTING[r.below(INTERESTING.len())].to_le_bytes();
            let width = [1, 2, 4, 8][r.below(4)];
            let i = at(r, b.len().saturating_sub(width));
            b[i..i + width].copy_from_slice(&v[..width]);
        }
        4 => {
            let n = at(r, b.len());
            b.truncate(n);
        }
        _ => {
            let i = at(r, b.len());
            let n = 1 + r.below(16);
            let junk: Vec<u8> = (0..n).map(|_| r.next() as u8).collect();
            b.splice(i..i, junk);
        }
    }
}

/// The micro model's sizes: vocabulary, hidden, feed-forward.
const V: usize = 64;
const H: usize = 32;
const F: usize = 64;

/// The micro model's layer tensors (the layout table's required ones) with their shapes.
fn micro_layer() -> Vec<(&'static layerstream_model::layout::LayerTensor, Vec<usize>)> {
    layerstream_model::layout::LAYER_TENSORS
        .iter()
        .filter(|t| t.required)
        .map(|t| {
            let shape = match t.name {
                "attn_norm" | "ffn_norm" => vec![H],
                "gate" | "up" => vec![F, H],
                "down" => vec![H, F],
                _ => vec![H, H],
            };
            (t, shape)
        })
        .collect()
}

/// A llama GGUF with one layer, hidden 32, vocab 64 (single-character gpt2 tokens).
fn micro_gguf(path: &Path) -> (usize, Vec<(usize, usize)>) {
    let (v, h, f) = (V, H, F);
    let tokens: Vec<String> = (0..v)
        .map(|i| char::from(b'A' + (i % 58) as u8).to_string())
        .enumerate()
        .map(|(i, c)| if i < 58 { c } else { format!("{c}{i}") })
        .collect();
    let meta = vec![
        ("general.architecture", Meta::Str("llama".into())),
        ("llama.block_count", Meta::U32(1)),
        ("llama.context_length", Meta::U32(64)),
        ("llama.embedding_length", Meta::U32(h as u32)),
        ("llama.feed_forward_length", Meta::U32(f as u32)),
        ("llama.attention.head_count", Meta::U32(2)),
        ("llama.attention.head_count_kv", Meta::U32(2)),
        ("llama.rope.freq_base", Meta::F32(10000.0)),
        ("llama.attention.layer_norm_rms_epsilon", Meta::F32(1e-5)),
        ("tokenizer.ggml.model", Meta::Str("gpt2".into())),
        ("tokenizer.ggml.tokens", Meta::Strs(tokens)),
        ("tokenizer.ggml.token_type", Meta::I32s(vec![1; v])),
        ("tokenizer.ggml.merges", Meta::Strs(vec![])),
        ("tokenizer.ggml.eos_token_id", Meta::U32(1)),
        (
            "tokenizer.chat_template",
            Meta::Str("{% for m in messages %}{{ m.content }}{% endfor %}".into()),
        ),
    ];
    let mut seed = 1u64;
    let mut data = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
            })
            .collect()
    };
    let mut tensors = vec![
        ("token_embd.weight".to_owned(), vec![v, h], data(v * h)),
        ("output_norm.weight".to_owned(), vec![h], vec![1.0; h]),
    ];
    for (t, shape) in micro_layer() {
        let n = shape.iter().product();
        tensors.push((format!("blk.0.{}", t.gguf), shape, data(n)));
    }
    write_gguf(path, &meta, &tensors);
    // Where the tensor data starts: everything before is header, metadata and directory.
    let b = std::fs::read(path).unwrap();
    let keys: Vec<&str> = meta.iter().map(|(k, _)| *k).collect();
    let names: Vec<String> = tensors.iter().map(|t| t.0.clone()).collect();
    let hot = b.len() - tensors.iter().map(|t| (t.2.len() * 4).div_ceil(32) * 32).sum::<usize>();
    (hot, gguf_fields(&b, &keys, &names))
}

/// Runs `case` on a thread under a watchdog; a panic is returned as its message.
fn guarded(case: impl FnOnce() + Send + 'static) -> Result<(), String> {
    std::thread::spawn(move || std::panic::catch_unwind(std::panic::AssertUnwindSafe(case)))
        .join()
        .unwrap()
        .map_err(|p| {
            p.downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default()
        })
}

/// Opens, verifies and loads a store; errors are fine, panics are not.
fn use_store(dir: &Path) {
    if let Ok(store) = layerstream_model::Store::open(dir) {
        let _ = store.verify();
        let _ = store.tokenizer();
        let _ = layerstream_worker::Model::load(CpuBackend::default(), &store);
    }
}

#[test]
fn every_mutated_file_ends_in_ok_or_a_clear_error() {
    let cases: u64 =
        std::env::var("LAYERSTREAM_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(5200);
    let first: u64 =
        std::env::var("LAYERSTREAM_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("micro.gguf");
    let (hot, fields) = micro_gguf(&gguf);
    let good = std::fs::read(&gguf).unwrap();
    let store = tmp.path().join("store");
    layerstream_model::import::import(&gguf, &store, false).expect("the unmutated file imports");
    let manifest = std::fs::read(store.join("manifest.json")).unwrap();
    // An HF checkpoint of the same weights: config.json + model.safetensors + tokenizer.json.
    let hf = tmp.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    std::fs::copy(store.join("tokenizer.json"), hf.join("tokenizer.json")).unwrap();
    std::fs::write(
        hf.join("config.json"),
        r#"{"architectures":["LlamaForCausalLM"],"hidden_size":32,"intermediate_size":64,
            "num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":2,"vocab_size":64,
            "max_position_embeddings":64,"rms_norm_eps":1e-5,"rope_theta":10000.0,
            "tie_word_embeddings":true}"#,
    )
    .unwrap();
    let st = safetensors_micro();
    let st_hot = 8 + u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;

    // The watchdog: a case still running after this long is a hang. `since` is when the current
    // case started, in ms after `epoch`.
    let current = Arc::new(AtomicU64::new(u64::MAX));
    let since = Arc::new(AtomicU64::new(0));
    let epoch = Instant::now();
    {
        let (current, since) = (current.clone(), since.clone());
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(500));
            let c = current.load(Ordering::SeqCst);
            let running_ms =
                (epoch.elapsed().as_millis() as u64).saturating_sub(since.load(Ordering::SeqCst));
            if c != u64::MAX && running_ms > 20_000 {
                eprintln!("fuzz case {c} ran for 20 s: a hang (LAYERSTREAM_FUZZ_SEED={c} LAYERSTREAM_FUZZ_CASES=1)");
                std::process::abort();
            }
        });
    }
    let started = Instant::now();
    let mut panics = Vec::new();
    let mut oks = [0usize; 4];
    for seed in first..first + cases {
        let mut r = Rng(seed);
        // 0-9 GGUF, 10-11 manifest, 12 safetensors, 13-14 a pre-quantized checkpoint's
        // safetensors header or quantization_config.
        let kind = (seed % 15) as usize;
        let dir = tmp.path().join(format!("case-{seed}"));
        std::fs::create_dir(&dir).unwrap();
        since.store(epoch.elapsed().as_millis() as u64, Ordering::SeqCst);
        current.store(seed, Ordering::SeqCst);
        let (store_dir, hf_dir, gguf_src) = (store.clone(), hf.clone(), dir.join("m.gguf"));
        let (good, manifest, st, fields) =
            (good.clone(), manifest.clone(), st.clone(), fields.clone());
        let outcome = guarded(move || match kind {
            0..=9 => {
                let mut b = good;
                for _ in 0..1 + r.below(3) {
                    if r.below(2) == 0 {
                        mutate_field(&mut b, &fields, &mut r);
                    } else {
                        mutate(&mut b, hot, &mut r);
                    }
                }
                std::fs::write(&gguf_src, &b).unwrap();
                if layerstream_model::import::import(&gguf_src, &dir.join("s"), false).is_ok() {
                    use_store(&dir.join("s"));
                }
            }
            10 | 11 => {
                let s = dir.join("s");
                std::fs::create_dir(&s).unwrap();
                for e in std::fs::read_dir(&store_dir).unwrap().flatten() {
                    std::fs::copy(e.path(), s.join(e.file_name())).unwrap();
                }
                let mut m = manifest;
                for _ in 0..1 + r.below(3) {
                    if r.below(4) == 0 {
                        let hot = m.len();
                        mutate(&mut m, hot, &mut r);
                    } else {
                        mutate_json(&mut m, &mut r);
                    }
                }
                std::fs::write(s.join("manifest.json"), m).unwrap();
                use_store(&s);
            }
            13 | 14 => {
                let src = layerstream_tests::fixtures().join("prequant").join(PREQUANT[r.below(4)]);
                let h = dir.join("hf");
                std::fs::create_dir(&h).unwrap();
                for e in std::fs::read_dir(&src).unwrap().flatten() {
                    std::fs::copy(e.path(), h.join(e.file_name())).unwrap();
                }
                if kind == 13 {
                    let mut b = std::fs::read(h.join("model.safetensors")).unwrap();
                    let hot = 8 + u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
                    mutate(&mut b, hot, &mut r);
                    std::fs::write(h.join("model.safetensors"), b).unwrap();
                } else {
                    let mut c = std::fs::read(h.join("config.json")).unwrap();
                    for _ in 0..1 + r.below(3) {
                        mutate_json(&mut c, &mut r);
                    }
                    std::fs::write(h.join("config.json"), c).unwrap();
                }
                if layerstream_model::import::import(&h, &dir.join("s"), false).is_ok() {
                    use_store(&dir.join("s"));
                }
            }
            _ => {
                let h = dir.join("hf");
                std::fs::create_dir(&h).unwrap();
                for f in ["config.json", "tokenizer.json"] {
                    std::fs::copy(hf_dir.join(f), h.join(f)).unwrap();
                }
                let mut b = st;
                mutate(&mut b, st_hot, &mut r);
                std::fs::write(h.join("model.safetensors"), b).unwrap();
                if layerstream_model::import::import(&h, &dir.join("s"), false).is_ok() {
                    use_store(&dir.join("s"));
                }
            }
        });
        current.store(u64::MAX, Ordering::SeqCst);
        match outcome {
            Ok(()) => {
                oks[match kind {
                    0..=9 => 0,
                    10 | 11 => 1,
                    12 => 2,
                    _ => 3,
                }] += 1
            }
            Err(msg) => panics.push(format!("seed {seed}: {msg}")),
        }
        let _ = std::fs::remove_dir_all(tmp.path().join(format!("case-{seed}")));
    }
    eprintln!(
        "fuzz: {cases} cases in {:.1} s (GGUF/manifest/safetensors/pre-quantized cases that completed: {oks:?})",
        started.elapsed().as_secs_f64()
    );
    assert!(
        panics.is_empty(),
        "{} of {cases} cases panicked:\n{}",
        panics.len(),
        panics[..panics.len().min(10)].join("\n")
    );
}

/// Pre-quantized fixtures whose headers and configs the fuzzer mutates (tests/prequant.rs).
const PREQUANT: [&str; 4] = ["fp8-block", "ct-w4-asym", "awq", "gptq"];

/// The micro model's weights as a safetensors file (HF names, f32, tied embeddings).
fn safetensors_micro() -> Vec<u8> {
    let (v, h) = (V, H);
    let mut tensors: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![v, h]),
        ("model.norm.weight".into(), vec![h]),
    ];
    for (t, shape) in micro_layer() {
        tensors.push((format!("model.layers.0.{}", t.hf), shape));
    }
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, s)| {
            (0..s.iter().product::<usize>())
                .flat_map(|i| ((i % 7) as f32 * 0.01).to_le_bytes())
                .collect()
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, s), b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}
