//! Every GGML block format layerstream stores, dequantized by the CPU kernels, against gguf-py's
//! reference dequantization of the same blocks — blocks llama.cpp's `llama-quantize` wrote
//! (`fixtures/quant/gen.sh` regenerates both). The CUDA
//! kernels are checked against the CPU ones (`kernels/src/cuda/tests_emu.rs` under the host
//! emulator, `tests_gpu.rs` on a GPU), so this anchors both to the format's definition.

use layerstream_kernels::quant::dequant_row;
use layerstream_model::DType;
use layerstream_tests::fixtures;

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

#[test]
fn every_quantized_format_dequantizes_as_gguf_py_does() {
    let dir = fixtures().join("quant");
    let mut checked = Vec::new();
    // (The pre-quantized checkpoints' formats, which GGUF has no type for, are checked against
    // their own libraries in tests/prequant.rs.)
    for dtype in DType::ALL.into_iter().filter(|d| d.is_quantized() && d.ggml_type().is_some()) {
        let name = dtype.name();
        let blocks = std::fs::read(dir.join(format!("{name}.blocks"))).unwrap_or_else(|e| {
            panic!("{name}: no reference blocks ({e}); run fixtures/quant/gen.py")
        });
        let want = f32s(&std::fs::read(dir.join(format!("{name}.f32"))).unwrap());
        assert_eq!(blocks.len() / dtype.block_bytes() * dtype.block_elems(), want.len(), "{name}");
        let mut got = vec![f32::NAN; want.len()];
        dequant_row(dtype, &blocks, &mut got);
        let mut worst = 0f32;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let err = (g - w).abs();
            // gguf-py multiplies the same factors in numpy, sometimes grouped differently: a
            // rounding or two apart at most.
            assert!(
                err <= 4.0 * f32::EPSILON * w.abs().max(1e-3),
                "{name} value {i}: {g} vs gguf-py {w}"
            );
            worst = worst.max(err);
        }
        checked.push(format!("{name} (max |Δ| {worst:e})"));
    }
    assert_eq!(checked.len(), 15, "{checked:?}");
    eprintln!("checked against gguf-py: {}", checked.join(", "));
}

/// A store of every format llama.cpp's other file types use (random weights of the `tiny` shape,
/// whose rows are whole 256-value blocks) runs through `layerstream run` and through a 2-worker
/// stack that streams every layer, with the same tokens: the format crosses the store, the loader's
/// shared memory and the worker's kernels intact.
#[test]
fn stores_of_the_added_formats_run_alone_and_streamed_alike() {
    use layerstream_tests::stack::{submit, Stack};
    use layerstream_tests::{last_json, layerstream};
    let dir = tempfile::tempdir().unwrap();
    for dtype in [
        "q5_0",
        "q5_1",
        "q2_k",
        "q3_k",
        "q5_k",
        "iq4_nl",
        "iq4_xs",
        "tq1_0",
        "tq2_0",
        "mxfp4",
        "fp8_e4m3_b128",
        "int8_b128",
        "int4_g128",
    ] {
        let store = dir.path().join(dtype);
        let s = store.to_str().unwrap();
        layerstream(&["synth", "--shape", "tiny", "--dtype", dtype, "--layers", "2", s]);
        let args = ["--token-ids", "5,6,7,8", "--max-new-tokens", "6", "--ignore-eos"];
        let mut run = vec!["run", "--model", s, "--json"];
        run.extend(args);
        let solo = last_json(&layerstream(&run))["output_ids"].clone();
        assert_eq!(solo.as_array().unwrap().len(), 6, "{dtype}: {solo}");
        let stack = Stack::up(&store, &["--workers", "2", "--resident-layers", "0"]);
        let v = submit(stack.addr(), &args);
        assert_eq!(v["output_ids"], solo, "{dtype}: streamed differs from run");
        assert!(v["stats"]["bytes_streamed"].as_u64().unwrap() > 0, "{dtype}: nothing streamed");
        stack.shutdown();
    }
}

/// `--int8-activations` (8-bit activations for Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q6_K weights; the CPU's
/// default unless `--exact`) reaches the kernels
/// both in `run` and in the workers `up` starts: a Q4_1 store gives the same tokens either way, and
/// the dot it computes is checked against its reference and the f32 dot in `cpu::int8`.
#[test]
fn int8_activations_give_the_same_tokens_in_run_and_through_up() {
    use layerstream_tests::stack::{submit, Stack};
    use layerstream_tests::{last_json, layerstream};
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("q4_1");
    let s = store.to_str().unwrap();
    layerstream(&["synth", "--shape", "tiny", "--dtype", "q4_1", "--layers", "2", s]);
    let args = ["--token-ids", "5,6,7,8", "--max-new-tokens", "8", "--ignore-eos"];
    let mut run = vec!["run", "--model", s, "--json", "--int8-activations"];
    run.extend(args);
    let solo = last_json(&layerstream(&run))["output_ids"].clone();
    assert_eq!(solo.as_array().unwrap().len(), 8, "{solo}");
    let stack = Stack::up(&store, &["--workers", "2", "--int8-activations"]);
    for pid in stack.children("worker") {
        let cmd = std::fs::read_to_string(format!("/proc/{pid}/cmdline")).unwrap();
        assert!(cmd.split('\0').any(|a| a == "--int8-activations"), "up did not pass the flag on");
    }
    assert_eq!(submit(stack.addr(), &args)["output_ids"], solo);
    stack.shutdown();
    // They are the CPU's default: without `--exact` (nor LAYERSTREAM_EXACT, which the harness sets)
    // `run` computes as `--int8-activations` does; `--exact` as the harness's f32 runs.
    let raw = |extra: &[&str]| {
        let mut a = vec!["run", "--model", s, "--json"];
        a.extend(args);
        a.extend(extra);
        let out = std::process::Command::new(layerstream_tests::bin())
            .env_remove("LAYERSTREAM_EXACT")
            .args(&a)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        last_json(&String::from_utf8(out.stdout).unwrap())["output_ids"].clone()
    };
    assert_eq!(raw(&[]), solo, "8-bit activations are the CPU default");
    let mut exact = vec!["run", "--model", s, "--json"];
    exact.extend(args);
    assert_eq!(raw(&["--exact"]), last_json(&layerstream(&exact))["output_ids"]);
}
