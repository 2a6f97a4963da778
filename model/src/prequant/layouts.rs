//! Each published layout rewritten into the stored blocks, value for value: FP8/INT8 weights with
//! a grid of scales, compressed-tensors' dense int32 packing, AutoAWQ's GEMM packing (output
//! columns interleaved 0,2,4,6,1,3,5,7 in each word) and GPTQ's (inputs packed down the rows,
//! zero points stored minus one in its v1 files). Every shape is checked against the others first;
//! a disagreement names the tensor and what it expected.

use super::blocks::{code, push_int4, push_scaled, BLOCK};
use super::scheme::Args;
use super::Raw;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::source::SourceTensor;
use safetensors::Dtype as St;

/// AutoAWQ's order: nibble k of a word holds output column 8·col + AWQ_ORDER[k].
const AWQ_ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];

/// The values of a scale tensor (f32, f16, bf16 or e8m0) as f32, exactly.
fn floats(t: &Raw, name: &str) -> Result<Vec<f32>> {
    let two = |c: &[u8]| [c[0], c[1]];
    Ok(match t.dtype {
        St::F32 => {
            t.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        }
        St::F16 => {
            t.data.chunks_exact(2).map(|c| half::f16::from_le_bytes(two(c)).to_f32()).collect()
        }
        St::BF16 => {
            t.data.chunks_exact(2).map(|c| half::bf16::from_le_bytes(two(c)).to_f32()).collect()
        }
        // A power of two: 2^(e − 127), 0xFF NaN.
        St::F8_E8M0 => t
            .data
            .iter()
            .map(|&e| {
                if e == 0xFF {
                    f32::NAN
                } else {
                    f32::from_bits((e as u32) << 23).max(2f32.powi(-127))
                }
            })
            .collect(),
        other => {
            return Err(Error::tensor(
                name,
                format!("scales stored as {other:?} (F32, F16, BF16, F8_E8M0 expected)"),
            ))
        }
    })
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Checks `t`'s element type, rank-2 shape and byte size; its `[rows, cols]`.
fn matrix(t: &Raw, name: &str, want: St, elem_bytes: usize) -> Result<[usize; 2]> {
    if t.dtype != want {
        return Err(Error::tensor(name, format!("stored as {:?}, {want:?} expected", t.dtype)));
    }
    let &[r, c] = t.shape.as_slice() else {
        return Err(Error::tensor(name, format!("shape {:?}: a matrix expected", t.shape)));
    };
    if r.checked_mul(c).and_then(|n| n.checked_mul(elem_bytes)) != Some(t.data.len()) {
        return Err(Error::tensor(
            name,
            format!("{} bytes disagree with shape {:?}", t.data.len(), t.shape),
        ));
    }
    Ok([r, c])
}

fn shape_is(name: &str, got: &[usize], want: &[usize]) -> Result<()> {
    if got != want {
        return Err(Error::tensor(name, format!("shape {got:?}, expected {want:?}")));
    }
    Ok(())
}

/// Inputs must be whole 128-value blocks, each under one scale (`group` a multiple of 128).
fn check_group(name: &str, inp: usize, group: usize) -> Result<()> {
    if !inp.is_multiple_of(BLOCK) {
        return Err(Error::tensor(
            name,
            format!("{inp} input columns: pre-quantized weights need a multiple of {BLOCK}"),
        ));
    }
    if group == 0 || (!group.is_multiple_of(BLOCK) && group < inp) {
        return Err(Error::tensor(
            name,
            format!("group size {group} is not supported (a multiple of {BLOCK}, or per-channel)"),
        ));
    }
    Ok(())
}

/// FP8 e4m3 or INT8 weights `[out, in]` with a scale per `[block[0], block[1]]` (a grid
/// `[⌈out/b0⌉, ⌈in/b1⌉]`; a single value for a per-tensor scale).
pub fn scaled_bytes(
    name: &str,
    dtype: DType,
    w: &Raw,
    s: &Raw,
    block: [usize; 2],
    what: &str,
) -> Result<SourceTensor> {
    let elem = if dtype == DType::Fp8E4m3B128 { St::F8_E4M3 } else { St::I8 };
    let [out, inp] = matrix(w, name, elem, 1)?;
    check_group(name, inp, block[1])?;
    let grid = [out.div_ceil(block[0].max(1)), inp.div_ceil(block[1])];
    let sname = name.replace(".weight", &format!(".{what}"));
    let per_tensor = numel(&s.shape) == 1 && grid == [1, 1];
    if !per_tensor && numel(&s.shape) != grid[0] * grid[1] {
        return Err(Error::tensor(
            &sname,
            format!("shape {:?}, expected {grid:?} for weight {:?}", s.shape, w.shape),
        ));
    }
    let scales = floats(s, &sname)?;
    if scales.len() != numel(&s.shape) {
        return Err(Error::tensor(
            &sname,
            format!("{} bytes disagree with shape {:?}", s.data.len(), s.shape),
        ));
    }
    let mut data = Vec::with_capacity(out * inp / BLOCK * (BLOCK + 4));
    for r in 0..out {
        for c in (0..inp).step_by(BLOCK) {
            let sc = scales[(r / block[0]) * grid[1] + c / block[1]];
            push_scaled(&mut data, sc, &w.data[r * inp + c..r * inp + c + BLOCK]);
        }
    }
    Ok(SourceTensor { dtype, shape: vec![out, inp], data })
}

/// int4 codes `q(o, i)` with per-(group, output) scale and zero: rows of `int4_g128` blocks.
fn int4_rows(
    out: usize,
    inp: usize,
    group: usize,
    q: impl Fn(usize, usize) -> u8,
    scale: impl Fn(usize, usize) -> f32,
    zero: impl Fn(usize, usize) -> u8,
) -> SourceTensor {
    let mut data = Vec::with_capacity(out * inp / BLOCK * 69);
    let mut codes = [0u8; BLOCK];
    for o in 0..out {
        for c in (0..inp).step_by(BLOCK) {
            codes.iter_mut().enumerate().for_each(|(j, v)| *v = q(o, c + j));
            let g = c / group;
            push_int4(&mut data, scale(g, o), zero(g, o), &codes);
        }
    }
    SourceTensor { dtype: DType::Int4G128, shape: vec![out, inp], data }
}

/// AutoAWQ GEMM: `qweight` `[in, out/8]`, `qzeros` `[in/g, out/8]` (int32), `scales` `[in/g, out]`.
pub fn awq(name: &str, group: usize, q: &Raw, z: &Raw, s: &Raw) -> Result<SourceTensor> {
    let (qn, zn, sn) = (
        name.replace(".weight", ".qweight"),
        name.replace(".weight", ".qzeros"),
        name.replace(".weight", ".scales"),
    );
    let [inp, packed] = matrix(q, &qn, St::I32, 4)?;
    let out = packed * 8;
    check_group(&qn, inp, group)?;
    let groups = inp.div_ceil(group);
    shape_is(&zn, &matrix(z, &zn, St::I32, 4)?, &[groups, packed])?;
    shape_is(&sn, &s.shape, &[groups, out])?;
    let scales = floats(s, &sn)?;
    // Code of output column o in a word run of `packed` words per row.
    let awq_code = |words: &[u8], row: usize, o: usize| {
        let k = AWQ_ORDER.iter().position(|&x| x == o % 8).expect("0..8");
        code(&words[4 * packed * row..4 * packed * (row + 1)], (o / 8) * 8 + k, 4)
    };
    Ok(int4_rows(
        out,
        inp,
        group,
        |o, i| awq_code(&q.data, i, o),
        |g, o| scales[g * out + o],
        |g, o| awq_code(&z.data, g, o),
    ))
}

/// A GPTQ weight's layout checked from its `qweight`'s element type and shape (its header):
/// `(inputs, outputs, inputs per group, groups)`.
fn gptq_dims(name: &str, group: Option<usize>, dtype: St, shape: &[usize]) -> Result<[usize; 4]> {
    let qn = name.replace(".weight", ".qweight");
    let (St::I32, &[packed_in, out]) = (dtype, shape) else {
        return Err(Error::tensor(&qn, format!("{dtype:?} {shape:?}: an I32 matrix expected")));
    };
    let inp = packed_in * 8;
    let group = group.unwrap_or(inp);
    check_group(&qn, inp, group)?;
    if !out.is_multiple_of(8) {
        return Err(Error::tensor(&qn, format!("{out} outputs: a multiple of 8 expected")));
    }
    Ok([inp, out, group, inp.div_ceil(group)])
}

/// The input order a GPTQ weight is stored in: `None` when `g_idx` is absent or puts input `i` in
/// group `i / g`; for act-order (`desc_act`) files, the inputs sorted by group (stable), so each
/// group's inputs are contiguous — stored column `j` is input `perm[j]`, and the worker permutes
/// activations the same way before the product (`…input_perm`).
/// `q` is the `qweight`'s element type and shape.
pub fn gptq_perm(
    name: &str,
    group: Option<usize>,
    q: (St, &[usize]),
    g_idx: Option<&Raw>,
) -> Result<Option<Vec<usize>>> {
    let Some(g) = g_idx else { return Ok(None) };
    let [inp, _, group, groups] = gptq_dims(name, group, q.0, q.1)?;
    let gn = name.replace(".weight", ".g_idx");
    shape_is(&gn, &g.shape, &[inp])?;
    if g.dtype != St::I32 || g.data.len() != 4 * inp {
        return Err(Error::tensor(
            &gn,
            format!("stored as {:?} in {} bytes, I32 [{inp}] expected", g.dtype, g.data.len()),
        ));
    }
    let mut of = Vec::with_capacity(inp);
    for (i, c) in g.data.chunks_exact(4).enumerate() {
        let v = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        if v < 0 || v as usize >= groups {
            return Err(Error::tensor(
                &gn,
                format!("input {i} names group {v}, outside 0..{groups}"),
            ));
        }
        of.push(v as usize);
    }
    if of.iter().enumerate().all(|(i, &v)| v == i / group) {
        return Ok(None);
    }
    let mut counts = vec![0usize; groups];
    of.iter().for_each(|&v| counts[v] += 1);
    if let Some((gi, n)) = counts.iter().enumerate().find(|&(_, &n)| n != group) {
        return Err(Error::tensor(&gn, format!("group {gi} holds {n} inputs, not {group}")));
    }
    let mut perm: Vec<usize> = (0..inp).collect();
    perm.sort_by_key(|&i| of[i]);
    Ok(Some(perm))
}

/// GPTQ: `qweight` `[in/8, out]` (inputs packed down the rows), `qzeros` `[in/g, out/8]`,
/// `scales` `[in/g, out]`; `perm`: the input order `gptq_perm` found (act-order weights are
/// stored in it).
pub fn gptq(
    name: &str,
    group: Option<usize>,
    v1_zeros: bool,
    q: &Raw,
    z: &Raw,
    s: &Raw,
    perm: Option<&[usize]>,
) -> Result<SourceTensor> {
    let (qn, zn, sn) = (
        name.replace(".weight", ".qweight"),
        name.replace(".weight", ".qzeros"),
        name.replace(".weight", ".scales"),
    );
    matrix(q, &qn, St::I32, 4)?;
    let [inp, out, group, groups] = gptq_dims(name, group, q.dtype, &q.shape)?;
    shape_is(&zn, &matrix(z, &zn, St::I32, 4)?, &[groups, out / 8])?;
    shape_is(&sn, &s.shape, &[groups, out])?;
    let scales = floats(s, &sn)?;
    let zero_bytes = &z.data;
    let row_words = 4 * out; // bytes of one qweight row
    Ok(int4_rows(
        out,
        inp,
        group,
        |o, j| {
            let i = perm.map_or(j, |p| p[j]);
            let w = &q.data[(i / 8) * row_words + 4 * o..(i / 8) * row_words + 4 * o + 4];
            code(w, i % 8, 4)
        },
        |g, o| scales[g * out + o],
        // v1 files store zero − 1 in four bits (wrapping): add it back, as AutoGPTQ does.
        |g, o| (code(&zero_bytes[g * out / 2..(g + 1) * out / 2], o, 4) + v1_zeros as u8) & 0xF,
    ))
}

/// compressed-tensors `pack-quantized`: `weight_packed` `[out, in·bits/32]` (codes offset by
/// 2^(bits−1)), `weight_scale` `[out, in/g]`, optional `weight_zero_point` packed down the rows
/// `[⌈out·bits/32⌉, in/g]`, `weight_shape` `[out, in]`.
pub fn ct_packed(
    name: &str,
    args: &Args,
    packed: &Raw,
    s: &Raw,
    z: Option<&Raw>,
    shape: &Raw,
) -> Result<SourceTensor> {
    let base = name.trim_end_matches(".weight");
    let (pn, sn, zn, shn) = (
        format!("{base}.weight_packed"),
        format!("{base}.weight_scale"),
        format!("{base}.weight_zero_point"),
        format!("{base}.weight_shape"),
    );
    let dims: Vec<usize> = match shape.dtype {
        St::I64 => shape
            .data
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8")) as usize)
            .collect(),
        St::I32 => shape
            .data
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().expect("4")) as usize)
            .collect(),
        other => return Err(Error::tensor(&shn, format!("stored as {other:?}, I64 expected"))),
    };
    let &[out, inp] = dims.as_slice() else {
        return Err(Error::tensor(&shn, format!("{dims:?}: two dimensions expected")));
    };
    let bits = args.num_bits;
    let [pr, pc] = matrix(packed, &pn, St::I32, 4)?;
    // (weight_shape comes from the file: checked against the packed data before any product.)
    let words = inp.checked_mul(bits).map(|b| b.div_ceil(32));
    if pr != out || words != Some(pc) {
        return Err(Error::tensor(
            &pn,
            format!("shape [{pr}, {pc}] does not hold {bits}-bit weights of shape [{out}, {inp}]"),
        ));
    }
    let [_, group] = args.block(&[out, inp], name)?;
    check_group(name, inp, group)?;
    let groups = inp.div_ceil(group);
    if numel(&s.shape) != out * groups {
        return Err(Error::tensor(&sn, format!("shape {:?}, expected [{out}, {groups}]", s.shape)));
    }
    let scales = floats(s, &sn)?;
    let row = 4 * pc;
    let q = |o: usize, i: usize| code(&packed.data[o * row..(o + 1) * row], i, bits);
    if bits == 8 {
        if z.is_some() && !args.symmetric {
            return Err(Error::tensor(&zn, "asymmetric 8-bit weights are not supported"));
        }
        let mut data = Vec::with_capacity(out * inp / BLOCK * (BLOCK + 4));
        let mut bytes = [0u8; BLOCK];
        for o in 0..out {
            for c in (0..inp).step_by(BLOCK) {
                // The code is the value + 128: as a signed byte, the value.
                bytes.iter_mut().enumerate().for_each(|(j, v)| *v = q(o, c + j) ^ 0x80);
                push_scaled(&mut data, scales[o * groups + c / group], &bytes);
            }
        }
        return Ok(SourceTensor { dtype: DType::Int8B128, shape: vec![out, inp], data });
    }
    let zeros: Option<(&Raw, usize)> = match z {
        Some(z) if !args.symmetric => {
            let [zr, zc] = matrix(z, &zn, St::I32, 4)?;
            shape_is(&zn, &[zr, zc], &[(out * bits).div_ceil(32), groups])?;
            Some((z, zc))
        }
        None if !args.symmetric => {
            return Err(Error::tensor(&zn, "missing: asymmetric weights need zero points"))
        }
        _ => None,
    };
    // Zero point of (group g, output o): code o of column g, packed down the rows.
    let zero = |g: usize, o: usize| match zeros {
        None => 8,
        Some((z, zc)) => {
            let bit = o * bits;
            let at = 4 * ((bit / 32) * zc + g);
            let word =
                u32::from_le_bytes([z.data[at], z.data[at + 1], z.data[at + 2], z.data[at + 3]]);
            ((word >> (bit % 32)) & 0xF) as u8
        }
    };
    Ok(int4_rows(out, inp, group, q, |g, o| scales[o * groups + g], zero))
}

