//! Bad input gets a clear error naming what is wrong, and leaves nothing behind: truncated and
//! corrupt store files, unknown architectures, wrong shapes, bad requests.

use layerstream_tests::*;
use std::path::Path;

fn only_entry(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn truncated_layer_file_is_named_with_its_offset() {
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir("tiny-llama"), dir.path());
    let f = store.dir.join("layer_002.bin");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&f).unwrap().set_len(len - 4096).unwrap();
    let err = layerstream_fails(&[
        "run",
        "--model",
        store.dir.to_str().unwrap(),
        "--prompt",
        "hi",
        "--max-new-tokens",
        "1",
    ]);
    assert!(
        err.contains("layer_002.bin")
            && err.contains(&format!("offset {}", len - 4096))
            && err.contains("truncated"),
        "{err}"
    );
}

#[test]
fn corrupt_tensor_is_named_by_verify() {
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir("tiny-llama"), dir.path());
    let f = store.dir.join("layer_001.bin");
    let t = store.manifest.file("layer_001.bin").unwrap().tensor("gate").unwrap().clone();
    let mut bytes = std::fs::read(&f).unwrap();
    bytes[t.offset as usize + 10] ^= 0xFF;
    std::fs::write(&f, bytes).unwrap();
    let err = layerstream_fails(&["verify", store.dir.to_str().unwrap()]);
    assert!(
        err.contains("layer_001.bin")
            && err.contains(&format!("offset {}", t.offset))
            && err.contains("tensor gate"),
        "{err}"
    );
}

#[test]
fn unknown_architecture_lists_supported_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let hf = copy_hf_with_config(dir.path(), |c| {
        c["architectures"] = serde_json::json!(["FalconForCausalLM"])
    });
    let dst = dir.path().join("out");
    let err = layerstream_fails(&["import", hf.to_str().unwrap(), dst.to_str().unwrap()]);
    assert!(
        err.contains("FalconForCausalLM")
            && err.contains("LlamaForCausalLM")
            && err.contains("Qwen3ForCausalLM"),
        "{err}"
    );
    assert_eq!(only_entry(dir.path()), vec!["hf"]);
}

#[test]
fn wrong_shape_names_the_tensor_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let hf = copy_hf_with_config(dir.path(), |c| c["intermediate_size"] = serde_json::json!(128));
    let dst = dir.path().join("out");
    let err = layerstream_fails(&["import", hf.to_str().unwrap(), dst.to_str().unwrap()]);
    assert!(
        err.contains("model.layers.0.mlp.gate_proj.weight")
            && err.contains("[160, 64]")
            && err.contains("[128, 64]"),
        "{err}"
    );
    assert_eq!(only_entry(dir.path()), vec!["hf"]);
}

#[test]
fn import_refuses_a_non_empty_destination() {
    let dir = tempfile::tempdir().unwrap();
    let dst = dir.path().join("out");
    std::fs::create_dir_all(&dst).unwrap();
    std::fs::write(dst.join("keep.txt"), "mine").unwrap();
    let err = layerstream_fails(&[
        "import",
        model_dir("tiny-llama").to_str().unwrap(),
        dst.to_str().unwrap(),
    ]);
    assert!(err.contains("not empty"), "{err}");
    assert_eq!(std::fs::read_to_string(dst.join("keep.txt")).unwrap(), "mine");
}

#[test]
fn bad_requests_are_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir("tiny-llama"), dir.path());
    let s = store.dir.to_str().unwrap();
    let err = layerstream_fails(&[
        "run",
        "--model",
        s,
        "--token-ids",
        "1,99999",
        "--max-new-tokens",
        "1",
    ]);
    assert!(err.contains("99999") && err.contains("vocabulary"), "{err}");
    let err =
        layerstream_fails(&["run", "--model", s, "--prompt", "hi", "--max-new-tokens", "5000"]);
    assert!(err.contains("context of 2048"), "{err}");
    let err = layerstream_fails(&["run", "--model", s, "--prompt", "hi", "--top-p", "0"]);
    assert!(err.contains("top_p"), "{err}");
    let err =
        layerstream_fails(&["run", "--model", dir.path().to_str().unwrap(), "--prompt", "hi"]);
    assert!(err.contains("not a layer store"), "{err}");
}

