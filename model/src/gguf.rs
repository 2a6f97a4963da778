//! GGUF v2/v3 reader: metadata key/values, tensor directory, and a memory map of the tensor data.
//!
//! The llama (Llama, Mistral), qwen2 and qwen3 architectures are imported; their metadata becomes a
//! [`ModelConfig`] and their tokenizer metadata is rebuilt as a `tokenizer.json` by
//! [`crate::gguf_tokenizer`].

use crate::config::{Arch, ModelConfig, RopeConfig};
use crate::dtype::DType;
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

mod checkpoint;
pub use checkpoint::{move_head_rows, unpermute_rows, GgufCheckpoint};

const MAGIC: &[u8; 4] = b"GGUF";

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U64(u64),
    I64(i64),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, if it is an integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U64(v) => Some(v),
            Value::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }
    /// The value as a float, if it is numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F64(v) => Some(v),
            Value::U64(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => None,
        }
    }
    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    /// The value as an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
    /// The value as a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }
}

/// One entry of the tensor directory.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// Row-major shape (GGUF's `ne` reversed: last dimension is contiguous).
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// Absolute offset of the data in the file.
    pub offset: usize,
    pub bytes: usize,
}

/// An opened GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    map: memmap2::Mmap,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.pos.checked_add(n).is_none_or(|end| end > self.buf.len()) {
            return Err(Error::Corrupt {
                path: self.path.into(),
                offset: self.pos as u64,
                msg: format!("need {n} bytes, file ends at {}", self.buf.len()),
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn string(&mut self) -> Result<String> {
        let at = self.pos;
        let n = self.u64()? as usize;
        let bytes = self.take(n)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| Error::Corrupt {
            path: self.path.into(),
            offset: at as u64,
            msg: "string is not UTF-8".into(),
        })
    }
    fn value(&mut self, ty: u32) -> Result<Value> {
        Ok(match ty {
            0 => Value::U64(self.take(1)?[0] as u64),
            1 => Value::I64(self.take(1)?[0] as i8 as i64),
            2 => Value::U64(u16::from_le_bytes(self.take(2)?.try_into().unwrap()) as u64),
            3 => Value::I64(i16::from_le_bytes(self.take(2)?.try_into().unwrap()) as i64),
            4 => Value::U64(self.u32()? as u64),
            5 => Value::I64(self.u32()? as i32 as i64),
            6 => Value::F64(f32::from_bits(self.u32()?) as f64),
            7 => Value::Bool(self.take(1)?[0] != 0),
            8 => Value::Str(self.string()?),
            9 => {
                let inner = self.u32()?;
                if inner == 9 {
                    // GGUF metadata has no arrays of arrays; refusing them also bounds recursion.
                    return Err(self.corrupt("nested metadata arrays are not supported".into()));
                }
                let n = self.u64()? as usize;
                // Every item takes at least one byte: a longer array cannot be in the file.
                if n > self.buf.len() - self.pos {
                    return Err(self.corrupt(format!("array length {n} exceeds the bytes left")));
                }
                let mut items = Vec::with_capacity(n.min(1 << 16));
                for _ in 0..n {
                    items.push(self.value(inner)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(self.u64()? as i64),
            12 => Value::F64(f64::from_bits(self.u64()?)),
            other => return Err(self.corrupt(format!("unknown metadata value type {other}"))),
        })
    }
    fn corrupt(&self, msg: String) -> Error {
        Error::Corrupt { path: self.path.into(), offset: self.pos as u64, msg }
    }
}

impl GgufFile {
    /// Opens and parses a GGUF file; a truncated or malformed file names the offset at fault.
    pub fn open(path: &Path) -> Result<GgufFile> {
        crate::error::regular(path)?;
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the file is opened read-only and we never hand out references that outlive `map`;
        // a concurrent writer truncating it is outside what we support (as for any mmap reader).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let mut c = Cursor { buf: &map, pos: 0, path };
        if c.take(4)? != MAGIC {
            return Err(Error::Corrupt {
                path: path.into(),
                offset: 0,
                msg: "not a GGUF file (bad magic)".into(),
            });
        }
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            return Err(Error::format(
                path,
                format!("GGUF version {version} unsupported (2 or 3)"),
            ));
        }
        let n_tensors = c.u64()? as usize;
        let n_kv = c.u64()? as usize;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string()?;
            let ty = c.u32()?;
            let val = c.value(ty)?;
            metadata.insert(key, val);
        }
        let mut raw = Vec::with_capacity(n_tensors.min(1 << 20));
        for _ in 0..n_tensors {
            let name = c.string()?;
            let nd = c.u32()? as usize;
            if nd == 0 || nd > 4 {
                return Err(c.corrupt(format!("tensor {name}: {nd} dimensions")));
            }
            let mut ne = Vec::with_capacity(nd);
            for _ in 0..nd {
                ne.push(c.u64()? as usize);
            }
            let code = c.u32()?;
            let offset = c.u64()? as usize;
            let dtype = DType::from_ggml_type(code).ok_or_else(|| {
                let known: Vec<&str> = DType::ALL.iter().map(|d| d.name()).collect();
                Error::tensor(
                    &name,
                    format!("GGML type {code} unsupported (supported: {})", known.join(", ")),
                )
            })?;
            ne.reverse();
            raw.push((name, ne, dtype, offset));
        }
        let align = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() && a <= 1 << 20 => a as usize,
                _ => {
                    return Err(Error::config(
                        "general.alignment",
                        format!("{v:?} is not a power of two up to 1 MiB"),
                    ))
                }
            },
        };
        let data_start = c.pos.div_ceil(align) * align;
        let mut tensors = Vec::with_capacity(raw.len());
        let mut names = std::collections::HashSet::new();
        for (name, shape, dtype, rel) in raw {
            if !names.insert(name.clone()) {
                return Err(Error::tensor(&name, "listed twice in the tensor directory"));
            }
            let bytes = dtype.tensor_bytes(&shape).ok_or_else(|| {
                Error::tensor(
                    &name,
                    format!("shape {shape:?} is not whole {dtype} blocks, or too large"),
                )
            })?;
            if rel % align != 0 {
                return Err(Error::tensor(&name, format!("offset {rel} is not {align}-aligned")));
            }
            let end = data_start.checked_add(rel).and_then(|o| o.checked_add(bytes));
            if end.is_none_or(|e| e > map.len()) {
                return Err(Error::Corrupt {
                    path: path.into(),
                    offset: map.len() as u64,
                    msg: format!(
                        "tensor {name} (offset {rel} + {bytes} bytes) lies past the end of the file"
                    ),
                });
            }
            tensors.push(TensorInfo { name, shape, dtype, offset: data_start + rel, bytes });
        }
        check_no_overlap(&tensors)?;
        Ok(GgufFile { path: path.into(), metadata, tensors, map })
    }

    /// The bytes of a tensor.
    pub fn data(&self, t: &TensorInfo) -> &[u8] {
        &self.map[t.offset..t.offset + t.bytes]
    }

    /// Looks up a tensor by GGUF name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    fn meta(&self, key: &str) -> Result<&Value> {
        self.metadata.get(key).ok_or_else(|| Error::config(key, "missing from GGUF metadata"))
    }

    fn meta_usize(&self, key: &str) -> Result<usize> {
        self.meta(key)?
            .as_u64()
            .map(|v| v as usize)
            .ok_or_else(|| Error::config(key, "not an integer"))
    }

    /// The architecture (`general.architecture`): llama (also Mistral's files), qwen2 or qwen3.
    pub fn arch(&self) -> Result<Arch> {
        match self.meta("general.architecture")?.as_str().unwrap_or("") {
            // Mixtral's files are `llama` with experts.
            "llama"
                if self.metadata.get("llama.expert_count").and_then(Value::as_u64).unwrap_or(0)
                    > 0 =>
            {
                Ok(Arch::Mixtral)
            }
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "qwen3" => Ok(Arch::Qwen3),
            "qwen3moe" => Ok(Arch::Qwen3Moe),
            "gemma3" => Ok(Arch::Gemma3),
            "gpt-oss" => Ok(Arch::GptOss),
            "deepseek2" => Ok(Arch::DeepseekV3),
            other => Err(Error::UnsupportedArch {
                got: format!("GGUF {other}"),
                supported: crate::config::SUPPORTED_ARCHS.into(),
            }),
        }
    }

    /// Builds the model config from the `<architecture>.*` metadata.
    pub fn config(&self) -> Result<ModelConfig> {
        let arch = self.arch()?;
        if arch == Arch::DeepseekV3 {
            let cfg = self.deepseek2_config()?;
            self.check_block_count(&cfg, "deepseek2")?;
            return Ok(cfg);
        }
        let p = match arch {
            Arch::Llama | Arch::Mistral | Arch::Mixtral => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Gemma3 => "gemma3",
            Arch::GptOss => "gpt-oss",
            // BitNet has no GGUF architecture here; DeepSeek-V3 is read above.
            Arch::BitNet | Arch::DeepseekV3 => {
                return Err(Error::UnsupportedArch {
                    got: format!("{arch:?}"),
                    supported: crate::config::SUPPORTED_ARCHS.into(),
                })
            }
        };
        let key = |k: &str| format!("{p}.{k}");
        let scaling = self.rope_scaling(p)?;
        if self.tensor("rope_freqs.weight").is_some() {
            return Err(Error::tensor(
                "rope_freqs.weight",
                "GGUF llama3 RoPE frequency factors are not supported",
            ));
        }
        let hidden = self.meta_usize(&key("embedding_length"))?;
        let heads = self.meta_usize(&key("attention.head_count"))?;
        if heads == 0 {
            return Err(Error::config(key("attention.head_count"), "must be > 0"));
        }
        let vocab = match self.metadata.get(&key("vocab_size")).and_then(Value::as_u64) {
            Some(v) => v as usize,
            None => self.meta("tokenizer.ggml.tokens")?.as_array().map_or(0, |a| a.len()),
        };
        let head_dim = self
            .metadata
            .get(&key("attention.key_length"))
            .and_then(Value::as_u64)
            .map_or(hidden / heads, |v| v as usize);
        let u32_of = |k: &str| self.metadata.get(k).and_then(Value::as_u64).map(|v| v as u32);
        let cfg = ModelConfig {
            arch,
            hidden_size: hidden,
            intermediate_size: self.meta_usize(&key("feed_forward_length"))?,
            num_layers: self.meta_usize(&key("block_count"))?,
            num_heads: heads,
            num_kv_heads: self
                .metadata
                .get(&key("attention.head_count_kv"))
                .and_then(Value::as_u64)
                .map_or(heads, |v| v as usize),
            head_dim,
            vocab_size: vocab,
            rms_norm_eps: self
                .meta(&key("attention.layer_norm_rms_epsilon"))?
                .as_f64()
                .unwrap_or(1e-5),
            rope: RopeConfig {
                theta: self
                    .metadata
                    .get(&key("rope.freq_base"))
                    .and_then(Value::as_f64)
                    .unwrap_or(10000.0),
                scaling,
            },
            max_position_embeddings: self
                .metadata
                .get(&key("context_length"))
                .and_then(Value::as_u64)
                .unwrap_or(4096) as usize,
            tie_word_embeddings: self.tensor("output.weight").is_none(),
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3),
            bos_token_id: u32_of("tokenizer.ggml.bos_token_id"),
            eos_token_ids: u32_of("tokenizer.ggml.eos_token_id").into_iter().collect(),
            moe: self.moe(arch, p)?,
            gemma: None,
            sliding_window: None,
            bitlinear: false,
            full_attention_layers: Vec::new(),
            attn_sinks: false,
            mla: None,
        };
        let cfg = ModelConfig { gemma: self.gemma(&cfg, p)?, ..cfg };
        let cfg = self.gpt_oss(cfg, p)?;
        // f32 metadata widened to f64 carries float noise (1e-5 -> 9.99999974738e-06); round it back.
        let cfg = ModelConfig { rms_norm_eps: (cfg.rms_norm_eps as f32) as f64, ..cfg };
        cfg.validate()?;
        self.check_block_count(&cfg, p)?;
        Ok(cfg)
    }

    /// gpt-oss as llama.cpp reads it: every even layer windowed (`attention.sliding_window`,
    /// llama.cpp's SWA pattern 2), sinks, biased router and experts, SwiGLU clamped at 7 with α
    /// 1.702 (llama.cpp's constants).
    fn gpt_oss(&self, cfg: ModelConfig, p: &str) -> Result<ModelConfig> {
        if cfg.arch != Arch::GptOss {
            return Ok(cfg);
        }
        let m = crate::config::MoeConfig {
            experts: self.meta_usize(&format!("{p}.expert_count"))?,
            top_k: self.meta_usize(&format!("{p}.expert_used_count"))?,
            expert_intermediate: self.meta_usize(&format!("{p}.expert_feed_forward_length"))?,
            norm_topk_prob: true,
            bias: true,
            swiglu_clamp: Some(crate::config::SwigluClamp { alpha: 1.702, limit: 7.0 }),
            ..Default::default()
        };
        Ok(ModelConfig {
            moe: Some(m),
            sliding_window: Some(self.meta_usize(&format!("{p}.attention.sliding_window"))?),
            full_attention_layers: (1..cfg.num_layers).step_by(2).collect(),
            attn_sinks: true,
            ..cfg
        })
    }

    /// The `<p>.rope.scaling.*` keys (none, linear or yarn).
    fn rope_scaling(&self, p: &str) -> Result<Option<crate::config::RopeScaling>> {
        let key = |k: &str| format!("{p}.{k}");
        let num = |k: &str| -> Result<f64> {
            self.meta(&key(k))?.as_f64().ok_or_else(|| Error::config(key(k), "not a number"))
        };
        let opt = |k: &str| self.metadata.get(&key(k)).and_then(Value::as_f64);
        Ok(match self.metadata.get(&key("rope.scaling.type")).and_then(Value::as_str) {
            None | Some("none") => None,
            Some("linear") => {
                Some(crate::config::RopeScaling::Linear { factor: num("rope.scaling.factor")? })
            }
            // llama.cpp rounds the ramp's bounds outward (transformers' `truncate`).
            Some("yarn") => {
                let factor = num("rope.scaling.factor")?;
                Some(crate::config::RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings: num("rope.scaling.original_context_length")?,
                    beta_fast: opt("rope.scaling.yarn_beta_fast").unwrap_or(32.0),
                    beta_slow: opt("rope.scaling.yarn_beta_slow").unwrap_or(1.0),
                    truncate: true,
                    attention_factor: opt("rope.scaling.yarn_attn_factor")
                        .unwrap_or(if factor <= 1.0 { 1.0 } else { 0.1 * factor.ln() + 1.0 }),
                })
            }
            Some(kind) => {
                return Err(Error::config(
                    key("rope.scaling.type"),
                    format!("unsupported {kind:?}; supported: none, linear, yarn"),
                ))
            }
        })
    }

    /// Every block's tensors must belong to a block the config counts.
    fn check_block_count(&self, cfg: &ModelConfig, p: &str) -> Result<()> {
        if let Some(t) = self.tensors.iter().find(|t| {
            t.name
                .strip_prefix("blk.")
                .and_then(|r| r.split('.').next())
                .and_then(|n| n.parse::<usize>().ok())
                .is_some_and(|n| n >= cfg.num_layers)
        }) {
            return Err(Error::config(
                format!("{p}.block_count"),
                format!("{} blocks, but the file has tensor {}", cfg.num_layers, t.name),
            ));
        }
        Ok(())
    }

    /// Gemma 3's section as llama.cpp reads it: the window (`attention.sliding_window`), every 6th
    /// layer global, the sliding layers' base `rope.freq_base_swa` (10000 when absent), and the
    /// attention scale llama.cpp derives (the file does not carry `query_pre_attn_scalar`): the head
    /// size, or hidden ÷ heads for the 62-layer 27B.
    fn gemma(&self, cfg: &ModelConfig, p: &str) -> Result<Option<crate::config::GemmaConfig>> {
        if cfg.arch != Arch::Gemma3 {
            return Ok(None);
        }
        let f = |k: &str, d: f64| {
            self.metadata.get(&format!("{p}.{k}")).and_then(Value::as_f64).unwrap_or(d)
        };
        let scalar = if cfg.num_layers == 62 {
            (cfg.hidden_size / cfg.num_heads) as f64
        } else {
            cfg.head_dim as f64
        };
        Ok(Some(crate::config::GemmaConfig {
            query_pre_attn_scalar: scalar,
            sliding_window: self.meta_usize(&format!("{p}.attention.sliding_window"))?,
            global_layers: (0..cfg.num_layers).filter(|i| (i + 1).is_multiple_of(6)).collect(),
            local_rope: RopeConfig { theta: f("rope.freq_base_swa", 10000.0), scaling: None },
        }))
    }

    /// The experts section: `<arch>.expert_count`, `expert_used_count` and the expert width
    /// (`expert_feed_forward_length`, or `feed_forward_length` for Mixtral's `llama` files). llama.cpp
    /// renormalises the top-k weights of both, as Mixtral and Qwen3-MoE (norm_topk_prob) do.
    fn moe(&self, arch: Arch, p: &str) -> Result<Option<crate::config::MoeConfig>> {
        if !matches!(arch, Arch::Qwen3Moe | Arch::Mixtral) {
            return Ok(None);
        }
        let width = if arch == Arch::Qwen3Moe {
            format!("{p}.expert_feed_forward_length")
        } else {
            format!("{p}.feed_forward_length")
        };
        Ok(Some(crate::config::MoeConfig {
            experts: self.meta_usize(&format!("{p}.expert_count"))?,
            top_k: self.meta_usize(&format!("{p}.expert_used_count"))?,
            expert_intermediate: self.meta_usize(&width)?,
            norm_topk_prob: true,
            ..Default::default()
        }))
    }

    /// The chat template, if the file carries one.
    pub fn chat_template(&self) -> Option<String> {
        self.metadata.get("tokenizer.chat_template").and_then(Value::as_str).map(str::to_owned)
    }
}

