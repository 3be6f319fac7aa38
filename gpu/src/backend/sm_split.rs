//! `--sm-split`: a node's prefill and decode engines on one GPU, each on its own share of the
//! streaming multiprocessors (green contexts, `cuda/green.rs`). What the flag says is read
//! here, without a device; which SM counts a device can split into is decided by
//! [`SmSplit::resolve`] from the figures the driver reports, also without one, so every
//! refusal is unit-tested here.

use std::fmt;
use std::str::FromStr;

/// How the SMs are shared, as `--sm-split` gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SmSplit {
    /// `prefill:N`, `decode:N` or both: SM counts; a side left out gets the rest.
    Counts {
        prefill: Option<u32>,
        decode: Option<u32>,
    },
    /// A fraction of the SMs for prefill (`0.75`), in millionths so the type stays `Eq`.
    PrefillShare { ppm: u32 },
}

/// Which engine of the split a backend is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SmSide {
    Prefill,
    Decode,
}

/// One engine's part of a split: the split and its side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SmPartition {
    pub split: SmSplit,
    pub side: SmSide,
}

/// A split settled against a device: the group cut off by the driver (a count it can cut)
/// and the remainder, and which side each goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResolvedSplit {
    pub prefill: u32,
    pub decode: u32,
    /// The side whose count is the group the driver splits off; the other side gets the
    /// remaining SMs.
    pub cut: SmSide,
}

impl ResolvedSplit {
    pub fn count(&self, side: SmSide) -> u32 {
        match side {
            SmSide::Prefill => self.prefill,
            SmSide::Decode => self.decode,
        }
    }
}

/// What the driver says of the device's SMs (`CUdevSmResource`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SmFigures {
    pub total: u32,
    /// The smallest group the driver splits off (8 on Hopper).
    pub min_partition: u32,
    /// Groups are multiples of this (8 on Hopper).
    pub alignment: u32,
}

/// Why `--sm-split` cannot be read, or cannot split this device.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SmSplitError {
    #[error("--sm-split {0}: a share must be between 0 and 1 (both engines need SMs)")]
    Share(String),
    #[error("--sm-split {given}: `{part}` is not side:count; {FORM}")]
    NotSideCount { given: String, part: String },
    #[error("--sm-split {given}: `{count}` is not a positive SM count")]
    Count { given: String, count: String },
    #[error("--sm-split {given}: `{side}` is not prefill or decode; {FORM}")]
    Side { given: String, side: String },
    #[error("--sm-split {given}: `{side}` is given twice")]
    Twice { given: String, side: String },
    #[error("--sm-split {split}: no side is given")]
    NoSide { split: SmSplit },
    #[error(
        "--sm-split {split}: the counts add up to {sum} but {}: give counts that add up to \
         {}, or one side only",
        rule(.sm),
        .sm.total
    )]
    Sum {
        split: SmSplit,
        sum: u32,
        sm: SmFigures,
    },
    #[error("--sm-split {split}: {}", rule(.sm))]
    Device { split: SmSplit, sm: SmFigures },
}

const FORM: &str = "give SM counts (`prefill:96,decode:36`, or one side: `decode:32`, the \
                    other side taking the rest) or prefill's share of the SMs (`0.75`)";

/// What a device can split into, in words.
fn rule(sm: &SmFigures) -> String {
    format!(
        "this GPU has {} SMs and splits off groups of at least {} SMs in multiples of {}, \
         the other engine taking the rest",
        sm.total,
        sm.min_partition,
        sm.alignment.max(1)
    )
}

impl FromStr for SmSplit {
    type Err = SmSplitError;

    fn from_str(s: &str) -> Result<SmSplit, SmSplitError> {
        let given = || s.to_string();
        if let Ok(f) = s.parse::<f64>() {
            if !(f > 0.0 && f < 1.0) {
                return Err(SmSplitError::Share(given()));
            }
            return Ok(SmSplit::PrefillShare {
                ppm: (f * 1e6).round() as u32,
            });
        }
        let (mut prefill, mut decode) = (None, None);
        for part in s.split(',') {
            let (side, n) = part
                .split_once(':')
                .ok_or_else(|| SmSplitError::NotSideCount {
                    given: given(),
                    part: part.into(),
                })?;
            let count = n
                .trim()
                .parse()
                .ok()
                .filter(|&n: &u32| n > 0)
                .ok_or_else(|| SmSplitError::Count {
                    given: given(),
                    count: n.into(),
                })?;
            let slot = match side.trim() {
                "prefill" => &mut prefill,
                "decode" => &mut decode,
                other => {
                    return Err(SmSplitError::Side {
                        given: given(),
                        side: other.into(),
                    })
                }
            };
            if slot.replace(count).is_some() {
                return Err(SmSplitError::Twice {
                    given: given(),
                    side: side.into(),
                });
            }
        }
        Ok(SmSplit::Counts { prefill, decode })
    }
}

impl fmt::Display for SmSplit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SmSplit::PrefillShare { ppm } => write!(f, "{}", *ppm as f64 / 1e6),
            SmSplit::Counts { prefill, decode } => {
                let parts: Vec<String> = [("prefill", prefill), ("decode", decode)]
                    .into_iter()
                    .filter_map(|(n, c)| c.map(|c| format!("{n}:{c}")))
                    .collect();
                write!(f, "{}", parts.join(","))
            }
        }
    }
}

