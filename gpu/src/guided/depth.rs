//! How deeply a grammar nests, measured before it is compiled. Compiling follows a
//! grammar's structure recursively (a schema's subschemas and `$ref`s, a Lark rule's
//! references), so a request could otherwise bring a grammar deep enough to exhaust a
//! thread's stack. Past [`MAX_GRAMMAR_DEPTH`] a grammar is refused, naming the limit.
//!
//! The measure is the longest chain a walk can follow, with a cycle (a recursive schema or
//! rule, which compiles to a loop, not to deeper code) cut where it closes. Every walk here
//! is itself bounded by the limit: it stops as soon as a chain passes it.

use std::collections::{HashMap, HashSet};

use llguidance::api::TopLevelGrammar;
use serde_json::Value;

use super::GuidedError;

/// The deepest nesting a grammar may have: JSON levels and `$ref` hops of a schema, rule
/// references and brackets of a Lark grammar. Real schemas and grammars stay far below
/// (a schema 20 objects deep is rare); compiling one this deep needs well under the
/// compiling thread's stack.
pub const MAX_GRAMMAR_DEPTH: usize = 256;

/// Refuses a grammar nested deeper than [`MAX_GRAMMAR_DEPTH`].
pub fn check(grammar: &TopLevelGrammar) -> Result<(), GuidedError> {
    for g in &grammar.grammars {
        if let Some(schema) = &g.json_schema {
            schema_depth(schema).map_err(|()| too_deep("JSON schema"))?;
        }
        if let Some(lark) = &g.lark_grammar {
            lark_depth(lark)?;
        }
    }
    Ok(())
}

fn too_deep(what: &str) -> GuidedError {
    GuidedError::TooDeep(format!(
        "the {what} nests more than {MAX_GRAMMAR_DEPTH} levels deep (counting nested objects, \
         arrays and $ref/rule references), over the limit of {MAX_GRAMMAR_DEPTH}"
    ))
}

/// The height of `schema`: its deepest chain of nested values and `$ref` hops (local refs:
/// `#` and JSON pointers). `Err` once a chain passes the limit.
pub fn schema_depth(schema: &Value) -> Result<usize, ()> {
    let mut walk = SchemaWalk {
        root: schema,
        memo: HashMap::new(),
        open: HashSet::new(),
    };
    walk.height(schema, 0)
}

struct SchemaWalk<'a> {
    root: &'a Value,
    /// Heights known, by node address (the tree does not change during the walk).
    memo: HashMap<*const Value, usize>,
    /// Nodes on the current chain: a reference back to one closes a cycle.
    open: HashSet<*const Value>,
}

impl<'a> SchemaWalk<'a> {
    fn height(&mut self, v: &'a Value, depth: usize) -> Result<usize, ()> {
        if depth > MAX_GRAMMAR_DEPTH {
            return Err(());
        }
        let key = v as *const Value;
        if let Some(&h) = self.memo.get(&key) {
            return if depth + h > MAX_GRAMMAR_DEPTH {
                Err(())
            } else {
                Ok(h)
            };
        }
        if !self.open.insert(key) {
            return Ok(0);
        }
        let mut h = 0;
        let children: Box<dyn Iterator<Item = (Option<&str>, &'a Value)>> = match v {
            Value::Object(m) => Box::new(m.iter().map(|(k, c)| (Some(k.as_str()), c))),
            Value::Array(a) => Box::new(a.iter().map(|c| (None, c))),
            _ => Box::new(std::iter::empty()),
        };
        for (key, child) in children {
            let target = if key == Some("$ref") {
                child.as_str().and_then(|r| resolve_ref(self.root, r))
            } else if child.is_object() || child.is_array() {
                Some(child)
            } else {
                None
            };
            if let Some(t) = target {
                h = h.max(1 + self.height(t, depth + 1)?);
            }
        }
        self.open.remove(&key);
        self.memo.insert(key, h);
        Ok(h)
    }
}

/// The value a local `$ref` points at: `#` or `#/a/b` (JSON pointer, `~0`/`~1` and `%xx`
/// escapes). Others (remote, by `$id`) are not followed.
fn resolve_ref<'a>(root: &'a Value, r: &str) -> Option<&'a Value> {
    let frag = r.strip_prefix('#')?;
    if frag.is_empty() {
        return Some(root);
    }
    let decoded = percent_decode(frag)?;
    root.pointer(&decoded)
}

