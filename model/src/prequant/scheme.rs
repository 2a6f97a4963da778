//! `config.json`'s `quantization_config`: which pre-quantized layout a checkpoint uses, refused
//! with the field at fault when layerstream cannot keep it as stored.

use crate::error::{Error, Result};
use serde_json::Value;

/// A checkpoint's quantization, as far as the importer needs it.
#[derive(Debug, Clone)]
pub enum Scheme {
    /// `quant_method: "fp8"`: e4m3 weights with `weight_scale_inv` per `[rows, cols]` block.
    Fp8Block { block: [usize; 2] },
    /// `quant_method: "compressed-tensors"`.
    CompressedTensors(CompressedTensors),
    /// AutoAWQ's GEMM layout (4-bit, zero points, groups of `group` inputs).
    Awq { group: usize },
    /// GPTQ 4-bit (`group` inputs per scale, `None` for per-channel); `v1_zeros`: the zero points
    /// are stored minus one (`checkpoint_format: "gptq"`, AutoGPTQ's and optimum's files).
    Gptq { group: Option<usize>, v1_zeros: bool },
    /// `quant_method: "bitnet"` (offline): ternary weights packed four to a byte down the rows,
    /// with a per-tensor `weight_scale` the output is divided by (`BitLinear`) or multiplied by
    /// (`AutoBitLinear`, `divide: false`).
    BitNet { divide: bool },
    /// `quant_method: "mxfp4"` (gpt-oss): only the experts are quantized, read from their
    /// `*_blocks`/`*_scales` by `hf_stacked`; every other tensor is stored as it is.
    Mxfp4,
}

/// compressed-tensors' config groups and ignore list.
#[derive(Debug, Clone)]
pub struct CompressedTensors {
    groups: Vec<(Vec<String>, Args)>,
    ignore: Vec<String>,
}

/// One config group's weight arguments.
#[derive(Debug, Clone)]
pub struct Args {
    pub num_bits: usize,
    pub symmetric: bool,
    pub strategy: String,
    pub group_size: Option<usize>,
    pub block_structure: Option<[usize; 2]>,
}

fn field<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    v.get(key).filter(|x| !x.is_null())
}

fn bad(field: &str, msg: impl Into<String>) -> Error {
    Error::config(format!("quantization_config.{field}"), msg)
}

fn usize_of(v: &Value, key: &str, path: &str) -> Result<Option<usize>> {
    match field(v, key) {
        None => Ok(None),
        Some(x) => x
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| bad(path, format!("{x} is not a positive integer"))),
    }
}

fn pair(v: &Value, path: &str) -> Result<[usize; 2]> {
    match v.as_array().map(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<_>>>()) {
        Some(Some(a)) if a.len() == 2 && a.iter().all(|&n| n > 0) => {
            Ok([a[0] as usize, a[1] as usize])
        }
        _ => Err(bad(path, format!("{v} is not two positive integers"))),
    }
}

