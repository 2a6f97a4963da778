//! Pre-quantized HF checkpoints imported as published: block-wise FP8 (`quant_method: "fp8"`,
//! `weight_scale_inv`, DeepSeek-V3 / Qwen3-FP8), compressed-tensors (`float-quantized` FP8,
//! `int-quantized` INT8, `pack-quantized` int4/int8), AutoAWQ's GEMM layout and GPTQ. No value is
//! dequantized: each linear weight becomes one of the stored formats `fp8_e4m3_b128`,
//! `int8_b128` or `int4_g128` (128 values of a row behind the scale — and zero point — that
//! covers them), streamed compressed like the GGUF block types.

mod blocks;
mod layouts;
mod scheme;

pub use scheme::Scheme;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::source::SourceTensor;

/// A tensor as the safetensors file holds it (any element type).
pub struct Raw {
    pub dtype: safetensors::Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

/// Where the importer finds a checkpoint's raw tensors by name.
pub trait RawSource {
    fn raw(&self, name: &str) -> Result<Option<Raw>>;
    /// A tensor's element type and shape from its file's header, without reading its bytes.
    fn header(&self, name: &str) -> Result<Option<(safetensors::Dtype, Vec<usize>)>>;
}

/// Whether tensor `name` is stored as `dtype` (looked up in its header only: a tensor the scheme
/// leaves as it is is read once, by the caller).
fn stored_as(src: &dyn RawSource, name: &str, dtype: safetensors::Dtype) -> Result<bool> {
    Ok(src.header(name)?.is_some_and(|(d, _)| d == dtype))
}

/// The suffix of the virtual tensor naming a weight's stored input order (`layout`'s `*_perm`).
pub const INPUT_PERM: &str = ".input_perm";
/// The suffix of the virtual tensor holding what a BitLinear's output is multiplied by
/// (`layout`'s `*_oscale`).
pub const OUTPUT_SCALE: &str = ".output_scale";

impl Scheme {
    /// For `name` = `<module>.output_scale`: a BitLinear's output multiplier (f32 `[1]`): its
    /// `weight_scale`, or its inverse where `BitLinear` divides by it.
    pub fn output_scale(&self, src: &dyn RawSource, name: &str) -> Result<Option<SourceTensor>> {
        let (Some(prefix), Scheme::BitNet { divide }) = (name.strip_suffix(OUTPUT_SCALE), self)
        else {
            return Ok(None);
        };
        let Some(s) = src.raw(&format!("{prefix}.weight_scale"))? else { return Ok(None) };
        let v = layouts::single_scale(&format!("{prefix}.weight_scale"), &s)?;
        let m = if *divide { 1.0 / v } else { v };
        Ok(Some(SourceTensor { dtype: DType::F32, shape: vec![1], data: m.to_le_bytes().to_vec() }))
    }

    /// For `name` = `<module>.input_perm`: the order a GPTQ act-order weight's inputs are stored in
    /// (f32 indices, `[in]`), or `None` for weights stored in input order.
    pub fn input_perm(&self, src: &dyn RawSource, name: &str) -> Result<Option<SourceTensor>> {
        let (Some(prefix), Scheme::Gptq { group, .. }) = (name.strip_suffix(INPUT_PERM), self)
        else {
            return Ok(None);
        };
        let Some((dtype, shape)) = src.header(&format!("{prefix}.qweight"))? else {
            return Ok(None);
        };
        let g_idx = src.raw(&format!("{prefix}.g_idx"))?;
        let weight = format!("{prefix}.weight");
        let Some(perm) = layouts::gptq_perm(&weight, *group, (dtype, &shape), g_idx.as_ref())?
        else {
            return Ok(None);
        };
        let data = perm.iter().flat_map(|&i| (i as f32).to_le_bytes()).collect();
        Ok(Some(SourceTensor { dtype: DType::F32, shape: vec![perm.len()], data }))
    }

