//! What a request, a disk or a neighbour does must not take the stack down (the outside probe's
//! findings, each as it found it, through real processes and users' tools): hostile output formats
//! over HTTP and gRPC are refused naming the limit while the stack keeps serving; pydantic `$defs`
//! in tool parameters work; a message that does not decode is INVALID_ARGUMENT; shared-memory
//! names squatted by another user stop nothing; one peer holding connections cannot lock out
//! another; the API key stays off every command line; tenants do not share prefix blocks; a full
//! journal disk degrades and heals; a /dev/shm too small is named at start.

use layerstream_tests::stack::*;
use layerstream_tests::*;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// `curl` of `path` with a JSON `body` (and headers); returns (HTTP status, body as JSON or text).
fn chat(text: &str, extra: serde_json::Value) -> serde_json::Value {
    let mut b = serde_json::json!({"model": "m", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": text}]});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

fn health(stack: &Stack) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-sS", "-w", "\n%{http_code}", &format!("{}/health", stack.http())])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = out.rsplit_once('\n').unwrap();
    (code.trim().parse().unwrap(), body.to_owned())
}

/// A command (program and arguments to add) run in a private mount namespace where `at` is a
/// fresh tmpfs of `size`.
fn in_tmpfs(at: &Path, size: &str) -> Command {
    let mut c = Command::new("unshare");
    c.args(["-m", "--propagation", "private", "sh", "-c"])
        .arg(format!("mount -t tmpfs -o size={size} tmpfs {} && exec \"$0\" \"$@\"", at.display()));
    c
}

fn chain_grammar(n: usize) -> String {
    let mut g = String::from("start: r0\n");
    for i in 0..n {
        g.push_str(&format!("r{i}: r{}\n", i + 1));
    }
    g + &format!("r{n}: \"end\"\n")
}

fn ref_chain(n: usize) -> serde_json::Value {
    let mut defs = serde_json::Map::new();
    for i in 0..n {
        let next = format!("#/$defs/d{}", i + 1);
        defs.insert(
            format!("d{i}"),
            serde_json::json!({"type": "object", "properties": {"x": {"$ref": next}}}),
        );
    }
    defs.insert(format!("d{n}"), serde_json::json!({"type": "string"}));
    serde_json::json!({"$ref": "#/$defs/d0", "$defs": defs})
}

/// The probe's crashing formats, six times each way (six crashes used to stop the stack): 400s
/// naming `response_format` and the limit, gRPC INVALID_ARGUMENT, the same coordinator serving
/// throughout; a tool with pydantic `$defs` under `tool_choice` required is called.
#[test]
fn hostile_formats_are_refused_and_the_stack_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let stack = Stack::up(&store, &["--workers", "1", "--served-model-name", "m"]);
    let coordinator = stack.children("coordinator");
    let alternatives = format!(
        "start: {}\n",
        (0..5_000).map(|i| format!("\"w{i}\"")).collect::<Vec<_>>().join(" | ")
    );
    let cases = [
        (serde_json::json!({"type": "grammar", "grammar": chain_grammar(700)}), "chain of rules"),
        (
            serde_json::json!({"type": "json_schema", "json_schema": {"name": "x", "schema": ref_chain(300)}}),
            "nesting",
        ),
        (serde_json::json!({"type": "grammar", "grammar": alternatives}), "alternatives"),
    ];
    for (format, limit) in &cases {
        for _ in 0..6 {
            let (code, body) = stack.post(
                "/v1/chat/completions",
                &chat("hi", serde_json::json!({"response_format": format})),
                &[],
            );
            assert_eq!(code, 400, "{body}");
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["error"]["param"], "response_format", "{v}");
            let msg = v["error"]["message"].as_str().unwrap();
            assert!(msg.contains(limit) && msg.contains("limit"), "{msg}");
        }
    }
    // The same over gRPC: INVALID_ARGUMENT naming the limit, six times.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        use layerstream_rpc::v1::*;
        let mut c =
            coordinator_client::CoordinatorClient::connect(stack.addr().to_owned()).await.unwrap();
        for _ in 0..6 {
            let r = GenerateRequest {
                input: Some(generate_request::Input::Prompt("hi".into())),
                format: Some(OutputFormat {
                    kind: Some(output_format::Kind::Lark(chain_grammar(700))),
                }),
                ..Default::default()
            };
            let Err(e) = c.generate(r).await else { panic!("accepted") };
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
            assert!(e.message().contains("chain of rules"), "{}", e.message());
        }
    });
    // pydantic's nested models: `$defs` referenced from the parameters.
    let tool = serde_json::json!({"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "$defs": {"City": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}},
        "required": ["name"], "additionalProperties": false}},
        "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"], "additionalProperties": false}}});
    let body = chat(
        "Pick a city.",
        serde_json::json!({"tools": [tool], "tool_choice": "required", "max_tokens": 40}),
    );
    let (code, text) = stack.post("/v1/chat/completions", &body, &[]);
    assert_eq!(code, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let call = &v["choices"][0]["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "pick", "{v}");
    let args: serde_json::Value =
        serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert!(args["city"]["name"].is_string(), "{args}");
    // Still the same coordinator, healthy, answering.
    assert_eq!(stack.children("coordinator"), coordinator, "the coordinator was restarted");
    assert_eq!(health(&stack).0, 200);
    let (code, text) =
        stack.post("/v1/chat/completions", &chat("hello", serde_json::json!({})), &[]);
    assert_eq!(code, 200, "{text}");
    stack.shutdown();
}

/// A `GenerateRequest` whose prompt bytes are not UTF-8, sent as raw protobuf over a real gRPC
/// call: INVALID_ARGUMENT naming UTF-8 (it was INTERNAL).
#[test]
fn a_message_that_does_not_decode_is_invalid_argument() {
    #[derive(Clone, PartialEq, prost::Message)]
    struct RawRequest {
        #[prost(bytes = "vec", tag = "1")]
        prompt: Vec<u8>,
    }
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let stack = Stack::up(&store, &["--workers", "1"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let status = rt.block_on(async {
        let ch = tonic::transport::Endpoint::from_shared(stack.addr().to_owned())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut g = tonic::client::Grpc::new(ch);
        g.ready().await.unwrap();
        let path = tonic::codegen::http::uri::PathAndQuery::from_static(
            "/layerstream.v1.Coordinator/Generate",
        );
        let codec = tonic_prost::ProstCodec::<RawRequest, RawRequest>::default();
        let req = tonic::Request::new(RawRequest { prompt: vec![b'h', 0xff, 0xfe, b'i'] });
        let Err(e) = g.server_streaming(req, path, codec).await else { panic!("accepted") };
        e
    });
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("UTF-8"), "{}", status.message());
    stack.shutdown();
}

/// Another user (nobody) pre-creates 40 hand-off names of each worker in the old predictable
/// scheme and 40 more: every request still answers, over a 2-worker stack whose hidden states go
/// through shared memory; the regions the stack makes are 0600 with a random tag.
#[test]
#[cfg_attr(not(have_setpriv), ignore = "needs root and setpriv (names taken by another user)")]
fn squatted_shared_memory_names_stop_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let stack = Stack::up(&store, &["--workers", "2", "--served-model-name", "m"]);
    let mut squatted = Vec::new();
    for pid in stack.children("worker") {
        for n in 0..40 {
            squatted.push(format!("/dev/shm/layerstream-hidden-{pid}-{n}"));
        }
    }
    for _ in 0..40 {
        squatted.push(format!("/dev/shm/layerstream-hidden-{}-0", std::process::id()));
    }
    let as_nobody = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "touch"])
        .args(&squatted)
        .status();
    assert!(as_nobody.is_ok_and(|s| s.success()), "setpriv could not create files as nobody");
    for i in 0..4 {
        let (code, body) = stack.post(
            "/v1/chat/completions",
            &chat(&format!("Say {i}."), serde_json::json!({})),
            &[],
        );
        assert_eq!(code, 200, "{body}");
    }
    let mine: Vec<String> = shm_left(layerstream_shm::HIDDEN_PREFIX)
        .into_iter()
        .filter(|n| {
            stack
                .children("worker")
                .iter()
                .any(|p| n.starts_with(&format!("layerstream-hidden-{p}-")))
        })
        .filter(|n| !squatted.iter().any(|s| s.ends_with(n.as_str())))
        .collect();
    assert!(!mine.is_empty(), "the workers hand hidden states through shared memory");
    for n in &mine {
        use std::os::unix::fs::PermissionsExt;
        let tag = n.rsplit('-').next().unwrap();
        assert!(tag.len() == 16 && tag.chars().all(|c| c.is_ascii_hexdigit()), "{n}");
        let mode = std::fs::metadata(format!("/dev/shm/{n}")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{n}");
    }
    for s in &squatted {
        let _ = std::fs::remove_file(s);
    }
    stack.shutdown();
}

