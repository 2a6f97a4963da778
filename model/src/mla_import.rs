//! Multi-head latent attention's tensors as the store keeps them, cut from DeepSeek-V3's HF
//! projections so the worker computes the absorbed form with plain matrix products:
//!
//! - `q_a` (`q_a_proj`), `q_a_norm`, and `q_b_proj` split by rows into `q_nope_b` (every head's
//!   non-RoPE rows) and `q_rope_b` (its RoPE rows) — or `q_proj` split the same way (no q LoRA);
//! - `kv_a_proj_with_mqa` split into `kv_a` (the latent's rows) and `k_rope_a` (the RoPE key's);
//!   `kv_a_norm`;
//! - `kv_b_proj` split per head into `k_b` (`[heads · kv_lora_rank, qk_nope_head_dim]`: head h's key
//!   block transposed, which maps its query into the latent) and `v_b` (`[heads · v_head_dim,
//!   kv_lora_rank]`: its value block, which maps the attended latent to its output).
//!
//! RoPE rows stored interleaved (`rope_interleave`: pairs (2i, 2i+1)) are reordered to the half
//! layout (pairs (i, i + d/2)) the kernels rotate: q and k move alike, so every score is unchanged.

use crate::config_mla::MlaConfig;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::source::{Checkpoint, SourceTensor};

/// The canonical names of an MLA layer's attention tensors, in file order.
pub const MLA_TENSORS: [&str; 9] =
    ["q_a", "q_a_norm", "q_nope_b", "q_rope_b", "kv_a", "k_rope_a", "kv_a_norm", "k_b", "v_b"];

/// The expected shape of MLA tensor `name` for a model of `heads` heads and hidden size `h`.
pub fn mla_shape(m: &MlaConfig, heads: usize, h: usize, name: &str) -> Option<Vec<usize>> {
    let (r, nope, rope, v) = (m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim);
    let q_in = m.q_lora_rank.unwrap_or(h);
    Some(match name {
        "q_a" => vec![m.q_lora_rank?, h],
        "q_a_norm" => vec![m.q_lora_rank?],
        "q_nope_b" => vec![heads * nope, q_in],
        "q_rope_b" => vec![heads * rope, q_in],
        "kv_a" => vec![r, h],
        "k_rope_a" => vec![rope, h],
        "kv_a_norm" => vec![r],
        "k_b" => vec![heads * r, nope],
        "v_b" => vec![heads * v, r],
        "o" => vec![h, heads * v],
        _ => return None,
    })
}

/// Rows `[start, start + n)` of every group of `group` rows (a per-head slice), any dtype.
fn rows_of(t: &SourceTensor, group: usize, start: usize, n: usize) -> SourceTensor {
    let rows = t.shape[0];
    let rb = t.data.len() / rows.max(1);
    let data = (0..rows / group)
        .flat_map(|g| &t.data[(g * group + start) * rb..(g * group + start + n) * rb])
        .copied()
        .collect();
    SourceTensor { dtype: t.dtype, shape: vec![rows / group * n, t.shape[1]], data }
}

/// A pre-quantized FP8 or INT8 tensor (rows of 128-value runs behind an f32 scale) as f32.
fn dequant_b128(name: &str, t: &SourceTensor) -> Result<SourceTensor> {
    let decode: fn(u8) -> f32 = match t.dtype {
        DType::Fp8E4m3B128 => layerstream_types::fp8::e4m3,
        DType::Int8B128 => |b| b as i8 as f32,
        other => {
            return Err(Error::tensor(
                name,
                format!(
                    "stored as {other}: MLA's absorbed keys need it in f32, f16, bf16, FP8 or INT8"
                ),
            ))
        }
    };
    let mut data = Vec::with_capacity(t.data.len() / 132 * 128 * 4);
    for block in t.data.chunks_exact(132) {
        let s = f32::from_le_bytes([block[0], block[1], block[2], block[3]]);
        data.extend(block[4..].iter().flat_map(|&b| (decode(b) * s).to_le_bytes()));
    }
    Ok(SourceTensor { dtype: DType::F32, shape: t.shape.clone(), data })
}