    /// The linear weight `name` (`….weight`) read through this scheme: `Ok(None)` when the
    /// checkpoint keeps it unquantized (an `ignore`d module, a norm, the embedding), so the caller
    /// reads it as a plain tensor. `perm_ok`: the caller also reads `input_perm` (dense layers);
    /// elsewhere (experts) an act-order weight is refused.
    pub fn weight(
        &self,
        src: &dyn RawSource,
        name: &str,
        perm_ok: bool,
    ) -> Result<Option<SourceTensor>> {
        let Some(prefix) = name.strip_suffix(".weight") else { return Ok(None) };
        let get = |suffix: &str| src.raw(&format!("{prefix}.{suffix}"));
        match self {
            Scheme::Fp8Block { block, .. } => {
                if !stored_as(src, name, safetensors::Dtype::F8_E4M3)? {
                    return Ok(None); // kept in bf16 (lm_head, norms, gates)
                }
                let w = need(get("weight")?, prefix, "weight")?;
                let s = need(get("weight_scale_inv")?, prefix, "weight_scale_inv")?;
                layouts::scaled_bytes(name, DType::Fp8E4m3B128, &w, &s, *block, "weight_scale_inv")
                    .map(Some)
            }
            Scheme::CompressedTensors(ct) => ct.weight(src, name, prefix, &get),
            Scheme::Mxfp4 => Ok(None),
            Scheme::BitNet { .. } => {
                if !stored_as(src, name, safetensors::Dtype::U8)? {
                    return Ok(None); // unpacked (bf16 ternary values) or not quantized: as it is
                }
                layouts::bitnet_packed(name, &need(get("weight")?, prefix, "weight")?).map(Some)
            }
            Scheme::Awq { group } => {
                let Some(q) = get("qweight")? else { return Ok(None) };
                let z = need(get("qzeros")?, prefix, "qzeros")?;
                let s = need(get("scales")?, prefix, "scales")?;
                layouts::awq(name, *group, &q, &z, &s).map(Some)
            }
            Scheme::Gptq { group, v1_zeros } => {
                let Some(q) = get("qweight")? else { return Ok(None) };
                let z = need(get("qzeros")?, prefix, "qzeros")?;
                let s = need(get("scales")?, prefix, "scales")?;
                let g_idx = get("g_idx")?;
                let perm = layouts::gptq_perm(name, *group, (q.dtype, &q.shape), g_idx.as_ref())?;
                if !perm_ok && perm.is_some() {
                    return Err(Error::tensor(
                        format!("{prefix}.g_idx"),
                        "act-order (desc_act) weights are supported in dense layers, not in experts",
                    ));
                }
                layouts::gptq(name, *group, *v1_zeros, &q, &z, &s, perm.as_deref()).map(Some)
            }
        }
    }
}

fn need(t: Option<Raw>, prefix: &str, what: &str) -> Result<Raw> {
    t.ok_or_else(|| Error::tensor(format!("{prefix}.{what}"), "missing from the checkpoint"))
}

impl scheme::CompressedTensors {
    fn weight(
        &self,
        src: &dyn RawSource,
        name: &str,
        prefix: &str,
        get: &dyn Fn(&str) -> Result<Option<Raw>>,
    ) -> Result<Option<SourceTensor>> {
        let Some(args) = self.scheme_for(prefix) else { return Ok(None) };
        if let Some(packed) = get("weight_packed")? {
            let s = need(get("weight_scale")?, prefix, "weight_scale")?;
            let shape = need(get("weight_shape")?, prefix, "weight_shape")?;
            let z = get("weight_zero_point")?;
            return layouts::ct_packed(name, args, &packed, &s, z.as_ref(), &shape).map(Some);
        }
        let dtype = match src.header(name)? {
            Some((safetensors::Dtype::F8_E4M3, _)) => DType::Fp8E4m3B128,
            Some((safetensors::Dtype::I8, _)) => DType::Int8B128,
            // Absent, or stored unquantized although a group names it: as it is.
            _ => return Ok(None),
        };
        let w = need(get("weight")?, prefix, "weight")?;
        if !args.symmetric {
            if let Some(z) = get("weight_zero_point")? {
                if z.data.iter().any(|&b| b != 0) {
                    return Err(Error::tensor(
                        format!("{prefix}.weight_zero_point"),
                        "asymmetric 8-bit weights (non-zero zero points) are not supported",
                    ));
                }
            }
        }
        let s = need(get("weight_scale")?, prefix, "weight_scale")?;
        let block = args.block(&w.shape, name)?;
        layouts::scaled_bytes(name, dtype, &w, &s, block, "weight_scale").map(Some)
    }
}
