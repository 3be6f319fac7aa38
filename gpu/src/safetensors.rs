//! Reading and writing the safetensors format: an 8-byte little-endian header length, a JSON
//! header naming each tensor's dtype, shape and byte range, then the raw little-endian data.
//!
//! Files are memory-mapped; a tensor is converted to f32 only when a backend asks for it.

use std::collections::{HashMap, HashSet};
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
    /// FP8 e4m3 as PyTorch's `float8_e4m3fn` stores it (no infinities, one NaN pattern per
    /// sign, largest finite ±448). Only meaningful with the scales a `quantization_config`
    /// names, so reading one as plain values is refused (see [`WeightStore::f8_e4m3`]).
    F8E4M3,
}

impl DType {
    fn parse(s: &str) -> std::result::Result<DType, DTypeRefusal> {
        match s {
            "F32" => Ok(DType::F32),
            "F16" => Ok(DType::F16),
            "BF16" => Ok(DType::BF16),
            "F8_E4M3" => Ok(DType::F8E4M3),
            // e5m2 is the gradient format; no published inference checkpoint kvmesh runs
            // stores weights in it, and reading it as e4m3 would misread every value.
            "F8_E5M2" => Err(DTypeRefusal::E5m2),
            other => Err(DTypeRefusal::Unknown(other.to_string())),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::F8E4M3 => "F8_E4M3",
        }
    }

    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::F8E4M3 => 1,
        }
    }
}

/// The value of an e4m3 (`float8_e4m3fn`) byte: sign, 4 exponent bits (bias 7) and 3
/// mantissa bits; exponent 0 is subnormal (`m/8 · 2⁻⁶`), and `S.1111.111` is NaN (the
/// format has no infinities, so 448 is the largest magnitude).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0x0f) as i32;
    let m = (b & 0x07) as f32;
    if e == 0x0f && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    let mag = if e == 0 {
        m / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    };
    sign * mag
}

/// The e4m3 byte nearest to `x` (ties to the even mantissa), saturating at ±448 as
/// PyTorch's clamp-then-cast quantizers do; NaN stays NaN. Bit arithmetic: an 8B
/// checkpoint's FP8 weights are billions of calls (held to a search over every code in the
/// tests).
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a >= 448.0 {
        return sign | 0x7e;
    }
    // Below the smallest normal (2^-6) the codes count 2^-9 steps: code 8 is 2^-6 itself.
    if a < 2f32.powi(-6) {
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let bits = a.to_bits();
    let mut e = ((bits >> 23) & 0xff) as i32 - 127 + 7;
    let mant = bits & 0x7f_ffff;
    let (mut m, rest) = (mant >> 20, mant & 0xf_ffff);
    if rest > 0x8_0000 || (rest == 0x8_0000 && m & 1 == 1) {
        m += 1;
        if m == 8 {
            m = 0;
            e += 1;
        }
    }
    // 480 (e 15, m 7) is NaN's code in e4m3fn: what rounds there saturates.
    if e > 15 || (e == 15 && m == 7) {
        return sign | 0x7e;
    }
    sign | ((e as u8) << 3) | m as u8
}

