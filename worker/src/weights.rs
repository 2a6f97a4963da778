//! Loading store files onto a backend: one layer's tensors, or the embedding / final norm / lm_head.
//! Shapes are checked against the config so a wrong store fails here, naming the tensor.

use crate::error::{Error, Result};
use layerstream_kernels::Backend;
use layerstream_model::layout::{layer_shape, LAYER_TENSORS, ROUTER, ROUTER_BIAS};
use layerstream_model::{FileEntry, LoadedFile, ModelConfig, Store};

/// One decoder layer's weights on a device.
pub struct LayerWeights<B: Backend> {
    pub(crate) attn_norm: B::Weight,
    /// The q, k and v projections (`None` under multi-head latent attention: `mla`).
    pub(crate) qkv: Option<[B::Weight; 3]>,
    pub(crate) mla: Option<crate::mla::MlaWeights<B>>,
    pub(crate) o: B::Weight,
    pub(crate) q_bias: Option<B::Weight>,
    pub(crate) k_bias: Option<B::Weight>,
    pub(crate) v_bias: Option<B::Weight>,
    pub(crate) o_bias: Option<B::Weight>,
    pub(crate) q_norm: Option<B::Weight>,
    pub(crate) k_norm: Option<B::Weight>,
    pub(crate) ffn_norm: B::Weight,
    /// Gemma's sandwich norms, after attention and after the MLP.
    pub(crate) attn_post_norm: Option<B::Weight>,
    pub(crate) ffn_post_norm: Option<B::Weight>,
    pub(crate) mlp: Mlp<B>,
    /// Input orders of GPTQ act-order weights (`layout`'s `*_perm`), kept on the host.
    pub(crate) perms: Perms,
    /// BitNet: RMSNorms before `o` and before `down`.
    pub(crate) attn_sub_norm: Option<B::Weight>,
    pub(crate) ffn_sub_norm: Option<B::Weight>,
    /// BitLinear output multipliers (`layout`'s `*_oscale`), kept on the host.
    pub(crate) oscales: OutScales,
    /// gpt-oss's attention sink logits, one per head, kept on the host.
    pub(crate) sinks: Option<Vec<f32>>,
}

/// Each projection's output multiplier where its weights are BitNet's ternary values.
pub type OutScales = PerProj<f32>;

/// Tensor `name` of a layer file's host bytes as f32 values, from f32, f16 or bf16 (`None`: the
/// file has none).
fn f32_values(entry: &FileEntry, bytes: &[u8], name: &str) -> Result<Option<Vec<f32>>> {
    use layerstream_model::DType;
    let Some(t) = entry.tensor(name) else { return Ok(None) };
    let raw = bytes.get(t.offset as usize..(t.offset + t.size) as usize);
    let n = t.dtype.block_bytes();
    match raw {
        Some(raw)
            if matches!(t.dtype, DType::F32 | DType::F16 | DType::Bf16)
                && raw.len().is_multiple_of(n) =>
        {
            let mut out = vec![0f32; raw.len() / n];
            layerstream_kernels::quant::dequant_row(t.dtype, raw, &mut out);
            Ok(Some(out))
        }
        _ => Err(Error::Weights(format!(
            "{}: tensor {name} is not float values inside its file",
            entry.name
        ))),
    }
}

/// Tensor `name` of a layer file as one finite f32 (a BitLinear's output multiplier).
fn scalar(entry: &FileEntry, bytes: &[u8], name: &str) -> Result<Option<f32>> {
    match f32_values(entry, bytes, name)?.as_deref() {
        None => Ok(None),
        Some(&[v]) if v.is_finite() => Ok(Some(v)),
        _ => Err(Error::Weights(format!("{}: tensor {name} is not one finite f32", entry.name))),
    }
}

/// Something each of a layer's seven projections may have, kept on the host: tensor
/// `<projection><suffix>` of its layer file.
pub struct PerProj<T> {
    pub(crate) q: Option<T>,
    pub(crate) k: Option<T>,
    pub(crate) v: Option<T>,
    pub(crate) o: Option<T>,
    pub(crate) gate: Option<T>,
    pub(crate) up: Option<T>,
    pub(crate) down: Option<T>,
}

