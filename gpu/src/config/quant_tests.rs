//! `quantization_config`: each field read, each refusal naming its field.

use serde_json::{json, Value};

use super::testing::{err, llama};
use super::{ActivationScheme, ModelConfig, QuantMethod, Quantization, Scheme, WeightScale};
use crate::error::Result;

const Q: &str = "model.layers.0.self_attn.q_proj";
const DOWN1: &str = "model.layers.1.mlp.down_proj";

/// The two-layer llama of `testing` (untied head) with this `quantization_config`.
fn with(q: Value) -> Result<ModelConfig> {
    llama(&format!(r#","quantization_config":{q}"#))
}

fn quant(q: Value) -> Quantization {
    with(q).unwrap().quantization.expect("quantized")
}

/// Qwen's published block-scaled config.
fn qwen_fp8() -> Value {
    json!({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
           "weight_block_size": [128, 128]})
}

fn fp8_with(k: &str, v: Value) -> Value {
    let mut q = qwen_fp8();
    q[k] = v;
    q
}

const BLOCK: Scheme = Scheme {
    weights: WeightScale::Block {
        rows: 128,
        cols: 128,
    },
    activations: ActivationScheme::DynamicTokenGroup(128),
};

#[test]
fn qwens_fp8_config_quantizes_every_layer_but_the_head() {
    let c = with(qwen_fp8()).unwrap();
    let q = c.quantization.as_ref().unwrap();
    assert_eq!(q.method, QuantMethod::Fp8);
    for (m, _, _) in c.linear_layers() {
        let want = (m != "lm_head").then_some(BLOCK);
        assert_eq!(q.scheme_of(&m), want, "{m}");
    }
    assert_eq!(q.summary(), "quant_method fp8, block 128x128");
    // The scale of each quantized layer is expected beside its weight; the head has none.
    let names = c.expected_tensors();
    assert!(names.contains(&format!("{Q}.weight_scale_inv")));
    assert!(!names.iter().any(|n| n.starts_with("lm_head.weight_scale")));
    // Scale shapes: a partial last block counts.
    assert_eq!(BLOCK.scale_shapes(320, 192), vec![vec![3, 2]]);
    assert_eq!(BLOCK.scale_shapes(256, 128), vec![vec![2, 1]]);
    // An empty config is no quantization; `dequantize` is how transformers loads, not data.
    assert!(with(json!({})).unwrap().quantization.is_none());
    quant(fp8_with("dequantize", json!(true)));
    quant(fp8_with("scale_fmt", json!("float")));
    quant(fp8_with("expert_dtype", json!("fp8")));
    quant(fp8_with("modules_to_convert", json!(null)));
}

#[test]
fn fp8_skip_lists_match_as_transformers_does() {
    // A module name or a prefix up to a module boundary, a regex, or a plain suffix.
    for (pattern, skipped, kept) in [
        ("model.layers.1", DOWN1, Q),
        (
            "model.layers.1.mlp.down_proj",
            DOWN1,
            "model.layers.1.mlp.up_proj",
        ),
        (
            r"model\.layers\.\d+\.mlp",
            DOWN1,
            "model.layers.1.self_attn.o_proj",
        ),
        (
            "model.layers.*.down_proj",
            DOWN1,
            "model.layers.0.mlp.gate_proj",
        ),
        ("down_proj", DOWN1, "model.layers.0.mlp.up_proj"),
        ("o_proj", "model.layers.0.self_attn.o_proj", Q),
    ] {
        for field in ["modules_to_not_convert", "ignored_layers"] {
            let q = quant(fp8_with(field, json!([pattern])));
            assert_eq!(
                q.scheme_of(skipped),
                None,
                "{field} {pattern} skips {skipped}"
            );
            assert_eq!(
                q.scheme_of(kept),
                Some(BLOCK),
                "{field} {pattern} keeps {kept}"
            );
            // An explicit list replaces the default: the head is quantized unless named.
            assert_eq!(q.scheme_of("lm_head"), Some(BLOCK));
        }
    }
    // Not a prefix ending at a boundary: `layers.1` does not reach `layers.11`.
    let q = quant(fp8_with(
        "modules_to_not_convert",
        json!(["model.layers.1"]),
    ));
    assert_eq!(q.scheme_of("model.layers.11.mlp.up_proj"), Some(BLOCK));
    let q = quant(fp8_with("modules_to_not_convert", json!(["mlp.gate"])));
    assert_eq!(q.scheme_of("model.layers.0.mlp.gate_proj"), Some(BLOCK));
    // Both spellings given and equal is fine; differing is ambiguous.
    let mut both = fp8_with("modules_to_not_convert", json!(["lm_head"]));
    both["ignored_layers"] = json!(["lm_head"]);
    quant(both.clone());
    both["ignored_layers"] = json!(["model.layers.0"]);
    let e = err(with(both));
    assert!(
        e.contains("ignored_layers") && e.contains("modules_to_not_convert"),
        "{e}"
    );
}

#[test]
fn fp8_fields_kvmesh_does_not_run_are_refused_by_name() {
    for (field, value, says) in [
        ("fmt", json!("e5m2"), "e4m3"),
        (
            "activation_scheme",
            json!("static"),
            "static activation scales",
        ),
        ("activation_scheme", json!("per_block"), "dynamic"),
        ("weight_block_size", json!([64, 64]), "128x128"),
        ("weight_block_size", json!([128, 128, 1]), "128x128"),
        ("weight_block_size", json!([1, 128]), "128x128"),
        ("scale_fmt", json!("ue8m0"), "ue8m0"),
        ("expert_dtype", json!("fp4"), "FP4"),
        (
            "modules_to_convert",
            json!(["model.embed_tokens"]),
            "embedding",
        ),
        (
            "modules_to_not_convert",
            json!(["model.layers.(1"]),
            "regex",
        ),
        ("modules_to_not_convert", json!("lm_head"), "list"),
        ("modules_to_not_convert", json!([3]), "string"),
        ("ignored_layers", json!(["(?<=x)lm_head"]), "regex"),
        ("dequantize", json!("yes"), "true or false"),
        ("kv_cache_scheme", json!({"num_bits": 8}), "not a field"),
        ("input_scale", json!(1.0), "not a field"),
    ] {
        let e = err(with(fp8_with(field, value.clone())));
        assert!(
            e.contains(&format!("quantization_config.{field}")) && e.contains(says),
            "{field} = {value}: {e}"
        );
    }
    let mut q = qwen_fp8();
    q.as_object_mut().unwrap().remove("weight_block_size");
    let e = err(with(q));
    assert!(
        e.contains("weight_block_size") && e.contains("per-tensor"),
        "{e}"
    );
    for method in [json!("awq"), json!("bitsandbytes"), json!("fbgemm_fp8")] {
        let e = err(with(fp8_with("quant_method", method.clone())));
        assert!(
            e.contains("quant_method") && e.contains(method.as_str().unwrap()),
            "{e}"
        );
    }
    let e = err(with(json!({"fmt": "e4m3"})));
    assert!(e.contains("no quant_method"), "{e}");
    let e = err(with(json!(["fp8"])));
    assert!(e.contains("expected an object"), "{e}");
}

/// llm-compressor's `FP8_DYNAMIC` recipe as compressed-tensors 0.20 writes it.
fn ct_dynamic() -> Value {
    let args = |strategy: &str, dynamic: bool| {
        json!({"dynamic": dynamic, "group_size": null, "num_bits": 8, "strategy": strategy,
               "symmetric": true, "type": "float", "observer": "minmax",
               "observer_kwargs": {}, "actorder": null, "block_structure": null})
    };
    json!({
        "config_groups": {"group_0": {
            "format": "float-quantized",
            "input_activations": args("token", true),
            "output_activations": null,
            "targets": ["Linear"],
            "weights": args("channel", false),
        }},
        "format": "float-quantized",
        "global_compression_ratio": null,
        "ignore": ["lm_head"],
        "kv_cache_scheme": null,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.20.0",
    })
}

fn ct_set(path: &[&str], v: Value) -> Value {
    let mut q = ct_dynamic();
    let mut at = &mut q;
    for k in &path[..path.len() - 1] {
        at = &mut at[*k];
    }
    at[path[path.len() - 1]] = v;
    q
}

const CHANNEL_TOKEN: Scheme = Scheme {
    weights: WeightScale::Channel,
    activations: ActivationScheme::DynamicToken,
};

#[test]
fn compressed_tensors_fp8_dynamic_is_read() {
    let c = with(ct_dynamic()).unwrap();
    let q = c.quantization.as_ref().unwrap();
    assert_eq!(q.method, QuantMethod::CompressedTensors);
    assert_eq!(q.scheme_of(Q), Some(CHANNEL_TOKEN));
    assert_eq!(q.scheme_of("lm_head"), None);
    assert!(c.expected_tensors().contains(&format!("{Q}.weight_scale")));
    assert_eq!(
        CHANNEL_TOKEN.scale_shapes(8, 128),
        vec![vec![8, 1], vec![8]]
    );
    assert_eq!(q.summary(), "quant_method compressed-tensors, per-channel");
    // naive-quantized is the same storage; a preset group maps to its scheme.
    quant(ct_set(&["format"], json!("naive-quantized")));
    let mut preset = ct_dynamic();
    preset["config_groups"] = json!({"FP8": ["Linear"]});
    let q = quant(preset);
    let static_tensor = q.scheme_of(Q).unwrap();
    assert_eq!(static_tensor.weights, WeightScale::Tensor);
    assert_eq!(static_tensor.activations, ActivationScheme::StaticTensor);
    let c = with(ct_set(&["config_groups"], json!({"FP8": ["Linear"]}))).unwrap();
    assert!(c.expected_tensors().contains(&format!("{Q}.input_scale")));
    // Weight-only and per-tensor weights; activation orderings from calibration.
    let c = quant(ct_set(
        &["config_groups", "group_0", "input_activations"],
        json!(null),
    ));
    assert_eq!(
        c.scheme_of(Q).unwrap().activations,
        ActivationScheme::Unquantized
    );
    let w = ct_set(
        &["config_groups", "group_0", "weights", "strategy"],
        json!("tensor"),
    );
    assert_eq!(quant(w).scheme_of(Q).unwrap().weights, WeightScale::Tensor);
    quant(ct_set(
        &["config_groups", "group_0", "weights", "actorder"],
        json!("weight"),
    ));
    // The strategy may be left to the group size, as compressed-tensors infers it.
    let mut inferred = ct_dynamic();
    let w = &mut inferred["config_groups"]["group_0"]["weights"];
    w["strategy"] = json!(null);
    w["group_size"] = json!(-1);
    assert_eq!(
        quant(inferred).scheme_of(Q).unwrap().weights,
        WeightScale::Channel
    );
}

#[test]
fn compressed_tensors_targets_and_ignore_match_as_the_package_does() {
    let mut q = ct_dynamic();
    q["config_groups"]["group_0"]["targets"] = json!([r"re:.*self_attn\.(q|k)_proj$"]);
    let mut mlp = q["config_groups"]["group_0"].clone();
    mlp["targets"] = json!([r"re:.*mlp\..*_proj"]);
    mlp["weights"]["strategy"] = json!("tensor");
    q["config_groups"]["group_1"] = mlp;
    q["ignore"] = json!(["lm_head", DOWN1, r"re:model\.layers\.0\.mlp\.up"]);
    let q = quant(q);
    assert_eq!(q.scheme_of(Q), Some(CHANNEL_TOKEN));
    assert_eq!(q.scheme_of("model.layers.0.self_attn.v_proj"), None);
    let mlp = q.scheme_of("model.layers.0.mlp.down_proj").unwrap();
    assert_eq!(mlp.weights, WeightScale::Tensor);
    assert_eq!(q.scheme_of(DOWN1), None, "ignored by name");
    assert_eq!(
        q.scheme_of("model.layers.0.mlp.up_proj"),
        None,
        "ignored by regex"
    );
    assert_eq!(q.scheme_of("model.layers.1.mlp.up_proj"), Some(mlp));
    // An exact name matches only itself.
    let q = quant(ct_set(
        &["ignore"],
        json!(["layers.1.mlp.down_proj", "lm_head"]),
    ));
    assert_eq!(q.scheme_of(DOWN1), Some(CHANNEL_TOKEN));
    // Two groups with different schemes on one layer: ambiguous.
    let mut two = ct_dynamic();
    let mut g = two["config_groups"]["group_0"].clone();
    g["weights"]["strategy"] = json!("tensor");
    g["targets"] = json!([Q]);
    two["config_groups"]["group_1"] = g;
    let e = err(with(two));
    assert!(e.contains(Q) && e.contains("ambiguous"), "{e}");
}

#[test]
fn compressed_tensors_fields_kvmesh_does_not_run_are_refused_by_name() {
    let g = ["config_groups", "group_0"];
    let w = ["config_groups", "group_0", "weights"];
    let a = ["config_groups", "group_0", "input_activations"];
    let cat = |p: &[&str], k: &str| -> Vec<String> {
        p.iter()
            .map(|s| s.to_string())
            .chain([k.to_string()])
            .collect()
    };
    let cases: Vec<(Vec<String>, Value, &str)> = vec![
        (
            cat(&[], "format"),
            json!("pack-quantized"),
            "float-quantized",
        ),
        (
            cat(&[], "quantization_status"),
            json!("frozen"),
            "compressed",
        ),
        (
            cat(&[], "kv_cache_scheme"),
            json!({"num_bits": 8, "type": "float"}),
            "KV cache",
        ),
        (
            cat(&[], "sparsity_config"),
            json!({"format": "sparse-24-bitmask"}),
            "sparse",
        ),
        (
            cat(&[], "transform_config"),
            json!({"config_groups": {}}),
            "transformed",
        ),
        (cat(&[], "ignore"), json!("lm_head"), "list"),
        (cat(&[], "ignore"), json!(["re:(lm_head"]), "regex"),
        (cat(&[], "lora"), json!(true), "not a field"),
        (
            cat(&g, "output_activations"),
            json!({"num_bits": 8}),
            "outputs",
        ),
        (cat(&g, "format"), json!("pack-quantized"), "another format"),
        (
            cat(&g, "targets"),
            json!(["Qwen2DecoderLayer"]),
            "class target",
        ),
        (cat(&g, "weights"), json!(null), "no weights"),
        (cat(&g, "extra"), json!(1), "not a scheme field"),
        (cat(&w, "num_bits"), json!(4), "8-bit"),
        (cat(&w, "type"), json!("int"), "not int"),
        (cat(&w, "symmetric"), json!(false), "asymmetric"),
        (cat(&w, "strategy"), json!("block"), "per-channel"),
        (cat(&w, "strategy"), json!("group"), "per-channel"),
        (cat(&w, "group_size"), json!(128), "group-wise"),
        (
            cat(&w, "block_structure"),
            json!([128, 128]),
            "expected null",
        ),
        (
            cat(&w, "scale_dtype"),
            json!("torch.float8_e8m0fnu"),
            "expected null",
        ),
        (cat(&w, "dynamic"), json!("local"), "local"),
        (cat(&w, "actorder"), json!("group"), "reordered"),
        (cat(&w, "observer_kwargs2"), json!({}), "not an argument"),
        (cat(&a, "strategy"), json!("group"), "per-token"),
        (cat(&a, "dynamic"), json!(false), "per-token"),
        (cat(&a, "num_bits"), json!(16), "8-bit"),
    ];
    for (path, value, says) in cases {
        let p: Vec<&str> = path.iter().map(String::as_str).collect();
        let e = err(with(ct_set(&p, value.clone())));
        let field = p.join(".");
        let named = match p.last() {
            Some(&"weights") if value.is_null() => p[..2].join("."),
            // The strategy and dynamic-ness are refused together, at their arguments.
            Some(&("strategy" | "dynamic")) => p[..p.len() - 1].join("."),
            _ => field.clone(),
        };
        assert!(
            e.contains(&format!("quantization_config.{named}")) && e.contains(says),
            "{field} = {value}: {e}"
        );
    }
    let mut preset = ct_dynamic();
    preset["config_groups"] = json!({"W4A16": ["Linear"]});
    let e = err(with(preset));
    assert!(
        e.contains("config_groups.W4A16") && e.contains("preset"),
        "{e}"
    );
}

/// A small Qwen3.5 text config's fields (layers 0-2 linear attention, 3 full).
const QWEN35_TEXT: &str = r#""vocab_size":100,"hidden_size":64,"intermediate_size":128,
    "num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16"#;

/// Qwen3.5 FP8 checkpoints as published: compressed-tensors' FP8_DYNAMIC recipe leaving the
/// linear-attention layers bf16 (top-level layout), Qwen's block-scaled format with the
/// wrapper's layout and its modules under `model.language_model.`.
#[test]
fn qwen35_fp8_configs_are_read_in_either_layout() {
    let mut ct = ct_dynamic();
    ct["ignore"] = json!(["lm_head", "re:.*visual.*", "re:.*linear_attn.*"]);
    let causal = ModelConfig::from_json(&format!(
        r#"{{"architectures":["Qwen3_5ForCausalLM"],"model_type":"qwen3_5_text",{QWEN35_TEXT},
            "quantization_config":{ct}}}"#
    ))
    .unwrap();
    let q = causal.quantization.as_ref().unwrap();
    assert_eq!(q.method, QuantMethod::CompressedTensors);
    for m in [
        "model.layers.3.self_attn.q_proj",
        "model.layers.0.mlp.down_proj",
    ] {
        assert!(q.scheme_of(m).is_some(), "{m}");
    }
    for m in ["model.layers.0.linear_attn.in_proj_qkv", "lm_head"] {
        assert!(q.scheme_of(m).is_none(), "{m}");
    }
    let block = fp8_with(
        "modules_to_not_convert",
        json!([
            "lm_head",
            "model.language_model.layers.0.linear_attn.in_proj_a",
            // Modules of the unread vision tower and MTP head may be named too.
            "model.visual.merger.linear_fc1",
            "mtp.fc"
        ]),
    );
    let wrapped = |text_extra: &str| {
        ModelConfig::from_json(&format!(
            r#"{{"architectures":["Qwen3_5ForConditionalGeneration"],"model_type":"qwen3_5",
                "text_config":{{"model_type":"qwen3_5_text",{QWEN35_TEXT}{text_extra}}},
                "quantization_config":{block}}}"#
        ))
    };
    let c = wrapped("").unwrap();
    let q = c.quantization.as_ref().unwrap();
    let p = "model.language_model.layers.0.linear_attn";
    assert_eq!(q.scheme_of(&format!("{p}.in_proj_qkv")), Some(BLOCK));
    assert_eq!(q.scheme_of(&format!("{p}.in_proj_a")), None);
    // A quantization_config inside text_config is nowhere transformers writes it: refused
    // by name rather than read or ignored.
    let e = err(wrapped(&format!(
        r#","quantization_config":{}"#,
        qwen_fp8()
    )));
    assert!(e.contains("text_config.quantization_config"), "{e}");
    // The fingerprint hashes the config's Debug: it must tell FP8 from bf16.
    let plain = format!("{:?}", llama("").unwrap());
    let fp8 = format!("{:?}", with(qwen_fp8()).unwrap());
    assert_ne!(plain, fp8);
}

#[test]
fn the_quantization_config_is_written_back_as_read() {
    let c = with(qwen_fp8()).unwrap();
    let v = c.to_hf_json();
    assert_eq!(v["quantization_config"], qwen_fp8());
    let back = ModelConfig::from_json(&v.to_string()).unwrap();
    assert_eq!(
        format!("{:?}", back.quantization),
        format!("{:?}", c.quantization)
    );
}
