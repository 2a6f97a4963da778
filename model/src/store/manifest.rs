//! `manifest.json`: the model config, and per file its size, checksum and tensor directory.

use crate::config::ModelConfig;
use crate::dtype::DType;
use serde::{Deserialize, Serialize};

/// Alignment of every tensor inside a store file, and of file sizes.
pub const ALIGN: u64 = 4096;
/// Name of the manifest inside a store directory.
pub const MANIFEST: &str = "manifest.json";
/// Store format version written by this build.
pub const FORMAT_VERSION: u32 = 1;

/// One tensor inside a store file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub offset: u64,
    pub size: u64,
    pub checksum: String,
}

/// One file of the store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    pub name: String,
    pub size: u64,
    pub checksum: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tensors: Vec<TensorEntry>,
}

impl FileEntry {
    /// A tensor of this file by canonical name.
    pub fn tensor(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// The whole store description.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    /// What the store was imported from (path and format), for humans.
    pub source: String,
    pub config: ModelConfig,
    pub tokenizer: String,
    pub chat_template: Option<String>,
    pub files: Vec<FileEntry>,
}

impl Manifest {
    /// A file entry by name.
    pub fn file(&self, name: &str) -> Option<&FileEntry> {
        self.files.iter().find(|f| f.name == name)
    }

    /// Every checksum is one `checksum` could have written (`xxh3:` and 16 hex digits): a malformed
    /// one is a malformed manifest, not corrupt data.
    fn check_checksums(&self) -> Result<(), String> {
        let well_formed = |c: &str| {
            c.strip_prefix("xxh3:")
                .is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        };
        for f in &self.files {
            if !well_formed(&f.checksum) {
                return Err(format!(
                    "file {}: checksum {:?} is not xxh3:<16 hex digits>",
                    f.name, f.checksum
                ));
            }
            if let Some(t) = f.tensors.iter().find(|t| !well_formed(&t.checksum)) {
                return Err(format!(
                    "{}: tensor {}: checksum {:?} is not xxh3:<16 hex digits>",
                    f.name, t.name, t.checksum
                ));
            }
        }
        Ok(())
    }

    /// Checks that the manifest describes a whole, consistent store of its config (without reading
    /// the files): every name a plain file name listed once; every tensor inside its file, aligned,
    /// sized for its dtype and shape, not overlapping another; a layer file for each of the config's
    /// layers and none beyond; the embedding, final norm and (untied) lm_head with the config's
    /// shapes; layer tensors known and shaped as the config says. The message names what is wrong.
    pub fn check(&self) -> Result<(), String> {
        self.check_checksums()?;
        let cfg = &self.config;
        let plain = |n: &str| crate::error::is_plain_file_name(n) && n != MANIFEST;
        let mut names = std::collections::HashSet::new();
        for f in &self.files {
            if !plain(&f.name) {
                return Err(format!(
                    "file name {:?} is not a plain file name in the store",
                    f.name
                ));
            }
            if !names.insert(f.name.as_str()) {
                return Err(format!("file {} is listed twice", f.name));
            }
            let mut spans: Vec<(u64, u64, &str)> = Vec::new();
            let mut tnames = std::collections::HashSet::new();
            for t in &f.tensors {
                let at = |msg: String| format!("{}: tensor {}: {msg}", f.name, t.name);
                if !tnames.insert(t.name.as_str()) {
                    return Err(at("listed twice".into()));
                }
                let end =
                    t.offset.checked_add(t.size).filter(|&e| e <= f.size).ok_or_else(|| {
                        at(format!(
                            "offset {} + size {} lies outside the file's {} bytes",
                            t.offset, t.size, f.size
                        ))
                    })?;
                if t.offset % ALIGN != 0 {
                    return Err(at(format!("offset {} is not {ALIGN}-aligned", t.offset)));
                }
                if t.dtype.tensor_bytes(&t.shape).map(|b| b as u64) != Some(t.size) {
                    return Err(at(format!(
                        "{} bytes do not hold a {} tensor of shape {:?}",
                        t.size,
                        t.dtype.name(),
                        t.shape
                    )));
                }
                spans.push((t.offset, end, &t.name));
            }
            spans.sort();
            if let Some(w) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
                return Err(format!("{}: tensors {} and {} overlap", f.name, w[0].2, w[1].2));
            }
        }
        for name in [&self.tokenizer].into_iter().chain(self.chat_template.as_ref()) {
            if !plain(name) || !names.contains(name.as_str()) {
                return Err(format!("{name:?} is not a file listed in the store"));
            }
        }
        let shaped = |file: &str, tensor: &str, want: &[usize]| -> Result<(), String> {
            let f = self.file(file).ok_or_else(|| format!("{file} is missing"))?;
            let t = f.tensor(tensor).ok_or_else(|| format!("{file} has no tensor {tensor}"))?;
            if t.shape != want {
                return Err(format!(
                    "{file}: tensor {tensor} has shape {:?}, the config (vocab {}, hidden {}) needs {want:?}",
                    t.shape, cfg.vocab_size, cfg.hidden_size
                ));
            }
            Ok(())
        };
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        shaped("embed.bin", "embed", &[v, h])?;
        shaped("final_norm.bin", "final_norm", &[h])?;
        if !cfg.tie_word_embeddings {
            shaped("lm_head.bin", "lm_head", &[v, h])?;
        }
        for i in 0..cfg.num_layers {
            let name = crate::layout::layer_file(i);
            let f = self.file(&name).ok_or_else(|| {
                format!("{name} is missing (the config has {} layers)", cfg.num_layers)
            })?;
            for t in &f.tensors {
                match crate::layout::layer_shape(cfg, &t.name) {
                    Some(want) if want == t.shape => {}
                    Some(want) => {
                        return Err(format!(
                            "{name}: tensor {} has shape {:?}, the config needs {want:?}",
                            t.name, t.shape
                        ))
                    }
                    None => return Err(format!("{name}: unknown tensor {}", t.name)),
                }
            }
            self.check_moe_layer(i, f)?;
        }
        if let Some(f) = self.files.iter().find(|f| {
            f.name
                .strip_prefix("layer_")
                .and_then(|r| r.strip_suffix(".bin"))
                .and_then(|n| n.parse::<usize>().ok())
                .is_some_and(|n| n >= cfg.num_layers)
        }) {
            return Err(format!("{} lies beyond the config's {} layers", f.name, cfg.num_layers));
        }
        Ok(())
    }

