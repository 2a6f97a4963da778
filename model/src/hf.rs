//! Reader for HF checkpoint directories: `config.json`, single or sharded safetensors, tokenizer files.

use crate::config::ModelConfig;
use crate::dtype::DType;
use crate::error::{read_json, Error, Result};
use crate::source::{Checkpoint, SourceTensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Where a Gemma 3 checkpoint keeps a layer tensor: its pre-MLP norm is `pre_feedforward_layernorm`
/// and its `post_attention_layernorm` follows attention (the Llama table's names otherwise).
pub fn gemma_name(arch: crate::config::Arch, hf: &str) -> &str {
    use crate::layout::GEMMA_POST_ATTN;
    match (arch, hf) {
        (crate::config::Arch::Gemma3, "post_attention_layernorm.weight") => {
            "pre_feedforward_layernorm.weight"
        }
        (crate::config::Arch::Gemma3, GEMMA_POST_ATTN) => "post_attention_layernorm.weight",
        _ => hf,
    }
}

/// An opened HF model directory.
pub struct HfCheckpoint {
    dir: PathBuf,
    config: ModelConfig,
    shards: Vec<(PathBuf, memmap2::Mmap)>,
    /// tensor name -> shard index
    index: HashMap<String, usize>,
    /// The checkpoint's `quantization_config`, if it is pre-quantized.
    quant: Option<crate::prequant::Scheme>,
}

fn st_dtype(d: safetensors::Dtype, name: &str) -> Result<DType> {
    match d {
        safetensors::Dtype::F32 => Ok(DType::F32),
        safetensors::Dtype::F16 => Ok(DType::F16),
        safetensors::Dtype::BF16 => Ok(DType::Bf16),
        other => Err(Error::tensor(
            name,
            format!("safetensors dtype {other:?} unsupported (F32, F16, BF16)"),
        )),
    }
}

impl HfCheckpoint {
    /// Opens `dir`, parsing the config and indexing every safetensors shard.
    pub fn open(dir: &Path) -> Result<Self> {
        let raw_config: serde_json::Value = read_json(&dir.join("config.json"))?;
        let config = ModelConfig::from_hf(&raw_config)?;
        let quant = crate::prequant::Scheme::from_config(&raw_config)?;
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<String> = if index_path.exists() {
            let idx: serde_json::Value = read_json(&index_path)?;
            let map = idx
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::format(&index_path, "no weight_map object"))?;
            let mut files: Vec<String> =
                map.values().filter_map(|v| v.as_str().map(str::to_owned)).collect();
            files.sort();
            files.dedup();
            files
        } else {
            vec!["model.safetensors".into()]
        };
        let mut shards = Vec::new();
        let mut index = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            // A shard is a plain file name inside the model directory, and a regular file (a FIFO
            // or device named as a shard would block or never end).
            if !crate::error::is_plain_file_name(f) {
                return Err(Error::format(
                    &index_path,
                    format!(
                        "weight_map names {f:?}, which is not a file inside the model directory"
                    ),
                ));
            }
            let path = dir.join(f);
            crate::error::regular(&path)?;
            let file = std::fs::File::open(&path).map_err(|e| Error::io(&path, e))?;
            // SAFETY: read-only map of a checkpoint file that we do not modify; it lives in `shards`
            // as long as any borrow of it.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
            let st = safetensors::SafeTensors::deserialize(&map)
                .map_err(|e| Error::format(&path, format!("invalid safetensors: {e}")))?;
            for name in st.names() {
                index.insert(name.to_string(), i);
            }
            drop(st);
            shards.push((path, map));
        }
        Ok(HfCheckpoint { dir: dir.into(), config, shards, index, quant })
    }
}

impl HfCheckpoint {
    /// A tensor by name, read through the checkpoint's quantization scheme first; `perm_ok`: see
    /// `Scheme::weight`.
    fn tensor_with(&self, name: &str, perm_ok: bool) -> Result<Option<SourceTensor>> {
        if let Some(q) = &self.quant {
            if name.ends_with(crate::prequant::INPUT_PERM) {
                return q.input_perm(self, name);
            }
            if name.ends_with(crate::prequant::OUTPUT_SCALE) {
                return q.output_scale(self, name);
            }
            if let Some(t) = q.weight(self, name, perm_ok)? {
                return Ok(Some(t));
            }
        }
        use crate::prequant::RawSource;
        let Some(raw) = self.raw(name)? else { return Ok(None) };
        Ok(Some(SourceTensor {
            dtype: st_dtype(raw.dtype, name)?,
            shape: raw.shape,
            data: raw.data,
        }))
    }
}

