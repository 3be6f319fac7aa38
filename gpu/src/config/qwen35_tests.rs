use super::*;
use crate::config::testing::err;
use crate::error::Result;

/// A small Qwen3_5ForCausalLM config with `extra` appended (`extra` starts with a comma).
fn text(extra: &str) -> Result<ModelConfig> {
    ModelConfig::from_json(&format!(
        r#"{{"architectures":["Qwen3_5ForCausalLM"],"model_type":"qwen3_5_text",
           "vocab_size":100,"hidden_size":64,"intermediate_size":128,"num_hidden_layers":8,
           "num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,
           "linear_num_key_heads":2,"linear_num_value_heads":4,"linear_key_head_dim":16,
           "linear_value_head_dim":8{extra}}}"#
    ))
}

/// The same text model nested the way Qwen3_5ForConditionalGeneration writes it.
fn wrapped(text_extra: &str, top_extra: &str) -> Result<ModelConfig> {
    ModelConfig::from_json(&format!(
        r#"{{"architectures":["Qwen3_5ForConditionalGeneration"],"model_type":"qwen3_5",
           "image_token_id":248056,"video_token_id":248057,"vision_start_token_id":248053,
           "vision_end_token_id":248054,"vision_config":{{"depth":1,"model_type":"qwen3_5_vision"}},
           "transformers_version":"5.23.0",
           "text_config":{{"model_type":"qwen3_5_text","vocab_size":100,"hidden_size":64,
             "intermediate_size":128,"num_hidden_layers":4,"num_attention_heads":4,
             "num_key_value_heads":1,"head_dim":16,"mtp_num_hidden_layers":1,
             "mamba_ssm_dtype":"float32","attn_output_gate":true,"output_gate_type":"swish",
             "rope_parameters":{{"rope_type":"default","rope_theta":10000000,
               "partial_rotary_factor":0.25,"mrope_section":[2,1,1],"mrope_interleaved":true}}
             {text_extra}}}{top_extra}}}"#
    ))
}

#[test]
fn reads_the_causal_lm_layout_with_transformers_defaults() {
    let c = text("").unwrap();
    assert_eq!(c.arch, Arch::Qwen35);
    let h = c.hybrid.as_ref().unwrap();
    assert_eq!(h.layout, HybridLayout::CausalLm);
    // full_attention_interval 4 by default: layers 3 and 7 are full attention.
    let full: Vec<usize> = (0..8)
        .filter(|&i| h.layer_types[i] == LayerType::FullAttention)
        .collect();
    assert_eq!(full, vec![3, 7]);
    assert_eq!(h.linear_conv_kernel_dim, 4);
    // partial_rotary_factor 0.25 by default.
    assert_eq!(h.rotary_dim, 8);
    assert_eq!(c.rope_inv_freq().len(), 4);
    assert!(c.qk_norm && !c.qkv_bias && !c.tie_word_embeddings);
    assert_eq!(c.max_position_embeddings, 32_768);
    // conv window 3 x (2*32 + 32) and a 16 x 8 state per value head, for 6 linear layers.
    assert_eq!(h.state_floats_per_layer(), 3 * 96 + 4 * 16 * 8);
    assert_eq!(h.state_bytes_per_sequence(), 4 * 6 * (3 * 96 + 4 * 16 * 8));
}

