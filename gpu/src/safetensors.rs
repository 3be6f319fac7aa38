//! Reading and writing the safetensors format: an 8-byte little-endian header length, a JSON
//! header naming each tensor's dtype, shape and byte range, then the raw little-endian data.
//!
//! Files are memory-mapped; a tensor is converted to f32 only when a backend asks for it.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16};
use serde_json::Value;

use crate::error::{EngineError, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    fn parse(s: &str) -> Option<DType> {
        match s {
            "F32" => Some(DType::F32),
            "F16" => Some(DType::F16),
            "BF16" => Some(DType::BF16),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
        }
    }

    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }
}

/// Bytes of one file: memory-mapped, or compiled into the binary.
#[derive(Clone)]
enum Bytes {
    Mapped(Arc<memmap2::Mmap>),
    Static(&'static [u8]),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Static(s) => s,
        }
    }
}

#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub dtype: DType,
    pub shape: Vec<usize>,
    start: usize,
    end: usize,
}

struct File {
    name: String,
    bytes: Bytes,
    data_start: usize,
    tensors: HashMap<String, TensorInfo>,
}

impl File {
    fn parse(name: String, bytes: Bytes) -> Result<File> {
        let buf = bytes.as_slice();
        let bad = |why: String| EngineError::BadModel(format!("{name}: {why}"));
        if buf.len() < 8 {
            return Err(bad("file too short for a safetensors header".into()));
        }
        let n = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes")) as usize;
        if n > buf.len() - 8 {
            return Err(bad(format!(
                "header length {n} exceeds the file size {}",
                buf.len()
            )));
        }
        let header: BTreeMap<String, Value> = serde_json::from_slice(&buf[8..8 + n])
            .map_err(|e| bad(format!("header is not JSON: {e}")))?;
        let data_start = 8 + n;
        let mut tensors = HashMap::new();
        for (key, v) in header {
            if key == "__metadata__" {
                continue;
            }
            let dtype_name = v.get("dtype").and_then(Value::as_str).unwrap_or("?");
            let dtype = DType::parse(dtype_name).ok_or_else(|| {
                bad(format!(
                    "tensor {key} has dtype {dtype_name}; kvmesh reads F32, F16 and BF16"
                ))
            })?;
            let usizes = |field: &str| -> Option<Vec<usize>> {
                let a = v.get(field)?.as_array()?;
                a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect()
            };
            let shape = usizes("shape").ok_or_else(|| bad(format!("tensor {key} has no shape")))?;
            let offs = usizes("data_offsets").unwrap_or_default();
            let [start, end] = offs[..] else {
                return Err(bad(format!("tensor {key} has no data_offsets")));
            };
            let numel: usize = shape.iter().product();
            if end < start || end - start != numel * dtype.size() || data_start + end > buf.len() {
                return Err(bad(format!(
                    "tensor {key}: byte range does not match its shape"
                )));
            }
            tensors.insert(
                key,
                TensorInfo {
                    dtype,
                    shape,
                    start,
                    end,
                },
            );
        }
        Ok(File {
            name,
            bytes,
            data_start,
            tensors,
        })
    }
}

/// A tensor's values: f32, or bf16 kept as its raw bits.
pub enum TensorData {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
}

/// All tensors of a checkpoint, across its shards.
pub struct WeightStore {
    files: Vec<File>,
    index: HashMap<String, usize>,
}

