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

/// Every tensor a decoder layer may have, in file order (a mixture-of-experts layer has the
/// attention and norms, then `ROUTER` in place of gate/up/down).
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
    // gpt-oss: one learned sink logit per attention head.
    lt!("sinks", "self_attn.sinks", "attn_sinks.weight", false),
    lt!("k_norm", "self_attn.k_norm.weight", "attn_k_norm.weight", false),
    lt!("ffn_norm", "post_attention_layernorm.weight", "ffn_norm.weight", true),
    // DeepSeek-V3: the router's score-correction bias and the shared experts (MoE layers).
    lt!("router_correction", "mlp.gate.e_score_correction_bias", "exp_probs_b.bias", false),
    lt!("shared_gate", "mlp.shared_experts.gate_proj.weight", "ffn_gate_shexp.weight", false),
    lt!("shared_up", "mlp.shared_experts.up_proj.weight", "ffn_up_shexp.weight", false),
    lt!("shared_down", "mlp.shared_experts.down_proj.weight", "ffn_down_shexp.weight", false),
    // Gemma 3's sandwich norms: after attention (HF post_attention_layernorm, which Gemma names so
    // while its pre-MLP norm is pre_feedforward_layernorm; see `hf::gemma_name`) and after the MLP.
    lt!(
        "attn_post_norm",
        "gemma:post_attention_layernorm.weight",
        "post_attention_norm.weight",
        false
    ),
    lt!("ffn_post_norm", "post_feedforward_layernorm.weight", "post_ffw_norm.weight", false),
    lt!("gate", "mlp.gate_proj.weight", "ffn_gate.weight", true),
    lt!("up", "mlp.up_proj.weight", "ffn_up.weight", true),
    lt!("down", "mlp.down_proj.weight", "ffn_down.weight", true),
    // The order a GPTQ act-order weight's inputs are stored in (f32 indices; `prequant`): the
    // worker permutes activations by it before that product. No GGUF holds one.
    lt!("q_perm", "self_attn.q_proj.input_perm", "attn_q.input_perm", false),
    lt!("k_perm", "self_attn.k_proj.input_perm", "attn_k.input_perm", false),
    lt!("v_perm", "self_attn.v_proj.input_perm", "attn_v.input_perm", false),
    lt!("o_perm", "self_attn.o_proj.input_perm", "attn_output.input_perm", false),
    lt!("gate_perm", "mlp.gate_proj.input_perm", "ffn_gate.input_perm", false),
    lt!("up_perm", "mlp.up_proj.input_perm", "ffn_up.input_perm", false),
    lt!("down_perm", "mlp.down_proj.input_perm", "ffn_down.input_perm", false),
    // BitNet: RMSNorms over the attention output (before `o`) and the gated MLP activation (before
    // `down`), and each BitLinear's output multiplier (f32 `[1]`; `prequant`).
    lt!("attn_sub_norm", "self_attn.attn_sub_norm.weight", "attn_sub_norm.weight", false),
    lt!("ffn_sub_norm", "mlp.ffn_sub_norm.weight", "ffn_sub_norm.weight", false),
    lt!("q_oscale", "self_attn.q_proj.output_scale", "attn_q.output_scale", false),
    lt!("k_oscale", "self_attn.k_proj.output_scale", "attn_k.output_scale", false),
    lt!("v_oscale", "self_attn.v_proj.output_scale", "attn_v.output_scale", false),
    lt!("o_oscale", "self_attn.o_proj.output_scale", "attn_output.output_scale", false),
    lt!("gate_oscale", "mlp.gate_proj.output_scale", "ffn_gate.output_scale", false),
    lt!("up_oscale", "mlp.up_proj.output_scale", "ffn_up.output_scale", false),
    lt!("down_oscale", "mlp.down_proj.output_scale", "ffn_down.output_scale", false),
];

/// Placeholder HF name of Gemma's post-attention norm (no other architecture has one).
pub const GEMMA_POST_ATTN: &str = "gemma:post_attention_layernorm.weight";

/// Canonical names of the non-layer tensors and their sources: (store name, HF name, GGUF name).
pub const EMBED: (&str, &str, &str) = ("embed", "model.embed_tokens.weight", "token_embd.weight");
pub const FINAL_NORM: (&str, &str, &str) =
    ("final_norm", "model.norm.weight", "output_norm.weight");
pub const LM_HEAD: (&str, &str, &str) = ("lm_head", "lm_head.weight", "output.weight");

/// File name of layer `i` in a store.
pub fn layer_file(i: usize) -> String {
    format!("layer_{i:03}.bin")
}

