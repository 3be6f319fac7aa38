//! `--cuda-options`: the CUDA backend's switches that are not the defaults yet (each is off
//! until a GPU run has measured it), so that `serve` and `node` can run what `gpu-bench`
//! measures, and a measured switch can be tried through the gateway before it becomes the
//! default. A list of names, comma-separated; a name it does not know, or one given twice, is
//! refused with the names it knows, never ignored.

use super::{CudaOptions, Pdl, UnknownPdl};

/// What `--cuda-options` takes, with what each does.
pub const CUDA_OPTIONS: [(&str, &str); 9] = [
    (
        "fuse-norms",
        "decode steps of 1-2 rows run each residual add and RMSNorm as the next product's prologue",
    ),
    (
        "fuse-rope",
        "decode steps normalise (q/k norms) and rotate q and k and write the new K/V in the q/k/v product's epilogue",
    ),
    (
        "prefill-graphs",
        "steps with prompts of up to 512 tokens replay piecewise CUDA graphs",
    ),
    (
        "gdn-scan",
        "Qwen3.5's Gated DeltaNet layers prefill through the scan path",
    ),
    (
        "gdn-chunked",
        "the same in the chunked form: chunks of 32 tokens as small matrix products",
    ),
    (
        "fp8-f32-out",
        "FP8 prefill GEMMs write f32 straight into the product",
    ),
    (
        "no-split-decode",
        "decode attention runs one block per head instead of splitting the history",
    ),
    (
        "pdl=auto|on|off",
        "programmatic dependent launch (auto: on for models reading under 8 GiB a step)",
    ),
    (
        "skinny-max-rows=N",
        "products of at most N rows (0-8) stream the weights through the skinny kernels",
    ),
];

/// A `--cuda-options` list the backend cannot take.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CudaOptionsError {
    #[error("--cuda-options: `{0}` is not an option; the options are {known}", known = known())]
    Unknown(String),
    #[error("--cuda-options: `{0}` is given twice")]
    Twice(String),
    #[error("--cuda-options: pdl={0}")]
    Pdl(#[from] UnknownPdl),
    #[error("--cuda-options: skinny-max-rows={0}: expected a whole number from 0 to 8")]
    SkinnyRows(String),
}

fn known() -> String {
    CUDA_OPTIONS
        .iter()
        .map(|(name, _)| *name)
        .collect::<Vec<_>>()
        .join(", ")
}

impl CudaOptions {
    /// The switches that differ from the defaults, as `--cuda-options` spells them (for the
    /// backend's start-up log); empty when none does.
    pub fn switches(&self) -> String {
        let d = CudaOptions::device(self.ordinal);
        let mut on: Vec<String> = [
            (self.fuse_norms, "fuse-norms"),
            (self.fuse_rope, "fuse-rope"),
            (self.prefill_graphs, "prefill-graphs"),
            (self.gdn_scan, "gdn-scan"),
            (self.gdn_chunked, "gdn-chunked"),
            (self.fp8_f32_out, "fp8-f32-out"),
            (self.fp8_mma, "fp8-mma"),
            (!self.split_decode, "no-split-decode"),
        ]
        .into_iter()
        .filter(|&(set, _)| set)
        .map(|(_, name)| name.to_string())
        .collect();
        if self.pdl != d.pdl {
            on.push(format!("pdl={}", format!("{:?}", self.pdl).to_lowercase()));
        }
        if self.skinny_max_rows != d.skinny_max_rows {
            on.push(format!("skinny-max-rows={}", self.skinny_max_rows));
        }
        on.join(",")
    }

