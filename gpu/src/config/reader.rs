//! Typed reads of top-level `config.json` fields. A value of the wrong type is refused with a
//! message naming the field, rather than read as absent and replaced by a default.

use serde_json::{Map, Value};

use super::error::{ConfigError, Result};

/// Token ids given as a number or a list of numbers.
pub(crate) fn token_ids(v: &Value) -> Vec<u32> {
    match v {
        Value::Number(n) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Value::Array(a) => a
            .iter()
            .filter_map(|x| x.as_u64())
            .map(|x| x as u32)
            .collect(),
        _ => Vec::new(),
    }
}

/// A value as it appears in the file, cut short for messages.
pub(super) fn shown(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 120 {
        format!(
            "{}…",
            &s[..s.char_indices().nth(117).map_or(s.len(), |(i, _)| i)]
        )
    } else {
        s
    }
}

/// Reads typed fields from the top-level object, naming the field on a type error.
pub(super) struct Fields<'a> {
    pub(super) obj: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    /// The value, with `null` treated as absent.
    pub(super) fn get(&self, k: &str) -> Option<&'a Value> {
        self.obj.get(k).filter(|v| !v.is_null())
    }

    /// A typed read of field `k` (`null` counts as absent); a value of another type is an
    /// error that says what was expected.
    fn typed<T>(
        &self,
        k: &str,
        conv: impl Fn(&'a Value) -> Option<T>,
        expected: &'static str,
    ) -> Result<Option<T>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => conv(v).map(Some).ok_or_else(|| ConfigError::Mistyped {
                field: k.to_string(),
                value: shown(v),
                expected,
            }),
        }
    }

    pub(super) fn usize(&self, k: &str) -> Result<Option<usize>> {
        let int = |v: &Value| v.as_u64().map(|x| x as usize);
        self.typed(k, int, "a non-negative integer")
    }

    pub(super) fn need(&self, k: &str) -> Result<usize> {
        self.usize(k)?.ok_or_else(|| ConfigError::Missing {
            field: k.to_string(),
        })
    }

    pub(super) fn f64(&self, k: &str) -> Result<Option<f64>> {
        self.typed(k, Value::as_f64, "a number")
    }

    pub(super) fn bool(&self, k: &str) -> Result<Option<bool>> {
        self.typed(k, Value::as_bool, "true or false")
    }

    pub(super) fn str(&self, k: &str) -> Result<Option<&'a str>> {
        self.typed(k, Value::as_str, "a string")
    }
}

#[cfg(test)]
mod tests {
    use crate::config::testing::{err, llama};

    #[test]
    fn type_errors_name_the_field() {
        let e = err(llama(r#","rms_norm_eps":"small""#));
        assert!(e.contains("rms_norm_eps"), "{e}");
        let e = err(llama(r#","rope_scaling":{"type":"linear","factor":"2"}"#));
        assert!(e.contains("rope_scaling.factor"), "{e}");
    }
}
