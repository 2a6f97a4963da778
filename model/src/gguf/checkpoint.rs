//! A GGUF file as an importable checkpoint: tensors by their Hugging Face names, q/k rows moved
//! back from llama.cpp's interleaved-RoPE order.

use super::*;

/// Undoes llama.cpp's q/k row permutation (its interleaved-RoPE layout) so rows are in HF order.
///
/// GGUF row `h*hd + 2i + j` holds HF row `h*hd + j*hd/2 + i`. Rows are moved whole, so quantized
/// blocks are untouched.
pub fn unpermute_rows(data: &[u8], rows: usize, n_heads: usize) -> Vec<u8> {
    move_head_rows(data, rows, n_heads, false)
}

/// Moves whole rows between HF's q/k order and llama.cpp's (`to_gguf`: HF → llama.cpp).
pub fn move_head_rows(data: &[u8], rows: usize, n_heads: usize, to_gguf: bool) -> Vec<u8> {
    let row_bytes = data.len() / rows;
    let hd = rows / n_heads;
    let mut out = vec![0u8; data.len()];
    for h in 0..n_heads {
        for i in 0..hd / 2 {
            for j in 0..2 {
                let (hf, gg) = (h * hd + j * (hd / 2) + i, h * hd + 2 * i + j);
                let (src, dst) = if to_gguf { (hf, gg) } else { (gg, hf) };
                out[dst * row_bytes..(dst + 1) * row_bytes]
                    .copy_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
            }
        }
    }
    out
}

/// A GGUF file seen as an importable checkpoint (q/k rows restored to HF order on read).
pub struct GgufCheckpoint {
    pub file: GgufFile,
    config: ModelConfig,
}

impl GgufCheckpoint {
    /// Opens a GGUF file and derives its config.
    pub fn open(path: &Path) -> Result<Self> {
        let file = GgufFile::open(path)?;
        let config = file.config()?;
        Ok(GgufCheckpoint { file, config })
    }
}

impl crate::source::Checkpoint for GgufCheckpoint {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn tensor(&self, name: &str) -> Result<Option<crate::source::SourceTensor>> {
        let Some(t) = self.file.tensor(name) else { return Ok(None) };
        let data = self.file.data(t);
        // llama.cpp's converter permutes q/k rows for the llama architecture only (its rotary
        // layout); qwen2/qwen3 keep HF's.
        let permuted = matches!(self.config.arch, Arch::Llama | Arch::Mistral | Arch::Mixtral);
        let heads = if !permuted {
            None
        } else if name.ends_with(".attn_q.weight") || name.ends_with(".attn_q.bias") {
            Some(self.config.num_heads)
        } else if name.ends_with(".attn_k.weight") || name.ends_with(".attn_k.bias") {
            Some(self.config.num_kv_heads)
        } else {
            None
        };
        let data = match heads {
            Some(h) => {
                // A bias is one "row" per element: permute its elements.
                let rows = t.shape[0];
                if rows == 0
                    || h == 0
                    || !rows.is_multiple_of(2 * h)
                    || !data.len().is_multiple_of(rows)
                {
                    return Err(Error::tensor(
                        name,
                        format!("{rows} rows do not split into {h} heads of even size"),
                    ));
                }
                unpermute_rows(data, rows, h)
            }
            None => data.to_vec(),
        };
        Ok(Some(crate::source::SourceTensor { dtype: t.dtype, shape: t.shape.clone(), data }))
    }

    fn tokenizer_json(&self) -> Result<String> {
        crate::gguf_tokenizer::tokenizer_json(&self.file)
    }

    fn chat_template(&self) -> Result<Option<String>> {
        Ok(self.file.chat_template())
    }

    fn pick_name(&self, _hf: &str, gguf: &str) -> String {
        // gpt-oss's pre-MLP norm is llama.cpp's `post_attention_norm` (it has no sandwich norms).
        match (self.config.arch, gguf) {
            (Arch::GptOss, "ffn_norm.weight") => "post_attention_norm.weight".into(),
            (Arch::GptOss, "post_attention_norm.weight") => "gpt-oss:no-sandwich-norm".into(),
            _ => gguf.to_owned(),
        }
    }

    fn layer_prefix(&self, i: usize) -> String {
        format!("blk.{i}.")
    }

    fn router(&self, layer: usize) -> Result<Option<crate::source::SourceTensor>> {
        self.tensor(&format!("blk.{layer}.{}", crate::layout::GGUF_ROUTER))
    }

    fn router_bias(&self, layer: usize) -> Result<Option<crate::source::SourceTensor>> {
        self.tensor(&format!("blk.{layer}.{}", crate::layout::GGUF_ROUTER_BIAS))
    }

    /// Expert `expert`'s slice of the stacked `[experts, rows, cols]` tensor (whole rows of whole
    /// blocks, so quantized data is cut, not converted).
    fn expert(
        &self,
        layer: usize,
        expert: usize,
        which: &str,
    ) -> Result<Option<crate::source::SourceTensor>> {
        let name = format!("blk.{layer}.{}", crate::layout::gguf_experts(which));
        let Some(t) = self.file.tensor(&name) else { return Ok(None) };
        // A bias stack is `[experts, rows]`: each expert's slice a vector.
        let (n, shape) = match t.shape[..] {
            [n, rows, cols] if !which.ends_with("_bias") => (n, vec![rows, cols]),
            [n, rows] if which.ends_with("_bias") => (n, vec![rows]),
            _ => {
                return Err(Error::tensor(
                    &name,
                    format!("shape {:?} is not [experts, rows(, cols)]", t.shape),
                ))
            }
        };
        let data = self.file.data(t);
        if expert >= n || n == 0 || !data.len().is_multiple_of(n) {
            return Err(Error::tensor(
                &name,
                format!("{} bytes do not hold expert {expert} of {n}", data.len()),
            ));
        }
        let per = data.len() / n;
        Ok(Some(crate::source::SourceTensor {
            dtype: t.dtype,
            shape,
            data: data[expert * per..(expert + 1) * per].to_vec(),
        }))
    }
}
