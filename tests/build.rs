//! Which Python clients the client tests can drive, decided when the tests are built, so that
//! `cargo test` counts a test it cannot run as ignored — with the package to install — never as
//! passed: `have_clients` (openai, jsonschema), `have_frameworks` (openai-agents, pydantic-ai,
//! instructor, langchain-openai, smolagents), `have_lm_eval`. Where a package must be there
//! (`LAYERSTREAM_REQUIRE_CLIENTS` / `LAYERSTREAM_REQUIRE_FRAMEWORKS`, as CI sets them after
//! installing) its absence fails the build instead. A pip install changes site-packages, which
//! makes the choice again.
//!
//! The same for the programs some tests drive (`have_prometheus`, `have_chromium`, `have_grpcurl`,
//! `have_openssl`: found on PATH; installing one changes a PATH directory, which makes the choice
//! again) and for a GPU (`have_gpu`: the CUDA driver's libcuda.so.1 in the linker cache or beside
//! /dev/nvidia0), so a test that needs one is ignored, naming it, where it is missing.
//!
//! And for what some tests do to the machine: `is_root` (euid 0), `have_setpriv` (root with
//! setpriv: act as another user), `have_unshare` (root with unshare and mount: a private mount
//! namespace with a tmpfs) and `have_memory_cgroup` (a memory cgroup, v1 or v2, can be made here:
//! one is made and removed to see).

use std::process::Command;

/// The (cfg, Python modules, variable that requires them) triples.
const CLIENTS: [(&str, &str, &str); 3] = [
    ("have_clients", "openai, jsonschema", "LAYERSTREAM_REQUIRE_CLIENTS"),
    (
        "have_frameworks",
        "agents, pydantic_ai, instructor, langchain_openai, smolagents",
        "LAYERSTREAM_REQUIRE_FRAMEWORKS",
    ),
    ("have_lm_eval", "lm_eval", "LAYERSTREAM_REQUIRE_FRAMEWORKS"),
];

fn python(code: &str) -> Option<String> {
    let o = Command::new("python3").args(["-c", code]).output().ok()?;
    o.status.success().then(|| String::from_utf8_lossy(&o.stdout).trim().to_owned())
}

/// The (cfg, program names: any one will do) pairs.
const PROGRAMS: [(&str, &[&str]); 4] = [
    ("have_prometheus", &["prometheus"]),
    ("have_chromium", &["chromium", "chromium-browser", "google-chrome"]),
    ("have_grpcurl", &["grpcurl"]),
    ("have_openssl", &["openssl"]),
];

/// Whether an executable `name` is in one of PATH's directories.
fn on_path(name: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).any(|d| {
        std::fs::metadata(d.join(name))
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

include!("../kernels/build_gpu.rs");

/// Whether this build runs as root (euid 0).
fn root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

/// Whether a memory cgroup can be made here: v1 under /sys/fs/cgroup/memory, else v2 with the
/// memory controller; one is made, given a limit and removed.
fn memory_cgroup() -> bool {
    let tries =
        [("/sys/fs/cgroup/memory", "memory.limit_in_bytes"), ("/sys/fs/cgroup", "memory.max")];
    tries.iter().any(|(root, limit)| {
        let dir =
            std::path::Path::new(root).join(format!("layerstream-build-{}", std::process::id()));
        let ok = std::fs::create_dir(&dir).is_ok()
            && std::fs::write(dir.join(limit), (64u64 << 20).to_string()).is_ok();
        let _ = std::fs::remove_dir(&dir);
        ok
    })
}

/// The capabilities of the machine (see the module doc).
fn emit_capabilities() {
    let root = root();
    let caps = [
        ("is_root", root),
        ("have_setpriv", root && on_path("setpriv")),
        ("have_unshare", root && on_path("unshare") && on_path("mount")),
        ("have_memory_cgroup", memory_cgroup()),
    ];
    for (cfg, present) in caps {
        println!("cargo::rustc-check-cfg=cfg({cfg})");
        if present {
            println!("cargo::rustc-cfg={cfg}");
        }
    }
}

fn main() {
    println!("cargo::rerun-if-env-changed=PATH");
    for d in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
        if d.is_dir() {
            println!("cargo::rerun-if-changed={}", d.display());
        }
    }
    for (cfg, names) in PROGRAMS {
        println!("cargo::rustc-check-cfg=cfg({cfg})");
        if names.iter().any(|n| on_path(n)) {
            println!("cargo::rustc-cfg={cfg}");
        }
    }
    println!("cargo::rerun-if-changed=../kernels/build_gpu.rs");
    emit_have_gpu();
    emit_capabilities();
    println!("cargo::rerun-if-changed=build.rs");
    if let Some(dir) = python("import sysconfig; print(sysconfig.get_paths()['purelib'])") {
        println!("cargo::rerun-if-changed={dir}");
    }
    for (cfg, modules, required) in CLIENTS {
        println!("cargo::rustc-check-cfg=cfg({cfg})");
        println!("cargo::rerun-if-env-changed={required}");
        let found = python(&format!("import {modules}")).is_some();
        if found {
            println!("cargo::rustc-cfg={cfg}");
        } else if std::env::var_os(required).is_some() {
            panic!("{required} is set but `import {modules}` fails in python3");
        }
    }
}
