//! `layerstream bench --expert-caches 8,32,all` (mixture-of-experts stores): the attention and
//! routers resident and the experts through caches of each size, at each `--expert-batches` batch,
//! every configuration on a fresh `layerstream up` stack; prints bytes streamed per token against
//! what streaming whole layers (every expert of every layer, every step) would move, the expert
//! cache's hit rate, the predictions' share of the misses they saved, and tokens/s.

use crate::bench::{run_config, BenchArgs, Row};
use anyhow::{bail, Context, Result};
use std::path::Path;

/// Bytes one step moves when every layer streams whole: each layer file and all its experts.
fn whole_layer_bytes(m: &layerstream_model::Manifest) -> u64 {
    m.files.iter().filter(|f| f.name.starts_with("layer_")).map(|f| f.size).sum()
}

/// The KV cache one token costs a layer (f16), and under MLA what the same heads would cost
/// stored in full (every head's keys and values).
fn kv_line(cfg: &layerstream_model::ModelConfig) -> String {
    let (dim, rows) = cfg.kv_cache_rows();
    let bytes = dim * rows * 2;
    match &cfg.mla {
        Some(m) => {
            let full = cfg.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * 2;
            format!(
                "KV cache per token and layer (f16): {bytes} B as MLA's latent + RoPE key; the same \
                 {} heads in full would take {full} B ({:.1}×); {:.1} KB per token over {} layers",
                cfg.num_heads,
                full as f64 / bytes as f64,
                (bytes * cfg.num_layers) as f64 / 1e3,
                cfg.num_layers
            )
        }
        None => {
            format!("KV cache per token and layer (f16): {bytes} B ({dim} keys + {dim} values)")
        }
    }
}

/// Runs every (batch, cache) configuration and prints the table.
pub fn compare(a: &BenchArgs, model_dir: &Path, vocab: usize) -> Result<()> {
    let store = layerstream_model::Store::open(model_dir)?;
    let cfg = &store.manifest.config;
    let Some(moe) = cfg.moe.as_ref() else {
        bail!("--expert-caches needs a mixture-of-experts store; {} has none", model_dir.display());
    };
    let whole = whole_layer_bytes(&store.manifest);
    let moe_layers = (0..cfg.num_layers).filter(|&l| cfg.moe_at(l).is_some()).count().max(1);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let model = model_dir.display().to_string();
    let mut rows: Vec<(usize, String, Row)> = Vec::new();
    for &batch in &a.expert_batches {
        for cache in &a.expert_caches {
            let n = match cache.as_str() {
                "all" => "0".to_owned(),
                n => {
                    n.parse::<usize>().with_context(|| format!("--expert-caches {n}"))?.to_string()
                }
            };
            let plan = layerstream_coordinator::PlanFlags {
                resident_layers: None,
                expert_cache: None,
                ..a.plan.clone()
            };
            let mut extra = plan.to_args();
            extra.extend([
                "--resident-layers".to_owned(),
                cfg.num_layers.to_string(),
                "--expert-cache".into(),
                n,
            ]);
            let b = BenchArgs { batch, ..a.clone() };
            let name = format!("batch {batch}, cache {cache}");
            let row = run_config(&name, &model, vocab, &extra, &b, &rt).context(name)?;
            rows.push((batch, cache.clone(), row));
        }
    }
    println!(
        "{}: {} layers × {} experts (top {}), {:.2} MB per expert file; whole-layer streaming moves {:.1} MB a step",
        model_dir.display(),
        cfg.num_layers,
        moe.experts,
        moe.top_k,
        store.manifest.max_expert_bytes() as f64 / 1e6,
        whole as f64 / 1e6
    );
    println!("{}", kv_line(cfg));
    println!(
        "workload: batch × {} tokens after a {} prompt, {} worker(s), {} thread(s)\n",
        a.max_new_tokens,
        a.prompt_tokens.map_or("text".to_owned(), |n| format!("{n}-token")),
        a.workers,
        a.device.compute.threads.map_or("default".to_owned(), |t| t.to_string())
    );
    let mut t = String::from("| batch | expert cache | tok/s | decode tok/s | MB/token | vs whole layers | experts/layer-step | hit % | prefetched % | missed % |\n");
    t += "|---|---|---|---|---|---|---|---|---|---|\n";
    for (batch, cache, r) in &rows {
        let [needed, hit, pre, missed] = r.experts;
        let pct = |x: u64| if needed > 0 { x as f64 / needed as f64 * 100.0 } else { 0.0 };
        let per_token = r.bytes_streamed_per_step / *batch as f64;
        t += &format!(
            "| {batch} | {cache} | {:.1} | {:.1} | {:.3} | {:.3} | {:.1} | {:.1} | {:.1} | {:.1} |\n",
            r.tokens_per_s,
            r.decode_tok_s,
            per_token / 1e6,
            r.bytes_streamed_per_step / whole as f64,
            needed as f64 / r.steps.max(1) as f64 / moe_layers as f64,
            pct(hit),
            pct(pre),
            pct(missed),
        );
    }
    print!("{t}");
    println!(
        "\n`vs whole layers`: bytes streamed per step ÷ {:.1} MB (every layer file and expert).",
        whole as f64 / 1e6
    );
    if let Some(p) = &a.json_out {
        let v: Vec<_> = rows
            .iter()
            .map(|(b, c, r)| serde_json::json!({"batch": b, "cache": c, "row": r}))
            .collect();
        std::fs::write(p, serde_json::to_vec_pretty(&v)?)?;
    }
    Ok(())
}
