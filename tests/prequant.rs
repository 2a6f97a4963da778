//! Pre-quantized checkpoints as people download them (tests/fixtures/prequant/gen.py): block-wise
//! FP8 (`weight_scale_inv`, also with power-of-two ue8m0 scales), compressed-tensors FP8 and INT8
//! per channel and int4 groups (symmetric and asymmetric) written by compressed-tensors itself,
//! AutoAWQ's GEMM layout, GPTQ (grouped, per-channel and act-order) and BitNet b1.58's packed
//! ternary weights (`BitLinear` and `AutoBitLinear`; goldens from transformers' own BitNet
//! quantizer, `gen_bitnet.py`). Each is imported as stored (its
//! weights keep their bytes), decodes bit for bit as the format's library decodes it, and runs with
//! transformers' tokens on those decoded weights — in `run` and streamed through a 2-worker `up`.
//! Bad headers are refused with the tensor or field at fault.

use layerstream_kernels::quant::dequant_row;
use layerstream_model::DType;
use layerstream_tests::stack::{golden_args, submit, Stack};
use layerstream_tests::*;

/// (fixture, the dtype its linear weights are stored as).
const FORMATS: [(&str, DType); 12] = [
    ("fp8-block", DType::Fp8E4m3B128),
    ("fp8-block-ue8m0", DType::Fp8E4m3B128),
    ("ct-fp8-channel", DType::Fp8E4m3B128),
    ("ct-int8-channel", DType::Int8B128),
    ("ct-w4a16", DType::Int4G128),
    ("ct-w4-asym", DType::Int4G128),
    ("awq", DType::Int4G128),
    ("gptq", DType::Int4G128),
    ("gptq-channel", DType::Int4G128),
    ("gptq-act-order", DType::Int4G128),
    ("bitnet", DType::Tq2_0),
    ("bitnet-auto", DType::Tq2_0),
];

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// The library's decoding of `tensor` (`[rows, cols]` f32) from the fixture's reference.
fn reference(name: &str, tensor: &str) -> Vec<f32> {
    let p = fixtures().join("reference/prequant").join(name).join("dequant.safetensors");
    let bytes = std::fs::read(p).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    f32s(st.tensor(tensor).unwrap().data())
}

#[test]
fn every_layout_imports_as_stored_and_decodes_as_its_library_does() {
    for (name, dtype) in FORMATS {
        let dir = tempfile::tempdir().unwrap();
        let store = import(&fixtures().join("prequant").join(name), dir.path());
        store.verify().unwrap();
        for (file, t, hf) in [
            ("layer_000.bin", "k", "model.layers.0.self_attn.k_proj.weight"),
            ("layer_001.bin", "down", "model.layers.1.mlp.down_proj.weight"),
        ] {
            let loaded = store.load(file).unwrap();
            let (entry, bytes) = loaded.tensor(t).unwrap();
            assert_eq!(entry.dtype, dtype, "{name}: {t} stored as {}", entry.dtype);
            let mut want = reference(name, hf);
            let mut got = vec![f32::NAN; want.len()];
            dequant_row(dtype, bytes, &mut got);
            // An act-order weight is stored in its groups' input order: column j is input perm[j].
            if let Some((_, p)) = loaded.tensor(&format!("{t}_perm")) {
                let perm: Vec<usize> = f32s(p).iter().map(|&v| v as usize).collect();
                assert_eq!(name, "gptq-act-order", "{name}: only act-order weights are permuted");
                want = want
                    .chunks_exact(perm.len())
                    .flat_map(|r| perm.iter().map(|&i| r[i]))
                    .collect();
            }
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "{name} {hf} value {i}: {g} vs the library's {w}"
                );
            }
        }
        // Every linear weight kept in the format: 8.25 (FP8, INT8), 4.3125 (int4) or 2.0625 (BitNet's
        // ternary, as TQ2_0) bits per weight.
        let (mut bytes, mut weights) = (0u64, 0usize);
        for f in ["layer_000.bin", "layer_001.bin"] {
            for t in &store.manifest.file(f).unwrap().tensors {
                if t.dtype == dtype {
                    bytes += t.size;
                    weights += t.shape.iter().product::<usize>();
                }
            }
        }
        assert_eq!(weights, 1_179_648, "{name}: every linear weight kept");
        let bits = 8.0 * bytes as f64 / weights as f64;
        assert_eq!(bits, 8.0 * dtype.block_bytes() as f64 / dtype.block_elems() as f64, "{name}");
        assert!(bits <= 8.25, "{name}: {bits} bits per weight");
    }
}