/// Bytes of one file: memory-mapped, compiled into the binary, or made in memory.
#[derive(Clone)]
enum Bytes {
    Mapped(Arc<memmap2::Mmap>),
    Static(&'static [u8]),
    Owned(Arc<Vec<u8>>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Static(s) => s,
            Bytes::Owned(v) => v,
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
        let n = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
        let n = match usize::try_from(n) {
            Ok(n) if n <= buf.len() - 8 => n,
            _ => {
                return Err(bad(format!(
                    "header length {n} exceeds the file size {}",
                    buf.len()
                )))
            }
        };
        let header = Header::parse(&buf[8..8 + n]).map_err(|e| bad(e.to_string()))?;
        let data_start = 8 + n;
        let data_len = buf.len() - data_start;
        let mut tensors = HashMap::new();
        for (key, e) in header {
            let dtype = DType::parse(&e.dtype)
                .map_err(|why| bad(format!("tensor {key} has dtype {why}")))?;
            let (start, end) = e.data_offsets;
            let need = e
                .shape
                .iter()
                .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| {
                    bad(format!(
                        "tensor {key}: shape {:?} is too large to address",
                        e.shape
                    ))
                })?;
            if end < start || end - start != need {
                return Err(bad(format!(
                    "tensor {key}: data_offsets [{start}, {end}] do not match its shape {:?} \
                     of {} ({need} bytes)",
                    e.shape,
                    dtype.name()
                )));
            }
            if end > data_len {
                return Err(bad(format!(
                    "tensor {key}: data_offsets [{start}, {end}] end past the data section \
                     of {data_len} bytes"
                )));
            }
            let info = TensorInfo {
                dtype,
                shape: e.shape,
                start,
                end,
            };
            tensors.insert(key, info);
        }
        check_no_overlap(&tensors).map_err(|e| bad(e.to_string()))?;
        Ok(File {
            name,
            bytes,
            data_start,
            tensors,
        })
    }
}

/// A tensor dtype a safetensors header gives that kvmesh does not read.
#[derive(Debug, thiserror::Error)]
enum DTypeRefusal {
    #[error("F8_E5M2; kvmesh reads FP8 weights as F8_E4M3 only")]
    E5m2,
    #[error("{0}; kvmesh reads F32, F16, BF16 and F8_E4M3 (with a quantization_config)")]
    Unknown(String),
}

/// Two tensors whose bytes overlap in a file's data section.
#[derive(Debug, thiserror::Error)]
#[error(
    "tensors `{first}` (bytes {}..{}) and `{second}` (bytes {}..{}) overlap in the data \
     section; each tensor must have bytes of its own",
    .first_bytes.start, .first_bytes.end, .second_bytes.start, .second_bytes.end
)]
struct Overlap {
    first: String,
    first_bytes: std::ops::Range<usize>,
    second: String,
    second_bytes: std::ops::Range<usize>,
}

/// Refuses two tensors whose byte ranges share a byte: each would read the other's values.
/// A zero-length tensor holds no bytes and overlaps nothing.
fn check_no_overlap(tensors: &HashMap<String, TensorInfo>) -> std::result::Result<(), Overlap> {
    let mut ranges: Vec<(&str, &TensorInfo)> = tensors
        .iter()
        .filter(|(_, t)| t.end > t.start)
        .map(|(k, t)| (k.as_str(), t))
        .collect();
    ranges.sort_unstable_by_key(|&(k, t)| (t.start, t.end, k));
    // The range seen so far that reaches furthest: any range starting before its end
    // shares bytes with it.
    let mut furthest: Option<(&str, &TensorInfo)> = None;
    for (k, t) in ranges {
        if let Some((fk, f)) = furthest {
            if t.start < f.end {
                return Err(Overlap {
                    first: fk.to_string(),
                    first_bytes: f.start..f.end,
                    second: k.to_string(),
                    second_bytes: t.start..t.end,
                });
            }
        }
        if furthest.is_none_or(|(_, f)| t.end > f.end) {
            furthest = Some((k, t));
        }
    }
    Ok(())
}

