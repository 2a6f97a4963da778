//! `layerstream import`: any supported checkpoint → a layer store, written to a `.partial` directory
//! and renamed into place only when complete, so a failed import leaves nothing behind.

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::gguf::GgufCheckpoint;
use crate::hf::HfCheckpoint;
use crate::layout::{
    expert_file, expert_shape, expert_tensors, layer_file, layer_shape, EMBED, EXPERT_TENSORS,
    FINAL_NORM, GGUF_ROUTER, GGUF_ROUTER_BIAS, LAYER_TENSORS, LM_HEAD, ROUTER, ROUTER_BIAS,
};
use crate::source::{Checkpoint, SourceTensor};
use crate::store::{Manifest, StoreWriter};
use std::path::{Path, PathBuf};

/// Opens `src` as a GGUF file or an HF directory.
pub fn open_checkpoint(src: &Path) -> Result<Box<dyn Checkpoint>> {
    if src.is_dir() {
        if !src.join("config.json").exists() {
            return Err(Error::format(
                src,
                "directory has no config.json (expected an HF checkpoint)",
            ));
        }
        return Ok(Box::new(HfCheckpoint::open(src)?));
    }
    if src.exists() {
        // GgufCheckpoint::open refuses what is not a regular file (a FIFO would block forever).
        return Ok(Box::new(GgufCheckpoint::open(src)?));
    }
    Err(Error::io(
        src,
        std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory"),
    ))
}

fn check_shape(name: &str, t: &SourceTensor, want: &[usize]) -> Result<()> {
    if t.shape != want {
        return Err(Error::tensor(
            name,
            format!("shape {:?}, expected {:?} from the config", t.shape, want),
        ));
    }
    if t.dtype.tensor_bytes(&t.shape) != Some(t.data.len()) {
        return Err(Error::tensor(
            name,
            format!("{} bytes do not match {} {:?}", t.data.len(), t.dtype, t.shape),
        ));
    }
    Ok(())
}

fn required(ck: &dyn Checkpoint, src_name: &str) -> Result<SourceTensor> {
    ck.tensor(src_name)?.ok_or_else(|| Error::tensor(src_name, "missing from the checkpoint"))
}

/// A norm weight with the checkpoint's `norm_offset` added (as f32); any other tensor as it is.
fn norm_offset(ck: &dyn Checkpoint, name: &str, t: SourceTensor) -> Result<SourceTensor> {
    match ck.norm_offset() {
        o if o != 0.0 && name.ends_with("norm") => t.offset(name, o),
        _ => Ok(t),
    }
}

/// Writes every expert of layer `layer` as its own file (gate, up and down together, and their
/// biases where the model has them).
fn write_experts(
    ck: &dyn Checkpoint,
    w: &mut StoreWriter,
    cfg: &ModelConfig,
    layer: usize,
    m: &crate::MoeConfig,
) -> Result<()> {
    for e in 0..m.experts {
        let mut tensors = Vec::with_capacity(6);
        for which in expert_tensors(m) {
            let what = format!("layer {layer} expert {e} {which}");
            let t = ck
                .expert(layer, e, which)?
                .ok_or_else(|| Error::tensor(&what, "missing from the checkpoint"))?;
            check_shape(&what, &t, &expert_shape(cfg, which).expect("moe config"))?;
            tensors.push((which.to_owned(), t));
        }
        w.write_tensors(&expert_file(layer, e), tensors)?;
    }
    Ok(())
}

/// Layer `i`'s tensors as the store holds them (shapes checked, norms offset where the
/// checkpoint's convention differs, what the config requires present); its experts, for a
/// mixture-of-experts layer, are written to their own files on the way.
fn layer_tensors(
    ck: &dyn Checkpoint,
    w: &mut StoreWriter,
    cfg: &ModelConfig,
    i: usize,
) -> Result<Vec<(String, SourceTensor)>> {
    let h = cfg.hidden_size;
    let prefix = ck.layer_prefix(i);
    let mut tensors = Vec::new();
    let moe = cfg.moe_at(i).cloned();
    if let Some(m) = &cfg.mla {
        tensors = crate::mla_import::mla_tensors(ck, m, cfg.num_heads, h, &prefix)?;
    }
    for lt in LAYER_TENSORS {
        if moe.is_some() && EXPERT_TENSORS.contains(&lt.name) {
            continue; // the experts' own files hold them
        }
        if cfg.mla.is_some() && matches!(lt.name, "q" | "k" | "v") {
            continue; // MLA's own tensors stand in for them
        }
        let src_name = format!("{prefix}{}", ck.pick_name(lt.hf, lt.gguf));
        match ck.tensor(&src_name)? {
            Some(t) => {
                check_shape(
                    &src_name,
                    &t,
                    &layer_shape(cfg, lt.name).expect("layout covers every layer tensor"),
                )?;
                tensors.push((lt.name.to_owned(), norm_offset(ck, lt.name, t)?));
            }
            None if lt.required
                || (cfg.qk_norm && matches!(lt.name, "q_norm" | "k_norm"))
                || (cfg.arch == crate::config::Arch::BitNet
                    && matches!(lt.name, "attn_sub_norm" | "ffn_sub_norm"))
                || (cfg.bitlinear && lt.name.ends_with("_oscale"))
                || (cfg.attn_sinks && lt.name == "sinks")
                || (moe.as_ref().is_some_and(|m| m.shared_intermediate > 0)
                    && lt.name.starts_with("shared_"))
                || (moe.as_ref().is_some_and(|m| m.groups.is_some())
                    && lt.name == "router_correction")
                || (cfg.gemma.is_some()
                    && matches!(lt.name, "attn_post_norm" | "ffn_post_norm")) =>
            {
                return Err(Error::tensor(src_name, "missing from the checkpoint"));
            }
            None => {}
        }
    }
    if let Some(m) = &moe {
        let name = format!("{prefix}{}", ck.pick_name("router", GGUF_ROUTER));
        let router =
            ck.router(i)?.ok_or_else(|| Error::tensor(&name, "missing from the checkpoint"))?;
        check_shape(&name, &router, &layer_shape(cfg, ROUTER).expect("moe config"))?;
        tensors.push((ROUTER.to_owned(), router));
        if m.bias {
            let name = format!("{prefix}{}", ck.pick_name("router_bias", GGUF_ROUTER_BIAS));
            let bias = ck
                .router_bias(i)?
                .ok_or_else(|| Error::tensor(&name, "missing from the checkpoint"))?;
            check_shape(&name, &bias, &layer_shape(cfg, ROUTER_BIAS).expect("moe config"))?;
            tensors.push((ROUTER_BIAS.to_owned(), bias));
        }
        write_experts(ck, w, cfg, i, m)?;
    }
    Ok(tensors)
}

