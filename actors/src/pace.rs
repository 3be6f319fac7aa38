//! How often workers and routers speak when nothing else is said, as the cluster grows.
//!
//! At a handful of workers a router hears each one's load five times a second and notices a
//! dead one in 0.7 s. At ten thousand that would be 50,000 reports and as many keep-alive
//! round trips a second for one router to absorb. So both paces stretch with the cluster:
//! they stay at their small-cluster values up to [`FULL_PACE_WORKERS`] workers, and beyond
//! it slow in proportion, so that what one router absorbs stays near
//! [`PER_ROUTER_PER_S`] of each kind however many workers there are.
//!
//! - A worker's load reports: every [`LOAD_EVERY`] at most, and only when something in the
//!   report changed (a report that would say nothing new waits, up to ten intervals).
//!   Workers count the cluster's workers from the registry.
//! - A router's heartbeat to each worker (a datagram, which the worker acknowledges at
//!   once; not QUIC's keep-alive, whose pace is fixed when a connection is dialed) and the
//!   silence after which it closes the connection ([`Beat::silent_after`]). Routers count
//!   the worker links they hold, and every link follows the count as it changes. Detecting a dead worker thus takes 0.7 s up
//!   to 1,000 workers, and proportionally longer beyond.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// The small-cluster interval of both load reports and heartbeats.
pub const LOAD_EVERY: Duration = Duration::from_millis(200);
/// Reports (and heartbeats) one router absorbs per second, at most, once the cluster is
/// larger than [`FULL_PACE_WORKERS`].
pub const PER_ROUTER_PER_S: u64 = 5_000;
/// Workers up to which the small-cluster pace holds.
pub const FULL_PACE_WORKERS: u64 = PER_ROUTER_PER_S * LOAD_EVERY.as_millis() as u64 / 1000;
/// The slowest pace, whatever the size.
const SLOWEST: Duration = Duration::from_secs(5);

/// The interval for `workers` workers: [`LOAD_EVERY`] up to [`FULL_PACE_WORKERS`], then in
/// proportion.
pub fn interval_for(workers: usize) -> Duration {
    let ms = (workers as u64 * 1000).div_ceil(PER_ROUTER_PER_S);
    Duration::from_millis(ms).clamp(LOAD_EVERY, SLOWEST)
}

/// A worker's load-report interval, following the cluster's size.
#[derive(Debug)]
pub struct ReportPace(AtomicU64);

impl Default for ReportPace {
    fn default() -> Self {
        ReportPace(AtomicU64::new(LOAD_EVERY.as_millis() as u64))
    }
}

impl ReportPace {
    /// The cluster has `workers` workers now.
    pub fn set_workers(&self, workers: usize) {
        self.0
            .store(interval_for(workers).as_millis() as u64, Ordering::Relaxed);
    }

    pub fn every(&self) -> Duration {
        Duration::from_millis(self.0.load(Ordering::Relaxed))
    }
}

/// Worker links this process's routers hold, for their heartbeat.
static LINKS: AtomicUsize = AtomicUsize::new(0);

/// A router's heartbeat on one worker connection: chosen when it dials, from the links the
/// process holds then.
#[derive(Clone, Copy, Debug)]
pub struct Beat(pub Duration);

impl Beat {
    pub fn now() -> Beat {
        Beat(interval_for(LINKS.load(Ordering::Relaxed)))
    }

    /// Nothing heard for this long (several missed beats; 0.7 s at the small-cluster pace)
    /// means the worker is gone.
    pub fn silent_after(self) -> Duration {
        self.0 * 7 / 2
    }
}

/// Counts one worker link for as long as it lives.
pub struct Link;

impl Link {
    pub fn held() -> Link {
        LINKS.fetch_add(1, Ordering::Relaxed);
        Link
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        LINKS.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pace_holds_to_a_thousand_workers_then_stretches_in_proportion() {
        assert_eq!(FULL_PACE_WORKERS, 1000);
        assert_eq!(interval_for(0), LOAD_EVERY);
        assert_eq!(interval_for(1000), LOAD_EVERY);
        assert_eq!(interval_for(2500), Duration::from_millis(500));
        assert_eq!(interval_for(10_000), Duration::from_secs(2));
        assert_eq!(interval_for(1_000_000), SLOWEST);
        // What a router absorbs stays bounded.
        for n in [10usize, 1000, 4000, 10_000, 20_000] {
            let per_s = n as f64 / interval_for(n).as_secs_f64();
            assert!(per_s <= PER_ROUTER_PER_S as f64 + 1.0, "{n}: {per_s}");
        }
        assert_eq!(Beat(LOAD_EVERY).silent_after(), Duration::from_millis(700));
    }
}
