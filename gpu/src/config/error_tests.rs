//! Each rule of the reader refuses with its own variant, and says what it said when the
//! refusals were free text: for each rule, a file that breaks it, the variant (with the
//! values it holds) and the whole message.

use super::{ConfigError as E, PatternError};
use crate::config::testing::{llama, qwen2};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};

/// A refusal to hold against: the read, which variant it must be, and the message after
/// `model: config.json: `.
type Case = (Result<ModelConfig>, fn(&E) -> bool, &'static str);

/// Holds every case to its variant and its text, naming the case that fails.
fn check(cases: Vec<Case>) {
    for (i, (read, is, text)) in cases.into_iter().enumerate() {
        let e = read.expect_err("expected a refusal");
        assert_eq!(
            e.to_string(),
            format!("model: config.json: {text}"),
            "case {i}"
        );
        match e {
            EngineError::Config(c) => assert!(is(&c), "case {i}: {c:?}"),
            other => panic!("case {i}: not a config refusal: {other:?}"),
        }
    }
}

fn json(text: &str) -> Result<ModelConfig> {
    ModelConfig::from_json(text)
}

/// A small Qwen3_5ForCausalLM config with `extra` appended (`extra` starts with a comma).
fn hybrid(extra: &str) -> Result<ModelConfig> {
    json(&format!(
        r#"{{"architectures":["Qwen3_5ForCausalLM"],"model_type":"qwen3_5_text",
           "vocab_size":100,"hidden_size":64,"intermediate_size":128,"num_hidden_layers":8,
           "num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,
           "linear_num_key_heads":2,"linear_num_value_heads":4,"linear_key_head_dim":16,
           "linear_value_head_dim":8{extra}}}"#
    ))
}

/// The llama of `testing` with this `quantization_config`.
fn quantized(q: &str) -> Result<ModelConfig> {
    llama(&format!(r#","quantization_config":{q}"#))
}

/// Qwen's block-scaled fp8 config with `extra` appended.
fn fp8(extra: &str) -> Result<ModelConfig> {
    quantized(&format!(
        r#"{{"quant_method":"fp8","weight_block_size":[128,128]{extra}}}"#
    ))
}

/// A compressed-tensors config with one group `g` targeting `Linear` whose weights are
/// `weights`, and `extra` appended to the group.
fn ct(weights: &str, extra: &str) -> Result<ModelConfig> {
    quantized(&format!(
        r#"{{"quant_method":"compressed-tensors","format":"float-quantized",
           "quantization_status":"compressed",
           "config_groups":{{"g":{{"targets":["Linear"],"weights":{weights}{extra}}}}}}}"#
    ))
}

const CHANNEL: &str = r#"{"type":"float","strategy":"channel"}"#;

/// The families kvmesh runs, as every refusal of the family lists them.
macro_rules! supported {
    () => {
        "kvmesh runs LlamaForCausalLM (llama), Qwen2ForCausalLM (qwen2), Qwen3ForCausalLM \
         (qwen3), MistralForCausalLM (mistral), and Qwen3.5's text model: Qwen3_5ForCausalLM \
         (qwen3_5_text) or Qwen3_5ForConditionalGeneration (qwen3_5)"
    };
}