/// Two tensors whose data overlap would read each other's bytes: refused, naming both.
fn check_no_overlap(tensors: &[TensorInfo]) -> Result<()> {
    let mut spans: Vec<&TensorInfo> = tensors.iter().filter(|t| t.bytes > 0).collect();
    spans.sort_by_key(|t| t.offset);
    for w in spans.windows(2) {
        if w[0].offset + w[0].bytes > w[1].offset {
            return Err(Error::tensor(
                &w[1].name,
                format!("its data overlaps tensor {}'s", w[0].name),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // llama.cpp: reshape(n_head, 2, hd/2, cols).swapaxes(1, 2)
        let (heads, hd, cols) = (2, 8, 3);
        let rows = heads * hd;
        let hf: Vec<u8> = (0..rows * cols).map(|x| x as u8).collect();
        let mut gguf = vec![0u8; hf.len()];
        for h in 0..heads {
            for j in 0..2 {
                for i in 0..hd / 2 {
                    let src = h * hd + j * hd / 2 + i;
                    let dst = h * hd + i * 2 + j;
                    gguf[dst * cols..(dst + 1) * cols]
                        .copy_from_slice(&hf[src * cols..(src + 1) * cols]);
                }
            }
        }
        assert_ne!(gguf, hf);
        assert_eq!(unpermute_rows(&gguf, rows, heads), hf);
    }

    #[test]
    fn truncated_file_names_offset() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.gguf");
        let mut bytes = b"GGUF".to_vec();
        bytes.extend_from_slice(&3u32.to_le_bytes());
        bytes.extend_from_slice(&1u64.to_le_bytes());
        std::fs::write(&p, &bytes).unwrap();
        let e = GgufFile::open(&p).err().unwrap().to_string();
        assert!(e.contains("x.gguf") && e.contains("offset 16"), "{e}");
    }
}
