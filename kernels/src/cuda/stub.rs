//! Stand-in for builds without the `cuda` feature: `CudaBackend::new` reports "built without CUDA",
//! and since no value of the type can exist, its `Backend` methods are never reached.

use crate::backend::{AttnShape, Backend};
use crate::error::Result;
use crate::kv::{KvLayout, KvSeq};
use crate::rope::RopeTable;
use layerstream_types::DType;

/// No value of this type exists.
#[derive(Debug, Clone, Copy)]
pub enum Never {}

/// The CUDA backend of a build without CUDA: it cannot be constructed.
#[derive(Debug, Clone)]
pub struct CudaBackend(Never);

impl CudaBackend {
    /// Always fails: this build has no CUDA support.
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        super::open_device(ordinal)
            .map(|_| unreachable!("open_device always fails without the cuda feature"))
    }

    /// Never called (no value exists).
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        match self.0 {}
    }

    /// Never called (no value exists).
    pub fn registered_bytes(&self) -> usize {
        match self.0 {}
    }
}

impl Backend for CudaBackend {
    type Tensor = Never;
    type Weight = Never;
    type KvCache = Never;
    type Blob = Never;
    type Mark = Never;

    fn name(&self) -> String {
        match self.0 {}
    }
    fn upload_blob(&self, _: &[u8], _: bool) -> Result<(Never, Option<f64>)> {
        match self.0 {}
    }
    fn weight_in(
        &self,
        _: &Never,
        _: &str,
        _: DType,
        _: &[usize],
        _: std::ops::Range<usize>,
    ) -> Result<Never> {
        match self.0 {}
    }
    fn mark(&self) -> Result<Never> {
        match self.0 {}
    }
    fn elapsed_ms(&self, _: &Never, _: &Never) -> Result<f64> {
        match self.0 {}
    }
    fn weight(&self, _: &str, _: DType, _: &[usize], _: &[u8]) -> Result<Never> {
        match self.0 {}
    }
    fn from_host(&self, _: &[f32], _: usize, _: usize) -> Result<Never> {
        match self.0 {}
    }
    fn to_host(&self, _: &Never) -> Result<Vec<f32>> {
        match self.0 {}
    }
    fn dims(&self, _: &Never) -> (usize, usize) {
        match self.0 {}
    }
    fn rows(&self, _: &Never, _: usize, _: usize) -> Result<Never> {
        match self.0 {}
    }
    fn concat_rows(&self, _: &[Never]) -> Result<Never> {
        match self.0 {}
    }
    fn embedding(&self, _: &Never, _: &[u32]) -> Result<Never> {
        match self.0 {}
    }
    fn matmul(&self, _: &Never, _: &Never, _: crate::Precision) -> Result<Never> {
        match self.0 {}
    }
    fn add_bias(&self, _: &mut Never, _: &Never) -> Result<()> {
        match self.0 {}
    }
    fn rms_norm(&self, _: &Never, _: &Never, _: f32) -> Result<Never> {
        match self.0 {}
    }
    fn rope(&self, _: &mut Never, _: &[usize], _: &RopeTable) -> Result<()> {
        match self.0 {}
    }
    fn silu_mul(&self, _: &Never, _: &Never) -> Result<Never> {
        match self.0 {}
    }
    fn add(&self, _: &mut Never, _: &Never) -> Result<()> {
        match self.0 {}
    }
    fn kv_cache(&self, _: AttnShape, _: KvLayout) -> Result<Never> {
        match self.0 {}
    }
    fn kv_read(&self, _: &Never, _: u32) -> Result<Vec<u8>> {
        match self.0 {}
    }
    fn kv_write(&self, _: &mut Never, _: u32, _: &[u8]) -> Result<()> {
        match self.0 {}
    }
    fn attention(
        &self,
        _: &Never,
        _: &Never,
        _: &Never,
        _: &mut Never,
        _: KvSeq<'_>,
        _: AttnShape,
        _: Option<&[u64]>,
        _: Option<&[f32]>,
    ) -> Result<Never> {
        match self.0 {}
    }
}