#[test]
fn the_file_and_its_fields() {
    check(vec![
        (
            json("[1]"),
            |e| matches!(e, E::NotAnObject),
            "expected a JSON object at the top level",
        ),
        (
            llama(r#","rms_norm_eps":"small""#),
            |e| matches!(e, E::Mistyped { field, expected: "a number", .. } if field == "rms_norm_eps"),
            r#"`rms_norm_eps` is "small"; expected a number"#,
        ),
        (
            json(
                r#"{"architectures":["LlamaForCausalLM"],"hidden_size":8,"num_attention_heads":1}"#,
            ),
            |e| matches!(e, E::Missing { field } if field == "num_hidden_layers"),
            "missing `num_hidden_layers`",
        ),
        (
            llama(r#","final_logit_softcapping":30.0"#),
            |e| {
                matches!(
                    e,
                    E::UnknownField {
                        model_type: "llama",
                        ..
                    }
                )
            },
            "`final_logit_softcapping` = 30.0 is not a field kvmesh knows for llama models, and \
             it may change the model's math, so the model is refused rather than run \
             differently from how it was trained. If it does not change the forward pass, \
             delete it from config.json",
        ),
        (
            llama(r#","compression_config":{"format":"pack-quantized"}"#),
            |e| matches!(e, E::QuantizedModel { method: Some(m), .. } if m == "\"pack-quantized\""),
            "the checkpoint is quantized (quant_method \"pack-quantized\"); kvmesh reads FP8 \
             `quantization_config`s (of Llama, Qwen2, Qwen3, Mistral and Qwen3.5 models) only, \
             and otherwise bf16, f16 and f32 weights",
        ),
        (
            llama(r#","compression_config":{"x":1}"#),
            |e| matches!(e, E::QuantizedModel { method: None, .. }),
            "the checkpoint is quantized ({\"x\":1}); kvmesh reads FP8 `quantization_config`s \
             (of Llama, Qwen2, Qwen3, Mistral and Qwen3.5 models) only, and otherwise bf16, f16 \
             and f32 weights",
        ),
        (
            llama(r#","is_encoder_decoder":true"#),
            |e| matches!(e, E::NotDecoderOnly { .. }),
            "`is_encoder_decoder` is true; kvmesh runs decoder-only models",
        ),
    ]);
    let e = json("{").unwrap_err();
    assert!(matches!(e, EngineError::Config(E::NotJson(_))), "{e:?}");
    assert_eq!(
        e.to_string(),
        "model: config.json: not valid JSON: EOF while parsing an object at line 1 column 1"
    );
}

#[test]
fn the_family() {
    check(vec![
        (
            json(r#"{"architectures":["GPT2LMHeadModel"],"model_type":"gpt2"}"#),
            |e| matches!(e, E::UnknownArchitecture { architecture, .. } if architecture == "GPT2LMHeadModel"),
            concat!(
                "unsupported architecture \"GPT2LMHeadModel\" (model_type \"gpt2\"); ",
                supported!()
            ),
        ),
        (
            json(r#"{"architectures":["A","B"]}"#),
            |e| matches!(e, E::SeveralArchitectures { names } if names.len() == 2),
            concat!(
                "`architectures` names several classes [\"A\", \"B\"]; a checkpoint for kvmesh \
                 names one: ",
                supported!()
            ),
        ),
        (
            json(r#"{"model_type":"gpt2"}"#),
            |e| matches!(e, E::UnknownModelType { architectures, .. } if architectures.is_empty()),
            concat!(
                "unsupported model_type \"gpt2\" (architectures []); ",
                supported!()
            ),
        ),
        (
            json(r#"{"architectures":["LlamaForCausalLM"],"model_type":"qwen2"}"#),
            |e| {
                matches!(
                    e,
                    E::FamilyMismatch {
                        architecture: "LlamaForCausalLM",
                        model_type: "qwen2"
                    }
                )
            },
            "`architectures` says LlamaForCausalLM but `model_type` says \"qwen2\"; transformers \
             builds the model from model_type, so the file is ambiguous: make them agree",
        ),
        (
            json("{}"),
            |e| matches!(e, E::NoFamily),
            concat!(
                "neither `architectures` nor `model_type` is set; ",
                supported!()
            ),
        ),
        (
            json(r#"{"architectures":[1]}"#),
            |e| matches!(e, E::ArchitectureNotAName { value } if value == "1"),
            "`architectures` holds 1; expected class names",
        ),
        (
            json(r#"{"architectures":"x"}"#),
            |e| {
                matches!(
                    e,
                    E::Mistyped {
                        expected: "a list of class names",
                        ..
                    }
                )
            },
            "`architectures` is \"x\"; expected a list of class names",
        ),
        (
            json(r#"{"architectures":["Qwen3_5MoeForCausalLM"]}"#),
            |e| matches!(e, E::MoeRefused { what } if what == "Qwen3_5MoeForCausalLM"),
            "Qwen3_5MoeForCausalLM is a Qwen3.5 mixture-of-experts model; kvmesh runs the dense \
             Qwen3.5 models (Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration) and does not \
             implement expert routing yet",
        ),
    ]);
}

#[test]
fn the_shape() {
    check(vec![
        (
            json(r#"{"model_type":"llama","hidden_size":0,"num_attention_heads":1}"#),
            |e| matches!(e, E::ZeroWidth),
            "zero hidden_size or num_attention_heads",
        ),
        (
            llama(r#","num_key_value_heads":3"#),
            |e| {
                matches!(
                    e,
                    E::KvHeads {
                        heads: 2,
                        kv_heads: 3
                    }
                )
            },
            "num_attention_heads 2 is not a multiple of num_key_value_heads 3",
        ),
        (
            llama(r#","head_dim":3"#),
            |e| matches!(e, E::HeadDim { head_dim: 3 }),
            "head_dim is 3; rotary embeddings need an even, non-zero head size",
        ),
        (
            llama(r#","hidden_act":"gelu""#),
            |e| matches!(e, E::Activation { act } if act == "gelu"),
            "`hidden_act` is \"gelu\"; the families kvmesh runs use silu (SwiGLU), and it \
             implements no other activation",
        ),
        (
            llama(r#","max_position_embeddings":0"#),
            |e| matches!(e, E::Zero { field } if field == "max_position_embeddings"),
            "`max_position_embeddings` is 0",
        ),
        (
            llama(r#","rms_norm_eps":-1"#),
            |e| matches!(e, E::RmsNormEps { eps } if *eps == -1.0),
            "`rms_norm_eps` is -1; expected a small positive number",
        ),
        (
            llama(r#","head_dim":2,"rope_scaling":{"type":"dynamic","factor":2}"#),
            |e| matches!(e, E::DynamicRopeHeadDim),
            "dynamic RoPE needs head_dim above 2",
        ),
        (
            qwen2(
                r#","use_sliding_window":true,"sliding_window":8,
                   "layer_types":["sliding_attention"]"#,
            ),
            |e| {
                matches!(
                    e,
                    E::LayerCount {
                        listed: 1,
                        num_layers: 2
                    }
                )
            },
            "`layer_types` lists 1 layers but num_hidden_layers is 2",
        ),
    ]);
}

#[test]
fn sliding_windows() {
    let mistral = r#"{"architectures":["MistralForCausalLM"],"vocab_size":10,"hidden_size":64,
        "intermediate_size":8,"num_hidden_layers":2,"num_attention_heads":4,
        "num_key_value_heads":2,"layer_types":["full_attention","sliding_attention"]}"#;
    check(vec![
        (
            json(mistral),
            |e| matches!(e, E::MistralLayerTypes { .. }),
            "`layer_types` is [\"full_attention\",\"sliding_attention\"] on a mistral model; \
             transformers' Mistral applies one window to every layer and ignores per-layer \
             types (those are Ministral's)",
        ),
        (
            qwen2(
                r#","use_sliding_window":false,
                   "layer_types":["sliding_attention","full_attention"]"#,
            ),
            |e| matches!(e, E::SlidingWithoutWindow { layer: 0 }),
            "`layer_types[0]` is sliding_attention but use_sliding_window is false; \
             transformers would then find no window size",
        ),
        (
            qwen2(r#","use_sliding_window":true,"sliding_window":null"#),
            |e| matches!(e, E::NoWindowSize),
            "use_sliding_window is true but `sliding_window` is null; name the window size",
        ),
        (
            qwen2(r#","sliding_window":0"#),
            |e| matches!(e, E::ZeroWindow),
            "`sliding_window` is 0; expected a window of at least 1 token",
        ),
        (
            qwen2(r#","layer_types":["full_attention","chunked_attention"]"#),
            |e| matches!(e, E::UnknownLayerType { layer: 1, .. }),
            "`layer_types[1]` is \"chunked_attention\"; kvmesh runs full_attention and \
             sliding_attention layers",
        ),
    ]);
    // transformers' Llama has no window, so the field is refused as unknown before the
    // window is read; the window's own refusal reads as it always did.
    let e = E::LlamaWindow {
        value: "4096".into(),
    };
    assert_eq!(
        e.to_string(),
        "`sliding_window` is 4096 on a llama model; Llama attends over the whole context \
         (transformers' Llama ignores the field, so a window here means the checkpoint is \
         something else)"
    );
}

#[test]
fn qwen35_layouts_and_moe() {
    check(vec![
        (
            json(r#"{"model_type":"qwen3_5"}"#),
            |e| matches!(e, E::NoTextConfig),
            "model_type is \"qwen3_5\" (Qwen3_5ForConditionalGeneration) but there is no \
             `text_config`; that class keeps the text model's fields there",
        ),
        (
            json(r#"{"model_type":"qwen3_5_text","text_config":{}}"#),
            |e| matches!(e, E::NestedTextConfig),
            "model_type is \"qwen3_5_text\" (Qwen3_5ForCausalLM, fields at the top level) but \
             the file nests a `text_config`; make them agree",
        ),
        (
            json(r#"{"model_type":"qwen3_5","text_config":{"model_type":"llama"}}"#),
            |e| matches!(e, E::TextModelType { model_type } if model_type == "llama"),
            "`text_config.model_type` is \"llama\"; a Qwen3.5 checkpoint's text model is \
             \"qwen3_5_text\"",
        ),
        (
            json(r#"{"model_type":"qwen3_5","text_config":{},"audio_config":{"x":1}}"#),
            |e| matches!(e, E::UnknownWrapperField { field, .. } if field == "audio_config"),
            "`audio_config` = {\"x\":1} is not a field kvmesh knows at the top level of a \
             Qwen3_5ForConditionalGeneration config (it reads `text_config`), and it may change \
             the model's math, so the model is refused",
        ),
        (
            json(
                r#"{"architectures":["Qwen3_5ForConditionalGeneration"],
                   "model_type":"qwen3_5_text"}"#,
            ),
            |e| {
                matches!(
                    e,
                    E::LayoutMismatch {
                        fields: "at the top level",
                        ..
                    }
                )
            },
            "`architectures` names Qwen3_5ForConditionalGeneration but the file has the layout \
             Qwen3_5ForCausalLM writes (fields at the top level); make them agree",
        ),
        (
            hybrid(r#","num_experts":256"#),
            |e| matches!(e, E::MoeRefused { .. }),
            "`num_experts` = 256: this is a Qwen3.5 mixture-of-experts model; kvmesh runs the \
             dense Qwen3.5 models (Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration) and \
             does not implement expert routing yet",
        ),
        (
            hybrid(r#","quantization_config":{"quant_method":"awq"}"#),
            |e| matches!(e, E::UnknownQuantMethod { method } if method == "awq"),
            "the checkpoint is quantized with quantization_config.quant_method \"awq\"; kvmesh \
             reads FP8 checkpoints in the formats \"fp8\" (block-scaled) and \
             \"compressed-tensors\" (float8), and runs no other quantization",
        ),
    ]);
}

#[test]
fn qwen35_layers_gates_and_rope() {
    let eight = r#","layer_types":["linear_attention","linear_attention","linear_attention",
        "full_attention","linear_attention","linear_attention","linear_attention",
        "full_attention"]"#;
    check(vec![
        (
            hybrid(r#","attn_output_gate":false"#),
            |e| matches!(e, E::UngatedAttention),
            "`attn_output_gate` is false; Qwen3.5's full-attention layers always gate their \
             output (q_proj holds the gate), and kvmesh implements no ungated variant",
        ),
        (
            hybrid(r#","output_gate_type":"sigmoid""#),
            |e| matches!(e, E::OutputGate { gate } if gate == "sigmoid"),
            "`output_gate_type` is \"sigmoid\"; the linear layers' norm is gated by swish \
             (SiLU) in Qwen3.5, and kvmesh implements no other gate",
        ),
        (
            hybrid(r#","mamba_ssm_dtype":"bfloat16""#),
            |e| matches!(e, E::StateDtype { dtype } if dtype == "bfloat16"),
            "`mamba_ssm_dtype` is \"bfloat16\"; kvmesh keeps the recurrent (delta rule) state \
             in float32, and a state kept in another dtype would give other numbers",
        ),
        (
            hybrid(r#","partial_rotary_factor":0.01"#),
            |e| {
                matches!(
                    e,
                    E::RotaryDim {
                        head_dim: 32,
                        rotary_dim: 0,
                        ..
                    }
                )
            },
            "`partial_rotary_factor` 0.01 of head_dim 32 rotates 0 dimensions; RoPE needs an \
             even, non-zero number",
        ),
        (
            hybrid(r#","linear_num_value_heads":3"#),
            |e| {
                matches!(
                    e,
                    E::LinearHeads {
                        value_heads: 3,
                        key_heads: 2
                    }
                )
            },
            "linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2; each key \
             head serves a whole number of value heads",
        ),
        (
            hybrid(r#","linear_conv_kernel_dim":0"#),
            |e| matches!(e, E::Zero { field } if field == "linear_conv_kernel_dim"),
            "`linear_conv_kernel_dim` is 0",
        ),
        (
            hybrid(r#","full_attention_interval":0"#),
            |e| matches!(e, E::ZeroLayerInterval),
            "`full_attention_interval` is 0",
        ),
        (
            hybrid(r#","layer_types":["x"]"#),
            |e| matches!(e, E::UnknownHybridLayerType { layer: 0, .. }),
            "`layer_types[0]` is \"x\"; Qwen3.5 layers are \"linear_attention\" (Gated \
             DeltaNet) or \"full_attention\", and kvmesh implements no other",
        ),
        (
            hybrid(r#","layer_types":["full_attention"]"#),
            |e| {
                matches!(
                    e,
                    E::LayerCount {
                        listed: 1,
                        num_layers: 8
                    }
                )
            },
            "`layer_types` lists 1 layers but num_hidden_layers is 8",
        ),
        (
            hybrid(&format!(r#"{eight},"full_attention_interval":2"#)),
            |e| matches!(e, E::IntervalMismatch { interval: 2 }),
            "`layer_types` and `full_attention_interval` = 2 describe different layers; \
             transformers follows layer_types and ignores the interval, so the file is \
             ambiguous: make them agree or drop one",
        ),
        (
            hybrid(r#","rope_parameters":{"rope_type":"default","mrope_section":[1]}"#),
            |e| matches!(e, E::Mistyped { field, .. } if field == "rope_parameters.mrope_section"),
            "`rope_parameters.mrope_section` is [1]; expected three non-negative integers",
        ),
        (
            hybrid(
                r#","rope_parameters":{"rope_type":"default","partial_rotary_factor":0.5},
                   "partial_rotary_factor":0.25"#,
            ),
            |e| matches!(e, E::PartialRotaryDisagrees { dict, top } if *dict == 0.5 && *top == 0.25),
            "`rope_parameters.partial_rotary_factor` is 0.5 but the top-level one is 0.25; make \
             them agree",
        ),
        (
            hybrid(r#","partial_rotary_factor":1.5"#),
            |e| matches!(e, E::PartialRotaryRange { value, .. } if value == "1.5"),
            "`partial_rotary_factor` is 1.5; expected a fraction in (0, 1]",
        ),
        (
            hybrid(r#","rope_parameters":{"rope_type":"linear","factor":2}"#),
            |e| {
                matches!(
                    e,
                    E::HybridRopeType {
                        rope_type: "linear"
                    }
                )
            },
            "rope type `linear` on a Qwen3.5 model; kvmesh runs Qwen3.5 with plain (default) \
             RoPE on the rotated part of each head",
        ),
    ]);
}

#[test]
fn rope() {
    check(vec![
        (
            llama(
                r#","rope_parameters":{"rope_type":"default"},"rope_scaling":{"type":"default"}"#,
            ),
            |e| matches!(e, E::BothRopeLayouts { .. }),
            "both `rope_parameters` ({\"rope_type\":\"default\"}) and the legacy `rope_scaling` \
             ({\"type\":\"default\"}) are set; transformers would take rope_scaling and drop \
             rope_parameters, which is rarely what was meant. Keep one: move rope_scaling's \
             fields into rope_parameters",
        ),
        (
            llama(r#","rope_scaling":{"type":"linear","factor":"2"}"#),
            |e| matches!(e, E::Mistyped { field, .. } if field == "rope_scaling.factor"),
            "`rope_scaling.factor` is \"2\"; expected a number",
        ),
        (
            llama(r#","rope_scaling":{"type":"longrope"}"#),
            |e| matches!(e, E::UnknownRopeType { dict: "rope_scaling", rope_type } if rope_type == "longrope"),
            "`rope_scaling` has rope type \"longrope\", which kvmesh does not implement; \
             supported: default, linear, dynamic, llama3, yarn",
        ),
        (
            llama(r#","rope_parameters":{"full_attention":{"rope_type":"default"}}"#),
            |e| matches!(e, E::NestedRope { key, .. } if key == "full_attention"),
            "`rope_parameters.full_attention` is a nested RoPE dict (RoPE per layer type); the \
             families kvmesh runs use one RoPE for every layer",
        ),
        (
            llama(r#","rope_parameters":{"rope_type":"default","factor":2}"#),
            |e| {
                matches!(
                    e,
                    E::ForeignRopeParam {
                        rope_type: "default",
                        takes: [],
                        ..
                    }
                )
            },
            "`rope_parameters.factor` = 2 is not a parameter of rope type `default` (it takes: \
             rope_theta only); kvmesh will not guess what it means",
        ),
        (
            llama(r#","rope_parameters":{"rope_type":"linear","factor":2,"beta_fast":3}"#),
            |e| {
                matches!(
                    e,
                    E::ForeignRopeParam {
                        takes: ["factor"],
                        ..
                    }
                )
            },
            "`rope_parameters.beta_fast` = 3 is not a parameter of rope type `linear` (it \
             takes: factor); kvmesh will not guess what it means",
        ),
        (
            llama(r#","rope_theta":1000,"rope_parameters":{"rope_theta":2000}"#),
            |e| {
                matches!(
                    e,
                    E::ThetaDisagrees {
                        dict: "rope_parameters",
                        ..
                    }
                )
            },
            "`rope_parameters.rope_theta` is 2000 but the top-level `rope_theta` is 1000; make \
             them agree",
        ),
        (
            llama(r#","rope_theta":0.5"#),
            |e| matches!(e, E::RopeTheta { theta } if *theta == 0.5),
            "`rope_theta` is 0.5; expected a number above 1",
        ),
        (
            llama(r#","rope_scaling":{"type":"linear","rope_type":"dynamic","factor":2}"#),
            |e| matches!(e, E::RopeTypeDisagrees { rope_type, legacy_type, .. } if rope_type == "dynamic" && legacy_type == "linear"),
            "`rope_scaling.rope_type` is \"dynamic\" but `rope_scaling.type` is \"linear\"; make \
             them agree",
        ),
        (
            llama(r#","partial_rotary_factor":0.5"#),
            |e| matches!(e, E::PartialRotary { factor } if *factor == 0.5),
            "`partial_rotary_factor` is 0.5: RoPE on part of each head is not how Llama, Qwen2, \
             Qwen3 or Mistral models work, and kvmesh rotates whole heads",
        ),
    ]);
}

#[test]
fn rope_parameters_of_each_type() {
    check(vec![
        (
            llama(r#","rope_scaling":{"type":"linear"}"#),
            |e| {
                matches!(
                    e,
                    E::MissingRopeParam {
                        rope_type: "linear",
                        key: "factor",
                        ..
                    }
                )
            },
            "`rope_scaling` is rope type `linear` but has no `factor`, which that type requires",
        ),
        (
            llama(r#","rope_scaling":{"type":"linear","factor":0.5}"#),
            |e| {
                matches!(
                    e,
                    E::RopeFactor {
                        rope_type: "linear",
                        ..
                    }
                )
            },
            "`rope_scaling.factor` is 0.5; rope type `linear` needs a factor of 1 or more",
        ),
        (
            llama(
                r#","original_max_position_embeddings":16,
                   "rope_scaling":{"type":"yarn","factor":2,"original_max_position_embeddings":32}"#,
            ),
            |e| matches!(e, E::OriginalDisagrees { dict_value, top, .. } if *dict_value == 32.0 && *top == 16.0),
            "`rope_scaling.original_max_position_embeddings` is 32 but the top-level one is 16; \
             make them agree",
        ),
        (
            llama(
                r#","rope_scaling":{"type":"llama3","factor":8,"low_freq_factor":4,
                   "high_freq_factor":1}"#,
            ),
            |e| matches!(e, E::Llama3Freqs { low, high, .. } if *low == 4.0 && *high == 1.0),
            "`rope_scaling`: llama3 needs 0 < low_freq_factor < high_freq_factor, got 4 and 1",
        ),
        (
            llama(
                r#","rope_scaling":{"type":"yarn","factor":2,
                   "original_max_position_embeddings":0}"#,
            ),
            |e| matches!(e, E::YarnOriginal { .. }),
            "`rope_scaling.original_max_position_embeddings` is 0; expected a positive length",
        ),
        (
            llama(r#","rope_scaling":{"type":"yarn","factor":2,"attention_factor":-1}"#),
            |e| matches!(e, E::YarnAttentionFactor { factor, .. } if *factor == -1.0),
            "`rope_scaling.attention_factor` is -1; expected a positive number",
        ),
    ]);
    // Every entry of a dict deserializes, so serde's own refusal is not reached from a file.
    let error = serde_json::from_str::<u8>("x").unwrap_err();
    let text = format!("`rope_scaling`: {error}");
    let e = E::RopeDict {
        dict: "rope_scaling",
        error,
    };
    assert_eq!(e.to_string(), text);
}

#[test]
fn quantization_config_of_either_method() {
    check(vec![
        (
            quantized("3"),
            |e| matches!(e, E::Mistyped { field, .. } if field == "quantization_config"),
            "`quantization_config` is 3; expected an object",
        ),
        (
            quantized(r#"{"quant_method":"awq"}"#),
            |e| matches!(e, E::UnknownQuantMethod { method } if method == "awq"),
            "the checkpoint is quantized with quantization_config.quant_method \"awq\"; kvmesh \
             reads FP8 checkpoints in the formats \"fp8\" (block-scaled) and \
             \"compressed-tensors\" (float8), and runs no other quantization",
        ),
        (
            quantized(r#"{"bits":4}"#),
            |e| matches!(e, E::NoQuantMethod { .. }),
            "quantization_config has no quant_method ({\"bits\":4}); cannot tell how the \
             weights are stored",
        ),
        (
            fp8(r#","foo":1"#),
            |e| matches!(e, E::UnknownQuantField { format: "fp8", .. }),
            "quantization_config.foo is 1: not a field of the fp8 format kvmesh knows, and it \
             may change how the weights are read; refused rather than ignored",
        ),
        (
            fp8(r#","fmt":"e5m2""#),
            |e| matches!(e, E::Quant { field, .. } if field == "fmt"),
            "quantization_config.fmt is \"e5m2\": kvmesh reads e4m3 FP8 weights only",
        ),
        (
            fp8(r#","activation_scheme":"static""#),
            |e| matches!(e, E::StaticActivations { .. }),
            "quantization_config.activation_scheme is \"static\": static activation scales \
             (`activation_scale` tensors) are not read by kvmesh yet; it reads the dynamic \
             scheme",
        ),
        (
            fp8(r#","activation_scheme":"x""#),
            |e| matches!(e, E::UnknownActivationScheme { value } if value == "\"x\""),
            "quantization_config.activation_scheme is \"x\": expected \"dynamic\"",
        ),
        (
            quantized(r#"{"quant_method":"fp8"}"#),
            |e| matches!(e, E::NoBlockSize),
            "quantization_config.weight_block_size is absent: a per-tensor fp8 checkpoint; \
             kvmesh reads the block-scaled one ([128, 128])",
        ),
        (
            quantized(r#"{"quant_method":"fp8","weight_block_size":[64,64]}"#),
            |e| matches!(e, E::BlockSize { value } if value == "[64,64]"),
            "quantization_config.weight_block_size is [64,64]: kvmesh reads 128x128 blocks, the \
             size published checkpoints and the FP8 GEMMs' block scales use",
        ),
        (
            fp8(r#","modules_to_not_convert":["a"],"ignored_layers":["b"]"#),
            |e| matches!(e, E::SkipListsDisagree { .. }),
            "quantization_config gives both modules_to_not_convert [\"a\"] and ignored_layers \
             [\"b\"] and they differ; transformers reads only the first, so which layers stay \
             unquantized is ambiguous",
        ),
        (
            fp8(r#","modules_to_not_convert":[1]"#),
            |e| {
                matches!(
                    e,
                    E::Quant {
                        why: "every entry must be a string",
                        ..
                    }
                )
            },
            "quantization_config.modules_to_not_convert is [1]: every entry must be a string",
        ),
        (
            ct("{}", r#","output_activations":{"num_bits":8}"#),
            |e| matches!(e, E::Quant { field, .. } if field == "config_groups.g.output_activations"),
            "quantization_config.config_groups.g.output_activations is {\"num_bits\":8}: \
             quantized outputs are not run by kvmesh",
        ),
    ]);
}

#[test]
fn compressed_tensors_schemes() {
    let ct_top = |extra: &str| {
        quantized(&format!(
            r#"{{"quant_method":"compressed-tensors","format":"float-quantized",
               "quantization_status":"compressed","config_groups":{{"g":{{"targets":["Linear"],
               "weights":{CHANNEL}}}}}{extra}}}"#
        ))
    };
    check(vec![
        (
            ct_top(r#","kv_cache_scheme":{"num_bits":8}"#),
            |e| matches!(e, E::KvCacheScheme { .. }),
            "quantization_config.kv_cache_scheme is {\"num_bits\":8}: kvmesh keeps the KV cache \
             in bf16 (f32 on the CPU) and reads no KV-cache scales",
        ),
        (
            ct_top(r#","foo":1"#),
            |e| {
                matches!(
                    e,
                    E::UnknownQuantField {
                        format: "compressed-tensors",
                        ..
                    }
                )
            },
            "quantization_config.foo is 1: not a field of the compressed-tensors format kvmesh \
             knows, and it may change how the weights are read; refused rather than ignored",
        ),
        (
            ct(CHANNEL, r#","foo":1"#),
            |e| matches!(e, E::UnknownSchemeField { field, .. } if field == "config_groups.g.foo"),
            "quantization_config.config_groups.g.foo is 1: not a scheme field kvmesh knows",
        ),
        (
            ct(r#"{"type":"float","foo":1}"#, ""),
            |e| matches!(e, E::UnknownQuantArgument { .. }),
            "quantization_config.config_groups.g.weights.foo is 1: not an argument kvmesh knows",
        ),
        (
            ct(r#"{"type":"float","strategy":"block"}"#, ""),
            |e| matches!(e, E::WeightStrategy { strategy, dynamic: false, .. } if strategy == "block"),
            "quantization_config.config_groups.g.weights has strategy \"block\" with dynamic \
             false: kvmesh reads static per-channel and per-tensor FP8 weight scales",
        ),
        (
            ct(
                CHANNEL,
                r#","input_activations":{"type":"float","strategy":"channel","dynamic":true}"#,
            ),
            |e| matches!(e, E::ActivationStrategy { dynamic: true, .. }),
            "quantization_config.config_groups.g.input_activations has strategy \"channel\" \
             with dynamic true: kvmesh reads dynamic per-token, dynamic per-tensor and static \
             per-tensor FP8 activations",
        ),
        (
            ct(r#"{"type":"int"}"#, ""),
            |e| matches!(e, E::Quant { field, .. } if field == "config_groups.g.weights.type"),
            "quantization_config.config_groups.g.weights.type is \"int\": kvmesh reads float \
             (e4m3) quantization, not int",
        ),
        (
            quantized(&format!(
                r#"{{"quant_method":"compressed-tensors","format":"float-quantized",
                   "config_groups":{{"g":{{"weights":{CHANNEL}}}}}}}"#
            )),
            |e| matches!(e, E::NoQuantizationStatus),
            "quantization_config.quantization_status is absent; kvmesh reads checkpoints saved \
             \"compressed\"",
        ),
    ]);
}

#[test]
fn compressed_tensors_targets() {
    let groups = |g: &str| {
        quantized(&format!(
            r#"{{"quant_method":"compressed-tensors","format":"float-quantized",
               "quantization_status":"compressed","config_groups":{g}}}"#
        ))
    };
    check(vec![
        (
            groups(&format!(r#"{{"g":{{"weights":{CHANNEL}}}}}"#)),
            |e| matches!(e, E::NoTargets { group } if group == "config_groups.g"),
            "quantization_config.config_groups.g has no targets",
        ),
        (
            groups(r#"{"g":{"targets":["Linear"]}}"#),
            |e| matches!(e, E::NoWeights { group } if group == "config_groups.g"),
            "quantization_config.config_groups.g quantizes no weights; kvmesh reads FP8 weights",
        ),
        (
            groups(r#"{"FP8":["LlamaDecoderLayer"]}"#),
            |e| {
                matches!(
                    e,
                    E::UnreadablePattern { why: PatternError::ClassTarget(c), .. }
                        if c == "LlamaDecoderLayer"
                )
            },
            "quantization_config.config_groups.FP8 is \"LlamaDecoderLayer\": class target \
             \"LlamaDecoderLayer\": kvmesh matches the class `Linear`, module names and `re:` \
             regexes",
        ),
        (
            groups(&format!(
                r#"{{"a":{{"targets":["Linear"],"weights":{CHANNEL}}},
                   "b":{{"targets":["re:model.layers.0.*"],"weights":{{"type":"float"}}}}}}"#
            )),
            |e| matches!(e, E::AmbiguousLayer { targets, .. } if targets.len() == 2),
            "quantization_config: layer model.layers.0.self_attn.q_proj is targeted by config \
             groups with different schemes (targets [\"Linear\", \"re:model.layers.0.*\"]); \
             which applies is ambiguous",
        ),
    ]);
    // A regex neither format can read: the reason is the regex crate's, after the phrase.
    for (read, start) in [
        (
            fp8(r#","ignored_layers":["("]"#),
            "quantization_config.ignored_layers is \"(\": kvmesh cannot read it as the regex \
             transformers matches it as (regex parse error:",
        ),
        (
            groups(&format!(
                r#"{{"g":{{"targets":["Linear"],"weights":{CHANNEL}}}}},"ignore":["re:("]"#
            )),
            "quantization_config.ignore is \"re:(\": kvmesh cannot read it as the regex \
             compressed-tensors matches (regex parse error:",
        ),
    ] {
        let e = read.unwrap_err();
        let text = e.to_string();
        assert!(
            text.starts_with(&format!("model: config.json: {start}")),
            "{text}"
        );
        assert!(
            matches!(e, EngineError::Config(E::UnreadablePattern { .. })),
            "{e:?}"
        );
    }
}

#[test]
fn a_refusal_is_the_engine_error_without_a_source() {
    use std::error::Error;
    let e = llama(r#","hidden_act":"gelu""#).unwrap_err();
    // Its text is the message already: a chain would print it twice.
    assert!(e.source().is_none());
    let direct = EngineError::from(E::ZeroWidth);
    assert_eq!(
        direct.to_string(),
        "model: config.json: zero hidden_size or num_attention_heads"
    );
}
