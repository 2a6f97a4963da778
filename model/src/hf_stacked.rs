//! gpt-oss's experts as the hub stores them: every expert of a layer stacked in one tensor, gate and
//! up interleaved in `gate_up_proj` — in bf16 (`[experts, hidden, 2·width]`, inputs first) or in
//! MXFP4 (`*_blocks` `[experts, rows, cols/32, 16]` + `*_scales` `[experts, rows, cols/32]`, e8m0).
//! One expert's gate, up, down or bias comes out as the store keeps it: `[rows, cols]` row-major,
//! MXFP4 repacked into ggml's blocks (scale byte, then element j in the low nibble of byte j and
//! element j + 16 in its high nibble) with the values kept exactly.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::hf::HfCheckpoint;
use crate::source::SourceTensor;

/// The stacked tensor `which` comes from, and whether it is one of an interleaved gate/up pair
/// (`Some(0)`: gate, the even columns or rows; `Some(1)`: up, the odd ones).
fn source(which: &str) -> Option<(&'static str, Option<usize>)> {
    Some(match which {
        "gate" => ("gate_up_proj", Some(0)),
        "up" => ("gate_up_proj", Some(1)),
        "down" => ("down_proj", None),
        "gate_bias" => ("gate_up_proj_bias", Some(0)),
        "up_bias" => ("gate_up_proj_bias", Some(1)),
        "down_bias" => ("down_proj_bias", None),
        _ => return None,
    })
}

/// Expert `e`'s `which` of layer `prefix` (`model.layers.N.`), or `None` if the checkpoint holds
/// neither the bf16 nor the MXFP4 form.
pub fn expert(
    ck: &HfCheckpoint,
    prefix: &str,
    e: usize,
    which: &str,
) -> Result<Option<SourceTensor>> {
    let (stacked, half) =
        source(which).ok_or_else(|| Error::tensor(which, "not an expert tensor"))?;
    let base = format!("{prefix}mlp.experts.{stacked}");
    if let Some(t) =
        ck.slab(&base, e, |dtype, shape, slab| float(&base, dtype, shape, slab, half))?
    {
        return t.map(Some);
    }
    let blocks = format!("{base}_blocks");
    let Some(q) = ck.slab(&blocks, e, |_, shape, slab| (shape.to_vec(), slab.to_vec()))? else {
        return Ok(None);
    };
    let scales = format!("{base}_scales");
    let s = ck
        .slab(&scales, e, |_, shape, slab| (shape.to_vec(), slab.to_vec()))?
        .ok_or_else(|| Error::tensor(&scales, format!("missing beside {blocks}")))?;
    mxfp4(&blocks, q, s, half).map(Some)
}

/// A float slab (one expert's `[hidden, 2·width]` gate_up, `[width, hidden]` down, or a bias row)
/// as a `[rows, cols]` weight: matrices transposed to outputs-first, gate/up de-interleaved.
fn float(
    name: &str,
    dtype: safetensors::Dtype,
    shape: &[usize],
    slab: &[u8],
    half: Option<usize>,
) -> Result<SourceTensor> {
    let dtype = match dtype {
        safetensors::Dtype::F32 => DType::F32,
        safetensors::Dtype::F16 => DType::F16,
        safetensors::Dtype::BF16 => DType::Bf16,
        other => return Err(Error::tensor(name, format!("dtype {other:?} (float expected)"))),
    };
    let es = dtype.block_bytes();
    let (rows, cols) = match shape {
        [n] => (1, *n),
        [r, c] => (*r, *c),
        _ => return Err(Error::tensor(name, format!("shape {shape:?} per expert"))),
    };
    if half.is_some() && !cols.is_multiple_of(2) {
        return Err(Error::tensor(name, format!("{cols} columns do not interleave gate and up")));
    }
    let out_cols = if half.is_some() { cols / 2 } else { cols };
    let at = |r: usize, c: usize| &slab[(r * cols + c) * es..(r * cols + c + 1) * es];
    let col = |j: usize| half.map_or(j, |h| 2 * j + h);
    let mut data = Vec::with_capacity(rows * out_cols * es);
    let shape = if rows == 1 {
        data.extend((0..out_cols).flat_map(|j| at(0, col(j))));
        vec![out_cols]
    } else {
        // Inputs-first `[rows = inputs, cols = outputs]` becomes outputs-first.
        for j in 0..out_cols {
            data.extend((0..rows).flat_map(|r| at(r, col(j))));
        }
        vec![out_cols, rows]
    };
    Ok(SourceTensor { dtype, shape, data })
}