fn percent_decode(s: &str) -> Option<String> {
    if !s.contains('%') {
        return Some(s.to_string());
    }
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// A Lark rule's body as the depth walk needs it: the names it refers to and the schemas
/// it embeds (`%json {…}`), each with the bracket depth it sits at, and its deepest bracket.
#[derive(Default, Debug)]
struct RuleBody {
    refs: Vec<(String, usize)>,
    schemas: Vec<(usize, usize)>,
    brackets: usize,
}

/// The height of a Lark grammar: its deepest chain of rule references and brackets,
/// schemas embedded with `%json` included.
pub fn lark_depth(text: &str) -> Result<usize, GuidedError> {
    let rules = lark_rules(text)?;
    let mut walk = LarkWalk {
        rules: &rules,
        memo: HashMap::new(),
        open: HashSet::new(),
    };
    let mut h = 0;
    for name in rules.keys() {
        h = h.max(
            walk.height(name, 0)
                .map_err(|()| too_deep("Lark grammar"))?,
        );
    }
    Ok(h)
}

struct LarkWalk<'a> {
    rules: &'a HashMap<String, RuleBody>,
    memo: HashMap<&'a str, usize>,
    open: HashSet<&'a str>,
}

impl<'a> LarkWalk<'a> {
    fn height(&mut self, name: &'a str, depth: usize) -> Result<usize, ()> {
        if depth > MAX_GRAMMAR_DEPTH {
            return Err(());
        }
        if let Some(&h) = self.memo.get(name) {
            return if depth + h > MAX_GRAMMAR_DEPTH {
                Err(())
            } else {
                Ok(h)
            };
        }
        let Some(body) = self.rules.get(name) else {
            return Ok(0);
        };
        if !self.open.insert(name) {
            return Ok(0);
        }
        let mut h = 1 + body.brackets;
        for &(s, at) in &body.schemas {
            h = h.max(1 + at + s);
        }
        for (r, at) in &body.refs {
            h = h.max(1 + at + self.height(r, depth + 1 + at)?);
        }
        if depth + h > MAX_GRAMMAR_DEPTH {
            return Err(());
        }
        self.open.remove(name);
        self.memo.insert(name, h);
        Ok(h)
    }
}

/// The rules (and terminals) of a Lark grammar with what their bodies refer to. This reads
/// only as much of Lark as depth needs: definitions (`name:` first on a line, with an
/// optional `?`/`!` before it and `.priority` after), names, brackets, and the strings,
/// regexes and comments to skip. Text before the first definition (directives) counts as
/// a body of its own.
fn lark_rules(text: &str) -> Result<HashMap<String, RuleBody>, GuidedError> {
    let b = text.as_bytes();
    let mut rules: HashMap<String, RuleBody> = HashMap::new();
    let mut current = String::from("%top");
    let mut body = RuleBody::default();
    let mut depth = 0usize;
    let mut line_start = true;
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        match c {
            b'\n' => {
                line_start = true;
                i += 1;
                continue;
            }
            b' ' | b'\t' | b'\r' => {
                i += 1;
                continue;
            }
            b'/' if b.get(i + 1) == Some(&b'/') => {
                i = skip_until(b, i, b'\n');
                continue;
            }
            b'"' | b'/' => i = skip_quoted(b, i, c),
            b'(' | b'[' | b'{' => {
                depth += 1;
                body.brackets = body.brackets.max(depth);
                i += 1;
            }
            b')' | b']' | b'}' => {
                depth = depth.saturating_sub(1);
                i += 1;
            }
            b'%' if text[i..].starts_with("%json") => {
                let (schema_h, end) = embedded_schema(text, i + 5)?;
                body.schemas.push((schema_h, depth));
                i = end;
            }
            b'?' | b'!' if line_start => {
                i += 1;
                continue;
            }
            c if c.is_ascii_alphabetic() || c == b'_' => {
                let start = i;
                while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                    i += 1;
                }
                let name = &text[start..i];
                if line_start && defines(b, i) {
                    let done = std::mem::take(&mut body);
                    rules
                        .entry(std::mem::take(&mut current))
                        .or_default()
                        .merge(done);
                    current = name.to_string();
                    depth = 0;
                } else {
                    body.refs.push((name.to_string(), depth));
                }
            }
            _ => i += 1,
        }
        line_start = false;
    }
    rules.entry(current).or_default().merge(body);
    Ok(rules)
}

impl RuleBody {
    fn merge(&mut self, other: RuleBody) {
        self.refs.extend(other.refs);
        self.schemas.extend(other.schemas);
        self.brackets = self.brackets.max(other.brackets);
    }
}

/// Whether the name ending at `i` is being defined: `:` follows, after an optional
/// `.priority`.
fn defines(b: &[u8], mut i: usize) -> bool {
    while i < b.len() && (b[i] == b' ' || b[i] == b'\t') {
        i += 1;
    }
    if b.get(i) == Some(&b'.') {
        i += 1;
        while i < b.len() && (b[i].is_ascii_digit() || b[i] == b'-') {
            i += 1;
        }
        while i < b.len() && (b[i] == b' ' || b[i] == b'\t') {
            i += 1;
        }
    }
    b.get(i) == Some(&b':')
}

fn skip_until(b: &[u8], mut i: usize, end: u8) -> usize {
    while i < b.len() && b[i] != end {
        i += 1;
    }
    i
}