impl<T> PerProj<T> {
    /// Reads `<projection><suffix>` of each projection with `read` (`None`: the file has none).
    fn read(suffix: &str, read: impl Fn(&str) -> Result<Option<T>>) -> Result<Self> {
        let get = |p: &str| read(&format!("{p}{suffix}"));
        Ok(PerProj {
            q: get("q")?,
            k: get("k")?,
            v: get("v")?,
            o: get("o")?,
            gate: get("gate")?,
            up: get("up")?,
            down: get("down")?,
        })
    }
}

/// The stored input order of each projection whose weight was published act-order (GPTQ
/// `desc_act`): stored column `j` multiplies input `perm[j]`.
pub type Perms = PerProj<Vec<u32>>;

/// Tensor `name` of a layer file as an input order: f32 indices that must be a permutation.
fn perm(entry: &FileEntry, bytes: &[u8], name: &str) -> Result<Option<Vec<u32>>> {
    let Some(vals) = f32_values(entry, bytes, name)? else { return Ok(None) };
    let mut seen = vec![false; vals.len()];
    let mut out = Vec::with_capacity(vals.len());
    for v in vals {
        let i = v as usize;
        if v.fract() != 0.0 || v < 0.0 || i >= seen.len() || std::mem::replace(&mut seen[i], true) {
            return Err(Error::Weights(format!(
                "{}: tensor {name} is not a permutation of its inputs",
                entry.name
            )));
        }
        out.push(i as u32);
    }
    Ok(Some(out))
}

/// A layer's feed-forward: one dense MLP, or a router over experts kept in their own files.
pub enum Mlp<B: Backend> {
    Dense {
        gate: B::Weight,
        up: B::Weight,
        down: B::Weight,
    },
    Experts {
        router: B::Weight,
        router_bias: Option<B::Weight>,
        /// DeepSeek-V3's score-correction bias, kept on the host (routing runs there).
        correction: Option<Vec<f32>>,
        /// DeepSeek-V3's shared experts (gate, up, down), every token's.
        shared: Option<[B::Weight; 3]>,
    },
}

impl<B: Backend> Mlp<B> {
    /// A mixture-of-experts layer's router.
    pub fn router(&self) -> Option<crate::moe::Router<'_, B>> {
        match self {
            Mlp::Experts { router, router_bias, correction, .. } => Some(crate::moe::Router {
                weight: router,
                bias: router_bias.as_ref(),
                correction: correction.as_deref(),
            }),
            Mlp::Dense { .. } => None,
        }
    }
}

/// Uploads tensor `name` of `file`, checking its shape when `want` is given.
pub fn upload<B: Backend>(
    b: &B,
    file: &LoadedFile,
    name: &str,
    want: Option<&[usize]>,
) -> Result<Option<B::Weight>> {
    let Some((t, bytes)) = file.tensor(name) else { return Ok(None) };
    if let Some(w) = want {
        check_shape_of(&file.entry.name, name, &t.shape, w)?;
    }
    Ok(Some(b.weight(&format!("{}:{name}", file.entry.name), t.dtype, &t.shape, bytes)?))
}

/// `name`'s shape in `file` is `want`, or an error naming both.
fn check_shape_of(file: &str, name: &str, shape: &[usize], want: &[usize]) -> Result<()> {
    if shape == want {
        return Ok(());
    }
    Err(Error::Weights(format!(
        "{file}: tensor {name} has shape {shape:?}, the config needs {want:?}"
    )))
}

/// A whole store file's bytes, owned, as host memory a device computes from in place.
#[derive(Debug)]
struct OwnedFile(Vec<u8>);