impl HfCheckpoint {
    /// Runs `f` on tensor `name`'s view in its shard, if the checkpoint has it.
    fn view<T>(
        &self,
        name: &str,
        f: impl FnOnce(safetensors::tensor::TensorView<'_>) -> T,
    ) -> Result<Option<T>> {
        let Some(&i) = self.index.get(name) else { return Ok(None) };
        let (path, map) = &self.shards[i];
        let st = safetensors::SafeTensors::deserialize(map)
            .map_err(|e| Error::format(path, e.to_string()))?;
        let view = st.tensor(name).map_err(|e| Error::tensor(name, e.to_string()))?;
        Ok(Some(f(view)))
    }
}

impl HfCheckpoint {
    /// Runs `f` on expert `e`'s slab of the stacked tensor `name` (`[experts, …]`): its dtype, its
    /// shape without the leading dimension, its bytes. `None` if the checkpoint has no `name`.
    pub(crate) fn slab<T>(
        &self,
        name: &str,
        e: usize,
        f: impl FnOnce(safetensors::Dtype, &[usize], &[u8]) -> T,
    ) -> Result<Option<T>> {
        self.view(name, |v| {
            let shape = v.shape();
            let n = shape.first().copied().unwrap_or(0);
            if e >= n || !v.data().len().is_multiple_of(n) {
                return Err(Error::tensor(name, format!("shape {shape:?} holds no expert {e}")));
            }
            let per = v.data().len() / n;
            Ok(f(v.dtype(), &shape[1..], &v.data()[e * per..(e + 1) * per]))
        })?
        .transpose()
    }
}

impl crate::prequant::RawSource for HfCheckpoint {
    fn raw(&self, name: &str) -> Result<Option<crate::prequant::Raw>> {
        self.view(name, |v| crate::prequant::Raw {
            dtype: v.dtype(),
            shape: v.shape().to_vec(),
            data: v.data().to_vec(),
        })
    }

    fn header(&self, name: &str) -> Result<Option<(safetensors::Dtype, Vec<usize>)>> {
        self.view(name, |v| (v.dtype(), v.shape().to_vec()))
    }
}

impl Checkpoint for HfCheckpoint {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn tensor(&self, name: &str) -> Result<Option<SourceTensor>> {
        self.tensor_with(name, true)
    }

    fn tokenizer_json(&self) -> Result<String> {
        let p = self.dir.join("tokenizer.json");
        crate::error::regular(&p)?;
        std::fs::read_to_string(&p).map_err(|e| Error::io(p, e))
    }

    fn chat_template(&self) -> Result<Option<String>> {
        let jinja = self.dir.join("chat_template.jinja");
        if jinja.exists() {
            crate::error::regular(&jinja)?;
            return std::fs::read_to_string(&jinja).map(Some).map_err(|e| Error::io(jinja, e));
        }
        let cfg = self.dir.join("tokenizer_config.json");
        if !cfg.exists() {
            return Ok(None);
        }
        let v: serde_json::Value = read_json(&cfg)?;
        Ok(match v.get("chat_template") {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            // A list of named templates: take the "default" one.
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(str::to_owned)),
            _ => None,
        })
    }

    fn pick_name(&self, hf: &str, _gguf: &str) -> String {
        gemma_name(self.config.arch, hf).to_owned()
    }

    fn norm_offset(&self) -> f32 {
        // Gemma's RMSNorm scales by 1 + w: stored as 1 + w, the kernels' plain norm computes it.
        if self.config.arch == crate::config::Arch::Gemma3 {
            1.0
        } else {
            0.0
        }
    }

    fn layer_prefix(&self, i: usize) -> String {
        format!("model.layers.{i}.")
    }

    fn router(&self, layer: usize) -> Result<Option<SourceTensor>> {
        let (router, _) = crate::layout::hf_moe_names(self.config.arch);
        self.tensor(&format!("{}{router}", self.layer_prefix(layer)))
    }

    fn router_bias(&self, layer: usize) -> Result<Option<SourceTensor>> {
        let (router, _) = crate::layout::hf_moe_names(self.config.arch);
        let bias = router.replace(".weight", ".bias");
        self.tensor(&format!("{}{bias}", self.layer_prefix(layer)))
    }

    fn expert(&self, layer: usize, expert: usize, which: &str) -> Result<Option<SourceTensor>> {
        if self.config.arch == crate::config::Arch::GptOss {
            return crate::hf_stacked::expert(self, &self.layer_prefix(layer), expert, which);
        }
        let (_, name) = crate::layout::hf_moe_names(self.config.arch);
        self.tensor_with(&format!("{}{}", self.layer_prefix(layer), name(expert, which)), false)
    }
}
