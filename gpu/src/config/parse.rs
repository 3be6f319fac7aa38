//! Where reading `config.json` starts: the family it names decides which reader takes the
//! rest (the dense families' in `model`, Qwen3.5's in `qwen35`).

use serde_json::Value;

use super::arch::{read_arch, Arch};
use super::error::ConfigError;
use super::model::ModelConfig;
use super::qwen35::read_qwen35;
use super::reader::Fields;
use crate::error::Result;

impl ModelConfig {
    /// Reads `config.json`. The order of the reads is the order of the refusals: a file with
    /// several problems is refused for the first.
    pub fn from_json(text: &str) -> Result<ModelConfig> {
        let root: Value = serde_json::from_str(text).map_err(ConfigError::NotJson)?;
        let obj = root.as_object().ok_or(ConfigError::NotAnObject)?;
        Ok(match read_arch(&Fields { obj })? {
            Arch::Qwen35 => read_qwen35(obj)?,
            arch => ModelConfig::read_dense(obj, arch)?,
        })
    }
}
