//! Any bytes as a GGUF file: importing them ends in Ok or an error, never a panic or a hang.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("in.gguf");
    std::fs::write(&src, data).unwrap();
    if layerstream_model::import::import(&src, &dir.path().join("store"), false).is_ok() {
        let store = layerstream_model::Store::open(&dir.path().join("store")).unwrap();
        let _ = store.verify();
    }
});