#[test]
fn every_layout_gives_transformers_tokens_in_run() {
    for (name, _) in FORMATS {
        let dir = tempfile::tempdir().unwrap();
        let store = import(&fixtures().join("prequant").join(name), dir.path());
        if name.starts_with("bitnet") {
            check_bitlinear(name, &store);
        } else {
            check_model_against_goldens(&format!("prequant/{name}"), &store);
        }
    }
}

/// How far BitLinear's 8-bit activations let two correct f32 implementations drift: each
/// projection's input is rounded to one of 255 levels, so a value within a float ulp of a level
/// boundary lands on the other level when our RMSNorm's last bit differs from torch's (measured
/// on the `bitnet` fixture: one of the first row's 256 values, at 63.500004 vs 63.499995 levels),
/// and a level moves this tiny random model's logits by up to ~0.08. Logits are compared within
/// this, and greedy tokens until the golden's top-2 gap falls below it.
const BITLINEAR_TOL: f64 = 0.2;

/// The greedy tokens of `got` against the golden's, up to its first gap below `BITLINEAR_TOL`.
fn assert_bitlinear_greedy(what: &str, g: &Golden, got: &[u32]) -> usize {
    let n = g.top2_gaps.iter().position(|&gap| gap < BITLINEAR_TOL).unwrap_or(g.greedy_ids.len());
    assert_eq!(
        &got[..n],
        &g.greedy_ids[..n],
        "{what}/{}: greedy tokens before a gap of {BITLINEAR_TOL}",
        g.name
    );
    n
}

/// transformers' tokens for a BitNet store, within what 8-bit activations allow (`BITLINEAR_TOL`);
/// the tokenizer and template as every model's.
fn check_bitlinear(name: &str, store: &layerstream_model::Store) {
    let model =
        layerstream_worker::Model::load(layerstream_kernels::CpuBackend::default(), store).unwrap();
    let (mut compared, mut worst) = (0, 0f32);
    for g in goldens(&format!("prequant/{name}")) {
        let d = max_abs_diff(
            &prefill_logits(&model, &g.input_ids),
            &reference_logits(&format!("prequant/{name}"), &g.name),
        );
        assert!((d as f64) < BITLINEAR_TOL, "{name}/{}: prefill logits differ by {d}", g.name);
        worst = worst.max(d);
        compared += assert_bitlinear_greedy(name, &g, &run_golden(&store.dir, &g));
    }
    eprintln!(
        "{name}: prefill logits within {worst} of transformers, {compared} greedy tokens compared"
    );
    assert!(compared >= 2, "{name}: too few tokens above the tolerance to compare");
}

/// Streamed through shared memory to two workers (no layer resident), the same tokens.
#[test]
fn every_layout_streams_through_a_two_worker_stack() {
    for (name, _) in FORMATS {
        let dir = tempfile::tempdir().unwrap();
        let store = import(&fixtures().join("prequant").join(name), dir.path());
        let stack = Stack::up(&store.dir, &["--workers", "2", "--resident-layers", "0"]);
        for g in goldens(&format!("prequant/{name}")) {
            let args = golden_args(&g, g.greedy_ids.len());
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let v = submit(stack.addr(), &args);
            let got: Vec<u32> = serde_json::from_value(v["output_ids"].clone()).unwrap();
            if name.starts_with("bitnet") {
                // The same tokens as `run` (one implementation, streamed or not), and transformers'
                // within BITLINEAR_TOL.
                assert_eq!(got, run_golden(&store.dir, &g), "{name}/{}: streamed vs run", g.name);
                assert_bitlinear_greedy(&format!("{name} streamed"), &g, &got);
            } else {
                assert_greedy(&format!("prequant/{name} streamed"), &g, &got);
            }
            assert!(v["stats"]["bytes_streamed"].as_u64().unwrap() > 0, "{name}: nothing streamed");
        }
        stack.shutdown();
    }
}

