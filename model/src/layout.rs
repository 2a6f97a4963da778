//! The canonical tensor names of a decoder layer and where each checkpoint format keeps them.
//!
//! One table serves the HF importer, the GGUF importer and the forward pass, so a name is spelled once.

/// A layer tensor: canonical store name, HF suffix, GGUF suffix, required.
pub struct LayerTensor {
    pub name: &'static str,
    pub hf: &'static str,
    pub gguf: &'static str,
    pub required: bool,
}

macro_rules! lt {
    ($name:literal, $hf:literal, $gguf:literal, $req:literal) => {
        LayerTensor { name: $name, hf: $hf, gguf: $gguf, required: $req }
    };
}

/// Every tensor a decoder layer may have, in file order.
pub const LAYER_TENSORS: &[LayerTensor] = &[
    lt!("attn_norm", "input_layernorm.weight", "attn_norm.weight", true),
    lt!("q", "self_attn.q_proj.weight", "attn_q.weight", true),
    lt!("k", "self_attn.k_proj.weight", "attn_k.weight", true),
    lt!("v", "self_attn.v_proj.weight", "attn_v.weight", true),
    lt!("o", "self_attn.o_proj.weight", "attn_output.weight", true),
    lt!("q_bias", "self_attn.q_proj.bias", "attn_q.bias", false),
    lt!("k_bias", "self_attn.k_proj.bias", "attn_k.bias", false),
    lt!("v_bias", "self_attn.v_proj.bias", "attn_v.bias", false),
    lt!("o_bias", "self_attn.o_proj.bias", "attn_output.bias", false),
    lt!("q_norm", "self_attn.q_norm.weight", "attn_q_norm.weight", false),
    lt!("k_norm", "self_attn.k_norm.weight", "attn_k_norm.weight", false),
    lt!("ffn_norm", "post_attention_layernorm.weight", "ffn_norm.weight", true),
    lt!("gate", "mlp.gate_proj.weight", "ffn_gate.weight", true),
    lt!("up", "mlp.up_proj.weight", "ffn_up.weight", true),
    lt!("down", "mlp.down_proj.weight", "ffn_down.weight", true),
];

/// Canonical names of the non-layer tensors and their sources: (store name, HF name, GGUF name).
pub const EMBED: (&str, &str, &str) = ("embed", "model.embed_tokens.weight", "token_embd.weight");
pub const FINAL_NORM: (&str, &str, &str) =
    ("final_norm", "model.norm.weight", "output_norm.weight");
pub const LM_HEAD: (&str, &str, &str) = ("lm_head", "lm_head.weight", "output.weight");

/// File name of layer `i` in a store.
pub fn layer_file(i: usize) -> String {
    format!("layer_{i:03}.bin")
}

/// Expected shape of a layer tensor for `cfg`.
pub fn layer_shape(cfg: &crate::ModelConfig, name: &str) -> Option<Vec<usize>> {
    let (h, q, kv, f, hd) =
        (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim(), cfg.intermediate_size, cfg.head_dim);
    Some(match name {
        "attn_norm" | "ffn_norm" | "o_bias" => vec![h],
        "q" => vec![q, h],
        "k" | "v" => vec![kv, h],
        "o" => vec![h, q],
        "q_bias" => vec![q],
        "k_bias" | "v_bias" => vec![kv],
        "q_norm" | "k_norm" => vec![hd],
        "gate" | "up" => vec![f, h],
        "down" => vec![h, f],
        _ => return None,
    })
}