impl layerstream_kernels::MappedBytes for OwnedFile {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// A mapped store file (`Store::map`) as a CPU blob's bytes.
#[derive(Debug)]
struct MappedFile(layerstream_model::store::MappedFile);

impl layerstream_kernels::MappedBytes for MappedFile {
    fn bytes(&self) -> &[u8] {
        self.0.bytes()
    }
}

/// Tensor `name` of `file` (the embedding, the final norm, the head), its shape `want`, the file
/// consumed: where the device computes from host memory (the CPU) the weight is the file's own
/// bytes, moved rather than copied — an 8B model's 0.56 GB embedding was held twice while it
/// loaded, which a worker sized to a memory limit did not survive — else uploaded (`upload`).
pub fn need<B: Backend>(b: &B, file: LoadedFile, name: &str, want: &[usize]) -> Result<B::Weight> {
    if !b.maps_host() {
        let missing = || Error::Weights(format!("{}: missing tensor {name}", file.entry.name));
        return upload(b, &file, name, Some(want))?.ok_or_else(missing);
    }
    let entry = file.entry.clone();
    host_weight(b, &entry, std::sync::Arc::new(OwnedFile(file.bytes)), name, want)
}

/// The token embedding of `store`. A worker that uses it for lookups alone (not as its tied head)
/// on a device that computes from host memory maps the file (`Store::map`): a step touches its
/// tokens' rows, whose pages the page cache holds and may drop, so the embedding takes none of the
/// worker's memory (`plan::embed_head_bytes`); a head reads every row each step, so it is loaded.
pub fn embedding<B: Backend>(b: &B, store: &Store, as_head: bool) -> Result<B::Weight> {
    let want = [store.manifest.config.vocab_size, store.manifest.config.hidden_size];
    if !b.maps_host() || as_head {
        return need(b, store.load("embed.bin")?, "embed", &want);
    }
    let file = store.map("embed.bin")?;
    let entry = file.entry.clone();
    host_weight(b, &entry, std::sync::Arc::new(MappedFile(file)), "embed", &want)
}

/// Tensor `name` of the file `entry` describes, whose bytes are `bytes`, as a weight in place.
fn host_weight<B: Backend>(
    b: &B,
    entry: &FileEntry,
    bytes: std::sync::Arc<dyn layerstream_kernels::MappedBytes>,
    name: &str,
    want: &[usize],
) -> Result<B::Weight> {
    let missing = || Error::Weights(format!("{}: missing tensor {name}", entry.name));
    let t = entry.tensor(name).cloned().ok_or_else(missing)?;
    check_shape_of(&entry.name, name, &t.shape, want)?;
    let label = format!("{}:{name}", entry.name);
    let range = t.offset as usize..(t.offset + t.size) as usize;
    let blob = b
        .map_blob(bytes)
        .ok_or_else(|| Error::Weights(format!("{label}: the device maps no host memory")))?;
    Ok(b.weight_in(&blob, &label, t.dtype, &t.shape, range)?)
}

impl<B: Backend> LayerWeights<B> {
    /// Uploads a layer file's tensors (one transfer for the whole file).
    pub fn load(b: &B, cfg: &ModelConfig, file: &LoadedFile) -> Result<Self> {
        let (blob, _) = b.upload_blob(&file.bytes, false)?;
        Self::from_blob(b, cfg, &file.entry, &blob, &file.bytes)
    }