    /// A mixture-of-experts layer's file holds its router and no dense MLP, and each of its experts
    /// has a file with gate, up and down shaped as the config says; a dense layer has no router.
    fn check_moe_layer(&self, i: usize, f: &FileEntry) -> Result<(), String> {
        use crate::layout::{expert_file, expert_shape, expert_tensors, EXPERT_TENSORS, ROUTER};
        let Some(m) = self.config.moe_at(i) else {
            if f.tensor(ROUTER).is_some() {
                return Err(format!("{}: a dense layer has a router", f.name));
            }
            return Ok(());
        };
        if f.tensor(ROUTER).is_none() {
            return Err(format!("{}: the mixture-of-experts layer has no router", f.name));
        }
        if let Some(t) = f.tensors.iter().find(|t| EXPERT_TENSORS.contains(&t.name.as_str())) {
            return Err(format!("{}: a mixture-of-experts layer holds a dense {}", f.name, t.name));
        }
        for e in 0..m.experts {
            let name = expert_file(i, e);
            let ef = self.file(&name).ok_or_else(|| {
                format!("{name} is missing (layer {i} has {} experts)", m.experts)
            })?;
            let all = expert_tensors(m);
            if ef.tensors.len() != all.len() {
                return Err(format!(
                    "{name}: holds {} tensors, an expert has {}",
                    ef.tensors.len(),
                    all.join(", ")
                ));
            }
            for which in all {
                let want = expert_shape(&self.config, which).expect("moe config");
                match ef.tensor(which) {
                    Some(t) if t.shape == want => {}
                    Some(t) => {
                        return Err(format!(
                            "{name}: tensor {which} has shape {:?}, the config needs {want:?}",
                            t.shape
                        ))
                    }
                    None => return Err(format!("{name} has no tensor {which}")),
                }
            }
        }
        Ok(())
    }

    /// Size of the largest expert file (0 for a dense model).
    pub fn max_expert_bytes(&self) -> u64 {
        self.files.iter().filter(|f| f.name.contains("_expert_")).map(|f| f.size).max().unwrap_or(0)
    }

    /// Size of the largest streamable unit: a layer file or an expert file (the default loader slot
    /// size).
    pub fn max_unit_bytes(&self) -> u64 {
        (0..self.config.num_layers)
            .filter_map(|i| self.file(&crate::layout::layer_file(i)))
            .map(|f| f.size)
            .chain([self.max_expert_bytes()])
            .max()
            .unwrap_or(0)
    }
}