/// The transpose of a `[rows, cols]` tensor (pre-quantized FP8/INT8 dequantized to f32 first: a
/// transpose cuts across its 128-value runs).
fn transpose(name: &str, t: &SourceTensor) -> Result<SourceTensor> {
    let deq;
    let t = if matches!(t.dtype, DType::F32 | DType::F16 | DType::Bf16) {
        t
    } else {
        deq = dequant_b128(name, t)?;
        &deq
    };
    let (rows, cols, es) = (t.shape[0], t.shape[1], t.dtype.block_bytes());
    let mut data = Vec::with_capacity(t.data.len());
    for c in 0..cols {
        for r in 0..rows {
            data.extend_from_slice(&t.data[(r * cols + c) * es..(r * cols + c + 1) * es]);
        }
    }
    Ok(SourceTensor { dtype: t.dtype, shape: vec![cols, rows], data })
}

/// Reads tensor `name` (this format's spelling) and checks it is `[rows, cols]` (a GGUF
/// `[heads, rows, cols]` stack is read as its heads' rows one after another).
fn read(ck: &dyn Checkpoint, name: &str, shape: [usize; 2]) -> Result<SourceTensor> {
    let mut t =
        ck.tensor(name)?.ok_or_else(|| Error::tensor(name, "missing from the checkpoint"))?;
    if let [n, r, c] = t.shape[..] {
        let rows = n.checked_mul(r).ok_or_else(|| Error::tensor(name, "shape overflows"))?;
        t.shape = vec![rows, c];
    }
    if t.shape != shape || t.shape[0] == 0 || !t.data.len().is_multiple_of(t.shape[0]) {
        return Err(Error::tensor(
            name,
            format!(
                "shape {:?}, expected {shape:?} from the config's ranks and head sizes",
                t.shape
            ),
        ));
    }
    Ok(t)
}