/// 8 HTTP connections at most, so 4 per peer: a peer holding idle connections is refused past
/// its share, while another peer (127.0.0.2) is still served.
#[test]
fn one_peer_cannot_lock_out_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let stack = Stack::up(&store, &["--workers", "1", "--http-max-connections", "8"]);
    let addr = stack.http().trim_start_matches("http://").to_owned();
    let held: Vec<std::net::TcpStream> =
        (0..8).map(|_| std::net::TcpStream::connect(&addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(300));
    let from = |ip: &str| {
        Command::new("curl")
            .args([
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--max-time",
                "5",
                "--interface",
                ip,
            ])
            .arg(format!("{}/health", stack.http()))
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    };
    assert_eq!(from("127.0.0.2"), "200", "another peer is served");
    assert_ne!(from("127.0.0.1"), "200", "the greedy peer is past its share");
    drop(held);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(from("127.0.0.1"), "200", "its places came back");
    stack.shutdown();
}

/// Two API keys in a 0600 file (`--api-key-file`): neither appears on any process's command line;
/// each key is served, no key is refused; each key is a tenant of the prefix cache, and
/// `cache_salt` narrows it further — a prompt cached under one is not found under
/// another, and is under the same.
#[test]
fn keys_stay_off_command_lines_and_tenants_do_not_share_prefixes() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "# two tenants\nsk-tenant-one\nsk-tenant-two\n").unwrap();
    let stack = Stack::up(
        &store,
        &["--workers", "1", "--served-model-name", "m", "--api-key-file", keys.to_str().unwrap()],
    );
    let mut pids = vec![stack.proc.child.id() as i32];
    for w in ["coordinator", "worker", "loader-daemon"] {
        pids.extend(stack.children(w));
    }
    assert!(pids.len() >= 4, "{pids:?}");
    for p in &pids {
        let cmd = std::fs::read_to_string(format!("/proc/{p}/cmdline")).unwrap_or_default();
        assert!(!cmd.contains("sk-tenant"), "a key on the command line of {p}: {cmd:?}");
    }
    let long = "The loader daemon reads each layer file from disk into shared memory before the \
        workers need it, so the copy to the device overlaps the compute of the previous layer.";
    let ask = |key: &str, salt: Option<&str>| -> (u16, u64) {
        let extra = match salt {
            Some(s) => serde_json::json!({"cache_salt": s}),
            None => serde_json::json!({}),
        };
        let auth = format!("authorization: Bearer {key}");
        let (code, body) = stack.post("/v1/chat/completions", &chat(long, extra), &[&auth]);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        (code, v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0))
    };
    assert_eq!(ask("sk-wrong", None).0, 401);
    assert_eq!(ask("sk-tenant-one", None), (200, 0));
    let (code, cached) = ask("sk-tenant-one", None);
    assert!(code == 200 && cached >= 16, "the same tenant finds its prefix: {cached}");
    assert_eq!(ask("sk-tenant-two", None), (200, 0), "another tenant does not");
    assert_eq!(ask("sk-tenant-one", Some("private")), (200, 0), "another salt does not");
    let (_, cached) = ask("sk-tenant-one", Some("private"));
    assert!(cached >= 16, "the same salt does: {cached}");
    stack.shutdown();
}