/// One tensor's entry in a safetensors header. A field given twice is refused (serde's
/// derive does), so a second `dtype` or `data_offsets` cannot quietly win.
#[derive(serde::Deserialize)]
struct Entry {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

/// A safetensors header's tensor entries, in file order (`__metadata__` is skipped).
/// Parsed with a visitor of its own: a JSON object that gives one key twice keeps only the
/// last value in `serde_json`'s maps, and a tensor named twice must be refused instead.
struct Header;

impl Header {
    fn parse(json: &[u8]) -> std::result::Result<Vec<(String, Entry)>, HeaderError> {
        use serde::de::DeserializeSeed;
        let mut at = None;
        let mut de = serde_json::Deserializer::from_slice(json);
        let entries = HeaderSeed(&mut at)
            .deserialize(&mut de)
            .and_then(|h| de.end().map(|()| h));
        entries.map_err(|source| match at {
            Some(key) => HeaderError::Entry { key, source },
            None => HeaderError::NotEntries(source),
        })
    }
}

/// A safetensors header that does not read as tensor entries.
#[derive(Debug, thiserror::Error)]
enum HeaderError {
    /// Reading the value of `key` failed (its shape, dtype or offsets, or the key repeated).
    #[error("header entry `{key}`: {source}")]
    Entry {
        key: String,
        source: serde_json::Error,
    },
    #[error("header is not a JSON object of tensor entries: {0}")]
    NotEntries(serde_json::Error),
}

/// Deserializes the header, leaving in `.0` the key whose value was being read when it
/// failed, so the error can name it.
struct HeaderSeed<'a>(&'a mut Option<String>);

impl<'de> serde::de::DeserializeSeed<'de> for HeaderSeed<'_> {
    type Value = Vec<(String, Entry)>;

    fn deserialize<D: serde::Deserializer<'de>>(
        self,
        d: D,
    ) -> std::result::Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> serde::de::Visitor<'de> for HeaderSeed<'_> {
    type Value = Vec<(String, Entry)>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object of tensor entries")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<Self::Value, A::Error> {
        use serde::de::Error;
        let mut seen = HashSet::new();
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            *self.0 = Some(key.clone());
            if !seen.insert(key.clone()) {
                return Err(A::Error::custom(
                    "the key appears twice in the header; refusing rather than keeping one",
                ));
            }
            if key == "__metadata__" {
                map.next_value::<serde::de::IgnoredAny>()?;
            } else {
                entries.push((key, map.next_value::<Entry>()?));
            }
            *self.0 = None;
        }
        Ok(entries)
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
            shard_paths(dir, &v)?
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
        Self::from_files(files)
    }

    /// A single safetensors file compiled into the binary.
    pub fn from_static(name: &str, bytes: &'static [u8]) -> Result<WeightStore> {
        Self::from_files(vec![File::parse(name.to_string(), Bytes::Static(bytes))?])
    }

    /// A single safetensors file made in memory (a benchmark's random checkpoint larger than
    /// the disk it runs on).
    pub fn from_vec(name: &str, bytes: Vec<u8>) -> Result<WeightStore> {
        Self::from_files(vec![File::parse(
            name.to_string(),
            Bytes::Owned(Arc::new(bytes)),
        )?])
    }

    /// Indexes the files' tensors; a tensor found in two shards is refused (which copy a
    /// lookup found would depend on the order the shards were read in).
    fn from_files(files: Vec<File>) -> Result<WeightStore> {
        let mut index = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            for k in f.tensors.keys() {
                if let Some(j) = index.insert(k.clone(), i) {
                    return Err(EngineError::BadModel(format!(
                        "tensor `{k}` is in both weight shards {} and {}",
                        files[j].name, f.name
                    )));
                }
            }
        }
        Ok(WeightStore { files, index })
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
            DType::F8E4M3 => {
                return Err(EngineError::BadModel(format!(
                    "{}: tensor `{name}` is F8_E4M3, which means nothing without the scales \
                     a quantization_config gives it, and config.json quantizes no such \
                     weight",
                    file.name
                )))
            }
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

    /// An F8_E4M3 tensor's values before scaling, checked against the expected shape; a
    /// NaN (which no quantizer writes) is refused rather than carried into every product.
    pub fn f8_e4m3(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let Some((t, raw)) = self.raw(name) else {
            return Err(EngineError::BadModel(format!(
                "weights: tensor `{name}` is missing"
            )));
        };
        if t.dtype != DType::F8E4M3 || t.shape != shape {
            return Err(EngineError::BadModel(format!(
                "weights: tensor `{name}` is {} {:?}; its quantization_config makes it \
                 F8_E4M3 {shape:?}",
                t.dtype.name(),
                t.shape
            )));
        }
        let table: Vec<f32> = (0..=255u8).map(e4m3_to_f32).collect();
        let vals: Vec<f32> = raw.iter().map(|&b| table[b as usize]).collect();
        if let Some(i) = vals.iter().position(|v| v.is_nan()) {
            return Err(EngineError::BadModel(format!(
                "weights: tensor `{name}` holds an FP8 NaN at element {i}"
            )));
        }
        Ok(vals)
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

/// The shard files a `model.safetensors.index.json` names in its `weight_map`, each once,
/// sorted. Every entry is checked before any file is opened: a shard must be a plain
/// relative path inside `dir` (no root, drive, `..` or `.` component), so an index cannot
/// point the server at a file elsewhere. Symlinks inside the folder are followed as the
/// operator laid them out (a Hugging Face cache links every shard into a blob folder).
fn shard_paths(dir: &Path, index: &Value) -> Result<Vec<PathBuf>> {
    let bad = |why: String| EngineError::BadModel(format!("model.safetensors.index.json: {why}"));
    let map = index
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("has no weight_map object".into()))?;
    let mut shards = std::collections::BTreeSet::new();
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| {
            bad(format!(
                "weight_map entry `{tensor}` is {file}, not a shard file name"
            ))
        })?;
        let path = Path::new(file);
        let plain = !file.is_empty()
            && path
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_)));
        if !plain {
            return Err(bad(format!(
                "weight_map entry `{tensor}` names the file {file:?}; a shard must be a plain \
                 relative path inside the model folder (no leading `/`, no `..` or `.`)"
            )));
        }
        shards.insert(file);
    }
    Ok(shards.into_iter().map(|s| dir.join(s)).collect())
}