/// A per-tensor scale (`[1]` or `[]`) as f32, exactly; it must be finite and non-zero.
pub fn single_scale(name: &str, s: &Raw) -> Result<f32> {
    let v = floats(s, name)?;
    match v.as_slice() {
        [x] if x.is_finite() && *x != 0.0 => Ok(*x),
        _ => Err(Error::tensor(
            name,
            format!("{} values ({:?}): one finite, non-zero scale expected", v.len(), s.shape),
        )),
    }
}

/// BitNet's packed ternary weights, `U8` `[out/4, in]`: output row `o` is bits `2·(o / (out/4))` of
/// packed row `o % (out/4)`, code − 1 its value (transformers' `unpack_weights`) — written as
/// TQ2_0 blocks with a scale of 1 (the same codes; the per-tensor scale is applied to the output).
pub fn bitnet_packed(name: &str, w: &Raw) -> Result<SourceTensor> {
    let [packed, inp] = matrix(w, name, St::U8, 1)?;
    let out = packed * 4;
    if !inp.is_multiple_of(256) {
        return Err(Error::tensor(
            name,
            format!("{inp} input columns: ternary weights need a multiple of 256"),
        ));
    }
    let one = half::f16::from_f32(1.0).to_le_bytes();
    let mut data = Vec::with_capacity(out * inp / 256 * 66);
    for o in 0..out {
        let (r, shift) = (o % packed, 2 * (o / packed));
        let row = &w.data[r * inp..(r + 1) * inp];
        for c in (0..inp).step_by(256) {
            let code = |i: usize| (row[c + i] >> shift) & 3;
            // TQ2_0: value 128·h + 32·l + m is bits 2l of byte 32·h + m.
            for h in 0..2 {
                for m in 0..32 {
                    data.push((0..4).fold(0u8, |b, l| b | code(128 * h + 32 * l + m) << (2 * l)));
                }
            }
            data.extend(one);
        }
    }
    Ok(SourceTensor { dtype: DType::Tq2_0, shape: vec![out, inp], data })
}