/// A newcomer's first mistakes get errors that say what to do: no server at the address, a CUDA
/// device asked of a build without CUDA, an unknown device.
#[test]
fn friendly_errors_for_no_server_and_unavailable_devices() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("http://127.0.0.1:{port}");
    let err = layerstream_fails(&["submit", "--addr", &addr, "--prompt", "hi"]);
    assert!(
        err.contains(&format!("no coordinator answers at {addr}"))
            && err.contains("layerstream up"),
        "{err}"
    );
    if !cfg!(feature = "cuda") {
        for cmd in [
            &["up", "--device", "cuda:0"][..],
            &["bench", "--device", "cuda:0"],
            &["run", "--device", "cuda:0", "--prompt", "hi"],
        ] {
            let err = layerstream_fails(cmd);
            assert!(
                err.contains("built without CUDA") && err.contains("--features cuda"),
                "{cmd:?}: {err}"
            );
        }
    }
    let err = layerstream_fails(&["up", "--device", "tpu:0"]);
    assert!(err.contains("unknown device"), "{err}");
}

/// What a hostile or broken checkpoint directory can hold is refused at `import`, naming it, with
/// nothing left behind: a `weight_map` pointing outside the directory, a FIFO named as a shard or
/// as the GGUF file (which would block a reader forever), a NaN `rope_theta`, a chat template
/// that cannot be rendered.
#[test]
fn hostile_checkpoints_are_refused_at_import_and_leave_nothing() {
    let fifo = |p: &Path| {
        let ok = std::process::Command::new("mkfifo").arg(p).status().is_ok_and(|s| s.success());
        assert!(ok, "mkfifo failed");
    };
    let import_fails = |dir: &Path, src: &Path| {
        let dst = dir.join("out");
        let err = layerstream_fails(&["import", src.to_str().unwrap(), dst.to_str().unwrap()]);
        assert!(!dst.exists() && !dir.join("out.partial").exists(), "left a store behind");
        err
    };
    // weight_map with a path outside the model directory.
    let dir = tempfile::tempdir().unwrap();
    let hf = copy_hf_with_config(dir.path(), |_| {});
    std::fs::write(
        hf.join("model.safetensors.index.json"),
        r#"{"weight_map": {"model.embed_tokens.weight": "../../../../etc/passwd"}}"#,
    )
    .unwrap();
    let err = import_fails(dir.path(), &hf);
    assert!(err.contains("../../../../etc/passwd") && err.contains("not a file inside"), "{err}");
    // A FIFO as a shard, and as the GGUF file.
    let dir = tempfile::tempdir().unwrap();
    let hf = copy_hf_with_config(dir.path(), |_| {});
    std::fs::remove_file(hf.join("model.safetensors")).unwrap();
    fifo(&hf.join("model.safetensors"));
    let err = import_fails(dir.path(), &hf);
    assert!(err.contains("model.safetensors") && err.contains("not a regular file"), "{err}");
    let gguf = dir.path().join("pipe.gguf");
    fifo(&gguf);
    let err = import_fails(dir.path(), &gguf);
    assert!(err.contains("pipe.gguf") && err.contains("not a regular file"), "{err}");
    // A NaN RoPE base (JSON has no NaN: a string is not a number, an overflow is infinite).
    let dir = tempfile::tempdir().unwrap();
    let hf = copy_hf_with_config(dir.path(), |c| c["rope_theta"] = serde_json::json!(-1.0));
    let err = import_fails(dir.path(), &hf);
    assert!(err.contains("rope_theta") && err.contains("finite number > 0"), "{err}");
    // A chat template that fails to render.
    let dir = tempfile::tempdir().unwrap();
    let hf = copy_hf_with_config(dir.path(), |_| {});
    std::fs::write(hf.join("chat_template.jinja"), "{{ raise_exception('no chats here') }}")
        .unwrap();
    let err = import_fails(dir.path(), &hf);
    assert!(err.contains("chat template") && err.contains("no chats here"), "{err}"); // A template that turns a short chat into gigabytes (the probe's bomb): refused at import.
    let dir = tempfile::tempdir().unwrap();
    let hf = copy_hf_with_config(dir.path(), |_| {});
    let bomb = "{% for i in range(100000) %}{% for j in range(100000) %}{{ messages[0]['content'] }}{% endfor %}{% endfor %}";
    std::fs::write(hf.join("chat_template.jinja"), bomb).unwrap();
    let err = import_fails(dir.path(), &hf);
    assert!(err.contains("chat template") && err.contains("exceeds 1048576 bytes"), "{err}");
}