/// Every MLA tensor of layer `prefix` of a DeepSeek-V3 checkpoint (HF, or llama.cpp's `deepseek2`
/// GGUF, whose converter already split `kv_b_proj` into `attn_k_b` — transposed — and `attn_v_b`),
/// as the store keeps them.
pub fn mla_tensors(
    ck: &dyn Checkpoint,
    m: &MlaConfig,
    heads: usize,
    hidden: usize,
    prefix: &str,
) -> Result<Vec<(String, SourceTensor)>> {
    let (r, nope, rope, v) = (m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim);
    let qk = nope + rope;
    let half = |t: SourceTensor, n_heads: usize| -> SourceTensor {
        if !m.rope_interleave {
            return t;
        }
        let rows = t.shape[0];
        SourceTensor { data: crate::gguf::unpermute_rows(&t.data, rows, n_heads), ..t }
    };
    let name = |hf: &str, gguf: &str| format!("{prefix}{}", ck.pick_name(hf, gguf));
    // A vector of `n` values (a norm).
    let vector = |tn: &str, n: usize, what: &str| -> Result<SourceTensor> {
        let t = ck.tensor(tn)?.ok_or_else(|| Error::tensor(tn, "missing from the checkpoint"))?;
        if t.shape != [n] {
            return Err(Error::tensor(tn, format!("shape {:?}, expected [{n}] ({what})", t.shape)));
        }
        Ok(t)
    };
    let mut out = Vec::new();
    let q_full = match m.q_lora_rank {
        Some(q) => {
            let qa = read(ck, &name("self_attn.q_a_proj.weight", "attn_q_a.weight"), [q, hidden])?;
            out.push(("q_a".into(), qa));
            let n = name("self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight");
            out.push(("q_a_norm".into(), vector(&n, q, "q_lora_rank")?));
            read(ck, &name("self_attn.q_b_proj.weight", "attn_q_b.weight"), [heads * qk, q])?
        }
        None => read(ck, &name("self_attn.q_proj.weight", "attn_q.weight"), [heads * qk, hidden])?,
    };
    out.push(("q_nope_b".into(), rows_of(&q_full, qk, 0, nope)));
    out.push(("q_rope_b".into(), half(rows_of(&q_full, qk, nope, rope), heads)));
    let kv_a_name = name("self_attn.kv_a_proj_with_mqa.weight", "attn_kv_a_mqa.weight");
    let kv_a = read(ck, &kv_a_name, [r + rope, hidden])?;
    out.push(("kv_a".into(), rows_of(&kv_a, r + rope, 0, r)));
    out.push(("k_rope_a".into(), half(rows_of(&kv_a, r + rope, r, rope), 1)));
    let n = name("self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight");
    out.push(("kv_a_norm".into(), vector(&n, r, "kv_lora_rank")?));
    // llama.cpp's converter already split kv_b_proj (`attn_k_b` transposed per head, `attn_v_b`).
    let (k_name, v_name) = (name("", "attn_k_b.weight"), name("", "attn_v_b.weight"));
    // (An HF checkpoint has no such name: `pick_name` leaves the bare prefix, which is no tensor.)
    if ck.tensor(&k_name)?.is_some() {
        out.push(("k_b".into(), read(ck, &k_name, [heads * r, nope])?));
        out.push(("v_b".into(), read(ck, &v_name, [heads * v, r])?));
        return Ok(out);
    }
    let kv_b_name = name("self_attn.kv_b_proj.weight", "attn_kv_b.weight");
    let kv_b = read(ck, &kv_b_name, [heads * (nope + v), r])?;
    let k_heads = rows_of(&kv_b, nope + v, 0, nope);
    // Pre-quantized rows come out of the transpose as f32.
    let mut k_b =
        SourceTensor { dtype: kv_b.dtype, shape: vec![heads * r, nope], data: Vec::new() };
    for h in 0..heads {
        let one = transpose(&kv_b_name, &rows_of(&k_heads, heads * nope, h * nope, nope))?;
        k_b.dtype = one.dtype;
        k_b.data.extend(one.data);
    }
    out.push(("k_b".into(), k_b));
    out.push(("v_b".into(), rows_of(&kv_b, nope + v, nope, v)));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(rows: usize, cols: usize) -> SourceTensor {
        SourceTensor {
            dtype: DType::F32,
            shape: vec![rows, cols],
            data: (0..rows * cols).flat_map(|x| (x as f32).to_le_bytes()).collect(),
        }
    }

    fn vals(t: &SourceTensor) -> Vec<f32> {
        t.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    /// Per-head row slices keep whole rows in head order; a transpose swaps the indices.
    #[test]
    fn head_slices_and_transpose() {
        let x = t(6, 2); // 2 heads of 3 rows: [0,1],[2,3],[4,5] | [6,7],[8,9],[10,11]
        assert_eq!(vals(&rows_of(&x, 3, 1, 2)), vec![2., 3., 4., 5., 8., 9., 10., 11.]);
        let tr = transpose("x", &t(2, 3)).unwrap();
        assert_eq!((tr.shape.clone(), vals(&tr)), (vec![3, 2], vec![0., 3., 1., 4., 2., 5.]));
        let q8 = SourceTensor { dtype: DType::Q8_0, shape: vec![1, 32], data: vec![0; 34] };
        assert!(transpose("blk.0.attn_kv_b.weight", &q8)
            .unwrap_err()
            .to_string()
            .contains("attn_kv_b"));
        // FP8 rows (scale 0.5; bytes 0x38 = 1.0, 0xC0 = -2.0) transpose to their f32 values.
        let mut fp8 = 0.5f32.to_le_bytes().to_vec();
        fp8.extend((0..128).map(|i| if i % 2 == 0 { 0x38u8 } else { 0xC0 }));
        let t8 = SourceTensor { dtype: DType::Fp8E4m3B128, shape: vec![1, 128], data: fp8 };
        let tr = transpose("kv_b", &t8).unwrap();
        assert_eq!((tr.dtype, tr.shape.clone()), (DType::F32, vec![128, 1]));
        assert_eq!(&vals(&tr)[..4], &[0.5, -1.0, 0.5, -1.0]);
    }
}