/// File name of expert `expert` of layer `layer` (its gate, up and down matrices together).
pub fn expert_file(layer: usize, expert: usize) -> String {
    format!("layer_{layer:03}_expert_{expert:03}.bin")
}

/// The store's streamable units, as the loader numbers them: unit `l < num_layers` is layer `l`'s
/// file (for a mixture-of-experts layer: attention, norms and router), and unit
/// `num_layers + l * experts + e` is expert `e` of layer `l`.
pub fn unit_file(cfg: &crate::ModelConfig, unit: u32) -> Option<String> {
    let (u, n) = (unit as usize, cfg.num_layers);
    if u < n {
        return Some(layer_file(u));
    }
    let m = cfg.moe.as_ref()?;
    let (l, e) = ((u - n) / m.experts, (u - n) % m.experts);
    (l < n && cfg.moe_at(l).is_some()).then(|| expert_file(l, e))
}

/// How traces and messages name unit `unit`: "layer 3", or "layer 3 expert 12".
pub fn unit_label(cfg: &crate::ModelConfig, unit: u32) -> String {
    let (u, n) = (unit as usize, cfg.num_layers);
    match cfg.moe.as_ref().filter(|_| u >= n) {
        Some(m) => format!("layer {} expert {}", (u - n) / m.experts, (u - n) % m.experts),
        None => format!("layer {u}"),
    }
}

/// The unit number of expert `expert` of layer `layer` (see `unit_file`).
pub fn expert_unit(cfg: &crate::ModelConfig, layer: u32, expert: u32) -> u32 {
    let e = cfg.moe.as_ref().map_or(0, |m| m.experts) as u32;
    cfg.num_layers as u32 + layer * e + expert
}

/// Canonical name of a mixture-of-experts layer's router (`[experts, hidden]`, in the layer file).
pub const ROUTER: &str = "router";
/// Canonical name of the router's bias (`[experts]`; gpt-oss), in the layer file.
pub const ROUTER_BIAS: &str = "router_bias";
/// Canonical names of an expert file's tensors.
pub const EXPERT_TENSORS: [&str; 3] = ["gate", "up", "down"];
/// Canonical names of an expert's biases (`MoeConfig::bias`), after its matrices in its file.
pub const EXPERT_BIASES: [&str; 3] = ["gate_bias", "up_bias", "down_bias"];

/// The tensors of an expert file of `m`'s experts, in file order.
pub fn expert_tensors(m: &crate::MoeConfig) -> Vec<&'static str> {
    let biases = if m.bias { &EXPERT_BIASES[..] } else { &[] };
    EXPERT_TENSORS.iter().chain(biases).copied().collect()
}

/// Where an HF checkpoint of `arch` keeps layer `layer`'s router and its experts' matrices
/// (per-expert tensors, as the hub stores them), relative to the layer prefix.
pub fn hf_moe_names(arch: crate::config::Arch) -> (&'static str, fn(usize, &str) -> String) {
    use crate::config::Arch;
    match arch {
        // Stacked `[experts, …]` tensors, read by `gpt_oss::expert`.
        Arch::GptOss => ("mlp.router.weight", |_, t| format!("mlp.experts.{t}")),
        Arch::Mixtral => ("block_sparse_moe.gate.weight", |e, t| {
            let w = match t {
                "gate" => "w1",
                "down" => "w2",
                _ => "w3",
            };
            format!("block_sparse_moe.experts.{e}.{w}.weight")
        }),
        _ => ("mlp.gate.weight", |e, t| format!("mlp.experts.{e}.{t}_proj.weight")),
    }
}

/// GGUF names of a mixture-of-experts layer's router and stacked expert tensors
/// (`[experts, rows, cols]`), relative to the layer prefix.
pub const GGUF_ROUTER: &str = "ffn_gate_inp.weight";
/// GGUF name of the router's bias (gpt-oss).
pub const GGUF_ROUTER_BIAS: &str = "ffn_gate_inp.bias";
/// The stacked GGUF tensor holding every expert's `gate`, `up` or `down` (or, for `gate_bias`
/// and the like, their biases: `[experts, rows]`).
pub fn gguf_experts(t: &str) -> String {
    match t.strip_suffix("_bias") {
        Some(m) => format!("ffn_{m}_exps.bias"),
        None => format!("ffn_{t}_exps.weight"),
    }
}