fn write_all(ck: &dyn Checkpoint, dir: &Path, source: String, progress: bool) -> Result<Manifest> {
    let mut cfg: ModelConfig = ck.config().clone();
    let bar = if progress {
        let b = indicatif::ProgressBar::new(cfg.num_layers as u64 + 3);
        b.set_style(
            indicatif::ProgressStyle::with_template("importing {bar:40} {pos}/{len} files {msg}")
                .expect("static template"),
        );
        b
    } else {
        indicatif::ProgressBar::hidden()
    };
    let mut w = StoreWriter::new(dir);
    let (h, vocab) = (cfg.hidden_size, cfg.vocab_size);

    let embed = required(ck, &ck.pick_name(EMBED.1, EMBED.2))?;
    check_shape(EMBED.1, &embed, &[vocab, h])?;
    w.write_tensors("embed.bin", vec![(EMBED.0.into(), embed)])?;
    bar.inc(1);

    for i in 0..cfg.num_layers {
        let tensors = layer_tensors(ck, &mut w, &cfg, i)?;
        w.write_tensors(&layer_file(i), tensors)?;
        bar.set_message(layer_file(i));
        bar.inc(1);
    }

    let norm = required(ck, &ck.pick_name(FINAL_NORM.1, FINAL_NORM.2))?;
    check_shape(FINAL_NORM.1, &norm, &[h])?;
    let norm = norm_offset(ck, FINAL_NORM.0, norm)?;
    w.write_tensors("final_norm.bin", vec![(FINAL_NORM.0.into(), norm)])?;
    bar.inc(1);

    match ck.tensor(&ck.pick_name(LM_HEAD.1, LM_HEAD.2))? {
        Some(t) if !cfg.tie_word_embeddings => {
            check_shape(LM_HEAD.1, &t, &[vocab, h])?;
            w.write_tensors("lm_head.bin", vec![(LM_HEAD.0.into(), t)])?;
        }
        // Tied (or absent, which transformers also treats as tied).
        _ => cfg.tie_word_embeddings = true,
    }
    bar.inc(1);

    let tok = ck.tokenizer_json()?;
    w.write_aux("tokenizer.json", tok.as_bytes())?;
    let template = ck.chat_template()?;
    if let Some(t) = &template {
        w.write_aux("chat_template.jinja", t.as_bytes())?;
    }
    bar.finish_and_clear();
    w.finish(cfg, source, "tokenizer.json", template.as_ref().map(|_| "chat_template.jinja"))
}

/// Imports `src` (GGUF file or HF directory) into a new store at `dst`.
pub fn import(src: &Path, dst: &Path, progress: bool) -> Result<Manifest> {
    if dst.exists() && std::fs::read_dir(dst).map_err(|e| Error::io(dst, e))?.next().is_some() {
        return Err(Error::format(dst, "destination exists and is not empty"));
    }
    let ck = open_checkpoint(src)?;
    let partial = PathBuf::from(format!("{}.partial", dst.display()));
    if partial.exists() {
        std::fs::remove_dir_all(&partial).map_err(|e| Error::io(&partial, e))?;
    }
    std::fs::create_dir_all(&partial).map_err(|e| Error::io(&partial, e))?;
    let kind = if src.is_dir() { "hf" } else { "gguf" };
    let result = write_all(ck.as_ref(), &partial, format!("{kind}:{}", src.display()), progress)
        .and_then(|m| {
            // Everything `run` and `up` will read is checked now, so a bad file fails here: the
            // manifest's consistency, the tokenizer and the chat template.
            let store = crate::Store::open(&partial)?;
            store.tokenizer()?.check_template()?;
            Ok(m)
        });
    match result {
        Ok(m) => {
            if dst.exists() {
                std::fs::remove_dir(dst).map_err(|e| Error::io(dst, e))?;
            }
            std::fs::rename(&partial, dst).map_err(|e| Error::io(dst, e))?;
            Ok(m)
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&partial);
            Err(e)
        }
    }
}
