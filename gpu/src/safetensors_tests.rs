//! The safetensors reader and writers: what is refused, what round-trips.

use super::*;

#[test]
fn round_trips_each_dtype() {
    let dir = std::env::temp_dir().join(format!("kvmesh-st-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let p = dir.join("model.safetensors");
        let data = vec![1.0f32, -2.5, 0.125, 3.0, 4.0, 5.0];
        write_file(&p, &[("a.weight".into(), vec![2, 3], data.clone())], dtype).unwrap();
        let w = WeightStore::open_dir(&dir).unwrap();
        assert_eq!(w.f32("a.weight", &[2, 3]).unwrap(), data);
        assert!(w
            .f32("a.weight", &[3, 2])
            .unwrap_err()
            .to_string()
            .contains("shape"));
        assert!(w
            .f32("b.weight", &[1])
            .unwrap_err()
            .to_string()
            .contains("missing"));
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The nearest e4m3 code by search over every finite magnitude, ties to the even code,
/// saturating at 448: what `f32_to_e4m3` must equal.
fn e4m3_by_search(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs().min(448.0);
    let mut best = 0u8;
    for code in 1u8..0x7f {
        let (d, db) = ((e4m3_to_f32(code) - a).abs(), (e4m3_to_f32(best) - a).abs());
        if d < db || (d == db && code & 1 == 0) {
            best = code;
        }
    }
    sign | best
}

#[test]
fn e4m3_rounding_equals_a_search_over_every_code() {
    let mut xs: Vec<f32> = (0..=u16::MAX)
        .map(|b| f32::from_bits((b as u32) << 16))
        .filter(|x| !x.is_nan())
        .collect();
    // Every midpoint between neighbouring codes, and just either side of it.
    for code in 0u8..0x7e {
        let m = (e4m3_to_f32(code) + e4m3_to_f32(code + 1)) / 2.0;
        for x in [m, m.next_down(), m.next_up()] {
            xs.extend([x, -x]);
        }
    }
    let mut rng = crate::sampler::Rng::seeded(7);
    xs.extend((0..200_000).map(|_| ((rng.next_f64() - 0.5) * 1000.0) as f32));
    for x in xs {
        assert_eq!(f32_to_e4m3(x), e4m3_by_search(x), "{x:e}");
    }
}

#[test]
fn e4m3_bytes_mean_what_float8_e4m3fn_means() {
    for (b, v) in [
        (0x00u8, 0.0f32),
        (0x01, 2f32.powi(-9)),
        (0x07, 7.0 * 2f32.powi(-9)),
        (0x08, 2f32.powi(-6)),
        (0x38, 1.0),
        (0x3c, 1.5),
        (0x40, 2.0),
        (0x7e, 448.0),
        (0xb8, -1.0),
        (0xfe, -448.0),
    ] {
        assert_eq!(e4m3_to_f32(b), v, "{b:#04x}");
    }
    assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
    // 0x78..0x7e are finite: the format has no infinities.
    assert_eq!(e4m3_to_f32(0x78), 256.0);
    // Every finite byte encodes back to itself; in between, the nearest, ties to even.
    for b in (0..=255u8).filter(|b| b & 0x7f != 0x7f && *b != 0x80) {
        assert_eq!(f32_to_e4m3(e4m3_to_f32(b)), b, "{b:#04x}");
    }
    assert_eq!(f32_to_e4m3(1.0625), 0x38, "a tie goes to the even mantissa");
    assert_eq!(f32_to_e4m3(1.1), 0x39);
    assert_eq!(f32_to_e4m3(1000.0), 0x7e, "saturates");
    assert_eq!(f32_to_e4m3(-1000.0), 0xfe);
}

#[test]
fn fp8_tensors_are_read_only_as_fp8_and_e5m2_is_refused() {
    let dir = std::env::temp_dir().join(format!("kvmesh-st-f8-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let vals = vec![1.0f32, -0.5, 448.0, 0.0];
    let t = ("w".to_string(), vec![2, 2], vals.clone(), DType::F8E4M3);
    write_file_typed(&dir.join("model.safetensors"), &[t]).unwrap();
    let w = WeightStore::open_dir(&dir).unwrap();
    assert_eq!(w.info("w").unwrap().dtype, DType::F8E4M3);
    assert_eq!(w.f8_e4m3("w", &[2, 2]).unwrap(), vals);
    let e = w.f32("w", &[2, 2]).err().unwrap().to_string();
    assert!(
        e.contains("F8_E4M3") && e.contains("quantization_config"),
        "{e}"
    );
    assert!(w.f8_e4m3("w", &[4]).is_err());
    std::fs::remove_dir_all(&dir).ok();
    let e = refused(
        r#"{"a":{"dtype":"F8_E5M2","shape":[1],"data_offsets":[0,1]}}"#,
        1,
    );
    assert!(e.contains("F8_E5M2") && e.contains("F8_E4M3 only"), "{e}");
    let e = refused(
        r#"{"a":{"dtype":"I8","shape":[1],"data_offsets":[0,1]}}"#,
        1,
    );
    assert!(e.contains("I8"), "{e}");
}

/// A safetensors file from a header written by hand and `data` bytes.
fn parse(header: &str, data: usize) -> Result<WeightStore> {
    let mut buf = (header.len() as u64).to_le_bytes().to_vec();
    buf.extend_from_slice(header.as_bytes());
    buf.extend((0..data).map(|i| i as u8));
    WeightStore::from_static("t.safetensors", Box::leak(buf.into_boxed_slice()))
}

fn entry(name: &str, shape: &[usize], start: usize, end: usize) -> String {
    format!(r#""{name}":{{"dtype":"F32","shape":{shape:?},"data_offsets":[{start},{end}]}}"#)
}

fn refused(header: &str, data: usize) -> String {
    match parse(header, data) {
        Ok(_) => panic!("accepted {header}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn overlapping_tensors_are_refused_naming_both() {
    // Adjacent ranges and zero-length tensors anywhere in range are fine.
    let ok = format!(
        "{{{},{},{},{}}}",
        entry("a", &[2], 0, 8),
        entry("b", &[1], 8, 12),
        entry("empty", &[0], 4, 4),
        entry("none", &[2, 0], 12, 12),
    );
    let w = parse(&ok, 12).unwrap();
    assert_eq!(w.names(), ["a", "b", "empty", "none"]);
    assert_eq!(w.stored_bytes(), 12);
    for (header, pair) in [
        // the same bytes twice
        (
            format!("{{{},{}}}", entry("a", &[2], 0, 8), entry("b", &[2], 0, 8)),
            ("a", "b"),
        ),
        // a partial overlap, listed out of order
        (
            format!(
                "{{{},{}}}",
                entry("late", &[2], 4, 12),
                entry("early", &[2], 0, 8)
            ),
            ("early", "late"),
        ),
        // one range inside a longer one, beyond a third that ends later than neither
        (
            format!(
                "{{{},{},{}}}",
                entry("long", &[4], 4, 20),
                entry("inner", &[1], 12, 16),
                entry("first", &[1], 0, 4)
            ),
            ("long", "inner"),
        ),
    ] {
        let e = refused(&header, 20);
        assert!(
            e.contains(&format!("`{}`", pair.0)) && e.contains(&format!("`{}`", pair.1)),
            "{e}"
        );
        assert!(e.contains("overlap"), "{e}");
    }
}

#[test]
fn offsets_must_lie_in_the_data_section_and_match_the_shape() {
    let e = refused(&format!("{{{}}}", entry("a", &[2], 4, 12)), 8);
    assert!(
        e.contains("tensor a") && e.contains("past the data section of 8"),
        "{e}"
    );
    let e = refused(&format!("{{{}}}", entry("a", &[3], 0, 8)), 16);
    assert!(
        e.contains("tensor a") && e.contains("do not match its shape"),
        "{e}"
    );
    let e = refused(&format!("{{{}}}", entry("a", &[2], 8, 0)), 16);
    assert!(e.contains("do not match"), "{e}");
    // Sizes that overflow are refused, not wrapped around.
    let huge = usize::MAX - 4;
    let e = refused(&format!("{{{}}}", entry("a", &[1], huge, huge + 4)), 16);
    assert!(e.contains("past the data section"), "{e}");
    let e = refused(&format!("{{{}}}", entry("a", &[1 << 62, 4], 0, 16)), 16);
    assert!(e.contains("too large"), "{e}");
}

#[test]
fn a_key_given_twice_is_refused_naming_it() {
    let a = entry("a.weight", &[1], 0, 4);
    let e = refused(&format!("{{{a},{}}}", entry("a.weight", &[1], 4, 8)), 8);
    assert!(e.contains("`a.weight`") && e.contains("twice"), "{e}");
    // The same name spelt with an escape is the same key.
    let e = refused(
        &format!("{{{a},{}}}", entry(r"a.weigh\u0074", &[1], 4, 8)),
        8,
    );
    assert!(e.contains("`a.weight`") && e.contains("twice"), "{e}");
    let meta = r#""__metadata__":{"format":"pt"}"#;
    let e = refused(&format!("{{{meta},{a},{meta}}}"), 4);
    assert!(e.contains("`__metadata__`") && e.contains("twice"), "{e}");
    // A field given twice inside one entry is refused too.
    let e = refused(
        r#"{"a":{"dtype":"F32","dtype":"BF16","shape":[1],"data_offsets":[0,4]}}"#,
        4,
    );
    assert!(e.contains("`a`") && e.contains("duplicate field"), "{e}");
    let e = refused(r#"{"a":{"dtype":"F32","data_offsets":[0,4]}}"#, 4);
    assert!(e.contains("`a`") && e.contains("shape"), "{e}");
    let e = refused("[1, 2]", 4);
    assert!(e.contains("not a JSON object"), "{e}");
    assert!(parse(&format!("{{{meta},{a}}}"), 4)
        .unwrap()
        .contains("a.weight"));
}

/// A model folder holding two shards and the index naming them.
fn sharded(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvmesh-st-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    let t = |n: &str| (n.to_string(), vec![2], vec![1.0f32, 2.0]);
    write_file(&dir.join("one.safetensors"), &[t("a")], DType::F32).unwrap();
    write_file(&dir.join("sub/two.safetensors"), &[t("b")], DType::F32).unwrap();
    dir
}

fn write_index(dir: &Path, map: Value) {
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

#[test]
fn shard_index_names_only_files_inside_the_model_folder() {
    let dir = sharded("index");
    write_index(
        &dir,
        serde_json::json!({"a": "one.safetensors", "b": "sub/two.safetensors"}),
    );
    let w = WeightStore::open_dir(&dir).unwrap();
    assert_eq!(w.names(), ["a", "b"]);
    let outside = dir.file_name().unwrap().to_string_lossy().into_owned();
    for name in [
        "/etc/hostname".to_string(),
        "../one.safetensors".into(),
        format!("../{outside}/one.safetensors"),
        "sub/../one.safetensors".into(),
        "./one.safetensors".into(),
        String::new(),
    ] {
        write_index(&dir, serde_json::json!({"a": "one.safetensors", "b": name}));
        let e = WeightStore::open_dir(&dir).err().unwrap().to_string();
        assert!(
            e.contains("entry `b`") && e.contains("inside the model folder"),
            "{e}"
        );
        assert!(e.contains(&format!("{name:?}")), "{e}");
    }
    write_index(&dir, serde_json::json!({"a": "one.safetensors", "b": 2}));
    let e = WeightStore::open_dir(&dir).err().unwrap().to_string();
    assert!(
        e.contains("entry `b`") && e.contains("not a shard file name"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_tensor_in_two_shards_is_refused() {
    let dir = sharded("twice");
    let t = ("a".to_string(), vec![2], vec![3.0f32, 4.0]);
    write_file(&dir.join("sub/two.safetensors"), &[t], DType::F32).unwrap();
    write_index(
        &dir,
        serde_json::json!({"a": "one.safetensors", "b": "sub/two.safetensors"}),
    );
    let e = WeightStore::open_dir(&dir).err().unwrap().to_string();
    assert!(
        e.contains("`a`") && e.contains("one.safetensors") && e.contains("two.safetensors"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