/// Expected shape of an expert tensor for `cfg`.
pub fn expert_shape(cfg: &crate::ModelConfig, name: &str) -> Option<Vec<usize>> {
    let (h, f) = (cfg.hidden_size, cfg.moe.as_ref()?.expert_intermediate);
    Some(match name {
        "gate" | "up" => vec![f, h],
        "down" => vec![h, f],
        "gate_bias" | "up_bias" => vec![f],
        "down_bias" => vec![h],
        _ => return None,
    })
}

/// Expected shape of a layer tensor for `cfg`.
pub fn layer_shape(cfg: &crate::ModelConfig, name: &str) -> Option<Vec<usize>> {
    if let Some(m) = &cfg.mla {
        if let Some(s) = crate::mla_import::mla_shape(m, cfg.num_heads, cfg.hidden_size, name) {
            return Some(s);
        }
    }
    let shared = cfg.moe.as_ref().map_or(0, |m| m.shared_intermediate);
    match name {
        "router_correction" => return Some(vec![cfg.moe.as_ref()?.experts]),
        "shared_gate" | "shared_up" => return Some(vec![shared, cfg.hidden_size]),
        "shared_down" => return Some(vec![cfg.hidden_size, shared]),
        _ => {}
    }
    let (h, q, kv, f, hd) =
        (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim(), cfg.intermediate_size, cfg.head_dim);
    Some(match name {
        "attn_norm" | "ffn_norm" | "o_bias" | "attn_post_norm" | "ffn_post_norm" => vec![h],
        "q_perm" | "k_perm" | "v_perm" | "gate_perm" | "up_perm" => vec![h],
        "o_perm" | "attn_sub_norm" => vec![q],
        "ffn_sub_norm" | "down_perm" => vec![f],
        "q_oscale" | "k_oscale" | "v_oscale" | "o_oscale" | "gate_oscale" | "up_oscale"
        | "down_oscale" => vec![1],
        "q" => vec![q, h],
        "k" | "v" => vec![kv, h],
        "o" => vec![h, q],
        "q_bias" => vec![q],
        "k_bias" | "v_bias" => vec![kv],
        "q_norm" | "k_norm" => vec![hd],
        "sinks" => vec![cfg.num_heads],
        "gate" | "up" => vec![f, h],
        "down" => vec![h, f],
        ROUTER => vec![cfg.moe.as_ref()?.experts, h],
        ROUTER_BIAS => vec![cfg.moe.as_ref()?.experts],
        _ => return None,
    })
}

/// One tensor of a dense Llama store as the exporters (`synth --gguf`, `synth --hf`) name it.
pub struct ExportTensor {
    /// Store file and canonical tensor name.
    pub file: String,
    pub name: String,
    /// Its names in an HF checkpoint and in a GGUF file.
    pub hf: String,
    pub gguf: String,
    /// The layer-table entry of a layer tensor (`None`: embedding, final norm, head).
    pub layer: Option<&'static LayerTensor>,
}

/// Every tensor of a dense Llama store without RoPE scaling (what `synth`'s dense shapes write), in
/// file order: embedding, each layer's tensors in `LAYER_TENSORS` order, final norm, and the head
/// when untied. Other stores, or a missing layer file, are an error.
pub fn dense_llama_tensors(store: &crate::Store) -> crate::Result<Vec<ExportTensor>> {
    let cfg = &store.manifest.config;
    if cfg.arch != crate::Arch::Llama || cfg.moe.is_some() || cfg.rope.scaling.is_some() {
        return Err(crate::Error::format(
            &store.dir,
            "export writes dense Llama stores without RoPE scaling (synth's dense shapes)",
        ));
    }
    let whole = |(name, hf, gguf): (&str, &str, &str), file: &str| ExportTensor {
        file: file.into(),
        name: name.into(),
        hf: hf.into(),
        gguf: gguf.into(),
        layer: None,
    };
    let mut list = vec![whole(EMBED, "embed.bin")];
    for l in 0..cfg.num_layers {
        let file = layer_file(l);
        let f = store
            .manifest
            .file(&file)
            .ok_or_else(|| crate::Error::format(&store.dir, format!("{file} missing")))?;
        for lt in LAYER_TENSORS.iter().filter(|lt| f.tensor(lt.name).is_some()) {
            list.push(ExportTensor {
                file: file.clone(),
                name: lt.name.into(),
                hf: format!("model.layers.{l}.{}", lt.hf),
                gguf: format!("blk.{l}.{}", lt.gguf),
                layer: Some(lt),
            });
        }
    }
    list.push(whole(FINAL_NORM, "final_norm.bin"));
    if !cfg.tie_word_embeddings {
        list.push(whole(LM_HEAD, "lm_head.bin"));
    }
    Ok(list)
}