/// Two tensors whose data overlap would read each other's bytes: refused at import, naming both.
#[test]
fn gguf_tensors_with_overlapping_data_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("overlap.gguf");
    let t = |name: &str| (name.to_owned(), vec![8usize], vec![1.0f32; 8]);
    gguf_writer::write_gguf(&gguf, &[], &[t("tensor_one"), t("tensor_two")]);
    // Point the second tensor's offset (after its name, n_dims, one dim and the type) at the first.
    let mut bytes = std::fs::read(&gguf).unwrap();
    let at = bytes.windows(10).position(|w| w == b"tensor_two").unwrap() + 10 + 4 + 8 + 4;
    assert_eq!(bytes[at..at + 8], 32u64.to_le_bytes(), "the writer put it after the first");
    bytes[at..at + 8].copy_from_slice(&0u64.to_le_bytes());
    std::fs::write(&gguf, bytes).unwrap();
    let dst = dir.path().join("store");
    let err = layerstream_fails(&["import", gguf.to_str().unwrap(), dst.to_str().unwrap()]);
    assert!(err.contains("tensor_two") && err.contains("overlaps tensor tensor_one"), "{err}");
    assert!(!dst.exists(), "nothing is written");
}

/// A manifest checksum that is not one is a malformed manifest, not corrupt data at offset 0.
#[test]
fn malformed_manifest_checksums_are_named_as_such() {
    let dir = tempfile::tempdir().unwrap();
    let store = import(&model_dir("tiny-llama"), dir.path());
    let mpath = store.dir.join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    m["files"][1]["checksum"] = "xxh3:zz".into();
    std::fs::write(&mpath, serde_json::to_vec(&m).unwrap()).unwrap();
    let err = layerstream_fails(&["verify", store.dir.to_str().unwrap()]);
    assert!(err.contains("checksum \"xxh3:zz\" is not xxh3:<16 hex digits>"), "{err}");
    assert!(!err.contains("corrupt"), "{err}");
}

/// A store directory the user may not read says so (not "not a layer store"). Root reads any
/// directory, so as root the command runs as `nobody` (setpriv), from a copy of the binary in a
/// directory `nobody` can reach (a checkout may sit under a private one); the store's own
/// directory is made reachable up to the one it denies.
#[test]
#[cfg_attr(
    all(is_root, not(have_setpriv)),
    ignore = "as root it needs setpriv (to read as another user)"
)]
fn an_unreadable_store_says_permission_denied() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &std::path::Path, m| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    mode(dir.path(), 0o755);
    let store = import(&model_dir("tiny-llama"), dir.path());
    mode(&store.dir, 0o000);
    let root = std::fs::metadata(store.dir.join("manifest.json")).is_ok();
    let mut cmd = if root {
        let exe = dir.path().join("layerstream");
        std::fs::hard_link(bin(), &exe).or_else(|_| std::fs::copy(bin(), &exe).map(drop)).unwrap();
        let mut c = std::process::Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups"]).arg(exe);
        c
    } else {
        cmd()
    };
    let out = cmd.args(["verify", store.dir.to_str().unwrap()]).output();
    mode(&store.dir, 0o755);
    let out = out.expect("setpriv runs (the build found it)");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.starts_with("setpriv:"), "{err}");
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("ermission denied") && err.contains("manifest.json"), "{err}");
}