/// Past a string or regex that opens with `q` at `i`, backslash escapes included.
fn skip_quoted(b: &[u8], mut i: usize, q: u8) -> usize {
    i += 1;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            c if c == q => return i + 1,
            b'\n' if q == b'/' => return i,
            _ => i += 1,
        }
    }
    i
}

/// The schema after `%json` at `from`: its height and where it ends.
fn embedded_schema(text: &str, from: usize) -> Result<(usize, usize), GuidedError> {
    let b = text.as_bytes();
    let mut i = from;
    while i < b.len() && b[i].is_ascii_whitespace() {
        i += 1;
    }
    if b.get(i) != Some(&b'{') {
        return Ok((0, i));
    }
    let start = i;
    let mut depth = 0usize;
    while i < b.len() {
        match b[i] {
            b'"' => {
                i = skip_quoted(b, i, b'"');
                continue;
            }
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    i += 1;
                    break;
                }
            }
            _ => {}
        }
        i += 1;
    }
    // A schema that does not parse is left for the compiler to refuse with its reason.
    let h = match serde_json::from_str::<Value>(&text[start..i]) {
        Ok(v) => schema_depth(&v).map_err(|()| too_deep("JSON schema in the Lark grammar"))?,
        Err(_) => 0,
    };
    Ok((h, i))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ref_chain(n: usize) -> Value {
        let mut defs = serde_json::Map::new();
        for i in 0..n {
            defs.insert(
                format!("d{i}"),
                json!({"$ref": format!("#/$defs/d{}", i + 1)}),
            );
        }
        defs.insert(format!("d{n}"), json!({"type": "string"}));
        json!({"$ref": "#/$defs/d0", "$defs": defs})
    }

    #[test]
    fn schema_depth_follows_nesting_and_refs_and_cuts_cycles() {
        assert_eq!(schema_depth(&json!({"type": "string"})).unwrap(), 0);
        let nested = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(schema_depth(&nested).unwrap(), 2);
        // Each hop of a chain counts once.
        let h = schema_depth(&ref_chain(100)).unwrap();
        assert!((100..=110).contains(&h), "{h}");
        assert!(schema_depth(&ref_chain(300)).is_err());
        // A recursive schema (a tree) is a loop, not a deep chain.
        let tree = json!({
            "$defs": {"node": {"type": "object", "properties": {
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"
        });
        assert!(schema_depth(&tree).unwrap() < 10);
        assert!(schema_depth(&json!({"$ref": "#"})).unwrap() <= 1);
        // Escaped pointers are followed.
        let esc = json!({"$defs": {"a/b": {"$ref": "#/$defs/a~1b"}}, "$ref": "#/$defs/a~1b"});
        assert!(schema_depth(&esc).is_ok());
        let pct = json!({"$defs": {"a b": {"type": "object", "properties": {"x": {}}}},
            "$ref": "#/$defs/a%20b"});
        assert!(schema_depth(&pct).unwrap() >= 3);
    }

    #[test]
    fn lark_depth_follows_rules_brackets_and_embedded_schemas() {
        assert_eq!(lark_depth("start: \"a\" | \"b\"\n").unwrap(), 1);
        let chain = |n: usize| {
            let mut s = String::from("start: r0\n");
            for i in 0..n {
                s.push_str(&format!("r{i}: r{} \"x\"\n", i + 1));
            }
            s.push_str(&format!("r{n}: \"end\"\n"));
            s
        };
        let h = lark_depth(&chain(100)).unwrap();
        assert!((100..=105).contains(&h), "{h}");
        let e = lark_depth(&chain(700)).unwrap_err();
        assert!(e.to_string().contains("256"), "{e}");
        // Terminals chain the same way, `?`/`!` and priorities do not hide a definition.
        let t = "start: A0\n?A0.2: A1 | \"q\"\n!A1: \"z\"\n";
        assert_eq!(lark_depth(t).unwrap(), 3);
        // Recursion is a loop.
        let rec = "start: expr\nexpr: expr \"+\" term | term\nterm: \"(\" expr \")\" | /[0-9]+/\n";
        assert!(lark_depth(rec).unwrap() <= 4);
        // Brackets nest, and strings, regexes and comments hide none.
        let deep = format!("start: {}\"a\"{}\n", "(".repeat(300), ")".repeat(300));
        assert!(lark_depth(&deep).is_err());
        let hidden = "start: \"((((\" /[(((]+/ // ((((((\n";
        assert_eq!(lark_depth(hidden).unwrap(), 1);
        // Schemas embedded with %json count, deep ones are refused.
        let embedded = format!("start: %json {}\n", ref_chain(300));
        assert!(lark_depth(&embedded)
            .unwrap_err()
            .to_string()
            .contains("JSON schema"));
        let ok = format!("start: \"<\" %json {} \">\"\n", ref_chain(10));
        assert!(lark_depth(&ok).unwrap() > 10);
    }
}