    /// The layer's weights as views of a file already on the device, shapes checked against `cfg`;
    /// `bytes` is the file on the host (for what stays there: input orders).
    pub fn from_blob(
        b: &B,
        cfg: &ModelConfig,
        entry: &FileEntry,
        blob: &B::Blob,
        bytes: &[u8],
    ) -> Result<Self> {
        if let Some(t) = entry.tensors.iter().find(|t| {
            ![ROUTER, ROUTER_BIAS].contains(&t.name.as_str())
                && !LAYER_TENSORS.iter().any(|k| k.name == t.name)
                && !layerstream_model::mla_import::MLA_TENSORS.contains(&t.name.as_str())
        }) {
            return Err(Error::Weights(format!("{}: unknown tensor {}", entry.name, t.name)));
        }
        let opt = |name: &str| -> Result<Option<B::Weight>> {
            let Some(t) = entry.tensor(name) else { return Ok(None) };
            if let Some(want) = layer_shape(cfg, name) {
                if t.shape != want {
                    return Err(Error::Weights(format!(
                        "{}: tensor {name} has shape {:?}, the config needs {:?}",
                        entry.name, t.shape, want
                    )));
                }
            }
            let range = t.offset as usize..(t.offset + t.size) as usize;
            Ok(Some(b.weight_in(
                blob,
                &format!("{}:{name}", entry.name),
                t.dtype,
                &t.shape,
                range,
            )?))
        };
        let req = |name: &str| {
            opt(name)?
                .ok_or_else(|| Error::Weights(format!("{}: missing tensor {name}", entry.name)))
        };
        let mla = match &cfg.mla {
            Some(m) => Some(crate::mla::MlaWeights::from_blob(b, cfg, m, entry, blob, &opt)?),
            None => None,
        };
        let w = LayerWeights {
            attn_norm: req("attn_norm")?,
            qkv: match mla {
                Some(_) => None,
                None => Some([req("q")?, req("k")?, req("v")?]),
            },
            mla,
            o: req("o")?,
            q_bias: opt("q_bias")?,
            k_bias: opt("k_bias")?,
            v_bias: opt("v_bias")?,
            o_bias: opt("o_bias")?,
            q_norm: opt("q_norm")?,
            k_norm: opt("k_norm")?,
            ffn_norm: req("ffn_norm")?,
            attn_post_norm: opt("attn_post_norm")?,
            ffn_post_norm: opt("ffn_post_norm")?,
            mlp: match opt(ROUTER)? {
                Some(router) => Mlp::Experts {
                    router,
                    router_bias: opt(ROUTER_BIAS)?,
                    correction: f32_values(entry, bytes, "router_correction")?,
                    shared: match opt("shared_gate")? {
                        Some(g) => Some([g, req("shared_up")?, req("shared_down")?]),
                        None => None,
                    },
                },
                None => Mlp::Dense { gate: req("gate")?, up: req("up")?, down: req("down")? },
            },
            perms: Perms::read("_perm", |n| perm(entry, bytes, n))?,
            attn_sub_norm: opt("attn_sub_norm")?,
            ffn_sub_norm: opt("ffn_sub_norm")?,
            oscales: OutScales::read("_oscale", |n| scalar(entry, bytes, n))?,
            sinks: f32_values(entry, bytes, "sinks")?,
        };
        w.check(cfg, &entry.name)?;
        Ok(w)
    }