/// A safetensors entry: element type, shape, bytes.
type Entry = (safetensors::Dtype, Vec<usize>, Vec<u8>);

/// Copies a fixture and lets `edit` change its config and tensors.
fn edited(
    dir: &std::path::Path,
    name: &str,
    edit_config: impl FnOnce(&mut serde_json::Value),
    edit_tensor: impl Fn(&str, &mut Entry),
) -> std::path::PathBuf {
    let src = fixtures().join("prequant").join(name);
    let out = dir.join(name);
    std::fs::create_dir_all(&out).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), out.join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    edit_config(&mut cfg);
    std::fs::write(out.join("config.json"), cfg.to_string()).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Entry)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect();
    for (n, t) in tensors.iter_mut() {
        edit_tensor(n, t);
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, (d, s, b))| {
            (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &out.join("model.safetensors")).unwrap();
    out
}

#[test]
fn bad_quantized_checkpoints_name_the_tensor_or_field() {
    let dir = tempfile::tempdir().unwrap();
    let k = "model.layers.0.self_attn.k_proj";
    let none = |_: &str, _: &mut Entry| {};
    let cases: Vec<(std::path::PathBuf, String)> = vec![
        (
            edited(
                dir.path().join("a").as_path(),
                "awq",
                |c| c["quantization_config"]["quant_method"] = "hqq".into(),
                none,
            ),
            "quantization_config.quant_method".into(),
        ),
        (
            edited(
                dir.path().join("b").as_path(),
                "awq",
                |c| c["quantization_config"]["group_size"] = 64.into(),
                none,
            ),
            "group size 64".into(),
        ),
        (
            edited(
                dir.path().join("c").as_path(),
                "fp8-block",
                |_| {},
                |n, t| {
                    if n == format!("{k}.weight_scale_inv") {
                        *t = (safetensors::Dtype::F32, vec![2, 2], vec![0; 16]);
                    }
                },
            ),
            format!("{k}.weight_scale_inv"),
        ),
        (
            edited(
                dir.path().join("d").as_path(),
                "gptq",
                |_| {},
                |n, t| {
                    if n == format!("{k}.g_idx") {
                        t.2[..4].copy_from_slice(&7i32.to_le_bytes());
                    }
                },
            ),
            format!("{k}.g_idx"),
        ),
        (
            edited(
                dir.path().join("e").as_path(),
                "ct-w4a16",
                |_| {},
                |n, t| {
                    if n == format!("{k}.weight_packed") {
                        t.1 = vec![64, 32];
                        t.2.truncate(64 * 32 * 4);
                    }
                },
            ),
            format!("{k}.weight_packed"),
        ),
        (
            edited(
                dir.path().join("f").as_path(),
                "gptq-act-order",
                |_| {},
                |n, t| {
                    if n == format!("{k}.g_idx") {
                        // Groups of uneven size: input 0 moved to the other group.
                        let g = i32::from_le_bytes(t.2[..4].try_into().unwrap());
                        t.2[..4].copy_from_slice(&(1 - g).to_le_bytes());
                    }
                },
            ),
            "inputs, not 128".into(),
        ),
        (
            edited(
                dir.path().join("g").as_path(),
                "ct-w4a16",
                |c| {
                    c["quantization_config"]["config_groups"]["group_0"]["format"] =
                        "marlin-24".into()
                },
                none,
            ),
            "config_groups.group_0.format".into(),
        ),
    ];
    for (src, want) in cases {
        let out = dir.path().join("store");
        let err = layerstream_fails(&["import", src.to_str().unwrap(), out.to_str().unwrap()]);
        assert!(err.contains(&want), "{}: {err}", src.display());
        assert!(!out.exists() && !dir.path().join("store.partial").exists(), "nothing left behind");
    }
}