impl SmSplit {
    /// The counts each side gets on a device of `sm`, or why the device cannot be split so.
    /// The driver cuts one group off (at least `min_partition` SMs, a multiple of
    /// `alignment`) and leaves the rest, so one side's count must be such a group and the
    /// other side takes exactly the rest.
    pub fn resolve(&self, sm: SmFigures) -> Result<ResolvedSplit, SmSplitError> {
        let align = sm.alignment.max(1);
        let cuttable = |n: u32| n >= sm.min_partition && n.is_multiple_of(align) && n < sm.total;
        let device = || SmSplitError::Device { split: *self, sm };
        let pick = |cut: SmSide, n: u32| {
            let rest = sm.total - n;
            Ok(match cut {
                SmSide::Prefill => ResolvedSplit {
                    prefill: n,
                    decode: rest,
                    cut,
                },
                SmSide::Decode => ResolvedSplit {
                    prefill: rest,
                    decode: n,
                    cut,
                },
            })
        };
        match *self {
            SmSplit::PrefillShare { ppm } => {
                let want = sm.total as f64 * ppm as f64 / 1e6;
                // The nearest group the driver can cut, for prefill.
                let n = ((want / align as f64).round() as u32 * align).max(sm.min_partition);
                if !cuttable(n) {
                    return Err(device());
                }
                pick(SmSide::Prefill, n)
            }
            SmSplit::Counts { prefill, decode } => {
                if let (Some(p), Some(d)) = (prefill, decode) {
                    if p + d != sm.total {
                        return Err(SmSplitError::Sum {
                            split: *self,
                            sum: p + d,
                            sm,
                        });
                    }
                }
                match (prefill, decode) {
                    (Some(p), _) if cuttable(p) => pick(SmSide::Prefill, p),
                    (_, Some(d)) if cuttable(d) => pick(SmSide::Decode, d),
                    (None, None) => Err(SmSplitError::NoSide { split: *self }),
                    _ => Err(device()),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An H100 SXM as the driver describes it.
    const H100: SmFigures = SmFigures {
        total: 132,
        min_partition: 8,
        alignment: 8,
    };

    fn split(s: &str) -> SmSplit {
        s.parse().unwrap()
    }

    #[test]
    fn the_flag_reads_counts_and_shares() {
        assert_eq!(
            split("prefill:96,decode:36"),
            SmSplit::Counts {
                prefill: Some(96),
                decode: Some(36)
            }
        );
        assert_eq!(
            split("decode:32"),
            SmSplit::Counts {
                prefill: None,
                decode: Some(32)
            }
        );
        assert_eq!(split("0.75"), SmSplit::PrefillShare { ppm: 750_000 });
        for s in ["prefill:96,decode:36", "decode:32", "0.75"] {
            assert_eq!(split(s).to_string(), s, "round trip");
        }
        for (bad, why) in [
            ("1.5", "between 0 and 1"),
            ("0", "between 0 and 1"),
            ("prefill:0", "not a positive SM count"),
            ("prefill:x", "not a positive SM count"),
            ("cook:8", "not prefill or decode"),
            ("prefill", "is not side:count"),
            ("prefill:8,prefill:16", "given twice"),
        ] {
            let e = bad.parse::<SmSplit>().unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn splits_settle_to_a_group_the_driver_cuts_and_the_rest() {
        let r = split("prefill:96,decode:36").resolve(H100).unwrap();
        assert_eq!((r.prefill, r.decode, r.cut), (96, 36, SmSide::Prefill));
        // 36 is not a multiple of 8, 96 is: prefill is the group cut off either way round.
        let r = split("decode:36,prefill:96").resolve(H100).unwrap();
        assert_eq!(r.cut, SmSide::Prefill);
        let r = split("decode:32").resolve(H100).unwrap();
        assert_eq!((r.prefill, r.decode, r.cut), (100, 32, SmSide::Decode));
        // 0.75 of 132 is 99: the nearest multiple of 8 is 96.
        let r = split("0.75").resolve(H100).unwrap();
        assert_eq!((r.prefill, r.decode), (96, 36));
        assert_eq!(r.count(SmSide::Decode), 36);
        // The rest may be any size the cut leaves.
        let r = split("0.999").resolve(H100).unwrap();
        assert_eq!((r.prefill, r.decode), (128, 4));
    }

    #[test]
    fn splits_a_device_cannot_make_are_refused_with_its_figures() {
        for bad in [
            "prefill:90",
            "decode:4",
            "prefill:132",
            "prefill:100,decode:36",
        ] {
            let e = split(bad).resolve(H100).unwrap_err().to_string();
            assert!(e.contains("132 SMs"), "{bad}: {e}");
        }
        let e = split("prefill:100,decode:36").resolve(H100).unwrap_err();
        assert!(matches!(e, SmSplitError::Sum { sum: 136, .. }), "{e:?}");
        let e = e.to_string();
        assert!(e.contains("add up to 136"), "{e}");
        // Neither count is a group the driver cuts.
        let e = split("prefill:66,decode:66")
            .resolve(H100)
            .unwrap_err()
            .to_string();
        assert!(e.contains("multiples of 8"), "{e}");
    }
}