    /// The parts `cfg` requires of layer file `file` are there, and none it rules out: experts or a
    /// dense MLP as the config places them, with the router parts it names; Gemma's post-norms,
    /// BitNet's sub-norms, attention sinks, q/k norms.
    fn check(&self, cfg: &ModelConfig, file: &str) -> Result<()> {
        let layer = file.strip_prefix("layer_").and_then(|r| r.strip_suffix(".bin"));
        let moe_layer = layer.and_then(|l| l.parse::<usize>().ok()).and_then(|l| cfg.moe_at(l));
        if moe_layer.is_some() != matches!(self.mlp, Mlp::Experts { .. }) {
            return Err(Error::Weights(format!(
                "{}: the config says {}, the file holds {}",
                file,
                if moe_layer.is_some() { "experts" } else { "a dense MLP" },
                if moe_layer.is_some() { "a dense MLP" } else { "a router" },
            )));
        }
        if cfg.gemma.is_some() && (self.attn_post_norm.is_none() || self.ffn_post_norm.is_none()) {
            return Err(Error::Weights(format!(
                "{}: attn_post_norm/ffn_post_norm required by {:?}",
                file, cfg.arch
            )));
        }
        if cfg.arch == layerstream_model::Arch::BitNet
            && (self.attn_sub_norm.is_none() || self.ffn_sub_norm.is_none())
        {
            return Err(Error::Weights(format!(
                "{}: attn_sub_norm/ffn_sub_norm required by BitNet",
                file
            )));
        }
        if cfg.attn_sinks != self.sinks.is_some() {
            return Err(Error::Weights(format!(
                "{}: the config {} attention sinks, the file {}",
                file,
                if cfg.attn_sinks { "has" } else { "has no" },
                if cfg.attn_sinks { "none" } else { "holds some" },
            )));
        }
        if let Some(m) = moe_layer {
            if let Mlp::Experts { router_bias, correction, shared, .. } = &self.mlp {
                for (name, want, got) in [
                    ("router_bias", m.bias, router_bias.is_some()),
                    ("router_correction", m.groups.is_some(), correction.is_some()),
                    ("shared_gate", m.shared_intermediate > 0, shared.is_some()),
                ] {
                    if want != got {
                        return Err(Error::Weights(format!(
                            "{}: {name} {} by the config",
                            file,
                            if want { "required" } else { "not expected" }
                        )));
                    }
                }
            }
        }
        if cfg.qk_norm && (self.q_norm.is_none() || self.k_norm.is_none()) {
            return Err(Error::Weights(format!(
                "{}: q_norm/k_norm required by {:?}",
                file, cfg.arch
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use layerstream_kernels::CpuBackend;

    /// On the CPU the embedding is the file's own bytes, moved in (no second copy while it
    /// loads), with the values `upload`'s copy has; a wrong shape is refused, naming the tensor.
    #[test]
    fn the_cpu_takes_a_whole_file_in_place() {
        let dir = tempfile::tempdir().unwrap();
        layerstream_model::synth::synth(
            "tiny",
            layerstream_model::DType::Q8_0,
            Some(2),
            1,
            dir.path(),
        )
        .unwrap();
        let store = layerstream_model::Store::open(dir.path()).unwrap();
        let c = &store.manifest.config;
        let shape = [c.vocab_size, c.hidden_size];
        let b = CpuBackend::default();
        let file = store.load("embed.bin").unwrap();
        let t = file.entry.tensor("embed").unwrap().clone();
        let at = file.bytes.as_ptr() as usize + t.offset as usize;
        let copy = upload(&b, &file, "embed", Some(&shape)).unwrap().unwrap();
        let w = need(&b, file, "embed", &shape).unwrap();
        assert_eq!(w.stored().unwrap().as_ptr() as usize, at, "the file's own bytes");
        assert_eq!(w.stored(), copy.stored());
        assert_eq!(w.row(3), copy.row(3));
        let err = need(&b, store.load("embed.bin").unwrap(), "embed", &[1, 2]).err().unwrap();
        assert!(err.to_string().contains("tensor embed has shape"), "{err}");
    }

    /// An embedding used for lookups alone is the store file mapped (its bytes lie in a mapping of
    /// embed.bin, as /proc/self/maps shows), with the loaded one's values; used as the head it is
    /// loaded.
    #[test]
    fn a_lookup_embedding_is_mapped_and_a_head_loaded() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("s");
        layerstream_model::synth::synth("tiny", layerstream_model::DType::Q8_0, Some(1), 4, &d)
            .unwrap();
        let store = layerstream_model::Store::open(&d).unwrap();
        let b = CpuBackend::default();
        let in_file_map = |w: &<CpuBackend as Backend>::Weight| {
            let at = w.stored().unwrap().as_ptr() as usize;
            let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
            maps.lines().filter(|l| l.ends_with("/s/embed.bin")).any(|l| {
                let (lo, hi) = l.split_once(' ').unwrap().0.split_once('-').unwrap();
                let (lo, hi) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16));
                (lo.unwrap()..hi.unwrap()).contains(&at)
            })
        };
        let mapped = embedding(&b, &store, false).unwrap();
        let loaded = embedding(&b, &store, true).unwrap();
        assert!(in_file_map(&mapped), "lookups read the mapped file");
        assert!(!in_file_map(&loaded), "a head is the process's own memory");
        assert_eq!(mapped.stored(), loaded.stored());
        assert_eq!(mapped.row(5), loaded.row(5));
    }
}
