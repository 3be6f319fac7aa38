//! Sliding-window attention: which layers attend through a window, and how wide it is. Each
//! family spells this its own way, and a window where the family has none is refused.

use super::arch::Arch;
use super::error::{ConfigError, Result};
use super::reader::{shown, Fields};

/// The window size, and which layers use it (`None`: all of them, when there is a window).
pub(super) type Windows = (Option<usize>, Option<Vec<bool>>);

/// Which layers attend through a window, and how wide it is.
pub(super) fn read_window(f: &Fields, arch: Arch) -> Result<Windows> {
    match arch {
        Arch::Llama => llama(f),
        Arch::Mistral => mistral(f),
        Arch::Qwen2 | Arch::Qwen3 => qwen(f),
        // Its `layer_types` name token mixers, not windows (see `hybrid`).
        Arch::Qwen35 => Ok((None, None)),
    }
}

fn llama(f: &Fields) -> Result<Windows> {
    if let Some(v) = f.get("sliding_window") {
        return Err(ConfigError::LlamaWindow { value: shown(v) });
    }
    Ok((None, None))
}

fn mistral(f: &Fields) -> Result<Windows> {
    if let Some(v) = f.get("layer_types") {
        return Err(ConfigError::MistralLayerTypes { value: shown(v) });
    }
    Ok((window_size(f)?, None))
}

fn qwen(f: &Fields) -> Result<Windows> {
    let types = layer_types(f)?;
    let enabled = f.bool("use_sliding_window")?.unwrap_or(false);
    let size = window_size(f)?;
    if !enabled {
        if let Some(i) = types.as_ref().and_then(|t| t.iter().position(|&s| s)) {
            return Err(ConfigError::SlidingWithoutWindow { layer: i });
        }
        return Ok((None, None));
    }
    let Some(size) = size else {
        return Err(ConfigError::NoWindowSize);
    };
    let layers = match types {
        Some(t) => t,
        None => {
            let first = f.usize("max_window_layers")?.unwrap_or(28);
            let n = f.need("num_hidden_layers")?;
            (0..n).map(|i| i >= first).collect()
        }
    };
    if layers.iter().any(|&s| s) {
        Ok((Some(size), Some(layers)))
    } else {
        Ok((None, None))
    }
}

/// `sliding_window`: absent means transformers' default window of 4096; null means none.
fn window_size(f: &Fields) -> Result<Option<usize>> {
    if !f.obj.contains_key("sliding_window") {
        return Ok(Some(4096));
    }
    match f.usize("sliding_window")? {
        Some(0) => Err(ConfigError::ZeroWindow),
        w => Ok(w),
    }
}

/// `layer_types`, as whether each layer is a sliding one.
fn layer_types(f: &Fields) -> Result<Option<Vec<bool>>> {
    let Some(v) = f.get("layer_types") else {
        return Ok(None);
    };
    let a = v.as_array().ok_or_else(|| ConfigError::Mistyped {
        field: "layer_types".into(),
        value: shown(v),
        expected: "a list",
    })?;
    a.iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            Some("full_attention") => Ok(false),
            Some("sliding_attention") => Ok(true),
            _ => Err(ConfigError::UnknownLayerType {
                layer: i,
                value: shown(t),
            }),
        })
        .collect::<Result<Vec<bool>>>()
        .map(Some)
}

#[cfg(test)]
mod tests {
    use crate::config::testing::{err, llama, qwen2};
    use crate::config::ModelConfig;

    #[test]
    fn sliding_window_on_llama_is_refused() {
        let e = err(llama(r#","sliding_window":4096"#));
        assert!(
            e.contains("sliding_window") && e.contains("4096") && e.contains("llama"),
            "{e}"
        );
        assert_eq!(
            llama(r#","sliding_window":null"#).unwrap().sliding_window,
            None
        );
    }

    #[test]
    fn mistral_window_defaults_like_transformers() {
        let base = r#"{"architectures":["MistralForCausalLM"],"vocab_size":10,"hidden_size":64,
               "intermediate_size":8,"num_hidden_layers":2,"num_attention_heads":4,
               "num_key_value_heads":2"#;
        let absent = ModelConfig::from_json(&format!("{base}}}")).unwrap();
        assert_eq!(absent.sliding_window, Some(4096));
        assert_eq!(absent.max_context(), 131_072);
        let none = ModelConfig::from_json(&format!(r#"{base},"sliding_window":null}}"#)).unwrap();
        assert_eq!(none.sliding_window, None);
        let w = ModelConfig::from_json(&format!(r#"{base},"sliding_window":8}}"#)).unwrap();
        assert_eq!((w.layer_window(0), w.layer_window(1)), (Some(8), Some(8)));
        let e = err(ModelConfig::from_json(&format!(
            r#"{base},"layer_types":["full_attention","sliding_attention"]}}"#
        )));
        assert!(e.contains("layer_types") && e.contains("Ministral"), "{e}");
    }

    #[test]
    fn qwen_windows_per_layer() {
        let c = qwen2(r#","use_sliding_window":true,"sliding_window":8,"max_window_layers":1"#)
            .unwrap();
        assert_eq!((c.layer_window(0), c.layer_window(1)), (None, Some(8)));
        let c = qwen2(
            r#","use_sliding_window":true,"sliding_window":8,
               "layer_types":["sliding_attention","full_attention"]"#,
        )
        .unwrap();
        assert_eq!((c.layer_window(0), c.layer_window(1)), (Some(8), None));
        let e = err(qwen2(
            r#","use_sliding_window":false,"layer_types":["sliding_attention","full_attention"]"#,
        ));
        assert!(e.contains("layer_types[0]"), "{e}");
        let e = err(qwen2(r#","use_sliding_window":true,"sliding_window":null"#));
        assert!(e.contains("sliding_window"), "{e}");
        let e = err(qwen2(
            r#","layer_types":["full_attention","chunked_attention"]"#,
        ));
        assert!(e.contains("chunked_attention"), "{e}");
    }
}