impl WeightStore {
    /// Opens `model.safetensors`, or the shards listed in `model.safetensors.index.json`.
    pub fn open_dir(dir: &Path) -> Result<WeightStore> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let paths: Vec<PathBuf> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .map_err(|e| EngineError::io(index_path.display().to_string(), e))?;
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| EngineError::BadModel(format!("model.safetensors.index.json: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| {
                    EngineError::BadModel("model.safetensors.index.json has no weight_map".into())
                })?;
            let mut shards: Vec<String> = map
                .values()
                .filter_map(Value::as_str)
                .map(String::from)
                .collect();
            shards.sort();
            shards.dedup();
            shards.into_iter().map(|s| dir.join(s)).collect()
        } else if single.exists() {
            vec![single]
        } else {
            return Err(EngineError::BadModel(format!(
                "{} has neither model.safetensors nor model.safetensors.index.json",
                dir.display()
            )));
        };
        let mut files = Vec::new();
        for p in paths {
            let f = std::fs::File::open(&p).map_err(|e| {
                EngineError::BadModel(format!("cannot open weight shard {}: {e}", p.display()))
            })?;
            // SAFETY: the map is read-only; a checkpoint rewritten underneath a running server
            // is outside what kvmesh supports.
            let m = unsafe { memmap2::Mmap::map(&f) }
                .map_err(|e| EngineError::io(format!("mmap {}", p.display()), e))?;
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            files.push(File::parse(name, Bytes::Mapped(Arc::new(m)))?);
        }
        Ok(Self::from_files(files))
    }

    /// A single safetensors file compiled into the binary.
    pub fn from_static(name: &str, bytes: &'static [u8]) -> Result<WeightStore> {
        Ok(Self::from_files(vec![File::parse(
            name.to_string(),
            Bytes::Static(bytes),
        )?]))
    }

    fn from_files(files: Vec<File>) -> WeightStore {
        let mut index = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            for k in f.tensors.keys() {
                index.insert(k.clone(), i);
            }
        }
        WeightStore { files, index }
    }

    /// Every tensor's name, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.index.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.files[i].tensors[name])
    }

    /// The tensor as f32, checked against the expected shape.
    pub fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let &i = self
            .index
            .get(name)
            .ok_or_else(|| EngineError::BadModel(format!("weights: tensor `{name}` is missing")))?;
        let file = &self.files[i];
        let t = &file.tensors[name];
        if t.shape != shape {
            return Err(EngineError::BadModel(format!(
                "{}: tensor `{name}` has shape {:?}, expected {:?}",
                file.name, t.shape, shape
            )));
        }
        let raw = &file.bytes.as_slice()[file.data_start + t.start..file.data_start + t.end];
        Ok(match t.dtype {
            DType::F32 => raw
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                .collect(),
            DType::F16 => raw
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            DType::BF16 => raw
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        })
    }

    /// The tensor as stored when it is bf16 (raw bits), else converted to f32. Keeping bf16
    /// halves the bytes a memory-bound decode step reads.
    pub fn load(&self, name: &str, shape: &[usize]) -> Result<TensorData> {
        match self.info(name) {
            Some(t) if t.dtype == DType::BF16 && t.shape == shape => {
                let i = self.index[name];
                let file = &self.files[i];
                let raw =
                    &file.bytes.as_slice()[file.data_start + t.start..file.data_start + t.end];
                Ok(TensorData::Bf16(
                    raw.chunks_exact(2)
                        .map(|b| u16::from_le_bytes([b[0], b[1]]))
                        .collect(),
                ))
            }
            _ => self.f32(name, shape).map(TensorData::F32),
        }
    }

    /// A tensor's stored bytes, as they are in the file.
    pub fn raw(&self, name: &str) -> Option<(&TensorInfo, &[u8])> {
        let &i = self.index.get(name)?;
        let file = &self.files[i];
        let t = &file.tensors[name];
        Some((
            t,
            &file.bytes.as_slice()[file.data_start + t.start..file.data_start + t.end],
        ))
    }

    /// Total bytes of tensor data, as stored.
    pub fn stored_bytes(&self) -> usize {
        self.files
            .iter()
            .flat_map(|f| f.tensors.values())
            .map(|t| t.end - t.start)
            .sum()
    }
}

/// Writes tensors given as f32 into one safetensors file, stored in `dtype`.
pub fn write_file(
    path: &Path,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    dtype: DType,
) -> Result<()> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, shape, data) in tensors {
        let n = data.len() * dtype.size();
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype.name(), "shape": shape, "data_offsets": [offset, offset + n]}),
        );
        offset += n;
    }
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut h = serde_json::to_vec(&Value::Object(header)).expect("json");
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let io = |e| EngineError::io(format!("write {}", path.display()), e);
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    out.write_all(&(h.len() as u64).to_le_bytes()).map_err(io)?;
    out.write_all(&h).map_err(io)?;
    for (_, _, data) in tensors {
        let mut buf = Vec::with_capacity(data.len() * dtype.size());
        for &x in data {
            match dtype {
                DType::F32 => buf.extend_from_slice(&x.to_le_bytes()),
                DType::F16 => buf.extend_from_slice(&f16::from_f32(x).to_le_bytes()),
                DType::BF16 => buf.extend_from_slice(&bf16::from_f32(x).to_le_bytes()),
            }
        }
        out.write_all(&buf).map_err(io)?;
    }
    out.flush().map_err(io)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_each_dtype() {
        let dir = std::env::temp_dir().join(format!("kvmesh-st-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let p = dir.join("model.safetensors");
            let data = vec![1.0f32, -2.5, 0.125, 3.0, 4.0, 5.0];
            write_file(&p, &[("a.weight".into(), vec![2, 3], data.clone())], dtype).unwrap();
            let w = WeightStore::open_dir(&dir).unwrap();
            assert_eq!(w.f32("a.weight", &[2, 3]).unwrap(), data);
            assert!(w
                .f32("a.weight", &[3, 2])
                .unwrap_err()
                .to_string()
                .contains("shape"));
            assert!(w
                .f32("b.weight", &[1])
                .unwrap_err()
                .to_string()
                .contains("missing"));
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
