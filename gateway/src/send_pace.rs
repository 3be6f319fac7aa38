//! The send timeout's account of a stalled client: a client whose socket is full (the
//! server's writes wait) must take its answer at [`MIN_SEND_RATE`] or better, averaged over
//! the stall, or be closed when the send timeout ends. Pure: driven by the bytes written and
//! the time, so tested on a made-up clock.

use std::time::Duration;

use tokio::time::Instant;

/// The slowest a client whose socket is full may take its answer, in bytes a second, averaged
/// over a stall: slower than this for the send timeout, and it is closed. A stream of tokens
/// is far less than this, and so never makes a socket full of a client that reads it.
pub const MIN_SEND_RATE: u64 = 1024;

/// A stall's account: since when the client has kept the server's writes waiting, and what
/// it has taken since.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SendPace {
    since: Instant,
    taken: u64,
}

impl SendPace {
    pub(crate) fn new(now: Instant) -> SendPace {
        SendPace {
            since: now,
            taken: 0,
        }
    }

    /// The client took `n` bytes at `now`: whether it has now caught up with
    /// [`MIN_SEND_RATE`] over the stall (which then ends).
    pub(crate) fn took(&mut self, n: usize, now: Instant) -> bool {
        self.taken += n as u64;
        let owed = MIN_SEND_RATE as f64 * now.saturating_duration_since(self.since).as_secs_f64();
        self.taken as f64 >= owed
    }

    /// Why a stall that lasted `after` ends the connection.
    pub(crate) fn verdict(&self, after: Duration) -> String {
        if self.taken == 0 {
            format!("the client took no byte of the answer for {after:?}")
        } else {
            format!(
                "the client took {} bytes of the answer in {after:?}, under {MIN_SEND_RATE} \
                 bytes a second",
                self.taken
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_keeping_up_ends_the_stall_a_trickle_does_not() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // Taking a socket's worth at once ends a stall at once.
        let mut p = SendPace::new(t0);
        assert!(p.took(65_536, at(10)));
        // 64 bytes every 1.5 s: never caught up, and the verdict says how little it took.
        let mut p = SendPace::new(t0);
        for i in 1..=20 {
            assert!(!p.took(64, at(1_500 * i)), "step {i}");
        }
        let why = p.verdict(Duration::from_secs(30));
        assert!(
            why.contains("1280 bytes") && why.contains("under 1024"),
            "{why}"
        );
        // Bursts after pauses count on average: 40 KiB after 30 s is enough.
        let mut p = SendPace::new(t0);
        assert!(!p.took(10_240, at(29_000)));
        assert!(p.took(30_720, at(30_000)));
        // Nothing taken at all.
        let p = SendPace::new(t0);
        assert!(p.verdict(Duration::from_secs(1)).contains("no byte"));
    }
}
