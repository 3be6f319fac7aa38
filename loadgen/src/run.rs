//! One benchmark run: every sample sent under one load (a concurrency or a request rate),
//! with the wall time it took.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use super::client::{self, Target};
use super::dataset::Sample;
use super::metrics::Outcome;
use super::schedule;

/// How hard a run pushes the server.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum Load {
    /// A fixed number of requests in flight: a new one is sent as soon as one finishes.
    Concurrency { concurrency: usize },
    /// Requests arrive on a schedule, whether or not the server keeps up.
    RequestRate {
        #[serde(with = "inf_as_string")]
        request_rate: f64,
        burstiness: f64,
        max_concurrency: Option<usize>,
    },
}

/// What a sweep varies, the x axis of its charts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Axis {
    Concurrency,
    RequestRate,
}

impl Axis {
    pub fn title(self) -> &'static str {
        match self {
            Axis::Concurrency => "concurrency",
            Axis::RequestRate => "request rate (req/s)",
        }
    }
}

impl Load {
    pub fn axis(&self) -> Axis {
        match self {
            Load::Concurrency { .. } => Axis::Concurrency,
            Load::RequestRate { .. } => Axis::RequestRate,
        }
    }

    /// The value on the sweep's axis (infinite for an unlimited rate).
    pub fn x(&self) -> f64 {
        match *self {
            Load::Concurrency { concurrency } => concurrency as f64,
            Load::RequestRate { request_rate, .. } => request_rate,
        }
    }

    /// A short name for file names: `c4`, `rate2.5`, `rate-inf`.
    pub fn file_stem(&self) -> String {
        match *self {
            Load::Concurrency { concurrency } => format!("c{concurrency}"),
            Load::RequestRate { request_rate, .. } => format!("rate{}", fmt_x(request_rate)),
        }
    }

    fn limit(&self) -> Option<usize> {
        match *self {
            Load::Concurrency { concurrency } => Some(concurrency),
            Load::RequestRate {
                max_concurrency, ..
            } => max_concurrency,
        }
    }
}

impl fmt::Display for Load {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Load::Concurrency { concurrency } => write!(f, "concurrency {concurrency}"),
            Load::RequestRate {
                request_rate,
                burstiness,
                max_concurrency,
            } => {
                write!(f, "request rate {} req/s", fmt_x(request_rate))?;
                if burstiness != 1.0 && request_rate.is_finite() {
                    write!(f, ", burstiness {burstiness}")?;
                }
                if let Some(c) = max_concurrency {
                    write!(f, ", at most {c} in flight")?;
                }
                Ok(())
            }
        }
    }
}

/// An axis value as people write it: `4`, `2.5`, `inf`.
pub fn fmt_x(x: f64) -> String {
    if x.is_infinite() {
        "inf".into()
    } else {
        format!("{x}")
    }
}

/// Sends every sample under `load` and waits for all of them. Returns each sample's outcome
/// (in sample order) and the run's wall time, from the first send to the last response.
pub async fn run(
    http: &reqwest::Client,
    target: &Target,
    samples: &Arc<Vec<Sample>>,
    load: Load,
    seed: u64,
    bar: &ProgressBar,
) -> (Vec<Outcome>, f64) {
    let arrivals = match load {
        Load::Concurrency { .. } => vec![0.0; samples.len()],
        Load::RequestRate {
            request_rate,
            burstiness,
            ..
        } => schedule::arrival_times(samples.len(), request_rate, burstiness, seed),
    };
    // Permits are taken here, in arrival order, before a request is sent (tokio's semaphore
    // is fair), so the cap on requests in flight holds exactly and none jumps the queue.
    let permits = load.limit().map(|n| Arc::new(Semaphore::new(n)));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(samples.len());
    for (i, at) in arrivals.into_iter().enumerate() {
        tokio::time::sleep_until((start + Duration::from_secs_f64(at)).into()).await;
        let permit = match &permits {
            Some(p) => Some(p.clone().acquire_owned().await.expect("never closed")),
            None => None,
        };
        let (http, target, samples, bar) =
            (http.clone(), target.clone(), samples.clone(), bar.clone());
        tasks.push(tokio::spawn(async move {
            let s = &samples[i];
            let outcome = client::send(&http, &target, s, s.output_len).await;
            drop(permit);
            bar.inc(1);
            outcome
        }));
    }
    let mut outcomes = Vec::with_capacity(tasks.len());
    for t in tasks {
        outcomes.push(
            t.await
                .unwrap_or_else(|e| Outcome::failed(format!("request task failed: {e}"), 0.0)),
        );
    }
    (outcomes, start.elapsed().as_secs_f64())
}

/// JSON has no infinity: an unlimited rate is written `"inf"`.
mod inf_as_string {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        if v.is_infinite() {
            s.serialize_str("inf")
        } else {
            s.serialize_f64(*v)
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum NumOrText {
            Num(f64),
            Text(String),
        }
        match NumOrText::deserialize(d)? {
            NumOrText::Num(n) => Ok(n),
            NumOrText::Text(t) => t
                .parse()
                .map_err(|_| serde::de::Error::custom(format!("not a rate: {t:?}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_round_trip_through_json_with_inf_as_text() {
        for load in [
            Load::Concurrency { concurrency: 4 },
            Load::RequestRate {
                request_rate: f64::INFINITY,
                burstiness: 1.0,
                max_concurrency: Some(8),
            },
            Load::RequestRate {
                request_rate: 2.5,
                burstiness: 0.5,
                max_concurrency: None,
            },
        ] {
            let j = serde_json::to_string(&load).unwrap();
            assert_eq!(serde_json::from_str::<Load>(&j).unwrap(), load, "{j}");
        }
        let j = serde_json::to_value(Load::RequestRate {
            request_rate: f64::INFINITY,
            burstiness: 1.0,
            max_concurrency: None,
        })
        .unwrap();
        assert_eq!(j["mode"], "request_rate");
        assert_eq!(j["request_rate"], "inf");
        assert_eq!(
            Load::RequestRate {
                request_rate: 2.5,
                burstiness: 0.5,
                max_concurrency: Some(3)
            }
            .to_string(),
            "request rate 2.5 req/s, burstiness 0.5, at most 3 in flight"
        );
        assert_eq!(Load::Concurrency { concurrency: 4 }.file_stem(), "c4");
    }
}