impl Scheme {
    /// The scheme of a `config.json`, or `None` for an unquantized checkpoint.
    pub fn from_config(config: &Value) -> Result<Option<Scheme>> {
        let Some(q) = field(config, "quantization_config") else { return Ok(None) };
        let method = field(q, "quant_method").and_then(Value::as_str).unwrap_or("");
        Ok(Some(match method {
            "fp8" => {
                if let Some(f) = field(q, "fmt").and_then(Value::as_str) {
                    if f != "e4m3" {
                        return Err(bad("fmt", format!("{f:?} is not supported (e4m3)")));
                    }
                }
                let block = match field(q, "weight_block_size") {
                    Some(b) => pair(b, "weight_block_size")?,
                    None => [128, 128], // transformers' FineGrainedFP8Config default
                };
                Scheme::Fp8Block { block }
            }
            "compressed-tensors" => Scheme::CompressedTensors(CompressedTensors::parse(q)?),
            "awq" => {
                bits4(q)?;
                let version = field(q, "version").and_then(Value::as_str).unwrap_or("gemm");
                if !version.eq_ignore_ascii_case("gemm") {
                    return Err(bad(
                        "version",
                        format!("AWQ {version:?} layout is not supported (gemm)"),
                    ));
                }
                if field(q, "zero_point").and_then(Value::as_bool) == Some(false) {
                    return Err(bad("zero_point", "AWQ without zero points is not supported"));
                }
                let group = usize_of(q, "group_size", "group_size")?
                    .ok_or_else(|| bad("group_size", "missing"))?;
                Scheme::Awq { group }
            }
            "gptq" => {
                bits4(q)?;
                let group = match field(q, "group_size").and_then(Value::as_i64) {
                    Some(-1) => None,
                    Some(g) if g > 0 => Some(g as usize),
                    other => {
                        return Err(bad(
                            "group_size",
                            format!("{other:?}: a positive size or -1 expected"),
                        ))
                    }
                };
                let format =
                    field(q, "checkpoint_format").and_then(Value::as_str).unwrap_or("gptq");
                let v1_zeros = match format {
                    "gptq" => true,
                    "gptq_v2" => false,
                    other => {
                        return Err(bad(
                            "checkpoint_format",
                            format!("{other:?} is not supported (gptq, gptq_v2)"),
                        ))
                    }
                };
                Scheme::Gptq { group, v1_zeros }
            }
            "bitnet" => {
                let mode =
                    field(q, "quantization_mode").and_then(Value::as_str).unwrap_or("offline");
                if mode != "offline" {
                    return Err(bad(
                        "quantization_mode",
                        format!("{mode:?} is not supported (offline)"),
                    ));
                }
                if field(q, "use_rms_norm").and_then(Value::as_bool) == Some(true) {
                    return Err(bad(
                        "use_rms_norm",
                        "BitLinear's own input RMSNorm is not supported",
                    ));
                }
                let divide =
                    match field(q, "linear_class").and_then(Value::as_str).unwrap_or("bitlinear") {
                        "bitlinear" => true,
                        "autobitlinear" => false,
                        other => {
                            return Err(bad(
                                "linear_class",
                                format!("{other:?} is not supported (bitlinear, autobitlinear)"),
                            ))
                        }
                    };
                Scheme::BitNet { divide }
            }
            "mxfp4" => Scheme::Mxfp4,
            other => {
                return Err(bad(
                    "quant_method",
                    format!(
                        "{other:?} is not supported (fp8, compressed-tensors, awq, gptq, bitnet, \
                         mxfp4)"
                    ),
                ))
            }
        }))
    }
}

fn bits4(q: &Value) -> Result<()> {
    match field(q, "bits").or_else(|| field(q, "w_bit")).and_then(Value::as_u64) {
        Some(4) => Ok(()),
        other => Err(bad("bits", format!("{other:?}: only 4-bit weights are supported"))),
    }
}

const CT_FORMATS: [&str; 4] =
    ["float-quantized", "int-quantized", "pack-quantized", "naive-quantized"];

impl CompressedTensors {
    fn parse(q: &Value) -> Result<CompressedTensors> {
        let top_format = field(q, "format").and_then(Value::as_str);
        let groups_v = field(q, "config_groups")
            .and_then(Value::as_object)
            .ok_or_else(|| bad("config_groups", "missing"))?;
        let mut groups = Vec::new();
        for (gname, g) in groups_v {
            let path = format!("config_groups.{gname}");
            let format = field(g, "format").and_then(Value::as_str).or(top_format).unwrap_or("");
            if !CT_FORMATS.contains(&format) {
                return Err(bad(
                    &format!("{path}.format"),
                    format!("{format:?} is not supported ({})", CT_FORMATS.join(", ")),
                ));
            }
            let targets: Vec<String> = field(g, "targets")
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(|t| t.as_str().map(str::to_owned)).collect())
                .unwrap_or_default();
            let Some(w) = field(g, "weights") else { continue }; // activations only
            let wp = format!("{path}.weights");
            let num_bits = usize_of(w, "num_bits", &format!("{wp}.num_bits"))?.unwrap_or(8);
            let kind = field(w, "type").and_then(Value::as_str).unwrap_or("int");
            match (kind, num_bits) {
                ("int", 4 | 8) | ("float", 8) => {}
                _ => {
                    return Err(bad(
                        &format!("{wp}.num_bits"),
                        format!(
                            "{kind} {num_bits}-bit weights are not supported (int4, int8, float8)"
                        ),
                    ))
                }
            }
            let strategy =
                field(w, "strategy").and_then(Value::as_str).unwrap_or("tensor").to_owned();
            if !["tensor", "channel", "group", "block"].contains(&strategy.as_str()) {
                return Err(bad(
                    &format!("{wp}.strategy"),
                    format!("{strategy:?} is not supported"),
                ));
            }
            let block_structure = match field(w, "block_structure") {
                Some(b) => Some(pair(b, &format!("{wp}.block_structure"))?),
                None => None,
            };
            let args = Args {
                num_bits,
                symmetric: field(w, "symmetric").and_then(Value::as_bool).unwrap_or(true),
                group_size: usize_of(w, "group_size", &format!("{wp}.group_size"))?,
                strategy,
                block_structure,
            };
            groups.push((targets, args));
        }
        let ignore = field(q, "ignore")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(|t| t.as_str().map(str::to_owned)).collect())
            .unwrap_or_default();
        Ok(CompressedTensors { groups, ignore })
    }

    /// The weight arguments of module `module` (`model.layers.0.self_attn.q_proj`), or `None`
    /// when no group targets it or `ignore` lists it.
    pub fn scheme_for(&self, module: &str) -> Option<&Args> {
        if self.ignore.iter().any(|p| matches(p, module)) {
            return None;
        }
        self.groups
            .iter()
            .find(|(targets, _)| targets.iter().any(|t| matches(t, module)))
            .map(|(_, a)| a)
    }
}

