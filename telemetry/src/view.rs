//! A trace's spans as a waterfall: parents before children, children in start order, each
//! with its depth. The viewer page draws the same order; `kvmesh trace` prints it as text.

use std::collections::{HashMap, HashSet};

use crate::store::SpanRecord;

/// Spans in waterfall order with their depth. Spans whose parent is missing (on a node that
/// did not answer, or evicted) are shown as roots.
pub fn waterfall(spans: &[SpanRecord]) -> Vec<(usize, &SpanRecord)> {
    let ids: HashSet<&str> = spans.iter().map(|s| s.span_id.as_str()).collect();
    let mut children: HashMap<&str, Vec<&SpanRecord>> = HashMap::new();
    let mut roots = Vec::new();
    for s in spans {
        match s.parent_id.as_deref().filter(|p| ids.contains(p)) {
            Some(p) => children.entry(p).or_default().push(s),
            None => roots.push(s),
        }
    }
    let by_start = |v: &mut Vec<&SpanRecord>| v.sort_by_key(|s| (s.start_us, s.end_us));
    by_start(&mut roots);
    for v in children.values_mut() {
        by_start(v);
    }
    let mut out = Vec::with_capacity(spans.len());
    let mut stack: Vec<(usize, &SpanRecord)> = roots.into_iter().rev().map(|s| (0, s)).collect();
    while let Some((d, s)) = stack.pop() {
        out.push((d, s));
        if let Some(c) = children.get(s.span_id.as_str()) {
            stack.extend(c.iter().rev().map(|c| (d + 1, *c)));
        }
    }
    out
}

/// The attributes a line shows, short.
fn brief(s: &SpanRecord) -> String {
    let mut parts: Vec<String> = s
        .attrs
        .iter()
        .filter(|(k, _)| !k.starts_with("otel.") && k.as_str() != "busy_ns")
        .map(|(k, v)| match v {
            serde_json::Value::String(t) => format!("{k}={t}"),
            other => format!("{k}={other}"),
        })
        .collect();
    if !s.events.is_empty() {
        parts.push(format!("{} events", s.events.len()));
    }
    if let Some(e) = &s.error {
        parts.push(format!("ERROR: {e}"));
    }
    parts.join(" ")
}

/// The waterfall as text, with bars `width` characters wide.
pub fn render_text(spans: &[SpanRecord], width: usize) -> String {
    if spans.is_empty() {
        return "no spans\n".into();
    }
    let t0 = spans.iter().map(|s| s.start_us).min().unwrap_or(0);
    let t1 = spans
        .iter()
        .map(|s| s.end_us)
        .max()
        .unwrap_or(t0)
        .max(t0 + 1);
    let span_us = (t1 - t0) as f64;
    let mut nodes: Vec<&str> = Vec::new();
    for s in spans {
        if !nodes.contains(&s.node.as_str()) {
            nodes.push(&s.node);
        }
    }
    let mut out = format!(
        "trace {}: {} spans on {} ({}), {:.2} ms\n",
        spans[0].trace_id,
        spans.len(),
        if nodes.len() == 1 {
            "1 node".to_string()
        } else {
            format!("{} nodes", nodes.len())
        },
        nodes.join(", "),
        span_us / 1e3
    );
    let name_w = waterfall(spans)
        .iter()
        .map(|(d, s)| 2 * d + s.name.len())
        .max()
        .unwrap_or(10)
        .min(40);
    let node_w = nodes.iter().map(|n| n.len()).max().unwrap_or(4).min(16);
    out.push_str(&format!(
        "{:>9} {:>9}  {:<node_w$}  {:<name_w$}  {:<width$}\n",
        "start ms", "dur ms", "node", "span", "",
    ));
    for (d, s) in waterfall(spans) {
        let a = ((s.start_us - t0) as f64 / span_us * width as f64) as usize;
        let b = (((s.end_us.max(s.start_us) - t0) as f64 / span_us * width as f64).ceil() as usize)
            .clamp(a + 1, width.max(a + 1));
        let bar: String = (0..width)
            .map(|i| if i >= a && i < b { '█' } else { '·' })
            .collect();
        let name = format!("{}{}", "  ".repeat(d), s.name);
        out.push_str(&format!(
            "{:>9.2} {:>9.2}  {:<node_w$}  {:<name_w$}  {}  {}\n",
            (s.start_us - t0) as f64 / 1e3,
            s.duration_us() as f64 / 1e3,
            s.node,
            name,
            bar,
            brief(s)
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(id: &str, parent: Option<&str>, start: u64, end: u64, node: &str) -> SpanRecord {
        SpanRecord {
            trace_id: "t".into(),
            span_id: id.into(),
            parent_id: parent.map(String::from),
            name: format!("span-{id}"),
            node: node.into(),
            start_us: start,
            end_us: end,
            error: None,
            attrs: Default::default(),
            events: vec![],
        }
    }

    #[test]
    fn children_follow_parents_in_start_order_and_orphans_are_roots() {
        let spans = vec![
            s("c2", Some("r"), 30, 40, "w"),
            s("r", None, 0, 100, "gw"),
            s("c1", Some("r"), 10, 20, "gw"),
            s("g", Some("c1"), 11, 12, "w"),
            s("o", Some("gone"), 50, 60, "p"),
        ];
        let order: Vec<(usize, &str)> = waterfall(&spans)
            .into_iter()
            .map(|(d, s)| (d, s.span_id.as_str()))
            .collect();
        assert_eq!(
            order,
            vec![(0, "r"), (1, "c1"), (2, "g"), (1, "c2"), (0, "o")]
        );
        let text = render_text(&spans, 20);
        assert!(text.contains("5 spans on 3 nodes (w, gw, p)"), "{text}");
        assert!(text.lines().nth(2).unwrap().contains("span-r"), "{text}");
    }
}