    /// Turns on the switches `list` names (`--cuda-options`, e.g.
    /// `fuse-norms,fuse-rope,pdl=off`). Blank entries are skipped; anything else it does not
    /// know is an error, and so is a name given twice.
    pub fn apply_list(&mut self, list: &str) -> Result<(), CudaOptionsError> {
        let mut seen: Vec<&str> = Vec::new();
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, value) = match item.split_once('=') {
                Some((n, v)) => (n.trim(), Some(v.trim())),
                None => (item, None),
            };
            if seen.contains(&name) {
                return Err(CudaOptionsError::Twice(name.to_string()));
            }
            seen.push(name);
            match (name, value) {
                ("fuse-norms", None) => self.fuse_norms = true,
                ("fuse-rope", None) => self.fuse_rope = true,
                ("prefill-graphs", None) => self.prefill_graphs = true,
                ("gdn-scan", None) => self.gdn_scan = true,
                ("gdn-chunked", None) => self.gdn_chunked = true,
                ("fp8-f32-out", None) => self.fp8_f32_out = true,
                ("fp8-mma", None) => self.fp8_mma = true,
                ("no-split-decode", None) => self.split_decode = false,
                ("pdl", Some(v)) => self.pdl = v.parse::<Pdl>()?,
                ("skinny-max-rows", Some(v)) => {
                    self.skinny_max_rows = v
                        .parse::<usize>()
                        .ok()
                        .filter(|&n| n <= 8)
                        .ok_or_else(|| CudaOptionsError::SkinnyRows(v.to_string()))?;
                }
                _ => return Err(CudaOptionsError::Unknown(item.to_string())),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_name_sets_its_switch_and_nothing_else() {
        let base = CudaOptions::device(0);
        let mut o = base;
        o.apply_list(
            " fuse-norms, fuse-rope,prefill-graphs,gdn-scan,gdn-chunked,fp8-f32-out,fp8-mma,\
             no-split-decode,pdl=off,skinny-max-rows=2,",
        )
        .unwrap();
        assert!(o.fuse_norms && o.fuse_rope && o.prefill_graphs && o.gdn_scan && o.fp8_f32_out);
        assert!(o.gdn_chunked && o.fp8_mma);
        assert!(!o.split_decode);
        assert_eq!((o.pdl, o.skinny_max_rows), (Pdl::Off, 2));
        // What the list does not name keeps its default.
        assert_eq!((o.ordinal, o.graphs), (base.ordinal, base.graphs));
        let mut empty = base;
        empty.apply_list("").unwrap();
        assert_eq!(empty, base);
        assert_eq!(
            o.switches(),
            "fuse-norms,fuse-rope,prefill-graphs,gdn-scan,gdn-chunked,fp8-f32-out,fp8-mma,\
             no-split-decode,pdl=off,skinny-max-rows=2"
        );
        assert_eq!(base.switches(), "");
        let mut one = base;
        one.apply_list("fuse-rope").unwrap();
        assert_eq!(
            one,
            CudaOptions {
                fuse_rope: true,
                ..base
            }
        );
    }

    #[test]
    fn unknown_repeated_and_malformed_entries_are_refused_by_name() {
        let mut o = CudaOptions::device(0);
        let e = o.apply_list("fuse-norms,fuse_rope").unwrap_err();
        assert_eq!(e, CudaOptionsError::Unknown("fuse_rope".into()));
        let msg = e.to_string();
        assert!(msg.contains("`fuse_rope` is not an option"), "{msg}");
        assert!(
            msg.contains("fuse-rope") && msg.contains("pdl=auto|on|off"),
            "{msg}"
        );
        assert_eq!(
            CudaOptions::device(0)
                .apply_list("gdn-scan,gdn-scan")
                .unwrap_err(),
            CudaOptionsError::Twice("gdn-scan".into())
        );
        assert!(matches!(
            CudaOptions::device(0).apply_list("pdl=maybe").unwrap_err(),
            CudaOptionsError::Pdl(_)
        ));
        for bad in [
            "skinny-max-rows=9",
            "skinny-max-rows=-1",
            "skinny-max-rows=",
        ] {
            assert!(
                matches!(
                    CudaOptions::device(0).apply_list(bad).unwrap_err(),
                    CudaOptionsError::SkinnyRows(_)
                ),
                "{bad}"
            );
        }
        // A switch with a value, and a value option without one, are not options.
        for bad in ["fuse-norms=1", "pdl"] {
            assert!(
                matches!(
                    CudaOptions::device(0).apply_list(bad).unwrap_err(),
                    CudaOptionsError::Unknown(_)
                ),
                "{bad}"
            );
        }
    }
}