/// Writes tensors given as f32 into one safetensors file, stored in `dtype`.
pub fn write_file(
    path: &Path,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    dtype: DType,
) -> Result<()> {
    let typed: Vec<(String, Vec<usize>, Vec<f32>, DType)> = tensors
        .iter()
        .map(|(n, s, d)| (n.clone(), s.clone(), d.clone(), dtype))
        .collect();
    write_file_typed(path, &typed)
}

/// Writes tensors given as f32 into one safetensors file, each stored in its own dtype (an
/// FP8 checkpoint's weights beside their f32 scales and bf16 norms).
pub fn write_file_typed(
    path: &Path,
    tensors: &[(String, Vec<usize>, Vec<f32>, DType)],
) -> Result<()> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, shape, data, dtype) in tensors {
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
    for (_, _, data, dtype) in tensors {
        out.write_all(&encode(data, *dtype)).map_err(io)?;
    }
    out.flush().map_err(io)?;
    Ok(())
}

/// Elements one fill call makes: large enough to amortise the call, small enough that a
/// batch of them per core stays a few hundred MB.
pub const STREAM_CHUNK: usize = 1 << 20;

/// Writes a safetensors file whose values are made on the fly, `STREAM_CHUNK` elements at a
/// time and many chunks in parallel, so a checkpoint of billions of parameters needs neither
/// its f32 values in memory nor a single core to draw them. `fill(tensor, start, out)` fills
/// `out` with tensor `tensor`'s elements from `start` on; it must depend on nothing else, so
/// the file is the same however the chunks are scheduled.
pub fn write_file_streamed(
    path: &Path,
    tensors: &[(String, Vec<usize>)],
    dtype: DType,
    fill: &(dyn Fn(usize, usize, &mut [f32]) + Sync),
) -> Result<()> {
    let list: Vec<(String, Vec<usize>, DType)> = tensors
        .iter()
        .map(|(n, s)| (n.clone(), s.clone(), dtype))
        .collect();
    write_file_parts(path, &list, &mut |ti, out| {
        write_chunks(
            &list[ti].1,
            dtype,
            &|start, vals| fill(ti, start, vals),
            out,
        )
    })
}

