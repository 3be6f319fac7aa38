//! Several tools' parameter schemas in one grammar. A function's parameters often carry
//! their own definitions (`$defs`, or `definitions`: Pydantic writes nested models so) and
//! point at them with `$ref`s relative to the parameters' root. Embedded under a call's
//! `arguments`, those pointers would resolve against the combined schema's root and find
//! nothing; [`SharedDefs`] moves each tool's definitions to the combined root's `$defs`,
//! under names of that tool's own, and rewrites its pointers to match.

use serde_json::{Map, Value};

/// Definitions gathered from the tools embedded so far.
#[derive(Default)]
pub struct SharedDefs(Map<String, Value>);

/// Keywords whose values are data, not schemas: a `$ref` inside them is left alone.
const DATA: [&str; 4] = ["const", "enum", "default", "examples"];

impl SharedDefs {
    /// Tool `i`'s `parameters` as they must read inside a bigger schema.
    pub fn embed(&mut self, i: usize, parameters: &Value) -> Value {
        let prefix = format!("tool{i}_");
        let mut schema = parameters.clone();
        let mut moved = Vec::new();
        if let Value::Object(o) = &mut schema {
            for (key, tag) in [("$defs", ""), ("definitions", "d_")] {
                if let Some(Value::Object(defs)) = o.remove(key) {
                    moved.extend(
                        defs.into_iter()
                            .map(|(name, def)| (format!("{prefix}{tag}{name}"), def)),
                    );
                }
            }
        }
        let mut root_used = false;
        rewrite(&mut schema, &prefix, &mut root_used);
        for (name, mut def) in moved {
            rewrite(&mut def, &prefix, &mut root_used);
            self.0.insert(name, def);
        }
        if root_used {
            self.0.insert(format!("{prefix}root"), schema.clone());
        }
        schema
    }

    /// Puts the gathered definitions at the top of `root` (an object schema).
    pub fn finish(self, root: &mut Value) {
        if let (false, Value::Object(o)) = (self.0.is_empty(), root) {
            o.insert("$defs".into(), Value::Object(self.0));
        }
    }
}

/// Every local `$ref` under `v`, made to point where the tool's definitions (or its root)
/// now are.
fn rewrite(v: &mut Value, prefix: &str, root_used: &mut bool) {
    match v {
        Value::Object(o) => {
            for (k, c) in o.iter_mut() {
                match (k.as_str(), c) {
                    ("$ref", Value::String(r)) => {
                        if let Some(moved) = relocated(r, prefix, root_used) {
                            *r = moved;
                        }
                    }
                    (k, _) if DATA.contains(&k) => {}
                    (_, c) => rewrite(c, prefix, root_used),
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|c| rewrite(c, prefix, root_used)),
        _ => {}
    }
}

/// Where a local pointer of the tool's schema points in the combined one (`None`: not a
/// local pointer, left as it is).
fn relocated(r: &str, prefix: &str, root_used: &mut bool) -> Option<String> {
    let ptr = r.strip_prefix('#')?;
    if let Some(rest) = ptr.strip_prefix("/$defs/") {
        return Some(format!("#/$defs/{prefix}{rest}"));
    }
    if let Some(rest) = ptr.strip_prefix("/definitions/") {
        return Some(format!("#/$defs/{prefix}d_{rest}"));
    }
    *root_used = true;
    Some(format!("#/$defs/{prefix}root{ptr}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn definitions_move_to_the_root_and_pointers_follow() {
        let city = json!({"$defs": {"City": {"type": "object", "properties":
                {"name": {"type": "string"}, "near": {"$ref": "#/$defs/City"}}}},
            "definitions": {"Zip": {"type": "string"}},
            "type": "object", "properties": {
                "city": {"$ref": "#/$defs/City"}, "zip": {"$ref": "#/definitions/Zip"},
                "again": {"$ref": "#"}, "tag": {"const": {"$ref": "#/$defs/City"}}}});
        let plain = json!({"type": "object", "properties": {"x": {"type": "integer"}}});
        let mut defs = SharedDefs::default();
        let a = defs.embed(0, &city);
        let b = defs.embed(1, &plain);
        assert_eq!(b, plain, "a schema without pointers is unchanged");
        assert!(a.get("$defs").is_none() && a.get("definitions").is_none());
        assert_eq!(a["properties"]["city"]["$ref"], "#/$defs/tool0_City");
        assert_eq!(a["properties"]["zip"]["$ref"], "#/$defs/tool0_d_Zip");
        assert_eq!(a["properties"]["again"]["$ref"], "#/$defs/tool0_root");
        // Data is data: a const that looks like a pointer stays as it was.
        assert_eq!(a["properties"]["tag"]["const"]["$ref"], "#/$defs/City");
        let mut root = json!({"anyOf": [a, b]});
        defs.finish(&mut root);
        let d = &root["$defs"];
        assert_eq!(
            d["tool0_City"]["properties"]["near"]["$ref"],
            "#/$defs/tool0_City"
        );
        assert_eq!(d["tool0_d_Zip"]["type"], "string");
        assert_eq!(
            d["tool0_root"]["properties"]["city"]["$ref"],
            "#/$defs/tool0_City"
        );
        // Every pointer resolves in the combined schema.
        let text = root.to_string();
        for r in ["tool0_City", "tool0_d_Zip", "tool0_root"] {
            assert!(
                root.pointer(&format!("/$defs/{r}")).is_some(),
                "{r} in {text}"
            );
        }
    }
}