/// `layerstream up` in a private mount namespace whose runtime directory (the journal's home) is
/// a 4 MiB tmpfs: with the disk full, a request with an idempotency key is 503 naming the
/// journal, one without still answers, `/health` says degraded; with room again both answer and
/// `/health` is ok — no restart.
#[test]
#[cfg_attr(not(have_unshare), ignore = "needs root, unshare and mount (a private tmpfs)")]
fn a_full_journal_disk_degrades_and_heals() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let run = dir.path().join("run");
    std::fs::create_dir(&run).unwrap();
    let probe = in_tmpfs(&run, "4m").arg("true").status();
    assert!(probe.is_ok_and(|s| s.success()), "unshare could not mount a private tmpfs");
    let mut cmd = in_tmpfs(&run, "4m");
    cmd.arg(bin())
        .args([
            "up",
            "--model",
            store.to_str().unwrap(),
            "--workers",
            "1",
            "--listen",
            "127.0.0.1:0",
        ])
        .args(["--http-listen", "127.0.0.1:0", "--served-model-name", "m"])
        .env("XDG_RUNTIME_DIR", &run)
        .env("LAYERSTREAM_EXACT", "true")
        .env(layerstream_rpc::auth::INTERNAL_TOKEN_ENV, INTERNAL_TOKEN);
    let stack = Stack { proc: Proc::spawn(cmd) };
    // The tmpfs as `up` sees it, from outside its mount namespace.
    let inside = Path::new("/proc")
        .join(stack.proc.child.id().to_string())
        .join("root")
        .join(run.strip_prefix("/").unwrap());
    let filler = inside.join("filler");
    let keyed = |k: &str| {
        stack.post(
            "/v1/chat/completions",
            &chat("hi", serde_json::json!({})),
            &[&format!("idempotency-key: {k}")],
        )
    };
    assert_eq!(keyed("before").0, 200);
    // Fill it: the write fails once the tmpfs is full.
    let _ = Command::new("dd")
        .args(["if=/dev/zero", "bs=64k", "count=1000"])
        .arg(format!("of={}", filler.display()))
        .output();
    let mut refused = None;
    for i in 0..20 {
        let (code, body) = keyed(&format!("full-{i}"));
        if code == 503 {
            refused = Some(body);
            break;
        }
    }
    let body = refused.expect("a keyed request refused while the journal's disk is full");
    assert!(body.contains("journal") && body.contains("retry"), "{body}");
    let (code, h) = health(&stack);
    assert!(code == 200 && h.contains("degraded") && h.contains("journal"), "{code} {h}");
    let (code, body) = stack.post("/v1/chat/completions", &chat("hi", serde_json::json!({})), &[]);
    assert_eq!(code, 200, "a request without a key still answers: {body}");
    std::fs::remove_file(&filler).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    for n in 0.. {
        let (code, body) = keyed(&format!("after-{n}"));
        if code == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "the journal did not heal: {code} {body}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let (code, h) = health(&stack);
    assert!(code == 200 && h.contains("\"ok\""), "{code} {h}");
    stack.shutdown();
}

/// `up` with a /dev/shm of 64 KiB (a private tmpfs): refused at start, naming the bytes needed and
/// how to give them (`shm_size`), not a death by SIGBUS.
#[test]
#[cfg_attr(not(have_unshare), ignore = "needs root, unshare and mount (a private /dev/shm)")]
fn a_dev_shm_too_small_is_named_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let store = tiny_store(dir.path());
    let out = in_tmpfs(Path::new("/dev/shm"), "64k")
        .arg(bin())
        .args([
            "up",
            "--model",
            store.to_str().unwrap(),
            "--workers",
            "1",
            "--listen",
            "127.0.0.1:0",
        ])
        .args(["--http-listen", "off", "--prompt", "hi"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("/dev/shm has") && err.contains("shm_size"), "{err}");
    assert!(!err.contains("SIGBUS"), "{err}");
}
