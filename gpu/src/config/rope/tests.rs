use crate::config::testing::{err, llama, qwen2};
use crate::config::{ModelConfig, RopeLayout, RopeScaling};

#[test]
fn both_layouts_give_the_same_rope() {
    let cur = llama(
        r#","rope_parameters":{"rope_type":"llama3","rope_theta":500000.0,"factor":8.0,
           "low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":16}"#,
    )
    .unwrap();
    let old = llama(
        r#","rope_theta":500000.0,"rope_scaling":{"type":"llama3","factor":8.0,
           "low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":16}"#,
    )
    .unwrap();
    assert_eq!(cur.rope.layout, RopeLayout::Parameters);
    assert_eq!(old.rope.layout, RopeLayout::Legacy);
    assert_eq!(cur.rope.theta, 500000.0);
    assert_eq!(cur.rope.scaling, old.rope.scaling);
    assert_eq!(cur.rope_inv_freq(), old.rope_inv_freq());
    // The current layout is what gets written, and reads back the same.
    let back = ModelConfig::from_json(&cur.to_hf_json().to_string()).unwrap();
    assert_eq!(back.rope, cur.rope);
}

#[test]
fn rope_parameters_theta_is_not_ignored() {
    // The bug this file once had: theta read only from the top level.
    let c = llama(r#","rope_parameters":{"rope_type":"default","rope_theta":1000000.0}"#).unwrap();
    assert_eq!(c.rope.theta, 1_000_000.0);
    assert_eq!(c.rope_inv_freq()[1], 1e6f64.powf(-2.0 / 64.0) as f32);
}

#[test]
fn unknown_rope_type_is_refused_by_name() {
    let e = err(llama(
        r#","rope_scaling":{"rope_type":"longrope","factor":2.0}"#,
    ));
    assert!(e.contains("longrope") && e.contains("yarn"), "{e}");
    let e = err(llama(
        r#","rope_parameters":{"rope_type":"su","rope_theta":1e4}"#,
    ));
    assert!(e.contains("\"su\""), "{e}");
}

#[test]
fn rope_parameter_of_another_type_is_refused() {
    let e = err(llama(
        r#","rope_scaling":{"type":"linear","factor":2.0,"beta_fast":8}"#,
    ));
    assert!(
        e.contains("rope_scaling.beta_fast") && e.contains("linear"),
        "{e}"
    );
}

#[test]
fn missing_required_rope_parameter_is_refused() {
    let e = err(llama(r#","rope_scaling":{"type":"linear"}"#));
    assert!(e.contains("factor"), "{e}");
    let e = err(llama(
        r#","rope_scaling":{"rope_type":"llama3","factor":8.0}"#,
    ));
    assert!(e.contains("low_freq_factor"), "{e}");
}

#[test]
fn contradictory_rope_settings_are_refused() {
    let e = err(llama(
        r#","rope_theta":10000.0,"rope_parameters":{"rope_type":"default","rope_theta":500000.0}"#,
    ));
    assert!(e.contains("rope_theta") && e.contains("500000"), "{e}");
    let e = err(llama(
        r#","rope_parameters":{"rope_type":"default","rope_theta":1e4},"rope_scaling":{"type":"linear","factor":2.0}"#,
    ));
    assert!(
        e.contains("rope_parameters") && e.contains("rope_scaling"),
        "{e}"
    );
    let e = err(llama(
        r#","rope_scaling":{"type":"linear","rope_type":"dynamic","factor":2.0}"#,
    ));
    assert!(e.contains("linear") && e.contains("dynamic"), "{e}");
}

#[test]
fn partial_rotary_factor_is_refused() {
    let e = err(llama(r#","partial_rotary_factor":0.5"#));
    assert!(
        e.contains("partial_rotary_factor") && e.contains("0.5"),
        "{e}"
    );
    llama(r#","partial_rotary_factor":1.0"#).unwrap();
}

#[test]
fn yarn_null_factor_is_the_ratio_of_context_lengths_and_absent_is_refused() {
    // qwen2's max_position_embeddings defaults to 32768.
    let c = qwen2(
        r#","rope_scaling":{"type":"yarn","factor":null,"original_max_position_embeddings":32}"#,
    )
    .unwrap();
    assert!(matches!(c.rope.scaling, RopeScaling::Yarn { factor, .. } if factor == 1024.0));
    let e = err(qwen2(
        r#","rope_scaling":{"type":"yarn","original_max_position_embeddings":32}"#,
    ));
    assert!(e.contains("has no `factor`"), "{e}");
}

#[test]
fn yarn_defaults_follow_transformers() {
    let c = qwen2(
        r#","rope_parameters":{"rope_type":"yarn","factor":4,"original_max_position_embeddings":32,
           "beta_fast":0,"beta_slow":null}"#,
    )
    .unwrap();
    let RopeScaling::Yarn {
        factor,
        beta_fast,
        beta_slow,
        truncate,
        ..
    } = c.rope.scaling
    else {
        panic!("{:?}", c.rope.scaling);
    };
    assert_eq!(
        (factor, beta_fast, beta_slow, truncate),
        (4.0, 32.0, 1.0, true)
    );
}

#[test]
fn top_level_original_max_position_embeddings_is_read_and_must_agree() {
    let dict = r#""rope_scaling":{"type":"llama3","factor":8.0,"low_freq_factor":1.0,
        "high_freq_factor":4.0"#;
    let c = llama(&format!(
        r#",{dict}}},"original_max_position_embeddings":16"#
    ))
    .unwrap();
    assert!(matches!(
        c.rope.scaling,
        RopeScaling::Llama3 { original_max_position_embeddings, .. }
            if original_max_position_embeddings == 16.0
    ));
    let e = err(llama(&format!(
        r#",{dict},"original_max_position_embeddings":8}},"original_max_position_embeddings":16"#
    )));
    assert!(e.contains("top-level one is 16"), "{e}");
}

#[test]
fn mistyped_entries_are_named_with_their_dict() {
    let e = err(llama(r#","rope_parameters":{"rope_type":5}"#));
    assert!(
        e.contains("`rope_parameters.rope_type` is 5; expected a string"),
        "{e}"
    );
    let e = err(qwen2(
        r#","rope_scaling":{"type":"yarn","factor":2.0,"truncate":"yes"}"#,
    ));
    assert!(
        e.contains(r#"`rope_scaling.truncate` is "yes"; expected true or false"#),
        "{e}"
    );
    // The same type under both names is no contradiction.
    llama(r#","rope_scaling":{"type":"linear","rope_type":"linear","factor":2.0}"#).unwrap();
}

#[test]
fn nested_rope_dicts_are_refused() {
    let e = err(llama(
        r#","rope_parameters":{"full_attention":{"rope_type":"default","rope_theta":1e4}}"#,
    ));
    assert!(
        e.contains("`rope_parameters.full_attention` is a nested RoPE dict"),
        "{e}"
    );
}