#[test]
fn reads_the_conditional_generation_layout() {
    let c = wrapped("", r#","tie_word_embeddings":true"#).unwrap();
    let h = c.hybrid.as_ref().unwrap();
    assert_eq!(h.layout, HybridLayout::ConditionalGeneration);
    assert!(c.tie_word_embeddings, "the wrapper's flag ties the head");
    assert_eq!(h.rotary_dim, 4);
    assert_eq!(c.rope.theta, 10_000_000.0);
    assert!(c.ignored_fields.contains(&"vision_config".to_string()));
    assert!(c
        .ignored_fields
        .contains(&"mtp_num_hidden_layers".to_string()));
    let names = c.expected_tensors();
    assert_eq!(names[0], "model.language_model.embed_tokens.weight");
    assert!(names.contains(&"model.language_model.layers.3.self_attn.q_norm.weight".into()));
    assert!(names.contains(&"model.language_model.layers.0.linear_attn.A_log".into()));
    assert!(!names.iter().any(|n| n == "lm_head.weight"));
    assert!(c.ignores_tensor("mtp.fc.weight") && c.ignores_tensor("model.visual.blocks.0.x"));
    assert!(!c.ignores_tensor("model.language_model.norm.weight"));
    // The text config's own tie flag is not what transformers reads.
    let c = wrapped(r#","tie_word_embeddings":true"#, "").unwrap();
    assert!(!c.tie_word_embeddings);
}

#[test]
fn layer_types_and_the_interval() {
    let c = text(r#","full_attention_interval":2"#).unwrap();
    let t = &c.hybrid.unwrap().layer_types;
    assert_eq!(t[1], LayerType::FullAttention);
    assert_eq!(t[2], LayerType::LinearAttention);
    let list = r#","layer_types":["linear_attention","full_attention","linear_attention",
        "full_attention","linear_attention","full_attention","linear_attention","full_attention"]"#;
    text(list).unwrap();
    text(&format!("{list},\"full_attention_interval\":2")).unwrap();
    let e = err(text(&format!("{list},\"full_attention_interval\":4")));
    assert!(e.contains("full_attention_interval"), "{e}");
    let e = err(text(
        r#","layer_types":["linear_attention","sliding_attention","linear_attention",
        "full_attention","linear_attention","full_attention","linear_attention","full_attention"]"#,
    ));
    assert!(
        e.contains("layer_types[1]") && e.contains("sliding_attention"),
        "{e}"
    );
    let e = err(text(r#","layer_types":["full_attention"]"#));
    assert!(
        e.contains("layer_types") && e.contains("num_hidden_layers"),
        "{e}"
    );
}

#[test]
fn moe_variants_are_refused_by_name() {
    let e = err(ModelConfig::from_json(
        r#"{"architectures":["Qwen3_5MoeForConditionalGeneration"],"model_type":"qwen3_5_moe"}"#,
    ));
    assert!(
        e.contains("mixture-of-experts") && e.contains("qwen3_5_moe"),
        "{e}"
    );
    let e = err(text(r#","num_experts":256,"num_experts_per_tok":8"#));
    assert!(
        e.contains("num_experts") && e.contains("mixture-of-experts"),
        "{e}"
    );
    let e = err(wrapped("", "").and_then(|_| {
        ModelConfig::from_json(
            r#"{"architectures":["Qwen3_5ForConditionalGeneration"],"model_type":"qwen3_5",
               "text_config":{"model_type":"qwen3_5_moe_text"}}"#,
        )
    }));
    assert!(e.contains("qwen3_5_moe_text"), "{e}");
}

#[test]
fn state_dtype_gates_and_rope_are_checked() {
    let e = err(text(r#","mamba_ssm_dtype":"bfloat16""#));
    assert!(
        e.contains("mamba_ssm_dtype") && e.contains("bfloat16"),
        "{e}"
    );
    let e = err(text(r#","attn_output_gate":false"#));
    assert!(e.contains("attn_output_gate"), "{e}");
    let e = err(text(r#","output_gate_type":"sigmoid""#));
    assert!(e.contains("output_gate_type"), "{e}");
    let e = err(text(
        r#","rope_parameters":{"rope_type":"yarn","factor":4.0,"rope_theta":10000}"#,
    ));
    assert!(e.contains("yarn"), "{e}");
    let e = err(text(
        r#","rope_parameters":{"rope_theta":10000,"mrope_section":"a"}"#,
    ));
    assert!(e.contains("mrope_section"), "{e}");
    let c = text(r#","rope_parameters":{"rope_theta":10000,"partial_rotary_factor":0.5}"#).unwrap();
    assert_eq!(c.rotary_dim(), 16);
    let e = err(text(r#","partial_rotary_factor":0.01"#));
    assert!(e.contains("partial_rotary_factor"), "{e}");
}

#[test]
fn unknown_fields_are_refused_at_both_levels() {
    let e = err(text(r#","linear_gate_bias":true"#));
    assert!(e.contains("linear_gate_bias"), "{e}");
    let e = err(wrapped(r#","mystery":1"#, ""));
    assert!(e.contains("mystery"), "{e}");
    let e = err(wrapped("", r#","audio_config":{"x":1}"#));
    assert!(e.contains("audio_config"), "{e}");
    let e = err(ModelConfig::from_json(
        r#"{"architectures":["Qwen3_5ForConditionalGeneration"],"model_type":"qwen3_5"}"#,
    ));
    assert!(e.contains("text_config"), "{e}");
    let e = err(text(r#","linear_num_value_heads":3"#));
    assert!(e.contains("linear_num_value_heads"), "{e}");
}

#[test]
fn written_back_and_read_again_it_is_the_same_model() {
    for c in [
        text(r#","attention_bias":true,"full_attention_interval":2"#).unwrap(),
        wrapped("", r#","tie_word_embeddings":true"#).unwrap(),
    ] {
        let back = ModelConfig::from_json(&c.to_hf_json().to_string()).unwrap();
        assert_eq!(back.hybrid, c.hybrid);
        assert_eq!(back.expected_tensors(), c.expected_tensors());
        assert_eq!(back.tie_word_embeddings, c.tie_word_embeddings);
        assert_eq!(back.qkv_bias, c.qkv_bias);
        assert_eq!(back.num_params(), c.num_params());
    }
}
