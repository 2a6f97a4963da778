//! Any bytes as a store's manifest.json: opening and verifying end in Ok or an error.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("manifest.json"), data).unwrap();
    if let Ok(store) = layerstream_model::Store::open(dir.path()) {
        let _ = store.verify();
        let _ = store.tokenizer();
    }
});