/// compressed-tensors' target syntax: `re:<python regex>` matched from the start of the module
/// name, a class name (`Linear`: any projection), or the module's name (or its suffix).
fn matches(target: &str, module: &str) -> bool {
    if let Some(re) = target.strip_prefix("re:") {
        return regex::Regex::new(&format!("^(?:{re})")).is_ok_and(|r| r.is_match(module));
    }
    if target == "Linear" {
        return !module.contains("embed") && !module.ends_with("norm");
    }
    module == target || module.ends_with(&format!(".{target}"))
}

impl Args {
    /// The `[rows, cols]` that one scale covers in a `[out, in]` weight.
    pub fn block(&self, shape: &[usize], name: &str) -> Result<[usize; 2]> {
        let [out, inp] = shape else {
            return Err(Error::tensor(name, format!("shape {shape:?}: a matrix expected")));
        };
        Ok(match self.strategy.as_str() {
            "tensor" => [*out, *inp],
            "channel" => [1, *inp],
            "group" => [
                1,
                self.group_size
                    .ok_or_else(|| Error::tensor(name, "group strategy without group_size"))?,
            ],
            _ => self
                .block_structure
                .ok_or_else(|| Error::tensor(name, "block strategy without block_structure"))?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn schemes_parse_and_bad_ones_name_the_field() {
        let fp8 = json!({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}});
        assert!(matches!(
            Scheme::from_config(&fp8).unwrap(),
            Some(Scheme::Fp8Block { block: [128, 128] })
        ));
        let gptq = json!({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": true}});
        assert!(matches!(
            Scheme::from_config(&gptq).unwrap(),
            Some(Scheme::Gptq { group: None, v1_zeros: true })
        ));
        for (cfg, field) in [
            (json!({"quant_method": "bitsandbytes"}), "quantization_config.quant_method"),
            (
                json!({"quant_method": "awq", "bits": 3, "group_size": 128}),
                "quantization_config.bits",
            ),
            (
                json!({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}),
                "quantization_config.version",
            ),
            (json!({"quant_method": "fp8", "fmt": "e5m2"}), "quantization_config.fmt"),
            (
                json!({"quant_method": "bitnet", "quantization_mode": "online"}),
                "quantization_config.quantization_mode",
            ),
            (
                json!({"quant_method": "bitnet", "use_rms_norm": true}),
                "quantization_config.use_rms_norm",
            ),
            (
                json!({"quant_method": "compressed-tensors", "config_groups": {"g": {"format": "nvfp4-pack-quantized", "targets": ["Linear"], "weights": {"num_bits": 4}}}}),
                "quantization_config.config_groups.g.format",
            ),
            (
                json!({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 2, "type": "int"}}}}),
                "quantization_config.config_groups.g.weights.num_bits",
            ),
        ] {
            let e =
                Scheme::from_config(&json!({"quantization_config": cfg})).unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
    }

    #[test]
    fn compressed_tensors_targets_and_ignore() {
        let q = json!({"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head", "re:.*mlp.down_proj"],
            "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "strategy": "group", "group_size": 128}}}});
        let Some(Scheme::CompressedTensors(ct)) =
            Scheme::from_config(&json!({"quantization_config": q})).unwrap()
        else {
            panic!()
        };
        assert!(ct.scheme_for("model.layers.0.self_attn.q_proj").is_some());
        assert!(ct.scheme_for("model.layers.1.mlp.down_proj").is_none());
        assert!(ct.scheme_for("lm_head").is_none());
        assert!(ct.scheme_for("model.embed_tokens").is_none());
    }
}
