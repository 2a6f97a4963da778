//! Every llama.cpp file type end to end: a tiny Llama written by llama.cpp's converter and
//! `llama-quantize` as Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K_M, Q4_K_M, Q5_K_M, Q6_K, IQ4_NL and
//! IQ4_XS (mixtures of the block types those file types use, fallbacks included), and a ternary
//! (BitNet b1.58 style) tiny Llama as TQ1_0 and TQ2_0 and with every tensor MXFP4, each imported
//! and run, equal to
//! transformers (f32) on the weights gguf-py dequantizes back from that very file
//! (tests/fixtures/quant_models/gen.py, gen_ternary.py).

use layerstream_tests::*;

const TYPES: [&str; 15] = [
    "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_NL",
    "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4",
];

#[test]
fn every_llama_cpp_file_type_matches_transformers_on_its_own_weights() {
    for t in TYPES {
        let dir = tempfile::tempdir().unwrap();
        let gguf = fixtures().join("gguf").join("quant").join(format!("tiny-llama-{t}.gguf"));
        let store = import(&gguf, dir.path());
        store.verify().unwrap();
        // The file type's blocks are kept as they are in the store (not converted).
        let q = store.manifest.file("layer_000.bin").unwrap().tensor("q").unwrap().dtype;
        assert!(q.is_quantized(), "{t}: q stored as {q}");
        // Numerics only: this Llama-converted file carries Llama's space-prefix convention while the
        // goldens were tokenized by the (Gemma-style) HF tokenizer; tokenizers are checked by
        // tests/vocab.rs and the models' own tests.
        check_numerics_against_goldens(&format!("tiny-llama-quant/{t}"), &store);
    }
}
