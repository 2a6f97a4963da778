//! Which Python clients the client tests can drive, decided when the tests are built, so that
//! `cargo test` counts a test it cannot run as ignored — with the package to install — never as
//! passed: `have_clients` (openai, jsonschema), `have_frameworks` (openai-agents, pydantic-ai,
//! instructor, langchain-openai, smolagents), `have_lm_eval`. Where a package must be there
//! (`LAYERSTREAM_REQUIRE_CLIENTS` / `LAYERSTREAM_REQUIRE_FRAMEWORKS`, as CI sets them after
//! installing) its absence fails the build instead. A pip install changes site-packages, which
//! makes the choice again.

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

fn main() {
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