/// One expert's MXFP4 `blocks` (`[rows, cols/32, 16]`) and `scales` (`[rows, cols/32]`) as ggml
/// MXFP4 rows; gate/up take the even/odd rows.
fn mxfp4(
    name: &str,
    (bshape, blocks): (Vec<usize>, Vec<u8>),
    (sshape, scales): (Vec<usize>, Vec<u8>),
    half: Option<usize>,
) -> Result<SourceTensor> {
    let [rows, nb, 16] = bshape[..] else {
        return Err(Error::tensor(
            name,
            format!("shape {bshape:?} per expert, [rows, blocks, 16] expected"),
        ));
    };
    if sshape != [rows, nb] {
        return Err(Error::tensor(
            name,
            format!("scales of shape {sshape:?} for blocks {bshape:?}"),
        ));
    }
    if half.is_some() && !rows.is_multiple_of(2) {
        return Err(Error::tensor(name, format!("{rows} rows do not interleave gate and up")));
    }
    let picked: Vec<usize> = match half {
        Some(h) => (0..rows / 2).map(|j| 2 * j + h).collect(),
        None => (0..rows).collect(),
    };
    let mut data = Vec::with_capacity(picked.len() * nb * 17);
    for &r in &picked {
        for b in 0..nb {
            let q = &blocks[(r * nb + b) * 16..(r * nb + b + 1) * 16];
            // Element i: the low nibble of byte i/2 when i is even, its high nibble when odd.
            let el = |i: usize| (q[i / 2] >> (4 * (i % 2))) & 0xF;
            data.push(scales[r * nb + b]);
            data.extend((0..16).map(|j| el(j) | el(j + 16) << 4));
        }
    }
    Ok(SourceTensor { dtype: DType::Mxfp4, shape: vec![picked.len(), nb * 32], data })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bf16 gate_up slab `[hidden 2, 2·width 4]` splits into gate (even columns) and up (odd),
    /// each transposed to `[width, hidden]`; a bias row de-interleaves the same way.
    #[test]
    fn float_slabs_transpose_and_deinterleave() {
        let slab: Vec<u8> = (0u8..8).flat_map(|x| [x, 0]).collect(); // [[0,1,2,3],[4,5,6,7]]
        let gate = float("g", safetensors::Dtype::BF16, &[2, 4], &slab, Some(0)).unwrap();
        assert_eq!(gate.shape, vec![2, 2]);
        assert_eq!(gate.data.iter().step_by(2).copied().collect::<Vec<_>>(), vec![0, 4, 2, 6]);
        let up = float("u", safetensors::Dtype::BF16, &[2, 4], &slab, Some(1)).unwrap();
        assert_eq!(up.data.iter().step_by(2).copied().collect::<Vec<_>>(), vec![1, 5, 3, 7]);
        let down = float("d", safetensors::Dtype::BF16, &[2, 4], &slab, None).unwrap();
        assert_eq!(down.shape, vec![4, 2]);
        assert_eq!(
            down.data.iter().step_by(2).copied().collect::<Vec<_>>(),
            vec![0, 4, 1, 5, 2, 6, 3, 7]
        );
        let bias = float("b", safetensors::Dtype::BF16, &[4], &slab[..8], Some(1)).unwrap();
        assert_eq!((bias.shape, bias.data), (vec![2], vec![1, 0, 3, 0]));
    }

    /// MXFP4 blocks repacked to ggml's nibble order hold every element where the hub's layout
    /// does (transformers' `convert_moe_packed_tensors`: low nibble = even element), scale kept.
    #[test]
    fn mxfp4_repack_keeps_every_value() {
        let blocks: Vec<u8> = (0..2 * 16).map(|i| (i * 37 % 256) as u8).collect();
        let scales = vec![120u8, 130];
        let t = mxfp4("x", (vec![2, 1, 16], blocks.clone()), (vec![2, 1], scales.clone()), None)
            .unwrap();
        // ggml's MXFP4 block: the scale byte, then element j (< 16) in the low nibble of byte j
        // and element j + 16 in its high nibble.
        let ggml = |row: &[u8], j: usize| (row[1 + j % 16] >> (4 * (j / 16))) & 0xF;
        for (r, row) in t.data.chunks_exact(17).enumerate() {
            assert_eq!(row[0], scales[r]);
            for i in 0..32 {
                let b = blocks[r * 16 + i / 2];
                let hub = if i % 2 == 0 { b & 0xF } else { b >> 4 };
                assert_eq!(ggml(row, i), hub, "row {r} element {i}");
            }
        }
        let up =
            mxfp4("x", (vec![2, 1, 16], blocks.clone()), (vec![2, 1], scales.clone()), Some(1))
                .unwrap();
        assert_eq!(up.data, t.data[17..]);
        // Blocks of the wrong size, scales that do not match, rows that do not pair: refused, naming
        // the tensor.
        let name = "model.layers.0.mlp.experts.gate_up_proj_blocks";
        for (b, s, half) in [
            (vec![2, 2, 8], vec![2, 2], None),
            (vec![2, 1, 16], vec![2, 2], None),
            (vec![1, 2, 16], vec![1, 2], Some(0)),
        ] {
            let e =
                mxfp4(name, (b.clone(), blocks.clone()), (s, scales.clone()), half).unwrap_err();
            assert!(e.to_string().contains(name), "{b:?}: {e}");
        }
    }
}