/// Writes a safetensors file of `tensors` (name, shape, dtype, in file order) whose data
/// `write(i, out)` writes for the `i`th; each must write exactly its tensor's bytes, which is
/// checked, so the header's offsets always hold.
pub fn write_file_parts(
    path: &Path,
    tensors: &[(String, Vec<usize>, DType)],
    write: &mut dyn FnMut(usize, &mut dyn Write) -> Result<()>,
) -> Result<()> {
    let io = |e| EngineError::io(format!("write {}", path.display()), e);
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    write_parts(&mut out, &path.display().to_string(), tensors, write)?;
    out.flush().map_err(io)
}

/// [`write_file_parts`] into any writer (`what` names it in errors).
pub fn write_parts(
    out: &mut dyn Write,
    what: &str,
    tensors: &[(String, Vec<usize>, DType)],
    write: &mut dyn FnMut(usize, &mut dyn Write) -> Result<()>,
) -> Result<()> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, shape, dtype) in tensors {
        let n = shape.iter().product::<usize>() * dtype.size();
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
    let io = |e| EngineError::io(format!("write {what}"), e);
    out.write_all(&(h.len() as u64).to_le_bytes()).map_err(io)?;
    out.write_all(&h).map_err(io)?;
    for (i, (name, shape, dtype)) in tensors.iter().enumerate() {
        let want = shape.iter().product::<usize>() * dtype.size();
        let mut counted = Counted {
            inner: &mut *out,
            bytes: 0,
        };
        write(i, &mut counted)?;
        if counted.bytes != want {
            return Err(EngineError::io(
                format!("write {what}"),
                std::io::Error::other(format!(
                    "tensor `{name}`: {} bytes written where its shape takes {want}",
                    counted.bytes
                )),
            ));
        }
    }
    out.flush().map_err(io)?;
    Ok(())
}

/// A writer that counts what passes through it.
struct Counted<'a> {
    inner: &'a mut dyn Write,
    bytes: usize,
}

impl Write for Counted<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.bytes += n;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Writes one tensor of `shape` as `dtype`, its values made `STREAM_CHUNK` at a time and a
/// batch of chunks in parallel by `fill(start, out)`.
pub fn write_chunks(
    shape: &[usize],
    dtype: DType,
    fill: &(dyn Fn(usize, &mut [f32]) + Sync),
    out: &mut dyn Write,
) -> Result<()> {
    use rayon::prelude::*;
    let io = |e| EngineError::io("write a tensor".to_string(), e);
    // Chunks are made a batch at a time (a few per core) and written in order.
    let batch = rayon::current_num_threads().max(1) * 4;
    let n: usize = shape.iter().product();
    let starts: Vec<usize> = (0..n).step_by(STREAM_CHUNK).collect();
    for group in starts.chunks(batch) {
        let bytes: Vec<Vec<u8>> = group
            .par_iter()
            .map(|&start| {
                let mut vals = vec![0f32; STREAM_CHUNK.min(n - start)];
                fill(start, &mut vals);
                encode(&vals, dtype)
            })
            .collect();
        for b in &bytes {
            out.write_all(b).map_err(io)?;
        }
    }
    Ok(())
}

fn encode(vals: &[f32], dtype: DType) -> Vec<u8> {
    let mut buf = Vec::with_capacity(vals.len() * dtype.size());
    for &x in vals {
        match dtype {
            DType::F32 => buf.extend_from_slice(&x.to_le_bytes()),
            DType::F16 => buf.extend_from_slice(&f16::from_f32(x).to_le_bytes()),
            DType::BF16 => buf.extend_from_slice(&bf16::from_f32(x).to_le_bytes()),
            DType::F8E4M3 => buf.push(f32_to_e4m3(x)),
        }
    }
    buf
}

#[cfg(test)]
#[path = "safetensors_tests.rs"]
mod tests;
